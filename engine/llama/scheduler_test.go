package llama

// Integration tests of the scheduler over the real engine. They live here, not in
// package scheduler, so that the scheduler's own tests never compile llama.cpp.

import (
	"context"
	"fmt"
	"math"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/shoal-ai/shoal/engine"
	"github.com/shoal-ai/shoal/models"
	"github.com/shoal-ai/shoal/scheduler"
)

func startSched(t testing.TB, e *Engine, mod func(*scheduler.Config)) *scheduler.Scheduler {
	t.Helper()
	cfg := scheduler.DefaultConfig()
	cfg.MaxBatchTokens = 256
	cfg.MaxRunning = 32
	if mod != nil {
		mod(&cfg)
	}
	s, err := scheduler.New(cfg, e, nil)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { defer close(done); s.Run(ctx) }()
	t.Cleanup(func() { cancel(); <-done })
	return s
}

type genResult struct {
	tokens []engine.Token
	// margins: each token's lead over the next best, when the request asked
	// for two top logprobs or more (a numerical tie below tieMargin).
	margins []float64
	text    string
	cached  int
	err     error
	finish  scheduler.FinishReason
	first   time.Time // when the first token came
}

func generate(ctx context.Context, s *scheduler.Scheduler, r *scheduler.Request) genResult {
	st, err := s.Submit(ctx, r)
	if err != nil {
		return genResult{err: err}
	}
	var g genResult
	for {
		ev, ok := st.Next(ctx)
		if !ok {
			return g
		}
		switch ev.Kind {
		case scheduler.EventToken:
			if g.first.IsZero() {
				g.first = time.Now()
			}
			g.tokens = append(g.tokens, ev.Token)
			g.text += ev.Text
			if len(ev.Top) >= 2 {
				g.margins = append(g.margins, float64(ev.Top[0].Logprob-ev.Top[1].Logprob))
			}
		case scheduler.EventFinish:
			g.text += ev.Text
			g.finish = ev.Finish
		case scheduler.EventDone:
			g.cached = ev.Usage.CachedTokens
		case scheduler.EventError:
			g.err = ev.Err
		}
	}
}

// mixedPrompts returns n prompts of varied lengths; some share long prefixes.
func mixedPrompts(t testing.TB, e *Engine, n int) [][]engine.Token {
	var out [][]engine.Token
	for i := range n {
		text := testPrompts[i%len(testPrompts)]
		for range i % 5 {
			text += " " + testPrompts[(i*3)%len(testPrompts)]
		}
		out = append(out, tokenize(t, e, text))
	}
	return out
}

// reference is a request's greedy output computed alone, with the gap between the
// best and second-best logit at every step.
type reference struct {
	tokens  []engine.Token
	margins []float64
}

func soloGreedy(t *testing.T, e *Engine, prompts [][]engine.Token, maxTokens []int) []reference {
	t.Helper()
	var out []reference
	for i, p := range prompts {
		if err := e.ClearMemory(); err != nil {
			t.Fatal(err)
		}
		run := decodeGreedy(t, e, [][]engine.Token{p}, maxTokens[i], false)[0]
		r := reference{tokens: run.tokens}
		for step, l := range run.logits {
			r.margins = append(r.margins, gapToNext(l, run.tokens[step]))
		}
		out = append(out, r)
	}
	e.ClearMemory()
	return out
}

// tieMargin is the logit gap below which two greedy choices are a numerical tie on
// e's device: batches of other shapes take other kernel paths, which move every logit
// by up to kernelNoise (about 5e-3 on the CPU), so a closer race may go either way
// (vLLM's tests compare outputs the same way, accepting divergence only where the
// reference's choice was close). Twice the noise with 2× headroom, and never below
// 0.02. It leaves the engine's memory empty.
func tieMargin(t *testing.T, e *Engine) float64 {
	return max(0.02, 4*kernelNoise(t, e))
}

