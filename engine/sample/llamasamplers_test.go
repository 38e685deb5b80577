package sample

import (
	"fmt"
	"math"
	"math/rand/v2"
	"slices"
	"strings"
	"testing"

	"github.com/shoal-ai/shoal/engine"
)

// The expected distributions below are those of llama.cpp's own sampler tests
// (tests/test-sampling.cpp), which these samplers follow.

// logitsOf is the logits of probabilities p.
func logitsOf(p []float32) []engine.TokenLogit {
	c := make([]engine.TokenLogit, len(p))
	for i, x := range p {
		c[i] = engine.TokenLogit{Token: engine.Token(i), Logit: float32(math.Log(float64(x)))}
	}
	return c
}

// softmaxOf is the distribution of c's logits, by token id (0 where absent).
func softmaxOf(c []engine.TokenLogit, n int) []float64 {
	out := make([]float64, n)
	var sum float64
	for _, x := range c {
		if !math.IsInf(float64(x.Logit), -1) {
			sum += math.Exp(float64(x.Logit))
		}
	}
	for _, x := range c {
		if !math.IsInf(float64(x.Logit), -1) {
			out[x.Token] = math.Exp(float64(x.Logit)) / sum
		}
	}
	return out
}

// normalised is the distribution of c's probabilities (Logit holding them),
// by token id.
func normalised(c []engine.TokenLogit, n int) []float64 {
	out := make([]float64, n)
	var sum float64
	for _, x := range c {
		sum += float64(x.Logit)
	}
	for _, x := range c {
		out[x.Token] = float64(x.Logit) / sum
	}
	return out
}

func near(a []float64, b []float32, tol float64) bool {
	if len(a) != len(b) {
		return false
	}
	for i := range a {
		if math.Abs(a[i]-float64(b[i])) > tol {
			return false
		}
	}
	return true
}

func TestDRYMatchesLlamaCpp(t *testing.T) {
	for _, tc := range []struct {
		probs    []float32
		history  []engine.Token
		want     []float32
		mult     float32
		base     float32
		allowed  int
		lastN    int
		breakers [][]engine.Token
	}{
		{[]float32{0.25, 0.25, 0.25, 0.25}, []engine.Token{0, 1}, []float32{0.25, 0.25, 0.25, 0.25}, 1, 1.1, 2, 4, nil},
		{[]float32{0.25, 0.25, 0.25, 0.25}, []engine.Token{0, 1, 2, 0, 1}, []float32{0.296923, 0.296923, 0.109232, 0.296923}, 1, 1.1, 2, 5, nil},
		{[]float32{0.2, 0.2, 0.2, 0.2, 0.2}, []engine.Token{0, 1, 3, 4, 0, 1}, []float32{0.2, 0.2, 0.2, 0.2, 0.2}, 1, 1.1, 2, 6, [][]engine.Token{{3}}},
		{[]float32{0.2, 0.2, 0.2, 0.2, 0.2}, []engine.Token{0, 1, 2, 0, 1}, []float32{0.241818, 0.241818, 0.032727, 0.241818, 0.241818}, 2, 1.1, 2, 5, nil},
		{[]float32{0.2, 0.2, 0.2, 0.2, 0.2}, []engine.Token{0, 1, 2, 3, 4, 0, 1}, []float32{0.2, 0.2, 0.2, 0.2, 0.2}, 1, 1.1, 4, 7, nil},
	} {
		d := DRY{Multiplier: tc.mult, Base: tc.base, AllowedLength: tc.allowed, LastN: tc.lastN, Breakers: BreakerTokens(tc.breakers...)}
		s := mustNew(t, Params{Temperature: 1, DRY: d}, nil)
		for _, tok := range tc.history {
			s.Accept(tok, false)
		}
		logits := make([]float32, len(tc.probs))
		for i, c := range logitsOf(tc.probs) {
			logits[i] = c.Logit
		}
		if got := softmaxOf(s.candidates(logits, false), len(tc.probs)); !near(got, tc.want, 1e-5) {
			t.Errorf("history %v, allowed %d, last %d: got %v, want %v", tc.history, tc.allowed, tc.lastN, got, tc.want)
		}
	}
}

// naiveDRY is DRY's penalties by definition, in quadratic time.
func naiveDRY(h []engine.Token, d DRY) map[engine.Token]float32 {
	if d.LastN > 0 && len(h) > d.LastN {
		h = h[len(h)-d.LastN:]
	}
	n := len(h)
	pen := map[engine.Token]float32{}
	if n <= d.AllowedLength {
		return pen
	}
	// The tokens after the latest breaker ending in the window (its longest
	// form at that place).
	limit := n
outer:
	for end := n - 1; end >= 0 && d.Breakers != nil; end-- {
		longest := -1
		for _, tail := range d.Breakers.tails[h[end]] {
			if end+len(tail) <= n-1 && slices.Equal(h[end+1:end+1+len(tail)], tail) && len(tail) > longest {
				longest = len(tail)
			}
		}
		if longest >= 0 {
			limit = n - 1 - end - longest
			break outer
		}
	}
	if limit < d.AllowedLength {
		return pen
	}
	longest := map[engine.Token]int{}
	for j := 0; j < n-1; j++ { // a repeat ending at j, followed by h[j+1]
		m := 0
		for m <= j && h[j-m] == h[n-1-m] {
			m++
		}
		m = min(m, limit)
		if m < d.AllowedLength {
			continue
		}
		if old, ok := longest[h[j+1]]; !ok || m > old {
			longest[h[j+1]] = m
		}
	}
	for tok, m := range longest {
		if !d.Breakers.single(tok) {
			pen[tok] = d.Multiplier * float32(math.Pow(float64(d.Base), float64(m-d.AllowedLength)))
		}
	}
	return pen
}

