package llama

import (
	"bytes"
	"cmp"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"math"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"
	"unicode"

	"github.com/shoal-ai/shoal/engine"
	"github.com/shoal-ai/shoal/engine/sample"
	"github.com/shoal-ai/shoal/models"
)

var (
	modelOnce sync.Map // spec name -> func() (string, error)
	modelDir  string
)

func TestMain(m *testing.M) {
	dir, err := os.MkdirTemp("", "shoal-engine-test")
	if err != nil {
		panic(err)
	}
	modelDir = dir
	// llama.cpp warns about the generated vocabulary's unused special ids; keep test
	// output to errors.
	SetLogger(slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelError})))
	code := m.Run()
	os.RemoveAll(dir)
	os.Exit(code)
}

// genModel generates spec once per test binary and returns its path.
func genModel(t testing.TB, spec models.Spec) string {
	t.Helper()
	f, _ := modelOnce.LoadOrStore(spec.Name, sync.OnceValues(func() (string, error) {
		p := filepath.Join(modelDir, spec.Name+".gguf")
		return p, models.Generate(p, spec)
	}))
	p, err := f.(func() (string, error))()
	if err != nil {
		t.Fatal(err)
	}
	return p
}

// genLoRA writes a rank-rank LoRA adapter for spec's model into a temporary
// directory and returns its path.
func genLoRA(t testing.TB, spec models.Spec, rank int) string {
	t.Helper()
	p := filepath.Join(t.TempDir(), fmt.Sprintf("lora-%s-%d.gguf", spec.Name, rank))
	if err := models.GenerateLoRA(p, spec, rank, 0); err != nil {
		t.Fatal(err)
	}
	return p
}

func openTest(t testing.TB, spec models.Spec, mod func(*Config)) *Engine {
	t.Helper()
	return openFile(t, genModel(t, spec), mod)
}

// openFile opens the model at path with the tests' small sizes.
func openFile(t testing.TB, path string, mod func(*Config)) *Engine {
	t.Helper()
	cfg := DefaultConfig(path)
	cfg.ContextCells = 2048
	cfg.MaxSeqs = 16
	cfg.BatchTokens = 512
	cfg.Threads = 2
	if mod != nil {
		mod(&cfg)
	}
	cfg.MicroBatchTokens = min(cfg.MicroBatchTokens, cfg.BatchTokens)
	e, err := Open(cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { e.Close() })
	return e
}

var testPrompts = []string{
	"The quick brown fox jumps over the lazy dog.",
	"Once upon a time there was a little girl.",
	"hello",
	"In a hole in the ground there lived a hobbit, not a nasty dirty wet hole.",
	"1 2 3 4 5 6 7 8 9 10",
	"Über naïve café ✓",
	"What is the capital of France? It is Paris, of course, and it has been for centuries.",
	"a",
}

func tokenize(t testing.TB, e *Engine, s string) []engine.Token {
	t.Helper()
	toks, err := e.Vocab().Tokenize(s, true, false)
	if err != nil {
		t.Fatal(err)
	}
	return toks
}

// greedyRun is one prompt's greedy continuation with the logits of every step.
type greedyRun struct {
	tokens []engine.Token
	logits [][]float32
}

// decodeGreedy generates n tokens for each prompt, all sequences sharing every batch.
// With stepwise, each prompt is prefilled one token per decode instead of all at once:
// the same computation through batches of another shape.
func decodeGreedy(t testing.TB, e *Engine, prompts [][]engine.Token, n int, stepwise bool) []greedyRun {
	t.Helper()
	ctx := context.Background()
	var b engine.Batch
	out := make([]greedyRun, len(prompts))
	rows := make([]int, len(prompts))
	for s, p := range prompts {
		from := 0
		if stepwise {
			from = len(p) - 1
			for i, tk := range p[:from] {
				var one engine.Batch
				one.Add(tk, engine.Pos(i), engine.SeqID(s), false)
				if err := e.Decode(ctx, &one); err != nil {
					t.Fatalf("prefill: %v", err)
				}
			}
		}
		for i := from; i < len(p); i++ {
			last := i == len(p)-1
			if last {
				rows[s] = b.Len()
			}
			b.Add(p[i], engine.Pos(i), engine.SeqID(s), last)
		}
	}
	for step := range n {
		if err := e.Decode(ctx, &b); err != nil {
			t.Fatalf("step %d: %v", step, err)
		}
		for s := range prompts {
			var l []float32
			if err := e.Logits(rows[s], func(x []float32) { l = slices.Clone(x) }); err != nil {
				t.Fatal(err)
			}
			out[s].logits = append(out[s].logits, l)
			out[s].tokens = append(out[s].tokens, engine.Token(argmax(l)))
		}
		b.Reset()
		for s, p := range prompts {
			rows[s] = b.Len()
			b.Add(out[s].tokens[step], engine.Pos(len(p)+step), engine.SeqID(s), true)
		}
	}
	return out
}

func argmax(l []float32) int {
	best := 0
	for i, x := range l {
		if x > l[best] {
			best = i
		}
	}
	return best
}

// maxAbsDiff is the largest |a[i]-b[i]|.
func maxAbsDiff(a, b []float32) float64 {
	var d float64
	for i := range a {
		d = max(d, math.Abs(float64(a[i]-b[i])))
	}
	return d
}

// compareGreedy compares two greedy runs of one prompt step by step up to the first
// step whose tokens differ (the runs' inputs differ after it). It returns the largest
// change of a logit over the steps compared, and at the first differing step (at, -1
// if none) the gap between a's two best logits and that step's largest change: a
// change of at most d in every logit can swap the best two only if their gap is at
// most 2d.
func compareGreedy(a, b greedyRun) (maxDiff float64, at int, gap, diffAt float64) {
	for i := range min(len(a.tokens), len(b.tokens)) {
		d := maxAbsDiff(a.logits[i], b.logits[i])
		maxDiff = max(maxDiff, d)
		if a.tokens[i] != b.tokens[i] {
			return maxDiff, i, gapToNext(a.logits[i], a.tokens[i]), d
		}
	}
	return maxDiff, -1, 0, 0
}

// gapToNext is how far logit best stands above every other.
func gapToNext(l []float32, best engine.Token) float64 {
	next := float32(math.Inf(-1))
	for k, x := range l {
		if k != int(best) {
			next = max(next, x)
		}
	}
	return float64(l[best] - next)
}

// kernelNoise is how far this device's logits move when only the shape of the
// batches changes: a few prompts decoded alone, prefilled at once and token by token,
// compared up to their first differing token. Kernels for other batch sizes sum in
// another order and the f16 KV cache rounds the difference, so logits move even on
// the CPU (about 5e-3 of a spread of 4 for the small test model); a GPU's kernels may
// move them more. Tests that compare other changes of the batches (sequences sharing
// them, a cached prefix) measure against it rather than against a constant that holds
// on one device only. It leaves the engine's memory empty.
func kernelNoise(t testing.TB, e *Engine) float64 {
	t.Helper()
	var noise float64
	for _, p := range testPrompts[:4] {
		toks := tokenize(t, e, p)
		var runs [2]greedyRun
		for i, stepwise := range []bool{false, true} {
			if err := e.ClearMemory(); err != nil {
				t.Fatal(err)
			}
			runs[i] = decodeGreedy(t, e, [][]engine.Token{toks}, 8, stepwise)[0]
		}
		d, _, _, _ := compareGreedy(runs[0], runs[1])
		noise = max(noise, d)
	}
	if err := e.ClearMemory(); err != nil {
		t.Fatal(err)
	}
	t.Logf("kernel noise: logits move by up to %.3g when only the batch shapes change", noise)
	return noise
}