// sameGreedy compares got with the reference up to the first divergence, which is
// accepted only at a numerical tie (a gap under tie). It returns whether a tie
// decided a divergence.
func sameGreedy(t *testing.T, name string, got []engine.Token, want reference, tie float64) bool {
	t.Helper()
	for i := range want.tokens {
		if i >= len(got) {
			t.Fatalf("%s: %d tokens, want %d", name, len(got), len(want.tokens))
		}
		if got[i] != want.tokens[i] {
			if want.margins[i] < tie {
				return true
			}
			t.Fatalf("%s: token %d is %d, alone it is %d (margin %.3g, ties below %.3g)\ngot  %v\nwant %v", name, i, got[i], want.tokens[i], want.margins[i], tie, got, want.tokens)
		}
	}
	return false
}

// ref is g as a reference for sameGreedy (g asked for two top logprobs).
func (g genResult) ref() reference { return reference{tokens: g.tokens, margins: g.margins} }

// sameAsSolo runs prompts at once on a scheduler over e (configured by mod)
// and checks each greedy output against the prompt's alone, up to numerical
// ties. Ties are rare (about 1 in 32 requests on the CPU); many would mean the
// scheduler's batches move logits more than batch shapes do. It returns the
// scheduler and the ties.
func sameAsSolo(t *testing.T, e *Engine, prompts [][]engine.Token, maxTokens []int, mod func(*scheduler.Config)) (*scheduler.Scheduler, int) {
	t.Helper()
	tie := tieMargin(t, e)
	want := soloGreedy(t, e, prompts, maxTokens)
	s := startSched(t, e, mod)
	got := runAll(t, s, prompts, maxTokens)
	ties := 0
	for i := range prompts {
		if sameGreedy(t, fmt.Sprintf("request %d", i), got[i].tokens, want[i], tie) {
			ties++
		}
	}
	if ties > max(2, len(prompts)/8) {
		t.Fatalf("%d of %d requests diverged at numerical ties", ties, len(prompts))
	}
	t.Logf("%d of %d requests diverged at a numerical tie (margin < %.3g)", ties, len(prompts), tie)
	return s, ties
}

func runAll(t *testing.T, s *scheduler.Scheduler, prompts [][]engine.Token, maxTokens []int) []genResult {
	t.Helper()
	res := make([]genResult, len(prompts))
	var wg sync.WaitGroup
	for i, p := range prompts {
		wg.Go(func() {
			res[i] = generate(context.Background(), s, &scheduler.Request{Prompt: p, MaxTokens: maxTokens[i], IgnoreEOS: true})
		})
	}
	wg.Wait()
	for i, r := range res {
		if r.err != nil {
			t.Fatalf("request %d: %v", i, r.err)
		}
	}
	return res
}

func TestSchedulerConcurrentEqualsSolo(t *testing.T) {
	for _, unified := range []bool{true, false} {
		t.Run(fmt.Sprintf("unified=%v", unified), func(t *testing.T) { testConcurrent(t, unified) })
	}
}

func testConcurrent(t *testing.T, unified bool) {
	e := openTest(t, models.Small(), func(c *Config) {
		c.ContextCells, c.MaxSeqs, c.BatchTokens, c.Unified = 8192, 64, 512, unified
		if !unified {
			c.ContextCells = 256 * 48 // 48 streams of 256 cells
			c.MaxSeqs = 48
		}
	})
	prompts := mixedPrompts(t, e, 32)
	maxTokens := make([]int, len(prompts))
	for i := range maxTokens {
		maxTokens[i] = 4 + i*5%28
	}
	s, _ := sameAsSolo(t, e, prompts, maxTokens, nil)
	if l := s.Load(); l.PrefixHits == 0 {
		t.Errorf("shared prefixes among the prompts gave no cache hits: %+v", l)
	}
}

func TestSchedulerCachedPrefixEqualsUncached(t *testing.T) {
	for _, unified := range []bool{true, false} {
		t.Run(fmt.Sprintf("unified=%v", unified), func(t *testing.T) { testCachedPrefix(t, unified) })
	}
}

