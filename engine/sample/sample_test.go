package sample

import (
	"errors"
	"fmt"
	"math"
	"math/rand/v2"
	"slices"
	"testing"

	"github.com/shoal-ai/shoal/engine"
)

func randomLogits(seed uint64, n int) []float32 {
	r := rand.New(rand.NewPCG(seed, 1))
	l := make([]float32, n)
	for i := range l {
		l[i] = float32(r.NormFloat64() * 3)
	}
	return l
}

func mustNew(t *testing.T, p Params, g engine.Grammar) *Sampler {
	t.Helper()
	s, err := New(p, g)
	if err != nil {
		t.Fatal(err)
	}
	return s
}

func TestGreedyPicksArgmax(t *testing.T) {
	l := randomLogits(1, 5000)
	want := argmax(l)
	for _, p := range []Params{{}, {TopK: 1, Temperature: 1}, {Temperature: 0, TopP: 0.5}} {
		got, err := mustNew(t, p, nil).Sample(l)
		if err != nil || got.Token != want {
			t.Fatalf("%+v: got %v %v, want %d", p, got.Token, err, want)
		}
	}
}

func TestSeedDeterminism(t *testing.T) {
	l := randomLogits(2, 4000)
	p := Params{Temperature: 1.2, TopP: 0.95, TopK: 100, MinP: 0.01, Seed: 42}
	draw := func(seed uint64) []engine.Token {
		p.Seed = seed
		s := mustNew(t, p, nil)
		var out []engine.Token
		for range 50 {
			x, err := s.Sample(l)
			if err != nil {
				t.Fatal(err)
			}
			out = append(out, x.Token)
		}
		return out
	}
	a, b, c := draw(42), draw(42), draw(43)
	same := func(x, y []engine.Token) bool {
		for i := range x {
			if x[i] != y[i] {
				return false
			}
		}
		return true
	}
	if !same(a, b) {
		t.Fatal("same seed gave different draws")
	}
	if same(a, c) {
		t.Fatal("different seeds gave identical 50 draws")
	}
}

func TestTopKAndTopPRestrictSupport(t *testing.T) {
	l := []float32{5, 4, 3, 2, 1, 0}
	seen := map[engine.Token]bool{}
	s := mustNew(t, Params{Temperature: 5, TopK: 2, Seed: 1}, nil)
	for range 500 {
		x, _ := s.Sample(l)
		seen[x.Token] = true
	}
	if len(seen) != 2 || !seen[0] || !seen[1] {
		t.Fatalf("top_k=2 drew %v", seen)
	}
	// With a flat distribution, top_p=0.5 over 6 tokens keeps the 3 most likely.
	flat := []float32{3, 2.999, 2.998, 2.997, 2.996, 2.995}
	seen = map[engine.Token]bool{}
	s = mustNew(t, Params{Temperature: 1, TopP: 0.5, Seed: 2}, nil)
	for range 500 {
		x, _ := s.Sample(flat)
		seen[x.Token] = true
	}
	if len(seen) != 3 || seen[3] || seen[4] || seen[5] {
		t.Fatalf("top_p=0.5 drew %v", seen)
	}
	// min_p=0.5 keeps only tokens at least half as likely as the best.
	seen = map[engine.Token]bool{}
	s = mustNew(t, Params{Temperature: 1, MinP: 0.5, Seed: 3}, nil)
	for range 500 {
		x, _ := s.Sample([]float32{0, float32(math.Log(0.6)), float32(math.Log(0.4)), -5})
		seen[x.Token] = true
	}
	if len(seen) != 2 || !seen[0] || !seen[1] {
		t.Fatalf("min_p=0.5 drew %v", seen)
	}
}

