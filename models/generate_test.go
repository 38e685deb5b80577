package models

import (
	"bytes"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

func TestGenerateDeterministic(t *testing.T) {
	dir := t.TempDir()
	a, b := filepath.Join(dir, "a.gguf"), filepath.Join(dir, "b.gguf")
	for _, p := range []string{a, b} {
		if err := Generate(p, Tiny()); err != nil {
			t.Fatal(err)
		}
	}
	da, _ := os.ReadFile(a)
	db, _ := os.ReadFile(b)
	if !bytes.Equal(da, db) {
		t.Fatal("same spec and seed gave different files")
	}
	if string(da[:4]) != "GGUF" {
		t.Fatalf("magic %q", da[:4])
	}
	spec := Tiny()
	spec.Seed = 99
	c := filepath.Join(dir, "c.gguf")
	if err := Generate(c, spec); err != nil {
		t.Fatal(err)
	}
	dc, _ := os.ReadFile(c)
	if bytes.Equal(da, dc) {
		t.Fatal("different seeds gave identical weights")
	}
}

func TestSpecValidate(t *testing.T) {
	for name, mk := range Presets {
		if err := mk().Validate(); err != nil {
			t.Errorf("preset %s: %v", name, err)
		}
	}
	bad := []func(*Spec){
		func(s *Spec) { s.Vocab = 10 },
		func(s *Spec) { s.Heads = 3 },
		func(s *Spec) { s.HeadsKV = 3 },
		func(s *Spec) { s.Layers = 0 },
		func(s *Spec) { s.Embd = 60; s.Heads = 20; s.HeadsKV = 20 },
	}
	for i, f := range bad {
		s := Tiny()
		f(&s)
		if err := s.Validate(); err == nil {
			t.Errorf("case %d: want error", i)
		}
		if err := Generate(filepath.Join(t.TempDir(), "x.gguf"), s); err == nil {
			t.Errorf("case %d: Generate accepted an invalid spec", i)
		}
	}
	// A control token whose text the vocabulary has already (two tokens of one
	// text make llama.cpp abort at load).
	dup := Tiny()
	dup.ControlTokens = []string{"ee"}
	if err := Generate(filepath.Join(t.TempDir(), "dup.gguf"), dup); err == nil || !strings.Contains(err.Error(), `"ee"`) {
		t.Errorf("a control token repeating a vocabulary text: %v", err)
	}
	if p := Bench100M().Params(); p < 90e6 || p > 130e6 {
		t.Errorf("100m preset has %d parameters", p)
	}
}

func TestVocabularyIsPrefixClosed(t *testing.T) {
	toks, _, types := vocabulary(2000)
	if len(toks) != 2000 {
		t.Fatalf("%d tokens", len(toks))
	}
	seen := map[string]bool{}
	for i, tk := range toks {
		if seen[tk] {
			t.Fatalf("duplicate token %q", tk)
		}
		seen[tk] = true
		if types[i] != tokenNormal {
			continue
		}
		// SentencePiece merges pairs of existing pieces: every piece must be reachable.
		r := []rune(tk)
		if len(r) > 1 && !seen[string(r[:len(r)-1])] {
			t.Fatalf("token %q: prefix %q missing", tk, string(r[:len(r)-1]))
		}
	}
}