// TestBatchedGreedyEqualsSequential: sequences decoded together in every batch give
// what each gives alone. Batching changes the kernels' batch shapes and nothing else,
// so every logit may move by what such a change moves it (kernelNoise, with 4×
// headroom; a sequence seeing another's cells would move them by their whole spread),
// and a greedy choice may differ only where the best two logits are within twice the
// step's change: a tie at this precision, after which the runs go apart.
func TestBatchedGreedyEqualsSequential(t *testing.T) {
	batchedEqualsSequential(t, openTest(t, models.Small(), nil))
}

// batchedEqualsSequential decodes the test prompts greedily in one batch and each
// alone, and holds their logits to four times e's own kernel noise.
func batchedEqualsSequential(t *testing.T, e *Engine) {
	t.Helper()
	tol := max(4*kernelNoise(t, e), 1e-3)
	var prompts [][]engine.Token
	for _, p := range testPrompts {
		prompts = append(prompts, tokenize(t, e, p))
	}
	const n = 24
	batched := decodeGreedy(t, e, prompts, n, false)
	var worst float64
	for s, p := range prompts {
		if err := e.ClearMemory(); err != nil {
			t.Fatal(err)
		}
		alone := decodeGreedy(t, e, [][]engine.Token{p}, n, false)[0]
		d, at, gap, dAt := compareGreedy(alone, batched[s])
		worst = max(worst, d)
		if d > tol {
			t.Errorf("prompt %d: batched, logits move by %.3g, more than a change of batch shape does (tolerance %.3g)", s, d, tol)
		}
		if at >= 0 {
			if gap > 2*dAt {
				t.Errorf("prompt %d token %d: batched %v, alone %v; the best two logits alone are %.3g apart, more than twice the step's change %.3g: not a tie", s, at, batched[s].tokens, alone.tokens, gap, dAt)
			} else {
				t.Logf("prompt %d: tie at token %d (best two %.3g apart, logits moved %.3g); compared up to it", s, at, gap, dAt)
			}
		}
	}
	t.Logf("batched vs alone: logits move by up to %.3g (tolerance %.3g)", worst, tol)
}

func TestSharedPrefixEqualsRecomputed(t *testing.T) {
	sharedPrefixEqualsRecomputed(t, openTest(t, models.Small(), nil))
}

// sharedPrefixEqualsRecomputed holds a sequence that borrows 1, 2 and 4 blocks of
// another's cells to the logits of computing the prompt itself.
func sharedPrefixEqualsRecomputed(t *testing.T, e *Engine) {
	t.Helper()
	toks := tokenize(t, e, strings.Repeat("The cat sat on the mat and looked at the dog. ", 8))
	if len(toks) < 70 {
		t.Fatalf("prompt too short: %d", len(toks))
	}
	ctx := context.Background()
	logits := func(row int) []float32 {
		var l []float32
		if err := e.Logits(row, func(x []float32) { l = slices.Clone(x) }); err != nil {
			t.Fatal(err)
		}
		return l
	}
	for _, k := range []int{1, 2, 4} {
		shared := k * 16
		if err := e.ClearMemory(); err != nil {
			t.Fatal(err)
		}
		// Sequence 0 computes the whole prompt; sequence 1 borrows its first k blocks and
		// computes the rest; sequence 2 computes everything itself; sequence 3 too, in a
		// batch of its own: the control, what a change of batch shape alone does.
		var b engine.Batch
		for i, tk := range toks {
			b.Add(tk, engine.Pos(i), 0, false)
		}
		if err := e.Decode(ctx, &b); err != nil {
			t.Fatal(err)
		}
		if err := e.SeqCopy(0, 1, 0, engine.Pos(shared)); err != nil {
			t.Fatal(err)
		}
		b.Reset()
		for i := shared; i < len(toks); i++ {
			b.Add(toks[i], engine.Pos(i), 1, i == len(toks)-1)
		}
		rowShared := b.Len() - 1
		for i, tk := range toks {
			b.Add(tk, engine.Pos(i), 2, i == len(toks)-1)
		}
		rowOwn := b.Len() - 1
		if err := e.Decode(ctx, &b); err != nil {
			t.Fatal(err)
		}
		sharedL, own := logits(rowShared), logits(rowOwn)
		b.Reset()
		for i, tk := range toks {
			b.Add(tk, engine.Pos(i), 3, i == len(toks)-1)
		}
		if err := e.Decode(ctx, &b); err != nil {
			t.Fatal(err)
		}
		control := maxAbsDiff(logits(b.Len()-1), own)
		// The device's own noise, with 4× headroom, or 1e-3 where it has none (the
		// CPU: there the difference is 0).
		tol := max(4*control, 1e-3)
		d := maxAbsDiff(sharedL, own)
		if d > tol {
			t.Fatalf("k=%d: logits differ by %g; recomputing in another batch moves them by %g", k, d, control)
		}
		t.Logf("k=%d (%d shared tokens): max |diff| %.2g (recomputed in another batch: %.2g)", k, shared, d, control)
	}
}

func TestRemoveReturnsCells(t *testing.T) {
	e := openTest(t, models.Tiny(), func(c *Config) { c.ContextCells = 256; c.BatchTokens = 256 })
	ctx := context.Background()
	fill := func(s engine.SeqID) error {
		var b engine.Batch
		for i := range 128 {
			b.Add(engine.Token(100+i), engine.Pos(i), s, false)
		}
		return e.Decode(ctx, &b)
	}
	for s := range engine.SeqID(2) {
		if err := fill(s); err != nil {
			t.Fatalf("fill %d: %v", s, err)
		}
	}
	if err := fill(2); !errors.Is(err, engine.ErrNoKVSpace) {
		t.Fatalf("full context: got %v, want ErrNoKVSpace", err)
	}
	if _, _, ok := e.SeqPosRange(2); ok {
		t.Fatal("failed decode left cells behind")
	}
	if err := e.SeqRemove(0, 0, -1); err != nil {
		t.Fatal(err)
	}
	if _, _, ok := e.SeqPosRange(0); ok {
		t.Fatal("sequence 0 still has cells")
	}
	if err := fill(2); err != nil {
		t.Fatalf("refill after remove: %v", err)
	}
	lo, hi, ok := e.SeqPosRange(2)
	if !ok || lo != 0 || hi != 127 {
		t.Fatalf("seq 2 range %d..%d %v", lo, hi, ok)
	}
	// Partial removal then keep.
	if err := e.SeqRemove(2, 64, -1); err != nil {
		t.Fatal(err)
	}
	if _, hi, _ := e.SeqPosRange(2); hi != 63 {
		t.Fatalf("after trim max pos %d", hi)
	}
	if err := e.SeqKeep(2); err != nil {
		t.Fatal(err)
	}
	if _, _, ok := e.SeqPosRange(1); ok {
		t.Fatal("keep left sequence 1")
	}
}

