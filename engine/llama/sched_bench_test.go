package llama

import (
	"context"
	"fmt"
	"math/rand/v2"
	"runtime"
	"slices"
	"sort"
	"sync"
	"testing"
	"time"

	"github.com/shoal-ai/shoal/engine"
	"github.com/shoal-ai/shoal/engine/sample"
	"github.com/shoal-ai/shoal/kvcache"
	"github.com/shoal-ai/shoal/models"
	"github.com/shoal-ai/shoal/scheduler"
)

// tokenTimes runs one request and returns the arrival time of each token event.
func tokenTimes(s *scheduler.Scheduler, r *scheduler.Request) ([]time.Time, scheduler.Usage, error) {
	st, err := s.Submit(context.Background(), r)
	if err != nil {
		return nil, scheduler.Usage{}, err
	}
	var ts []time.Time
	var u scheduler.Usage
	for {
		ev, ok := st.Next(context.Background())
		if !ok {
			return ts, u, nil
		}
		switch ev.Kind {
		case scheduler.EventToken:
			ts = append(ts, time.Now())
		case scheduler.EventDone:
			u = ev.Usage
		case scheduler.EventError:
			return ts, u, ev.Err
		}
	}
}

// BenchmarkSchedulerDecode compares the scheduler's steady-state decode throughput
// with the raw engine ceiling at the same batch sizes, side by side in one run: n
// requests with 128-token prompts generate 32 tokens each; throughput counts the
// tokens produced after the last request's first token (all n decoding together).
func BenchmarkSchedulerDecode(b *testing.B) {
	path := genModel(b, models.Bench100M())
	for _, threads := range []int{1, 2} {
		for _, unified := range []bool{true, false} {
			benchSchedulerDecode(b, path, threads, unified)
		}
	}
}

func benchSchedulerDecode(b *testing.B, path string, threads int, unified bool) {
	{
		e := openBench(b, path, threads, unified, 64, 256)
		for _, n := range []int{1, 8, 32, 64} {
			b.Run(fmt.Sprintf("model=100m/threads=%d/unified=%v/batch=%d/engine=raw", threads, unified, n), func(b *testing.B) {
				var total time.Duration
				for b.Loop() {
					b.StopTimer()
					prefill(b, e, n, benchPrompt)
					b.StartTimer()
					total += decodeSteps(b, e, n, benchPrompt, benchSteps)
				}
				b.ReportMetric(float64(n*benchSteps*b.N)/total.Seconds(), "tok/s")
			})
			b.Run(fmt.Sprintf("model=100m/threads=%d/unified=%v/batch=%d/engine=scheduler", threads, unified, n), func(b *testing.B) {
				e.ClearMemory()
				s := startSched(b, e, func(c *scheduler.Config) { c.MaxRunning = 64; c.MaxBatchTokens = 2048; c.KV.Caching = false })
				benchSchedRate(b, s, n, func(i int) *scheduler.Request {
					p := make([]engine.Token, benchPrompt)
					for j := range p {
						p[j] = engine.Token(10 + (i*131+j*7+b.N)%16000)
					}
					return &scheduler.Request{Prompt: p, MaxTokens: benchSteps + 1, IgnoreEOS: true}
				})
			})
		}
	}
}

// benchSchedRate submits n requests (req(i)) at once per round and reports the
// tokens produced after the last request's first token (all n decoding together) per
// second of that window.
func benchSchedRate(b *testing.B, s *scheduler.Scheduler, n int, req func(i int) *scheduler.Request) {
	var tokens int
	var window time.Duration
	for b.Loop() {
		reqs := make([]*scheduler.Request, n)
		for i := range reqs {
			reqs[i] = req(i)
		}
		t, w := decodeWindow(b, s, reqs)
		tokens, window = tokens+t, window+w
	}
	b.ReportMetric(float64(tokens)/window.Seconds(), "tok/s")
}

// decodeWindow runs reqs at once and returns the tokens produced after the last
// request's first token (all of them decoding together) and the length of that window.
func decodeWindow(b *testing.B, s *scheduler.Scheduler, reqs []*scheduler.Request) (int, time.Duration) {
	times := make([][]time.Time, len(reqs))
	var wg sync.WaitGroup
	for i, r := range reqs {
		wg.Go(func() {
			ts, _, err := tokenTimes(s, r)
			if err != nil {
				b.Error(err)
			}
			times[i] = ts
		})
	}
	wg.Wait()
	var start, end time.Time
	for _, ts := range times {
		if len(ts) == 0 {
			return 0, 0
		}
		if ts[0].After(start) {
			start = ts[0]
		}
		if ts[len(ts)-1].After(end) {
			end = ts[len(ts)-1]
		}
	}
	tokens := 0
	for _, ts := range times {
		for _, x := range ts {
			if x.After(start) {
				tokens++
			}
		}
	}
	return tokens, end.Sub(start)
}

