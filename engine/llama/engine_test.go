package llama

import (
	"cmp"
	"context"
	"errors"
	"log/slog"
	"math"
	"os"
	"path/filepath"
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

func openTest(t testing.TB, spec models.Spec, mod func(*Config)) *Engine {
	t.Helper()
	cfg := DefaultConfig(genModel(t, spec))
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

func greedy(t testing.TB, e *Engine, row int) engine.Token {
	t.Helper()
	var tok engine.Token
	if err := e.Logits(row, func(l []float32) {
		for i, x := range l {
			if x > l[tok] {
				tok = engine.Token(i)
			}
		}
	}); err != nil {
		t.Fatal(err)
	}
	return tok
}

// decodeGreedy generates n tokens for each prompt, all sequences sharing every batch.
func decodeGreedy(t testing.TB, e *Engine, prompts [][]engine.Token, n int) [][]engine.Token {
	t.Helper()
	ctx := context.Background()
	var b engine.Batch
	out := make([][]engine.Token, len(prompts))
	rows := make([]int, len(prompts))
	for s, p := range prompts {
		for i, tk := range p {
			if i == len(p)-1 {
				rows[s] = b.Len()
			}
			b.Add(tk, engine.Pos(i), engine.SeqID(s), i == len(p)-1)
		}
	}
	for step := range n {
		if err := e.Decode(ctx, &b); err != nil {
			t.Fatalf("step %d: %v", step, err)
		}
		next := make([]engine.Token, len(prompts))
		for s := range prompts {
			next[s] = greedy(t, e, rows[s])
			out[s] = append(out[s], next[s])
		}
		b.Reset()
		for s, p := range prompts {
			rows[s] = b.Len()
			b.Add(next[s], engine.Pos(len(p)+step), engine.SeqID(s), true)
		}
	}
	return out
}

func TestBatchedGreedyEqualsSequential(t *testing.T) {
	e := openTest(t, models.Small(), nil)
	var prompts [][]engine.Token
	for _, p := range testPrompts {
		prompts = append(prompts, tokenize(t, e, p))
	}
	const n = 24
	batched := decodeGreedy(t, e, prompts, n)
	for s, p := range prompts {
		if err := e.ClearMemory(); err != nil {
			t.Fatal(err)
		}
		alone := decodeGreedy(t, e, [][]engine.Token{p}, n)[0]
		for i := range alone {
			if alone[i] != batched[s][i] {
				t.Fatalf("prompt %d token %d: batched %v, alone %v", s, i, batched[s], alone)
			}
		}
	}
}

func TestSharedPrefixEqualsRecomputed(t *testing.T) {
	e := openTest(t, models.Small(), nil)
	toks := tokenize(t, e, strings.Repeat("The cat sat on the mat and looked at the dog. ", 8))
	if len(toks) < 70 {
		t.Fatalf("prompt too short: %d", len(toks))
	}
	ctx := context.Background()
	for _, k := range []int{1, 2, 4} {
		shared := k * 16
		if err := e.ClearMemory(); err != nil {
			t.Fatal(err)
		}
		// Sequence 0 computes the whole prompt; sequence 1 borrows its first k blocks and
		// computes the rest; sequence 2 computes everything itself.
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
		var a []float32
		e.Logits(rowShared, func(l []float32) { a = append(a, l...) })
		var maxDiff float64
		e.Logits(rowOwn, func(l []float32) {
			for i := range l {
				maxDiff = max(maxDiff, math.Abs(float64(l[i]-a[i])))
			}
		})
		if maxDiff > 1e-3 {
			t.Fatalf("k=%d: logits differ by %g", k, maxDiff)
		}
		t.Logf("k=%d (%d shared tokens): max |diff| %.2g", k, shared, maxDiff)
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
	cases := map[string]string{
		"missing":   filepath.Join(dir, "nope.gguf"),
		"directory": dir,
		"truncated": write("trunc.gguf", data[:len(data)/2]),
		"corrupt":   write("corrupt.gguf", corrupt),
		"not gguf":  write("text.gguf", []byte("hello, this is not a model")),
		"empty":     write("empty.gguf", nil),
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
		func(c *Config) { c.KVType = "f32" },
		func(c *Config) { c.FlashAttention = "maybe" },
		func(c *Config) { c.MaxSeqs = 257 },
		func(c *Config) { c.MaxSeqs = 0 },
		func(c *Config) { c.MicroBatchTokens = c.BatchTokens * 2 },
		func(c *Config) { c.Unified = false; c.ContextCells = 64; c.MaxSeqs = 8 },
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
	for _, kv := range []string{"f16", "q8_0", "q4_0"} {
		cfg := DefaultConfig(p)
		cfg.KVType, cfg.FlashAttention, cfg.ContextCells = kv, FlashOn, 256
		e, err := Open(cfg)
		if err != nil {
			t.Fatalf("kv %s: %v", kv, err)
		}
		e.Close()
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
	if !e.Info().HasChatTemplate {
		t.Fatal("generated model should have a template")
	}
}

func TestGrammarOnRealVocab(t *testing.T) {
	e := openTest(t, models.Small(), nil)
	if _, err := e.NewGrammar("root ::= ("); !errors.Is(err, engine.ErrInvalidInput) {
		t.Fatalf("bad grammar: %v", err)
	}
	gbnf, err := SchemaToGrammar([]byte(`{"type":"object","properties":{"ok":{"type":"boolean"}},"required":["ok"]}`))
	if err != nil {
		t.Fatal(err)
	}
	if _, err := SchemaToGrammar([]byte(`{not json`)); err == nil {
		t.Fatal("bad schema accepted")
	}
	for _, g := range []string{`root ::= "yes" | "no"`, gbnf} {
		gr, err := e.NewGrammar(g)
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
		out := decodeGreedy(t, e, [][]engine.Token{tokenize(t, e, "Once upon a time")}, 48)[0]
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
	per, err := e.kvBytesPerCell("f16")
	if err != nil {
		t.Fatal(err)
	}
	want := int(float64(4<<20)/per) / 256 * 256
	if got := e.Capacity().Cells; got != want || got != 16384 {
		t.Fatalf("4 MiB of KV at %v bytes per cell: %d cells, want %d", per, got, want)
	}
	wantLayers := 0
	if len(gpus(devs)) > 0 {
		wantLayers = e.Info().Layers // everything offloaded by default
	}
	if len(e.Info().Devices) == 0 || e.Info().GPULayers != wantLayers {
		t.Fatalf("info devices %+v, GPU layers %d, want %d", e.Info().Devices, e.Info().GPULayers, wantLayers)
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