func TestLogitBiasAndPenalties(t *testing.T) {
	l := []float32{1, 3, 2}
	x, _ := mustNew(t, Params{LogitBias: map[engine.Token]float32{1: -100}}, nil).Sample(l)
	if x.Token != 2 {
		t.Fatalf("banned token: got %d", x.Token)
	}
	x, _ = mustNew(t, Params{LogitBias: map[engine.Token]float32{0: 5}}, nil).Sample(l)
	if x.Token != 0 {
		t.Fatalf("bias +5: got %d", x.Token)
	}
	s := mustNew(t, Params{PresencePenalty: 1.5}, nil)
	s.Accept(1, true)
	if x, _ = s.Sample(l); x.Token != 2 {
		t.Fatalf("presence penalty: got %d", x.Token)
	}
	s = mustNew(t, Params{RepeatPenalty: 4, RepeatLastN: 1}, nil)
	s.Accept(1, true)
	if x, _ = s.Sample(l); x.Token != 2 {
		t.Fatalf("repeat penalty: got %d", x.Token)
	}
	s.Accept(2, true) // window of 1: token 1 leaves it
	if x, _ = s.Sample(l); x.Token != 1 {
		t.Fatalf("repeat window: got %d", x.Token)
	}
	s = mustNew(t, Params{FrequencyPenalty: 0.6}, nil)
	s.Accept(1, true)
	s.Accept(1, true)
	if x, _ = s.Sample(l); x.Token != 2 {
		t.Fatalf("frequency penalty: got %d", x.Token)
	}
}

func TestLogprobs(t *testing.T) {
	l := randomLogits(3, 1000)
	x, err := mustNew(t, Params{TopLogprobs: 5}, nil).Sample(l)
	if err != nil {
		t.Fatal(err)
	}
	if len(x.Top) != 5 || x.Top[0].Token != x.Token || x.Top[0].Logprob != x.Logprob {
		t.Fatalf("top logprobs %+v for %+v", x.Top, x)
	}
	for i := 1; i < 5; i++ {
		if x.Top[i].Logprob > x.Top[i-1].Logprob {
			t.Fatal("top logprobs not descending")
		}
	}
	var sum float64
	lse := logSumExp(l)
	for _, v := range l {
		sum += math.Exp(float64(v - lse))
	}
	if math.Abs(sum-1) > 1e-3 {
		t.Fatalf("probabilities sum to %v", sum)
	}
}

// evenGrammar allows only even token ids.
type evenGrammar struct{ accepted []engine.Token }

func (g *evenGrammar) Apply(c []engine.TokenLogit) {
	for i := range c {
		if c[i].Token%2 != 0 {
			c[i].Logit = float32(math.Inf(-1))
		}
	}
}
func (g *evenGrammar) Accept(t engine.Token) { g.accepted = append(g.accepted, t) }
func (g *evenGrammar) Close() error          { return nil }

// onlyGrammar allows one token: a grammar that must end.
type onlyGrammar engine.Token

func (g onlyGrammar) Apply(c []engine.TokenLogit) {
	for i := range c {
		if c[i].Token != engine.Token(g) {
			c[i].Logit = float32(math.Inf(-1))
		}
	}
}
func (onlyGrammar) Accept(engine.Token) {}
func (onlyGrammar) Close() error        { return nil }

func TestMinTokens(t *testing.T) {
	l := []float32{1, 3, 2, 0}
	for _, p := range []Params{{}, {Temperature: 1, Seed: 3, TopK: 1}} {
		p.MinTokens, p.EndTokens = 2, []engine.Token{1, 3}
		s := mustNew(t, p, nil)
		var got []engine.Token
		for range 3 {
			x, err := s.Sample(l)
			if err != nil {
				t.Fatal(err)
			}
			got = append(got, x.Token)
			s.Accept(x.Token, true)
		}
		if !slices.Equal(got, []engine.Token{2, 2, 1}) {
			t.Errorf("%+v: drew %v, want the end token banned for two draws", p, got)
		}
	}
	// A grammar that allows only an end: min_tokens gives way.
	s := mustNew(t, Params{MinTokens: 5, EndTokens: []engine.Token{1}}, onlyGrammar(1))
	if x, err := s.Sample(l); err != nil || x.Token != 1 {
		t.Errorf("grammar's end: %v %v", x.Token, err)
	}
}