func TestBadInputKeepsEngineWorking(t *testing.T) {
	e := openTest(t, models.Tiny(), func(c *Config) { c.ContextCells = 128; c.BatchTokens = 128 })
	ctx := context.Background()
	works := func() {
		t.Helper()
		var b engine.Batch
		b.Add(10, 0, 5, true)
		if err := e.Decode(ctx, &b); err != nil {
			t.Fatalf("engine broken: %v", err)
		}
		if err := e.SeqRemove(5, 0, -1); err != nil {
			t.Fatal(err)
		}
	}
	long := make([]engine.Token, 200)
	var b engine.Batch
	for i, tk := range long {
		b.Add(tk+10, engine.Pos(i), 0, false)
	}
	cases := []struct {
		name string
		b    func() *engine.Batch
		want error
	}{
		{"prompt longer than context", func() *engine.Batch { return &b }, engine.ErrInvalidInput},
		{"token out of range", func() *engine.Batch {
			var x engine.Batch
			x.Add(engine.Token(e.Vocab().Size()), 0, 0, true)
			return &x
		}, engine.ErrInvalidInput},
		{"negative token", func() *engine.Batch { var x engine.Batch; x.Add(-1, 0, 0, true); return &x }, engine.ErrInvalidInput},
		{"sequence out of range", func() *engine.Batch { var x engine.Batch; x.Add(1, 0, 999, true); return &x }, engine.ErrInvalidInput},
		{"position beyond context", func() *engine.Batch {
			var x engine.Batch
			x.Add(1, engine.Pos(e.Capacity().CellsPerSeq), 0, true)
			return &x
		}, engine.ErrInvalidInput},
		{"empty batch", func() *engine.Batch { return &engine.Batch{} }, engine.ErrInvalidInput},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			err := e.Decode(ctx, c.b())
			if !errors.Is(err, c.want) {
				t.Fatalf("got %v, want %v", err, c.want)
			}
			t.Logf("error: %v", err)
			works()
		})
	}
	if err := e.Logits(99, func([]float32) {}); !errors.Is(err, engine.ErrInvalidInput) {
		t.Fatalf("logits of a bad row: %v", err)
	}
	if _, err := e.Vocab().Detokenize([]engine.Token{1, 99999}, false, false); !errors.Is(err, engine.ErrInvalidInput) {
		t.Fatalf("detokenize bad token: %v", err)
	}
	if err := e.SeqCopy(0, 500, 0, -1); !errors.Is(err, engine.ErrInvalidInput) {
		t.Fatalf("copy to bad seq: %v", err)
	}
	works()
}

func TestBadModelFiles(t *testing.T) {
	good := genModel(t, models.Tiny())
	data, err := os.ReadFile(good)
	if err != nil {
		t.Fatal(err)
	}
	dir := t.TempDir()
	write := func(name string, b []byte) string {
		p := filepath.Join(dir, name)
		if err := os.WriteFile(p, b, 0o644); err != nil {
			t.Fatal(err)
		}
		return p
	}
	corrupt := append([]byte(nil), data...)
	for i := 8; i < 24; i++ { // tensor and KV counts
		corrupt[i] = 0xFF
	}
	// A vocabulary in which two tokens have one text ("ee", the vocabulary's
	// first pair of letters, in place of a control token "@@"): llama.cpp asserts.
	dupSpec := models.Tiny()
	dupSpec.Name, dupSpec.ControlTokens = "shoal-dup", []string{"@@"}
	dupData, err := os.ReadFile(genModel(t, dupSpec))
	if err != nil {
		t.Fatal(err)
	}
	lenPrefixed := func(s string) []byte { return append([]byte{byte(len(s)), 0, 0, 0, 0, 0, 0, 0}, s...) }
	if bytes.Count(dupData, lenPrefixed("@@")) != 1 || !bytes.Contains(dupData, lenPrefixed("ee")) {
		t.Fatal("the generated vocabulary changed: pick other texts")
	}
	dup := write("dup.gguf", bytes.Replace(dupData, lenPrefixed("@@"), lenPrefixed("ee"), 1))
	cases := map[string]string{
		"duplicate token": dup,
		"missing":         filepath.Join(dir, "nope.gguf"),
		"directory":       dir,
		"truncated":       write("trunc.gguf", data[:len(data)/2]),
		"corrupt":         write("corrupt.gguf", corrupt),
		"not gguf":        write("text.gguf", []byte("hello, this is not a model")),
		"empty":           write("empty.gguf", nil),
	}
	e := openTest(t, models.Tiny(), nil)
	for name, p := range cases {
		t.Run(name, func(t *testing.T) {
			_, err := Open(DefaultConfig(p))
			if err == nil {
				t.Fatal("want error")
			}
			t.Logf("error: %v", err)
			if !strings.Contains(err.Error(), p) && name != "directory" {
				t.Errorf("error does not name the file: %v", err)
			}
			var b engine.Batch
			b.Add(5, 0, 0, true)
			if err := e.Decode(context.Background(), &b); err != nil {
				t.Fatalf("other engine broken: %v", err)
			}
			e.ClearMemory()
		})
	}
}

func TestConfigValidation(t *testing.T) {
	p := genModel(t, models.Tiny())
	bad := []func(*Config){
		func(c *Config) { c.KVTypeK = "q3_k" },
		func(c *Config) { c.KVTypeV = "q8_0"; c.FlashAttention = FlashOff },
		func(c *Config) { c.FlashAttention = "maybe" },
		func(c *Config) { c.MaxSeqs = 257 },
		func(c *Config) { c.MaxSeqs = 0 },
		func(c *Config) { c.MicroBatchTokens = c.BatchTokens * 2 },
		func(c *Config) { c.Unified = false; c.ContextCells = 64; c.MaxSeqs = 8 },
		func(c *Config) { c.ChatTemplate = "no-such-format" },
	}
	for i, mod := range bad {
		cfg := DefaultConfig(p)
		mod(&cfg)
		if _, err := Open(cfg); err == nil {
			t.Errorf("case %d: want error", i)
		} else {
			t.Logf("case %d: %v", i, err)
		}
	}
	cellBytes := map[string]float64{}
	for _, kv := range KVTypes() {
		cfg := DefaultConfig(p)
		cfg.KVTypeK, cfg.KVTypeV, cfg.FlashAttention, cfg.ContextCells = kv, kv, FlashOn, 256
		e, err := Open(cfg)
		if err != nil {
			t.Fatalf("kv %s: %v", kv, err)
		}
		cellBytes[kv] = e.Capacity().CellBytes
		e.Close()
	}
	if f, q := cellBytes["f16"], cellBytes["q8_0"]; f != cellBytes["f32"]/2 || q != f*34/64 || cellBytes["q4_0"] != f*18/64 {
		t.Errorf("bytes per cell: %v", cellBytes)
	}
	// Quantized keys alone need no flash attention (llama-server's -ctk q8_0).
	cfg := DefaultConfig(p)
	cfg.KVTypeK, cfg.FlashAttention, cfg.ContextCells = "q8_0", FlashOff, 256
	e, err := Open(cfg)
	if err != nil {
		t.Fatalf("q8_0 keys without flash attention: %v", err)
	}
	defer e.Close()
	if got, want := e.Capacity().CellBytes, (cellBytes["f16"]+cellBytes["q8_0"])/2; got != want {
		t.Errorf("q8_0 keys, f16 values: %v bytes per cell, want %v", got, want)
	}
	var b engine.Batch
	for i := range 8 {
		b.Add(engine.Token(10+i), engine.Pos(i), 0, i == 7)
	}
	if err := e.Decode(context.Background(), &b); err != nil {
		t.Fatalf("decode with q8_0 keys: %v", err)
	}
}

func TestSplitModeCopiesWholeStreams(t *testing.T) {
	e := openTest(t, models.Tiny(), func(c *Config) { c.Unified = false; c.MaxSeqs = 4; c.ContextCells = 512 })
	// llama.cpp pads each stream to a multiple of 256 cells.
	if c := e.Capacity(); c.PrefixSharing || c.Unified || c.CellsPerSeq < 128 || c.Cells != c.CellsPerSeq*4 {
		t.Fatalf("capacity %+v", e.Capacity())
	}
	var b engine.Batch
	for i := range 20 {
		b.Add(engine.Token(10+i), engine.Pos(i), 0, i == 19)
	}
	if err := e.Decode(context.Background(), &b); err != nil {
		t.Fatal(err)
	}
	if err := e.SeqCopy(0, 1, 0, 16); !errors.Is(err, engine.ErrUnsupported) {
		t.Fatalf("partial copy in split mode: %v", err)
	}
	if err := e.SeqCopy(0, 1, 0, -1); err != nil {
		t.Fatal(err)
	}
	if _, hi, ok := e.SeqPosRange(1); !ok || hi != 19 {
		t.Fatalf("copied stream: max %d %v", hi, ok)
	}
}

