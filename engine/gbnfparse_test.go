package engine

import (
	"errors"
	"fmt"
	"strconv"
	"strings"
	"testing"
)

func TestParseGBNF(t *testing.T) {
	for _, c := range []struct{ in, want string }{
		{"root ::= \"yes\" | \"no\"", "root ::= \"yes\" | \"no\"\n"},
		{"# answers\nroot ::= answer   # the one rule\nanswer ::= (\n  \"a\" |\n  [b-d]+ # more\n) \"!\"?\n", "root ::= answer\nanswer ::= ( \"a\" | [b-d]+ ) \"!\"?\n"},
		{"root ::= \"line\nbreak\\t\" [\\]\\[\"^-] [^\\n]", "root ::= \"line\\x0Abreak\\x09\" [\\]\\[\\\"\\x5E\\x2D] [^\\x0A]\n"},
		{"root ::= x{ 2 , 5 } x{3} x{1,}\nx ::= \"\\u00e9\\x41\"", "root ::= x{2,5} x{3} x{1,}\nx ::= \"éA\"\n"},
		{"root ::= \"a\" |\n  \"b\"\r\n", "root ::= \"a\" | \"b\"\n"},
		{"root ::= <[3]> !<[4]> .", "root ::= <[3]> !<[4]> .\n"},
		{"root ::= \"\" | \"a\" root", "root ::= \"\" | \"a\" root\n"},
		{"root ::= (\"a\"?)?", "root ::= ( \"a\"? )?\n"},
		{"root ::= \"a\"*?", "root ::= \"a\"*?\n"}, // ? of what can match nothing is fine
		{"root ::= \"\\UFFFFFFFF\\U0010FFFF\\uD800\"", "root ::= \"\\UFFFFFFFF\U0010FFFF\\U0000D800\"\n"},
		{"root ::= x\nx ::=", "root ::= x\nx ::= \"\"\n"},
		{"root ::= \"a\" |", "root ::= \"a\" | \"\"\n"}, // an empty alternative is written "", so that a rule joined after it is not read into it
	} {
		got, err := ParseGBNF(c.in, nil)
		if err != nil || got != c.want {
			t.Errorf("%q:\n got %q, %v\nwant %q", c.in, got, err, c.want)
			continue
		}
		if again, err := ParseGBNF(got, nil); err != nil || again != got {
			t.Errorf("%q: canonical form reads back as %q, %v", got, again, err)
		}
	}
	for in, want := range map[string]string{
		"":                                     "no rule named root",
		"answer ::= \"a\"":                     "no rule named root",
		"root ::= x":                           `rule "x" is referred to`,
		"root ::= \"a\" )":                     "line 1, column 14: unexpected ')'",
		"root ::= (\"a\"":                      "expecting ) to close the group opened at line 1, column 10",
		"root = \"a\"":                         "expecting ::=",
		"root ::= \"a":                         "unexpected end",
		"root ::= [a-":                         "unexpected end",
		"root ::= \"\\q\"":                     `unknown escape \q`,
		"root ::= \"\\x4\"":                    "needs 2 hex digits",
		"root ::= []":                          "empty character class",
		"root ::= [^]":                         "empty character class",
		"root ::= * \"a\"":                     "nothing before it",
		"root ::= \"\"*":                       "nothing to repeat",
		"root ::= \"a\"{3,1}":                  "minimum exceeds its maximum",
		"root ::= \"a\"{2001}":                 "above 2000",
		"root ::= \"a\"{99999999999999999999}": "above 2000",
		"root ::= \"a\"{1,\n2}":                "expecting }", // a line break ends the rule outside a group
		"root ::= (\"a\"?)*":                   "can match nothing",
		"root ::= x{0,50}\nx ::= \"a\" | \"\"": "can match nothing",
		"root ::= \"abcdefghij\"{2000}{2000}":  "elements",
		"root ::= \"a\"{0}*":                   "nothing to repeat",
		"root ::= \"a\"**":                     "can match nothing", // llama.cpp repeats the repetition
		"root ::= root \"a\" | \"b\"":          "left recursion: root -> root",
		"root ::= x\nx ::= y? \"a\"\ny ::= \"b\" | x": "left recursion: x -> y -> x",
		"root ::= \"a\"\x00":                          "NUL byte",
		"root ::= \"\xff\"":                           "not valid UTF-8",
		"root ::= <[x]>":                              "want <[id]>",
		"root ::= !\"a\"":                             "expecting < after !",
		"root ::= <a\nb>":                             "line break inside a token",
		"root ::= " + strings.Repeat("(", 101) + `"a"` + strings.Repeat(")", 101): "nested more than 100",
		"root ::= x\n" + strings.Repeat("x ::= \"abcdefghij\"{2000}\n", 60):       "more than 1048576 elements",
	} {
		_, err := ParseGBNF(in, nil)
		if err == nil || !errors.Is(err, ErrInvalidInput) || !strings.Contains(err.Error(), want) {
			t.Errorf("%q: %v, want an invalid-input error with %q", in, err, want)
		}
	}
	// What would crash or stall llama.cpp: a chain of repetitions or groups
	// deeper than its stack, a long run of parts that may each be left out.
	groups := strings.Builder{}
	groups.WriteString("root ::= r0\n")
	for i := range 990 {
		groups.WriteString("r" + strconv.Itoa(i) + " ::= " + strings.Repeat("(", 99) + "r" + strconv.Itoa(i+1) + strings.Repeat(")", 99) + " | \"a\"\n")
	}
	groups.WriteString("r990 ::= \"b\"\n")
	for in, want := range map[string]string{
		"root ::= \"a\"" + strings.Repeat("?", 80000): "more than 4 repetition operators in a row",
		groups.String(): "recurse more than 1000",
		"root ::= " + strings.Repeat("x? ", 17) + "\"y\"\nx ::= \"a\"":                         "17 parts in a row",
		"root ::= (x? x? x? x? x? x?)? (x? x? x? x? x? x?)? (x? x? x? x? x? x?)?\nx ::= \"a\"": "18 parts in a row",
	} {
		_, err := ParseGBNF(in, nil)
		if err == nil || !errors.Is(err, ErrInvalidInput) || !strings.Contains(err.Error(), want) {
			t.Errorf("%.60q: %v, want an invalid-input error with %q", in, err, want)
		}
	}
	if _, err := ParseGBNF("root ::= "+strings.Repeat("x? ", 16)+"\"y\" ws obj\nx ::= \"a\"\nws ::= [ \\t\\n]*\nobj ::= \"{\" ws (\"a\" ws (\",\" ws \"a\" ws)*)? \"}\"", nil); err != nil {
		t.Errorf("16 optional parts in a row: %v", err)
	}
	var chain strings.Builder
	chain.WriteString("root ::= r0\n")
	for i := range 1200 {
		chain.WriteString("r" + strconv.Itoa(i) + " ::= r" + strconv.Itoa(i+1) + " | \"a\"\n")
	}
	chain.WriteString("r1200 ::= \"b\"\n")
	if _, err := ParseGBNF(chain.String(), nil); err == nil || !strings.Contains(err.Error(), "chain of more than 1000") {
		t.Errorf("a chain of 1200 rules: %v", err)
	}
	if _, err := ParseGBNF(strings.Repeat(" ", MaxGrammarBytes+1), nil); err == nil {
		t.Errorf("a grammar over the size limit was taken")
	}
}

