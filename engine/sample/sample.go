// Package sample implements engine.Sampler in Go over a row of logits.
//
// Why Go and not llama.cpp's sampler chain: the scheduler samples many sequences per
// step, each with its own parameters, seed and log-probability request. A Go sampler
// per sequence needs no C object per request, makes determinism a property of our own
// seeded generator (same seed and input, same output), reads the logits through the
// engine's zero-copy view, and computes logprobs exactly as OpenAI's API defines them.
// The one piece taken from llama.cpp is grammar matching (GBNF), behind
// engine.Grammar, because re-implementing its grammar engine would be a large
// duplicate of well-tested code.
//
// Order of operations: logit bias, end tokens banned before min tokens,
// repetition/frequency/presence penalties, DRY, grammar, then greedy (temperature
// 0) or, before drawing: top-n-sigma, top-k, temperature (or dynamic temperature),
// typical-p, min-p, top-p and XTC; with Mirostat, logit bias, temperature and
// Mirostat alone (no penalties or DRY either), as llama-server chains them.
// The truncations after temperature see its probabilities, and top-p follows
// min-p, as in vLLM (llama.cpp applies temperature last, top-p before min-p). Log-probabilities are those of
// the raw model distribution (log-softmax of the unmodified logits), as vLLM
// reports them by default.
package sample

import (
	"cmp"
	"errors"
	"fmt"
	"math"
	"math/rand/v2"
	"slices"

	"github.com/shoal-ai/shoal/engine"
)

// Defaults for parameters a request leaves unset.
const (
	// DefaultRepeatLastN is how many recent tokens the penalties look at (llama.cpp's default).
	DefaultRepeatLastN = 64
	// MaxTopLogprobs bounds the alternatives returned per token (OpenAI allows 20).
	MaxTopLogprobs = 20
)

// Params are one request's sampling parameters. The zero value is greedy decoding.
type Params struct {
	Temperature float32 // 0: greedy
	TopK        int     // 0: off
	TopP        float32 // 0 or 1: off
	MinP        float32 // 0: off

	// RepeatPenalty follows llama.cpp: positive logits of tokens among the last
	// RepeatLastN of the prompt and output are divided by it, negative ones
	// multiplied. 1 or 0: off.
	RepeatPenalty float32
	// FrequencyPenalty and PresencePenalty follow OpenAI (and vLLM): a token
	// generated n times so far loses n × FrequencyPenalty + PresencePenalty
	// (n > 0), counting every generated token and no prompt token.
	FrequencyPenalty float32
	PresencePenalty  float32
	RepeatLastN      int // RepeatPenalty's window; 0: DefaultRepeatLastN, -1: whole sequence

	LogitBias map[engine.Token]float32 // added to the logit; -100 or less bans the token
	// Allowed, when not empty, are the only tokens that may be drawn (vLLM's
	// allowed_token_ids).
	Allowed []engine.Token
	// BadWords are token sequences never generated (vLLM's bad_words): the
	// last token of each is banned where the generated tokens end with the
	// rest of it (a one-token word, always).
	BadWords [][]engine.Token

	// EndTokens are banned until MinTokens tokens have been generated (vLLM's
	// min_tokens: the end-of-generation and stop tokens).
	EndTokens []engine.Token
	MinTokens int

	// llama-server's samplers beyond OpenAI's and vLLM's, with llama.cpp's
	// meanings.
	TopNSigma float32 // keep logits within TopNSigma standard deviations of the best; <= 0: off
	TypicalP  float32 // keep the most typical tokens (closest to the entropy) of this mass; 0 or 1: off
	// XTC ("exclude top choices"): with probability XTCProbability, of the
	// tokens at least XTCThreshold likely all but the least likely are removed
	// (when two or more are). XTCThreshold above 0.5: off.
	XTCProbability, XTCThreshold float32
	// DynatempRange > 0 draws at a temperature in Temperature ± DynatempRange
	// (not below 0): the higher the entropy of the candidates, the higher,
	// shaped by DynatempExponent.
	DynatempRange, DynatempExponent float32
	// Mirostat 1 or 2 replaces the truncations (top-k, top-p, min-p, typical-p,
	// XTC, top-n-sigma) by Mirostat's, which aims at a surprise of MirostatTau
	// bits per token, learning at rate MirostatEta.
	Mirostat                 int
	MirostatTau, MirostatEta float32
	DRY                      DRY
	// MinKeep is llama-server's min_keep: top-p, min-p, typical-p and XTC
	// keep at least this many tokens. 0: no such bound.
	MinKeep int
	// Order, when set, is the request's own order of samplers, as
	// llama-server's "samplers" (Stage). Penalties and DRY still come first,
	// but only when listed; the truncations and temperature then run as
	// listed, each over the logits the ones before it left, and temperature
	// only where listed (at 1 when it is not).
	Order []Stage

	Seed uint64 // seeds the generator; equal seeds give equal draws

	Logprobs    bool // compute the chosen token's log-probability (costs a pass over the vocabulary)
	TopLogprobs int  // alternatives to return per token, 0..MaxTopLogprobs; implies Logprobs
}

