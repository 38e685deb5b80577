// Package enginetest provides a deterministic engine.Engine for tests of the packages
// above the engine (scheduler, api, cluster) that must not compile llama.cpp.
package enginetest

import (
	"cmp"
	"context"
	"fmt"
	"hash/fnv"
	"slices"
	"sync"
	"time"

	"github.com/shoal-ai/shoal/engine"
)

// Fake is a deterministic engine.Engine: the next token of a sequence is a hash
// of the tokens its KV memory holds at positions 0..pos, so any mistake in sharing,
// eviction or preemption changes the output. It models llama.cpp's unified cells to
// check that the scheduler never needs more cells than exist, and refuses what
// engine/llama refuses (ids and tokens out of range, positions that do not follow,
// partial copies between streams), leaving memory untouched, so that a test cannot
// pass on behaviour the real engine would reject.
type Fake struct {
	vocab  Vocab
	cap    engine.Capacity
	cells  []*cell
	logits map[int][]float32 // output rows of the last decode
	Delay  time.Duration
	EOSAt  int // if > 0, EOS once a sequence reaches this length
	// Period, if > 0, makes a sequence repeat itself: the token after
	// position p is the one at p+1-Period (from Period tokens on), as a model
	// copying text it has seen does.
	Period int
	// Adapters is how many LoRA adapters a batch may select (Batch.Adapter):
	// a cell computed under one holds other "KV", and a row's logits depend on
	// the adapters its sequence's cells were computed under and its own.
	Adapters int
	// EmbdWidth is the model's embedding width (8 from New): batches may
	// hold embedding rows of this many values (an image's, engine.Batch.Embd),
	// whose "KV" is their placeholder token's, as the prefix cache keys them.
	EmbdWidth int
	// Rerank, when set, makes the fake a reranker (ModelInfo.Rerank): Embeddings
	// gives one score in (0, 1), a hash of the tokens the sequence holds.
	Rerank *engine.RerankLayout
	// MRoPE makes the fake place images as an M-RoPE engine does
	// (engine.Capacity.MRoPE): an image's rows share a position, each at its
	// line and column (Batch.Grid), which a row's logits depend on; a
	// sequence's positions jump past its images. Two cells of a sequence at
	// one place (position, line, column) fail the Decode.
	MRoPE   bool
	mu      sync.Mutex
	batches []BatchStats
	Failing func(b *engine.Batch) error
	aborted bool // Abort: the next Decode returns ErrAborted
}

type cell struct {
	pos     engine.Pos
	y, x    engine.Pos // with MRoPE, an image row's line and column
	tok     engine.Token
	adapter int
	seqs    map[engine.SeqID]bool
}

// BatchStats describes one decoded batch.
type BatchStats struct {
	Rows    int                  // tokens in the batch
	Seqs    map[engine.SeqID]int // rows per sequence
	Outputs int                  // rows that asked for logits
}

func New(cells, seqs, batch int) *Fake {
	return &Fake{
		vocab:     Vocab{n: 64, fim: engine.NoFIM},
		cap:       engine.Capacity{Cells: cells, CellsPerSeq: cells, MaxSeqs: seqs, BatchTokens: batch, Unified: true, PrefixReuse: true, PrefixSharing: true},
		EmbdWidth: 8,
	}
}

func (f *Fake) Info() engine.ModelInfo {
	return engine.ModelInfo{Name: "fake", VocabSize: f.vocab.n, EmbeddingSize: f.EmbdWidth, Rerank: f.Rerank,
		Devices: []engine.Device{{Name: "CPU", Description: "fake", Kind: "cpu"}}}
}
func (f *Fake) Capacity() engine.Capacity {
	c := f.cap
	c.MRoPE = f.MRoPE
	return c
}
func (f *Fake) Vocab() engine.Vocab { return f.vocab }
func (f *Fake) Abort()              { f.mu.Lock(); f.aborted = true; f.mu.Unlock() }
func (f *Fake) Close() error        { return nil }