func testCachedPrefix(t *testing.T, unified bool) {
	e := openTest(t, models.Small(), func(c *Config) { c.ContextCells = 4096; c.MaxSeqs = 16; c.Unified = unified })
	base := tokenize(t, e, testPrompts[3]+" "+testPrompts[6]+" "+testPrompts[0])
	prompts := [][]engine.Token{base, append(slices.Clone(base), tokenize(t, e, " and then")[1:]...)}
	maxTokens := []int{12, 12}
	tie := tieMargin(t, e)
	for _, caching := range []bool{false, true} {
		e.ClearMemory()
		func() {
			s := startSched(t, e, func(c *scheduler.Config) { c.KV.Caching = caching; c.MaxRunning = 8 })
			var results []genResult
			for i, p := range prompts { // one after another: the second can reuse the first
				results = append(results, runAll(t, s, [][]engine.Token{p}, maxTokens[i:i+1])[0])
			}
			want := soloGreedy(t, e, prompts, maxTokens)
			for i := range prompts {
				if sameGreedy(t, fmt.Sprintf("caching=%v request %d", caching, i), results[i].tokens, want[i], tie) {
					t.Logf("caching=%v request %d diverged at a numerical tie", caching, i)
				}
			}
			if caching && results[1].cached == 0 {
				t.Fatalf("second request got no cached tokens")
			}
			if !caching && results[1].cached != 0 {
				t.Fatalf("caching off but %d cached tokens", results[1].cached)
			}
			t.Logf("caching=%v: cached tokens of the second request %d of %d", caching, results[1].cached, len(prompts[1]))
		}()
	}
}

func TestSchedulerSmallPoolCompletesAll(t *testing.T) {
	// 16 requests of up to ~150 tokens each in a pool of 768 cells: preemption and
	// eviction must happen, and every output must still be exact.
	e := openTest(t, models.Small(), func(c *Config) { c.ContextCells = 768; c.MaxSeqs = 32; c.BatchTokens = 256 })
	prompts := mixedPrompts(t, e, 16)
	maxTokens := make([]int, len(prompts))
	for i := range maxTokens {
		maxTokens[i] = 40
	}
	tie := tieMargin(t, e)
	want := soloGreedy(t, e, prompts, maxTokens)
	s := startSched(t, e, func(c *scheduler.Config) { c.MaxBatchTokens = 128; c.MaxRunning = 16 })
	got := runAll(t, s, prompts, maxTokens)
	for i := range prompts {
		sameGreedy(t, fmt.Sprintf("request %d", i), got[i].tokens, want[i], tie)
	}
	l := s.Load()
	t.Logf("preemptions %d, prefix hits %d of %d", l.Preemptions, l.PrefixHits, l.PrefixQueries)
	if l.Preemptions == 0 {
		t.Error("expected preemptions with a pool smaller than the requests")
	}
}

// TestSchedulerSpeculativeEqualsSolo: with n-gram proposals, every request's
// greedy output is the one it has alone without them (up to numerical ties:
// a proposal's row is computed in a batch of another shape), in both KV
// layouts; proposals are made and some are taken.
func TestSchedulerSpeculativeEqualsSolo(t *testing.T) {
	for _, unified := range []bool{true, false} {
		t.Run(fmt.Sprintf("unified=%v", unified), func(t *testing.T) {
			e := openTest(t, models.Small(), func(c *Config) {
				c.ContextCells, c.MaxSeqs, c.BatchTokens, c.Unified = 8192, 16, 512, unified
				if !unified {
					c.ContextCells = 512 * 16
				}
			})
			prompts := mixedPrompts(t, e, 12)
			for i := range 4 { // text that repeats, as code being edited does
				prompts = append(prompts, tokenize(t, e, strings.Repeat(testPrompts[i]+" ", 6)))
			}
			maxTokens := make([]int, len(prompts))
			for i := range maxTokens {
				maxTokens[i] = 48 + i%5
			}
			s, ties := sameAsSolo(t, e, prompts, maxTokens, func(c *scheduler.Config) { c.MaxRunning = 16; c.Spec.Tokens = 5 })
			l := s.Load()
			if l.SpecProposed == 0 || l.SpecAccepted == 0 {
				t.Fatalf("%d proposed, %d taken", l.SpecProposed, l.SpecAccepted)
			}
			t.Logf("%d of %d proposals taken; %d ties", l.SpecAccepted, l.SpecProposed, ties)
		})
	}
}