func TestDRYEqualsItsDefinition(t *testing.T) {
	r := rand.New(rand.NewPCG(7, 7))
	for trial := range 400 {
		d := DRY{
			Multiplier:    1.5,
			Base:          1.75,
			AllowedLength: r.IntN(4),
			LastN:         []int{-1, 5, 17}[r.IntN(3)],
			Breakers:      BreakerTokens([]engine.Token{3}, []engine.Token{2, 0, 1}),
		}
		if trial%3 == 0 {
			d.Breakers = nil
		}
		s := newDRY(d)
		var h []engine.Token
		for range 1 + r.IntN(80) {
			tok := engine.Token(r.IntN(4))
			if r.IntN(3) > 0 && len(h) > 3 { // repeat an earlier stretch
				tok = h[r.IntN(len(h))]
			}
			h = append(h, tok)
			s.accept(tok)
			c := make([]engine.TokenLogit, 4)
			s.apply(c)
			want := naiveDRY(h, d)
			for tok := range engine.Token(4) {
				if got := -c[tok].Logit; math.Abs(float64(got-want[tok])) > 1e-4 {
					t.Fatalf("trial %d, %+v, history %v: token %d penalty %v, want %v (all: %v)", trial, d, h, tok, got, want[tok], want)
				}
			}
		}
	}
}

// byteVocab tokenizes text a byte to a token (token = the byte) and renders
// its tokens by pieces.
type byteVocab struct{ pieces []string }

func (v byteVocab) Size() int { return len(v.pieces) }
func (v byteVocab) Tokenize(text string, _, _ bool) ([]engine.Token, error) {
	var out []engine.Token
	for _, b := range []byte(text) {
		out = append(out, engine.Token(b))
	}
	return out, nil
}

func TestNewBreakersLaysBreakersOverTheVocabulary(t *testing.T) {
	pieces := make([]string, 128)
	for i := range pieces {
		pieces[i] = string(rune(i))
	}
	pieces[0] = "ya"   // ends with the start of "ab"
	pieces[1] = "zab"  // holds "ab"
	pieces[2] = "b:"   // holds ":"
	pieces[3] = "xyab" // holds "ab"
	pieces[4] = "qa"   // ends with the start of "ab"
	v := byteVocab{pieces}
	raw := make([][]byte, len(pieces))
	for i, p := range pieces {
		raw[i] = []byte(p)
	}
	b, err := NewBreakers(v, raw, []string{"ab", ":"})
	if err != nil {
		t.Fatal(err)
	}
	for _, tok := range []engine.Token{1, 2, 3, ':'} {
		if !b.single(tok) {
			t.Errorf("token %d (%q) should be a breaker by itself", tok, pieces[tok])
		}
	}
	for _, tok := range []engine.Token{0, 4, 'a'} {
		if b.single(tok) || len(b.tails[tok]) != 1 || !slices.Equal(b.tails[tok][0], []engine.Token{'b'}) {
			t.Errorf("token %d (%q): tails %v, want one: [b]", tok, pieces[tok], b.tails[tok])
		}
	}
	if len(b.tails['b']) != 0 {
		t.Errorf("token b begins no breaker, got %v", b.tails['b'])
	}
	if _, err := NewBreakers(v, raw, []string{""}); err == nil {
		t.Error("an empty breaker was accepted")
	}
	if _, err := NewBreakers(v, raw, make([]string, MaxBreakers+1)); err == nil {
		t.Error("too many breakers were accepted")
	}
	long, err := NewBreakers(v, raw, []string{"a" + strings.Repeat("b", 2*MaxBreakerBytes)})
	if err != nil {
		t.Fatal(err)
	}
	if tails := long.tails['a']; len(tails) != 1 || len(tails[0]) != maxBreakerTail {
		t.Errorf("a long breaker's tail: %d tokens, want %d (cut)", len(tails[0]), maxBreakerTail)
	}
}

func TestDRYBreakerStopsARepeat(t *testing.T) {
	// "0 1 2 ... 0 1": token 2 would extend the repeat, unless a breaker
	// (token 9) stands between the repeat's start and now.
	penalised := func(h []engine.Token) bool {
		s := newDRY(DRY{Multiplier: 1, Base: 2, AllowedLength: 2, LastN: -1, Breakers: BreakerTokens([]engine.Token{9})})
		for _, tok := range h {
			s.accept(tok)
		}
		c := make([]engine.TokenLogit, 10)
		s.apply(c)
		return c[2].Logit < 0
	}
	if !penalised([]engine.Token{0, 1, 2, 5, 0, 1}) {
		t.Error("a repeat of 2 tokens was not penalised")
	}
	if penalised([]engine.Token{0, 1, 2, 5, 9, 1}) {
		t.Error("a repeat through a breaker was penalised")
	}
}