func TestGrammarConstrains(t *testing.T) {
	for _, p := range []Params{{}, {Temperature: 1, Seed: 9}} {
		g := &evenGrammar{}
		s := mustNew(t, p, g)
		for i := range 100 {
			x, err := s.Sample(randomLogits(uint64(i), 101))
			if err != nil {
				t.Fatal(err)
			}
			if x.Token%2 != 0 {
				t.Fatalf("%+v: grammar allowed odd token %d", p, x.Token)
			}
			s.Accept(x.Token, true)
		}
		if len(g.accepted) != 100 {
			t.Fatalf("grammar saw %d accepts", len(g.accepted))
		}
	}
}

func TestValidate(t *testing.T) {
	bad := []Params{{Temperature: -1}, {TopP: 1.5}, {MinP: -0.1}, {TopK: -1}, {FrequencyPenalty: 3},
		{TopLogprobs: 21}, {LogitBias: map[engine.Token]float32{1: 101}}, {Temperature: float32(math.NaN())}}
	for _, p := range bad {
		if _, err := New(p, nil); err == nil {
			t.Errorf("%+v: want error", p)
		}
	}
}

// TestSelectTop: the k best by better's order (logit, then lower id) end up in
// c[:k] and the rest in c[k:], on both paths (heap for k <= n/8, quickselect), with
// ties.
func TestSelectTop(t *testing.T) {
	for seed := range uint64(40) {
		n := []int{300, 5000, 128256}[seed%3]
		l := randomLogits(seed, n)
		for i := range l {
			if i%5 == 0 {
				l[i] = float32(int(l[i])) // ties
			}
		}
		c := make([]engine.TokenLogit, len(l))
		for i, v := range l {
			c[i] = engine.TokenLogit{Token: engine.Token(i), Logit: v}
		}
		k := []int{1, 40, int(seed*13)%(n-1) + 1, n / 8, n/8 + 1}[seed%5]
		ref := slices.Clone(c)
		slices.SortFunc(ref, better)
		selectTop(c, k)
		got := slices.Clone(c[:k])
		slices.SortFunc(got, better)
		if !slices.Equal(got, ref[:k]) {
			t.Fatalf("seed %d n %d k %d: top set differs from a full sort", seed, n, k)
		}
		all := slices.Clone(c)
		slices.SortFunc(all, better)
		if !slices.Equal(all, ref) {
			t.Fatalf("seed %d n %d k %d: c is no longer a permutation", seed, n, k)
		}
	}
}

// BenchmarkSample: one draw per op over vocabularies of 32k and 128k tokens with
// N(0, 3) logits (flatter than a model's: the hard case for top-p) and with a
// model-like spread (most tokens 10-25 below the best).
func BenchmarkSample(b *testing.B) {
	for _, n := range []int{32000, 128256} {
		flat := randomLogits(1, n)
		peaky := make([]float32, n)
		r := rand.New(rand.NewPCG(2, 1))
		for i := range peaky {
			peaky[i] = float32(-15 + 4*r.NormFloat64())
		}
		for i := range 20 {
			peaky[r.IntN(n)] = float32(-float64(i) / 2)
		}
		for _, c := range []struct {
			name string
			p    Params
		}{{"greedy", Params{}}, {"t1", Params{Temperature: 1}}, {"topk40", Params{Temperature: 0.8, TopK: 40}},
			{"topp0.95", Params{Temperature: 0.8, TopP: 0.95}}} {
			for _, l := range []struct {
				name string
				l    []float32
			}{{"flat", flat}, {"peaky", peaky}} {
				b.Run(fmt.Sprintf("vocab=%d/%s/%s", n, l.name, c.name), func(b *testing.B) {
					s, _ := New(c.p, nil)
					for b.Loop() {
						_, _ = s.Sample(l.l)
					}
				})
			}
		}
	}
}