// Embeddings is a reranker's score (Rerank); the fake pools no embedding.
func (f *Fake) Embeddings(s engine.SeqID) ([]float32, error) {
	if f.Rerank == nil {
		return nil, engine.ErrUnsupported
	}
	h := fnv.New32a()
	for _, c := range f.cells {
		if c.seqs[s] {
			fmt.Fprint(h, c.pos, ":", c.tok, ",")
		}
	}
	return []float32{(float32(h.Sum32()%1000) + 0.5) / 1000}, nil
}

func (f *Fake) NewGrammar(string, []engine.Trigger) (engine.Grammar, error) {
	return nil, engine.ErrUnsupported
}

func (f *Fake) Decode(ctx context.Context, b *engine.Batch) error {
	if f.Failing != nil {
		if err := f.Failing(b); err != nil {
			return err
		}
	}
	f.mu.Lock()
	aborted := f.aborted
	f.aborted = false
	f.mu.Unlock()
	if aborted || ctx.Err() != nil {
		return fmt.Errorf("fake: %w", engine.ErrAborted)
	}
	if b.Adapter < 0 || b.Adapter > f.Adapters {
		return fmt.Errorf("fake: adapter %d of %d: %w", b.Adapter, f.Adapters, engine.ErrInvalidInput)
	}
	if err := b.Check(f.Capacity(), f.vocab.n, f.EmbdWidth, func(s engine.SeqID) (engine.Pos, bool) {
		_, hi, ok := f.SeqPosRange(s)
		return hi, ok
	}); err != nil {
		return fmt.Errorf("fake: %w", err)
	}
	if len(f.cells)+b.Len() > f.cap.Cells {
		return engine.ErrNoKVSpace
	}
	if !f.cap.Unified {
		per := map[engine.SeqID]int{}
		for _, s := range b.Seq {
			per[s]++
		}
		for s, n := range per {
			have := 0
			for _, c := range f.cells {
				if c.seqs[s] {
					have++
				}
			}
			if have+n > f.cap.CellsPerSeq {
				return fmt.Errorf("fake: stream %d over capacity: %w", s, engine.ErrNoKVSpace)
			}
		}
	}
	if f.Delay > 0 {
		select {
		case <-time.After(f.Delay):
		case <-ctx.Done():
			return engine.ErrAborted
		}
	}
	fb := BatchStats{Rows: b.Len(), Seqs: map[engine.SeqID]int{}}
	n := len(f.cells)
	for i := range b.Len() {
		s := b.Seq[i]
		y, x := b.At(i)
		f.cells = append(f.cells, &cell{pos: b.Pos[i], y: y, x: x, tok: b.Tokens[i], adapter: b.Adapter, seqs: map[engine.SeqID]bool{s: true}})
		fb.Seqs[s]++
	}
	f.logits = map[int][]float32{}
	for i := range b.Len() {
		if !b.Output[i] {
			continue
		}
		fb.Outputs++
		if f.MRoPE {
			l, err := f.nextPlaced(b.Seq[i], b.Pos[i], b.Adapter)
			if err != nil {
				f.cells = f.cells[:n]
				return err
			}
			f.logits[i] = l
			continue
		}
		f.logits[i] = f.next(b.Seq[i], b.Pos[i], b.Adapter)
	}
	f.mu.Lock()
	f.batches = append(f.batches, fb)
	f.mu.Unlock()
	return nil
}

func (f *Fake) checkSeq(s engine.SeqID) error {
	if s < 0 || int(s) >= f.cap.MaxSeqs {
		return fmt.Errorf("fake: sequence %d out of range: %w", s, engine.ErrInvalidInput)
	}
	return nil
}