// BenchmarkSchedulerSampling: 32 requests drawing at temperature 1 with top-p 0.95
// (the 100m model's 16,384-token vocabulary), their rows sampled on the scheduler's
// goroutine (workers=1) or on GOMAXPROCS goroutines (workers=0), alternately.
func BenchmarkSchedulerSampling(b *testing.B) {
	const n = 32
	e := openBench(b, genModel(b, models.Bench100M()), 2, false, 64, 256)
	for round := range 2 {
		for _, workers := range []int{1, 0} {
			b.Run(fmt.Sprintf("model=100m/batch=%d/workers=%d/round=%d", n, workers, round), func(b *testing.B) {
				e.ClearMemory()
				s := startSched(b, e, func(c *scheduler.Config) {
					c.MaxRunning, c.MaxBatchTokens, c.KV.Caching, c.SampleWorkers = 64, 2048, false, workers
				})
				benchSchedRate(b, s, n, func(i int) *scheduler.Request {
					p := make([]engine.Token, benchPrompt)
					for j := range p {
						p[j] = engine.Token(10 + (i*131+j*7)%16000)
					}
					return &scheduler.Request{Prompt: p, MaxTokens: benchSteps + 1, IgnoreEOS: true,
						Sampling: sample.Params{Temperature: 1, TopP: 0.95, Seed: uint64(i)}}
				})
			})
		}
	}
}

// BenchmarkSchedulerSharedPrefix: 32 groups × 4 requests, each a 1,024-token group
// prefix plus a 32-token question, 64 output tokens, 16 in flight, in random order;
// prefix caching on and off, unified and split pools, and a unified pool that keeps
// every cached block until it is full (cache floor 1).
func BenchmarkSchedulerSharedPrefix(b *testing.B) {
	const (
		groups, perGroup, prefixLen, questionLen, outLen, conc = 32, 4, 1024, 32, 64, 16
	)
	path := genModel(b, models.Bench100M())
	rng := rand.New(rand.NewPCG(1, 2))
	var prompts [][]engine.Token
	prefixes := randomPrompts(rng, groups, prefixLen)
	for g := range groups {
		for range perGroup {
			prompts = append(prompts, slices.Concat(prefixes[g], randomPrompts(rng, 1, questionLen)[0]))
		}
	}
	rng.Shuffle(len(prompts), func(i, j int) { prompts[i], prompts[j] = prompts[j], prompts[i] })
	for _, unified := range []bool{true, false} {
		perSeq := prefixLen + questionLen + outLen + 32
		seqs := conc + groups + 8 // running + one holder per group
		var e *Engine
		if unified {
			e = openBench(b, path, 2, true, seqs, perSeq)
		} else {
			e = openBench(b, path, 2, false, seqs, (perSeq+255)/256*256)
		}
		type policy struct {
			caching bool
			floor   float64
			name    string
		}
		policies := []policy{{false, 0, "caching=false"}, {true, kvcache.DefaultCacheFloor, "caching=true"}}
		if unified { // the floor bounds only a shared pool's cache
			policies = append(policies, policy{true, 1, "caching=true/floor=1"})
		}
		for _, pol := range policies {
			b.Run(fmt.Sprintf("model=100m/unified=%v/%s", unified, pol.name), func(b *testing.B) {
				var ttftHit, ttftMiss []float64
				var outTokens, cached, promptTokens int
				var wall time.Duration
				for b.Loop() {
					e.ClearMemory()
					s := startSched(b, e, func(c *scheduler.Config) {
						c.MaxRunning, c.MaxBatchTokens, c.KV.Caching, c.KV.CacheFloor = conc, 512, pol.caching, pol.floor
					})
					work := make(chan []engine.Token)
					var mu sync.Mutex
					var wg sync.WaitGroup
					start := time.Now()
					for range conc {
						wg.Go(func() {
							for p := range work {
								t0 := time.Now()
								ts, u, err := tokenTimes(s, &scheduler.Request{Prompt: p, MaxTokens: outLen, IgnoreEOS: true})
								if err != nil {
									b.Error(err)
									return
								}
								ttft := ts[0].Sub(t0).Seconds() * 1000
								mu.Lock()
								if u.CachedTokens > 0 {
									ttftHit = append(ttftHit, ttft)
								} else {
									ttftMiss = append(ttftMiss, ttft)
								}
								outTokens += len(ts)
								cached += u.CachedTokens
								promptTokens += u.PromptTokens
								mu.Unlock()
							}
						})
					}
					for _, p := range prompts {
						work <- p
					}
					close(work)
					wg.Wait()
					wall += time.Since(start)
				}
				b.ReportMetric(float64(outTokens)/wall.Seconds(), "out_tok/s")
				b.ReportMetric(float64(cached)/float64(promptTokens), "hit_rate")
				all := slices.Concat(ttftHit, ttftMiss)
				b.ReportMetric(pct(all, 50), "ttft_p50_ms")
				b.ReportMetric(pct(all, 99), "ttft_p99_ms")
				if len(ttftHit) > 0 {
					b.ReportMetric(pct(ttftHit, 50), "ttft_hit_p50_ms")
				}
				if len(ttftMiss) > 0 {
					b.ReportMetric(pct(ttftMiss, 50), "ttft_miss_p50_ms")
				}
			})
		}
	}
}