// FuzzParseGBNF checks that ParseGBNF never panics, and that what it takes
// reads back to itself.
func FuzzParseGBNF(f *testing.F) {
	for _, s := range []string{"root ::= \"a\" | [b-c]+ x\nx ::= (\"d\" x?)*", "root ::= x{2,3}\nx ::= <[1]> .", "root ::= \"\\u00e9\" # c\n"} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, s string) {
		g, err := ParseGBNF(s, nil)
		if err != nil {
			if !errors.Is(err, ErrInvalidInput) {
				t.Fatalf("%q: %v is not an invalid-input error", s, err)
			}
			return
		}
		again, err := ParseGBNF(g, nil)
		if err != nil || again != g {
			t.Fatalf("%q: canonical %q reads back as %q, %v", s, g, again, err)
		}
	})
}

// BenchmarkParseGBNF reads a JSON grammar of 0.6 KB, and the grammar of a
// phone-number regex.
func BenchmarkParseGBNF(b *testing.B) {
	const json = `root   ::= object
value  ::= object | array | string | number | ("true" | "false" | "null") ws
object ::= "{" ws ( string ":" ws value ("," ws string ":" ws value)* )? "}" ws
array  ::= "[" ws ( value ("," ws value)* )? "]" ws
string ::= "\"" ( [^"\\\x7F\x00-\x1F] | "\\" (["\\/bfnrt] | "u" [0-9a-fA-F]{4}) )* "\"" ws
number ::= ("-"? ([0-9] | [1-9] [0-9]{0,15})) ("." [0-9]+)? ([eE] [-+]? [0-9] [1-9]{0,15})? ws
ws     ::= | " " | "\n" [ \t]{0,20}
`
	b.Run("json", func(b *testing.B) {
		for b.Loop() {
			if _, err := ParseGBNF(json, nil); err != nil {
				b.Fatal(err)
			}
		}
	})
	b.Run("regex", func(b *testing.B) {
		for b.Loop() {
			if _, err := RegexGrammar(`(\+\d{1,3} )?\(?\d{3}\)?[ .-]?\d{3}[ .-]?\d{4}`); err != nil {
				b.Fatal(err)
			}
		}
	})
}

