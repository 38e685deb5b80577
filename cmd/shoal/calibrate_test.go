package main

import (
	"bytes"
	"context"
	"path/filepath"
	"strings"
	"testing"

	"github.com/openai/openai-go/v3"

	"github.com/shoal-ai/shoal/engine/sim"
)

func TestCalibrateAndServeSim(t *testing.T) {
	out := filepath.Join(t.TempDir(), "profile.json")
	var stdout, stderr bytes.Buffer
	if code := run([]string{"calibrate", "--model", smallModel(t), "--out", out, "--threads", "1", "--steps", "4"}, &stdout, &stderr); code != 0 {
		t.Fatalf("calibrate: %s", stderr.String())
	}
	p, err := sim.Load(out)
	if err != nil {
		t.Fatal(err)
	}
	if p.Model != "small" || p.PerTokenUS <= 0 || len(p.Samples) != 8 {
		t.Fatalf("profile %+v", p)
	}
	t.Logf("%s", strings.TrimSpace(stdout.String()))
	// A simulated node serves the API with the real scheduler.
	n := startNode(t, "--sim", out, "--ctx-size", "4096", "--parallel", "16")
	c := n.client("")
	comp, err := c.Completions.New(context.Background(), openai.CompletionNewParams{
		Model: "small", Prompt: openai.CompletionNewParamsPromptUnion{OfString: openai.String("hello")}, MaxTokens: openai.Int(5)})
	if err != nil || comp.Usage.CompletionTokens != 5 || len(comp.Choices[0].Text) != 5 {
		t.Fatalf("sim completion: %+v %v", comp, err)
	}
	// It says loudly that it is simulated.
	if b := modelList(n); !strings.Contains(b, `"simulated":true`) || !strings.Contains(n.log(), "SIMULATED ENGINE") {
		t.Fatalf("sim node does not say so: %s", b)
	}
}