func pct(xs []float64, p float64) float64 {
	if len(xs) == 0 {
		return 0
	}
	s := slices.Clone(xs)
	sort.Float64s(s)
	i := int(float64(len(s)-1) * p / 100)
	return s[i]
}

// TestManyRequestsFlat runs 10,000 short requests through the scheduler on the
// real engine and checks that heap and goroutines stay flat.
func TestManyRequestsFlat(t *testing.T) {
	if testing.Short() {
		t.Skip("10,000 requests: skipped with -short")
	}
	e := openTest(t, models.Tiny(), func(c *Config) { c.ContextCells = 4096; c.MaxSeqs = 64 })
	s := startSched(t, e, nil)
	sample := func() (uint64, int) {
		runtime.GC()
		var m runtime.MemStats
		runtime.ReadMemStats(&m)
		return m.HeapAlloc, runtime.NumGoroutine()
	}
	const total, conc = 10000, 8
	var heaps []uint64
	var gors []int
	work := make(chan int)
	var wg sync.WaitGroup
	for range conc {
		wg.Go(func() {
			for i := range work {
				p := tokenize(t, e, fmt.Sprintf("request %d: %s", i, testPrompts[i%len(testPrompts)]))
				if _, _, err := tokenTimes(s, &scheduler.Request{Prompt: p, MaxTokens: 4, IgnoreEOS: true}); err != nil {
					t.Error(err)
				}
			}
		})
	}
	for i := range total {
		work <- i
		if (i+1)%2000 == 0 {
			h, g := sample()
			heaps, gors = append(heaps, h), append(gors, g)
		}
	}
	close(work)
	wg.Wait()
	t.Logf("heap after each 2,000 requests: %v bytes; goroutines: %v", heaps, gors)
	if heaps[len(heaps)-1] > heaps[0]+4<<20 {
		t.Errorf("heap grew from %d to %d bytes", heaps[0], heaps[len(heaps)-1])
	}
	if gors[len(gors)-1] > gors[0]+2 {
		t.Errorf("goroutines grew from %d to %d", gors[0], gors[len(gors)-1])
	}
	deadline := time.Now().Add(2 * time.Second) // the last step publishes after its events
	for l := s.Load(); l.Running != 0 || l.Waiting != 0 || l.KVBlocksUsed != 0; l = s.Load() {
		if time.Now().After(deadline) {
			t.Fatalf("after %d requests: %+v", total, l)
		}
		time.Sleep(time.Millisecond)
	}
}

