package llama

import (
	"fmt"
	"math/rand/v2"
	"os"
	"slices"
	"strings"
	"testing"

	"github.com/shoal-ai/shoal/models"
)

// cutEverywhere makes Tokenize cut every text after every special token it
// can, for the test's duration.
func cutEverywhere(t *testing.T) {
	minBytes, every := cutMinBytes, cutEvery
	cutMinBytes, cutEvery = 0, 1
	t.Cleanup(func() { cutMinBytes, cutEvery = minBytes, every })
}

// tokenizeInPieces checks, for n random texts made of pieces, that Tokenize
// (cut wherever it may be) gives the tokens of one llama.cpp call on the whole
// text, with and without special tokens parsed and added; it returns how many
// cuts were made.
func tokenizeInPieces(t *testing.T, v *Vocab, pieces []string, n int, seed uint64) int {
	t.Helper()
	r := rand.New(rand.NewPCG(seed, 7))
	total := 0
	for i := range n {
		var b strings.Builder
		for range 1 + r.IntN(120) {
			b.WriteString(pieces[r.IntN(len(pieces))])
		}
		text := b.String()
		for _, parse := range []bool{true, false} {
			if sp := v.cutter(parse); sp != nil {
				total += len(sp.cuts(text))
			}
			for _, add := range []bool{true, false} {
				got, err1 := v.Tokenize(text, add, parse)
				want, err2 := v.tokenize(text, add, parse)
				if err1 != nil || err2 != nil || !slices.Equal(got, want) {
					t.Fatalf("text %d %q (parse %v, add %v):\ncut   %v (%v)\nwhole %v (%v)", i, text, parse, add, got, err1, want, err2)
				}
			}
		}
	}
	return total
}

// TestTokenizeInPieces: a text cut where Tokenize cuts it tokenizes as the
// whole, on a vocabulary whose special tokens overlap and nest ("<|a|>" in
// "<|a|><|b|>", "@q" in "q@q"), begin or end with spaces, or are only
// whitespace, in texts that mix them with words, parts of them and runs of
// whitespace.
func TestTokenizeInPieces(t *testing.T) {
	cutEverywhere(t)
	spec := models.Tiny()
	spec.Name = "shoal-cuts"
	spec.ControlTokens = []string{"<|a|>", "<|a|><|b|>", "<|b|>", "|>", "<|", "\n\n", " sp", "@q", "q@q", "x y", "<|im_start|>assistant", "]]", "[[x]]"}
	v := openTest(t, spec, nil).Vocab().(*Vocab)
	pieces := append(slices.Clone(spec.ControlTokens), "<|im_start|>", "<|im_end|>", "<s>", "</s>", "<unk>", "<|im_st", "art|>",
		" ", "  ", "\n", "\t", "a", "q", "@", "x", "y", "[", "]", "hello", " world", "é", "日本", "<", "|", ">", "user\n", "assistant")
	if cuts := tokenizeInPieces(t, v, pieces, 3000, 1); cuts < 1000 {
		t.Fatalf("only %d cuts in 3000 texts: the pieces path was hardly used", cuts)
	}
	// A chat of many turns is cut between them, and each cut piece holds at most
	// cutEvery special tokens.
	cutMinBytes, cutEvery = 1024, 64
	var chat strings.Builder
	for i := range 2000 {
		chat.WriteString("<|im_start|>user\nhi " + strings.Repeat("x", i%7) + "<|im_end|>\n<|im_start|>assistant\nhello<|im_end|>\n")
	}
	got, err := v.Tokenize(chat.String(), true, true)
	want, _ := v.tokenize(chat.String(), true, true)
	if err != nil || !slices.Equal(got, want) {
		t.Fatalf("a long chat: %d tokens cut, %d whole (%v)", len(got), len(want), err)
	}
	if cuts := v.cutter(true).cuts(chat.String()); len(cuts) < 8000/64-2 {
		t.Fatalf("%d cuts in a chat of 8000 special tokens, one per %d wanted", len(cuts), cutEvery)
	}
}