// TestGrammarAlternatives: more than MaxAlternatives alternatives are
// refused, in a grammar and in a schema's enum values and branches.
func TestGrammarAlternatives(t *testing.T) {
	alts := func(n int) string {
		parts := make([]string, n)
		for i := range parts {
			parts[i] = fmt.Sprintf(`"v%d"`, i)
		}
		return strings.Join(parts, " | ")
	}
	if _, err := ParseGBNF("root ::= "+alts(MaxAlternatives+1), nil); err == nil || !strings.Contains(err.Error(), "alternatives") {
		t.Errorf("%d alternatives: %v", MaxAlternatives+2, err)
	}
	if _, err := ParseGBNF("root ::= x | y\nx ::= "+alts(MaxAlternatives/2)+"\ny ::= "+alts(MaxAlternatives/2-2), nil); err != nil {
		t.Errorf("%d alternatives in all: %v", MaxAlternatives, err)
	}
	enum := func(n int) string { return `{"enum":[` + strings.ReplaceAll(alts(n), " | ", ",") + `]}` }
	if err := CheckSchema([]byte(enum(MaxAlternatives))); err != nil {
		t.Errorf("%d enum values: %v", MaxAlternatives, err)
	}
	if err := CheckSchema([]byte(`{"anyOf":[` + enum(MaxAlternatives-1) + `,{"type":"null"}]}`)); err == nil {
		t.Errorf("%d enum values and 2 branches were taken", MaxAlternatives-1)
	}
}

// TestGrammarStacksAndClasses: ways that multiply from one position (each
// alternative beginning with further alternatives) and classes of more
// characters than maxClassItems are refused; \p{L} is taken.
func TestGrammarStacksAndClasses(t *testing.T) {
	chain := func(levels int) string {
		g := "r0 ::= \"x\" | \"y\"\n"
		for i := 1; i <= levels; i++ {
			g += fmt.Sprintf("r%d ::= r%d \"x\" | r%d \"y\"\n", i, i-1, i-1)
		}
		return g + fmt.Sprintf("root ::= r%d\n", levels)
	}
	if _, err := ParseGBNF(chain(12), nil); err != nil { // 8,192 ways
		t.Errorf("12 levels: %v", err)
	}
	if _, err := ParseGBNF(chain(16), nil); err == nil || !strings.Contains(err.Error(), "ways") {
		t.Errorf("16 levels (131,072 ways): %v", err)
	}
	class := "root ::= [" + strings.Repeat("ab", maxClassItems/2) + "c]"
	if _, err := ParseGBNF(class, nil); err == nil || !strings.Contains(err.Error(), "character class") {
		t.Errorf("a class of %d: %v", maxClassItems+1, err)
	}
	g, err := RegexGrammar(`\p{L}+`)
	if err == nil {
		_, err = ParseGBNF(g, nil)
	}
	if err != nil {
		t.Errorf(`\p{L}: %v`, err)
	}
}