func TestTopNSigmaMatchesLlamaCpp(t *testing.T) {
	p := []float32{0.1, 0.2, 0.3, 0.4}
	for _, tc := range []struct {
		n    float32
		want []float32
	}{
		{1, []float32{0, 0, 0.428571, 0.571429}},
		{3, []float32{0.1, 0.2, 0.3, 0.4}},
	} {
		c := logitsOf(p)
		if got := softmaxOf(topNSigma(c, c[3].Logit, tc.n), 4); !near(got, tc.want, 1e-5) {
			t.Errorf("n %v: got %v, want %v", tc.n, got, tc.want)
		}
	}
}

func TestTypicalPMatchesLlamaCpp(t *testing.T) {
	for _, tc := range []struct {
		probs, want []float32
		p           float64
	}{
		{[]float32{0.97, 0.01, 0.01, 0.01}, []float32{1, 0, 0, 0}, 0.5},
		{[]float32{0.4, 0.2, 0.2, 0.2}, []float32{0, 1. / 3, 1. / 3, 1. / 3}, 0.5},
	} {
		c := make([]engine.TokenLogit, len(tc.probs))
		for i, x := range tc.probs {
			c[i] = engine.TokenLogit{Token: engine.Token(i), Logit: x}
		}
		var s Sampler
		kept, _ := s.typicalP(c, 1, tc.p)
		if got := normalised(kept, len(tc.probs)); !near(got, tc.want, 1e-5) {
			t.Errorf("%v at %v: got %v, want %v", tc.probs, tc.p, got, tc.want)
		}
	}
}

func TestXTCMatchesLlamaCpp(t *testing.T) {
	p := []float32{0.4, 0.3, 0.2, 0.1}
	for _, tc := range []struct {
		threshold float64
		want      []engine.Token
	}{
		{0.09, []engine.Token{3}},
		{0.19, []engine.Token{2, 3}},
		{0.29, []engine.Token{1, 2, 3}},
		{0.39, []engine.Token{0, 1, 2, 3}}, // one above the threshold: nothing removed
	} {
		c := make([]engine.TokenLogit, len(p))
		for i, x := range p {
			c[i] = engine.TokenLogit{Token: engine.Token(i), Logit: x}
		}
		kept, sum := xtc(c, 1, tc.threshold, 0)
		var got []engine.Token
		var mass float64
		for _, x := range kept {
			got = append(got, x.Token)
			mass += float64(x.Logit)
		}
		slices.Sort(got)
		if !slices.Equal(got, tc.want) || math.Abs(mass-sum) > 1e-6 {
			t.Errorf("threshold %v: kept %v (sum %v of %v), want %v", tc.threshold, got, sum, mass, tc.want)
		}
	}
}

// drawCounts samples n tokens from fixed logits with p and counts them.
func drawCounts(t *testing.T, p Params, logits []float32, n int) []int {
	t.Helper()
	s := mustNew(t, p, nil)
	counts := make([]int, len(logits))
	for range n {
		x, err := s.Sample(logits)
		if err != nil {
			t.Fatal(err)
		}
		counts[x.Token]++
	}
	return counts
}

func TestXTCProbabilityGatesIt(t *testing.T) {
	logits := make([]float32, 4)
	for i, c := range logitsOf([]float32{0.4, 0.3, 0.2, 0.1}) {
		logits[i] = c.Logit
	}
	const n = 4000
	always := drawCounts(t, Params{Temperature: 1, XTCProbability: 1, XTCThreshold: 0.09, Seed: 1}, logits, n)
	if always[3] != n {
		t.Errorf("XTC at probability 1: %v, want only token 3", always)
	}
	off := drawCounts(t, Params{Temperature: 1, XTCProbability: 1, XTCThreshold: 0.6, Seed: 1}, logits, n)
	if off[0] < n/3 {
		t.Errorf("XTC with a threshold above 0.5 removed tokens: %v", off)
	}
	// Half the time: token 0 keeps half its 0.4.
	half := drawCounts(t, Params{Temperature: 1, XTCProbability: 0.5, XTCThreshold: 0.09, Seed: 1}, logits, n)
	if f := float64(half[0]) / n; math.Abs(f-0.2) > 0.03 {
		t.Errorf("XTC at probability 0.5: token 0 drawn %.3f of the time, want 0.2", f)
	}
}

func TestDynamicTemperature(t *testing.T) {
	flat := logitsOf([]float32{0.25, 0.25, 0.25, 0.25})
	if got := dynamicTemp(flat, flat[0].Logit, 1, 0.5, 1); math.Abs(got-1.5) > 1e-9 {
		t.Errorf("highest entropy: temperature %v, want 1.5", got)
	}
	peaked := logitsOf([]float32{0.999997, 0.000001, 0.000001, 0.000001})
	if got := dynamicTemp(peaked, peaked[0].Logit, 1, 0.5, 1); got > 0.501 {
		t.Errorf("entropy near 0: temperature %v, want about 0.5", got)
	}
	mid := logitsOf([]float32{0.7, 0.1, 0.1, 0.1})
	lin, sq := dynamicTemp(mid, mid[0].Logit, 1, 1, 1), dynamicTemp(mid, mid[0].Logit, 1, 1, 2)
	if norm := lin / 2; math.Abs(sq-2*norm*norm) > 1e-9 {
		t.Errorf("exponent 2: temperature %v, want %v", sq, 2*norm*norm)
	}
	// Greedy only when the whole range is 0.
	if (Params{DynatempRange: 0.5}).greedy() {
		t.Error("temperature 0 with a range was taken as greedy")
	}
}

