package llama

import (
	"bytes"
	"encoding/json"
	"fmt"
	"math"
	"math/rand/v2"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
	"time"
	"unicode/utf8"

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
		_, _ = checkGGUFReader(bytes.NewReader(b), int64(len(b)))
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

// grammarTakes reports whether grammar g (GBNF) takes s whole: each of s's
// tokens in turn, then the end of generation.
func grammarTakes(t testing.TB, e *Engine, g, s string) bool {
	t.Helper()
	gr, err := e.NewGrammar(g, nil)
	if err != nil {
		t.Fatalf("the grammar does not parse: %v\n%s", err, g)
	}
	defer gr.Close()
	for _, tok := range append(pieceTokens(t, e, s), e.vocab.EOS()) {
		c := []engine.TokenLogit{{Token: tok}}
		gr.Apply(c)
		if math.IsInf(float64(c[0].Logit), -1) {
			return false
		}
		gr.Accept(tok)
	}
	return true
}

// pieceTokens splits s into the model's tokens by their pieces, longest
// first (the tokenizer would add SentencePiece's space in front).
func pieceTokens(t testing.TB, e *Engine, s string) []engine.Token {
	byPiece := map[string]engine.Token{}
	longest := 0
	for tok := range e.vocab.Size() {
		p, err := e.vocab.Piece(engine.Token(tok), false)
		if err != nil {
			t.Fatal(err)
		}
		if _, ok := byPiece[string(p)]; !ok && len(p) > 0 && !e.vocab.IsEOG(engine.Token(tok)) {
			byPiece[string(p)] = engine.Token(tok)
			longest = max(longest, len(p))
		}
	}
	var toks []engine.Token
	for i := 0; i < len(s); {
		n := min(longest, len(s)-i)
		for ; n > 0; n-- {
			if tok, ok := byPiece[s[i:i+n]]; ok {
				toks = append(toks, tok)
				break
			}
		}
		if n == 0 {
			t.Fatalf("no token for byte %q of %q", s[i], s)
		}
		i += n
	}
	return toks
}

// regexCases are regular expressions with strings each matches whole or not.
var regexCases = []struct {
	re          string
	match, miss []string
}{
	{`^\d{3}-\d{4}$`, []string{"555-1234"}, []string{"5551234", "555-12345", "55-1234", ""}},
	{`(yes|no)`, []string{"yes", "no"}, []string{"yesno", "y", "maybe"}},
	{`(?i)hello [a-z]+!?`, []string{"HeLLo world", "hello x!"}, []string{"hello", "hello World1"}},
	{`(a|b?)*c`, []string{"c", "abbac", "bc"}, []string{"ab", "cc"}},
	{`(a?b?)*`, []string{"", "ab", "ba", "aabb"}, []string{"abc"}},
	{`"[^"\n]*"`, []string{`"quoted"`, `""`}, []string{`"a"b"`, "\"a\nb\""}},
	{`.+`, []string{"any thing", "é"}, []string{"", "a\nb"}},
	{`(?s).{2,3}`, []string{"a\nb", "ab"}, []string{"a", "abcd"}},
	{`\w+@\w+\.com`, []string{"me@example.com"}, []string{"me@example.org", "@example.com"}},
	{`[^a-z]{1,2}`, []string{"A", "Z9"}, []string{"a", "ABC"}},
	{`\p{Greek}+ \d`, []string{"αβγ 1"}, []string{"abc 1"}},
	{`x*?y{2,}z{0,3}`, []string{"yy", "xxyyyzzz"}, []string{"xy", "yyzzzz"}},
}

// TestRegexGrammarMatches checks on llama.cpp's grammar sampler that a
// regex's grammar takes what the regex matches whole, and nothing else.
func TestRegexGrammarMatches(t *testing.T) {
	e := openTest(t, models.Tiny(), nil)
	for _, c := range regexCases {
		g, err := engine.RegexGrammar(c.re)
		if err != nil {
			t.Fatalf("%s: %v", c.re, err)
		}
		for _, s := range c.match {
			if !grammarTakes(t, e, g, s) {
				t.Errorf("%s: %q is not taken\n%s", c.re, s, g)
			}
		}
		for _, s := range c.miss {
			if grammarTakes(t, e, g, s) {
				t.Errorf("%s: %q is taken\n%s", c.re, s, g)
			}
		}
	}
}

// FuzzRegexMatches: a regex's grammar, run by llama.cpp, takes a string if
// and only if Go's regexp matches it whole.
func FuzzRegexMatches(f *testing.F) {
	e := openTest(f, models.Tiny(), nil)
	for _, c := range regexCases {
		for _, s := range append(c.match, c.miss...) {
			f.Add(c.re, s)
		}
	}
	f.Fuzz(func(t *testing.T, re, s string) {
		if !utf8.ValidString(s) || strings.IndexByte(s, 0) >= 0 || len(s) > 64 {
			return
		}
		g, err := engine.RegexGrammar(re)
		if err != nil {
			return
		}
		want := regexp.MustCompile(`^(?:` + re + `)$`).MatchString(s)
		if got := grammarTakes(t, e, g, s); got != want {
			t.Fatalf("%q on %q: grammar takes it %v, regexp matches %v\n%s", re, s, got, want, g)
		}
	})
}

// FuzzGBNF: a grammar ParseGBNF takes, llama.cpp parses, and what it takes
// reads back to itself; none crashes the process.
func FuzzGBNF(f *testing.F) {
	e := openTest(f, models.Tiny(), nil)
	for _, s := range []string{
		"root ::= \"a\" | [b-c]+ x\nx ::= (\"d\" x?)*",
		"root ::= x{2,3}\nx ::= <[1]> .",
		"root ::= \"\\u00e9\" # c\n",
		"root ::= (\"a\" | \"\")* \"b\"",
		"root ::= x\nx ::= \"a\" x | \"\"",
		"root ::= [^\"\\\\]{0,20} \"!\"",
	} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, s string) {
		g, err := engine.ParseGBNF(s, e.vocab)
		if err != nil {
			return
		}
		if err := e.vocab.CheckGrammar(g); err != nil {
			t.Fatalf("%q: ParseGBNF takes it, llama.cpp does not: %v\n%s", s, err, g)
		}
	})
}

// TestGrammarAtTheLimits: grammars just within ParseGBNF's bounds (rules and
// groups entered one inside another near 1000 deep, 16 optional parts in a
// row) run on llama.cpp's sampler without crashing or stalling.
func TestGrammarAtTheLimits(t *testing.T) {
	e := openTest(t, models.Tiny(), nil)
	var deep strings.Builder
	deep.WriteString("root ::= r0\n")
	for i := range 85 {
		fmt.Fprintf(&deep, "r%d ::= %sr%d%s | \"a\"\n", i, strings.Repeat("(", 10), i+1, strings.Repeat(")", 10))
	}
	deep.WriteString("r85 ::= \"b\"\n")
	for _, c := range []struct{ g, take string }{
		{deep.String(), "b"},
		{"root ::= " + strings.Repeat("x? ", 16) + "\"y\"\nx ::= \"a\"", "aaaaaaaay"},
	} {
		g, err := engine.ParseGBNF(c.g, e.vocab)
		if err != nil {
			t.Fatalf("%.60q: %v", c.g, err)
		}
		start := time.Now()
		if !grammarTakes(t, e, g, c.take) {
			t.Errorf("%.60q does not take %q", c.g, c.take)
		}
		if d := time.Since(start); d > 5*time.Second {
			t.Errorf("%.60q: %v to take %q", c.g, d, c.take)
		}
	}
}