func TestAbortAndCancel(t *testing.T) {
	e := openTest(t, models.Small(), func(c *Config) { c.BatchTokens = 2048; c.MicroBatchTokens = 64 })
	var b engine.Batch
	for i := range 2000 {
		b.Add(engine.Token(10+i%500), engine.Pos(i), 0, false)
	}
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	if err := e.Decode(ctx, &b); !errors.Is(err, context.Canceled) {
		t.Fatalf("cancelled before: %v", err)
	}
	ctx, cancel = context.WithTimeout(context.Background(), 5*time.Millisecond)
	defer cancel()
	err := e.Decode(ctx, &b)
	if err != nil && !errors.Is(err, engine.ErrAborted) {
		t.Fatalf("cancelled during: %v", err)
	}
	if err != nil {
		if _, _, ok := e.SeqPosRange(0); ok {
			t.Fatal("aborted decode left cells behind")
		}
	}
	t.Logf("decode under a 5ms deadline: %v", err)
	// The flag is cleared: the next decode works.
	b.Reset()
	b.Add(3, 0, 1, true)
	if err := e.Decode(context.Background(), &b); err != nil {
		t.Fatal(err)
	}
	// Abort before a decode stops that decode, and only that one.
	e.Abort()
	b.Reset()
	b.Add(3, 1, 1, true)
	if err := e.Decode(context.Background(), &b); !errors.Is(err, engine.ErrAborted) {
		t.Fatalf("decode after Abort: %v", err)
	}
	if err := e.Decode(context.Background(), &b); err != nil {
		t.Fatalf("decode after an aborted one: %v", err)
	}
}

func TestCloseTwiceAndAfterClose(t *testing.T) {
	e := openTest(t, models.Tiny(), nil)
	if err := e.Close(); err != nil {
		t.Fatal(err)
	}
	if err := e.Close(); err != nil {
		t.Fatal(err)
	}
	var b engine.Batch
	b.Add(1, 0, 0, true)
	if err := e.Decode(context.Background(), &b); !errors.Is(err, engine.ErrClosed) {
		t.Fatalf("decode after close: %v", err)
	}
	e.Abort() // must not crash
}

func TestTokenizeDetokenizeRoundTrip(t *testing.T) {
	e := openTest(t, models.Tiny(), nil)
	v := e.Vocab()
	for _, s := range testPrompts {
		toks, err := v.Tokenize(s, false, false)
		if err != nil {
			t.Fatal(err)
		}
		back, err := v.Detokenize(toks, false, false)
		if err != nil {
			t.Fatal(err)
		}
		if strings.TrimPrefix(back, " ") != s {
			t.Errorf("round trip %q -> %q", s, back)
		}
		// Incremental detokenization gives the same text and only valid UTF-8.
		var d engine.Detokenizer
		var sb strings.Builder
		for _, tk := range toks {
			p, err := v.Piece(tk, false)
			if err != nil {
				t.Fatal(err)
			}
			sb.WriteString(d.Add(p))
		}
		sb.WriteString(d.Flush())
		// Pieces keep the word-start space of the first token (right for continuations);
		// whole-sequence detokenization drops it.
		if strings.TrimPrefix(sb.String(), " ") != back {
			t.Errorf("incremental %q != whole %q", sb.String(), back)
		}
	}
	toks, _ := v.Tokenize("<|im_start|>user", false, true)
	if toks[0] != models.TokenIMStart {
		t.Errorf("special token not parsed: %v", toks)
	}
	if !v.IsEOG(v.EOS()) || !v.IsEOG(models.TokenIMEnd) || v.IsEOG(100) || v.BOS() != models.TokenBOS || !v.AddBOS() {
		t.Error("BOS/EOS/EOG handling")
	}
	if p, _ := v.Piece(models.TokenIMEnd, false); len(p) != 0 {
		t.Errorf("special piece without special: %q", p)
	}
}

func TestChatTemplate(t *testing.T) {
	e := openTest(t, models.Tiny(), nil)
	msgs := []engine.ChatMessage{{Role: "system", Content: "be brief"}, {Role: "user", Content: "hi"}}
	got, err := e.Vocab().ApplyChatTemplate(msgs, true)
	if err != nil {
		t.Fatal(err)
	}
	want := "<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
	if got != want {
		t.Fatalf("got %q", got)
	}
	if !e.Info().HasChatTemplate || e.Info().ChatTemplate != "model" {
		t.Fatalf("generated model should use its own template, info says %q", e.Info().ChatTemplate)
	}

	// A built-in format chosen by name replaces the model's.
	e = openTest(t, models.Tiny(), func(c *Config) { c.ChatTemplate = "llama3" })
	got, err = e.Vocab().ApplyChatTemplate(msgs, true)
	if err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(got, "<|start_header_id|>user<|end_header_id|>\n\nhi<|eot_id|>") || e.Info().ChatTemplate != "llama3" {
		t.Fatalf("llama3 format: %q (info %q)", got, e.Info().ChatTemplate)
	}

	// A model whose template llama.cpp does not recognise: chat is refused with what
	// to do, and a chosen format serves it.
	spec := models.Tiny()
	spec.Name, spec.ChatTemplate = "shoal-tiny-odd-template", "{{ messages[0]['content'] }} and nothing familiar"
	e = openTest(t, spec, nil)
	if _, err := e.Vocab().ApplyChatTemplate(msgs, true); !errors.Is(err, engine.ErrUnsupported) || !strings.Contains(err.Error(), "--chat-template") {
		t.Fatalf("unsupported template: %v", err)
	}
	e = openTest(t, spec, func(c *Config) { c.ChatTemplate = "chatml" })
	if got, err := e.Vocab().ApplyChatTemplate(msgs, true); err != nil || got != want {
		t.Fatalf("chatml chosen for an unsupported template: %q, %v", got, err)
	}
}

func TestGrammarOnRealVocab(t *testing.T) {
	e := openTest(t, models.Small(), nil)
	if _, err := e.NewGrammar("root ::= (", nil); !errors.Is(err, engine.ErrInvalidInput) {
		t.Fatalf("bad grammar: %v", err)
	}
	gbnf, err := SchemaToGrammar([]byte(`{"type":"object","properties":{"ok":{"type":"boolean"}},"required":["ok"]}`))
	if err != nil {
		t.Fatal(err)
	}
	if _, err := SchemaToGrammar([]byte(`{not json`)); err == nil {
		t.Fatal("bad schema accepted")
	}
	// Integer ranges make grammars many times their schema's size: past the
	// converter's first buffer, the grammar must come back whole.
	var props, names []string
	for i := range 2000 {
		props = append(props, fmt.Sprintf(`"p%d":{"type":"integer","minimum":%d,"maximum":%d}`, i, 13+i, 987654+i*7919))
		names = append(names, fmt.Sprintf(`"p%d"`, i))
	}
	big := []byte(`{"type":"object","properties":{` + strings.Join(props, ",") + `},"required":[` + strings.Join(names, ",") + `]}`)
	long, err := SchemaToGrammar(big)
	if err != nil {
		t.Fatal(err)
	}
	if len(long) < max(1<<20, 4*len(big)) {
		t.Fatalf("a %d-byte schema gave a %d-byte grammar: not past the first buffer", len(big), len(long))
	}
	if gr, err := e.NewGrammar(long, nil); err != nil {
		t.Fatalf("the %d-byte grammar does not parse: %v", len(long), err)
	} else {
		gr.Close()
	}
	for _, g := range []string{`root ::= "yes" | "no"`, gbnf} {
		gr, err := e.NewGrammar(g, nil)
		if err != nil {
			t.Fatal(err)
		}
		s, err := sample.New(sample.Params{Temperature: 1, Seed: 7}, gr)
		if err != nil {
			t.Fatal(err)
		}
		text := constrainedGenerate(t, e, s, 40)
		s.Close()
		t.Logf("grammar output: %q", text)
		if g == gbnf && !strings.Contains(text, `"ok"`) {
			t.Fatalf("schema output %q", text)
		}
		if g != gbnf && text != "yes" && text != "no" {
			t.Fatalf("yes/no output %q", text)
		}
	}
}