func TestMirostat2KeepsSurpriseBelowMu(t *testing.T) {
	// Surprises 1, 2, 3, 3 bits; tau 1 makes mu 2: tokens 0 and 1 only.
	logits := make([]float32, 4)
	for i, c := range logitsOf([]float32{0.5, 0.25, 0.125, 0.125}) {
		logits[i] = c.Logit
	}
	s := mustNew(t, Params{Temperature: 1, Mirostat: 2, MirostatTau: 1, MirostatEta: 0.1, Seed: 3}, nil)
	x, err := s.Sample(logits)
	if err != nil {
		t.Fatal(err)
	}
	if x.Token > 1 {
		t.Fatalf("drew token %d, beyond mu", x.Token)
	}
	p := []float64{2. / 3, 1. / 3}[x.Token] // renormalised over the two
	if want := 2 - 0.1*(-math.Log2(p)-1); math.Abs(s.mu-want) > 1e-9 {
		t.Errorf("mu after token %d: %v, want %v", x.Token, s.mu, want)
	}
}

func TestMirostatHoldsTheSurpriseAtTau(t *testing.T) {
	logits := randomLogits(5, 4000)
	for _, version := range []int{1, 2} {
		const tau, eta = 4.0, 0.1
		s := mustNew(t, Params{Temperature: 1, Mirostat: version, MirostatTau: tau, MirostatEta: eta, Seed: 9}, nil)
		var total float64
		const steps = 3000
		for i := range steps {
			mu := s.mu
			if _, err := s.Sample(logits); err != nil {
				t.Fatal(err)
			}
			if i >= steps/2 {
				total += tau + (mu-s.mu)/eta // the surprise observed
			}
		}
		if mean := total / (steps / 2); math.Abs(mean-tau) > 0.25 {
			t.Errorf("mirostat %d: mean surprise %.3f bits, want about %v", version, mean, tau)
		}
	}
}

func TestMirostat1FitsZipf(t *testing.T) {
	// p_i ∝ 1/(i+1)^1.2: the fitted exponent is 1.2 and k follows from it.
	const n, sExp, mu = 1000, 1.2, 6.0
	c := make([]engine.TokenLogit, n)
	var sum float64
	for i := range c {
		p := math.Pow(float64(i+1), -sExp)
		c[i] = engine.TokenLogit{Token: engine.Token(i), Logit: float32(p)}
		sum += p
	}
	eps := sExp - 1
	want := int(math.Pow(eps*math.Pow(2, mu)/(1-math.Pow(n, -eps)), 1/sExp))
	kept, _ := mirostat1(c, sum, mu, n)
	if len(kept) < want-1 || len(kept) > want+1 {
		t.Fatalf("kept %d, want %d", len(kept), want)
	}
	for _, x := range kept {
		if int(x.Token) >= len(kept)+1 {
			t.Fatalf("kept token %d, not among the %d most likely", x.Token, len(kept))
		}
	}
}

func TestDRYAppliesToGreedy(t *testing.T) {
	// Token 2 is the best, but follows "0 1" again.
	logits := []float32{0, 0, 2, 1}
	d := DRY{Multiplier: 3, Base: 1.75, AllowedLength: 2, LastN: -1}
	s := mustNew(t, Params{DRY: d}, nil)
	for _, tok := range []engine.Token{0, 1, 2, 3, 0, 1} {
		s.Accept(tok, false)
	}
	x, err := s.Sample(logits)
	if err != nil || x.Token != 3 {
		t.Fatalf("greedy with DRY: %v %v, want 3", x.Token, err)
	}
}

func TestLlamaSamplersValidate(t *testing.T) {
	for _, p := range []Params{
		{TypicalP: 1.5},
		{XTCProbability: -0.1},
		{XTCThreshold: -1},
		{Mirostat: 3},
		{Mirostat: 2, MirostatTau: -1},
		{DynatempRange: -1},
		{TopNSigma: float32(math.NaN())},
		{DRY: DRY{Multiplier: 1, Base: 0.5, LastN: -1}},
		{DRY: DRY{Multiplier: 1, Base: 2, AllowedLength: -1, LastN: -1}},
		{DRY: DRY{Multiplier: 1, Base: 2, LastN: -2}},
		{DRY: DRY{Multiplier: -1}},
	} {
		if _, err := New(p, nil); err == nil {
			t.Errorf("%+v was accepted", p)
		}
	}
	// DRY off: its other fields do not matter.
	if _, err := New(Params{DRY: DRY{Base: 0}}, nil); err != nil {
		t.Error(err)
	}
}