// Validate rejects out-of-range parameters.
func (p Params) Validate() error {
	switch {
	case p.Temperature < 0 || isNaN(p.Temperature):
		return fmt.Errorf("temperature %v must be >= 0", p.Temperature)
	case p.TopK < 0:
		return fmt.Errorf("top_k %d must be >= 0", p.TopK)
	case p.TopP < 0 || p.TopP > 1 || isNaN(p.TopP):
		return fmt.Errorf("top_p %v must be in [0, 1]", p.TopP)
	case p.MinP < 0 || p.MinP > 1 || isNaN(p.MinP):
		return fmt.Errorf("min_p %v must be in [0, 1]", p.MinP)
	case p.RepeatPenalty < 0 || isNaN(p.RepeatPenalty):
		return fmt.Errorf("repetition_penalty %v must be >= 0", p.RepeatPenalty)
	case p.FrequencyPenalty < -2 || p.FrequencyPenalty > 2 || isNaN(p.FrequencyPenalty):
		return fmt.Errorf("frequency_penalty %v must be in [-2, 2]", p.FrequencyPenalty)
	case p.PresencePenalty < -2 || p.PresencePenalty > 2 || isNaN(p.PresencePenalty):
		return fmt.Errorf("presence_penalty %v must be in [-2, 2]", p.PresencePenalty)
	case p.RepeatLastN < -1:
		return fmt.Errorf("repeat_last_n %d must be >= -1", p.RepeatLastN)
	case p.TopLogprobs < 0 || p.TopLogprobs > MaxTopLogprobs:
		return fmt.Errorf("top_logprobs %d must be in [0, %d]", p.TopLogprobs, MaxTopLogprobs)
	case p.MinTokens < 0:
		return fmt.Errorf("min_tokens %d must be >= 0", p.MinTokens)
	case slices.ContainsFunc(p.Allowed, func(t engine.Token) bool { return t < 0 }):
		return errors.New("allowed_token_ids: token ids must not be negative")
	case slices.ContainsFunc(p.BadWords, func(w []engine.Token) bool { return len(w) == 0 }):
		return errors.New("bad_words: a word of no tokens")
	case !finite(p.TopNSigma):
		return fmt.Errorf("top_n_sigma %v must be a number", p.TopNSigma)
	case p.TypicalP < 0 || p.TypicalP > 1 || isNaN(p.TypicalP):
		return fmt.Errorf("typical_p %v must be in [0, 1]", p.TypicalP)
	case p.XTCProbability < 0 || p.XTCProbability > 1 || isNaN(p.XTCProbability):
		return fmt.Errorf("xtc_probability %v must be in [0, 1]", p.XTCProbability)
	case p.XTCThreshold < 0 || isNaN(p.XTCThreshold):
		return fmt.Errorf("xtc_threshold %v must be >= 0", p.XTCThreshold)
	case p.DynatempRange < 0 || !finite(p.DynatempRange):
		return fmt.Errorf("dynatemp_range %v must be >= 0", p.DynatempRange)
	case p.DynatempExponent < 0 || !finite(p.DynatempExponent):
		return fmt.Errorf("dynatemp_exponent %v must be >= 0", p.DynatempExponent)
	case p.MinKeep < 0:
		return fmt.Errorf("min_keep %d must be >= 0", p.MinKeep)
	case p.Mirostat < 0 || p.Mirostat > 2:
		return fmt.Errorf("mirostat %d must be 0 (off), 1 or 2", p.Mirostat)
	case p.MirostatTau < 0 || !finite(p.MirostatTau):
		return fmt.Errorf("mirostat_tau %v must be >= 0", p.MirostatTau)
	case p.MirostatEta < 0 || !finite(p.MirostatEta):
		return fmt.Errorf("mirostat_eta %v must be >= 0", p.MirostatEta)
	}
	if err := p.DRY.validate(); err != nil {
		return err
	}
	for _, st := range p.Order {
		if st < StagePenalties || st > StageTemperature {
			return fmt.Errorf("sampler stage %d is not one", st)
		}
	}
	for _, t := range p.EndTokens {
		if t < 0 {
			return fmt.Errorf("end token %d must be >= 0", t)
		}
	}
	for t, b := range p.LogitBias {
		if t < 0 || isNaN(b) || b < -100 || b > 100 {
			return fmt.Errorf("logit_bias %d: %v must be in [-100, 100] for a token id >= 0", t, b)
		}
	}
	return nil
}

