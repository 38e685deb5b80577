package scheduler

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"math"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"testing/synctest"
	"time"

	"github.com/shoal-ai/shoal/engine"
	"github.com/shoal-ai/shoal/engine/enginetest"
	"github.com/shoal-ai/shoal/engine/sample"
)

type result struct {
	text   []string // per choice
	tokens [][]engine.Token
	finish []FinishReason
	usage  Usage
	err    error
	// prompt holds the EventPromptLogprobs scores; prompts counts those
	// events, and late those after a token of choice 0.
	prompt        []engine.TokenScore
	prompts, late int
	logprobs      []float32 // choice 0's tokens' logprobs
}

func collect(ctx context.Context, st *Stream, n int) result {
	r := result{text: make([]string, n), tokens: make([][]engine.Token, n), finish: make([]FinishReason, n)}
	for {
		ev, ok := st.Next(ctx)
		if !ok {
			if r.err == nil && ctx.Err() != nil {
				r.err = ctx.Err()
			}
			return r
		}
		switch ev.Kind {
		case EventToken:
			r.text[ev.Index] += ev.Text
			r.tokens[ev.Index] = append(r.tokens[ev.Index], ev.Token)
			if ev.Index == 0 {
				r.logprobs = append(r.logprobs, ev.Logprob)
			}
		case EventPromptLogprobs:
			r.prompt = ev.Prompt
			r.prompts++
			if len(r.tokens[0]) > 0 {
				r.late++
			}
		case EventFinish:
			r.text[ev.Index] += ev.Text
			r.finish[ev.Index] = ev.Finish
		case EventDone:
			r.usage = ev.Usage
		case EventError:
			r.err = ev.Err
		}
	}
}

func startScheduler(t *testing.T, f *enginetest.Fake, mod func(*Config)) (*Scheduler, context.CancelFunc) {
	t.Helper()
	cfg := DefaultConfig()
	cfg.MaxBatchTokens = 64
	cfg.MaxRunning = 16
	if mod != nil {
		mod(&cfg)
	}
	s, err := New(cfg, f, nil)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { defer close(done); s.Run(ctx) }()
	t.Cleanup(func() { cancel(); <-done })
	return s, cancel
}

func prompt(seed, n int) []engine.Token {
	p := []engine.Token{1}
	for i := range n - 1 {
		p = append(p, engine.Token(3+(seed*7+i*3)%60))
	}
	return p
}

// solo runs each request alone on a fresh engine and scheduler: the reference output.
func solo(t *testing.T, reqs []*Request) []result { t.Helper(); return soloOn(t, reqs, nil) }

// soloOn is solo on fake engines that mod sets up.
func soloOn(t *testing.T, reqs []*Request, mod func(*enginetest.Fake)) []result {
	t.Helper()
	var out []result
	for _, r := range reqs {
		f := enginetest.New(4096, 32, 512)
		if mod != nil {
			mod(f)
		}
		s, _ := startScheduler(t, f, func(c *Config) { c.KV.Caching = false })
		st, err := s.Submit(context.Background(), r)
		if err != nil {
			t.Fatal(err)
		}
		out = append(out, collect(context.Background(), st, max(r.N, 1)))
	}
	return out
}

func runConcurrently(t *testing.T, s *Scheduler, reqs []*Request) []result {
	t.Helper()
	res := make([]result, len(reqs))
	var wg sync.WaitGroup
	for i, r := range reqs {
		st, err := s.Submit(context.Background(), r)
		if err != nil {
			t.Fatal(err)
		}
		wg.Go(func() { res[i] = collect(context.Background(), st, max(r.N, 1)) })
	}
	wg.Wait()
	return res
}

func mixedRequests(n int) []*Request {
	var reqs []*Request
	for i := range n {
		reqs = append(reqs, &Request{Prompt: prompt(i, 5+i*13%90), MaxTokens: 3 + i*7%40})
	}
	return reqs
}

func TestConcurrentEqualsSolo(t *testing.T) {
	reqs := mixedRequests(20)
	want := solo(t, reqs)
	f := enginetest.New(4096, 64, 512)
	s, _ := startScheduler(t, f, nil)
	got := runConcurrently(t, s, reqs)
	for i := range reqs {
		if got[i].err != nil || !slices.Equal(got[i].tokens[0], want[i].tokens[0]) {
			t.Fatalf("request %d: got %v %v, want %v", i, got[i].tokens, got[i].err, want[i].tokens)
		}
		if got[i].finish[0] != FinishLength || got[i].usage.CompletionTokens != reqs[i].MaxTokens {
			t.Fatalf("request %d: finish %v usage %+v", i, got[i].finish, got[i].usage)
		}
	}
	// Budget and decode rows: no batch exceeds 64 tokens, and while a sequence
	// decodes it has a row in every batch.
	for i, b := range f.Batches() {
		if b.Rows > 64 {
			t.Fatalf("batch %d has %d rows, budget 64", i, b.Rows)
		}
	}
}

// TestParallelSamplingEqualsSerial: drawing a step's rows on several goroutines gives
// every request the tokens it gets when the scheduler draws them one by one (each has
// its own seeded sampler), n > 1 choices and log-probabilities included; a request
// whose sampler cannot be made fails alone.
func TestParallelSamplingEqualsSerial(t *testing.T) {
	reqs := func() []*Request {
		var out []*Request
		for i := range 24 {
			out = append(out, &Request{Prompt: prompt(i, 5+i*11%70), MaxTokens: 4 + i*5%30, N: 1 + i%3,
				Sampling: sample.Params{Temperature: 1.5, TopP: 0.95, TopK: 20 * (i % 2), Seed: uint64(i), Logprobs: i%4 == 0, TopLogprobs: i % 5}})
		}
		out[7].Grammar = "root ::= \"x\"" // the fake has no grammars: this request fails
		return out
	}
	run := func(workers int) []result {
		f := enginetest.New(8192, 64, 512)
		s, _ := startScheduler(t, f, func(c *Config) { c.SampleWorkers = workers; c.MaxRunning = 32 })
		return runConcurrently(t, s, reqs())
	}
	serial, parallel := run(1), run(4)
	diverged := 0
	for i := range serial {
		if i == 7 {
			if !errors.Is(serial[i].err, ErrInvalid) || !errors.Is(parallel[i].err, ErrInvalid) {
				t.Fatalf("request with a grammar: serial %v, parallel %v; want ErrInvalid", serial[i].err, parallel[i].err)
			}
			continue
		}
		if serial[i].err != nil || parallel[i].err != nil {
			t.Fatalf("request %d: serial %v, parallel %v", i, serial[i].err, parallel[i].err)
		}
		for c := range serial[i].tokens {
			if !slices.Equal(serial[i].tokens[c], parallel[i].tokens[c]) {
				t.Fatalf("request %d choice %d: parallel %v, serial %v", i, c, parallel[i].tokens[c], serial[i].tokens[c])
			}
			if !slices.Equal(serial[i].tokens[c], solo(t, []*Request{{Prompt: reqs()[i].Prompt, MaxTokens: reqs()[i].MaxTokens}})[0].tokens[0]) {
				diverged++
			}
		}
	}
	if diverged == 0 {
		t.Fatal("no choice left the greedy path: the test draws nothing")
	}
}

func TestSplitModeEqualsSolo(t *testing.T) {
	reqs := mixedRequests(20)
	// Shared prefixes: every other request repeats an earlier prompt with more text.
	for i := 2; i < len(reqs); i += 2 {
		reqs[i].Prompt = append(slices.Clone(reqs[i-2].Prompt), prompt(i, 20)...)
	}
	want := solo(t, reqs)
	f := enginetest.NewSplit(256, 24, 512)
	s, _ := startScheduler(t, f, nil)
	var got []result
	for i := 0; i < len(reqs); i += 5 { // waves, so that later ones find cached prefixes
		got = append(got, runConcurrently(t, s, reqs[i:i+5])...)
	}
	for i := range reqs {
		if got[i].err != nil || !slices.Equal(got[i].tokens[0], want[i].tokens[0]) {
			t.Fatalf("request %d: got %v %v, want %v", i, got[i].tokens, got[i].err, want[i].tokens)
		}
	}
	if l := s.Load(); l.PrefixHits == 0 {
		t.Fatalf("no prefix reuse in split mode: %+v", l)
	}
	r := runConcurrently(t, s, []*Request{{Prompt: prompt(2, 30), MaxTokens: 8, N: 3}})[0]
	if r.err != nil || r.usage.CompletionTokens != 24 {
		t.Fatalf("n=3 in split mode: %v %+v", r.err, r.usage)
	}
}