// TestTopPKeepsTheShortestSortedPrefix: over a flat 128k vocabulary, where the 256
// most likely tokens fall short of the mass and top-p buckets the rest, the kept set
// is exactly the shortest prefix of the fully sorted candidates reaching the target.
func TestTopPKeepsTheShortestSortedPrefix(t *testing.T) {
	for _, c := range []struct {
		seed  uint64
		n     int
		sigma float64
		topP  float64
	}{{1, 128256, 3, 0.9}, {2, 32000, 1, 0.5}, {3, 4000, 0.2, 0.99}, {4, 128256, 8, 0.95}, {5, 1000, 3, 0.999999}} {
		r := rand.New(rand.NewPCG(c.seed, 7))
		cands := make([]engine.TokenLogit, c.n)
		var total float64
		for i := range cands {
			p := math.Exp(r.NormFloat64() * c.sigma)
			if i%97 == 0 && i > 0 { // ties across and inside buckets
				p = float64(cands[i-1].Logit)
			}
			cands[i] = engine.TokenLogit{Token: engine.Token(i), Logit: float32(p)}
			total += float64(float32(p))
		}
		ref := slices.Clone(cands)
		slices.SortFunc(ref, better)
		var acc float64
		want := len(ref)
		for i, x := range ref {
			acc += float64(x.Logit)
			if acc >= c.topP*total {
				want = i + 1
				break
			}
		}
		s := mustNew(t, Params{Temperature: 1, TopP: float32(c.topP)}, nil)
		got, mass := s.topP(cands, c.topP*total)
		if len(got) != want {
			t.Fatalf("seed %d: kept %d candidates, want %d", c.seed, len(got), want)
		}
		kept := map[engine.Token]bool{}
		var sum float64
		for _, x := range got {
			kept[x.Token] = true
			sum += float64(x.Logit)
		}
		for _, x := range ref[:want] {
			if !kept[x.Token] {
				t.Fatalf("seed %d: token %d (p %v) of the sorted prefix not kept", c.seed, x.Token, x.Logit)
			}
		}
		if math.Abs(sum-mass) > 1e-9*total || mass < c.topP*total*(1-1e-12) {
			t.Fatalf("seed %d: mass %v, kept %v, target %v", c.seed, mass, sum, c.topP*total)
		}
	}
}

// TestNegligibleTokensDropped: a token 30 temperatures below the best is never drawn,
// and the rest keep their probabilities.
func TestNegligibleTokensDropped(t *testing.T) {
	l := []float32{0, -0.5, -61, -1}
	s := mustNew(t, Params{Temperature: 2, Seed: 9}, nil)
	counts := map[engine.Token]int{}
	const n = 20000
	for range n {
		x, err := s.Sample(l)
		if err != nil {
			t.Fatal(err)
		}
		counts[x.Token]++
	}
	if counts[2] != 0 {
		t.Fatalf("negligible token drawn %d times", counts[2])
	}
	z := 1 + math.Exp(-0.25) + math.Exp(-0.5)
	for tok, lg := range map[engine.Token]float64{0: 0, 1: -0.5, 3: -1} {
		want := math.Exp(lg/2) / z
		if got := float64(counts[tok]) / n; math.Abs(got-want) > 0.015 {
			t.Errorf("token %d drawn with frequency %.3f, want %.3f", tok, got, want)
		}
	}
}

// TestExpNeg: over the whole range draw uses, expNeg is within 1e-8 of math.Exp
// (float32, in which probabilities are kept, resolves 6e-8).
func TestExpNeg(t *testing.T) {
	worst := 0.0
	for i := 0; i <= 1_000_000; i++ {
		x := -negligible * float64(i) / 1_000_000
		worst = max(worst, math.Abs(expNeg(x)/math.Exp(x)-1))
	}
	if worst > 1e-8 {
		t.Fatalf("expNeg is off by up to %.3g of math.Exp", worst)
	}
}

