package llama

import (
	"os"
	"path/filepath"
	"runtime"
	"strings"
	"sync"
	"testing"

	"github.com/shoal-ai/shoal/models"
)

// TestQuantizedModels: the weights users serve are quantized. A quantized copy of the
// small model loads, is smaller, and keeps the two exactness properties serving
// relies on (batching and shared prefixes change nothing beyond kernel noise).
func TestQuantizedModels(t *testing.T) {
	src := genModel(t, models.Small())
	srcInfo, err := os.Stat(src)
	if err != nil {
		t.Fatal(err)
	}
	for _, typ := range []string{"q8_0", "Q4_K_M"} {
		t.Run(typ, func(t *testing.T) {
			out := filepath.Join(t.TempDir(), typ+".gguf")
			if err := Quantize(src, out, typ, 2); err != nil {
				t.Fatal(err)
			}
			fi, err := os.Stat(out)
			if err != nil {
				t.Fatal(err)
			}
			// The small model is f32: q8_0 is about a quarter of it, q4_k_m less.
			if fi.Size() > srcInfo.Size()/3 {
				t.Errorf("%s is %d bytes, the f32 source %d", typ, fi.Size(), srcInfo.Size())
			}
			e := openFile(t, out, nil)
			if got := int64(e.Info().SizeBytes); got <= 0 || got > srcInfo.Size()/3 {
				t.Errorf("model size %d bytes after %s (source file %d)", got, typ, srcInfo.Size())
			}
			batchedEqualsSequential(t, e)
			sharedPrefixEqualsRecomputed(t, e)
		})
	}
}

func TestQuantizeRefusesBadInput(t *testing.T) {
	src := genModel(t, models.Tiny())
	dir := t.TempDir()
	junk := filepath.Join(dir, "junk.gguf")
	if err := os.WriteFile(junk, []byte("GGUF but not really"), 0o644); err != nil {
		t.Fatal(err)
	}
	out := filepath.Join(dir, "out.gguf")
	for _, c := range []struct{ in, out, typ, want string }{
		{src, out, "q9_9", "unknown type"},
		{filepath.Join(dir, "missing.gguf"), out, "q8_0", "no such file"},
		{src, src, "q8_0", "another file"},
		{junk, out, "q8_0", "quantize"},
	} {
		err := Quantize(c.in, c.out, c.typ, 1)
		if err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("Quantize(%s, %s): %v, want an error with %q", filepath.Base(c.in), c.typ, err, c.want)
		}
		if _, err := os.Stat(out); err == nil {
			t.Errorf("Quantize(%s, %s) left %s behind", filepath.Base(c.in), c.typ, out)
		}
	}
}

// quantModel quantizes spec's generated model to typ once per test binary.
func quantModel(t testing.TB, spec models.Spec, typ string) string {
	t.Helper()
	src := genModel(t, spec)
	f, _ := modelOnce.LoadOrStore(spec.Name+"/"+typ, sync.OnceValues(func() (string, error) {
		p := filepath.Join(modelDir, spec.Name+"-"+typ+".gguf")
		return p, Quantize(src, p, typ, 0)
	}))
	p, err := f.(func() (string, error))()
	if err != nil {
		t.Fatal(err)
	}
	return p
}

// BenchmarkQuantized compares the 100M model's weight types side by side on this
// machine: decode at batch 1, 8, 32 and 64 (128-token contexts, one pool, all cores)
// and the prefill of one 512-token prompt. `make bench-quant`; docs/benchmarks.md.
func BenchmarkQuantized(b *testing.B) {
	for _, typ := range []string{"f16", "q8_0", "q4_k_m"} {
		path := genModel(b, models.Bench100M())
		if typ != "f16" {
			path = quantModel(b, models.Bench100M(), typ)
		}
		benchDecode(b, "100m-"+typ, path, runtime.NumCPU(), true, []int{1, 8, 32, 64}, benchPrompt)
		benchPrefill(b, "100m-"+typ, path, runtime.NumCPU(), true)
	}
}