func constrainedGenerate(t *testing.T, e *Engine, s engine.Sampler, n int) string {
	t.Helper()
	e.ClearMemory()
	toks := tokenize(t, e, "answer:")
	var b engine.Batch
	for i, tk := range toks {
		b.Add(tk, engine.Pos(i), 0, i == len(toks)-1)
	}
	var out []engine.Token
	for i := range n {
		if err := e.Decode(context.Background(), &b); err != nil {
			t.Fatal(err)
		}
		var x engine.Sampled
		var serr error
		e.Logits(b.Len()-1, func(l []float32) { x, serr = s.Sample(l) })
		if serr != nil {
			t.Fatal(serr)
		}
		if e.Vocab().IsEOG(x.Token) {
			break
		}
		s.Accept(x.Token, true)
		out = append(out, x.Token)
		b.Reset()
		b.Add(x.Token, engine.Pos(len(toks)+i), 0, true)
	}
	text, _ := e.Vocab().Detokenize(out, false, false)
	return text
}

// storiesPath is ../shared/models/stories260K.gguf of the checkout, or $SHOAL_STORIES
// (scripts/gpu-check.sh runs the compiled tests away from a checkout).
var storiesPath = cmp.Or(os.Getenv("SHOAL_STORIES"), "../../../shared/models/stories260K.gguf")

func TestStories260K(t *testing.T) {
	if _, err := os.Stat(storiesPath); err != nil {
		t.Skipf("skipping: %s not present (see ../shared/models/README.md)", storiesPath)
	}
	run := func() string {
		cfg := DefaultConfig(storiesPath)
		cfg.ContextCells, cfg.MaxSeqs, cfg.Threads = 512, 4, 2
		e, err := Open(cfg)
		if err != nil {
			t.Fatal(err)
		}
		defer e.Close()
		if e.Info().HasChatTemplate {
			t.Error("stories260K has no chat template")
		}
		if _, err := e.Vocab().ApplyChatTemplate([]engine.ChatMessage{{Role: "user", Content: "x"}}, true); err != nil {
			t.Errorf("ChatML fallback: %v", err)
		}
		out := decodeGreedy(t, e, [][]engine.Token{tokenize(t, e, "Once upon a time")}, 48, false)[0].tokens
		var d engine.Detokenizer
		var sb strings.Builder
		for _, tk := range out {
			if e.Vocab().IsEOG(tk) {
				break
			}
			p, _ := e.Vocab().Piece(tk, false)
			sb.WriteString(d.Add(p))
		}
		return sb.String() + d.Flush()
	}
	a, b := run(), run()
	t.Logf("Once upon a time%s", a)
	if a != b {
		t.Fatalf("not deterministic:\n%q\n%q", a, b)
	}
	// Reads as English: mostly letters and spaces, and common story words.
	letters := 0
	for _, r := range a {
		if unicode.IsLetter(r) || r == ' ' || r == '.' || r == ',' {
			letters++
		}
	}
	if float64(letters) < 0.9*float64(len([]rune(a))) {
		t.Fatalf("not English-like: %q", a)
	}
	words := 0
	for _, w := range []string{" the ", " a ", " was ", " he ", " she ", " to ", " and "} {
		if strings.Contains(a, w) {
			words++
		}
	}
	if words < 2 {
		t.Fatalf("no common English words in %q", a)
	}
}

func TestPooledEmbeddings(t *testing.T) {
	e := openTest(t, models.Tiny(), func(c *Config) { c.Embeddings, c.Pooling = true, "mean" })
	if !e.Info().Pooling {
		t.Fatal("mean pooling not reported")
	}
	embed := func(text string, s engine.SeqID) []float32 {
		toks := tokenize(t, e, text)
		var b engine.Batch
		for i, tk := range toks {
			b.Add(tk, engine.Pos(i), s, true)
		}
		if err := e.Decode(context.Background(), &b); err != nil {
			t.Fatal(err)
		}
		v, err := e.Embeddings(s)
		if err != nil {
			t.Fatal(err)
		}
		return v
	}
	a, b := embed("the cat sat", 0), embed("the cat sat", 1)
	c := embed("a dog ran far away", 2)
	if len(a) != e.Info().EmbeddingSize {
		t.Fatalf("%d dimensions", len(a))
	}
	same, diff := true, false
	for i := range a {
		same = same && math.Abs(float64(a[i]-b[i])) < 1e-4
		diff = diff || math.Abs(float64(a[i]-c[i])) > 1e-3
	}
	if !same || !diff {
		t.Fatalf("equal texts must embed alike and different ones differently (same %v diff %v)", same, diff)
	}
	if _, err := Open(func() Config { c := DefaultConfig(genModel(t, models.Tiny())); c.Pooling = "max"; return c }()); err == nil {
		t.Fatal("unknown pooling accepted")
	}
}

// TestReranker: a reranker laid out as Qwen3-Reranker's GGUF (rank pooling, a
// yes/no head, a rerank prompt) reports its layout and gives a softmax of two
// scores per sequence, the same whether a pair is computed alone or beside others;
// served without embeddings it reports none (it is a causal model that generates).
func TestReranker(t *testing.T) {
	spec := models.Tiny()
	spec.Name, spec.Reranker = "shoal-tiny-reranker", true // genModel caches by name
	e := openTest(t, spec, func(c *Config) { c.Embeddings = true })
	info := e.Info()
	if info.Pooling || info.Rerank == nil {
		t.Fatalf("pooling %v rerank %+v: want a reranker", info.Pooling, info.Rerank)
	}
	if l := info.Rerank; l.Template != models.RerankTemplate || l.Scores != 2 {
		t.Fatalf("layout %+v", l)
	}
	prompts := [][]engine.Token{
		tokenize(t, e, "<Query>: cats\n<Document>: a cat sat"),
		tokenize(t, e, "<Query>: cats\n<Document>: paris is in france, far away"),
		tokenize(t, e, "<Query>: dogs\n<Document>: a dog ran"),
	}
	score := func(which ...int) map[int][]float32 {
		var b engine.Batch
		for _, s := range which {
			for i, tk := range prompts[s] {
				b.Add(tk, engine.Pos(i), engine.SeqID(s), true)
			}
		}
		if err := e.Decode(context.Background(), &b); err != nil {
			t.Fatal(err)
		}
		out := map[int][]float32{}
		for _, s := range which {
			v, err := e.Embeddings(engine.SeqID(s))
			if err != nil {
				t.Fatal(err)
			}
			out[s] = v
			if err := e.SeqRemove(engine.SeqID(s), 0, -1); err != nil {
				t.Fatal(err)
			}
		}
		return out
	}
	together := score(0, 1, 2)
	for s := range prompts {
		v := together[s]
		if len(v) != 2 || math.Abs(float64(v[0]+v[1])-1) > 1e-4 || v[0] <= 0 || v[0] >= 1 {
			t.Fatalf("pair %d: scores %v, want a softmax of two", s, v)
		}
		if alone := score(s)[s]; math.Abs(float64(alone[0]-v[0])) > 1e-4 {
			t.Fatalf("pair %d: %v alone, %v beside others", s, alone[0], v[0])
		}
	}
	if together[0][0] == together[1][0] {
		t.Fatalf("different pairs scored alike: %v", together)
	}

	g := openTest(t, spec, nil)
	if g.Info().Rerank != nil || g.Info().Pooling {
		t.Fatalf("without embeddings: rerank %+v pooling %v", g.Info().Rerank, g.Info().Pooling)
	}

	// Rank pooling of a model without a classification head would score its
	// hidden state, and llama.cpp ranks a causal model other than Qwen 3's by its
	// first token: both are refused.
	cfg := DefaultConfig(genModel(t, models.Tiny()))
	cfg.ContextCells, cfg.Embeddings, cfg.Pooling = 256, true, "rank"
	if e, err := Open(cfg); !errors.Is(err, engine.ErrUnsupported) || !strings.Contains(err.Error(), "classification head") {
		if err == nil {
			e.Close()
		}
		t.Fatalf("rank pooling without a head: %v", err)
	}
}