// BenchmarkSchedulerPromptScore: a 512-token prompt computed for one token, as
// is and with its tokens scored (prompt logprobs: a logits row per token, read
// in Go), side by side; prompt tokens per second.
func BenchmarkSchedulerPromptScore(b *testing.B) {
	path := genModel(b, models.Bench100M())
	e := openBench(b, path, runtime.NumCPU(), true, 8, 1024)
	s := startSched(b, e, func(c *scheduler.Config) { c.MaxBatchTokens, c.MaxRunning, c.KV.Caching = 512, 8, false })
	const n = 512
	round := 0
	for _, c := range []struct {
		name  string
		score bool
		top   int
	}{{"plain", false, 0}, {"scored", true, 0}, {"scored-top5", true, 5}} {
		b.Run("model=100m/prompt=512/"+c.name, func(b *testing.B) {
			for b.Loop() {
				round++
				p := make([]engine.Token, n)
				for j := range p {
					p[j] = engine.Token(10 + (round*131+j*7)%16000)
				}
				st, err := s.Submit(context.Background(), &scheduler.Request{Prompt: p, MaxTokens: 1, PromptLogprobs: c.score, PromptTopLogprobs: c.top})
				if err != nil {
					b.Fatal(err)
				}
				for ev, ok := st.Next(context.Background()); ok; ev, ok = st.Next(context.Background()) {
					if ev.Kind == scheduler.EventError {
						b.Fatal(ev.Err)
					}
				}
			}
			b.ReportMetric(float64(n*b.N)/b.Elapsed().Seconds(), "prompt-tok/s")
		})
	}
}

// specCode is the file BenchmarkSchedulerSpeculative's edit repeats.
const specCode = `def merge_intervals(intervals):
    """Merge overlapping [start, end] intervals, sorted by start."""
    if not intervals:
        return []
    intervals = sorted(intervals, key=lambda iv: iv[0])
    merged = [list(intervals[0])]
    for start, end in intervals[1:]:
        last = merged[-1]
        if start <= last[1]:
            last[1] = max(last[1], end)
        else:
            merged.append([start, end])
    return merged
`

// BenchmarkSchedulerSpeculative: greedy decoding of one and of four requests,
// without and with n-gram proposals (Config.Spec), side by side; output tokens
// per second of each request's decode, the share of proposals taken, and the
// tokens each sequence's step yields (what a step costs hardly depends on a
// few more rows where decoding is memory-bound, as on a GPU: there, this is
// the speed-up). Two workloads: "edit", whose prompt holds the model's own
// greedy continuation of its first part, then that first part again, so that
// it tends to write again what it wrote (the 100m model's weights are random;
// a real model rewriting code it was shown repeats it so), and "free", the
// model's own greedy output of a prompt.
func BenchmarkSchedulerSpeculative(b *testing.B) {
	path := genModel(b, models.Bench100M())
	e := openBench(b, path, runtime.NumCPU(), true, 8, 2048)
	for _, work := range []string{"edit", "free"} {
		prompt, err := e.Vocab().Tokenize("Here is a function:\n"+specCode+"\nThe same function, unchanged:\n", true, false)
		if err != nil {
			b.Fatal(err)
		}
		maxTokens := 128
		if work == "edit" {
			// The model's own greedy continuation, then the prompt again: what
			// it wrote once it tends to write again.
			e.ClearMemory()
			out := decodeGreedy(b, e, [][]engine.Token{prompt}, 128, false)[0].tokens
			prompt = slices.Concat(prompt, out, prompt[1:])
		}
		for _, n := range []int{1, 4} {
			for _, spec := range []int{0, 5} {
				b.Run(fmt.Sprintf("model=100m/%s/batch=%d/spec=%d", work, n, spec), func(b *testing.B) {
					e.ClearMemory()
					s := startSched(b, e, func(c *scheduler.Config) {
						c.MaxRunning, c.MaxBatchTokens, c.KV.Caching, c.Spec.Tokens = 8, 512, false, spec
					})
					var tokens int
					var window time.Duration
					for b.Loop() {
						var wg sync.WaitGroup
						var mu sync.Mutex
						for range n {
							p := slices.Clone(prompt) // alike: with the cache off, each computes its own
							wg.Go(func() {
								ts, _, err := tokenTimes(s, &scheduler.Request{Prompt: p, MaxTokens: maxTokens, IgnoreEOS: true})
								if err != nil {
									b.Error(err)
									return
								}
								mu.Lock()
								tokens, window = tokens+len(ts)-1, window+ts[len(ts)-1].Sub(ts[0])
								mu.Unlock()
							})
						}
						wg.Wait()
					}
					b.ReportMetric(float64(tokens)/window.Seconds(), "tok/s/request")
					l := s.Load()
					if l.SpecProposed > 0 {
						b.ReportMetric(float64(l.SpecAccepted)/float64(l.SpecProposed), "taken")
						b.ReportMetric(float64(l.SpecProposed)/float64(tokens), "proposed/tok")
					}
					// Each request's tokens over its steps (its first token comes with its prompt).
					b.ReportMetric(float64(tokens)/float64(tokens-int(l.SpecAccepted)), "tok/step")
				})
			}
		}
	}
}
