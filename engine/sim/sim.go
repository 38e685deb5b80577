// Package sim is an engine.Engine whose forward pass costs simulated time instead of
// compute, so that many shoal nodes (the real scheduler, kvcache, API and cluster
// code) can run on one machine for routing experiments. The time of a pass comes
// from a Profile measured on engine/llama by `shoal calibrate`:
//
//	step = Base + PerToken·tokens + PerAttend·Σ(row positions)/1000
//
// (a fixed cost, the matrix work per token, and attention over each row's context).
// Tokens are bytes; the next token is a deterministic function of the sequence's last
// token and position, so outputs are reproducible. Memory is tracked per sequence as a
// position range, enough for the scheduler's operations.
//
// Concurrency: as engine.Engine: one owner goroutine; Abort from any goroutine.
package sim

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"hash/fnv"
	"math"
	"os"
	"sync/atomic"
	"time"

	"github.com/shoal-ai/shoal/engine"
)

// Profile is a calibrated time model of one model on one machine.
type Profile struct {
	Model       string  `json:"model"`
	Machine     string  `json:"machine"`
	Threads     int     `json:"threads"`
	BaseUS      float64 `json:"base_us"`       // fixed cost of a pass, microseconds
	PerTokenUS  float64 `json:"per_token_us"`  // per batch token
	PerAttendUS float64 `json:"per_attend_us"` // per 1,000 attended positions
	// Samples are the measurements the coefficients were fitted to.
	Samples []Sample `json:"samples,omitempty"`
}

// Sample is one measured pass: tokens in the batch, their summed positions, time.
type Sample struct {
	Tokens  int     `json:"tokens"`
	PosSum  int64   `json:"pos_sum"`
	Seconds float64 `json:"seconds"`
}

// Step is the modelled duration of a pass.
func (p Profile) Step(tokens int, posSum int64) time.Duration {
	us := p.BaseUS + p.PerTokenUS*float64(tokens) + p.PerAttendUS*float64(posSum)/1000
	return time.Duration(max(us, 0) * float64(time.Microsecond))
}

// Fit sets the coefficients by least squares over the samples, none negative:
// on a noisy machine the unconstrained fit can make a term negative (longer
// contexts cheaper), which no engine is; then the best fit without it is taken
// (non-negative least squares, by trying each set of terms).
func (p *Profile) Fit() error {
	if len(p.Samples) < 3 {
		return errors.New("sim: need at least 3 samples to fit")
	}
	// y = a + b·x1 + c·x2, each sample weighted by 1/y so that relative errors
	// count: a 5 ms decode step matters as much as a 400 ms prefill.
	rows := make([][4]float64, len(p.Samples)) // weighted 1, x1, x2, y
	for i, s := range p.Samples {
		y := s.Seconds * 1e6
		w := 1 / max(y, 1)
		rows[i] = [4]float64{w, w * float64(s.Tokens), w * float64(s.PosSum) / 1000, w * y}
	}
	best, bestErr, determined := [3]float64{}, math.Inf(1), false
	for set := 1; set < 1<<3; set++ {
		coef, ok := fitTerms(rows, set)
		if !ok {
			continue
		}
		if set == 1<<3-1 {
			determined = true
		}
		if min(coef[0], coef[1], coef[2]) < 0 {
			continue
		}
		var sq float64
		for _, r := range rows {
			d := r[0]*coef[0] + r[1]*coef[1] + r[2]*coef[2] - r[3]
			sq += d * d
		}
		if sq < bestErr {
			best, bestErr = coef, sq
		}
	}
	if !determined || math.IsInf(bestErr, 1) {
		return errors.New("sim: samples do not determine the model (vary batch size and context)")
	}
	p.BaseUS, p.PerTokenUS, p.PerAttendUS = best[0], best[1], best[2]
	return nil
}

// fitTerms solves the weighted least squares over rows for the terms in set
// (bit i: coefficient i; the others 0) by its normal equations; ok is false
// when the samples do not determine them.
func fitTerms(rows [][4]float64, set int) (coef [3]float64, ok bool) {
	var idx []int
	for i := range 3 {
		if set&(1<<i) != 0 {
			idx = append(idx, i)
		}
	}
	n := len(idx)
	m := make([][]float64, n) // n×(n+1) augmented
	for a := range n {
		m[a] = make([]float64, n+1)
		for _, r := range rows {
			for b := range n {
				m[a][b] += r[idx[a]] * r[idx[b]]
			}
			m[a][n] += r[idx[a]] * r[3]
		}
	}
	for c := range n { // Gauss-Jordan with partial pivoting
		piv := c
		for r := c + 1; r < n; r++ {
			if math.Abs(m[r][c]) > math.Abs(m[piv][c]) {
				piv = r
			}
		}
		m[c], m[piv] = m[piv], m[c]
		if math.Abs(m[c][c]) < 1e-12 {
			return coef, false
		}
		for r := range n {
			if r != c {
				f := m[r][c] / m[c][c]
				for k := c; k <= n; k++ {
					m[r][k] -= f * m[c][k]
				}
			}
		}
	}
	for a, i := range idx {
		coef[i] = m[a][n] / m[a][a]
	}
	return coef, true
}