// TestGrammarFallbackDrawsFromTheModel: when the first draw breaks the grammar, the
// second is drawn from the model's (biased, penalised) distribution over the allowed
// tokens, not from what the first draw left in the scratch (probabilities in place
// of logits, reordered, banned tokens back).
func TestGrammarFallbackDrawsFromTheModel(t *testing.T) {
	s := mustNew(t, Params{Temperature: 1, Seed: 1}, &evenGrammar{})
	n0 := 0
	for range 2000 {
		x, err := s.Sample([]float32{-5, 10, 0, -10}) // allowed: 0 (-5), 2 (0): P(0) ≈ 0.0067
		if err != nil {
			t.Fatal(err)
		}
		if x.Token == 0 {
			n0++
		}
	}
	if n0 > 100 {
		t.Errorf("token 0 drawn %d times of 2000, expected about 13", n0)
	}
	s = mustNew(t, Params{Temperature: 1, Seed: 1, LogitBias: map[engine.Token]float32{0: -100}}, &evenGrammar{})
	for range 1000 {
		if x, err := s.Sample([]float32{1, 10, 0, 9}); err != nil || x.Token == 0 {
			t.Fatalf("banned token drawn (%v)", err)
		}
	}
}

// TestOpenAIPenaltiesCountGeneratedTokens: presence and frequency penalties count
// every generated token (no window) and no prompt token, as OpenAI and vLLM do.
func TestOpenAIPenaltiesCountGeneratedTokens(t *testing.T) {
	s := mustNew(t, Params{PresencePenalty: 2}, nil)
	s.Accept(1, false) // a prompt token
	if x, _ := s.Sample([]float32{0, 1.5}); x.Token != 1 {
		t.Errorf("a prompt token was penalised: got %d", x.Token)
	}
	s = mustNew(t, Params{FrequencyPenalty: 0.1}, nil)
	for range 30 {
		s.Accept(1, true)
	}
	for range 64 {
		s.Accept(2, true)
	}
	if x, _ := s.Sample([]float32{1, 3, -100}); x.Token != 0 { // 3 - 30 × 0.1 = 0 < 1
		t.Errorf("token 1, generated 30 times before the last 64, not penalised: got %d", x.Token)
	}
}

func TestScore(t *testing.T) {
	l := []float32{1, 3, 3, 0, 2}
	lse := logSumExp(l)
	for _, c := range []struct {
		tok  engine.Token
		rank int
	}{{1, 1}, {2, 1}, {4, 3}, {0, 4}, {3, 5}} {
		sc, err := Score(l, c.tok, 2)
		if err != nil {
			t.Fatal(err)
		}
		if sc.Token != c.tok || sc.Rank != c.rank || sc.Logprob != l[c.tok]-lse {
			t.Fatalf("token %d: %+v, want rank %d logprob %v", c.tok, sc, c.rank, l[c.tok]-lse)
		}
		if len(sc.Top) != 2 || sc.Top[0].Token != 1 || sc.Top[1].Token != 2 {
			t.Fatalf("top %+v", sc.Top)
		}
	}
	if sc, _ := Score(l, 4, 0); sc.Top != nil {
		t.Fatalf("no top asked for, got %+v", sc.Top)
	}
	for _, bad := range []struct {
		tok engine.Token
		n   int
	}{{-1, 0}, {5, 0}, {0, -1}, {0, MaxTopLogprobs + 1}} {
		if _, err := Score(l, bad.tok, bad.n); !errors.Is(err, engine.ErrInvalidInput) {
			t.Fatalf("Score(%d, %d): %v", bad.tok, bad.n, err)
		}
	}
}