// TestRerankFromCachedPrefix: a reranker that reads its last token over causal
// attention (Qwen 3's rank pooling) scores pairs that share the query's prefix
// from the cache, the prefix computed once, with the scores it gives each pair
// computed whole; mean pooling is not reported as reading the last token.
func TestRerankFromCachedPrefix(t *testing.T) {
	spec := models.Tiny()
	spec.Name, spec.Reranker = "shoal-tiny-reranker", true
	for _, unified := range []bool{true, false} {
		t.Run(fmt.Sprintf("unified=%v", unified), func(t *testing.T) {
			e := openTest(t, spec, func(c *Config) { c.Embeddings, c.Unified = true, unified })
			if !e.Capacity().PoolsLast {
				t.Fatal("Qwen 3's rank pooling not reported as last-token pooling")
			}
			prefix := "<|im_start|>system\nJudge whether the document answers the query.<|im_end|>\n<|im_start|>user\n<Query>: which animals purr and sleep most of the day?\n<Document>: "
			var prompts [][]engine.Token
			for _, d := range []string{"a cat sat on the mat", "paris is in france", "the dog ran far away after the ball", "cats purr"} {
				prompts = append(prompts, tokenize(t, e, prefix+d+"<|im_end|>\n<|im_start|>assistant\n"))
			}
			score := func(caching bool) ([]float32, int) {
				e.ClearMemory()
				s := startSched(t, e, func(c *scheduler.Config) { c.KV.Caching, c.MaxRunning = caching, 8 })
				vecs, usage := embedAll(t, s, prompts)
				var scores []float32
				cached := 0
				for i := range vecs {
					scores, cached = append(scores, vecs[i][0]), cached+usage[i].CachedTokens
				}
				return scores, cached
			}
			whole, none := score(false)
			fromCache, cached := score(true)
			// Every pair but the first computed takes the head's whole blocks.
			head := len(tokenize(t, e, prefix)) - 1 // its last token may merge with a document's
			if want := (len(prompts) - 1) * (head / 16 * 16); none != 0 || cached < want {
				t.Fatalf("cached tokens: %d without caching, %d with, want at least %d", none, cached, want)
			}
			for i := range whole {
				if math.Abs(float64(whole[i]-fromCache[i])) > 1e-4 {
					t.Fatalf("pair %d: %v computed whole, %v from the cached prefix", i, whole[i], fromCache[i])
				}
			}
			t.Logf("%d cached tokens of %d pairs", cached, len(prompts))
		})
	}
	if e := openTest(t, models.Tiny(), func(c *Config) { c.Embeddings, c.Pooling = true, "mean" }); e.Capacity().PoolsLast {
		t.Fatal("mean pooling reported as last-token pooling")
	}
}

// embedAll submits every prompt to s as an embedding request at once and
// returns each one's vector and usage.
func embedAll(tb testing.TB, s *scheduler.Scheduler, prompts [][]engine.Token) ([][]float32, []scheduler.Usage) {
	vecs, usage := make([][]float32, len(prompts)), make([]scheduler.Usage, len(prompts))
	var wg sync.WaitGroup
	for i, p := range prompts {
		wg.Go(func() {
			ctx := context.Background()
			st, err := s.Submit(ctx, &scheduler.Request{Prompt: p, Embed: true})
			if err != nil {
				tb.Error(err)
				return
			}
			for ev, ok := st.Next(ctx); ok; ev, ok = st.Next(ctx) {
				switch ev.Kind {
				case scheduler.EventEmbedding:
					vecs[i] = ev.Vector
				case scheduler.EventDone:
					usage[i] = ev.Usage
				case scheduler.EventError:
					tb.Error(ev.Err)
				}
			}
		})
	}
	wg.Wait()
	return vecs, usage
}