func BenchmarkLlamaSamplers(b *testing.B) {
	logits := randomLogits(11, 152064) // Qwen2.5's vocabulary
	history := make([]engine.Token, 4096)
	r := rand.New(rand.NewPCG(1, 2))
	for i := range history {
		history[i] = engine.Token(r.IntN(2000))
	}
	for _, bc := range []struct {
		name string
		p    Params
	}{
		{"base", Params{Temperature: 0.8, TopK: 40, TopP: 0.95, MinP: 0.05}},
		{"dry-4k", Params{Temperature: 0.8, TopK: 40, TopP: 0.95, MinP: 0.05, DRY: DRY{Multiplier: 0.8, Base: 1.75, AllowedLength: 2, LastN: -1}}},
		{"xtc", Params{Temperature: 0.8, TopK: 40, TopP: 0.95, MinP: 0.05, XTCProbability: 0.5, XTCThreshold: 0.1}},
		{"whole-vocab", Params{Temperature: 1}},
		{"min-p-whole-vocab", Params{Temperature: 1.5, MinP: 0.05, TopP: 0.95}},
		{"min-p-whole-vocab-temperature-last", Params{Temperature: 1.5, MinP: 0.05, TopP: 0.95, Order: []Stage{StagePenalties, StageDRY,
			StageTopNSigma, StageTopK, StageTypicalP, StageTopP, StageMinP, StageXTC, StageTemperature}}},
		{"typical-whole-vocab", Params{Temperature: 1, TypicalP: 0.9}},
		{"top-n-sigma", Params{Temperature: 1, TopNSigma: 1}},
		{"dynatemp", Params{Temperature: 1, DynatempRange: 0.5, DynatempExponent: 1}},
		{"mirostat1", Params{Temperature: 1, Mirostat: 1, MirostatTau: 5, MirostatEta: 0.1}},
		{"mirostat2", Params{Temperature: 1, Mirostat: 2, MirostatTau: 5, MirostatEta: 0.1}},
	} {
		b.Run(bc.name, func(b *testing.B) {
			s, err := New(bc.p, nil)
			if err != nil {
				b.Fatal(err)
			}
			for _, tok := range history {
				s.Accept(tok, false)
			}
			for b.Loop() {
				x, err := s.Sample(logits)
				if err != nil {
					b.Fatal(err)
				}
				s.Accept(x.Token, true)
			}
		})
	}
}

func TestTypicalPBucketsEqualSortingAll(t *testing.T) {
	r := rand.New(rand.NewPCG(3, 4))
	for trial := range 20 {
		n := []int{50, 3000, 40000}[trial%3]
		c := make([]engine.TokenLogit, n)
		var sum float64
		for i := range c {
			x := math.Exp(r.NormFloat64() * 2)
			c[i] = engine.TokenLogit{Token: engine.Token(i), Logit: float32(x)}
			sum += float64(float32(x))
		}
		p := []float64{0.2, 0.5, 0.9, 0.99}[trial%4]
		// By definition: every candidate sorted by distance from the entropy.
		var h float64
		for _, x := range c {
			q := float64(x.Logit) / sum
			h -= q * math.Log(q)
		}
		ref := make([]typicalCand, n)
		for i, x := range c {
			ref[i] = typicalCand{x, math.Abs(-math.Log(float64(x.Logit)/sum) - h)}
		}
		want := ref[:closest(ref, 0, p, sum)]
		var s Sampler
		kept, _ := s.typicalP(slices.Clone(c), sum, p)
		got := make([]engine.Token, len(kept))
		for i, x := range kept {
			got[i] = x.Token
		}
		wantTok := make([]engine.Token, len(want))
		for i, x := range want {
			wantTok[i] = x.x.Token
		}
		slices.Sort(got)
		slices.Sort(wantTok)
		if !slices.Equal(got, wantTok) {
			t.Fatalf("n %d, p %v: kept %d tokens, want %d", n, p, len(got), len(wantTok))
		}
	}
}

// BenchmarkDRY is DRY's search for repeats alone, by the length of the history
// it searches (a window of that many tokens, as a sequence that long with
// penalty_last_n -1 has).
func BenchmarkDRY(b *testing.B) {
	for _, n := range []int{4096, 32768} {
		b.Run(fmt.Sprintf("history=%d", n), func(b *testing.B) {
			r := rand.New(rand.NewPCG(1, 2))
			s := newDRY(DRY{Multiplier: 0.8, Base: 1.75, AllowedLength: 2, LastN: n, Breakers: BreakerTokens([]engine.Token{13})})
			for range n {
				s.accept(engine.Token(r.IntN(2000)))
			}
			c := make([]engine.TokenLogit, 2000)
			for b.Loop() {
				s.accept(engine.Token(r.IntN(2000)))
				s.apply(c)
			}
		})
	}
}

// TestInfiniteLogits: logits a penalty pushed to +Inf (repetition_penalty near
// 0 divides them) are drawn among, alike, under every truncation; they once
// left top-n-sigma and min-p nothing to draw from.
func TestInfiniteLogits(t *testing.T) {
	inf := float32(math.Inf(1))
	logits := []float32{1, inf, 2, inf, 0}
	for _, p := range []Params{
		{Temperature: 1, TopNSigma: 1},
		{Temperature: 1, MinP: 0.1},
		{Temperature: 1, TypicalP: 0.5, TopP: 0.9},
		{Temperature: 1, DynatempRange: 0.5, DynatempExponent: 1},
		{Temperature: 1, Mirostat: 1, MirostatTau: 5, MirostatEta: 0.1},
		{Temperature: 1, Mirostat: 2, MirostatTau: 5, MirostatEta: 0.1},
		{Temperature: 1, XTCProbability: 1, XTCThreshold: 0.1},
	} {
		counts := drawCounts(t, p, logits, 200)
		if counts[1]+counts[3] != 200 || counts[1] == 0 || counts[3] == 0 {
			t.Errorf("%+v: drew %v, want tokens 1 and 3 only, both", p, counts)
		}
	}
}