func TestDecodeRowEveryStep(t *testing.T) {
	f := enginetest.New(4096, 64, 512)
	cfg := DefaultConfig()
	cfg.MaxBatchTokens, cfg.MaxRunning, cfg.KV.Caching = 32, 16, false
	s, err := New(cfg, f, nil)
	if err != nil {
		t.Fatal(err)
	}
	// Queue all requests before the loop starts, so no sequence id is reused.
	var streams []*Stream
	for i := range 8 {
		st, err := s.Submit(context.Background(), &Request{Prompt: prompt(i, 40), MaxTokens: 20})
		if err != nil {
			t.Fatal(err)
		}
		streams = append(streams, st)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { defer close(done); s.Run(ctx) }()
	defer func() { cancel(); <-done }()
	for _, st := range streams {
		collect(context.Background(), st, 1)
	}
	// Each sequence id appears in a contiguous run of batches: once it starts it is
	// never skipped until it finishes (ids are not reused: 8 of 64).
	seen := map[engine.SeqID][]int{}
	for i, b := range f.Batches() {
		for id := range b.Seqs {
			seen[id] = append(seen[id], i)
		}
	}
	if len(seen) != 8 {
		t.Fatalf("%d sequence ids used", len(seen))
	}
	for id, steps := range seen {
		for j := 1; j < len(steps); j++ {
			if steps[j] != steps[j-1]+1 {
				t.Fatalf("seq %d skipped between batch %d and %d", id, steps[j-1], steps[j])
			}
		}
	}
}

func TestPrefixCacheHitGivesSameTokens(t *testing.T) {
	base := prompt(3, 100)
	reqs := []*Request{{Prompt: base, MaxTokens: 10}, {Prompt: append(slices.Clone(base[:90]), 5, 6, 7), MaxTokens: 10}}
	want := solo(t, reqs)
	f := enginetest.New(4096, 64, 512)
	s, _ := startScheduler(t, f, nil)
	for i, r := range reqs {
		got := runConcurrently(t, s, []*Request{r})[0]
		if !slices.Equal(got.tokens[0], want[i].tokens[0]) {
			t.Fatalf("request %d: %v want %v", i, got.tokens[0], want[i].tokens[0])
		}
		if i == 1 && got.usage.CachedTokens != 80 {
			t.Fatalf("cached tokens %d, want 80", got.usage.CachedTokens)
		}
	}
	if l := s.Load(); l.PrefixHits != 80 || l.PrefixQueries != 193 {
		t.Fatalf("load %+v", l)
	}
}

func TestPreemptionAndResume(t *testing.T) {
	reqs := mixedRequests(12)
	for _, r := range reqs {
		r.MaxTokens = 60
	}
	want := solo(t, reqs)
	// 512 cells cannot hold 12 sequences of up to ~150 tokens at once.
	f := enginetest.New(512, 64, 512)
	s, _ := startScheduler(t, f, func(c *Config) { c.MaxBatchTokens = 128 })
	got := runConcurrently(t, s, reqs)
	for i := range reqs {
		if got[i].err != nil || !slices.Equal(got[i].tokens[0], want[i].tokens[0]) {
			t.Fatalf("request %d: %v (%v), want %v", i, got[i].tokens[0], got[i].err, want[i].tokens[0])
		}
	}
	if s.Load().Preemptions == 0 {
		t.Fatal("expected preemptions with a small pool")
	}
	t.Logf("preemptions: %d", s.Load().Preemptions)
}

// TestCancelledWhilePreempted: requests cancelled while preempted leave nothing
// kept for them past the cache budget.
func TestCancelledWhilePreempted(t *testing.T) {
	f := enginetest.New(512, 64, 512)
	f.Delay = time.Millisecond
	s, _ := startScheduler(t, f, func(c *Config) { c.MaxBatchTokens = 128 })
	ctx, cancel := context.WithCancel(context.Background())
	var streams []*Stream
	for i := range 12 {
		st, err := s.Submit(ctx, &Request{Prompt: prompt(i, 40), MaxTokens: 400, IgnoreEOS: true})
		if err != nil {
			t.Fatal(err)
		}
		streams = append(streams, st)
	}
	// Cancelled once some are preempted and waiting to resume (how many
	// preemptions come depends on the timing of a loaded machine).
	deadline := time.Now().Add(30 * time.Second)
	for l := s.Load(); l.Preemptions < 2 || l.Waiting == 0; l = s.Load() {
		if time.Now().After(deadline) {
			t.Fatalf("no preempted request waiting in 30 s: %+v", l)
		}
		time.Sleep(time.Millisecond)
	}
	cancel()
	for _, st := range streams {
		<-st.Done()
	}
	deadline = time.Now().Add(2 * time.Second) // the load is published after the step
	for l := s.Load(); l.Running != 0 || l.KVBlocksUsed != 0 || l.KVBlocksCached > l.KVCacheBudget; l = s.Load() {
		if time.Now().After(deadline) {
			t.Fatalf("after cancelling: %d blocks used, %d cached over a budget of %d", l.KVBlocksUsed, l.KVBlocksCached, l.KVCacheBudget)
		}
		time.Sleep(time.Millisecond)
	}
}

// Requests without max_tokens generate past the old 256-token default, and are
// admitted with room for openReserve tokens rather than the whole context: six
// of them share a pool that holds two and a half at their full length, by
// preemption, and each says what it says alone.
func TestRequestsWithoutLimitShareThePool(t *testing.T) {
	var reqs []*Request
	for i := range 6 {
		reqs = append(reqs, &Request{Prompt: prompt(i, 20+i)})
	}
	eos := func(f *enginetest.Fake) *enginetest.Fake { f.EOSAt = 400; return f }
	var want []result
	for _, r := range reqs {
		s, _ := startScheduler(t, eos(enginetest.New(4096, 32, 512)), nil)
		want = append(want, runConcurrently(t, s, []*Request{r})[0])
	}
	s, _ := startScheduler(t, eos(enginetest.New(1024, 64, 512)), nil)
	got := runConcurrently(t, s, reqs)
	for i := range reqs {
		n := 400 - len(reqs[i].Prompt) // the last is EOS
		if want[i].err != nil || want[i].finish[0] != FinishStop || want[i].usage.CompletionTokens != n {
			t.Fatalf("request %d alone: %v %v %+v, want %d tokens and EOS", i, want[i].err, want[i].finish, want[i].usage, n)
		}
		if got[i].err != nil || got[i].finish[0] != FinishStop || !slices.Equal(got[i].tokens[0], want[i].tokens[0]) {
			t.Fatalf("request %d shared: %v %v, %d tokens, want the %d it generates alone", i, got[i].err, got[i].finish, len(got[i].tokens[0]), n)
		}
	}
	if s.Load().Preemptions == 0 {
		t.Fatal("no preemptions: the requests ran one at a time, each admitted with the whole context's room")
	}
	t.Logf("preemptions: %d, prompt tokens computed: %d", s.Load().Preemptions, s.Load().ComputedTokens)
}

func TestCancellationFreesBlocks(t *testing.T) {
	f := enginetest.New(4096, 64, 512)
	f.Delay = time.Millisecond
	s, _ := startScheduler(t, f, nil)
	ctx, cancel := context.WithCancel(context.Background())
	st, err := s.Submit(ctx, &Request{Prompt: prompt(1, 50), MaxTokens: 2000, IgnoreEOS: true})
	if err != nil {
		t.Fatal(err)
	}
	// Wait for it to generate, then cancel.
	for range 3 {
		if _, ok := st.Next(context.Background()); !ok {
			t.Fatal("stream ended early")
		}
	}
	cancel()
	r := collect(context.Background(), st, 1)
	if r.finish[0] != FinishCancelled {
		t.Fatalf("finish %v err %v", r.finish, r.err)
	}
	// Blocks are freed within a step of the cancellation.
	deadline := time.Now().Add(2 * time.Second)
	for s.Load().Running != 0 || s.Load().KVBlocksUsed != 0 {
		if time.Now().After(deadline) {
			t.Fatalf("load after cancel: %+v", s.Load())
		}
		time.Sleep(time.Millisecond)
	}
}

func TestPriorityAndFIFO(t *testing.T) {
	f := enginetest.New(4096, 64, 512)
	f.Delay = 200 * time.Microsecond
	s, _ := startScheduler(t, f, func(c *Config) { c.MaxRunning = 1; c.MaxBatchTokens = 64 })
	var mu sync.Mutex
	var order []string
	var wg sync.WaitGroup
	submit := func(name string, prio int) {
		st, err := s.Submit(context.Background(), &Request{Prompt: prompt(len(order), 10), MaxTokens: 5, Priority: prio})
		if err != nil {
			t.Fatal(err)
		}
		wg.Go(func() {
			collect(context.Background(), st, 1)
			mu.Lock()
			order = append(order, name)
			mu.Unlock()
		})
	}
	// Hold the single slot while the others queue.
	blocker, _ := s.Submit(context.Background(), &Request{Prompt: prompt(99, 10), MaxTokens: 30})
	for s.Load().Running == 0 {
		time.Sleep(100 * time.Microsecond)
	}
	submit("background", 3)
	submit("a", 0)
	submit("b", 0)
	submit("c", 0)
	submit("urgent", -5) // lower runs first, as in vLLM
	for s.Load().Waiting < 5 {
		time.Sleep(100 * time.Microsecond)
	}
	collect(context.Background(), blocker, 1)
	wg.Wait()
	if strings.Join(order, ",") != "urgent,a,b,c,background" {
		t.Fatalf("completion order %v", order)
	}
}

func TestStopStringsAcrossTokens(t *testing.T) {
	// Find the reference text, then stop on a string spanning token boundaries.
	ref := solo(t, []*Request{{Prompt: prompt(5, 20), MaxTokens: 30}})[0]
	text := ref.text[0]
	stop := text[10:13]
	want := text[:strings.Index(text, stop)]
	f := enginetest.New(4096, 64, 512)
	s, _ := startScheduler(t, f, nil)
	got := runConcurrently(t, s, []*Request{{Prompt: prompt(5, 20), MaxTokens: 30, Stop: []string{"zzzzzz", stop}}})[0]
	if got.text[0] != want || got.finish[0] != FinishStop {
		t.Fatalf("text %q finish %v, want %q", got.text[0], got.finish[0], want)
	}
}

// TestMinTokensAndStopTokens: vLLM's min_tokens holds off end-of-generation,
// stop tokens and stop strings; stop_token_ids end a choice without their
// text; include_stop_str_in_output keeps the stop string or token.
func TestMinTokensAndStopTokens(t *testing.T) {
	ref := solo(t, []*Request{{Prompt: prompt(5, 20), MaxTokens: 30}})[0]
	text, toks := ref.text[0], ref.tokens[0]
	f := enginetest.New(4096, 64, 512)
	s, _ := startScheduler(t, f, nil)

	stop := text[10:13]
	got := runConcurrently(t, s, []*Request{{Prompt: prompt(5, 20), MaxTokens: 30, Stop: []string{stop}, IncludeStop: true}})[0]
	if want := text[:strings.Index(text, stop)+len(stop)]; got.text[0] != want || got.finish[0] != FinishStop {
		t.Fatalf("include stop: text %q finish %v, want %q", got.text[0], got.finish[0], want)
	}
	// A stop string before min_tokens is passed over.
	got = runConcurrently(t, s, []*Request{{Prompt: prompt(5, 20), MaxTokens: 30, Stop: []string{stop}, MinTokens: 30}})[0]
	if got.text[0] != text || got.finish[0] != FinishLength {
		t.Fatalf("stop before min_tokens: text %q finish %v, want %q", got.text[0], got.finish[0], text)
	}

	// One that begins within the first min_tokens and ends after them stops
	// the choice (vLLM matches the stop strings that end in a new token's
	// text); one that ends within them does not.
	var off []int // bytes before each token
	n := 0
	for _, tok := range toks {
		off = append(off, n)
		p, _ := f.Vocab().Piece(tok, false)
		n += len(p)
	}
	found := false
	for k := 5; k+1 < len(toks); k++ {
		// Its last byte is token k's first, and it is nowhere before.
		if off[k] == 0 || off[k+1] == off[k] || strings.Index(text, text[off[k]-1:off[k]+1]) != off[k]-1 {
			continue
		}
		across := text[off[k]-1 : off[k]+1] // ends in token k+1
		got = runConcurrently(t, s, []*Request{{Prompt: prompt(5, 20), MaxTokens: 30, Stop: []string{across}, MinTokens: k}})[0]
		if got.text[0] != text[:off[k]-1] || got.finish[0] != FinishStop {
			t.Fatalf("stop %q across min_tokens %d: text %q finish %v, want %q", across, k, got.text[0], got.finish[0], text[:off[k]-1])
		}
		got = runConcurrently(t, s, []*Request{{Prompt: prompt(5, 20), MaxTokens: 30, Stop: []string{across}, MinTokens: k + 1}})[0]
		if got.text[0] != text || got.finish[0] != FinishLength {
			t.Fatalf("stop %q within min_tokens %d: text %q finish %v, want %q", across, k+1, got.text[0], got.finish[0], text)
		}
		found = true
		break
	}
	if !found {
		t.Fatal("no stop string across a token boundary found")
	}

	at := slices.Index(toks, toks[5]) // the stop token's first place
	got = runConcurrently(t, s, []*Request{{Prompt: prompt(5, 20), MaxTokens: 30, StopTokens: []engine.Token{toks[5]}}})[0]
	if !slices.Equal(got.tokens[0], toks[:at+1]) || got.finish[0] != FinishStop || got.usage.CompletionTokens != at+1 {
		t.Fatalf("stop token %d: tokens %v finish %v, want %v", toks[5], got.tokens[0], got.finish[0], toks[:at+1])
	}
	var before strings.Builder
	for _, tok := range toks[:at] {
		p, _ := f.Vocab().Piece(tok, false)
		before.Write(p)
	}
	last, _ := f.Vocab().Piece(toks[at], false)
	if got.text[0] != before.String() {
		t.Fatalf("stop token: text %q, want %q without its own", got.text[0], before.String())
	}
	got = runConcurrently(t, s, []*Request{{Prompt: prompt(5, 20), MaxTokens: 30, StopTokens: []engine.Token{toks[5]}, IncludeStop: true}})[0]
	if got.text[0] != before.String()+string(last) {
		t.Fatalf("stop token kept: text %q, want %q", got.text[0], before.String()+string(last))
	}
	// Banned before min_tokens: the output differs where it came first.
	got = runConcurrently(t, s, []*Request{{Prompt: prompt(5, 20), MaxTokens: 30, StopTokens: []engine.Token{toks[5]}, MinTokens: at + 3}})[0]
	if len(got.tokens[0]) < at+3 || slices.Contains(got.tokens[0][:at+2], toks[5]) {
		t.Fatalf("stop token before min_tokens: tokens %v (stop token %d)", got.tokens[0], toks[5])
	}

	f.EOSAt = 30 // EOS after 10 tokens of a 20-token prompt
	got = runConcurrently(t, s, []*Request{{Prompt: prompt(1, 20), MaxTokens: 100, MinTokens: 15}})[0]
	if got.finish[0] != FinishStop || got.usage.CompletionTokens != 16 {
		t.Fatalf("EOS before min_tokens: finish %v usage %+v, want stop after 16", got.finish, got.usage)
	}
	// The EOS that ended it is a token of the answer, with its logprob, as
	// vLLM lists it.
	if toks := got.tokens[0]; len(toks) != 16 || !f.Vocab().IsEOG(toks[15]) {
		t.Fatalf("EOS before min_tokens: tokens %v, want 16 ending with the EOS", toks)
	}
	for _, r := range []*Request{
		{Prompt: prompt(1, 4), MaxTokens: 4, MinTokens: 5},
		{Prompt: prompt(1, 4), MinTokens: -1},
		{Prompt: prompt(1, 4), StopTokens: []engine.Token{1 << 20}},
	} {
		if _, err := s.Submit(context.Background(), r); !errors.Is(err, ErrInvalid) {
			t.Errorf("%+v: %v, want ErrInvalid", r, err)
		}
	}
}

func TestMatchStop(t *testing.T) {
	cases := []struct {
		text, emit, held, stop string
	}{
		{"hello wor", "hello ", "wor", ""},
		{"hello world!", "hello ", "", "world"},
		{"abc", "abc", "", ""},
		{"xx<|e", "xx", "<|e", ""},
	}
	for _, c := range cases {
		e, h, s := MatchStop(c.text, []string{"world", "<|end|>"}, false)
		if e != c.emit || h != c.held || s != c.stop {
			t.Errorf("%q: got %q %q %q", c.text, e, h, s)
		}
	}
	// Included, the longest of the stop strings found at the earliest place.
	if e, _, s := MatchStop("say hello world", []string{"hello", "hello w", "world"}, true); e != "say hello w" || s != "hello w" {
		t.Errorf("include: got %q %q", e, s)
	}
}

func TestEOSAndContextFull(t *testing.T) {
	f := enginetest.New(4096, 64, 512)
	f.EOSAt = 30
	s, _ := startScheduler(t, f, nil)
	r := runConcurrently(t, s, []*Request{{Prompt: prompt(1, 20), MaxTokens: 100}})[0]
	if r.finish[0] != FinishStop || r.usage.CompletionTokens != 10 {
		t.Fatalf("EOS: finish %v usage %+v", r.finish, r.usage)
	}
	// Context of 64 cells: generation stops with "length" when it is full.
	f2 := enginetest.New(64, 8, 64)
	s2, _ := startScheduler(t, f2, func(c *Config) { c.MaxRunning = 8; c.MaxBatchTokens = 64; c.KV.BlockTokens = 16 })
	r = runConcurrently(t, s2, []*Request{{Prompt: prompt(1, 20), MaxTokens: 60, IgnoreEOS: true}})[0]
	if r.err != nil || r.finish[0] != FinishLength || r.usage.CompletionTokens != 44 {
		t.Fatalf("context full: %v %v %+v", r.err, r.finish, r.usage)
	}
	// Without max_tokens (and no configured default) the context ends it too.
	r = runConcurrently(t, s2, []*Request{{Prompt: prompt(1, 20)}})[0]
	if r.err != nil || r.finish[0] != FinishLength || r.usage.CompletionTokens != 44 {
		t.Fatalf("no max_tokens: %v %v %+v", r.err, r.finish, r.usage)
	}
	if _, err := s2.Submit(context.Background(), &Request{Prompt: prompt(1, 64)}); !errors.Is(err, ErrPromptTooLong) {
		t.Fatalf("prompt filling the context: %v", err)
	}
}

// TestStopEndsOneChoice: a reader's Stop ends that choice as a stop string
// would, within a step, and frees its KV; the request's other choices go on.
func TestStopEndsOneChoice(t *testing.T) {
	f := enginetest.New(4096, 64, 512)
	f.Delay = time.Millisecond
	s, _ := startScheduler(t, f, nil)
	st, err := s.Submit(context.Background(), &Request{Prompt: prompt(3, 40), MaxTokens: 200, IgnoreEOS: true, N: 2})
	if err != nil {
		t.Fatal(err)
	}
	r := result{text: make([]string, 2), tokens: make([][]engine.Token, 2), finish: make([]FinishReason, 2)}
	for {
		ev, ok := st.Next(context.Background())
		if !ok {
			break
		}
		switch ev.Kind {
		case EventToken:
			if r.tokens[ev.Index] = append(r.tokens[ev.Index], ev.Token); ev.Index == 1 && len(r.tokens[1]) == 5 {
				st.Stop(1)
				st.Stop(1) // again: no effect
			}
		case EventFinish:
			r.finish[ev.Index] = ev.Finish
		case EventDone:
			r.usage = ev.Usage
		case EventError:
			t.Fatal(ev.Err)
		}
	}
	if r.finish[0] != FinishLength || len(r.tokens[0]) != 200 {
		t.Fatalf("choice 0: %s after %d tokens, want length after 200", r.finish[0], len(r.tokens[0]))
	}
	// Tokens the scheduler had produced before it saw Stop still come (a step or two).
	if r.finish[1] != FinishStop || len(r.tokens[1]) > 10 {
		t.Fatalf("choice 1: %s after %d tokens, want stop soon after 5", r.finish[1], len(r.tokens[1]))
	}
	if r.usage.CompletionTokens != len(r.tokens[0])+len(r.tokens[1]) {
		t.Fatalf("usage %+v for %d+%d tokens", r.usage, len(r.tokens[0]), len(r.tokens[1]))
	}
	deadline := time.Now().Add(2 * time.Second) // the load is published after the step
	for l := s.Load(); l.Running != 0 || l.KVBlocksUsed != 0; l = s.Load() {
		if time.Now().After(deadline) {
			t.Fatalf("load after both ended: %+v", l)
		}
		time.Sleep(time.Millisecond)
	}
}

func TestNChoices(t *testing.T) {
	f := enginetest.New(4096, 64, 512)
	s, _ := startScheduler(t, f, nil)
	r := runConcurrently(t, s, []*Request{{Prompt: prompt(2, 30), MaxTokens: 8, N: 3}})[0]
	if r.err != nil || r.usage.CompletionTokens != 24 || r.usage.PromptTokens != 30 {
		t.Fatalf("n=3: %v %+v", r.err, r.usage)
	}
	for i := range 3 {
		// Greedy on a deterministic engine: every choice is the same.
		if !slices.Equal(r.tokens[i], r.tokens[0]) || len(r.tokens[i]) != 8 {
			t.Fatalf("choice %d: %v vs %v", i, r.tokens[i], r.tokens[0])
		}
	}
	// The prompt was computed once.
	total := 0
	for _, b := range f.Batches() {
		total += b.Rows
	}
	if total != 30+3*7 {
		t.Fatalf("rows decoded %d, want %d", total, 30+3*7)
	}
}

func TestSubmitErrors(t *testing.T) {
	f := enginetest.New(256, 8, 256)
	s, _ := startScheduler(t, f, func(c *Config) { c.MaxWaiting = 2; c.MaxRunning = 4; c.MaxBatchTokens = 64 })
	bad := []*Request{
		{},
		{Prompt: []engine.Token{99}},
		{Prompt: []engine.Token{1}, MaxTokens: -1},
		{Prompt: []engine.Token{1}, N: 17},
		{Prompt: []engine.Token{1}, Stop: []string{""}},
	}
	for i, r := range bad {
		if _, err := s.Submit(context.Background(), r); !errors.Is(err, ErrInvalid) {
			t.Errorf("case %d: %v", i, err)
		}
	}
	if _, err := s.Submit(context.Background(), &Request{Prompt: prompt(1, 300)}); !errors.Is(err, ErrPromptTooLong) {
		t.Errorf("long prompt: %v", err)
	}
}

func TestQueueFull(t *testing.T) {
	f := enginetest.New(4096, 64, 512)
	f.Delay = 5 * time.Millisecond
	s, _ := startScheduler(t, f, func(c *Config) { c.MaxWaiting = 2; c.MaxRunning = 1; c.MaxBatchTokens = 16 })
	var errs []error
	for range 6 {
		_, err := s.Submit(context.Background(), &Request{Prompt: prompt(1, 10), MaxTokens: 50})
		errs = append(errs, err)
	}
	full := 0
	for _, err := range errs {
		if errors.Is(err, ErrQueueFull) {
			full++
		}
	}
	if full < 3 {
		t.Fatalf("%d of 6 rejected with a queue of 2: %v", full, errs)
	}
}

func TestDeadline(t *testing.T) {
	f := enginetest.New(4096, 64, 512)
	f.Delay = time.Millisecond
	s, _ := startScheduler(t, f, nil)
	st, _ := s.Submit(context.Background(), &Request{Prompt: prompt(1, 10), MaxTokens: 2000, IgnoreEOS: true, Deadline: time.Now().Add(20 * time.Millisecond)})
	r := collect(context.Background(), st, 1)
	if r.finish[0] != FinishCancelled {
		t.Fatalf("deadline: %v %v", r.finish, r.err)
	}
}

func TestDecodeFailureFailsOnlyItsRequests(t *testing.T) {
	f := enginetest.New(4096, 64, 512)
	calls := 0
	f.Failing = func(b *engine.Batch) error {
		calls++
		if calls == 3 {
			return errors.New("injected failure")
		}
		return nil
	}
	s, _ := startScheduler(t, f, nil)
	r := runConcurrently(t, s, []*Request{{Prompt: prompt(1, 10), MaxTokens: 10}})[0]
	if r.err == nil {
		t.Fatal("want the decode error")
	}
	r = runConcurrently(t, s, []*Request{{Prompt: prompt(2, 10), MaxTokens: 10}})[0]
	if r.err != nil || len(r.tokens[0]) != 10 {
		t.Fatalf("node stopped serving: %v", r.err)
	}
	waitIdle(t, s)
}

// TestNoGoroutineLeaks runs a scheduler inside a synctest bubble: the bubble only
// ends when every goroutine it started has exited.
func TestNoGoroutineLeaks(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		f := enginetest.New(1024, 32, 256)
		f.Delay = time.Millisecond
		cfg := DefaultConfig()
		cfg.MaxBatchTokens, cfg.MaxRunning = 64, 8
		s, err := New(cfg, f, nil)
		if err != nil {
			t.Fatal(err)
		}
		ctx, cancel := context.WithCancel(context.Background())
		done := make(chan struct{})
		go func() { defer close(done); s.Run(ctx) }()
		var wg sync.WaitGroup
		for i := range 10 {
			rctx, rcancel := context.WithCancel(context.Background())
			st, err := s.Submit(rctx, &Request{Prompt: prompt(i, 20), MaxTokens: 20})
			if err != nil {
				t.Fatal(err)
			}
			wg.Go(func() {
				defer rcancel()
				if i%3 == 0 {
					st.Next(context.Background())
					rcancel()
				}
				collect(context.Background(), st, 1)
			})
		}
		wg.Wait()
		// Requests still queued at shutdown get an error, not a hang.
		st, _ := s.Submit(context.Background(), &Request{Prompt: prompt(1, 20), MaxTokens: 1000, IgnoreEOS: true})
		cancel()
		<-done
		if r := collect(context.Background(), st, 1); r.err == nil && r.finish[0] == "" {
			t.Fatal("stream neither finished nor failed at shutdown")
		}
		if _, err := s.Submit(context.Background(), &Request{Prompt: prompt(1, 5)}); !errors.Is(err, ErrClosed) {
			t.Fatalf("submit after shutdown: %v", err)
		}
	})
}

