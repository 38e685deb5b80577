package engine

import (
	"errors"
	"testing"
)

func TestCheckRepetitions(t *testing.T) {
	for g, bad := range map[string]bool{
		"root ::= \"a\"{3,1}\n":                    true,
		"root ::= x\nx ::= [a-z]{ 5 , 3 } \"b\"\n": true,
		"root ::= \"a\"{1,3} [0-9]{4} \"c\"{2,}\n": false,
		"root ::= \"{3,1}\" [{]{1,2} # a{9,1}\n":   false, // in a literal, a class, a comment
		"root ::= \"\\\"{3,1}\" \"x\"{,2}\n":       false,
		"root ::= [\\]{]{2,1}\n":                   true,
		"root ::= \"a\"{99999999999999999999,1}":   true,
		"root ::= \"a\"{":                          false, // not for this check to refuse
		"root ::= (\"a\"{5,\n3})":                  true,
		"root ::= (\"a\"{5 # c\n,3})":              true,
		"root ::= <#> \"a\"{5,3}":                  true, // a token reference is no comment
		"root ::= <[12]> \"a\"{1,3}":               false,
	} {
		err := CheckRepetitions(g)
		if (err != nil) != bad || err != nil && !errors.Is(err, ErrInvalidInput) {
			t.Errorf("%q: %v, want refused %v", g, err, bad)
		}
	}
}

func FuzzCheckRepetitions(f *testing.F) {
	for _, g := range []string{"root ::= \"a\"{3,1}", "x{1,}", "[\\", "\"\\", "#", "{,}", "{ 1 , 2 }"} {
		f.Add(g)
	}
	f.Fuzz(func(t *testing.T, g string) {
		_ = CheckRepetitions(g) // no panic, whatever the text
	})
}
