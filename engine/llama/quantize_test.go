package llama

import (
	"fmt"
	"os"
	"path/filepath"
	"runtime"
	"slices"
	"strings"
	"sync"
	"testing"

	"github.com/shoal-ai/shoal/engine"
	"github.com/shoal-ai/shoal/models"
)

// TestQuantizedModels: the weights users serve are quantized. A quantized copy of the
// small model loads, is smaller, and keeps the two exactness properties serving
// relies on (batching and shared prefixes change nothing beyond kernel noise).
//
// A second model has the widths ggml's AMX kernels take (inner sizes that are
// multiples of 2048, as Llama 3 8B's 4096 and 14336 are), so that on a CPU
// with AMX (a Xeon from its 4th generation) its q8_0 and k-quant matrices
// go through ggml's AMX backend (its tiles for many rows, VNNI for a few; its
// f16 ones through the same backend's AVX-512 kernels), and its q4_0 and q4_1
// ones, whose AMX products are wrong in the pinned llama.cpp, do not
// (engine/llama/ggml_amx.h).
func TestQuantizedModels(t *testing.T) {
	amx := strings.Contains(CPUFeatures(), "AMX_INT8")
	for _, typ := range []string{"f16", "q8_0", "q4_0", "q4_1", "q4_k_m"} {
		t.Run("amx-shaped/"+typ, func(t *testing.T) {
			e := openFile(t, quantModel(t, amxShaped(1, 2048), typ), nil)
			used := slices.ContainsFunc(e.Info().Weights, func(b engine.WeightBuffer) bool { return b.Name == "AMX" && b.Bytes > 0 })
			if used != amx {
				t.Errorf("kernels with AMX: %v; weights in AMX's buffer: %v (%v)", amx, used, e.Info().Weights)
			}
			batchedEqualsSequential(t, e)
			sharedPrefixEqualsRecomputed(t, e)
		})
	}
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
			var held uint64
			for _, b := range e.Info().Weights {
				held += b.Bytes
			}
			if size := e.Info().SizeBytes; held < size*9/10 || held > size*11/10 {
				t.Errorf("weight buffers %v hold %d bytes, the model %d", e.Info().Weights, held, size)
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
	// The input under another name: its own path spelled otherwise, a link.
	link := filepath.Join(dir, "link.gguf")
	if err := os.Symlink(src, link); err != nil {
		t.Fatal(err)
	}
	srcInfo, _ := os.Stat(src)
	for _, c := range []struct{ in, out, typ, want string }{
		{src, out, "q9_9", "unknown type"},
		{filepath.Join(dir, "missing.gguf"), out, "q8_0", "no such file"},
		{src, src, "q8_0", "another file"},
		{src, filepath.Dir(src) + "/./" + filepath.Base(src), "q8_0", "another file"},
		{src, link, "q8_0", "another file"},
		{junk, out, "q8_0", "quantize"},
	} {
		err := Quantize(c.in, c.out, c.typ, 1)
		if err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("Quantize(%s, %s): %v, want an error with %q", filepath.Base(c.in), c.typ, err, c.want)
		}
		if _, err := os.Stat(out); err == nil {
			t.Errorf("Quantize(%s, %s) left %s behind", filepath.Base(c.in), c.typ, out)
		}
		if fi, err := os.Stat(src); err != nil || fi.Size() != srcInfo.Size() {
			t.Fatalf("Quantize(%s, %s, %s) changed the input: %v", filepath.Base(c.in), c.out, c.typ, err)
		}
	}
	if left, _ := filepath.Glob(filepath.Join(dir, "*.part")); len(left) > 0 {
		t.Fatalf("left behind: %v", left)
	}
}

// quantModel quantizes spec's generated model to typ once per test binary; an
// f16 spec's "f16" is the model as generated.
func quantModel(t testing.TB, spec models.Spec, typ string) string {
	t.Helper()
	src := genModel(t, spec)
	if spec.F16 && strings.EqualFold(typ, "f16") {
		return src
	}
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

// amxShaped is a model whose matrices ggml's AMX kernels take: a width of 2048
// and an FFN of ffn (a multiple of 2048), in f16, a 16k vocabulary.
func amxShaped(layers, ffn int) models.Spec {
	return models.Spec{Name: fmt.Sprintf("shoal-amx-%dx%d", layers, ffn), Seed: 5, Vocab: 16384, Embd: 2048,
		Layers: layers, Heads: 16, HeadsKV: 8, FFN: ffn, ContextLen: 8192, F16: true}
}

// BenchmarkQuantized compares weight types side by side on this machine: decode
// at batch 1, 8, 32 and 64 (128-token contexts, one pool, all cores) and the
// prefill of one 512-token prompt, for the 100M model and for a 290M one whose
// matrices ggml's AMX kernels take (2048 wide, 4 layers, an FFN of 8192).
// `make bench-quant`; docs/benchmarks.md.
func BenchmarkQuantized(b *testing.B) {
	for _, c := range []struct {
		name  string
		spec  models.Spec
		types []string
	}{
		{"100m", models.Bench100M(), []string{"f16", "q8_0", "q4_k_m"}},
		{"amx-290m", amxShaped(4, 8192), []string{"f16", "q8_0", "q4_0", "q4_k_m"}},
	} {
		for _, typ := range c.types {
			path := quantModel(b, c.spec, typ)
			benchDecode(b, c.name+"-"+typ, path, runtime.NumCPU(), true, []int{1, 8, 32, 64}, benchPrompt)
			benchPrefill(b, c.name+"-"+typ, path, runtime.NumCPU(), true)
		}
	}
}

// TestLlamaErrorsPerCall: calls into llama.cpp failing at once each report
// their own error line (llama.cpp logs them process-wide; the lines are kept
// by the thread that logged them).
func TestLlamaErrorsPerCall(t *testing.T) {
	dir := t.TempDir()
	const n = 8
	errs := make([]error, n)
	var wg sync.WaitGroup
	for i := range n {
		junk := filepath.Join(dir, fmt.Sprintf("junk%d.gguf", i))
		// A GGUF header whose version no reader takes.
		if err := os.WriteFile(junk, append([]byte("GGUF"), 100, 0, 0, 0), 0o644); err != nil {
			t.Fatal(err)
		}
		wg.Go(func() { errs[i] = Quantize(junk, filepath.Join(dir, fmt.Sprintf("out%d.gguf", i)), "q8_0", 1) })
	}
	wg.Wait()
	for i, err := range errs {
		// Its name in the message and in llama.cpp's line, no other file's.
		if err == nil || strings.Count(err.Error(), fmt.Sprintf("junk%d.gguf", i)) != 2 || strings.Count(err.Error(), "junk") != 2 {
			t.Errorf("file %d: %v, want llama.cpp's line about it", i, err)
		}
	}
}