func TestManyRequestsKeepStateFlat(t *testing.T) {
	f := enginetest.New(2048, 64, 512)
	s, _ := startScheduler(t, f, nil)
	for round := range 20 {
		var reqs []*Request
		for i := range 10 {
			reqs = append(reqs, &Request{Prompt: prompt(round*10+i, 30), MaxTokens: 5})
		}
		for i, r := range runConcurrently(t, s, reqs) {
			if r.err != nil {
				t.Fatalf("round %d req %d: %v", round, i, r.err)
			}
		}
	}
	waitIdle(t, s)
	if f.CellsUsed() > 2048 {
		t.Fatalf("engine cells %d", f.CellsUsed())
	}
	_ = fmt.Sprint()
}

// waitIdle waits for the snapshot published after the last request's final step.
func waitIdle(t *testing.T, s *Scheduler) {
	t.Helper()
	deadline := time.Now().Add(2 * time.Second)
	for l := s.Load(); l.Running != 0 || l.Waiting != 0 || l.KVBlocksUsed != 0; l = s.Load() {
		if time.Now().After(deadline) {
			t.Fatalf("not idle: %+v", l)
		}
		time.Sleep(time.Millisecond)
	}
}

// TestQueueWaitCountsSlots: with every running slot taken, a new request waits for
// finishes, however little prefill is queued ahead of it.
func TestQueueWaitCountsSlots(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		f := enginetest.New(4096, 32, 512)
		f.Delay = time.Millisecond
		s, cancel := startScheduler(t, f, func(c *Config) { c.MaxRunning = 2 })
		ctx := context.Background()
		// Some requests finish: the finish rate is measured.
		runConcurrently(t, s, []*Request{
			{Prompt: prompt(1, 8), MaxTokens: 10, IgnoreEOS: true},
			{Prompt: prompt(2, 8), MaxTokens: 10, IgnoreEOS: true},
			{Prompt: prompt(3, 8), MaxTokens: 10, IgnoreEOS: true},
		})
		if l := s.Load(); l.FinishPS <= 0 {
			t.Fatalf("finish rate not measured: %+v", l)
		}
		// Two long requests take both slots; four short ones queue behind them.
		var sts []*Stream
		for i := range 6 {
			n := 4
			if i < 2 {
				n = 400
			}
			st, err := s.Submit(ctx, &Request{Prompt: prompt(10+i, 8), MaxTokens: n, IgnoreEOS: true})
			if err != nil {
				t.Fatal(err)
			}
			sts = append(sts, st)
		}
		time.Sleep(20 * time.Millisecond)
		l := s.Load()
		if l.Running != 2 || l.Waiting != 4 {
			t.Fatalf("want 2 running, 4 waiting: %+v", l)
		}
		prefill := time.Duration(float64(l.PendingTokens) / l.PrefillTokensPS * float64(time.Second))
		slots := time.Duration(5 / l.FinishPS * float64(time.Second))
		// Five finishes: both long ones (400 tokens at half the decode speed
		// each), then three of the short ones, unless the measured rate says sooner.
		bound := time.Duration((400 + 4 + 4) / (l.DecodeTokensPS / 2) * float64(time.Second))
		if want := min(slots, bound); l.QueueWait <= prefill || l.QueueWait > want || l.QueueWait < want*9/10 {
			t.Fatalf("queue wait %v: want the wait for 5 finishes (%v measured, %v at most from the limits), not the prefill ahead (%v)", l.QueueWait, slots, bound, prefill)
		}
		cancel()
		for _, st := range sts {
			collect(context.Background(), st, 1)
		}
	})
}