// TestMaskCells: the largest pools whose worst-case attention mask (cells × the
// reserved micro-batch, rounded up to a multiple of the sequences, × 4 bytes) stays
// within INT_MAX; the first two are the shapes that aborted on an H200.
func TestMaskCells(t *testing.T) {
	for _, c := range []struct {
		seqs, ubatch int
		unified      bool
		tokens, want int
	}{
		{128, 512, true, 512, 1048320},
		{160, 512, true, 640, 838656}, // 512 tokens rounded up to 4 per sequence
		{1, 512, true, 512, 1048320},
		{4, 2048, true, 2048, 261888},
		{160, 512, false, 640, 160 * 838656}, // split: each stream's cells × all 640 tokens
	} {
		cfg := DefaultConfig("")
		cfg.MaxSeqs, cfg.MicroBatchTokens, cfg.Unified = c.seqs, c.ubatch, c.unified
		got := maskCells(cfg)
		stream := got
		if !c.unified {
			stream = got / c.seqs
		}
		if got != c.want || got%256 != 0 || stream*c.tokens*4 > math.MaxInt32 || (stream+256)*c.tokens*4 <= math.MaxInt32 {
			t.Errorf("%d sequences, %d-token micro-batches, unified %v: %d cells, want %d", c.seqs, c.ubatch, c.unified, got, c.want)
		}
	}
}

// TestAutoSplit: with AutoUnified, a pool sized from GPU memory is split into one
// stream per sequence when each stream gets the trained context (up to 8192 cells).
func TestAutoSplit(t *testing.T) {
	for _, c := range []struct {
		name                 string
		auto, unified        bool
		kvMemory             float64
		seqs, cells, trained int
		want                 bool
	}{
		{"H200 defaults, 100m", true, true, -1, 160, 160 * 8192, 8192, true},
		{"long trained context: 8192 per stream is enough", true, true, 0.8, 16, 16 * 8192, 131072, true},
		{"too little memory per stream", true, true, -1, 160, 160 * 4096, 8192, false},
		{"cells asked for by count", true, true, 0, 160, 160 * 8192, 8192, false},
		{"not auto", false, true, -1, 160, 160 * 8192, 8192, false},
		{"split asked for already", true, false, -1, 160, 160 * 8192, 8192, false},
	} {
		cfg := DefaultConfig("")
		cfg.AutoUnified, cfg.Unified, cfg.KVMemory, cfg.MaxSeqs = c.auto, c.unified, c.kvMemory, c.seqs
		if got := autoSplit(cfg, c.cells, c.trained); got != c.want {
			t.Errorf("%s: split %v, want %v", c.name, got, c.want)
		}
	}
}

func TestDevicesAndKVMemory(t *testing.T) {
	devs := Devices()
	cpu := false
	for _, d := range devs {
		if d.Kind == "cpu" && d.MemoryTotal > 0 {
			cpu = true
		}
		t.Logf("device %s (%s, %s): %.1f of %.1f GiB free", d.Name, d.Description, d.Kind,
			float64(d.MemoryFree)/(1<<30), float64(d.MemoryTotal)/(1<<30))
	}
	if !cpu {
		t.Fatalf("no CPU device with memory in %+v", devs)
	}
	// A byte budget sizes the pool: tiny has 2 layers × 2 KV heads × (16+16) dims × 2
	// bytes = 256 bytes per cell, so 4 MiB is 16,384 cells.
	e := openTest(t, models.Tiny(), func(c *Config) { c.KVMemory = 4 << 20 })
	per, err := e.kvBytesPerCell(DefaultConfig(""))
	if err != nil {
		t.Fatal(err)
	}
	want := int(float64(4<<20)/per) / 256 * 256
	if got := e.Capacity().Cells; got != want || got != 16384 {
		t.Fatalf("4 MiB of KV at %v bytes per cell: %d cells, want %d", per, got, want)
	}
	if got := e.Capacity().CellBytes; got != 256 {
		t.Fatalf("capacity reports %v bytes per cell, want 256", got)
	}
	// Split into streams, each is a whole number of 256 cells (llama.cpp pads a
	// stream up to one), so the pool stays within the bytes: 5 streams of 3,072.
	split := openTest(t, models.Tiny(), func(c *Config) { c.KVMemory, c.Unified, c.MaxSeqs = 4<<20, false, 5 })
	if c := split.Capacity(); c.CellsPerSeq != 3072 || c.Cells != 5*3072 {
		t.Fatalf("4 MiB split among 5 streams: %d cells, %d a stream; want 5 × 3072", c.Cells, c.CellsPerSeq)
	}
	wantLayers := 0
	if len(gpus(devs)) > 0 {
		wantLayers = e.Info().Layers // everything offloaded by default
	}
	if len(e.Info().Devices) == 0 || e.Info().GPULayers != wantLayers {
		t.Fatalf("info devices %+v, GPU layers %d, want %d", e.Info().Devices, e.Info().GPULayers, wantLayers)
	}
	// However much memory there is, the pool stays under llama.cpp's 2 GiB attention
	// mask: 1 GiB of tiny's KV is 4Mi cells and 256 sequences of 4096 tokens are 1Mi,
	// one block more than 512-token micro-batches allow (the H200's abort at start).
	big := DefaultConfig("")
	big.KVMemory, big.MaxSeqs = 1<<30, 256
	if got, err := e.kvCells(big, false); err != nil || got != maskCells(big) || got*512*4 > math.MaxInt32 {
		t.Fatalf("1 GiB of KV for 256 sequences: %d cells (%v), want %d", got, err, maskCells(big))
	}
	// Asked for by count, such a pool is a clear error.
	big.KVMemory, big.ContextCells = 0, 1<<20
	if _, err := e.kvCells(big, false); err == nil || !strings.Contains(err.Error(), "attention mask") {
		t.Fatalf("a context of 1Mi cells with 512-token micro-batches: %v, want the mask limit", err)
	}
	// Too little memory for the sequences is an error at open, not a crash.
	// small: 4 layers × 4 KV heads × (32+32) × 2 bytes = 2 KiB per cell.
	cfg := DefaultConfig(genModel(t, models.Small()))
	cfg.KVMemory, cfg.MaxSeqs, cfg.Threads = 1<<20, 256, 1
	if e, err := Open(cfg); err == nil {
		e.Close()
		t.Fatal("1 MiB of KV for 256 sequences should be refused")
	} else {
		t.Log(err)
	}
}

