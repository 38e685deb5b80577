package llama

import (
	"bytes"
	"encoding/json"
	"os"
	"path/filepath"
	"testing"

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
// never crashes the process (llama.cpp's converter did on (?:a)+), and a
// grammar it makes parses.
func FuzzSchemaPatterns(f *testing.F) {
	e := openTest(f, models.Tiny(), nil)
	for _, p := range []string{"^(?:ab)+$", "abc", `^\d{3}$`, "^(?=x)a$", "^*$", `^[\d\-]+$`, "^(a|)+$", `^\u00e9{2}$`, "^()*$"} {
		f.Add(p)
	}
	f.Fuzz(func(t *testing.T, p string) {
		schema, _ := json.Marshal(map[string]any{"type": "string", "pattern": p})
		g, err := SchemaToGrammar(schema)
		if err != nil {
			return
		}
		if err := e.vocab.CheckGrammar(g); err != nil {
			t.Fatalf("pattern %q: the grammar does not parse: %v\n%s", p, err, g)
		}
	})
}