// TestSlotsFreedIn: the time until slots free, from what the running and
// queued sequences may still generate, at the batch's decode speed shared
// among its slots, each freed slot taking the next queued sequence.
func TestSlotsFreedIn(t *testing.T) {
	for _, c := range []struct {
		left, queued []int
		need         int
		want         time.Duration
	}{
		// 4 slots at 10 tokens/s each (40/s in all).
		{[]int{30, 10, 20, 40}, nil, 1, time.Second},
		{[]int{30, 10, 20, 40}, nil, 3, 3 * time.Second},
		{[]int{30, 10, 20, 40}, []int{50, 5}, 3, 2500 * time.Millisecond}, // 20+5 ends before 30
		{[]int{30, 10, 20, 40}, []int{50, 5}, 6, 6 * time.Second},         // 10+50, the first queued
		// The end of a burst: 4 running with a token left, 100 queued of 40:
		// 25 rounds of 40 after the first token.
		{[]int{1, 1, 1, 1}, slices.Repeat([]int{40}, 100), 101, 100*time.Second + 100*time.Millisecond},
		{nil, nil, 1, maxQueueWait},
	} {
		if got := slotsFreedIn(c.left, c.queued, c.need, 40); got != c.want {
			t.Errorf("%v, %v, %d: %v, want %v", c.left, c.queued, c.need, got, c.want)
		}
	}
	if got := slotsFreedIn([]int{5}, nil, 1, 0); got != maxQueueWait {
		t.Errorf("no decode speed yet: %v", got)
	}
}

func TestRateStartsAtItsFirstSample(t *testing.T) {
	var r rate
	if got := r.add(0, 0); got != 0 {
		t.Fatalf("no samples: %v", got)
	}
	if got := r.add(50, 100*time.Millisecond); math.Abs(got-500) > 1e-9 {
		t.Fatalf("first step: %v tokens/s, want 500", got)
	}
	for range 100 {
		r.add(100, 100*time.Millisecond)
	}
	if got := r.add(100, 100*time.Millisecond); math.Abs(got-1000) > 1 {
		t.Fatalf("steady: %v tokens/s, want 1000", got)
	}
}

// TestBurstWithOneNewPrefixComputesItOnce: requests that arrive together with a
// prefix nobody has computed yet do not each compute it: the later ones wait for the
// first's blocks and reuse them, with the same outputs.
func TestBurstWithOneNewPrefixComputesItOnce(t *testing.T) {
	base := prompt(5, 200)
	var reqs []*Request
	for i := range 4 {
		reqs = append(reqs, &Request{Prompt: append(slices.Clone(base[:192]), engine.Token(10+i), 11, 12), MaxTokens: 6})
	}
	reqs = append(reqs, &Request{Prompt: prompt(9, 50), MaxTokens: 6}) // unrelated: not held up
	want := solo(t, reqs)
	f := enginetest.New(4096, 64, 1024)
	// A budget that holds every prompt at once: without the wait, one step would
	// compute the prefix four times.
	s, _ := startScheduler(t, f, func(c *Config) { c.MaxBatchTokens = 1024 })
	got := runConcurrently(t, s, reqs)
	cached := 0
	for i := range reqs {
		if !slices.Equal(got[i].tokens[0], want[i].tokens[0]) {
			t.Fatalf("request %d: %v want %v", i, got[i].tokens[0], want[i].tokens[0])
		}
		cached += got[i].usage.CachedTokens
	}
	if cached != 3*192 {
		t.Fatalf("cached prompt tokens %d over the burst, want 3×192 (the prefix computed once)", cached)
	}
}

func TestConfigValidateRefusesBadCachePolicy(t *testing.T) {
	for _, mod := range []func(*Config){
		func(c *Config) { c.KV.CacheFloor = 2 },
		func(c *Config) { c.KV.CacheFloor = -0.5 },
		func(c *Config) { c.KV.BlockTokens = 0 },
	} {
		c := DefaultConfig()
		mod(&c)
		if err := c.Validate(); err == nil {
			t.Errorf("%+v: want an error before any engine is sized", c.KV)
		}
	}
	if err := DefaultConfig().Validate(); err != nil {
		t.Fatal(err)
	}
}

// TestNoKVSpaceRequeuesOnce: when the engine cannot place a batch, every sequence
// in it is requeued once (the victim too, when it was in the batch): none is started
// twice, which leaked its first sequence id and blocks for good.
func TestNoKVSpaceRequeuesOnce(t *testing.T) {
	f := enginetest.New(4096, 64, 512)
	failed := false
	f.Failing = func(b *engine.Batch) error {
		// The first batch holding both sequences (on a loaded machine the second
		// may arrive after the first has decoded a few tokens alone).
		if !failed && slices.ContainsFunc(b.Seq, func(s engine.SeqID) bool { return s != b.Seq[0] }) {
			failed = true
			return engine.ErrNoKVSpace
		}
		return nil
	}
	s, _ := startScheduler(t, f, nil)
	for i, r := range runConcurrently(t, s, []*Request{{Prompt: prompt(1, 10), MaxTokens: 10}, {Prompt: prompt(2, 10), MaxTokens: 10}}) {
		if r.err != nil || len(r.tokens[0]) != 10 {
			t.Fatalf("request %d: %d tokens, %v", i, len(r.tokens[0]), r.err)
		}
	}
	waitIdle(t, s)
}

// TestEmbeddingIgnoresCachedPrefix: an embedding is pooled over its whole prompt in
// one pass, even when its prefix is cached.
func TestEmbeddingIgnoresCachedPrefix(t *testing.T) {
	f := enginetest.New(4096, 64, 512)
	s, _ := startScheduler(t, f, nil)
	p := prompt(1, 40)
	for range 2 {
		st, err := s.Submit(context.Background(), &Request{Prompt: p, Embed: true})
		if err != nil {
			t.Fatal(err)
		}
		collect(context.Background(), st, 1) // the fake has no embeddings: an error
		bs := f.Batches()
		if last := bs[len(bs)-1]; last.Rows != len(p) {
			t.Fatalf("an embedding of %d tokens pooled over %d rows", len(p), last.Rows)
		}
	}
}

// TestForksRespectMaxRunning: n choices fork only into free running slots; the rest
// wait and compute their prompt from the cache, so no step exceeds the batch.
func TestForksRespectMaxRunning(t *testing.T) {
	f := enginetest.New(4096, 64, 8)
	s, _ := startScheduler(t, f, func(c *Config) { c.MaxBatchTokens, c.MaxRunning = 8, 8 })
	r := runConcurrently(t, s, []*Request{{Prompt: prompt(1, 5), MaxTokens: 4, N: 16}})[0]
	if r.err != nil {
		t.Fatalf("n=16 with 8 running slots: %v", r.err)
	}
	for i, toks := range r.tokens {
		if len(toks) != 4 {
			t.Fatalf("choice %d: %d tokens", i, len(toks))
		}
	}
	for _, b := range f.Batches() {
		if len(b.Seqs) > 8 {
			t.Fatalf("a step ran %d sequences with 8 running slots", len(b.Seqs))
		}
	}
	waitIdle(t, s)
}

// TestSplitContextInWholeBlocks: with streams that are not a whole number of blocks,
// a request limited by the context generates until its stream's blocks are full.
func TestSplitContextInWholeBlocks(t *testing.T) {
	f := enginetest.NewSplit(100, 4, 512) // 100 cells a stream: 6 blocks of 16
	s, _ := startScheduler(t, f, func(c *Config) { c.MaxRunning = 4 })
	if got := s.MaxContext(); got != 96 {
		t.Fatalf("MaxContext %d, want 96", got)
	}
	st, err := s.Submit(context.Background(), &Request{Prompt: prompt(1, 50), MaxTokens: 200, IgnoreEOS: true})
	if err != nil {
		t.Fatal(err)
	}
	if r := collect(context.Background(), st, 1); r.err != nil || r.finish[0] != FinishLength || len(r.tokens[0]) != 46 {
		t.Fatalf("%d tokens, finish %v, %v", len(r.tokens[0]), r.finish[0], r.err)
	}
}

// TestHeldTextSurvivesEOS: text held back as the possible start of a stop string is
// output when generation ends with EOS instead.
func TestHeldTextSurvivesEOS(t *testing.T) {
	f := enginetest.New(4096, 64, 512)
	f.EOSAt = 16
	s, _ := startScheduler(t, f, nil)
	p := prompt(1, 10)
	want := runConcurrently(t, s, []*Request{{Prompt: p, MaxTokens: 50}})[0].text[0]
	got := runConcurrently(t, s, []*Request{{Prompt: p, MaxTokens: 50, Stop: []string{want[len(want)-1:] + "#"}}})[0]
	if got.err != nil || got.text[0] != want {
		t.Fatalf("text %q (%v), want %q", got.text[0], got.err, want)
	}
}