func isNaN(f float32) bool { return f != f }

func finite(f float32) bool { return !isNaN(f) && !math.IsInf(float64(f), 0) }

// greedy reports whether the request draws the likeliest token. In an order
// of samplers (Order), temperature 0 keeps the likeliest of what the stages
// before it left, which typical-p and XTC may have cut the likeliest from (the
// draw does that); without temperature the draw is at 1, as llama-server's.
func (p Params) greedy() bool {
	if p.Temperature > 0 || p.DynatempRange > 0 {
		return false
	}
	if p.Order == nil {
		return true
	}
	for _, st := range p.Order {
		switch {
		case st == StageTemperature:
			return true
		case st == StageTypicalP && p.TypicalP > 0 && p.TypicalP < 1,
			st == StageXTC && p.XTCProbability > 0 && p.XTCThreshold <= 0.5:
			return false
		}
	}
	return false
}

func (p Params) penalised() bool {
	return p.repeatPenalised() || p.FrequencyPenalty != 0 || p.PresencePenalty != 0 || p.DRY.on()
}

func (p Params) repeatPenalised() bool { return p.RepeatPenalty != 0 && p.RepeatPenalty != 1 }

// ErrNoCandidates means no token could be drawn (every logit NaN or -Inf).
var ErrNoCandidates = errors.New("sampling: no allowed token")

// ErrNoneAllowed means the request's own constraints, its grammar or the
// tokens its logit_bias bans, ruled out every token: a schema no value meets,
// a bias that bans the whole vocabulary. It wraps ErrNoCandidates.
var ErrNoneAllowed = fmt.Errorf("%w: the request's grammar, logit_bias, allowed_token_ids or bad_words allow none", ErrNoCandidates)

// Sampler is the Go engine.Sampler. See the package doc for the order of operations.
type Sampler struct {
	p       Params
	grammar engine.Grammar // may be nil; owned (closed) by the sampler
	rng     *rand.Rand

	history   []engine.Token       // recent tokens for RepeatPenalty (ring of RepeatLastN)
	recent    []engine.Token       // the last generated tokens, as many as BadWords need
	badLen    int                  // the longest of BadWords
	kept      []float32            // scratch: the Allowed tokens' logits
	counts    map[engine.Token]int // occurrences within history
	generated map[engine.Token]int // occurrences among generated tokens (OpenAI penalties)
	ngen      int                  // tokens generated so far
	cands     []engine.TokenLogit  // scratch, reused across steps
	mass      []float64            // scratch for top-p over the whole vocabulary (lazily made)
	dry       *dryState            // nil: DRY off
	// mu is Mirostat's surprise bound, muNext its value after the token draw
	// last chose (kept once that token is the one sampled).
	mu, muNext float64
	typical    []typicalCand // scratch for typical-p
}

var _ engine.Sampler = (*Sampler)(nil)

// New returns a sampler for p. grammar, if not nil, is owned by the sampler from now on.
func New(p Params, grammar engine.Grammar) (*Sampler, error) {
	if err := p.Validate(); err != nil {
		if grammar != nil {
			_ = grammar.Close()
		}
		return nil, fmt.Errorf("sampler: %w", err)
	}
	if p.RepeatLastN == 0 {
		p.RepeatLastN = DefaultRepeatLastN
	}
	if p.Mirostat != 0 {
		// llama-server chains logit bias, temperature and Mirostat alone: no
		// penalties, no DRY.
		p.RepeatPenalty, p.FrequencyPenalty, p.PresencePenalty, p.DRY.Multiplier = 1, 0, 0, 0
	}
	if p.Order != nil && p.Mirostat == 0 { // Mirostat ignores the order, as llama-server's
		if !slices.Contains(p.Order, StagePenalties) {
			p.RepeatPenalty, p.FrequencyPenalty, p.PresencePenalty = 1, 0, 0
		}
		if !slices.Contains(p.Order, StageDRY) {
			p.DRY.Multiplier = 0
		}
	}
	s := &Sampler{
		p:         p,
		grammar:   grammar,
		rng:       rand.New(rand.NewPCG(p.Seed, p.Seed^0x9E3779B97F4A7C15)),
		counts:    map[engine.Token]int{},
		generated: map[engine.Token]int{},
		mu:        2 * float64(p.MirostatTau),
	}
	if p.DRY.on() {
		s.dry = newDRY(p.DRY)
	}
	for _, w := range p.BadWords {
		s.badLen = max(s.badLen, len(w))
	}
	return s, nil
}

