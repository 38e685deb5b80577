package llama

import (
	"fmt"
	"math/rand/v2"
	"slices"
	"testing"
	"time"

	"github.com/shoal-ai/shoal/engine"
	"github.com/shoal-ai/shoal/models"
	"github.com/shoal-ai/shoal/scheduler"
)

// BenchmarkSchedulerRerank: one rerank request's pairs (a query's prefix, as a
// Qwen3-Reranker prompt lays it out, then each document) scored by the 100M model
// laid out as a reranker, with the prefix computed for every pair (caching=false)
// and once, the others starting from it (caching=true): Qwen 3's rank pooling
// reads the last token, so a pair computes only its document. Pairs are submitted
// 64 at a time, as the API's window submits them.
func BenchmarkSchedulerRerank(b *testing.B) {
	const prefixLen, docs, window = 128, 64, 64
	spec := models.Bench100M()
	spec.Name, spec.Reranker = "shoal-100m-reranker", true
	path := genModel(b, spec)
	for _, docLen := range []int{64, 256} {
		rng := rand.New(rand.NewPCG(1, 2))
		prefix := randomPrompts(rng, 1, prefixLen)[0]
		var pairs [][]engine.Token
		for _, d := range randomPrompts(rng, docs, docLen) {
			pairs = append(pairs, slices.Concat(prefix, d))
		}
		e := openRerankBench(b, path, window+8, prefixLen+docLen+64)
		for _, caching := range []bool{false, true} {
			b.Run(fmt.Sprintf("model=100m/doc=%d/caching=%v", docLen, caching), func(b *testing.B) {
				var wall time.Duration
				var cached, tokens int
				for b.Loop() {
					e.ClearMemory()
					s := startSched(b, e, func(c *scheduler.Config) {
						c.MaxRunning, c.MaxBatchTokens, c.KV.Caching = window, 2048, caching
					})
					start := time.Now()
					_, usage := embedAll(b, s, pairs)
					for _, u := range usage {
						cached, tokens = cached+u.CachedTokens, tokens+u.PromptTokens
					}
					wall += time.Since(start)
				}
				n := float64(b.N)
				b.ReportMetric(float64(docs)*n/wall.Seconds(), "pairs/s")
				b.ReportMetric(wall.Seconds()*1000/n, "ms/request")
				b.ReportMetric(float64(cached)/float64(tokens), "cached/prompt")
			})
		}
	}
}

// openRerankBench opens the reranker at path as an embedding context of seqs
// sequences of perSeq cells, one pool, on 2 threads.
func openRerankBench(b *testing.B, path string, seqs, perSeq int) *Engine {
	b.Helper()
	cfg := DefaultConfig(path)
	cfg.Threads, cfg.Unified, cfg.MaxSeqs, cfg.Embeddings = 2, true, seqs, true
	cfg.ContextCells, cfg.BatchTokens = seqs*perSeq, 2048
	e, err := Open(cfg)
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { e.Close() })
	return e
}