// TestNoKVSpaceRunsFewer: an engine that cannot place batches of several sequences
// (fragmented cells) makes the scheduler run fewer at a time until they fit, instead
// of retrying the same batch for ever; one that cannot place a sequence alone fails
// it.
func TestNoKVSpaceRunsFewer(t *testing.T) {
	f := enginetest.New(4096, 64, 512)
	f.Failing = func(b *engine.Batch) error {
		seqs := map[engine.SeqID]bool{}
		for _, s := range b.Seq {
			seqs[s] = true
		}
		if len(seqs) >= 2 {
			return engine.ErrNoKVSpace
		}
		return nil
	}
	s, _ := startScheduler(t, f, nil)
	var reqs []*Request
	for i := range 4 {
		reqs = append(reqs, &Request{Prompt: prompt(i+1, 10), MaxTokens: 5})
	}
	for i, r := range runConcurrently(t, s, reqs) {
		if r.err != nil || len(r.tokens[0]) != 5 {
			t.Fatalf("request %d: %d tokens, %v", i, len(r.tokens[0]), r.err)
		}
	}
	waitIdle(t, s)

	f.Failing = func(*engine.Batch) error { return engine.ErrNoKVSpace }
	if r := runConcurrently(t, s, []*Request{{Prompt: prompt(9, 10), MaxTokens: 5}})[0]; !errors.Is(r.err, engine.ErrNoKVSpace) {
		t.Fatalf("a sequence the engine cannot place alone: %v", r.err)
	}
	waitIdle(t, s)
}

// TestPendingCountsQueuedPrefill: a waiting request's uncached prompt counts in the
// published pending prefill (what routers' queue-wait estimates read); its cached
// part does not.
func TestPendingCountsQueuedPrefill(t *testing.T) {
	f := enginetest.New(4096, 64, 512)
	f.Delay = 2 * time.Millisecond
	s, _ := startScheduler(t, f, func(c *Config) { c.MaxRunning = 1 })
	blocker, err := s.Submit(context.Background(), &Request{Prompt: prompt(99, 10), MaxTokens: 40})
	if err != nil {
		t.Fatal(err)
	}
	for s.Load().Running == 0 {
		time.Sleep(100 * time.Microsecond)
	}
	st, err := s.Submit(context.Background(), &Request{Prompt: prompt(1, 48), MaxTokens: 2})
	if err != nil {
		t.Fatal(err)
	}
	// Once the scheduler has taken it into its queue (a step later), while the
	// blocker still holds the only slot.
	deadline := time.Now().Add(2 * time.Second)
	for l := s.Load(); l.PendingTokens < 48 || l.Waiting != 1; l = s.Load() {
		if time.Now().After(deadline) {
			t.Fatalf("one waiting 48-token prompt: %+v", l)
		}
		time.Sleep(100 * time.Microsecond)
	}
	collect(context.Background(), blocker, 1)
	collect(context.Background(), st, 1)
}

// A preemption that takes out a decode row already in the batch (an urgent
// request growing into the space of an earlier, less urgent one) uncounts it: the
// step's prefill tokens are never negative, so the computed-token counter never
// runs backwards. Driven step by step, so that the two collide at a known step.
func TestPreemptedDecodeRowIsUncounted(t *testing.T) {
	f := enginetest.New(64, 8, 64) // 4 blocks of 16
	cfg := DefaultConfig()
	cfg.MaxBatchTokens, cfg.MaxRunning, cfg.KV.BlockTokens = 64, 8, 16
	s, err := New(cfg, f, nil)
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	step := func() {
		s.takeInbox()
		s.step(ctx)
	}
	low, err := s.Submit(ctx, &Request{Prompt: prompt(1, 20), MaxTokens: 28, Priority: 1, IgnoreEOS: true})
	if err != nil {
		t.Fatal(err)
	}
	step()
	urgent, err := s.Submit(ctx, &Request{Prompt: prompt(2, 4), MaxTokens: 20, Priority: -1, IgnoreEOS: true})
	if err != nil {
		t.Fatal(err)
	}
	last := uint64(0)
	for i := 0; i < 200 && (len(s.running) > 0 || len(s.queue) > 0 || i == 0); i++ {
		step()
		if c := s.stats.ComputedTokens; c < last || c > 1000 {
			t.Fatalf("step %d: computed prompt tokens went from %d to %d", i, last, c)
		}
		last = s.stats.ComputedTokens
	}
	if s.stats.Preemptions == 0 {
		t.Fatal("no preemption: the test does not make the two collide")
	}
	for name, st := range map[string]*Stream{"low": low, "urgent": urgent} {
		ctx, cancel := context.WithTimeout(ctx, time.Second)
		r := collect(ctx, st, 1)
		cancel()
		if r.err != nil || r.finish[0] != FinishLength {
			t.Fatalf("%s: %v %v", name, r.err, r.finish)
		}
	}
}

// A node whose every slot has been held by long generations for long enough that
// its finish rate decayed towards zero reports the longest wait, not none (the
// quotient overflowed a Duration and came out as no wait at all).
func TestQueueWaitWithDecayedFinishRate(t *testing.T) {
	f := enginetest.New(4096, 8, 512)
	cfg := DefaultConfig()
	cfg.MaxRunning = 1
	s, err := New(cfg, f, nil)
	if err != nil {
		t.Fatal(err)
	}
	s.endedAny = true
	s.waiting.Store(4)
	for _, fps := range []float64{1e-6, 1e-12, 0} {
		s.stats.FinishPS = fps
		s.publish()
		if w := s.Load().QueueWait; w < time.Hour {
			t.Fatalf("finish rate %g/s with 4 waiting and no free slot: queue wait %v", fps, w)
		}
	}
	// The running sequence's limit bounds it: 40 tokens left at 20 a second,
	// then the four waiting, of 40 tokens each, in turn.
	s.running = []*seq{{maxNew: 100, gen: 60, tokens: make([]engine.Token, 70)}}
	for range 4 {
		s.queue = append(s.queue, &seq{maxNew: 40, tokens: make([]engine.Token, 10)})
	}
	s.stats.FinishPS, s.stats.DecodeTokensPS = 1e-6, 20
	s.publish()
	if w := s.Load().QueueWait; w != 10*time.Second {
		t.Fatalf("a decayed finish rate, the running sequence's limit 40 tokens away: queue wait %v, want 10s", w)
	}
}

// TestPromptLogprobs: a prompt's scores are those of its tokens decoded one by
// one (a greedy continuation scored as a prompt gives its own logprobs), and are
// the same whether the prompt is computed in one chunk or many, beside others,
// with its prefix cached, preempted and resumed, or with n choices.
func TestPromptLogprobs(t *testing.T) {
	f := enginetest.New(4096, 32, 512)
	s, _ := startScheduler(t, f, nil)
	base := prompt(1, 40)
	gen := runConcurrently(t, s, []*Request{{Prompt: base, MaxTokens: 12, Sampling: sample.Params{Logprobs: true}}})[0]
	whole := append(slices.Clone(base), gen.tokens[0]...)
	scored := runConcurrently(t, s, []*Request{{Prompt: whole, MaxTokens: 1, PromptLogprobs: true, PromptTopLogprobs: 3}})[0]
	if scored.err != nil || scored.prompts != 1 || scored.late != 0 || len(scored.prompt) != len(whole)-1 {
		t.Fatalf("scored: err %v, %d events (%d late), %d scores for %d tokens", scored.err, scored.prompts, scored.late, len(scored.prompt), len(whole))
	}
	if scored.usage.CachedTokens != 0 {
		t.Fatalf("a scored prompt took %d tokens from the cache", scored.usage.CachedTokens)
	}
	for i, tok := range gen.tokens[0] {
		sc := scored.prompt[len(base)-1+i]
		if sc.Token != tok || sc.Logprob != gen.logprobs[i] || sc.Rank != 1 || len(sc.Top) != 3 || sc.Top[0].Token != tok {
			t.Fatalf("generated token %d (%d, logprob %v) scored as %+v", i, tok, gen.logprobs[i], sc)
		}
	}
	for i, sc := range scored.prompt {
		if sc.Token != whole[i+1] || sc.Rank < 1 || sc.Logprob > 0 {
			t.Fatalf("score %d: %+v for token %d", i, sc, whole[i+1])
		}
	}

	// Every way of computing it gives the same scores.
	reqs := mixedRequests(12)
	for i, r := range reqs {
		r.MaxTokens = 60
		if i%2 == 0 {
			r.PromptLogprobs, r.PromptTopLogprobs = true, i%4
		}
		if i == 4 {
			r.N = 3
		}
	}
	reqs = append(reqs, &Request{Prompt: []engine.Token{1}, MaxTokens: 2, PromptLogprobs: true})
	want := solo(t, reqs)
	check := func(what string, got []result) {
		t.Helper()
		for i, r := range reqs {
			g, w := got[i], want[i]
			if g.err != nil || !slices.Equal(g.tokens[0], w.tokens[0]) {
				t.Fatalf("%s: request %d: %v (%v), want %v", what, i, g.tokens[0], g.err, w.tokens[0])
			}
			n := 0
			if r.PromptLogprobs {
				n = 1
			}
			if g.prompts != n || g.late != 0 || len(g.prompt) != len(w.prompt) || n == 1 && len(g.prompt) != len(r.Prompt)-1 {
				t.Fatalf("%s: request %d: %d score events (%d late), %d scores for %d prompt tokens", what, i, g.prompts, g.late, len(g.prompt), len(r.Prompt))
			}
			for j := range g.prompt {
				if a, b := g.prompt[j], w.prompt[j]; a.Token != b.Token || a.Logprob != b.Logprob || a.Rank != b.Rank || !slices.Equal(a.Top, b.Top) {
					t.Fatalf("%s: request %d score %d: %+v, want %+v", what, i, j, a, b)
				}
			}
		}
	}
	// In chunks of 8 tokens, beside the others.
	s, _ = startScheduler(t, enginetest.New(4096, 64, 512), func(c *Config) { c.MaxBatchTokens, c.MaxRunning = 8, 4 })
	check("chunked", runConcurrently(t, s, reqs))
	// With every prompt cached: the scored ones compute theirs again.
	check("cached", runConcurrently(t, s, reqs))
	// Preempted: 512 cells cannot hold 12 sequences of up to ~150 tokens at once.
	s, _ = startScheduler(t, enginetest.New(512, 64, 512), func(c *Config) { c.MaxBatchTokens = 128 })
	check("preempted", runConcurrently(t, s, reqs))
	if s.Load().Preemptions == 0 {
		t.Fatal("expected preemptions with a small pool")
	}
}

// TestScoredPromptResumesFromItsBlocks: a prompt being scored, preempted with
// its computed tokens on a block boundary, takes back every block it computed
// and scored, as an unscored prompt does: it computes each token once, and
// keeps nothing past the cache budget.
func TestScoredPromptResumesFromItsBlocks(t *testing.T) {
	for _, score := range []bool{false, true} {
		cfg := DefaultConfig()
		cfg.MaxBatchTokens, cfg.MaxRunning = 32, 8
		s, err := New(cfg, enginetest.New(4096, 16, 512), nil)
		if err != nil {
			t.Fatal(err)
		}
		ctx := context.Background()
		st, err := s.Submit(ctx, &Request{Prompt: prompt(3, 100), MaxTokens: 1, PromptLogprobs: score})
		if err != nil {
			t.Fatal(err)
		}
		s.takeInbox()
		s.step(ctx)
		s.step(ctx)
		q := s.running[0]
		if q.computed() != 64 {
			t.Fatalf("computed %d, want 64 after two steps of 32", q.computed())
		}
		s.preempt(q)
		s.step(ctx)
		if q.kv.Cached() != 64 {
			t.Fatalf("score=%v: resumed with %d of its 64 computed tokens", score, q.kv.Cached())
		}
		for i := 0; i < 20 && len(s.running)+len(s.queue) > 0; i++ {
			s.step(ctx)
		}
		if r := collect(ctx, st, 1); r.err != nil || score && len(r.prompt) != 99 {
			t.Fatalf("score=%v: %v, %d scores", score, r.err, len(r.prompt))
		}
		if s.stats.ComputedTokens != 100 {
			t.Fatalf("score=%v: %d tokens computed for a prompt of 100", score, s.stats.ComputedTokens)
		}
		if l := s.pool.Stats(); l.Cached > l.CacheBudget {
			t.Fatalf("score=%v: %d blocks cached over a budget of %d", score, l.Cached, l.CacheBudget)
		}
	}
}

