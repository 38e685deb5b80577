package main

import (
	"bytes"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

func TestVersion(t *testing.T) {
	var out, errb bytes.Buffer
	if code := run([]string{"version"}, &out, &errb); code != 0 {
		t.Fatalf("exit %d: %s", code, errb.String())
	}
	s := out.String()
	for _, want := range []string{"shoal ", "llama.cpp ec98e2002", "cpu kernels: "} {
		if !strings.Contains(s, want) {
			t.Errorf("version output lacks %q:\n%s", want, s)
		}
	}
}

func TestUnknownCommandAndHelp(t *testing.T) {
	var out, errb bytes.Buffer
	if code := run([]string{"nope"}, &out, &errb); code != 2 || !strings.Contains(errb.String(), "unknown command") {
		t.Fatalf("exit %d: %s", code, errb.String())
	}
	out.Reset()
	if code := run(nil, &out, &errb); code != 0 || !strings.Contains(out.String(), "gen-model") {
		t.Fatalf("usage: %d %s", code, out.String())
	}
	out.Reset()
	if code := run([]string{"gen-model", "-h"}, &out, &errb); code != 0 || !strings.Contains(out.String(), "-preset") {
		t.Fatalf("gen-model -h: %d %s", code, out.String())
	}
}

func TestGenModel(t *testing.T) {
	p := filepath.Join(t.TempDir(), "m.gguf")
	var out, errb bytes.Buffer
	if code := run([]string{"gen-model", "--preset", "tiny", "--out", p}, &out, &errb); code != 0 {
		t.Fatalf("exit %d: %s", code, errb.String())
	}
	if st, err := os.Stat(p); err != nil || st.Size() < 100_000 {
		t.Fatalf("model file: %v", err)
	}
	if code := run([]string{"gen-model", "--preset", "huge", "--out", p}, &out, &errb); code != 1 {
		t.Fatalf("unknown preset: exit %d", code)
	}
}
