package llama

import (
	"context"
	"fmt"
	"math/rand/v2"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/shoal-ai/shoal/engine"
	"github.com/shoal-ai/shoal/kvcache"
	"github.com/shoal-ai/shoal/models"
	"github.com/shoal-ai/shoal/scheduler"
)

// cachePolicy is one prefix-cache setting of a one-pool node.
type cachePolicy struct {
	name    string
	caching bool
	floor   float64
}

var cachePolicies = []cachePolicy{
	{"caching=off", false, 0},
	{"floor=0", true, 0},
	{"floor=default", true, kvcache.DefaultCacheFloor},
	{"floor=1", true, 1},
}

// openServeDefaults opens the 100m model as `shoal serve` does on a CPU by default:
// one pool of 8192 cells, 128 sequence ids.
func openServeDefaults(b *testing.B) *Engine {
	return openBench(b, genModel(b, models.Bench100M()), 2, true, DefaultMaxSeqs, DefaultContextCells/DefaultMaxSeqs)
}

func startPolicy(b *testing.B, e *Engine, p cachePolicy) *scheduler.Scheduler {
	if err := e.ClearMemory(); err != nil {
		b.Fatal(err)
	}
	return startSched(b, e, func(c *scheduler.Config) {
		c.MaxRunning, c.MaxBatchTokens = scheduler.DefaultMaxRunning, scheduler.DefaultMaxBatchTokens
		c.KV.Caching, c.KV.CacheFloor = p.caching, p.floor
	})
}

// randomPrompts returns n prompts of length tokens drawn from rng.
func randomPrompts(rng *rand.Rand, n, length int) [][]engine.Token {
	out := make([][]engine.Token, n)
	for i := range out {
		for range length {
			out[i] = append(out[i], engine.Token(10+rng.IntN(16000)))
		}
	}
	return out
}

// decodeRound runs prompts at once (outLen tokens each): see decodeWindow.
func decodeRound(b *testing.B, s *scheduler.Scheduler, prompts [][]engine.Token, outLen int) (int, time.Duration) {
	reqs := make([]*scheduler.Request, len(prompts))
	for i, p := range prompts {
		reqs[i] = &scheduler.Request{Prompt: p, MaxTokens: outLen, IgnoreEOS: true}
	}
	return decodeWindow(b, s, reqs)
}

// BenchmarkSchedulerCacheFill: a one-pool node with `shoal serve`'s CPU defaults
// decodes rounds of 8 random 128-token prompts (32 output tokens each): two rounds
// on a fresh node, then 48 more random requests that nobody reuses, then two rounds
// again. In one pool every token attends over the cells up to the highest in use, so
// blocks cached for a reuse that never comes slow the filled node; the cache floor
// bounds them.
func BenchmarkSchedulerCacheFill(b *testing.B) {
	const conc, promptLen, outLen, fill = 8, 128, 32, 48
	e := openServeDefaults(b)
	for _, p := range cachePolicies {
		b.Run("model=100m/"+p.name, func(b *testing.B) {
			var freshTok, filledTok int
			var freshWin, filledWin time.Duration
			var cached int
			for i := 0; b.Loop(); i++ {
				s := startPolicy(b, e, p)
				rng := rand.New(rand.NewPCG(uint64(i), 7))
				for range 2 {
					n, w := decodeRound(b, s, randomPrompts(rng, conc, promptLen), outLen)
					freshTok, freshWin = freshTok+n, freshWin+w
				}
				for range fill / conc {
					decodeRound(b, s, randomPrompts(rng, conc, promptLen), outLen)
				}
				for range 2 {
					n, w := decodeRound(b, s, randomPrompts(rng, conc, promptLen), outLen)
					filledTok, filledWin = filledTok+n, filledWin+w
				}
				cached += s.Load().KVBlocksCached
			}
			fresh, filled := float64(freshTok)/freshWin.Seconds(), float64(filledTok)/filledWin.Seconds()
			b.ReportMetric(fresh, "fresh_tok/s")
			b.ReportMetric(filled, "filled_tok/s")
			b.ReportMetric(filled/fresh, "filled/fresh")
			b.ReportMetric(float64(cached)/float64(b.N), "cached_blocks")
		})
	}
}

// BenchmarkSchedulerConversations: k chats of 6 turns on a one-pool node with
// `shoal serve`'s CPU defaults, served turn by turn (every chat's turn t, 8 at a
// time, before any turn t+1), so a chat's next turn comes k requests after its last.
// Each turn sends the whole history plus 32 new tokens (the first: 128) and
// generates 32. Whether the cache budget grows to hold k chats' histories when
// they do not fit in the floor: hit_rate over turns 2-6, hit_rate_late over 4-6.
func BenchmarkSchedulerConversations(b *testing.B) {
	const turns, firstLen, turnLen, outLen, conc = 6, 128, 32, 32, 8
	e := openServeDefaults(b)
	for _, k := range []int{4, 16} {
		for _, p := range cachePolicies {
			b.Run(fmt.Sprintf("model=100m/chats=%d/%s", k, p.name), func(b *testing.B) {
				var hit, prompt, lateHit, latePrompt, out int
				var wall time.Duration
				for i := 0; b.Loop(); i++ {
					s := startPolicy(b, e, p)
					rng := rand.New(rand.NewPCG(uint64(i), 11))
					hist := randomPrompts(rng, k, firstLen)
					start := time.Now()
					for t := range turns {
						if t > 0 {
							for c := range hist {
								hist[c] = append(hist[c], randomPrompts(rng, 1, turnLen)[0]...)
							}
						}
						var mu sync.Mutex
						sem := make(chan struct{}, conc)
						var wg sync.WaitGroup
						for c := range hist {
							sem <- struct{}{}
							wg.Go(func() {
								defer func() { <-sem }()
								p := slices.Clone(hist[c])
								g := generate(context.Background(), s, &scheduler.Request{Prompt: p, MaxTokens: outLen, IgnoreEOS: true})
								if g.err != nil {
									b.Error(g.err)
									return
								}
								mu.Lock()
								defer mu.Unlock()
								hist[c] = append(hist[c], g.tokens...)
								out += len(g.tokens)
								if t > 0 {
									hit, prompt = hit+g.cached, prompt+len(p)
								}
								if t >= turns/2 {
									lateHit, latePrompt = lateHit+g.cached, latePrompt+len(p)
								}
							})
						}
						wg.Wait()
					}
					wall += time.Since(start)
				}
				b.ReportMetric(float64(out)/wall.Seconds(), "out_tok/s")
				b.ReportMetric(float64(hit)/float64(prompt), "hit_rate")
				b.ReportMetric(float64(lateHit)/float64(latePrompt), "hit_rate_late")
			})
		}
	}
}
