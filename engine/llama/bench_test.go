package llama

import (
	"context"
	"fmt"
	"os"
	"runtime"
	"strings"
	"testing"
	"time"

	"github.com/shoal-ai/shoal/engine"
	"github.com/shoal-ai/shoal/models"
)

// The decode ceiling: raw llama_decode throughput with no scheduler, the number the
// scheduler's throughput is compared against. Run with `make bench-engine`; results
// and the machine are recorded in docs/benchmarks.md.

const (
	benchPrompt = 128 // tokens of context per sequence before the timed decode steps
	benchSteps  = 32  // timed decode steps
)

type benchModel struct {
	name string
	path string
}

func benchModels(b *testing.B) []benchModel {
	ms := []benchModel{{"100m", genModel(b, models.Bench100M())}}
	if _, err := os.Stat(storiesPath); err == nil {
		ms = append(ms, benchModel{"stories260K", storiesPath})
	} else {
		b.Logf("stories260K not present at %s: benchmarking the generated model only", storiesPath)
	}
	return ms
}

func openBench(b *testing.B, path string, threads int, unified bool, seqs, perSeq int) *Engine {
	b.Helper()
	cfg := DefaultConfig(path)
	cfg.Threads, cfg.Unified, cfg.MaxSeqs = threads, unified, seqs
	cfg.ContextCells = seqs * perSeq
	cfg.BatchTokens = 2048
	cfg.MicroBatchTokens = 512
	e, err := Open(cfg)
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { e.Close() })
	return e
}

// prefill fills sequences 0..n-1 with distinct prompts of length p, in n_batch chunks.
func prefill(b *testing.B, e *Engine, n, p int) {
	b.Helper()
	if err := e.ClearMemory(); err != nil {
		b.Fatal(err)
	}
	var batch engine.Batch
	nv := e.Vocab().Size()
	flush := func() {
		if batch.Len() > 0 {
			if err := e.Decode(context.Background(), &batch); err != nil {
				b.Fatal(err)
			}
			batch.Reset()
		}
	}
	for s := range n {
		for i := range p {
			batch.Add(engine.Token(10+(s*131+i*7)%(nv-10)), engine.Pos(i), engine.SeqID(s), i == p-1)
			if batch.Len() == e.Capacity().BatchTokens {
				flush()
			}
		}
	}
	flush()
}

// decodeSteps runs steps decode passes with one token per sequence and returns the time.
func decodeSteps(b *testing.B, e *Engine, n, p, steps int) time.Duration {
	b.Helper()
	var batch engine.Batch
	start := time.Now()
	for step := range steps {
		batch.Reset()
		for s := range n {
			batch.Add(engine.Token(10+(s+step)%200), engine.Pos(p+step), engine.SeqID(s), true)
		}
		if err := e.Decode(context.Background(), &batch); err != nil {
			b.Fatal(err)
		}
	}
	return time.Since(start)
}

func benchDecode(b *testing.B, name string, path string, threads int, unified bool, batches []int, prompt int) {
	maxB := batches[len(batches)-1]
	perSeq := prompt + benchSteps
	if !unified {
		perSeq = (perSeq + 255) / 256 * 256 // llama.cpp pads each stream to 256 cells
	}
	e := openBench(b, path, threads, unified, maxB, perSeq)
	for _, n := range batches {
		b.Run(fmt.Sprintf("model=%s/threads=%d/unified=%v/prompt=%d/batch=%d", name, threads, unified, prompt, n), func(b *testing.B) {
			var total time.Duration
			for b.Loop() {
				b.StopTimer()
				prefill(b, e, n, prompt)
				b.StartTimer()
				total += decodeSteps(b, e, n, prompt, benchSteps)
			}
			b.ReportMetric(float64(n*benchSteps*b.N)/total.Seconds(), "tok/s")
		})
	}
}

// BenchmarkDecode measures decode tokens/s at batch 1, 8, 32 and 64, each sequence
// holding a 128-token context, with the unified pool and with one stream per sequence.
func BenchmarkDecode(b *testing.B) {
	for _, m := range benchModels(b) {
		for _, threads := range []int{1, 2} {
			for _, unified := range []bool{true, false} {
				benchDecode(b, m.name, m.path, threads, unified, []int{1, 8, 32, 64}, benchPrompt)
			}
		}
	}
}