// Load reads a profile written by `shoal calibrate`.
func Load(path string) (Profile, error) {
	var p Profile
	b, err := os.ReadFile(path)
	if err != nil {
		return p, fmt.Errorf("sim profile: %w", err)
	}
	if err := json.Unmarshal(b, &p); err != nil {
		return p, fmt.Errorf("sim profile %s: %w", path, err)
	}
	if p.Model == "" || p.BaseUS < 0 || p.PerTokenUS < 0 || p.PerAttendUS < 0 {
		return p, fmt.Errorf("sim profile %s: missing model or negative coefficients", path)
	}
	return p, nil
}

// Config sizes the simulated context.
type Config struct {
	Cells, MaxSeqs, BatchTokens int
	Unified                     bool
	// Speed divides every step time (2 runs twice as fast as the profile).
	Speed float64
}

// Engine is the simulated engine.
type Engine struct {
	p      Profile
	cfg    Config
	cap    engine.Capacity
	seqs   map[engine.SeqID]*span
	logits map[int][]float32
	vocab  vocab
	abort  atomic.Bool
	closed atomic.Bool
}

type span struct{ lo, hi engine.Pos } // positions lo..hi held; hi < lo: empty

var _ engine.Engine = (*Engine)(nil)

// New returns a simulated engine.
func New(p Profile, cfg Config) (*Engine, error) {
	if cfg.Cells < 16 || cfg.MaxSeqs < 1 || cfg.BatchTokens < 1 {
		return nil, errors.New("sim: cells, sequences and batch must be positive")
	}
	if cfg.Speed <= 0 {
		cfg.Speed = 1
	}
	// llama.cpp's sizes: the context padded to 256 cells, and with one stream per
	// sequence each stream padded to 256 (so --ctx-size 8192 --parallel 128 is
	// 128 streams of 256).
	cells := pad256(cfg.Cells)
	per := cells
	if !cfg.Unified {
		per = pad256(cfg.Cells / cfg.MaxSeqs)
		cells = per * cfg.MaxSeqs
	}
	return &Engine{p: p, cfg: cfg, seqs: map[engine.SeqID]*span{}, vocab: vocab{n: 256 + 3},
		cap: engine.Capacity{Cells: cells, CellsPerSeq: per, MaxSeqs: cfg.MaxSeqs, BatchTokens: cfg.BatchTokens,
			Unified: cfg.Unified, PrefixReuse: true, PrefixSharing: cfg.Unified}}, nil
}

func pad256(n int) int { return (n + 255) / 256 * 256 }

func (e *Engine) Info() engine.ModelInfo {
	return engine.ModelInfo{Name: e.p.Model, Architecture: "sim", VocabSize: e.vocab.n, TrainedContext: e.cap.CellsPerSeq, HasChatTemplate: true, ChatTemplate: "chatml"}
}
func (e *Engine) Capacity() engine.Capacity { return e.cap }
func (e *Engine) Vocab() engine.Vocab       { return e.vocab }
func (e *Engine) Abort()                    { e.abort.Store(true) }
func (e *Engine) Close() error              { e.closed.Store(true); return nil }
func (e *Engine) Embeddings(engine.SeqID) ([]float32, error) {
	return nil, engine.ErrUnsupported
}
func (e *Engine) NewGrammar(string, []engine.Trigger) (engine.Grammar, error) {
	return nil, engine.ErrUnsupported
}

