package llama

import (
	"context"
	"path/filepath"
	"testing"

	"github.com/shoal-ai/shoal/engine"
	"github.com/shoal-ai/shoal/models"
)

func TestSmoke(t *testing.T) {
	p := filepath.Join(t.TempDir(), "tiny.gguf")
	if err := models.Generate(p, models.Tiny()); err != nil {
		t.Fatal(err)
	}
	cfg := DefaultConfig(p)
	cfg.ContextCells = 1024
	cfg.MaxSeqs = 8
	e, err := Open(cfg)
	if err != nil {
		t.Fatal(err)
	}
	defer e.Close()
	t.Logf("%+v %+v", e.Info(), e.Capacity())
	toks, err := e.Vocab().Tokenize("Hello world, the cat sat on the mat. ünïcode ✓", true, false)
	if err != nil {
		t.Fatal(err)
	}
	t.Log(toks)
	s, _ := e.Vocab().Detokenize(toks, true, false)
	t.Logf("%q", s)
	var b engine.Batch
	for i, tk := range toks {
		b.Add(tk, engine.Pos(i), 0, i == len(toks)-1)
	}
	if err := e.Decode(context.Background(), &b); err != nil {
		t.Fatal(err)
	}
	e.Logits(len(toks)-1, func(l []float32) { t.Log(len(l), l[:5]) })
	c, err := e.Vocab().ApplyChatTemplate([]engine.ChatMessage{{Role: "user", Content: "hi"}}, true)
	t.Logf("%q %v", c, err)
}
