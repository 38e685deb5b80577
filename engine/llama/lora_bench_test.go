package llama

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/shoal-ai/shoal/engine"
	"github.com/shoal-ai/shoal/models"
)

// BenchmarkAdapters measures what serving LoRA adapters costs a decode step
// on the generated 100M model (rank 16 on every layer's query and value),
// side by side: an engine without adapters; one with a selectable adapter
// (--lora-modules, which builds every step's graph anew) decoding without it,
// under it, and switching every step, as two adapters taking turns do. Run
// with `make bench-lora`; results are in docs/benchmarks.md.
func BenchmarkAdapters(b *testing.B) {
	spec := models.Bench100M()
	path := genModel(b, spec)
	adapter := genLoRA(b, spec, 16)
	const n, prompt = 8, benchPrompt
	open := func(adapters []LoRA) *Engine {
		cfg := DefaultConfig(path)
		cfg.Threads, cfg.MaxSeqs, cfg.ContextCells = 2, n, n*(prompt+benchSteps+16)
		cfg.Adapters = adapters
		e, err := Open(cfg)
		if err != nil {
			b.Fatal(err)
		}
		b.Cleanup(func() { e.Close() })
		return e
	}
	plain, sel := open(nil), open([]LoRA{{Path: adapter, Scale: 1}})
	for _, batch := range []int{1, n} {
		for _, v := range []struct {
			name  string
			e     *Engine
			under func(step int) int
		}{
			{"plain", plain, func(int) int { return 0 }},
			{"selectable-off", sel, func(int) int { return 0 }},
			{"selectable-on", sel, func(int) int { return 1 }},
			{"selectable-alternating", sel, func(step int) int { return step % 2 }},
		} {
			b.Run(fmt.Sprintf("batch=%d/%s", batch, v.name), func(b *testing.B) {
				var total time.Duration
				for b.Loop() {
					b.StopTimer()
					prefill(b, v.e, batch, prompt)
					b.StartTimer()
					start := time.Now()
					var bt engine.Batch
					for step := range benchSteps {
						bt.Reset()
						bt.Adapter = v.under(step)
						for s := range batch {
							bt.Add(engine.Token(10+(s+step)%200), engine.Pos(prompt+step), engine.SeqID(s), true)
						}
						if err := v.e.Decode(context.Background(), &bt); err != nil {
							b.Fatal(err)
						}
					}
					total += time.Since(start)
				}
				b.ReportMetric(float64(batch*benchSteps*b.N)/total.Seconds(), "tok/s")
			})
		}
	}
}
