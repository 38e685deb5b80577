package engine

import (
	"errors"
	"testing"
)

func TestGrammarPattern(t *testing.T) {
	for in, want := range map[string]string{
		"^[0-9]{3}$":          "^[0-9]{3}$",
		"abc":                 "^.*(abc).*$",
		"^abc":                "^(abc).*$",
		"abc$":                "^.*(abc)$",
		`^\d{3}-\w+\s?$`:      `^[0-9]{3}-[a-zA-Z0-9_]+[ \t\n\r]?$`,
		"^(?:ab)+$":           "^(ab)+$",
		`^[\d\-.]+$`:          `^[0-9\x2D.]+$`,
		`^a\/b\.c\$$`:         `^a/b\.c\$$`,
		"^.*(abc).*$":         "^.*(abc).*$", // its own output stays
		`^[^"\\]*$`:           `^[^"\x5C]*$`,
		"^(a|b)*?c{2,}?$":     "^(a|b)*c{2,}$",
		"^é+$":                "^(é)+$",
		`^\u00e9[\x41-\x5a]$`: `^\u00e9[\x41-\x5a]$`,
		`^\u00e$`:             "",
		"^(?=.*[a-z]).+$":     "",
		"^(?!x)a$":            "",
		"^*a$":                "",
		"^a{5,3}$":            "",
		"^a{x}$":              "",
		`^\bword\b$`:          "",
		`^\p{L}+$`:            "",
		`^(a)\1$`:             "",
		"^(a$":                "",
		"^a)$":                "",
		"^[]$":                "",
		"^[a$":                "",
		"a^b":                 "",
		`^a\`:                 "",
		"^(|+)$":              "",
		"^(a|)+$":             "",
		"^a**$":               "",
		"^a*+$":               "",
		"^a{0}$":              "",
		"^a{0,0}*$":           "",
		"^()*$":               "",
		"^a|$":                "",
		`^a\|$`:               `^a\|$`,
		`^\u00e9{2}\.+$`:      `^(\u00e9){2}(\.)+$`,
	} {
		got, err := GrammarPattern(in)
		if want == "" {
			if err == nil || !errors.Is(err, ErrInvalidInput) {
				t.Errorf("%q: %q, want refused", in, got)
			}
			continue
		}
		if err != nil || got != want {
			t.Errorf("%q: %q %v, want %q", in, got, err, want)
		}
	}
}

func TestRewritePatterns(t *testing.T) {
	in := `{"type":"object","properties":{"pattern":{"type":"string","pattern":"abc"},"b":{"pattern":"^(?=x)$","const":{"pattern":"(?="}}},"default":{"pattern":"x"}}`
	if _, err := RewritePatterns([]byte(in), false); err == nil {
		t.Fatal("an unsupported pattern was not refused")
	}
	out, err := RewritePatterns([]byte(in), true)
	want := `{"type":"object","properties":{"pattern":{"type":"string","pattern":"^.*(abc).*$"},"b":{"x-unsupported-pattern":"^(?=x)$","const":{"pattern":"(?="}}},"default":{"pattern":"x"}}`
	if err != nil || string(out) != want {
		t.Fatalf("got  %s %v\nwant %s", out, err, want)
	}
	same := []byte(`{"a":[1,{"pattern":"^a$"}],"":"pattern","pattern":"^b$"}`)
	if out, err := RewritePatterns(same, false); err != nil || string(out) != string(same) {
		t.Fatalf("unchanged: %s %v", out, err)
	}
}

func FuzzRewritePatterns(f *testing.F) {
	for _, s := range []string{`{"pattern":"a"}`, `{"":"pattern","x":"y"}`, `[{"pattern":1}]`, `{"pattern":"^(?:a)+$"}`, `{"properties":{"p":{"pattern":"\\d"}}}`} {
		f.Add(s, true)
	}
	f.Fuzz(func(t *testing.T, s string, drop bool) {
		_, _ = RewritePatterns([]byte(s), drop) // no panic, whatever the text
		_, _ = GrammarPattern(s)
	})
}
