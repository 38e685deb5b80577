package engine

import (
	"fmt"
	"regexp/syntax"
	"slices"
	"strings"
	"unicode"
)

// MaxRegexBytes bounds a client's regular expression (vLLM's guided_regex).
const MaxRegexBytes = 16 << 10

// RegexGrammar is a GBNF grammar (start rule root) of the strings regular
// expression re matches whole: the output must be one match from its first
// character to its last, as vLLM's guided_regex asks. re is read in Perl's
// syntax as Go's regexp reads it (RE2, the regular part of Python's re): .
// leaves out a line break unless (?s), ^ and $ may open and close it, (?i)
// folds case, \d \w \s and \p{...} are classes; lazy quantifiers match the same
// strings as greedy ones. What a grammar cannot express is refused:
// backreferences and lookarounds (the parser refuses them), \b, and anchors
// other than at the ends. The grammar passes ParseGBNF's checks, which bound
// what llama.cpp is given.
func RegexGrammar(re string) (string, error) {
	if len(re) > MaxRegexBytes {
		return "", fmt.Errorf("regex: %d bytes, more than %d: %w", len(re), MaxRegexBytes, ErrInvalidInput)
	}
	r, err := syntax.Parse(pythonRepeats(re), syntax.Perl)
	if err != nil {
		return "", fmt.Errorf("regex: %w: %w", err, ErrInvalidInput)
	}
	r = trimAnchors(r, true, true)
	var b strings.Builder
	b.WriteString("root ::= ")
	if err := writeRegex(&b, r, false); err != nil {
		return "", fmt.Errorf("regex %.80q: %w: %w", re, err, ErrInvalidInput)
	}
	b.WriteByte('\n')
	g, err := ParseGBNF(b.String(), nil)
	if err != nil {
		return "", fmt.Errorf("regex %.80q: %w", re, err)
	}
	return g, nil
}

// pythonRepeats writes Python's {,n} (no lower bound) as {0,n}: Go's regexp
// reads it as the literal text "{,n}", Python's re as a repetition.
func pythonRepeats(re string) string {
	var b strings.Builder
	class := false
	for i := 0; i < len(re); i++ {
		c := re[i]
		b.WriteByte(c)
		switch {
		case c == '\\' && i+1 < len(re):
			i++
			b.WriteByte(re[i])
		case c == '[':
			class = true
		case c == ']':
			class = false
		case c == '{' && !class && i+1 < len(re) && re[i+1] == ',':
			j := i + 2
			for j < len(re) && re[j] >= '0' && re[j] <= '9' {
				j++
			}
			if j > i+2 && j < len(re) && re[j] == '}' {
				b.WriteByte('0')
			}
		}
	}
	return b.String()
}

// trimAnchors leaves out the ^ (start) and $ (end) that open and close r: the
// whole output is one match anyway.
func trimAnchors(r *syntax.Regexp, start, end bool) *syntax.Regexp {
	isStart := func(r *syntax.Regexp) bool { return r.Op == syntax.OpBeginText || r.Op == syntax.OpBeginLine }
	isEnd := func(r *syntax.Regexp) bool { return r.Op == syntax.OpEndText || r.Op == syntax.OpEndLine }
	switch r.Op {
	case syntax.OpBeginText, syntax.OpBeginLine:
		if start {
			return &syntax.Regexp{Op: syntax.OpEmptyMatch}
		}
	case syntax.OpEndText, syntax.OpEndLine:
		if end {
			return &syntax.Regexp{Op: syntax.OpEmptyMatch}
		}
	case syntax.OpCapture:
		c := *r
		c.Sub = []*syntax.Regexp{trimAnchors(r.Sub[0], start, end)}
		return &c
	case syntax.OpAlternate:
		c := *r
		c.Sub = make([]*syntax.Regexp, len(r.Sub))
		for i, s := range r.Sub {
			c.Sub[i] = trimAnchors(s, start, end)
		}
		return &c
	case syntax.OpConcat:
		c := *r
		subs := r.Sub
		for start && len(subs) > 0 && isStart(subs[0]) {
			subs = subs[1:]
		}
		for end && len(subs) > 0 && isEnd(subs[len(subs)-1]) {
			subs = subs[:len(subs)-1]
		}
		c.Sub = append([]*syntax.Regexp(nil), subs...)
		if n := len(c.Sub); n > 0 {
			c.Sub[0] = trimAnchors(c.Sub[0], start, end && n == 1)
			if n > 1 {
				c.Sub[n-1] = trimAnchors(c.Sub[n-1], false, end)
			}
		}
		return &c
	}
	return r
}