// BenchmarkScore: scoring one prompt token (prompt logprobs) over real
// vocabulary sizes, beside sampling it greedily with its logprob.
func BenchmarkScore(b *testing.B) {
	for _, n := range []int{32000, 151936} {
		l := randomLogits(1, n)
		for _, top := range []int{0, 5} {
			b.Run(fmt.Sprintf("vocab=%d/top=%d", n, top), func(b *testing.B) {
				for b.Loop() {
					_, _ = Score(l, 7, top)
				}
			})
		}
		b.Run(fmt.Sprintf("vocab=%d/greedy-logprob", n), func(b *testing.B) {
			s, _ := New(Params{Logprobs: true}, nil)
			for b.Loop() {
				_, _ = s.Sample(l)
			}
		})
	}
}

// TestGreedyMinTokensFastPath: greedy decoding while min_tokens holds the end
// tokens back picks what the full pipeline picks: the first highest logit
// among the others, and the end token when nothing else is finite.
func TestGreedyMinTokensFastPath(t *testing.T) {
	ends := []engine.Token{0, 5, 7}
	for i := range 200 {
		l := randomLogits(uint64(i), 50)
		switch i % 4 {
		case 1:
			l[5] = 100 // an end token is best
		case 2:
			l[5], l[9], l[11] = 100, 50, 50 // and a tie after it: the first
		case 3:
			for j := range l {
				if !slices.Contains(ends, engine.Token(j)) {
					l[j] = float32(math.Inf(-1))
				}
			}
		}
		want, err := mustNew(t, Params{MinTokens: 3, EndTokens: ends, Temperature: 0}, nil).sampleAll(l)
		if err != nil {
			t.Fatal(err)
		}
		got, err := mustNew(t, Params{MinTokens: 3, EndTokens: ends}, nil).Sample(l)
		if err != nil || got.Token != want {
			t.Fatalf("case %d: %v %v, want %v", i, got.Token, err, want)
		}
		if i%4 == 1 && slices.Contains(ends, got.Token) {
			t.Fatalf("case %d: an end token %d while held back", i, got.Token)
		}
	}
}

// TestAllowedAndBadWords: vLLM's allowed_token_ids leave only those tokens to
// draw; its bad_words never complete: a word's last token is banned where the
// output ends with the rest of it.
func TestAllowedAndBadWords(t *testing.T) {
	logits := make([]float32, 10)
	for i := range logits {
		logits[i] = float32(i) // 9 is the likeliest, then 8, ...
	}
	s := mustNew(t, Params{Allowed: []engine.Token{2, 5}}, nil)
	if x, err := s.Sample(logits); err != nil || x.Token != 5 {
		t.Fatalf("allowed 2 and 5, greedy: %v %v", x.Token, err)
	}
	hot := mustNew(t, Params{Temperature: 5, Allowed: []engine.Token{2, 5}, Seed: 1}, nil)
	for range 50 {
		if x, _ := hot.Sample(logits); x.Token != 2 && x.Token != 5 {
			t.Fatalf("drew %d, not allowed", x.Token)
		}
	}
	// "9" alone is banned; "8 7" may not follow 8.
	b := mustNew(t, Params{BadWords: [][]engine.Token{{9}, {8, 7}}}, nil)
	var got []engine.Token
	for i := range 3 {
		if i == 1 {
			logits[6], logits[7], logits[8] = 8, 8.5, 7 // after 9: 7, then 6, then 8
		}
		x, err := b.Sample(logits)
		if err != nil {
			t.Fatal(err)
		}
		got = append(got, x.Token)
		b.Accept(x.Token, true)
	}
	if want := []engine.Token{8, 6, 7}; !slices.Equal(got, want) {
		t.Fatalf("with bad words 9 and 8 7: drew %v, want %v", got, want)
	}
	if _, err := New(Params{BadWords: [][]engine.Token{{}}}, nil); err == nil {
		t.Fatal("an empty bad word was taken")
	}
}