// TestMinPAfterTypicalP: min-p is relative to the most likely token typical-p
// kept, which need not be the most likely one.
func TestMinPAfterTypicalP(t *testing.T) {
	logits := make([]float32, 4)
	for i, c := range logitsOf([]float32{0.4, 0.2, 0.2, 0.2}) {
		logits[i] = c.Logit
	}
	// Typical-p 0.5 keeps tokens 1, 2 and 3 (llama.cpp's test); min-p 0.9 of
	// the best among them keeps them all.
	counts := drawCounts(t, Params{Temperature: 1, TypicalP: 0.5, MinP: 0.9, Seed: 2}, logits, 600)
	if counts[0] != 0 || counts[1] == 0 || counts[2] == 0 || counts[3] == 0 {
		t.Errorf("drew %v, want tokens 1, 2 and 3", counts)
	}
}

func TestDRYWindowNearMaxInt(t *testing.T) {
	s := mustNew(t, Params{Temperature: 1, DRY: DRY{Multiplier: 1, Base: 2, AllowedLength: 2, LastN: math.MaxInt/2 + 1}}, nil)
	for i := range 10 {
		s.Accept(engine.Token(i%3), false)
	}
	if _, err := s.Sample(make([]float32, 4)); err != nil {
		t.Fatal(err)
	}
}

// refInOrder is a request's order of top-k (k), top-p (p), min-p (m) and
// temperature (t) by their definitions, over probabilities sorted most likely
// first, renormalised after each: the distribution left, by token id.
func refInOrder(probs []float64, order string, k int, topP, minP, temp float64) map[engine.Token]float64 {
	type tp struct {
		t engine.Token
		p float64
	}
	var c []tp
	for i, p := range probs {
		c = append(c, tp{engine.Token(i), p})
	}
	slices.SortFunc(c, func(a, b tp) int {
		if a.p != b.p {
			if a.p > b.p {
				return -1
			}
			return 1
		}
		return int(a.t - b.t)
	})
	norm := func() {
		var sum float64
		for _, x := range c {
			sum += x.p
		}
		for i := range c {
			c[i].p /= sum
		}
	}
	norm()
	for _, st := range order {
		switch st {
		case 'k':
			c = c[:min(k, len(c))]
		case 'p':
			acc := 0.0
			for i, x := range c {
				if acc += x.p; acc >= topP {
					c = c[:i+1]
					break
				}
			}
		case 'm':
			floor := minP * c[0].p
			c = slices.DeleteFunc(c, func(x tp) bool { return x.p < floor })
		case 't':
			for i := range c {
				c[i].p = math.Pow(c[i].p, 1/temp)
			}
		}
		norm()
	}
	out := map[engine.Token]float64{}
	for _, x := range c {
		out[x.t] = x.p
	}
	return out
}

// TestOrderAsLlamaCpp: a request's own order of samplers (llama-server's
// "samplers") keeps what the truncations keep by definition, applied in that
// order, each over what the ones before it left; the orders are those of
// llama.cpp's sampler-queue tests (weights growing with the token id) and
// temperature before or after them.
func TestOrderAsLlamaCpp(t *testing.T) {
	const n = 10000
	probs := make([]float64, n)
	logits := make([]engine.TokenLogit, n)
	for i := range probs {
		probs[i] = float64(i + 1)
		logits[i] = engine.TokenLogit{Token: engine.Token(i), Logit: float32(math.Log(float64(i + 1)))}
	}
	stage := map[rune]Stage{'k': StageTopK, 'p': StageTopP, 'm': StageMinP, 't': StageTemperature}
	for _, order := range []string{"k", "p", "m", "kp", "km", "pk", "pm", "mk", "mp", "kpm", "kmp", "pkm", "pmk", "mkp", "mpk", "tmp", "mpt", "kmt", "tkm"} {
		for _, temp := range []float64{0.5, 1.5} {
			p := Params{Temperature: float32(temp), TopK: 100, TopP: 0.8, MinP: 0.1}
			for _, st := range order {
				p.Order = append(p.Order, stage[st])
			}
			s := mustNew(t, p, nil)
			o := s.truncateInOrder(slices.Clone(logits))
			o.toLogits()
			kept := o.c
			got := softmaxOf(kept, n)
			want := refInOrder(probs, order, 100, 0.8, 0.1, temp)
			if len(kept) != len(want) {
				t.Errorf("%s at %v: kept %d, want %d", order, temp, len(kept), len(want))
				continue
			}
			for tok, w := range want {
				if math.Abs(got[tok]-w) > 1e-5 {
					t.Errorf("%s at %v: token %d %.6f, want %.6f", order, temp, tok, got[tok], w)
					break
				}
			}
		}
	}
}