// writeRegex writes r as a GBNF expression; atom asks for one that a
// repetition can follow (grouped unless it is one already).
func writeRegex(b *strings.Builder, r *syntax.Regexp, atom bool) error {
	if b.Len() > MaxGrammarBytes {
		return fmt.Errorf("its grammar would pass %d bytes", MaxGrammarBytes)
	}
	group := func(f func() error) error {
		if !atom {
			return f()
		}
		b.WriteString("( ")
		err := f()
		b.WriteString(" )")
		return err
	}
	switch r.Op {
	case syntax.OpNoMatch:
		return fmt.Errorf("it matches nothing")
	case syntax.OpEmptyMatch:
		b.WriteString(`""`)
	case syntax.OpLiteral:
		if r.Flags&syntax.FoldCase != 0 {
			return group(func() error {
				for i, c := range r.Rune {
					if i > 0 {
						b.WriteByte(' ')
					}
					writeClass(b, foldRanges(c))
				}
				return nil
			})
		}
		if len(r.Rune) == 1 || !atom {
			b.WriteString(GBNFLiteral(string(r.Rune)))
			return nil
		}
		b.WriteString("( " + GBNFLiteral(string(r.Rune)) + " )")
	case syntax.OpCharClass:
		if len(r.Rune) == 0 {
			return fmt.Errorf("an empty character class matches nothing")
		}
		writeClass(b, r.Rune)
	case syntax.OpAnyCharNotNL:
		b.WriteString(`[^\n]`)
	case syntax.OpAnyChar:
		b.WriteString(".")
	case syntax.OpBeginLine, syntax.OpEndLine, syntax.OpBeginText, syntax.OpEndText:
		return fmt.Errorf("^ and $ only at its start and end (the output is one match, whole)")
	case syntax.OpWordBoundary, syntax.OpNoWordBoundary:
		return fmt.Errorf(`\b and \B cannot be expressed as a grammar`)
	case syntax.OpCapture:
		return writeRegex(b, r.Sub[0], atom)
	case syntax.OpConcat, syntax.OpAlternate:
		sep := " "
		if r.Op == syntax.OpAlternate {
			sep = " | "
			atom = true // grouped even alone, so that it joins with others
		}
		return group(func() error {
			for i, s := range r.Sub {
				if i > 0 {
					b.WriteString(sep)
				}
				if err := writeRegex(b, s, r.Op == syntax.OpConcat && s.Op == syntax.OpAlternate); err != nil {
					return err
				}
			}
			return nil
		})
	case syntax.OpStar, syntax.OpPlus, syntax.OpQuest, syntax.OpRepeat:
		return group(func() error { return writeRepeat(b, r) })
	default:
		return fmt.Errorf("%v cannot be expressed as a grammar", r.Op)
	}
	return nil
}

// writeRepeat writes a repetition: *, +, ? or {m,n} after its repeated part.
func writeRepeat(b *strings.Builder, r *syntax.Regexp) error {
	lo, hi := r.Min, r.Max
	switch r.Op {
	case syntax.OpStar:
		lo, hi = 0, -1
	case syntax.OpPlus:
		lo, hi = 1, -1
	case syntax.OpQuest:
		lo, hi = 0, 1
	}
	sub := r.Sub[0]
	if nullable(sub) && hi != 1 {
		// Repeating what can match nothing: the same strings are up to hi
		// repetitions of what it matches that is not empty (llama.cpp
		// refuses or stalls on a repetition of what can match nothing).
		ne, ok := nonEmpty(sub)
		if !ok {
			return fmt.Errorf("a repetition of what can match nothing that cannot be rewritten as one of what cannot (an anchor, \\b, or more than %d optional parts in a row)", maxGrammarRun)
		}
		if ne == nil {
			hi = 0
		}
		sub, lo = ne, 0
	}
	if hi == 0 {
		b.WriteString(`""`)
		return nil
	}
	if err := writeRegex(b, sub, true); err != nil {
		return err
	}
	switch {
	case lo == 0 && hi == -1:
		b.WriteString("*")
	case lo == 1 && hi == -1:
		b.WriteString("+")
	case lo == 0 && hi == 1:
		b.WriteString("?")
	case hi == -1:
		fmt.Fprintf(b, "{%d,}", lo)
	case lo == hi:
		fmt.Fprintf(b, "{%d}", lo)
	default:
		fmt.Fprintf(b, "{%d,%d}", lo, hi)
	}
	return nil
}

