package main

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"math"
	"os"
	"runtime"
	"slices"
	"time"

	"github.com/shoal-ai/shoal/engine"
	"github.com/shoal-ai/shoal/engine/llama"
	"github.com/shoal-ai/shoal/engine/sim"
)

// runCalibrate measures engine/llama on this machine and writes a sim.Profile:
// decode passes at several batch sizes and contexts and prefill chunks, fitted to the
// profile's linear time model.
func runCalibrate(args []string, stdout, stderr io.Writer) error {
	fs := newFlags("calibrate", stdout)
	model := fs.String("model", "", "GGUF model to measure (required)")
	out := fs.String("out", "", "profile JSON to write (required)")
	threads := fs.Int("threads", 0, "threads (0: all cores)")
	name := fs.String("model-name", "", "model id the simulated nodes serve (default: the file's base name)")
	steps := fs.Int("steps", 8, "decode passes timed per sample")
	if err := parse(fs, args); err != nil {
		return err
	}
	if *model == "" || *out == "" {
		return fmt.Errorf("--model and --out are required")
	}
	if *steps < 1 {
		return fmt.Errorf("--steps %d: want at least 1", *steps)
	}
	log, _ := newLogger(stderr, "warn")
	llama.SetLogger(log)
	batches, contexts := []int{1, 8, 32}, []int{64, 256}
	cfg := llama.DefaultConfig(*model)
	cfg.Threads, cfg.MaxSeqs, cfg.ContextCells, cfg.BatchTokens = *threads, 32, 32*(256+*steps+16), 512
	// One stream per sequence: each token attends over its own context, which is what
	// the profile's attention term models.
	cfg.Unified = false
	e, err := llama.Open(cfg)
	if err != nil {
		return err
	}
	defer e.Close()
	p := sim.Profile{Model: modelID(*model, *name), Threads: cfg.Threads, Machine: fmt.Sprintf("%s/%s, %d cores", runtime.GOOS, runtime.GOARCH, runtime.NumCPU())}
	ctx := context.Background()
	nv := e.Vocab().Size()
	tok := func(i int) engine.Token { return engine.Token(10 + i%(nv-10)) }
	var b engine.Batch
	run := func() (time.Duration, error) {
		start := time.Now()
		err := e.Decode(ctx, &b)
		return time.Since(start), err
	}
	// Prefill chunks from an empty context, the fastest of three: a shared
	// machine's other work only ever adds time.
	for _, n := range []int{128, 512} {
		var pos int64
		best := time.Duration(math.MaxInt64)
		for range 3 {
			e.ClearMemory()
			b.Reset()
			pos = 0
			for i := range n {
				b.Add(tok(i), engine.Pos(i), 0, i == n-1)
				pos += int64(i)
			}
			d, err := run()
			if err != nil {
				return err
			}
			best = min(best, d)
		}
		p.Samples = append(p.Samples, sim.Sample{Tokens: n, PosSum: pos, Seconds: best.Seconds()})
	}
	for _, ctxLen := range contexts {
		for _, bs := range batches {
			e.ClearMemory()
			for s := range bs { // fill contexts (untimed), within n_batch
				for from := 0; from < ctxLen; from += 256 {
					b.Reset()
					for i := from; i < min(ctxLen, from+256); i++ {
						b.Add(tok(i+s*7), engine.Pos(i), engine.SeqID(s), false)
					}
					if err := e.Decode(ctx, &b); err != nil {
						return err
					}
				}
			}
			times := make([]time.Duration, 0, *steps)
			var pos int64
			for step := range *steps {
				b.Reset()
				for s := range bs {
					b.Add(tok(step+s), engine.Pos(ctxLen+step), engine.SeqID(s), true)
					pos += int64(ctxLen + step)
				}
				d, err := run()
				if err != nil {
					return err
				}
				times = append(times, d)
			}
			// One pass of the batch: its mean positions, its median time (a pass
			// another process slowed counts for no more than one).
			slices.Sort(times)
			p.Samples = append(p.Samples, sim.Sample{Tokens: bs, PosSum: pos / int64(*steps), Seconds: times[len(times)/2].Seconds()})
		}
	}
	if err := p.Fit(); err != nil {
		return err
	}
	if p.PerTokenUS == 0 || p.PerAttendUS == 0 {
		fmt.Fprintln(stderr, "calibrate: the samples vary too much for every term of the time model (another process took the cores?): a term is fitted as 0; run it again on an idle machine")
	}
	buf, _ := json.MarshalIndent(p, "", "  ")
	if err := os.WriteFile(*out, append(buf, '\n'), 0o644); err != nil {
		return err
	}
	fmt.Fprintf(stdout, "wrote %s: step = %.0fµs + %.1fµs/token + %.3fµs per 1,000 attended positions\n", *out, p.BaseUS, p.PerTokenUS, p.PerAttendUS)
	return nil
}

func modelID(path, name string) string {
	if name != "" {
		return name
	}
	base := path
	for i := len(base) - 1; i >= 0; i-- {
		if base[i] == '/' {
			base = base[i+1:]
			break
		}
	}
	if len(base) > 5 && base[len(base)-5:] == ".gguf" {
		base = base[:len(base)-5]
	}
	return base
}
