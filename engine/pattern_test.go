package engine

import (
	"encoding/json"
	"errors"
	"fmt"
	"strings"
	"testing"
)

func TestGrammarPattern(t *testing.T) {
	const dot = `[^"\x5C\x00-\x1F]`
	for in, want := range map[string]string{
		"^[0-9]{3}$":      "^[0-9]{3}$",
		"abc":             "^" + dot + "*(abc)" + dot + "*$", // JSON Schema's patterns search
		"^abc":            "^(abc)" + dot + "*$",
		"abc$":            "^" + dot + "*(abc)$",
		"^a|b$":           "^((a)" + dot + "*|" + dot + "*(b))$", // each alternative its own anchor
		"":                "^" + dot + "*$",
		"^$":              "^$", // the empty string alone
		"^":               "^" + dot + "*$",
		`^\d{3}-\w+\s?$`:  `^[0-9]{3}-[a-zA-Z0-9_]+( |\\t|\\n|\\r)?$`,
		"^(?:ab)+$":       "^(ab)+$",
		`^[\d\-.]+$`:      `^[0-9\x2D.]+$`,
		`^[\w-.]+$`:       `^[a-zA-Z0-9_\x2D.]+$`, // a - after a set is itself
		`^a\/b\.c\$$`:     `^a/b\.c\$$`,
		`^[^"\\]*$`:       `^[^"\x5C"\x5C\x00-\x1F]*$`,
		"^(a|b)*?c{2,}?$": "^(a|b)*c{2,}$", // lazy: the same strings
		"^é+$":            "^(é)+$",
		`^\u00e9{2}\.+$`:  `^(é){2}(\.)+$`,
		`^a"*$`:           `^a(\\")*$`, // as the JSON text spells it
		`^C:\\dir$`:       `^C:(\\\\)dir$`,
		`^[ -~]+$`:        `^[\x20-\x21\x23-\x5B\x5D-\x7E]+$`, // printable, less what JSON escapes
		`^\(?\d{3}\)?$`:   `^(\()?[0-9]{3}(\))?$`,
		`^(\(|\[)$`:       `^(\(|\[)$`,
		"^(x?){2,3}$":     "^(x?){2,3}$",
		"^(?=.*[a-z]).+$": "",
		"^(?!x)a$":        "",
		"^*a$":            "",
		"^a{5,3}$":        "",
		"^a{x}$":          "",
		"a{,3}":           "", // a literal in ECMA, which the converter cannot take
		"^a{0}$":          "",
		`^\bword\b$`:      "",
		`^\p{L}+$`:        "",
		`^(a)\1$`:         "",
		"^(a$":            "",
		"^a)$":            "",
		"^[]$":            "",
		"^[a$":            "",
		"^[\"a]$":         "", // a quote alone in a positive class
		"a^b":             "",
		`^a\`:             "",
		"^(|+)$":          "",
		"^(a|)+$":         "",
		"^()*$":           "",
		"^a**$":           "",
		"^(a*)*$":         "", // llama.cpp's grammar recursed without end on these
		"^(a?)+$":         "",
		"^(x?){2,}$":      "",
		"^\x00$":          "",
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
	// A property may be named pattern, default or const: its value is still a
	// schema. Within const, default, enum, examples, a pattern is data.
	in := `{"type":"object","properties":{"pattern":{"type":"string","pattern":"^a$"},"default":{"pattern":"^(?:ab)+$"},"b":{"pattern":"^(?=x)$","const":{"pattern":"(?="}}},"default":{"pattern":"x"}}`
	if _, err := RewritePatterns([]byte(in)); err == nil {
		t.Fatal("an unsupported pattern was not refused")
	}
	dropped := `{"type":"object","properties":{"pattern":{"type":"string","pattern":"^a$"},"default":{"pattern":"^(?:ab)+$"},"b":{"x-unsupported-pattern":"^(?=x)$","const":{"pattern":"(?="}}},"default":{"pattern":"x"}}`
	if got := DropPatterns([]byte(in)); string(got) != dropped {
		t.Fatalf("dropped:\ngot  %s\nwant %s", got, dropped)
	}
	rewritten := `{"type":"object","properties":{"pattern":{"type":"string","pattern":"^a$"},"default":{"pattern":"^(ab)+$"},"b":{"x-unsupported-pattern":"^(?=x)$","const":{"pattern":"(?="}}},"default":{"pattern":"x"}}`
	if got, err := RewritePatterns([]byte(dropped)); err != nil || string(got) != rewritten {
		t.Fatalf("rewritten:\ngot  %s %v\nwant %s", got, err, rewritten)
	}
	// A key written with escapes is the same key: dropped all the same, and
	// what is left rewrites.
	escaped := `{"type":"object", "properties":{"b":{"type":"string" , "patt\u0065rn":"^(?=x)$"}}}`
	want := `{"type":"object", "properties":{"b":{"type":"string" , "x-unsupported-pattern":"^(?=x)$"}}}`
	if got := DropPatterns([]byte(escaped)); string(got) != want {
		t.Fatalf("an escaped key:\ngot  %s\nwant %s", got, want)
	}
	if _, err := RewritePatterns([]byte(want)); err != nil {
		t.Fatalf("after dropping an escaped key: %v", err)
	}
	same := []byte(`{"a":[1,{"pattern":"^a$"}],"":"pattern","pattern":"^b$"}`)
	if out, err := RewritePatterns(same); err != nil || string(out) != string(same) {
		t.Fatalf("unchanged: %s %v", out, err)
	}
}

func FuzzRewritePatterns(f *testing.F) {
	for _, s := range []string{`{"pattern":"a"}`, `{"":"pattern","x":"y"}`, `[{"pattern":1}]`, `{"pattern":"^(?:a)+$"}`, `{"properties":{"p":{"pattern":"\\d"}}}`} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, s string) {
		_, _ = RewritePatterns([]byte(s)) // no panic, whatever the text
		dropped := DropPatterns([]byte(s))
		if json.Valid([]byte(s)) {
			if !json.Valid(dropped) {
				t.Fatalf("%s dropped to %s, not JSON", s, dropped)
			}
			if _, err := RewritePatterns(dropped); err != nil {
				t.Fatalf("%s dropped to %s, which still holds a refused pattern: %v", s, dropped, err)
			}
		}
		_, _ = GrammarPattern(s)
	})
}

func TestCheckSchema(t *testing.T) {
	long := strings.Repeat("!", maxSchemaName+1)
	chain := `{"$ref":"#/$defs/a0","$defs":{`
	for i := range maxRefChain + 2 {
		chain += fmt.Sprintf(`"a%d":{"$ref":"#/$defs/a%d"},`, i, i+1)
	}
	chain += fmt.Sprintf(`"a%d":{"type":"string"}}}`, maxRefChain+2)
	for schema, bad := range map[string]bool{
		`{"$ref":"#/$defs/a","$defs":{"a":{"$ref":"#/$defs/a"}}}`:                                      true,
		`{"allOf":[{"$ref":"#/$defs/a"}],"$defs":{"a":{"$ref":"#/$defs/b"},"b":{"$ref":"#/$defs/a"}}}`: true,
		`{"allOf":[{"$ref":"#"}]}`: true,
		`{"type":"object","properties":{"` + long + `":{"type":"string"}}}`: true,
		`{"properties":{"x":{"$ref":"#/$defs/` + long + `"}}}`:              true,
		chain: true,
		`{"properties":{"p":{"$ref":"https://example.com/person.json"}}}`: true, // fetched by no one: it would match anything
		`{"$ref":"defs.json#/a"}`: true,
		`{"type":"object","properties":{"kids":{"type":"array","items":{"$ref":"#"}}}}`:            false, // a tree
		`{"$ref":"#/$defs/node","$defs":{"node":{"properties":{"next":{"$ref":"#/$defs/node"}}}}}`: false,
		`{"allOf":[{"$ref":"#/$defs/a"},{"$ref":"#/$defs/a"}],"$defs":{"a":{"type":"object"}}}`:    false,
		`not json`: false,
	} {
		if err := CheckSchema([]byte(schema)); (err != nil) != bad || err != nil && !errors.Is(err, ErrInvalidInput) {
			t.Errorf("%.80s: %v, want refused %v", schema, err, bad)
		}
	}
	deep := "^" + strings.Repeat("(", maxGroupDepth+2) + "a" + strings.Repeat(")", maxGroupDepth+2) + "$"
	if _, err := GrammarPattern(deep); err == nil {
		t.Error("a pattern nested too deep was taken")
	}
}

// TestCheckSchemaOptional: objects with more optional properties than the
// converter lays out quickly (its time grows with the cube of their number)
// are refused; required ones do not count.
func TestCheckSchemaOptional(t *testing.T) {
	object := func(n, required int, extra string) string {
		var props, req []string
		for i := range n {
			props = append(props, fmt.Sprintf(`"p%d":{"type":"string"}`, i))
			if i < required {
				req = append(req, fmt.Sprintf(`"p%d"`, i))
			}
		}
		return `{"type":"object","properties":{` + strings.Join(props, ",") + `},"required":[` + strings.Join(req, ",") + `]` + extra + `}`
	}
	// Names whose rule names come out alike: "x" and a character other than
	// a letter, digit or -.
	alike := func(n int) string {
		var props []string
		for i := range n {
			props = append(props, fmt.Sprintf(`"x%c":{"type":"string"}`, rune(0x4e00+i)))
		}
		return strings.Join(props, ",")
	}
	for name, c := range map[string]struct {
		schema string
		bad    bool
	}{
		"at the limit":             {object(maxOptional, 0, ""), false},
		"one more":                 {object(maxOptional+1, 0, ""), true},
		"required do not count":    {object(maxOptional+100, 100, ""), false},
		"additionalProperties one": {object(maxOptional, 0, `,"additionalProperties":true`), true},
		"allOf's anyOf branches":   {`{"allOf":[{"anyOf":[{"$ref":"#/$defs/b"},{"$ref":"#/$defs/b"},{"$ref":"#/$defs/b"}]}],"$defs":{"b":` + object(100, 0, "") + `}}`, true},
		"allOf's own are required": {`{"allOf":[{"$ref":"#/$defs/b"},{"$ref":"#/$defs/b"},{"$ref":"#/$defs/b"}],"$defs":{"b":` + object(100, 0, "") + `}}`, false},
		"a type list twice":        {`{"type":["object","object"],"properties":{"a":{"type":"string"}}}`, true},
		"a type list of objects":   {`{"type":[{},{}]}`, false},
		"properties before allOf":  {`{"type":"object","allOf":[{}],"properties":{` + alike(0) + strings.TrimPrefix(strings.TrimSuffix(object(maxOptional+1, 0, ""), `},"required":[]}`), `{"type":"object","properties":{`) + `}}`, true},
		"a nullable type list":     {`{"type":["object","null"],"properties":{"a":{"type":["string","null"]}}}`, false},
		"too many properties":      {object(maxProperties+1, maxProperties+1, ""), true},
		"names alike":              {`{"type":"object","properties":{` + alike(maxAlikeNames+2) + `}}`, true},
		"a few names alike":        {`{"type":"object","properties":{` + alike(maxAlikeNames) + `}}`, false},
		"in all":                   {`{"type":"array","prefixItems":[` + object(maxOptional, 0, "") + "," + object(maxOptional, 0, "") + "," + object(maxOptional, 0, "") + `]}`, true},
		"two at the limit":         {`{"type":"array","prefixItems":[` + object(maxOptional, 0, "") + "," + object(maxOptional, 0, "") + `]}`, false},
	} {
		if err := CheckSchema([]byte(c.schema)); (err != nil) != c.bad || err != nil && !errors.Is(err, ErrInvalidInput) {
			t.Errorf("%s: %v, want refused %v", name, err, c.bad)
		}
	}
}

func TestCheckSchemaBounds(t *testing.T) {
	for schema, bad := range map[string]bool{
		`{"type":"string","minLength":3,"maxLength":1}`:                              true,
		`{"type":"number","exclusiveMinimum":3,"exclusiveMaximum":3}`:                true,
		`{"properties":{"a":{"type":"array","minItems":2,"maxItems":1}}}`:            true,
		`{"properties":{"minimum":{"type":"integer"},"maximum":{"type":"integer"}}}`: false, // names, not bounds
		`{"type":"object","default":{"minLength":3,"maxLength":1}}`:                  false, // a value
		`{"properties":{"default":{"type":"string","minLength":3,"maxLength":1}}}`:   true,  // a property named default
		`{"type":"integer","minimum":1,"maximum":1}`:                                 false,
	} {
		if err := CheckSchema([]byte(schema)); (err != nil) != bad {
			t.Errorf("%s: %v, want refused %v", schema, err, bad)
		}
	}
}

// FuzzCheckSchema: any JSON is checked without a panic, and a refusal is an
// invalid input.
func FuzzCheckSchema(f *testing.F) {
	for _, s := range []string{
		`{"type":["object","null"],"properties":{"a":{"type":["string","null"]}},"required":["a"]}`,
		`{"type":[{},{}]}`, `{"type":["a","a"]}`, `{"allOf":[{"anyOf":[{"$ref":"#/$defs/b"}]}],"$defs":{"b":{"properties":{"x":{}}}}}`,
		`{"enum":[1,2,[3]],"anyOf":[true,false],"oneOf":null}`, `{"properties":{"x中":{},"x丁":{}},"additionalProperties":{}}`,
		`{"$ref":"#/definitions/a","definitions":{"a":{"allOf":[{"$ref":"#"}]}}}`, `{"minLength":3,"maxLength":1}`, `[]`, `null`,
	} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, s string) {
		if err := CheckSchema([]byte(s)); err != nil && !errors.Is(err, ErrInvalidInput) {
			t.Fatalf("%q: %v", s, err)
		}
	})
}