// TestSpeculativeEqualsPlain: with proposals (Config.Spec) every request says
// exactly what it says without them, greedy or sampled with a seed, alone,
// beside others, preempted, or ended by EOS, a stop string or max_tokens
// amid accepted proposals; on a model that repeats itself most proposals are
// taken, no batch passes the budget, and nothing is left in the pool.
func TestSpeculativeEqualsPlain(t *testing.T) {
	reqs := mixedRequests(16)
	for i, r := range reqs {
		r.MaxTokens = 20 + i*5
		switch i % 4 {
		case 1:
			r.Sampling = sample.Params{Temperature: 3, Seed: uint64(i)} // many proposals turned down
		case 2:
			r.Stop = []string{"ab"}
		case 3:
			r.N = 2
			r.Sampling = sample.Params{Temperature: 1, Seed: uint64(i), Logprobs: true}
		}
	}
	run := func(cells, batch int, spec int, eos int) ([]result, Load, *enginetest.Fake) {
		f := enginetest.New(cells, 64, 512)
		f.Period, f.EOSAt = 7, eos
		s, _ := startScheduler(t, f, func(c *Config) {
			c.MaxBatchTokens = batch
			c.Spec.Tokens = spec
		})
		got := runConcurrently(t, s, reqs)
		deadline := time.Now().Add(5 * time.Second)
		for l := s.Load(); l.KVBlocksUsed != 0 || l.Running != 0; l = s.Load() {
			if time.Now().After(deadline) {
				t.Fatalf("spec %d: %d blocks used, %d running after every request ended", spec, l.KVBlocksUsed, l.Running)
			}
			time.Sleep(time.Millisecond)
		}
		return got, s.Load(), f
	}
	for _, c := range []struct {
		name         string
		cells, batch int
		eos          int
	}{{"roomy", 4096, 128, 0}, {"preempted", 600, 128, 0}, {"eos", 4096, 64, 60}} {
		want, _, _ := run(c.cells, c.batch, 0, c.eos)
		got, l, f := run(c.cells, c.batch, 5, c.eos)
		for i := range reqs {
			for j := range max(reqs[i].N, 1) {
				if got[i].err != nil || !slices.Equal(got[i].tokens[j], want[i].tokens[j]) || got[i].text[j] != want[i].text[j] || got[i].finish[j] != want[i].finish[j] {
					t.Fatalf("%s: request %d choice %d: %v %q %v (%v), want %v %q %v", c.name, i, j, got[i].tokens[j], got[i].text[j], got[i].finish[j], got[i].err, want[i].tokens[j], want[i].text[j], want[i].finish[j])
				}
			}
			if got[i].usage.CompletionTokens != want[i].usage.CompletionTokens {
				t.Fatalf("%s: request %d: usage %+v, want %+v", c.name, i, got[i].usage, want[i].usage)
			}
		}
		if l.SpecProposed == 0 || l.SpecAccepted*2 < l.SpecProposed {
			t.Fatalf("%s: %d of %d proposals taken on a model that repeats itself", c.name, l.SpecAccepted, l.SpecProposed)
		}
		// By position: token j is taken only after token j-1 of the same
		// proposal, and the positions add up to the tokens taken.
		var taken, steps uint64
		for j, n := range l.SpecAcceptedAt {
			taken += n
			if j > 0 && n > l.SpecAcceptedAt[j-1] || j >= l.SpecTokens && n > 0 {
				t.Fatalf("%s: taken by position %v (of %d)", c.name, l.SpecAcceptedAt, l.SpecTokens)
			}
		}
		if l.SpecTokens != 5 || taken != l.SpecAccepted || l.SpecAcceptedAt[0] > l.SpecDrafts || l.SpecDrafts*5 < l.SpecProposed {
			t.Fatalf("%s: %d drafts, %d tokens, %d taken, by position %v", c.name, l.SpecDrafts, l.SpecProposed, l.SpecAccepted, l.SpecAcceptedAt)
		}
		for _, n := range l.StepTokens {
			steps += n
		}
		if steps != l.Steps {
			t.Fatalf("%s: %d steps, %d in the step histogram", c.name, l.Steps, steps)
		}
		for i, b := range f.Batches() {
			if b.Rows > c.batch {
				t.Fatalf("%s: batch %d has %d rows, budget %d", c.name, i, b.Rows, c.batch)
			}
		}
		t.Logf("%s: %d of %d proposals taken, %d preemptions", c.name, l.SpecAccepted, l.SpecProposed, l.Preemptions)
	}
}

func TestProposal(t *testing.T) {
	tk := func(xs ...int) []engine.Token {
		out := make([]engine.Token, len(xs))
		for i, x := range xs {
			out[i] = engine.Token(x)
		}
		return out
	}
	for _, c := range []struct {
		toks       []engine.Token
		k, nmax, n int
		want       []engine.Token
	}{
		{tk(1, 2, 3, 4, 5, 1, 2, 3), 3, 3, 1, tk(4, 5, 1)}, // the longest tail
		{tk(1, 2, 3, 9, 2, 3, 7, 2, 3), 2, 3, 2, tk(7, 2)}, // the latest occurrence
		{tk(5, 6, 7, 8, 6, 7), 5, 3, 2, tk(8, 6, 7)},       // up to the end
		{tk(1, 2, 3, 4), 3, 3, 1, nil},                     // no repeat
		{tk(4, 4, 4, 4), 2, 2, 2, tk(4)},                   // overlapping, cut by the end
		{tk(1, 2, 9, 2), 3, 3, 2, nil},                     // only a 1-gram repeats
		{tk(1, 2, 9, 2), 3, 3, 1, tk(9, 2)},
	} {
		if got := proposal(c.toks, c.k, c.nmax, c.n); !slices.Equal(got, c.want) {
			t.Errorf("proposal(%v, k=%d, n=%d..%d) = %v, want %v", c.toks, c.k, c.n, c.nmax, got, c.want)
		}
	}
}

// TestCutPassesHeldText: a reader's Cut ends a choice as max_tokens would, and
// the text held back as the possible start of a stop string comes with the
// finish; Stop drops it, as a stop string would.
func TestCutPassesHeldText(t *testing.T) {
	p := prompt(5, 20)
	ref := solo(t, []*Request{{Prompt: p, MaxTokens: 8}})[0].text[0]
	for _, cut := range []bool{true, false} {
		cfg := DefaultConfig()
		cfg.MaxBatchTokens, cfg.MaxRunning = 64, 4
		s, err := New(cfg, enginetest.New(4096, 8, 512), nil)
		if err != nil {
			t.Fatal(err)
		}
		ctx := context.Background()
		// The stop string begins with the text's 4th and 5th characters and
		// goes on otherwise: those two are held back once generated.
		st, err := s.Submit(ctx, &Request{Prompt: p, MaxTokens: 8, Stop: []string{ref[3:5] + "@"}})
		if err != nil {
			t.Fatal(err)
		}
		s.takeInbox()
		for range 5 { // five tokens, the first with the prompt
			s.step(ctx)
		}
		if cut {
			st.Cut(0)
		} else {
			st.Stop(0)
		}
		s.step(ctx)
		r := collect(ctx, st, 1)
		want, reason := ref[:5], FinishLength
		if !cut {
			want, reason = ref[:3], FinishStop
		}
		if r.err != nil || r.text[0] != want || r.finish[0] != reason {
			t.Fatalf("cut %v: %q %s (%v), want %q %s", cut, r.text[0], r.finish[0], r.err, want, reason)
		}
	}
}

// TestSpeculativeKeepsTheCache: proposals change nothing in the prefix cache.
// A request ending amid its proposals (max_tokens, EOS) leaves cached what it
// computed, as without proposals (a follow-up with its prompt and output finds
// as many tokens cached); and proposals take only free cells, never a cached
// prefix's.
func TestSpeculativeKeepsTheCache(t *testing.T) {
	for _, eos := range []int{0, 61} {
		for maxTok := 5; maxTok < 40; maxTok += 3 {
			var cached [2]int
			for k, spec := range []int{0, 5} {
				f := enginetest.New(4096, 16, 512)
				f.Period, f.EOSAt = 7, eos
				s, _ := startScheduler(t, f, func(c *Config) { c.Spec.Tokens = spec })
				p := prompt(3, 20)
				r := runConcurrently(t, s, []*Request{{Prompt: p, MaxTokens: maxTok}})[0]
				follow := slices.Concat(p, r.tokens[0], []engine.Token{5, 6, 7})
				cached[k] = runConcurrently(t, s, []*Request{{Prompt: follow, MaxTokens: 1}})[0].usage.CachedTokens
			}
			if cached[0] != cached[1] {
				t.Fatalf("eos %d, max_tokens %d: the follow-up found %d tokens cached without proposals, %d with", eos, maxTok, cached[0], cached[1])
			}
		}
	}
	var cached [2]int
	for k, spec := range []int{0, 5} {
		f := enginetest.New(512, 16, 512)
		f.Period = 7
		s, _ := startScheduler(t, f, func(c *Config) { c.Spec.Tokens, c.KV.CacheFloor = spec, 1 })
		a := prompt(5, 65)
		runConcurrently(t, s, []*Request{{Prompt: a, MaxTokens: 1}})
		f.EOSAt = 449 // the next request's KV ends at 448 positions, every free block
		runConcurrently(t, s, []*Request{{Prompt: prompt(9, 20), MaxTokens: 480}})
		f.EOSAt = 0
		cached[k] = runConcurrently(t, s, []*Request{{Prompt: a, MaxTokens: 1}})[0].usage.CachedTokens
	}
	if cached[0] != cached[1] {
		t.Fatalf("a prompt cached before a request that used every free block: %d tokens still cached without proposals, %d with", cached[0], cached[1])
	}
	// A request that fails at its first draw (the fake compiles no grammar),
	// with proposals after its prompt, leaves its prompt cached all the same.
	var rep []engine.Token
	for i := range 40 {
		rep = append(rep, engine.Token(3+i%7))
	}
	for k, spec := range []int{0, 5} {
		f := enginetest.New(4096, 16, 512)
		f.Period = 7
		s, _ := startScheduler(t, f, func(c *Config) { c.Spec.Tokens = spec })
		if r := runConcurrently(t, s, []*Request{{Prompt: rep, MaxTokens: 10, Grammar: `root ::= "x"`}})[0]; r.err == nil {
			t.Fatal("the fake compiled a grammar")
		}
		cached[k] = runConcurrently(t, s, []*Request{{Prompt: slices.Concat(rep, []engine.Token{5, 6}), MaxTokens: 1}})[0].usage.CachedTokens
	}
	if cached[0] != cached[1] {
		t.Fatalf("after a failed first draw: %d tokens cached without proposals, %d with", cached[0], cached[1])
	}
}