// Accept records t for the penalties and advances the grammar past generated tokens.
func (s *Sampler) Accept(t engine.Token, generated bool) {
	if t < 0 {
		return // an image's placeholder in the prompt: no token to penalise
	}
	if generated {
		s.ngen++
	}
	if generated && s.grammar != nil {
		s.grammar.Accept(t)
	}
	if generated && len(s.p.BadWords) > 0 {
		s.recent = append(s.recent, t)
		if len(s.recent) > 2*s.badLen {
			s.recent = append(s.recent[:0], s.recent[len(s.recent)-s.badLen:]...)
		}
	}
	if generated && (s.p.FrequencyPenalty != 0 || s.p.PresencePenalty != 0) {
		s.generated[t]++
	}
	if s.dry != nil {
		s.dry.accept(t)
	}
	if !s.p.repeatPenalised() {
		return
	}
	s.history = append(s.history, t)
	s.counts[t]++
	if n := s.p.RepeatLastN; n > 0 && len(s.history) > n {
		old := s.history[0]
		s.history = s.history[1:]
		if s.counts[old]--; s.counts[old] == 0 {
			delete(s.counts, old)
		}
	}
}

// endsWith reports whether seq ends with suffix.
func endsWith(seq, suffix []engine.Token) bool {
	return len(seq) >= len(suffix) && slices.Equal(seq[len(seq)-len(suffix):], suffix)
}

// Close releases the grammar.
func (s *Sampler) Close() error {
	if s.grammar != nil {
		err := s.grammar.Close()
		s.grammar = nil
		return err
	}
	return nil
}

// Sample picks the next token from logits.
func (s *Sampler) Sample(logits []float32) (engine.Sampled, error) {
	if len(logits) == 0 {
		return engine.Sampled{}, fmt.Errorf("sample: empty logits: %w", engine.ErrInvalidInput)
	}
	var tok engine.Token
	var err error
	if s.p.greedy() && !s.p.penalised() && len(s.p.LogitBias) == 0 && len(s.p.Allowed) == 0 && len(s.p.BadWords) == 0 {
		// Greedy reads the logits once: the best token, or while min_tokens
		// holds the end tokens back, the best other (vocabulary-wide
		// candidates cost a copy of the row).
		var ok bool
		if tok, ok = s.bestAllowed(logits); !ok || s.grammar != nil && !s.allowed(tok, logits[tok]) {
			tok, err = s.sampleAll(logits)
		}
	} else {
		tok, err = s.sampleAll(logits)
	}
	if err != nil {
		return engine.Sampled{}, err
	}
	out := engine.Sampled{Token: tok}
	if s.p.Logprobs || s.p.TopLogprobs > 0 {
		lse := logSumExp(logits)
		out.Logprob = logits[tok] - lse
		if s.p.TopLogprobs > 0 {
			out.Top = topLogprobs(logits, s.p.TopLogprobs, lse)
		}
	}
	return out, nil
}

// allowed checks one token against the grammar: the common case of the model already
// choosing a valid token avoids running the grammar over the whole vocabulary.
func (s *Sampler) allowed(t engine.Token, logit float32) bool {
	one := []engine.TokenLogit{{Token: t, Logit: logit}}
	s.grammar.Apply(one)
	return !math.IsInf(float64(one[0].Logit), -1)
}

// sampleAll runs the full pipeline over every token.
func (s *Sampler) sampleAll(logits []float32) (engine.Token, error) {
	hold := s.holdingEnd()
	t, err := s.sampleFrom(logits, hold)
	if hold && errors.Is(err, ErrNoCandidates) {
		// Only an end is allowed (a complete grammar): min_tokens gives way, as
		// nothing else may follow.
		t, err = s.sampleFrom(logits, false)
	}
	if errors.Is(err, ErrNoCandidates) && s.constrained() {
		return 0, ErrNoneAllowed
	}
	return t, err
}