// TestRejectedBatchKeepsMemory: a batch llama.cpp refuses before running it (here,
// positions that do not follow the sequence's) leaves the sequence's cells alone;
// other calls that llama.cpp would abort the process on are refused or mapped.
func TestRejectedBatchKeepsMemory(t *testing.T) {
	e := openTest(t, models.Tiny(), nil)
	ctx := context.Background()
	var b engine.Batch
	for i := range 20 {
		b.Add(engine.Token(10+i), engine.Pos(i), 0, i == 19)
	}
	if err := e.Decode(ctx, &b); err != nil {
		t.Fatal(err)
	}
	b.Reset()
	b.Add(10, 10, 0, true) // position 10 again: not 20
	if err := e.Decode(ctx, &b); !errors.Is(err, engine.ErrInvalidInput) {
		t.Fatalf("decode at a used position: %v", err)
	}
	if lo, hi, ok := e.SeqPosRange(0); !ok || lo != 0 || hi != 19 {
		t.Fatalf("after a rejected batch sequence 0 holds [%d, %d] (%v), want [0, 19]", lo, hi, ok)
	}
	if err := e.SeqRemove(-2, 0, -1); err != nil { // any negative id means all
		t.Fatal(err)
	}
	if _, _, ok := e.SeqPosRange(0); ok {
		t.Fatal("SeqRemove(-2) left sequence 0")
	}
	// An end of generation before the grammar is complete is refused, not fatal.
	g, err := e.NewGrammar(`root ::= "ab"`, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer g.Close()
	g.Accept(e.Vocab().EOS())
	if gr := g.(*Grammar); gr.err == nil {
		t.Fatal("an early end of generation was accepted")
	}
}

// TestEmbeddingsNeedPooling: an embedding engine whose model pools nothing is
// refused at open (llama.cpp would hand back no vector, or a reranker's scores).
func TestEmbeddingsNeedPooling(t *testing.T) {
	cfg := DefaultConfig(genModel(t, models.Tiny()))
	cfg.ContextCells, cfg.Embeddings = 256, true
	if e, err := Open(cfg); !errors.Is(err, engine.ErrUnsupported) {
		if err == nil {
			e.Close()
		}
		t.Fatalf("embeddings from a model without pooling: %v", err)
	}
}

// TestQuietedLines: llama.cpp lines that do not concern shoal go to debug: the
// warning that a unified pool exceeds the trained context (the scheduler caps
// each sequence), quantization's per-tensor fallbacks (its count stays), and
// the errors of a pass shoal aborted itself (those of a failed pass stay).
func TestQuietedLines(t *testing.T) {
	for _, c := range []struct {
		quiet func(string) bool
		name  string
		lines map[string]bool
	}{
		{moot, "moot", map[string]bool{
			"llama_context: n_ctx_seq (8192) > n_ctx_train (4096) -- possible training context overflow":                                 true,
			"llama_context: n_ctx_seq (2048) < n_ctx_train (4096) -- the full capacity of the model will not be utilized":                false,
			"load: control token 3 is not marked as EOG":                                                                                 false,
			"llama_tensor_get_type : tensor cols 48 x 64 are not divisible by 256, required for q4_K - using fallback quantization q5_0": true,
			"llama_model_quantize_impl: WARNING: 7 of 43 tensor(s) required fallback quantization":                                       false,
		}},
		{aborted, "aborted", map[string]bool{
			"process_ubatch: failed to compute graph, compute status: 1":                 true,
			"graph_compute: ggml_backend_sched_graph_compute_async failed with error 1":  true,
			"llama_decode: failed to decode, ret = 2":                                    true,
			"process_ubatch: failed to compute graph, compute status: -2":                false,
			"graph_compute: ggml_backend_sched_graph_compute_async failed with error -1": false,
			"llama_decode: failed to decode, ret = -3":                                   false,
		}},
	} {
		for line, want := range c.lines {
			if c.quiet(line) != want {
				t.Errorf("%s(%q) = %v, want %v", c.name, line, !want, want)
			}
		}
	}
}

// TestAbortedPassQuiet: the cells an aborted pass removes are not warned
// about, those of a failed pass are.
func TestAbortedPassQuiet(t *testing.T) {
	const removing = "decode: removing memory module entries for seq_id = 0, pos = [599, +inf)"
	var rollingBack bool
	for i, c := range []struct {
		line   string
		lv, at slog.Level
	}{
		{"process_ubatch: failed to compute graph, compute status: 1", slog.LevelError, slog.LevelDebug},
		{removing, slog.LevelWarn, slog.LevelDebug},
		{removing, slog.LevelWarn, slog.LevelDebug},
		{"llama_decode: failed to decode, ret = 2", slog.LevelError, slog.LevelDebug},
		{removing, slog.LevelWarn, slog.LevelWarn}, // another pass's
		{"process_ubatch: failed to compute graph, compute status: -3", slog.LevelError, slog.LevelError},
		{removing, slog.LevelWarn, slog.LevelWarn},
	} {
		if got := quieted(c.line, c.lv, &rollingBack); got != c.at {
			t.Errorf("line %d, %q: logged at %v, want %v", i, c.line, got, c.at)
		}
	}
}

// pieceIDs maps each token's text to the first token with that text.
func pieceIDs(v engine.Vocab) map[string]engine.Token {
	ids := map[string]engine.Token{}
	for i := range v.Size() {
		if p, err := v.Piece(engine.Token(i), true); err == nil {
			if _, ok := ids[string(p)]; !ok {
				ids[string(p)] = engine.Token(i)
			}
		}
	}
	return ids
}

// TestLazyGrammar: a lazy grammar lets anything through until its trigger
// appears, then constrains the output from the trigger's first byte, also when
// the trigger begins inside a token.
func TestLazyGrammar(t *testing.T) {
	e := openTest(t, models.Small(), nil)
	v := e.Vocab()
	ids := pieceIDs(v)
	token := func(piece string) engine.Token { // the token whose text is piece
		id, ok := ids[piece]
		if !ok {
			panic(fmt.Sprintf("no token reads %q", piece))
		}
		return id
	}
	allowed := func(g engine.Grammar, piece string) bool {
		c := []engine.TokenLogit{{Token: token(piece)}}
		g.Apply(c)
		return !math.IsInf(float64(c[0].Logit), -1)
	}
	accept := func(g engine.Grammar, pieces ...string) {
		for _, p := range pieces {
			g.Accept(token(p))
		}
	}
	const gbnf = `root ::= "ab" "c"+ "d"`
	for name, trigger := range map[string][]string{
		"aligned":        {" th", "ab"},
		"inside a token": {" th", " ab"}, // the grammar starts at "ab", after " "
		"across tokens":  {" th", " a", "b"},
	} {
		t.Run(name, func(t *testing.T) {
			g, err := e.NewGrammar(gbnf, []engine.Trigger{{Text: "ab"}, {Text: "zz"}})
			if err != nil {
				t.Fatal(err)
			}
			defer g.Close()
			accept(g, " he")
			if !allowed(g, "x") || !allowed(g, "q") {
				t.Fatal("a lazy grammar constrained the output before its trigger")
			}
			if g.Accept(v.EOS()); g.(*lazyGrammar).err != nil {
				t.Fatal("end of generation refused before the trigger")
			}
			accept(g, trigger...)
			if allowed(g, "x") || !allowed(g, "c") {
				t.Fatal("after its trigger the grammar does not constrain the output")
			}
			accept(g, "c", "c")
			if !allowed(g, "d") || allowed(g, "a") {
				t.Fatal("the grammar lost its place")
			}
		})
	}
	if _, err := e.NewGrammar(gbnf, []engine.Trigger{{}}); !errors.Is(err, engine.ErrInvalidInput) {
		t.Fatalf("an empty trigger: %v", err)
	}
	// A trigger at the start fires only before any text but whitespace.
	for pieces, fires := range map[string]bool{" |ab": true, "ab": true, "x|ab": false, " | a|b": true, " x|ab": false} {
		g, err := e.NewGrammar(gbnf, []engine.Trigger{{Text: "ab", AtStart: true}})
		if err != nil {
			t.Fatal(err)
		}
		accept(g, strings.Split(pieces, "|")...)
		if got := !allowed(g, "x"); got != fires {
			t.Errorf("%q: fired %v, want %v", pieces, got, fires)
		}
		g.Close()
	}
}

// TestUntilGrammar: llama.cpp reads the "any text up to a closing tag" rules
// that api/xmlcalls.go's untilRules writes (here for the tag "\n</p>") as
// meant: the tag may appear in the text only without its newline, and once
// written in full it ends the text.
func TestUntilGrammar(t *testing.T) {
	e := openTest(t, models.Small(), nil)
	v := e.Vocab()
	ids := pieceIDs(v)
	const gbnf = `root ::= "<" t "\x0A</p>" "!"
t ::= t-0
t-0 ::= | [^\n] t-0 | "\x0A" t-1
t-1 ::= | "\x0A" t-1 | [^<\n] t-0 | "<" t-2
t-2 ::= | "\x0A" t-1 | [^/\n] t-0 | "/" t-3
t-3 ::= | "\x0A" t-1 | [^p\n] t-0 | "p" t-4
t-4 ::= | "\x0A" t-1 | [^>\n] t-0
`
	g, err := e.NewGrammar(gbnf, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer g.Close()
	allowed := func(piece string) bool {
		c := []engine.TokenLogit{{Token: ids[piece]}}
		g.Apply(c)
		return !math.IsInf(float64(c[0].Logit), -1)
	}
	for _, c := range strings.Split("<|a|b|\n|\n|<|/|x|<|/|p|>|\n|<|/|p", "|") {
		if !allowed(c) {
			t.Fatalf("%q refused", c)
		}
		g.Accept(ids[c])
	}
	if !allowed(">") || !allowed("a") { // the tag, or text that only began like it
		t.Fatal("after \"\\n</p\" both the tag's end and more text must be allowed")
	}
	g.Accept(ids[">"])
	if !allowed("!") || allowed("a") {
		t.Fatal("once written in full, the tag ends the text: only what follows it is allowed")
	}
}

// TestLoRA: an adapter changes the model's outputs at scale 1, leaves them as
// they are at scale 0, and one for another model's shapes, or no adapter at
// all, is an error at open.
func TestLoRA(t *testing.T) {
	spec := models.Small()
	adapter := genLoRA(t, spec, 8)
	base := openTest(t, spec, nil)
	prompts := [][]engine.Token{tokenize(t, base, testPrompts[0]), tokenize(t, base, testPrompts[1])}
	want := decodeGreedy(t, base, prompts, 8, false)
	withScale := func(scale float32) []greedyRun {
		e := openTest(t, spec, func(c *Config) { c.LoRA = []LoRA{{Path: adapter, Scale: scale}} })
		return decodeGreedy(t, e, prompts, 8, false)
	}
	off, on := withScale(0), withScale(1)
	for i := range prompts {
		if d := maxAbsDiff(off[i].logits[0], want[i].logits[0]); d > 1e-3 {
			t.Errorf("prompt %d: at scale 0 the logits differ from the model's by %g", i, d)
		}
		if d := maxAbsDiff(on[i].logits[0], want[i].logits[0]); d < 0.1 {
			t.Errorf("prompt %d: at scale 1 the logits differ from the model's by only %g", i, d)
		}
	}
	if slices.Equal(on[0].tokens, want[0].tokens) && slices.Equal(on[1].tokens, want[1].tokens) {
		t.Errorf("the adapter changed no greedy choice: %v", on[0].tokens)
	}

	other := genLoRA(t, models.Tiny(), 4)
	junk := filepath.Join(t.TempDir(), "junk.gguf")
	if err := os.WriteFile(junk, []byte("GGUF\x03\x00\x00\x00\xff\xff\xff\xff\xff\xff\xff\x7f"), 0o644); err != nil {
		t.Fatal(err)
	}
	for path, want := range map[string]string{junk: "LoRA adapter", other: "shape", filepath.Join(t.TempDir(), "none.gguf"): "none.gguf", genModel(t, models.Tiny()): "adapter"} {
		cfg := DefaultConfig(genModel(t, spec))
		cfg.ContextCells, cfg.MaxSeqs = 256, 2
		cfg.LoRA = []LoRA{{Path: path, Scale: 1}}
		if e, err := Open(cfg); err == nil {
			e.Close()
			t.Errorf("%s: opened", path)
		} else if !strings.Contains(err.Error(), want) {
			t.Errorf("%s: %v, want it to say %q", path, err, want)
		}
	}
}

// TestSelectedAdapters: batches that select an adapter, interleaved with
// batches that do not, compute what an engine with the adapter always
// applied, and one without, compute.
func TestSelectedAdapters(t *testing.T) {
	spec := models.Small()
	adapter := genLoRA(t, spec, 8)
	base := openTest(t, spec, nil)
	static := openTest(t, spec, func(c *Config) { c.LoRA = []LoRA{{Path: adapter, Scale: 1}} })
	prompts := [][]engine.Token{tokenize(t, base, testPrompts[0]), tokenize(t, base, testPrompts[3])}
	plain := decodeGreedy(t, base, prompts, 6, false)
	wantBase := plain[1]
	wantLoRA := decodeGreedy(t, static, prompts[:1], 6, false)[0]

	e := openTest(t, spec, func(c *Config) { c.Adapters = []LoRA{{Path: adapter, Scale: 1}} })
	ctx := context.Background()
	got := make([][]engine.Token, 2)
	for step := range 7 {
		for s, adapterOf := range []int{1, 0} { // seq 0 under the adapter, seq 1 under none
			b := engine.Batch{Adapter: adapterOf}
			if step == 0 {
				for i, tk := range prompts[s] {
					b.Add(tk, engine.Pos(i), engine.SeqID(s), i == len(prompts[s])-1)
				}
			} else {
				b.Add(got[s][step-1], engine.Pos(len(prompts[s])+step-1), engine.SeqID(s), true)
			}
			if err := e.Decode(ctx, &b); err != nil {
				t.Fatal(err)
			}
			var l []float32
			if err := e.Logits(b.Len()-1, func(x []float32) { l = slices.Clone(x) }); err != nil {
				t.Fatal(err)
			}
			got[s] = append(got[s], engine.Token(argmax(l)))
		}
	}
	if !slices.Equal(got[0][:6], wantLoRA.tokens) || !slices.Equal(got[1][:6], wantBase.tokens) {
		t.Errorf("interleaved: %v and %v; want %v (adapter) and %v (none)", got[0][:6], got[1][:6], wantLoRA.tokens, wantBase.tokens)
	}
	if slices.Equal(wantLoRA.tokens, plain[0].tokens) {
		t.Errorf("the adapter changes nothing on this prompt: the test shows nothing")
	}
	bad := engine.Batch{Adapter: 2}
	bad.Add(prompts[0][0], 0, 5, true)
	if err := e.Decode(ctx, &bad); !errors.Is(err, engine.ErrInvalidInput) {
		t.Errorf("adapter 2 of 1: %v", err)
	}
}