// next computes logits from the tokens seq s holds at positions 0..pos, and
// the adapters they and the row were computed under.
func (f *Fake) next(s engine.SeqID, pos engine.Pos, adapter int) []float32 {
	toks := make([]engine.Token, pos+1)
	under := make([]int, pos+1)
	seen := make([]bool, pos+1)
	for _, c := range f.cells {
		if c.seqs[s] && c.pos <= pos {
			toks[c.pos], under[c.pos], seen[c.pos] = c.tok, c.adapter, true
		}
	}
	h := fnv.New32a()
	for i, t := range toks {
		if !seen[i] {
			panic(fmt.Sprintf("fake: seq %d lacks position %d", s, i))
		}
		fmt.Fprint(h, t, ",")
		if under[i] > 0 {
			fmt.Fprint(h, "@", under[i], ",")
		}
	}
	if adapter > 0 {
		fmt.Fprint(h, "under ", adapter)
	}
	l := make([]float32, f.vocab.n)
	next := 3 + int(h.Sum32()%uint32(f.vocab.n-3))
	if f.Period > 0 && int(pos)+1 >= f.Period {
		next = int(toks[int(pos)+1-f.Period])
	}
	if f.EOSAt > 0 && int(pos)+2 >= f.EOSAt {
		next = 2
	}
	l[next] = 10
	return l
}

// nextPlaced is next for MRoPE: from the cells seq s holds at positions
// 0..pos, in the order of their places (position, line, column).
func (f *Fake) nextPlaced(s engine.SeqID, pos engine.Pos, adapter int) ([]float32, error) {
	var held []*cell
	for _, c := range f.cells {
		if c.seqs[s] && c.pos <= pos {
			held = append(held, c)
		}
	}
	slices.SortStableFunc(held, func(a, b *cell) int {
		return cmp.Or(cmp.Compare(a.pos, b.pos), cmp.Compare(a.y, b.y), cmp.Compare(a.x, b.x))
	})
	h := fnv.New32a()
	for i, c := range held {
		if i > 0 && c.pos == held[i-1].pos && c.y == held[i-1].y && c.x == held[i-1].x {
			return nil, fmt.Errorf("fake: sequence %d holds two cells at position %d, line %d, column %d: %w", s, c.pos, c.y, c.x, engine.ErrInvalidInput)
		}
		fmt.Fprint(h, c.tok, "@", c.pos, ":", c.y, ":", c.x, "/", c.adapter, ",")
	}
	fmt.Fprint(h, "under ", adapter)
	l := make([]float32, f.vocab.n)
	next := 3 + int(h.Sum32()%uint32(f.vocab.n-3))
	if f.Period > 0 && len(held)+1 >= f.Period {
		if t := held[len(held)+1-f.Period].tok; t >= 0 { // a placeholder is no token
			next = int(t)
		}
	}
	if f.EOSAt > 0 && len(held)+1 >= f.EOSAt {
		next = 2
	}
	l[next] = 10
	return l, nil
}

func (f *Fake) Logits(i int, fn func([]float32)) error {
	return engine.ViewLogits(f, i, fn)
}

// LogitsView implements engine.LogitsViewer: the row's logits, left alone until the
// next Decode.
func (f *Fake) LogitsView(i int) ([]float32, error) {
	l, ok := f.logits[i]
	if !ok {
		return nil, fmt.Errorf("fake: row %d has no logits: %w", i, engine.ErrInvalidInput)
	}
	return l, nil
}

func (f *Fake) SeqRemove(s engine.SeqID, p0, p1 engine.Pos) error {
	if s >= 0 {
		if err := f.checkSeq(s); err != nil {
			return err
		}
	}
	if p1 < 0 {
		p1 = 1 << 30
	}
	kept := f.cells[:0]
	for _, c := range f.cells {
		if (s < 0 || c.seqs[s]) && c.pos >= p0 && c.pos < p1 {
			if s < 0 {
				continue
			}
			delete(c.seqs, s)
			if len(c.seqs) == 0 {
				continue
			}
		}
		kept = append(kept, c)
	}
	f.cells = kept
	return nil
}