// TestTemperatureLast: min-p before temperature (SillyTavern's order, as
// llama-server takes it) truncates the model's own distribution, which a high
// temperature then flattens; shoal's own order truncates the flattened one and
// keeps more.
func TestTemperatureLast(t *testing.T) {
	logits := []float32{4, 3, 2, 1, 0, -1}
	p := Params{Temperature: 2, MinP: 0.1, Seed: 5}
	first := drawCounts(t, p, logits, 4000)
	p.Order = []Stage{StagePenalties, StageDRY, StageTopK, StageTypicalP, StageTopP, StageMinP, StageXTC, StageTemperature}
	last := drawCounts(t, p, logits, 4000)
	// At temperature 1 token 3 is e^-3 = 0.05 of the best: below min-p.
	if last[3]+last[4]+last[5] != 0 {
		t.Errorf("temperature last: drew %v, want none of tokens 3-5", last)
	}
	if first[3] == 0 {
		t.Errorf("temperature first: drew %v, want token 3 too (e^-1.5 = 0.22 of the best)", first)
	}
}

// TestOrderLeavesOutWhatItDoesNotList: penalties and DRY apply only when the
// order lists them, as in llama-server; temperature not listed is 1.
func TestOrderLeavesOutWhatItDoesNotList(t *testing.T) {
	logits := []float32{1, 5, 1, 1}
	p := Params{RepeatPenalty: 100, DRY: DRY{Multiplier: 50, Base: 2, AllowedLength: 1, LastN: -1}, Order: []Stage{StageTopK}}
	s := mustNew(t, p, nil)
	for _, tok := range []engine.Token{1, 2, 1} {
		s.Accept(tok, false)
	}
	if x, err := s.Sample(logits); err != nil || x.Token != 1 {
		t.Errorf("penalties and DRY not listed: %v %v, want token 1", x.Token, err)
	}
	p.Order = []Stage{StagePenalties}
	s = mustNew(t, p, nil)
	for _, tok := range []engine.Token{1, 2, 1} {
		s.Accept(tok, false)
	}
	if x, err := s.Sample(logits); err != nil || x.Token == 1 {
		t.Errorf("penalties listed: %v %v, want another token than 1", x.Token, err)
	}
}

// TestOrderEdges: a request's order with tokens far below the best (DRY's
// penalties, a bias), a temperature small enough to overflow a logit divided
// by it, and temperature 0 after typical-p, which may cut the likeliest.
func TestOrderEdges(t *testing.T) {
	full := []Stage{StagePenalties, StageDRY, StageTopNSigma, StageTopK, StageTypicalP, StageTopP, StageMinP, StageXTC, StageTemperature}
	// Tokens 3 and 4 are the typical ones, alike; token 5 is e^-205 of them.
	c := drawCounts(t, Params{Temperature: 1, TypicalP: 0.5, Order: []Stage{StageTypicalP, StageTemperature}, Seed: 1},
		[]float32{0, 0, 0, 5, 5, -200}, 2000)
	if c[3] < 800 || c[4] < 800 || c[3]+c[4] != 2000 {
		t.Errorf("typical-p over a token of probability 0: %v", c)
	}
	c = drawCounts(t, Params{Temperature: 1, TopNSigma: 1, XTCProbability: 1, XTCThreshold: 0.5, Order: []Stage{StageXTC, StageTopNSigma}, Seed: 1},
		[]float32{5, 4, 3, -200}, 200)
	if c[0] != 200 {
		t.Errorf("top-n-sigma after XTC: %v, want token 0 (the only one XTC's threshold passes)", c)
	}
	for _, p := range []Params{
		{Temperature: 0.5, DynatempRange: 0.5, DynatempExponent: 4, Order: []Stage{StageTemperature}},
		{Temperature: 1e-38, Order: full},
	} {
		if c := drawCounts(t, p, []float32{30, 1, 0, -3}, 200); c[0] != 200 {
			t.Errorf("%+v: %v, want token 0", p, c)
		}
	}
	// Typical-p keeps tokens 1-3 (llama.cpp's test); temperature 0 after it
	// keeps the likeliest of those.
	p := Params{TypicalP: 0.5, Order: []Stage{StageTypicalP, StageTemperature}}
	logits := make([]float32, 4)
	for i, x := range logitsOf([]float32{0.4, 0.2, 0.2, 0.2}) {
		logits[i] = x.Logit
	}
	if c := drawCounts(t, p, logits, 100); c[1] != 100 {
		t.Errorf("temperature 0 after typical-p: %v, want token 1", c)
	}
	if (Params{Order: []Stage{StageTopK}}).greedy() || !(Params{Order: []Stage{StageTopK, StageTemperature}}).greedy() {
		t.Error("greedy: an order without temperature draws at 1, with it at 0 greedily")
	}
}