// TestTokenizeInPiecesStripping: the same where llama.cpp's special tokens
// strip whitespace: <mask> before it (the attribute llama.cpp gives it under
// Jina's tokenizer), beside tokens that end or begin with a space; and every
// control token after it, as llama.cpp marks Phi-3's, which are cut before.
func TestTokenizeInPiecesStripping(t *testing.T) {
	cutEverywhere(t)
	for _, c := range []struct {
		name    string
		meta    map[string]any
		control []string
		texts   []string
	}{
		{"shoal-strip", map[string]any{"tokenizer.ggml.pre": "jina-v2-de"}, []string{"<mask>", "x ", " y", "<|a|>"}, []string{"ax <mask>b", "ax   <mask>b", "a y", "<|a|> <mask>"}},
		{"phi3-shoal", nil, []string{"<|user|>", "<|end|>", "<|assistant|>", "<|endoftext|>"}, []string{"<|user|>\n hi<|end|>\n<|assistant|>"}},
	} {
		t.Run(c.name, func(t *testing.T) {
			spec := models.Tiny()
			spec.Name, spec.Meta, spec.ControlTokens = c.name, c.meta, c.control
			v := openTest(t, spec, nil).Vocab().(*Vocab)
			for _, text := range c.texts {
				got, _ := v.Tokenize(text, false, true)
				want, _ := v.tokenize(text, false, true)
				if !slices.Equal(got, want) {
					t.Fatalf("%q cut at %v: %v, whole %v", text, v.cutter(true).cuts(text), got, want)
				}
			}
			pieces := append(slices.Clone(c.control), "<|im_start|>", "<|im_end|>", " ", "  ", "\n", "\t", "a", "x", "y", "hello")
			if cuts := tokenizeInPieces(t, v, pieces, 1000, 3); cuts < 300 {
				t.Fatalf("only %d cuts in 1000 texts", cuts)
			}
		})
	}
}

// TestTokenizeInPiecesStories: the same on stories260K's SentencePiece
// vocabulary (<s>, </s>, <unk>).
func TestTokenizeInPiecesStories(t *testing.T) {
	if _, err := os.Stat(storiesPath); err != nil {
		t.Skipf("skipping: %s not present (see ../shared/models/README.md)", storiesPath)
	}
	cutEverywhere(t)
	e := openFile(t, storiesPath, func(c *Config) { c.ContextCells, c.MaxSeqs = 512, 4 })
	pieces := []string{"<s>", "</s>", "<unk>", "<s", "s>", " ", "  ", "\n", "Once", " upon", " a time", "Lily", ".", "é", "<", ">"}
	if cuts := tokenizeInPieces(t, e.Vocab().(*Vocab), pieces, 1000, 2); cuts < 300 {
		t.Fatalf("only %d cuts in 1000 texts", cuts)
	}
}

// BenchmarkTokenizeChat: a chat of many short turns (ChatML: two special
// tokens each), tokenized by one llama.cpp call and by Tokenize, which cuts
// it (make bench-tokenize).
func BenchmarkTokenizeChat(b *testing.B) {
	v := openTest(b, models.Tiny(), nil).Vocab().(*Vocab)
	for _, turns := range []int{1000, 5000, 20000} {
		var chat strings.Builder
		for i := range turns {
			chat.WriteString("<|im_start|>user\nhi " + strings.Repeat("x", i%7) + "<|im_end|>\n")
		}
		text := chat.String()
		for _, way := range []string{"whole", "cut"} {
			b.Run(fmt.Sprintf("turns=%d/%s", turns, way), func(b *testing.B) {
				b.SetBytes(int64(len(text)))
				for b.Loop() {
					var err error
					if way == "whole" {
						_, err = v.tokenize(text, true, true)
					} else {
						_, err = v.Tokenize(text, true, true)
					}
					if err != nil {
						b.Fatal(err)
					}
				}
			})
		}
	}
}