// constrained reports whether the request rules tokens out itself: a grammar,
// allowed tokens, bad words, or a logit_bias that bans some.
func (s *Sampler) constrained() bool {
	if s.grammar != nil || len(s.p.Allowed) > 0 || len(s.p.BadWords) > 0 {
		return true
	}
	for _, b := range s.p.LogitBias {
		if b <= -100 {
			return true
		}
	}
	return false
}

// sampleFrom runs the pipeline, with the end tokens banned when holdEnd.
func (s *Sampler) sampleFrom(logits []float32, holdEnd bool) (engine.Token, error) {
	c := s.candidates(logits, holdEnd)
	if !s.p.greedy() {
		// Draw first and check only the drawn token against the grammar, as llama.cpp's
		// common sampler does; fall back to masking the whole vocabulary when it fails.
		if t, ok := s.draw(c); ok && (s.grammar == nil || s.allowed(t, logits[t])) {
			s.mu = s.muNext
			return t, nil
		}
		if s.grammar == nil {
			return 0, ErrNoCandidates
		}
		c = s.candidates(logits, holdEnd) // draw reordered c and turned logits into probabilities
	}
	if s.grammar != nil {
		s.grammar.Apply(c)
	}
	if s.p.greedy() {
		best := -1
		for i := range c {
			if !math.IsInf(float64(c[i].Logit), -1) && (best < 0 || c[i].Logit > c[best].Logit) {
				best = i
			}
		}
		if best < 0 {
			return 0, ErrNoCandidates
		}
		return c[best].Token, nil
	}
	if t, ok := s.draw(c); ok {
		s.mu = s.muNext
		return t, nil
	}
	return 0, ErrNoCandidates
}

// holdingEnd reports whether the end tokens are still banned.
func (s *Sampler) holdingEnd() bool { return s.ngen < s.p.MinTokens && len(s.p.EndTokens) > 0 }

// candidates is every token with its logit after bias and penalties (and the
// end tokens banned when holdEnd), in token order (in the sampler's scratch).
func (s *Sampler) candidates(logits []float32, holdEnd bool) []engine.TokenLogit {
	c := s.cands[:0]
	for i, l := range logits {
		c = append(c, engine.TokenLogit{Token: engine.Token(i), Logit: l})
	}
	s.cands = c
	for t, b := range s.p.LogitBias {
		if int(t) < len(c) {
			if b <= -100 {
				c[t].Logit = float32(math.Inf(-1))
			} else {
				c[t].Logit += b
			}
		}
	}
	negInf := float32(math.Inf(-1))
	if len(s.p.Allowed) > 0 {
		s.kept = s.kept[:0]
		for _, t := range s.p.Allowed {
			if int(t) < len(c) {
				s.kept = append(s.kept, c[t].Logit)
			}
		}
		for i := range c {
			c[i].Logit = negInf
		}
		j := 0
		for _, t := range s.p.Allowed {
			if int(t) < len(c) {
				c[t].Logit = s.kept[j]
				j++
			}
		}
	}
	for _, w := range s.p.BadWords {
		if last := w[len(w)-1]; int(last) < len(c) && endsWith(s.recent, w[:len(w)-1]) {
			c[last].Logit = negInf
		}
	}
	if holdEnd {
		for _, t := range s.p.EndTokens {
			if int(t) < len(c) {
				c[t].Logit = float32(math.Inf(-1))
			}
		}
	}
	if rp := s.p.RepeatPenalty; rp != 0 && rp != 1 {
		for t := range s.counts {
			if int(t) < len(c) {
				if l := c[t].Logit; l > 0 {
					c[t].Logit = l / rp
				} else {
					c[t].Logit = l * rp
				}
			}
		}
	}
	for t, n := range s.generated {
		if int(t) < len(c) {
			c[t].Logit -= float32(n)*s.p.FrequencyPenalty + s.p.PresencePenalty
		}
	}
	if s.dry != nil {
		s.dry.apply(c)
	}
	return c
}

