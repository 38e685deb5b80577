package main

import (
	"fmt"
	"io"
	"log/slog"
	"os"
	"strings"
	"time"

	"github.com/shoal-ai/shoal/engine/llama"
)

func runQuantize(args []string, stdout, _ io.Writer) error {
	fs := newFlags("quantize", stdout)
	model := fs.String("model", "", "GGUF model to quantize, usually f16, bf16 or f32 (required)")
	out := fs.String("out", "", "output GGUF path (required)")
	typ := fs.String("type", "q4_k_m", "weight type: "+strings.Join(llama.QuantTypes(), ", "))
	threads := fs.Int("threads", 0, "threads (0: all cores)")
	if err := parse(fs, args); err != nil {
		return err
	}
	if *model == "" || *out == "" {
		return fmt.Errorf("--model and --out are required")
	}
	start := time.Now()
	// llama.cpp's log in serve's format, its warnings only (it lists each
	// tensor it writes).
	llama.SetLogger(slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelWarn})))
	if err := llama.Quantize(*model, *out, *typ, *threads); err != nil {
		return err
	}
	in, err := os.Stat(*model)
	if err != nil {
		return err
	}
	o, err := os.Stat(*out)
	if err != nil {
		return err
	}
	fmt.Fprintf(stdout, "wrote %s: %s, %.1f MiB (from %.1f MiB) in %.1fs\n", *out, strings.ToLower(*typ),
		float64(o.Size())/(1<<20), float64(in.Size())/(1<<20), time.Since(start).Seconds())
	return nil
}