// Decode validates the batch, waits the modelled time and produces logits.
func (e *Engine) Decode(ctx context.Context, b *engine.Batch) error {
	if e.closed.Load() {
		return engine.ErrClosed
	}
	n := b.Len()
	if b.Adapter != 0 {
		return fmt.Errorf("sim: adapter %d: a simulated engine has none: %w", b.Adapter, engine.ErrInvalidInput)
	}
	if err := b.Check(e.cap, e.vocab.n, 0, func(s engine.SeqID) (engine.Pos, bool) {
		_, hi, ok := e.SeqPosRange(s)
		return hi, ok
	}); err != nil {
		return fmt.Errorf("sim: %w", err)
	}
	var posSum int64
	for _, p := range b.Pos {
		posSum += int64(p)
	}
	d := time.Duration(float64(e.p.Step(n, posSum)) / e.cfg.Speed)
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
	case <-ctx.Done():
		return fmt.Errorf("sim decode: %w: %w", engine.ErrAborted, ctx.Err())
	}
	if e.abort.Swap(false) {
		return engine.ErrAborted
	}
	e.logits = map[int][]float32{}
	for i := range n {
		s := e.seqs[b.Seq[i]]
		if s == nil || s.hi < s.lo {
			e.seqs[b.Seq[i]] = &span{lo: b.Pos[i], hi: b.Pos[i]}
		} else {
			s.hi = max(s.hi, b.Pos[i])
			s.lo = min(s.lo, b.Pos[i])
		}
		if b.Output[i] {
			e.logits[i] = e.next(b.Tokens[i], b.Pos[i])
		}
	}
	return nil
}

func (e *Engine) next(t engine.Token, p engine.Pos) []float32 {
	h := fnv.New32a()
	fmt.Fprint(h, t, ",", p)
	l := make([]float32, e.vocab.n)
	// A lower-case letter, so far above the rest (all 0) that no sampling setting
	// picks another token: at 10, temperature 1 sampled one of the other 4,095
	// tokens of a 4,096-token vocabulary about one time in six (4,095 / (e¹⁰ +
	// 4,095)): some are byte tokens, whose text is not UTF-8.
	l[3+'a'+int(h.Sum32()%26)] = 100
	return l
}

func (e *Engine) Logits(i int, fn func([]float32)) error {
	l, ok := e.logits[i]
	if !ok {
		return fmt.Errorf("sim: row %d has no logits: %w", i, engine.ErrInvalidInput)
	}
	fn(l)
	return nil
}

func (e *Engine) checkSeq(s engine.SeqID) error {
	if s < 0 || int(s) >= e.cap.MaxSeqs {
		return fmt.Errorf("sim: sequence %d: %w", s, engine.ErrInvalidInput)
	}
	return nil
}

func (e *Engine) SeqRemove(s engine.SeqID, p0, p1 engine.Pos) error {
	if s >= 0 {
		if err := e.checkSeq(s); err != nil {
			return err
		}
	}
	if s < 0 {
		e.seqs = map[engine.SeqID]*span{}
		return nil
	}
	sp := e.seqs[s]
	if sp == nil {
		return nil
	}
	if p1 < 0 {
		p1 = math.MaxInt32
	}
	switch {
	case p0 <= sp.lo && p1 > sp.hi:
		delete(e.seqs, s)
	case p0 <= sp.lo:
		sp.lo = max(sp.lo, p1)
	case p1 > sp.hi:
		sp.hi = min(sp.hi, p0-1)
	}
	return nil
}

func (e *Engine) SeqCopy(src, dst engine.SeqID, p0, p1 engine.Pos) error {
	if err := e.checkSeq(src); err != nil {
		return err
	}
	if err := e.checkSeq(dst); err != nil {
		return err
	}
	if !e.cfg.Unified {
		if p0 > 0 || p1 >= 0 { // llama.cpp copies only whole streams (and aborts otherwise)
			return fmt.Errorf("sim: partial copy between streams: %w", engine.ErrUnsupported)
		}
		delete(e.seqs, dst) // a stream copy replaces the destination
	}
	sp := e.seqs[src]
	if sp == nil {
		return nil
	}
	if p1 < 0 {
		p1 = math.MaxInt32
	}
	lo, hi := max(sp.lo, max(p0, 0)), min(sp.hi, p1-1)
	if hi < lo {
		return nil
	}
	if d := e.seqs[dst]; d != nil && d.hi >= d.lo && e.cfg.Unified {
		d.lo, d.hi = min(d.lo, lo), max(d.hi, hi)
	} else {
		e.seqs[dst] = &span{lo: lo, hi: hi}
	}
	return nil
}

func (e *Engine) SeqKeep(s engine.SeqID) error {
	for k := range e.seqs {
		if k != s {
			delete(e.seqs, k)
		}
	}
	return nil
}

func (e *Engine) SeqShift(engine.SeqID, engine.Pos, engine.Pos, engine.Pos) error {
	return engine.ErrUnsupported
}

func (e *Engine) SeqPosRange(s engine.SeqID) (lo, hi engine.Pos, ok bool) {
	sp := e.seqs[s]
	if sp == nil || sp.hi < sp.lo {
		return 0, 0, false
	}
	return sp.lo, sp.hi, true
}

func (e *Engine) ClearMemory() error { e.seqs = map[engine.SeqID]*span{}; return nil }