// draw applies the truncations and temperature to c (reordering it) and draws.
// Top-p needs an order; it sorts the few hundred most likely candidates, and
// when those do not reach the requested mass, one bucket of probability (see topP).
func (s *Sampler) draw(c []engine.TokenLogit) (engine.Token, bool) {
	vocab := len(c)
	// One pass drops banned (-inf) and NaN logits (x > -inf is false for both) and
	// finds the best.
	negInf := float32(math.Inf(-1))
	maxL := negInf
	n := 0
	for _, x := range c {
		if x.Logit > negInf {
			c[n] = x
			n++
			if x.Logit > maxL { // not max(): its NaN and signed-zero rules cost here
				maxL = x.Logit
			}
		}
	}
	if n == 0 {
		return 0, false
	}
	c = c[:n]
	s.muNext = s.mu
	if math.IsInf(float64(maxL), 1) {
		// A penalty or bias pushed logits to +Inf (repetition_penalty near 0
		// divides them): those tokens are certain, alike.
		m := 0
		for _, x := range c {
			if math.IsInf(float64(x.Logit), 1) {
				c[m] = x
				m++
			}
		}
		return c[s.rng.IntN(m)].Token, true
	}
	if s.p.Mirostat != 0 {
		return s.mirostat(c, maxL, vocab), true
	}
	if s.p.Order != nil {
		return s.drawInOrder(c)
	}
	if s.p.TopNSigma > 0 && len(c) > 1 {
		c = topNSigma(c, maxL, s.p.TopNSigma)
	}
	if k := s.p.TopK; k > 0 && k < len(c) {
		selectTop(c, k) // the best stays among the k
		c = c[:k]
	}
	temp := float64(s.p.Temperature)
	if s.p.DynatempRange > 0 && len(c) > 1 {
		temp = dynamicTemp(c, maxL, temp, float64(s.p.DynatempRange), float64(s.p.DynatempExponent))
	}
	if temp <= 0 {
		return c[best(c)].Token, true
	}
	c, sum := probabilities(c, maxL, temp)
	// top is the most likely candidate's probability, relative. Typical-p
	// comes before min-p, as in llama.cpp, and may drop the most likely.
	top := float32(1)
	if tp := s.p.TypicalP; tp > 0 && tp < 1 {
		c, sum = s.typicalP(c, sum, float64(tp))
		top = c[best(c)].Logit
	}
	if s.p.MinP > 0 {
		c, sum = s.minP(c, s.p.MinP*top)
	}
	if tp := float64(s.p.TopP); tp > 0 && tp < 1 {
		c, sum = s.topPKeep(c, tp*sum)
	}
	if s.p.XTCProbability > 0 && s.p.XTCThreshold <= 0.5 && len(c) > 1 && s.rng.Float64() <= float64(s.p.XTCProbability) {
		c, sum = xtc(c, sum, float64(s.p.XTCThreshold), s.p.MinKeep)
	}
	if len(c) == 0 {
		return 0, false
	}
	return c[s.pick(c, sum)].Token, true
}

// probabilities turns c's logits into probabilities at temperature temp,
// relative to the best's (which gets 1), kept in Logit, and returns them with
// their sum. Tokens less likely than negligible relative to the best are
// dropped before the exponential: even a whole vocabulary of them weighs less
// than float32 can tell apart from 1.
func probabilities(c []engine.TokenLogit, maxL float32, temp float64) ([]engine.TokenLogit, float64) {
	var sum float64
	floor := float64(maxL) - negligible*temp
	m := 0
	for _, x := range c {
		if float64(x.Logit) < floor {
			continue
		}
		p := float32(expNeg((float64(x.Logit) - float64(maxL)) / temp))
		c[m] = engine.TokenLogit{Token: x.Token, Logit: p}
		m++
		sum += float64(p) // as stored: the draw walks the stored values
	}
	return c[:m], sum
}

// pick draws an index of c in proportion to its probabilities (Logit), which
// sum to sum.
func (s *Sampler) pick(c []engine.TokenLogit, sum float64) int {
	r := s.rng.Float64() * sum
	for i, x := range c {
		r -= float64(x.Logit)
		if r < 0 {
			return i
		}
	}
	return len(c) - 1
}

// best is the index of c's most likely candidate (the first, among equals).
func best(c []engine.TokenLogit) int {
	b := 0
	for i, x := range c {
		if better(x, c[b]) < 0 {
			b = i
		}
	}
	return b
}

// negligible: a token whose logit is this many temperatures below the best has
// probability under e^-30 ≈ 1e-13 of the best's, so 128k such tokens weigh 1.2e-8:
// below float32's resolution of the total.
const negligible = 30

