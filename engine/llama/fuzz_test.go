package llama

import (
	"bytes"
	"encoding/json"
	"math"
	"math/rand/v2"
	"os"
	"path/filepath"
	"testing"

	"github.com/shoal-ai/shoal/engine"
	"github.com/shoal-ai/shoal/models"
)

// FuzzOpenGGUF mutates the header and metadata of a generated model: loading must
// fail with an error or succeed, never crash the process.
func FuzzOpenGGUF(f *testing.F) {
	good := genModel(f, models.Tiny())
	data, err := os.ReadFile(good)
	if err != nil {
		f.Fatal(err)
	}
	head := data[:min(len(data), 64<<10)]
	f.Add(uint32(8), []byte{0xff, 0xff, 0xff})
	f.Add(uint32(30), []byte{0, 0, 0, 0x80})
	f.Add(uint32(4), []byte{9})
	f.Add(uint32(1000), []byte("\xff\xff\xff\xff\xff\xff\xff\x7f"))
	f.Fuzz(func(t *testing.T, off uint32, patch []byte) {
		b := append([]byte(nil), data...)
		o := int(off) % len(head)
		copy(b[o:], patch)
		p := filepath.Join(t.TempDir(), "m.gguf")
		if err := os.WriteFile(p, b, 0o644); err != nil {
			t.Fatal(err)
		}
		cfg := DefaultConfig(p)
		cfg.ContextCells, cfg.MaxSeqs, cfg.BatchTokens, cfg.MicroBatchTokens = 64, 1, 64, 64
		if e, err := Open(cfg); err == nil {
			e.Close()
		}
	})
}

// FuzzCheckGGUF runs the pure-Go pre-check on arbitrary bytes.
func FuzzCheckGGUF(f *testing.F) {
	data, err := os.ReadFile(genModel(f, models.Tiny()))
	if err != nil {
		f.Fatal(err)
	}
	f.Add(data[:4096])
	f.Add([]byte("GGUF\x03\x00\x00\x00"))
	f.Fuzz(func(t *testing.T, b []byte) {
		_ = checkGGUFReader(bytes.NewReader(b), int64(len(b)))
	})
}

// FuzzSchemaPatterns: whatever a schema's pattern, converting the schema
// never crashes the process (llama.cpp's converter did on (?:a)+), a grammar
// it makes parses, and writing a string under it (the first token that fits
// of a seeded random ranking, step by step) neither crashes (llama.cpp's
// grammar recursed without end on (a*)*) nor writes text that is not a JSON
// string.
func FuzzSchemaPatterns(f *testing.F) {
	e := openTest(f, models.Tiny(), nil)
	for _, p := range []string{"^(?:ab)+$", "abc", `^\d{3}$`, "^(?=x)a$", "^*$", `^[\d\-]+$`, "^(a|)+$", `^\u00e9{2}$`, "^()*$", `^a"b\\c$`, "[ -~]+", `^(a?){1,3}$`} {
		f.Add(p, uint64(1))
	}
	f.Fuzz(func(t *testing.T, p string, seed uint64) {
		schema, _ := json.Marshal(map[string]any{"type": "string", "pattern": p})
		g, err := SchemaToGrammar(schema)
		if err != nil {
			return
		}
		gr, err := e.NewGrammar(g, nil)
		if err != nil {
			t.Fatalf("pattern %q: the grammar does not parse: %v\n%s", p, err, g)
		}
		defer gr.Close()
		rng := rand.New(rand.NewPCG(seed, 7))
		var out []byte
		cands := make([]engine.TokenLogit, e.vocab.Size())
		for range 24 {
			for i := range cands {
				cands[i] = engine.TokenLogit{Token: engine.Token(i), Logit: rng.Float32()}
			}
			gr.Apply(cands)
			best := -1
			for i, c := range cands {
				if !math.IsInf(float64(c.Logit), -1) && !e.vocab.IsEOG(c.Token) && (best < 0 || c.Logit > cands[best].Logit) {
					best = i
				}
			}
			if best < 0 {
				break
			}
			gr.Accept(cands[best].Token)
			piece, _ := e.vocab.Piece(cands[best].Token, false)
			out = append(out, piece...)
			if s := bytes.TrimRight(out, " \n\t"); len(s) > 1 && s[len(s)-1] == '"' && !json.Valid(s) && !bytes.HasSuffix(s, []byte(`\"`)) {
				t.Fatalf("pattern %q: %q is no JSON string\n%s", p, s, g)
			}
		}
	})
}