// TestSpeculativeEdges: a lone request whose batch with proposals does not fit
// the engine's cells runs on without them; a model whose memory cannot be cut
// back (recurrent) gets no proposals; the decode rate counts the tokens
// proposals add.
func TestSpeculativeEdges(t *testing.T) {
	f := enginetest.New(4096, 16, 512)
	f.Period, f.EOSAt = 7, 90 // the KV ends at 89 positions
	f.Failing = func(b *engine.Batch) error {
		if f.CellsUsed()+b.Len() > 92 { // room for the request, not for all its proposals
			return engine.ErrNoKVSpace
		}
		return nil
	}
	s, _ := startScheduler(t, f, func(c *Config) { c.Spec.Tokens, c.KV.Caching = 5, false })
	if r := runConcurrently(t, s, []*Request{{Prompt: prompt(9, 20), MaxTokens: 200}})[0]; r.err != nil || r.finish[0] != FinishStop {
		t.Fatalf("a lone request whose proposals did not fit: %v %v", r.err, r.finish)
	}

	rf := enginetest.New(4096, 16, 512)
	rf.Period = 7
	cfg := DefaultConfig()
	cfg.MaxBatchTokens, cfg.MaxRunning, cfg.Spec.Tokens = 64, 16, 5
	s, err := New(cfg, recurrent{rf}, nil)
	if err != nil {
		t.Fatal(err)
	}
	if s.cfg.Spec.Tokens != 0 {
		t.Fatal("proposals on a model whose memory cannot be cut back")
	}

	f = enginetest.New(4096, 16, 512)
	f.Period, f.Delay = 7, 2*time.Millisecond
	s, _ = startScheduler(t, f, func(c *Config) { c.Spec.Tokens = 5 })
	start := time.Now()
	r := runConcurrently(t, s, []*Request{{Prompt: prompt(9, 20), MaxTokens: 400}})[0]
	real := float64(len(r.tokens[0])) / time.Since(start).Seconds()
	if l := s.Load(); l.DecodeTokensPS < real/2 {
		t.Fatalf("decode rate %.0f tok/s, %.0f measured", l.DecodeTokensPS, real)
	}
}

// recurrent is a fake whose memory, as llama.cpp's recurrent memory, cannot be
// shared or cut at a position past 0.
type recurrent struct{ *enginetest.Fake }

func (r recurrent) Capacity() engine.Capacity {
	c := r.Fake.Capacity()
	c.PrefixReuse, c.PrefixSharing = false, false
	return c
}

func (r recurrent) SeqRemove(s engine.SeqID, p0, p1 engine.Pos) error {
	if s >= 0 && p0 > 0 {
		return engine.ErrUnsupported
	}
	return r.Fake.SeqRemove(s, p0, p1)
}

// TestSpeculativeStopsWithItsReader: a reader's Stop that comes while a step
// runs ends the proposals it checks: the step yields its decode row's token
// only, not the proposals the model would have taken.
func TestSpeculativeStopsWithItsReader(t *testing.T) {
	f := enginetest.New(4096, 8, 512)
	f.Period = 7
	cfg := DefaultConfig()
	cfg.MaxBatchTokens, cfg.MaxRunning, cfg.Spec.Tokens = 64, 4, 5
	s, err := New(cfg, f, nil)
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	st, err := s.Submit(ctx, &Request{Prompt: prompt(2, 30), MaxTokens: 100})
	if err != nil {
		t.Fatal(err)
	}
	s.takeInbox()
	for range 3 { // the prompt, then steps whose proposals are taken
		s.step(ctx)
	}
	before := s.Load().GeneratedTokens
	if s.stats.SpecAccepted == 0 {
		t.Fatal("no proposals taken on a model that repeats itself")
	}
	f.Failing = func(*engine.Batch) error { st.Stop(0); return nil } // during the next decode
	s.step(ctx)
	if got := s.stats.GeneratedTokens - before; got != 1 {
		t.Fatalf("the step during which the reader stopped yielded %d tokens, want 1", got)
	}
	f.Failing = nil
	s.step(ctx)
	if r := collect(ctx, st, 1); r.finish[0] != FinishStop {
		t.Fatalf("finish %v", r.finish)
	}
}

// TestAdaptersEqualSolo: requests under LoRA adapters and without, with the
// same prompts, run together (in turns, one adapter per step) as each does
// alone; each adapter reuses its own cached prefixes and never another's,
// through preemption too.
func TestAdaptersEqualSolo(t *testing.T) {
	var reqs []*Request
	for i := range 18 {
		p := prompt(i%3, 40+i%3*7) // three prompts, each under every adapter
		reqs = append(reqs, &Request{Prompt: p, MaxTokens: 5 + i%5*4, Adapter: i / 3 % 3})
	}
	adapters := func(c *Config) { c.Adapters = []string{"a", "b"} }
	var want []result
	for _, r := range reqs {
		f := enginetest.New(4096, 32, 512)
		f.Adapters = 2
		s, _ := startScheduler(t, f, func(c *Config) { adapters(c); c.KV.Caching = false })
		st, err := s.Submit(context.Background(), r)
		if err != nil {
			t.Fatal(err)
		}
		want = append(want, collect(context.Background(), st, 1))
	}
	for i := 3; i < 6; i++ {
		if slices.Equal(want[i].tokens[0], want[i-3].tokens[0]) {
			t.Fatalf("request %d: the fake answers the same under adapter 1 as under none", i)
		}
	}
	for _, cells := range []int{4096, 300} {
		f := enginetest.New(cells, 32, 512)
		f.Adapters = 2
		s, _ := startScheduler(t, f, adapters)
		for round := range 2 { // the second finds every prefix cached, under its own adapter
			got := runConcurrently(t, s, reqs)
			for i := range reqs {
				if got[i].err != nil || !slices.Equal(got[i].tokens[0], want[i].tokens[0]) {
					t.Fatalf("cells %d, round %d, request %d (adapter %d): %v %v, want %v", cells, round, i, reqs[i].Adapter, got[i].err, got[i].tokens, want[i].tokens)
				}
			}
			if cells == 4096 && round == 1 {
				for i := range reqs {
					if got[i].usage.CachedTokens == 0 {
						t.Errorf("round 2, request %d (adapter %d): nothing cached", i, reqs[i].Adapter)
					}
				}
			}
		}
	}
	f := enginetest.New(4096, 32, 512)
	s, _ := startScheduler(t, f, adapters)
	if _, err := s.Submit(context.Background(), &Request{Prompt: prompt(0, 4), Adapter: 3}); !errors.Is(err, ErrInvalid) {
		t.Errorf("adapter 3 of 2: %v", err)
	}
}

// TestMediaCut: a step's chunk of a prompt never ends within an image that
// is computed whole.
func TestMediaCut(t *testing.T) {
	r := &Request{Media: []engine.Media{{Pos: 5, Len: 10}, {Pos: 20, Len: 4}}}
	for _, c := range []struct{ from, to, want int }{
		{0, 5, 5}, {0, 6, 5}, {0, 14, 5}, {0, 15, 15}, {5, 12, 5}, {15, 22, 20}, {15, 30, 30}, {20, 24, 24}, {0, 3, 3},
	} {
		if got := r.mediaCut(c.from, c.to); got != c.want {
			t.Errorf("mediaCut(%d, %d) = %d, want %d", c.from, c.to, got, c.want)
		}
	}
}

// wholeMedia is the fake engine reporting images computed whole (Gemma 3's
// projector): no prefix reuse, micro-batches of 64 rows.
type wholeMedia struct{ *enginetest.Fake }

func (w wholeMedia) Capacity() engine.Capacity {
	c := w.Fake.Capacity()
	c.PrefixReuse, c.PrefixSharing, c.WholeMedia, c.MicroBatchTokens = false, false, true, 64
	return c
}

// TestWholeImageNotStarved: an image computed whole waits for a step with
// room for it, and meanwhile no one else is admitted, so the running
// sequences' decode rows drain and it runs once they have ended, not once
// the queue has.
func TestWholeImageNotStarved(t *testing.T) {
	synctest.Test(t, wholeImageNotStarved)
}

func wholeImageNotStarved(t *testing.T) {
	f := enginetest.New(8192, 32, 512)
	f.Delay = time.Millisecond
	cfg := DefaultConfig()
	cfg.MaxBatchTokens, cfg.MaxRunning, cfg.MaxWaiting = 20, 8, 1000
	s, err := New(cfg, wholeMedia{f}, nil)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { defer close(done); s.Run(ctx) }()
	defer func() { cancel(); <-done }()
	const n = 60
	var textDone atomic.Int64
	var wg sync.WaitGroup
	for k := range n {
		// Lengths that end at different steps: the batch never empties at once.
		st, err := s.Submit(ctx, &Request{Prompt: prompt(k, 4), MaxTokens: 10 + (k*7)%23, IgnoreEOS: true})
		if err != nil {
			t.Fatal(err)
		}
		wg.Go(func() { collect(ctx, st, 1); textDone.Add(1) })
	}
	deadline := time.Now().Add(10 * time.Second)
	for s.Load().Running < cfg.MaxRunning && time.Now().Before(deadline) {
		time.Sleep(time.Millisecond)
	}
	p := prompt(999, 25)
	m := engine.Media{Pos: 3, Len: 16, Embd: make([]float32, 16*f.EmbdWidth)}
	for i := range m.Len {
		p[m.Pos+i] = engine.Placeholder(42, i)
	}
	st, err := s.Submit(ctx, &Request{Prompt: p, Media: []engine.Media{m}, MaxTokens: 2, IgnoreEOS: true, Priority: -1})
	if err != nil {
		t.Fatal(err)
	}
	if r := collect(ctx, st, 1); r.err != nil {
		t.Fatal(r.err)
	}
	if d := textDone.Load(); d > 3*int64(cfg.MaxRunning) {
		t.Errorf("the image ran after %d of %d text requests had ended: it waited for the queue, not for the running batch", d, n)
	}
	big := p
	big2 := engine.Media{Pos: 3, Len: 21, Embd: make([]float32, 21*f.EmbdWidth)}
	big = append(slices.Clone(big[:3]), make([]engine.Token, 21)...)
	for i := range big2.Len {
		big[3+i] = engine.Placeholder(43, i)
	}
	big = append(big, 5)
	if _, err := s.Submit(ctx, &Request{Prompt: big, Media: []engine.Media{big2}, MaxTokens: 1}); !errors.Is(err, ErrPromptTooLong) {
		t.Errorf("an image of 21 tokens in steps of 20: %v, want ErrPromptTooLong", err)
	}
	wg.Wait()
}

// mropeRequest is a prompt of seed with images placed by M-RoPE: grids of
// cols×rows at the given prompt indices, text around them.
func mropeRequest(seed, n int, width int, images ...[3]int) *Request {
	p := prompt(seed, n)
	r := &Request{Prompt: p}
	for k, im := range images {
		m := engine.Media{Pos: im[0], Len: im[1] * im[2], Cols: im[1], Rows: im[2], Embd: make([]float32, im[1]*im[2]*width)}
		for i := range m.Len {
			p[m.Pos+i] = engine.Placeholder(uint64(seed*10+k)^uint64(m.Cols)<<20^uint64(m.Rows), i) // content and shape, as the projector's
		}
		r.Media = append(r.Media, m)
	}
	return r
}

// soloMRoPE is solo on the fake engine placing images by M-RoPE, whose
// sequences repeat themselves every period tokens (0: never).
func soloMRoPE(t *testing.T, reqs []*Request, period int) []result {
	t.Helper()
	return soloOn(t, reqs, func(f *enginetest.Fake) { f.MRoPE, f.Period = true, period })
}