// expNeg is e^x for x in [-negligible, 0], twice as fast as math.Exp (the cost of a
// draw at temperature > 0 is mostly this over the vocabulary) and within 1e-8 of it,
// below float32's resolution: 2^n × e^g with n = round(x / ln 2) and a degree-7 Taylor
// polynomial for |g| <= ln(2)/2.
func expNeg(x float64) float64 {
	t := x * math.Log2E
	n := math.Floor(t + 0.5)
	g := (t - n) * math.Ln2
	p := 1 + g*(1+g*(1.0/2+g*(1.0/6+g*(1.0/24+g*(1.0/120+g*(1.0/720+g*(1.0/5040)))))))
	return p * math.Float64frombits(uint64(int64(n)+1023)<<52)
}

// topPHead is how many candidates top-p sorts before looking at all of them.
const topPHead = 256

// massShift buckets a positive float32 by its exponent and top 5 mantissa bits
// (bits >> 18): the buckets follow the value's order, 32 to each power of two.
const massShift = 18

// topP keeps the most likely candidates (Logit holding probabilities) whose mass
// reaches target, returning them and their mass: the shortest prefix of c sorted by
// better. It sorts the topPHead most likely first; when those fall short (a flat
// distribution), it sums the mass per bucket of probability, keeps every bucket above
// the one where the target is reached, and sorts only that bucket, instead of sorting
// the whole vocabulary (22 ms for 128k tokens).
func (s *Sampler) topP(c []engine.TokenLogit, target float64) ([]engine.TokenLogit, float64) {
	head := min(len(c), topPHead)
	if head < len(c) {
		selectTop(c, head)
	}
	slices.SortFunc(c[:head], better)
	var acc float64
	for i, x := range c[:head] {
		acc += float64(x.Logit)
		if acc >= target {
			return c[:i+1], acc
		}
	}
	if head == len(c) {
		return c, acc
	}
	if s.mass == nil {
		s.mass = make([]float64, 1<<(31-massShift)) // positive floats only
	}
	clear(s.mass)
	bucket := func(x engine.TokenLogit) int { return int(math.Float32bits(x.Logit) >> massShift) }
	for _, x := range c {
		s.mass[bucket(x)] += float64(x.Logit)
	}
	acc = 0
	b := len(s.mass) - 1
	for ; b >= 0 && acc+s.mass[b] < target; b-- {
		acc += s.mass[b]
	}
	if b < 0 { // rounding: the target is the whole mass
		return c, acc
	}
	// c[:i]: the buckets above b, all kept; c[i:k]: bucket b, kept in order until the
	// target is reached.
	i := gather(c, 0, func(x engine.TokenLogit) bool { return bucket(x) > b })
	k := gather(c, i, func(x engine.TokenLogit) bool { return bucket(x) == b })
	slices.SortFunc(c[i:k], better)
	for j := i; j < k; j++ {
		acc += float64(c[j].Logit)
		if acc >= target {
			return c[:j+1], acc
		}
	}
	return c[:k], acc
}

// gather moves the elements of xs[from:] for which in holds to the front of
// xs[from:] (the others after them, in no particular order) and returns where
// they end.
func gather[T any](xs []T, from int, in func(T) bool) int {
	for j := from; j < len(xs); j++ {
		if in(xs[j]) {
			xs[from], xs[j] = xs[j], xs[from]
			from++
		}
	}
	return from
}

// better orders by descending logit, then ascending id, so every order is deterministic.
func better(a, b engine.TokenLogit) int {
	return cmp.Or(cmp.Compare(b.Logit, a.Logit), cmp.Compare(a.Token, b.Token))
}

// selectTop moves the k best candidates (by better) to c[:k], in no particular order,
// and the rest to c[k:]; c holds no NaN. A few of many (top-k 40 of a vocabulary)
// go through a heap of k, which rejects most candidates with one comparison;
// otherwise quickselect with a median-of-three pivot. Both are deterministic.
func selectTop(c []engine.TokenLogit, k int) {
	if k > 0 && k <= len(c)/8 {
		heapTop(c, k)
		return
	}
	lo, hi := 0, len(c)-1
	for lo < hi {
		mid := lo + (hi-lo)/2
		if better(c[mid], c[lo]) < 0 {
			c[mid], c[lo] = c[lo], c[mid]
		}
		if better(c[hi], c[lo]) < 0 {
			c[hi], c[lo] = c[lo], c[hi]
		}
		if better(c[hi], c[mid]) < 0 {
			c[hi], c[mid] = c[mid], c[hi]
		}
		pivot := c[mid]
		i, j := lo, hi
		for i <= j {
			for better(c[i], pivot) < 0 {
				i++
			}
			for better(pivot, c[j]) < 0 {
				j--
			}
			if i <= j {
				c[i], c[j] = c[j], c[i]
				i++
				j--
			}
		}
		switch {
		case k-1 <= j:
			hi = j
		case k-1 >= i:
			lo = i
		default:
			return
		}
	}
}

