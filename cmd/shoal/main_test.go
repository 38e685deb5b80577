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
	errb.Reset()
	if code := run(nil, &out, &errb); code != 2 || !strings.Contains(errb.String(), "gen-model") {
		t.Fatalf("no command: %d %s", code, errb.String())
	}
	if code := run([]string{"help"}, &out, &errb); code != 0 || !strings.Contains(out.String(), "gen-model") {
		t.Fatalf("help: %d %s", code, out.String())
	}
	out.Reset()
	if code := run([]string{"gen-model", "-h"}, &out, &errb); code != 0 || !strings.Contains(out.String(), "-preset") {
		t.Fatalf("gen-model -h: %d %s", code, out.String())
	}
	// A bad value is one line, not the help after it.
	out.Reset()
	errb.Reset()
	if code := run([]string{"gen-model", "--seed", "abc"}, &out, &errb); code != 1 || strings.Count(errb.String(), "\n") != 1 ||
		!strings.Contains(errb.String(), "-h lists the flags") || out.Len() > 0 {
		t.Fatalf("a bad value: %d %q %q", code, errb.String(), out.String())
	}
	// A malformed address is an error, not a panic.
	for _, args := range [][]string{{"status", "--addr", "::::"}, {"status", "--addr", "http://[::1"}, {"bench", "--url", "%zz"}} {
		errb.Reset()
		if code := run(args, &out, &errb); code != 1 || !strings.Contains(errb.String(), "URL") {
			t.Errorf("%v: %d %s", args, code, errb.String())
		}
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

func TestQuantizeCommand(t *testing.T) {
	dir := t.TempDir()
	src, q := filepath.Join(dir, "m.gguf"), filepath.Join(dir, "m-q8_0.gguf")
	var out, errb bytes.Buffer
	if code := run([]string{"gen-model", "--preset", "tiny", "--out", src}, &out, &errb); code != 0 {
		t.Fatalf("gen-model: exit %d: %s", code, errb.String())
	}
	out.Reset()
	if code := run([]string{"quantize", "--model", src, "--out", q, "--type", "q8_0", "--threads", "1"}, &out, &errb); code != 0 {
		t.Fatalf("quantize: exit %d: %s", code, errb.String())
	}
	if !strings.Contains(out.String(), "wrote "+q+": q8_0") {
		t.Fatalf("quantize said %q", out.String())
	}
	for _, args := range [][]string{
		{"quantize", "--model", src},
		{"quantize", "--model", src, "--out", q, "--type", "q1"},
	} {
		errb.Reset()
		if code := run(args, &out, &errb); code != 1 || errb.Len() == 0 {
			t.Errorf("%v: exit %d, stderr %q; want 1 and a message", args, code, errb.String())
		}
	}
}