// writeClass writes sorted ranges (pairs lo, hi) as a GBNF class, negated
// when that is shorter.
func writeClass(b *strings.Builder, ranges []rune) {
	var neg []rune
	next := rune(0)
	for i := 0; i < len(ranges); i += 2 {
		if ranges[i] > next {
			neg = append(neg, next, ranges[i]-1)
		}
		next = ranges[i+1] + 1
	}
	if next <= unicode.MaxRune {
		neg = append(neg, next, unicode.MaxRune)
	}
	b.WriteByte('[')
	if len(neg) > 0 && len(neg) < len(ranges) {
		b.WriteByte('^')
		ranges = neg
	}
	for i := 0; i < len(ranges); i += 2 {
		b.WriteString(gbnfChar(ranges[i], true))
		if ranges[i+1] != ranges[i] {
			b.WriteByte('-')
			b.WriteString(gbnfChar(ranges[i+1], true))
		}
	}
	b.WriteByte(']')
}

// foldRanges is the class of c and the runes its case folds to.
func foldRanges(c rune) []rune {
	rs := []rune{c}
	for f := unicode.SimpleFold(c); f != c; f = unicode.SimpleFold(f) {
		rs = append(rs, f)
	}
	slices.Sort(rs)
	out := make([]rune, 0, 2*len(rs))
	for _, r := range rs {
		out = append(out, r, r)
	}
	return out
}

// alternate is one of subs, nil for none.
func alternate(subs []*syntax.Regexp) *syntax.Regexp {
	switch len(subs) {
	case 0:
		return nil
	case 1:
		return subs[0]
	}
	return &syntax.Regexp{Op: syntax.OpAlternate, Sub: subs}
}

// nullable reports whether r can match the empty string.
func nullable(r *syntax.Regexp) bool {
	switch r.Op {
	case syntax.OpEmptyMatch, syntax.OpStar, syntax.OpQuest,
		syntax.OpBeginLine, syntax.OpEndLine, syntax.OpBeginText, syntax.OpEndText,
		syntax.OpWordBoundary, syntax.OpNoWordBoundary:
		return true
	case syntax.OpLiteral:
		return len(r.Rune) == 0
	case syntax.OpCapture, syntax.OpPlus:
		return nullable(r.Sub[0])
	case syntax.OpRepeat:
		return r.Min == 0 || nullable(r.Sub[0])
	case syntax.OpConcat:
		for _, s := range r.Sub {
			if !nullable(s) {
				return false
			}
		}
		return true
	case syntax.OpAlternate:
		for _, s := range r.Sub {
			if nullable(s) {
				return true
			}
		}
	}
	return false
}

// nonEmpty is what r matches but the empty string, nil when r matches only
// that; ok is false when it cannot be written (an anchor or \b that r matches
// nothing but) or is not worth writing (a run of more optional parts than
// ParseGBNF takes).
func nonEmpty(r *syntax.Regexp) (ne *syntax.Regexp, ok bool) {
	if !nullable(r) {
		return r, true
	}
	switch r.Op {
	case syntax.OpEmptyMatch:
		return nil, true
	case syntax.OpCapture:
		return nonEmpty(r.Sub[0])
	case syntax.OpQuest:
		return nonEmpty(r.Sub[0])
	case syntax.OpStar, syntax.OpPlus, syntax.OpRepeat:
		// (x*)-ish without the empty string: one or more of x's non-empty
		// matches, at most r.Max of them.
		s, ok := nonEmpty(r.Sub[0])
		if !ok || s == nil {
			return s, ok
		}
		hi := -1
		if r.Op == syntax.OpRepeat {
			hi = r.Max
		}
		if hi == 0 {
			return nil, true
		}
		return &syntax.Regexp{Op: syntax.OpRepeat, Min: 1, Max: hi, Sub: []*syntax.Regexp{s}}, true
	case syntax.OpAlternate:
		var subs []*syntax.Regexp
		for _, s := range r.Sub {
			n, ok := nonEmpty(s)
			if !ok {
				return nil, false
			}
			if n != nil {
				subs = append(subs, n)
			}
		}
		return alternate(subs), true
	case syntax.OpConcat:
		// Every part can match nothing: a non-empty match begins with
		// the first's non-empty match, or the first matches nothing and
		// the rest's match is not empty.
		if len(r.Sub) == 0 {
			return nil, true
		}
		if len(r.Sub) > maxGrammarRun+1 {
			return nil, false // ParseGBNF would refuse the run; rewriting it copies it once per part
		}
		head, ok := nonEmpty(r.Sub[0])
		if !ok {
			return nil, false
		}
		rest := r.Sub[1:]
		var tail *syntax.Regexp
		if len(rest) > 0 {
			if tail, ok = nonEmpty(&syntax.Regexp{Op: syntax.OpConcat, Sub: rest}); !ok {
				return nil, false
			}
		}
		var subs []*syntax.Regexp
		if head != nil {
			subs = append(subs, &syntax.Regexp{Op: syntax.OpConcat, Sub: append([]*syntax.Regexp{head}, rest...)})
		}
		if tail != nil {
			subs = append(subs, tail)
		}
		return alternate(subs), true
	}
	return nil, false
}