// worse reports whether a ranks below b in better's order (for NaN-free logits).
func worse(a, b engine.TokenLogit) bool {
	return a.Logit < b.Logit || a.Logit == b.Logit && a.Token > b.Token
}

// heapTop keeps the k best of c in c[:k] as a heap with the worst of them at the
// root, swapping each candidate that beats the root into it.
func heapTop(c []engine.TokenLogit, k int) {
	h := c[:k]
	for i := k/2 - 1; i >= 0; i-- {
		siftDown(h, i)
	}
	for j := k; j < len(c); j++ {
		if worse(h[0], c[j]) {
			h[0], c[j] = c[j], h[0]
			siftDown(h, 0)
		}
	}
}

func siftDown(h []engine.TokenLogit, i int) {
	for {
		m := 2*i + 1
		if m >= len(h) {
			return
		}
		if r := m + 1; r < len(h) && worse(h[r], h[m]) {
			m = r
		}
		if !worse(h[m], h[i]) {
			return
		}
		h[i], h[m] = h[m], h[i]
		i = m
	}
}

// bestAllowed is greedy's choice without the pipeline: the first highest
// logit, leaving out the end tokens while they are held back. ok is false when
// that leaves nothing finite (only an end may follow: the pipeline decides).
func (s *Sampler) bestAllowed(logits []float32) (engine.Token, bool) {
	tok := argmax(logits)
	if !s.holdingEnd() || !slices.Contains(s.p.EndTokens, tok) {
		return tok, true
	}
	best := -1
	for i, x := range logits {
		if (best < 0 || x > logits[best]) && !slices.Contains(s.p.EndTokens, engine.Token(i)) {
			best = i
		}
	}
	if best < 0 || math.IsInf(float64(logits[best]), -1) || math.IsNaN(float64(logits[best])) {
		return 0, false
	}
	return engine.Token(best), true
}

func argmax(l []float32) engine.Token {
	best := 0
	for i, x := range l {
		if x > l[best] {
			best = i
		}
	}
	return engine.Token(best)
}

// Score is how likely tok was under logits, the model's distribution before any
// sampling parameter: its log-probability, its rank and the top n tokens
// (engine.TokenScore). Logits are read, not changed; any goroutine may call it.
func Score(logits []float32, tok engine.Token, n int) (engine.TokenScore, error) {
	if int(tok) < 0 || int(tok) >= len(logits) {
		return engine.TokenScore{}, fmt.Errorf("score token %d: outside the %d logits: %w", tok, len(logits), engine.ErrInvalidInput)
	}
	if n < 0 || n > MaxTopLogprobs {
		return engine.TokenScore{}, fmt.Errorf("score: top %d must be in [0, %d]: %w", n, MaxTopLogprobs, engine.ErrInvalidInput)
	}
	x := logits[tok]
	rank := 1
	for _, y := range logits {
		if y > x {
			rank++
		}
	}
	lse := logSumExp(logits)
	sc := engine.TokenScore{Token: tok, Logprob: x - lse, Rank: rank}
	if n > 0 {
		sc.Top = topLogprobs(logits, n, lse)
	}
	return sc, nil
}

func logSumExp(l []float32) float32 {
	m := l[0]
	for _, x := range l {
		if x > m {
			m = x
		}
	}
	var s float64
	for _, x := range l {
		if d := float64(x - m); d >= -negligible { // the rest weigh under 1e-8 together
			s += expNeg(d)
		}
	}
	return m + float32(math.Log(s))
}

// topLogprobs returns the n most likely tokens of the raw distribution.
func topLogprobs(l []float32, n int, lse float32) []engine.TokenProb {
	n = min(n, len(l))
	top := make([]engine.TokenProb, 0, n+1)
	for i, x := range l {
		if len(top) == n && x <= top[n-1].Logprob {
			continue
		}
		tp := engine.TokenProb{Token: engine.Token(i), Logprob: x}
		j, _ := slices.BinarySearchFunc(top, tp, func(a, b engine.TokenProb) int { return cmp.Compare(b.Logprob, a.Logprob) })
		// equal logits keep the lower id first
		for j < len(top) && top[j].Logprob == x {
			j++
		}
		top = slices.Insert(top, j, tp)
		if len(top) > n {
			top = top[:n]
		}
	}
	for i := range top {
		top[i].Logprob -= lse
	}
	return top
}