// FuzzSampler: no parameters Validate accepts and no logits (NaN, ±Inf, huge)
// make a draw panic or return a token outside the vocabulary.
func FuzzSampler(f *testing.F) {
	f.Add([]byte{1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20}, []byte("\x00\x10\x20\x30\x7f\xff\x80"), uint64(1))
	f.Add([]byte{0, 0, 0, 255, 255, 255, 9, 9, 9, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11}, []byte("\xff\xff\x7f\x00"), uint64(7))
	f.Fuzz(func(t *testing.T, params, raw []byte, seed uint64) {
		if len(raw) < 2 || len(raw) > 512 {
			return
		}
		at := func(i int) float32 { // params byte i as a number in [0, 1]
			if i < len(params) {
				return float32(params[i]) / 255
			}
			return 0
		}
		p := Params{
			Temperature: at(0) * 2, TopK: int(at(1) * 10), TopP: at(2), MinP: at(3) * at(3), RepeatPenalty: at(4) * 3,
			TopNSigma: at(5)*4 - 1, TypicalP: at(6), XTCProbability: at(7), XTCThreshold: at(8) * 0.6,
			DynatempRange: at(9), DynatempExponent: at(10) * 3, Mirostat: int(at(11)*3) % 3, MirostatTau: at(12) * 8, MirostatEta: at(13),
			DRY:  DRY{Multiplier: at(14) * 3, Base: 1 + at(15)*2, AllowedLength: int(at(16) * 4), LastN: int(at(17)*20) - 1, Breakers: BreakerTokens([]engine.Token{1}, []engine.Token{2, 3})},
			Seed: seed, MinKeep: int(at(20) * 5),
		}
		if at(18) > 0.5 {
			all := []Stage{StagePenalties, StageDRY, StageTopNSigma, StageTopK, StageTypicalP, StageTopP, StageMinP, StageXTC, StageTemperature}
			for i := range int(at(19) * 12) {
				p.Order = append(p.Order, all[(int(seed)+i*int(1+at(i%20)*7))%len(all)])
			}
			if p.Order == nil {
				p.Order = []Stage{}
			}
		}
		if p.Validate() != nil {
			return
		}
		logits := make([]float32, len(raw))
		for i, b := range raw {
			switch b {
			case 0xff:
				logits[i] = float32(math.Inf(1))
			case 0xfe:
				logits[i] = float32(math.Inf(-1))
			case 0xfd:
				logits[i] = float32(math.NaN())
			case 0xfc:
				logits[i] = math.MaxFloat32
			default:
				logits[i] = float32(int(b)-128) / 4
			}
		}
		s, err := New(p, nil)
		if err != nil {
			t.Fatal(err)
		}
		for range 6 {
			x, err := s.Sample(logits)
			if err != nil {
				continue
			}
			if x.Token < 0 || int(x.Token) >= len(logits) {
				t.Fatalf("%+v: token %d outside %d", p, x.Token, len(logits))
			}
			s.Accept(x.Token, true)
		}
	})
}

// TestMinKeep: llama-server's min_keep keeps at least that many tokens
// through top-p, min-p, typical-p and XTC, in shoal's order and in a
// request's own.
func TestMinKeep(t *testing.T) {
	probs := []float32{0.1, 0.2, 0.3, 0.4}
	logits := make([]float32, 4)
	for i, x := range logitsOf(probs) {
		logits[i] = x.Logit
	}
	peaked := make([]float32, 4)
	for i, x := range logitsOf([]float32{0.97, 0.01, 0.01, 0.01}) {
		peaked[i] = x.Logit
	}
	for _, tc := range []struct {
		name   string
		p      Params
		logits []float32
		want   []engine.Token // the tokens drawn, each at least once
	}{
		{"top-p", Params{TopP: 0.3, MinKeep: 3}, logits, []engine.Token{1, 2, 3}},
		{"min-p", Params{MinP: 0.76, MinKeep: 2}, logits, []engine.Token{2, 3}},
		{"typical-p", Params{TypicalP: 0.5, MinKeep: 2}, peaked, []engine.Token{0, 1}},
		{"xtc", Params{XTCProbability: 1, XTCThreshold: 0.09, MinKeep: 2}, logits, []engine.Token{0, 1, 2, 3}},
	} {
		for _, order := range [][]Stage{nil, {StageTypicalP, StageTopP, StageMinP, StageXTC, StageTemperature}} {
			p := tc.p
			p.Temperature, p.Seed, p.Order = 1, 3, order
			c := drawCounts(t, p, tc.logits, 3000)
			var got []engine.Token
			for tok, n := range c {
				if n > 0 {
					got = append(got, engine.Token(tok))
				}
			}
			if !slices.Equal(got, tc.want) {
				t.Errorf("%s (order %v): drew %v (%v), want %v", tc.name, order, got, c, tc.want)
			}
		}
	}
}

// TestMirostatWithoutPenalties: under Mirostat the penalties and DRY are left
// out, as llama-server chains Mirostat after logit bias and temperature alone:
// the draws are those of a sampler without them.
func TestMirostatWithoutPenalties(t *testing.T) {
	logits := randomLogits(11, 500)
	for _, version := range []int{1, 2} {
		plain := Params{Temperature: 1, Mirostat: version, MirostatTau: 5, MirostatEta: 0.1, Seed: 4}
		penalised := plain
		penalised.RepeatPenalty, penalised.FrequencyPenalty, penalised.PresencePenalty = 1.5, 1, 1
		penalised.DRY = DRY{Multiplier: 0.8, Base: 1.75, AllowedLength: 2, LastN: -1}
		a, b := mustNew(t, plain, nil), mustNew(t, penalised, nil)
		for i := range 200 {
			x, err1 := a.Sample(logits)
			y, err2 := b.Sample(logits)
			if err1 != nil || err2 != nil || x.Token != y.Token {
				t.Fatalf("mirostat %d, draw %d: %v %v, %v %v", version, i, x.Token, err1, y.Token, err2)
			}
			a.Accept(x.Token, true)
			b.Accept(y.Token, true)
		}
	}
}