// BenchmarkDecodeCeiling is the raw decode ceiling on whatever device holds the
// model (scripts/gpu-check.sh runs it on a GPU): the generated 100M model, unified
// pool, batch 1 to 128, all cores for the CPU side.
func BenchmarkDecodeCeiling(b *testing.B) {
	benchDecode(b, "100m", genModel(b, models.Bench100M()), runtime.NumCPU(), true, []int{1, 8, 32, 64, 128}, benchPrompt)
}

// BenchmarkDecodeLong is where the unified pool's cost can show: many sequences with
// long contexts make every token attend over all used cells.
func BenchmarkDecodeLong(b *testing.B) {
	for _, m := range benchModels(b) {
		for _, unified := range []bool{true, false} {
			benchDecode(b, m.name, m.path, 2, unified, []int{16}, 1024)
		}
	}
}

// BenchmarkPrefill measures prompt tokens/s for one 512-token prompt.
func BenchmarkPrefill(b *testing.B) {
	for _, m := range benchModels(b) {
		for _, threads := range []int{1, 2} {
			for _, unified := range []bool{true, false} {
				benchPrefill(b, m.name, m.path, threads, unified)
			}
		}
	}
}

func benchPrefill(b *testing.B, name, path string, threads int, unified bool) {
	const p = 512
	e := openBench(b, path, threads, unified, 1, 768)
	b.Run(fmt.Sprintf("model=%s/threads=%d/unified=%v/prompt=%d", name, threads, unified, p), func(b *testing.B) {
		var total time.Duration
		for b.Loop() {
			b.StopTimer()
			e.ClearMemory()
			b.StartTimer()
			start := time.Now()
			prefill(b, e, 1, p)
			total += time.Since(start)
		}
		b.ReportMetric(float64(p*b.N)/total.Seconds(), "tok/s")
	})
}

// BenchmarkApplyChatTemplate: llama.cpp's built-in formatter (ChatML) on the
// chat BenchmarkChatPrompt in api lays out with Jinja: 21 turns of ~200 bytes.
func BenchmarkApplyChatTemplate(b *testing.B) {
	e := openTest(b, models.Tiny(), nil)
	msgs := []engine.ChatMessage{{Role: "system", Content: "You are a helpful assistant."}}
	for i := range 10 {
		msgs = append(msgs, engine.ChatMessage{Role: "user", Content: strings.Repeat(fmt.Sprintf("question %d ", i), 16)},
			engine.ChatMessage{Role: "assistant", Content: strings.Repeat(fmt.Sprintf("answer %d ", i), 20)})
	}
	msgs = append(msgs, engine.ChatMessage{Role: "user", Content: "And now?"})
	b.ReportAllocs()
	for b.Loop() {
		if _, err := e.Vocab().ApplyChatTemplate(msgs, true); err != nil {
			b.Fatal(err)
		}
	}
}

// BenchmarkCheckGrammar: what checking a request's grammar before answering
// costs (api Backend.CheckGrammar): a one-tool call grammar and one of 60
// integer-range properties (~40 KB of GBNF).
func BenchmarkCheckGrammar(b *testing.B) {
	e := openTest(b, models.Tiny(), nil)
	small, err := SchemaToGrammar([]byte(`{"type":"object","properties":{"name":{"const":"get_weather"},"arguments":{"type":"object","properties":{"city":{"type":"string"},"days":{"type":"integer"}},"required":["city"]}},"required":["name","arguments"]}`))
	if err != nil {
		b.Fatal(err)
	}
	var props []string
	for i := range 60 {
		props = append(props, fmt.Sprintf(`"p%d":{"type":"integer","minimum":%d,"maximum":%d}`, i, 13+i, 987654+i*7919))
	}
	big, err := SchemaToGrammar([]byte(`{"type":"object","properties":{` + strings.Join(props, ",") + `}}`))
	if err != nil {
		b.Fatal(err)
	}
	for name, g := range map[string]string{"one-tool": small, "60-ranges": big} {
		b.Run(fmt.Sprintf("%s-%dB", name, len(g)), func(b *testing.B) {
			for b.Loop() {
				if err := e.vocab.CheckGrammar(g); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}