// NewSplit models one stream of perSeq cells per sequence (kv_unified=false).
func NewSplit(perSeq, seqs, batch int) *Fake {
	f := New(perSeq*seqs, seqs, batch)
	f.cap.Unified, f.cap.PrefixSharing, f.cap.CellsPerSeq = false, false, perSeq
	return f
}

func (f *Fake) SeqCopy(src, dst engine.SeqID, p0, p1 engine.Pos) error {
	if err := f.checkSeq(src); err != nil {
		return err
	}
	if err := f.checkSeq(dst); err != nil {
		return err
	}
	if !f.cap.Unified {
		if p0 > 0 || p1 >= 0 {
			return fmt.Errorf("fake: partial copy between streams: %w", engine.ErrUnsupported)
		}
		f.SeqRemove(dst, 0, -1) // a stream copy replaces the destination
	}
	if p1 < 0 {
		p1 = 1 << 30
	}
	for _, c := range f.cells {
		if c.seqs[src] && c.pos >= p0 && c.pos < p1 {
			c.seqs[dst] = true
		}
	}
	return nil
}

func (f *Fake) SeqKeep(s engine.SeqID) error { return engine.ErrUnsupported }
func (f *Fake) SeqShift(engine.SeqID, engine.Pos, engine.Pos, engine.Pos) error {
	return engine.ErrUnsupported
}

func (f *Fake) SeqPosRange(s engine.SeqID) (lo, hi engine.Pos, ok bool) {
	for _, c := range f.cells {
		if c.seqs[s] {
			if !ok || c.pos < lo {
				lo = c.pos
			}
			if !ok || c.pos > hi {
				hi = c.pos
			}
			ok = true
		}
	}
	return lo, hi, ok
}

func (f *Fake) ClearMemory() error { f.cells = nil; return nil }

// CellsUsed is the number of KV cells in use.
func (f *Fake) CellsUsed() int { return len(f.cells) }

func (f *Fake) Batches() []BatchStats {
	f.mu.Lock()
	defer f.mu.Unlock()
	return append([]BatchStats(nil), f.batches...)
}

// Vocab: token t >= 3 is the letter 'a'+(t-3)%26; 2 is EOS.
type Vocab struct {
	n   int
	fim engine.FIMTokens
}

func (v Vocab) Size() int                 { return v.n }
func (v Vocab) BOS() engine.Token         { return 1 }
func (v Vocab) EOS() engine.Token         { return 2 }
func (v Vocab) IsEOG(t engine.Token) bool { return t == 2 }
func (v Vocab) AddBOS() bool              { return true }
func (v Vocab) FIM() engine.FIMTokens     { return v.fim }

// SetFIM gives the fake's vocabulary fill-in-the-middle tokens (by default it
// has none). Call it before handing out Vocab.
func (f *Fake) SetFIM(t engine.FIMTokens) { f.vocab.fim = t }
func (v Vocab) Tokenize(s string, addSpecial, _ bool) ([]engine.Token, error) {
	var out []engine.Token
	if addSpecial {
		out = append(out, 1)
	}
	for _, c := range []byte(s) {
		out = append(out, engine.Token(3+int(c)%26))
	}
	return out, nil
}
func (v Vocab) Piece(t engine.Token, _ bool) ([]byte, error) {
	if t < 3 {
		return nil, nil
	}
	return []byte{byte('a' + (int(t)-3)%26)}, nil
}
func (v Vocab) Detokenize(ts []engine.Token, _, _ bool) (string, error) {
	var b []byte
	for _, t := range ts {
		p, _ := v.Piece(t, false)
		b = append(b, p...)
	}
	return string(b), nil
}

// ApplyChatTemplate renders "role: content" lines, then "assistant:" when asked.
func (v Vocab) ApplyChatTemplate(m []engine.ChatMessage, addAssistant bool) (string, error) {
	var b []byte
	for _, x := range m {
		b = append(b, x.Role+": "+x.Content+"\n"...)
	}
	if addAssistant {
		b = append(b, "assistant:"...)
	}
	return string(b), nil
}
