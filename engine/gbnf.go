package engine

import (
	"fmt"
	"strconv"
)

// CheckRepetitions refuses a GBNF grammar with a bounded repetition whose
// minimum exceeds its maximum (x{3,1}), which JSON schemas whose minLength or
// minItems exceed their maximum, and patterns such as a{5,3}, convert to.
// llama.cpp's parser counts the optional repetitions as max - min, unsigned:
// it wraps around to a number of rules it allocates until memory runs out.
// Text inside string literals, character classes, token references (<...>)
// and comments is skipped; within the braces, whitespace, newlines and comments
// are allowed, as llama.cpp allows them inside parentheses.
func CheckRepetitions(gbnf string) error {
	for i := 0; i < len(gbnf); i++ {
		switch gbnf[i] {
		case '#':
			for i < len(gbnf) && gbnf[i] != '\n' && gbnf[i] != '\r' {
				i++
			}
		case '"', '[', '<':
			end := map[byte]byte{'"': '"', '[': ']', '<': '>'}[gbnf[i]]
			for i++; i < len(gbnf) && gbnf[i] != end; i++ {
				if gbnf[i] == '\\' {
					i++
				}
			}
		case '{':
			lo, hi, n := repetition(gbnf[i+1:])
			if n > 0 && hi >= 0 && lo > hi {
				return fmt.Errorf("grammar: repetition {%d,%d} at byte %d: its minimum exceeds its maximum (in a schema: minLength/minItems above maxLength/maxItems, or a pattern such as a{5,3}): %w", lo, hi, i, ErrInvalidInput)
			}
		}
	}
	return nil
}

// repetition reads "m,n}" (or "m}", "m,}", ",n}", spaces allowed) from s and
// returns the bounds (hi -1: none) and the bytes read; n is 0 when s holds no
// such bounds.
func repetition(s string) (lo, hi, n int) {
	i := 0
	space := func() {
		for i < len(s) {
			switch s[i] {
			case ' ', '\t', '\n', '\r':
				i++
			case '#':
				for i < len(s) && s[i] != '\n' && s[i] != '\r' {
					i++
				}
			default:
				return
			}
		}
	}
	num := func() (int, bool) {
		j := i
		for i < len(s) && s[i] >= '0' && s[i] <= '9' {
			i++
		}
		if i == j {
			return 0, false
		}
		v, err := strconv.Atoi(s[j:i])
		if err != nil {
			v = int(^uint(0) >> 1) // too large: bounded below by the parser's own limit
		}
		return v, true
	}
	space()
	lo, _ = num()
	space()
	hi = lo
	if i < len(s) && s[i] == ',' {
		i++
		space()
		var ok bool
		if hi, ok = num(); !ok {
			hi = -1
		}
		space()
	}
	if i >= len(s) || s[i] != '}' {
		return 0, 0, 0
	}
	return lo, hi, i + 1
}