// TestMRoPEImages: requests with images placed by M-RoPE (on the fake
// engine that models them: its logits depend on each cell's position, line
// and column, and it fails a sequence holding two cells at one place) give
// the same tokens alone and together under KV pressure, with preemptions,
// forks, proposals, cached prefixes before their images, small steps that
// cut their images, and unified or per-stream pools.
func TestMRoPEImages(t *testing.T) {
	mk := func(i int) *Request {
		var r *Request
		switch i % 4 {
		case 3:
			r = &Request{Prompt: prompt(1, 44)} // text only, among sequences with images
		case 0:
			r = mropeRequest(1, 40, 8, [3]int{20, 4, 3}) // an image of 4×3 after a shared text
		case 1:
			r = mropeRequest(1, 48, 8, [3]int{20, 3, 5}, [3]int{38, 2, 2})
		default:
			r = mropeRequest(2, 30, 8, [3]int{1, 5, 2})
		}
		r.MaxTokens, r.IgnoreEOS = 20+i*7%30, true
		if i%5 == 3 {
			r.N = 2
		}
		return r
	}
	var reqs []*Request
	for i := range 14 {
		reqs = append(reqs, mk(i))
	}
	want := soloMRoPE(t, reqs, 7)
	for _, unified := range []bool{true, false} {
		f := enginetest.New(256, 64, 512)
		if !unified {
			f = enginetest.NewSplit(120, 16, 512)
		}
		f.MRoPE, f.Period = true, 7
		s, _ := startScheduler(t, f, func(c *Config) { c.MaxBatchTokens, c.MaxRunning, c.Spec.Tokens = 24, 8, 3 })
		got := runConcurrently(t, s, reqs)
		for i := range reqs {
			for k := range want[i].tokens {
				if got[i].err != nil || !slices.Equal(got[i].tokens[k], want[i].tokens[k]) {
					t.Errorf("unified %v, request %d choice %d: %v (%v), alone %v", unified, i, k, got[i].tokens[k], got[i].err, want[i].tokens[k])
				}
			}
		}
		l := s.Load()
		t.Logf("unified %v: %d preemptions, %d of %d prompt tokens cached, %d proposals accepted", unified, l.Preemptions, l.PrefixHits, l.PrefixQueries, l.SpecAccepted)
		if l.PrefixHits == 0 || l.SpecAccepted == 0 || unified && l.Preemptions == 0 {
			t.Errorf("unified %v: %d preemptions, %d cached tokens, %d proposals accepted: want all", unified, l.Preemptions, l.PrefixHits, l.SpecAccepted)
		}
	}
}

// TestMRoPEImageThenOtherText: a prompt with the picture another one ended
// with mid-block, then other text, takes the picture's cells to its end from
// the cache (not only the blocks before it), in both pools, and generates as
// alone.
func TestMRoPEImageThenOtherText(t *testing.T) {
	first := mropeRequest(1, 40, 8, [3]int{20, 4, 4}) // the picture ends at 36, within the third block
	other := mropeRequest(1, 44, 8, [3]int{20, 4, 4})
	copy(other.Prompt[36:], prompt(3, 8))
	for _, r := range []*Request{first, other} {
		r.MaxTokens, r.IgnoreEOS = 24, true // the first fills its third block
	}
	want := soloMRoPE(t, []*Request{other}, 7)[0]
	for _, unified := range []bool{true, false} {
		f := enginetest.New(256, 64, 512)
		if !unified {
			f = enginetest.NewSplit(120, 16, 512)
		}
		f.MRoPE, f.Period = true, 7
		s, _ := startScheduler(t, f, func(c *Config) { c.KV.CacheFloor = 1 }) // keeps what nobody reused yet
		var got result
		for _, r := range []*Request{first, other} {
			st, err := s.Submit(context.Background(), r)
			if err != nil {
				t.Fatal(err)
			}
			got = collect(context.Background(), st, 1)
		}
		if got.err != nil || !slices.Equal(got.tokens[0], want.tokens[0]) {
			t.Errorf("unified %v: %v (%v), alone %v", unified, got.tokens[0], got.err, want.tokens[0])
		}
		if got.usage.CachedTokens != 36 {
			t.Errorf("unified %v: %d prompt tokens cached, want 36 (the text and the whole picture)", unified, got.usage.CachedTokens)
		}
	}
}

// errorLog records what a scheduler logs at warning level and above.
type errorLog struct {
	mu   sync.Mutex
	msgs []string
}

func (h *errorLog) Enabled(_ context.Context, l slog.Level) bool { return l >= slog.LevelWarn }
func (h *errorLog) WithAttrs([]slog.Attr) slog.Handler           { return h }
func (h *errorLog) WithGroup(string) slog.Handler                { return h }
func (h *errorLog) Handle(_ context.Context, r slog.Record) error {
	m := r.Message
	r.Attrs(func(a slog.Attr) bool { m += " " + a.String(); return true })
	h.mu.Lock()
	h.msgs = append(h.msgs, m)
	h.mu.Unlock()
	return nil
}

// TestMRoPEStepFailsWithinImage: a step that fails while an M-RoPE image is
// half computed fails its request, and every range its release gives back
// ends outside the image: the requests that then take its sequence ids
// answer as alone.
func TestMRoPEStepFailsWithinImage(t *testing.T) {
	f := enginetest.New(4096, 2, 512)
	f.MRoPE = true
	steps := 0
	f.Failing = func(*engine.Batch) error {
		if steps++; steps == 5 { // within the 36-token image, computed 8 tokens a step
			return errors.New("a failing step")
		}
		return nil
	}
	log := &errorLog{}
	cfg := DefaultConfig()
	cfg.MaxBatchTokens, cfg.MaxRunning = 8, 2
	s, err := New(cfg, f, slog.New(log))
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { defer close(done); s.Run(ctx) }()
	defer func() { cancel(); <-done }()
	r := mropeRequest(3, 70, 8, [3]int{24, 6, 6})
	r.MaxTokens = 4
	st, err := s.Submit(ctx, r)
	if err != nil {
		t.Fatal(err)
	}
	if res := collect(ctx, st, 1); res.err == nil {
		t.Fatalf("a request whose step failed: %v, want the failure", res.tokens)
	}
	var reqs []*Request
	for i := range 6 {
		q := mropeRequest(10+i, 60, 8, [3]int{20, 4, 4})
		q.MaxTokens = 5
		reqs = append(reqs, q)
	}
	want := soloMRoPE(t, reqs, 0)
	for i, q := range reqs {
		st, err := s.Submit(ctx, q)
		if err != nil {
			t.Fatal(err)
		}
		if got := collect(ctx, st, 1); got.err != nil || !slices.Equal(got.tokens[0], want[i].tokens[0]) {
			t.Errorf("request %d after the failure: %v (%v), alone %v", i, got.tokens[0], got.err, want[i].tokens[0])
		}
	}
	log.mu.Lock()
	defer log.mu.Unlock()
	for _, m := range log.msgs {
		if !strings.Contains(m, "a failing step") {
			t.Errorf("logged: %s", m)
		}
	}
}

// panicSampler is a sampler with a bug.
type panicSampler struct{}

func (panicSampler) Sample([]float32) (engine.Sampled, error) { panic("index out of range [-1]") }
func (panicSampler) Accept(engine.Token, bool)                {}
func (panicSampler) Close() error                             { return nil }

func TestSampleSafelyRecovers(t *testing.T) {
	var logged strings.Builder
	s := &Scheduler{log: slog.New(slog.NewTextHandler(&logged, nil))}
	if _, err := s.sampleSafely(panicSampler{}, []float32{1}); err == nil || !strings.Contains(err.Error(), "index out of range") {
		t.Fatalf("got %v, want the panic as an error", err)
	}
	if err := s.acceptSafely(panicAccept{}, 1, true); err == nil || !strings.Contains(err.Error(), "accept") {
		t.Fatalf("got %v, want the panic as an error", err)
	}
	if !strings.Contains(logged.String(), "sampler panicked") || !strings.Contains(logged.String(), "goroutine") {
		t.Errorf("the panic's stack was not logged: %s", logged.String())
	}
}

// panicAccept is a sampler whose Accept has a bug.
type panicAccept struct{ panicSampler }

func (panicAccept) Accept(engine.Token, bool) { panic("accept") }

// TestCountStep: a pass lands in the first bucket whose bound holds it, as
// Prometheus' le buckets read.
func TestCountStep(t *testing.T) {
	for _, c := range []struct{ n, bucket int }{{0, 0}, {1, 0}, {2, 1}, {8, 1}, {9, 2}, {512, 7}, {513, 8}, {16384, 12}, {16385, 13}} {
		var l Load
		l.countStep(c.n)
		if l.StepTokens[c.bucket] != 1 || l.StepTokensSum != uint64(c.n) {
			t.Errorf("%d tokens: buckets %v sum %d, want bucket %d", c.n, l.StepTokens, l.StepTokensSum, c.bucket)
		}
	}
}

// TestStepTimesTokens: the tokens of one step name it, so that a sequence's
// accepted proposals add no gaps between tokens (vLLM's inter-token latency
// is one gap per step).
func TestStepTimesTokens(t *testing.T) {
	f := enginetest.New(4096, 64, 512)
	f.Period = 7
	s, _ := startScheduler(t, f, func(c *Config) { c.Spec.Tokens = 5 })
	st, err := s.Submit(context.Background(), &Request{Prompt: []engine.Token{10, 11, 12, 13, 14, 15, 16, 10, 11, 12}, MaxTokens: 60, IgnoreEOS: true})
	if err != nil {
		t.Fatal(err)
	}
	steps := map[uint64]bool{}
	tokens := 0
	for {
		ev, ok := st.Next(context.Background())
		if !ok || ev.Kind == EventDone || ev.Kind == EventError {
			break
		}
		if ev.Kind == EventToken {
			tokens++
			steps[ev.Step] = true
		}
	}
	deadline := time.Now().Add(5 * time.Second)
	for s.Load().Running != 0 && time.Now().Before(deadline) { // the step that ended it is published
		time.Sleep(time.Millisecond)
	}
	accepted := int(s.Load().SpecAccepted)
	if tokens != 60 || accepted == 0 || len(steps) != tokens-accepted {
		t.Fatalf("%d tokens in %d steps, %d of them accepted proposals", tokens, len(steps), accepted)
	}
}

// TestResetPrefixCache: a reset drops what a finished request left cached, so
// that the same prompt again is computed whole.
func TestResetPrefixCache(t *testing.T) {
	f := enginetest.New(4096, 64, 512)
	s, _ := startScheduler(t, f, nil)
	prompt := make([]engine.Token, 80)
	for i := range prompt {
		prompt[i] = engine.Token(10 + i%40)
	}
	run := func() Usage {
		st, err := s.Submit(context.Background(), &Request{Prompt: prompt, MaxTokens: 4})
		if err != nil {
			t.Fatal(err)
		}
		return collect(context.Background(), st, 1).usage
	}
	run()
	if u := run(); u.CachedTokens == 0 {
		t.Fatalf("the prompt again found nothing cached: %+v", u)
	}
	n, err := s.ResetPrefixCache(context.Background())
	if l := s.Load(); err != nil || n == 0 || l.KVBlocksCached != 0 {
		t.Fatalf("reset: %d blocks, %v; %d still cached", n, err, l.KVBlocksCached)
	}
	if u := run(); u.CachedTokens != 0 {
		t.Fatalf("after the reset, %d prompt tokens were cached", u.CachedTokens)
	}
}

// TestStreamStarted: a stream says what its request took from the prefix
// cache and how long it queued once it is scheduled, before it ends (for a
// reader that leaves early).
func TestStreamStarted(t *testing.T) {
	f := enginetest.New(4096, 32, 512)
	s, cancel := startScheduler(t, f, nil)
	defer cancel()
	ctx := context.Background()
	p := prompt(5, 100)
	if r := collect(ctx, mustSubmit(t, s, &Request{Prompt: p, MaxTokens: 2, IgnoreEOS: true}), 1); r.err != nil {
		t.Fatal(r.err)
	}
	st := mustSubmit(t, s, &Request{Prompt: p, MaxTokens: 50, IgnoreEOS: true})
	if ev, ok := st.Next(ctx); !ok || ev.Kind != EventToken {
		t.Fatalf("first event: %+v", ev)
	}
	if cached, _ := st.Started(); cached == 0 || cached >= len(p) {
		t.Fatalf("cached %d of a %d-token prompt computed before", cached, len(p))
	}
	collect(ctx, st, 1)
}

func mustSubmit(t *testing.T, s *Scheduler, r *Request) *Stream {
	t.Helper()
	st, err := s.Submit(context.Background(), r)
	if err != nil {
		t.Fatal(err)
	}
	return st
}
