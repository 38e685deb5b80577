package engine

import (
	"errors"
	"strings"
	"testing"
)

func TestRegexGrammar(t *testing.T) {
	for re, want := range map[string]string{
		`^\d{3}-\d{4}$`:  `[0-9]{3} "-" [0-9]{4}`,
		`(yes|no)`:       `( "yes" | "no" )`,
		`(?i)ab`:         `[Aa] [Bb]`,
		`.+`:             `[^\x0A]+`,
		`(?s).+`:         `.+`,
		`(a|b?)*`:        `( "a" | "b" )*`,
		`(a*)*`:          `( "a"+ )*`,
		`(a?b?)*`:        `( "a" "b"? | "b" )*`,
		`(|a)+`:          `"a"*`,
		`x*?y{2,}z{0,3}`: `"x"* "y"{2,} "z"{0,3}`,
		`(?:ab)+`:        `( "ab" )+`,
		`[^a-z]`:         `[^a-z]`,
		`^(a|^b)$`:       `( "a" | "b" )`,
		`"[^"]*"`:        `"\"" [^\"]* "\""`,
		`a|`:             `( "a" | "" )`,
		`(?m)^a$`:        `"a"`,
		`\d{,3}[{,2}]`:   `[0-9]{0,3} [,2{}]`, // Python's {,n}, outside a class
	} {
		g, err := RegexGrammar(re)
		if err != nil || g != "root ::= "+want+"\n" {
			t.Errorf("%s: %q, %v; want %q", re, g, err, want)
		}
	}
	for re, want := range map[string]string{
		`a\bb`:                               `\b`,
		`a^b`:                                "^ and $ only at its start and end",
		`(a)\1`:                              "invalid escape",
		`(?=a)`:                              "invalid or unsupported Perl syntax",
		`[`:                                  "missing closing ]",
		`\pL{1000}\pL{1000}\pL{1000}`:        "",
		strings.Repeat("a", MaxRegexBytes+1): "more than",
		strings.Repeat("a?", 300) + "y":      "parts in a row",
		"(?:" + strings.Repeat("a?", 8000) + ")*": "optional parts in a row", // refused before a rewrite that copies the run once per part
	} {
		_, err := RegexGrammar(re)
		if err == nil || !errors.Is(err, ErrInvalidInput) || !strings.Contains(err.Error(), want) {
			t.Errorf("%.40s: %v, want an invalid-input error with %q", re, err, want)
		}
	}
}

// FuzzRegexGrammar checks that RegexGrammar never panics and refuses only
// with invalid-input errors; engine/llama's FuzzRegexMatches checks what its
// grammars match.
func FuzzRegexGrammar(f *testing.F) {
	for _, s := range []string{`^\d{3}-\d{4}$`, `(a|b?)*`, `(?i)[a-f]+x{2,5}`, `((a?b?)*c)+`, `\p{Greek}+`, `(?s).*?`} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, re string) {
		if _, err := RegexGrammar(re); err != nil && !errors.Is(err, ErrInvalidInput) {
			t.Fatalf("%q: %v is not an invalid-input error", re, err)
		}
	})
}
