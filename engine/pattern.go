package engine

import (
	"bytes"
	"encoding/json"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"unicode/utf8"
)

// GrammarPattern rewrites a JSON schema's pattern, an ECMA regular expression
// that may match anywhere in a string, into one llama.cpp's schema converter
// takes and turns into a grammar of the string's JSON text:
//
//   - anchored (^...$): an unanchored end becomes .* (JSON Schema's patterns
//     search), top-level alternatives each keep their own anchors;
//   - written as the JSON text spells the string: a quote or backslash as its
//     escape, control characters as \n, \t, \r, \f or \u00XX; . and negated
//     classes leave out what JSON must escape (the converter's own dot admits
//     a raw quote, which ends the string);
//   - (?:...) a plain group, \d and \w classes, \s its four escapes, lazy
//     quantifiers greedy (the same strings match);
//   - an escape, quote or non-ASCII character before a quantifier grouped (the
//     converter would repeat its whole literal, or its last byte).
//
// What a grammar cannot express, or the converter cannot take, is an error:
// lookarounds, backreferences, \b, \p{...}; a positive class holding a quote,
// backslash or control character; an unbounded repetition of something that
// can match nothing (llama.cpp's grammar recursed without end on it); a
// quantifier with nothing before it (the converter crashed the process on
// (?:a)+). Its output is a pattern over JSON text: it is not to be rewritten
// again.
func GrammarPattern(p string) (string, error) {
	bad := func(why string) (string, error) {
		return "", fmt.Errorf("pattern %q: %s cannot be expressed as a grammar: %w", p, why, ErrInvalidInput)
	}
	body := p
	start := strings.HasPrefix(body, "^")
	if start {
		body = body[1:]
	}
	end := strings.HasSuffix(body, "$") && !escaped(body, len(body)-1)
	if end {
		body = body[:len(body)-1]
	}
	switch {
	case body == "" && start && end:
		return "^$", nil // the empty string alone
	case body == "":
		return "^" + jsonDot + "*$", nil // matches every string
	}
	var b strings.Builder
	// Per open group (and the top level): whether every atom of the current
	// alternative before the last can match nothing, whether the last can,
	// whether there is a last, and whether an earlier alternative can.
	type level struct{ done, last, hasLast, anyAlt, empty bool }
	levels := []level{{done: true, empty: true}}
	cur := func() *level { return &levels[len(levels)-1] }
	atom := func(nullable bool) {
		l := cur()
		if l.hasLast {
			l.done = l.done && l.last
		}
		l.last, l.hasLast, l.empty = nullable, true, false
	}
	var alts []int // where top-level alternatives begin in b
	quantified := false
	for i := 0; i < len(body); i++ {
		c := body[i]
		if quantified && (c == '*' || c == '+' || c == '?' || c == '{') {
			if c != '?' {
				return bad("a quantifier on a quantifier")
			}
			continue // lazy: the same strings match
		}
		quantified = false
		switch c {
		case '\\':
			s, n, ok := escapeOutside(body[i:])
			if !ok {
				return bad("the escape " + body[i:min(len(body), i+2)])
			}
			i += n - 1
			if len(s) > 1 && s[0] != '[' && i+1 < len(body) && strings.IndexByte("*+?{", body[i+1]) >= 0 && !strings.HasPrefix(s, "(") {
				s = "(" + s + ")"
			}
			b.WriteString(s)
			atom(false)
		case '(':
			if len(levels) > maxGroupDepth {
				return bad(fmt.Sprintf("groups nested more than %d deep", maxGroupDepth))
			}
			if strings.HasPrefix(body[i+1:], "?") {
				if !strings.HasPrefix(body[i+1:], "?:") {
					return bad("a group starting (?") // lookarounds, named groups, flags
				}
				i += 2
			}
			b.WriteByte('(')
			levels = append(levels, level{done: true, empty: true})
		case ')':
			l := cur()
			if len(levels) == 1 {
				return bad("an unopened )")
			}
			if l.empty {
				return bad("an empty group or alternative")
			}
			nullable := l.anyAlt || l.done && l.last
			levels = levels[:len(levels)-1]
			b.WriteByte(')')
			atom(nullable)
		case '|':
			l := cur()
			if l.empty {
				return bad("an empty alternative")
			}
			l.anyAlt = l.anyAlt || l.done && l.last
			l.done, l.hasLast, l.empty = true, false, true
			if len(levels) == 1 {
				alts = append(alts, b.Len()+1)
			}
			b.WriteByte('|')
		case '*', '+', '?', '{':
			l := cur()
			if !l.hasLast {
				return bad("a quantifier with nothing before it")
			}
			q := string(c)
			unbounded := c != '?'
			nullable := c != '+'
			if c == '{' {
				lo, hi, n := repetition(body[i+1:])
				if n == 0 || body[i+1] < '0' || body[i+1] > '9' || (hi >= 0 && lo > hi) || hi == 0 || !digitsOnly(body[i+1:i+n]) {
					return bad("a { that is no {m}, {m,} or {m,n} (0 < n, m <= n)")
				}
				q = body[i : i+1+n]
				i += n
				unbounded, nullable = hi < 0, lo == 0
			}
			if unbounded && l.last {
				return bad("an unbounded repetition of something that can match nothing")
			}
			b.WriteString(q)
			l.last = l.last || nullable
			quantified = true
		case '[':
			class, n, ok := charClass(body[i:])
			if !ok {
				return bad("a character class it cannot read, or one holding a quote, backslash or control character")
			}
			b.WriteString(class)
			i += n - 1
			atom(false)
		case '.':
			b.WriteString(jsonDot)
			atom(false)
		case '}', ']', '^', '$':
			return bad("a " + string(c) + " out of place")
		default:
			lit, n, ok := literal(body[i:])
			if !ok {
				return bad("a control character, or text that is not UTF-8")
			}
			i += n - 1
			if len(lit) > 1 && i+1 < len(body) && strings.IndexByte("*+?{", body[i+1]) >= 0 {
				lit = "(" + lit + ")" // the converter would repeat its last byte, or the whole literal
			}
			b.WriteString(lit)
			atom(false)
		}
	}
	if len(levels) != 1 {
		return bad("an unclosed (")
	}
	if cur().empty {
		return bad("an empty alternative")
	}
	out := b.String()
	if len(alts) == 0 {
		if start && end {
			return "^" + out + "$", nil
		}
		return "^" + anchored(out, start, end) + "$", nil
	}
	// ^a|b$ is (^a)|(b$): each alternative with its own anchors.
	bounds := append([]int{0}, alts...)
	var parts []string
	for k, from := range bounds {
		to := len(out)
		if k+1 < len(bounds) {
			to = bounds[k+1] - 1
		}
		parts = append(parts, anchored(out[from:to], start && k == 0, end && k == len(bounds)-1))
	}
	return "^(" + strings.Join(parts, "|") + ")$", nil
}

// jsonDot is the regex's . in a JSON string's text: any character but a line
// break and what JSON must escape (a quote, a backslash, a control character).
const jsonDot = `[^"\x5C\x00-\x1F]`

// anchored is s searched for: .* where an end is not anchored.
func anchored(s string, start, end bool) string {
	if !start {
		s = jsonDot + "*(" + s + ")"
	}
	if !end {
		if start {
			s = "(" + s + ")"
		}
		s += jsonDot + "*"
	}
	return s
}

// literal reads the character at the start of s and returns it as the JSON
// text writes it, and its length.
func literal(s string) (string, int, bool) {
	c := s[0]
	switch {
	case c == '"':
		return `\\"`, 1, true
	case c == '\t':
		return `\\t`, 1, true
	case c == '\n':
		return `\\n`, 1, true
	case c == '\r':
		return `\\r`, 1, true
	case c < 0x20 || c == 0x7f:
		return "", 0, false
	case c < utf8.RuneSelf:
		return string(c), 1, true
	}
	return utf8Prefix(s)
}

// utf8Prefix is the character at the start of s (not ASCII) and its length;
// false for bytes that are not UTF-8.
func utf8Prefix(s string) (string, int, bool) {
	r, n := utf8.DecodeRuneInString(s)
	if r == utf8.RuneError {
		return "", 0, false
	}
	return s[:n], n, true
}

// hexEscape is the \xHH or \uHHHH escape at the start of s and its code point,
// or -1.
func hexEscape(s string) (string, rune) {
	for _, e := range []struct {
		prefix string
		n      int
	}{{`\x`, 2}, {`\u`, 4}} {
		if strings.HasPrefix(s, e.prefix) && len(s) >= 2+e.n {
			if v, err := strconv.ParseUint(s[2:2+e.n], 16, 32); err == nil {
				return s[:2+e.n], rune(v)
			}
		}
	}
	return "", -1
}

// escaped reports whether s[i] follows an odd number of backslashes.
func escaped(s string, i int) bool {
	n := 0
	for j := i - 1; j >= 0 && s[j] == '\\'; j-- {
		n++
	}
	return n%2 == 1
}

func digitsOnly(s string) bool {
	return strings.Trim(s, "0123456789,}") == ""
}

// escapeOutside reads the regex escape at the start of s (outside a class) and
// returns what the converter must be given for it, and its length.
func escapeOutside(s string) (string, int, bool) {
	if len(s) < 2 {
		return "", 0, false
	}
	if h, r := hexEscape(s); h != "" {
		return jsonRune(r), len(h), true
	}
	switch e := s[1]; e {
	case 'd':
		return "[0-9]", 2, true
	case 'D':
		return `[^0-9"\x5C\x00-\x1F]`, 2, true
	case 'w':
		return "[a-zA-Z0-9_]", 2, true
	case 'W':
		return `[^a-zA-Z0-9_"\x5C\x00-\x1F]`, 2, true
	case 's':
		return `( |\\t|\\n|\\r)`, 2, true
	case 'S':
		return `[^ "\x5C\x00-\x1F]`, 2, true
	case 'n':
		return `(\\n)`, 2, true
	case 't':
		return `(\\t)`, 2, true
	case 'r':
		return `(\\r)`, 2, true
	case 'f':
		return `(\\f)`, 2, true
	case 'v':
		return `(\\u000b)`, 2, true
	case '\\':
		return `(\\\\)`, 2, true
	case '"':
		return `(\\")`, 2, true
	case '^', '$', '.', '[', ']', '(', ')', '|', '{', '}', '*', '+', '?':
		return `\` + string(e), 2, true // kept escaped: the converter unescapes them
	default:
		if e >= 0x20 && e < 0x7f && !isAlnum(e) {
			return string(e), 2, true // /, -, ', ...: itself
		}
	}
	return "", 0, false // \b, \B, \p, \1, \u{...} and the like
}

// jsonRune is code point r as a JSON string's text writes it, for the
// converter.
func jsonRune(r rune) string {
	switch {
	case r == '"':
		return `(\\")`
	case r == '\\':
		return `(\\\\)`
	case r < 0x20:
		return fmt.Sprintf(`(\\u%04x)`, r)
	case strings.ContainsRune(`^$.[]()|{}*+?`, r):
		return `\` + string(r)
	}
	return string(r)
}

func isAlnum(c byte) bool {
	return c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9'
}

// charClass reads the class at the start of s ("[...]") and returns it as the
// converter passes it on to GBNF, and its length. What JSON escapes (a quote,
// a backslash, a control character) must not come out raw: a negated class is
// made to leave them out, a positive one's ranges are split around them, and a
// positive class naming one alone is refused.
func charClass(s string) (string, int, bool) {
	var b bytes.Buffer
	b.WriteByte('[')
	i := 1
	negated := strings.HasPrefix(s[i:], "^")
	if negated {
		b.WriteByte('^')
		i++
	}
	first := i
	special := func(lo, hi rune) bool { return lo <= '"' && '"' <= hi || lo <= '\\' && '\\' <= hi || lo < 0x20 }
	prev, prevAt := rune(-1), 0 // the last single character, a possible range start, and where it was written
	for i < len(s) {
		c := s[i]
		if c == ']' && i > first && b.Len() == 1+len("^")*boolInt(negated) {
			return "", 0, false // nothing left of it
		}
		if c == ']' && i > first {
			if negated && !bytes.HasSuffix(b.Bytes(), []byte(`"\x5C\x00-\x1F`)) {
				b.WriteString(`"\x5C\x00-\x1F`)
			}
			b.WriteByte(']')
			return b.String(), i + 1, true
		}
		if c == ']' || c == '[' || c == 0 {
			return "", 0, false // [], nested classes ([[:alpha:]])
		}
		var r rune
		var text string
		n := 1
		switch {
		case c == '\\':
			if h, v := hexEscape(s[i:]); h != "" {
				r, text, n = v, fmt.Sprintf(`\x%02X`, v), len(h)
				if v > 0xff {
					text = h
				}
				break
			}
			if i+1 >= len(s) {
				return "", 0, false
			}
			n = 2
			switch e := s[i+1]; {
			case e == 'd' || e == 'w':
				text = map[byte]string{'d': "0-9", 'w': "a-zA-Z0-9_"}[e]
				r = -2 // a set: no range endpoint
			case e == 'n' || e == 't' || e == 'r':
				r, text = map[byte]rune{'n': '\n', 't': '\t', 'r': '\r'}[e], `\`+string(e)
			case e >= 0x20 && e < 0x7f && !isAlnum(e):
				r, text = rune(e), fmt.Sprintf(`\x%02X`, e)
			default:
				return "", 0, false // \D, \s, \b, \p{...} in a class
			}
		case c < utf8.RuneSelf:
			r, text = rune(c), string(c)
			if c < 0x20 || c == 0x7f {
				text = fmt.Sprintf(`\x%02X`, c)
			}
		default:
			var size int
			if r, size = utf8.DecodeRuneInString(s[i:]); r == utf8.RuneError {
				return "", 0, false
			}
			text, n = s[i:i+size], size
		}
		if r == '-' && c == '-' && prev >= 0 && i+1 < len(s) && s[i+1] != ']' {
			// A range: its end comes next.
			b.WriteByte('-')
			i++
			endText, endLen, ok := classChar(s[i:])
			if !ok {
				return "", 0, false
			}
			hi, _ := utf8.DecodeRuneInString(endText)
			if h, v := hexEscape(endText); h != "" {
				hi = v
			}
			switch {
			case hi < prev:
				return "", 0, false
			case !negated && special(prev, hi):
				// [ -~]: the range without the quote, the backslash and
				// the control characters.
				b.Truncate(prevAt)
				lo := max(prev, 0x20)
				for _, cut := range []rune{'"', '\\', hi + 1} {
					if lo < cut && lo <= hi {
						fmt.Fprintf(&b, `\x%02X-%s`, lo, classRune(min(cut-1, hi)))
					}
					lo = max(lo, cut+1)
				}
			default:
				b.WriteString(endText)
			}
			i += endLen
			prev = -1
			continue
		}
		if !negated && r >= 0 && special(r, r) {
			return "", 0, false
		}
		if r == '-' && c == '-' {
			text = `\x2D` // a - that begins or ends no range
		}
		if r == -2 && i+n < len(s) && s[i+n] == '-' {
			// [\w-.]: a set is no range endpoint; the - is itself.
			b.WriteString(text + `\x2D`)
			i += n + 1
			prev = -1
			continue
		}
		prevAt = b.Len()
		b.WriteString(text)
		i += n
		prev = r
	}
	return "", 0, false
}

func boolInt(b bool) int {
	if b {
		return 1
	}
	return 0
}

// classRune is r as a class writes it.
func classRune(r rune) string {
	if r < 0x100 {
		return fmt.Sprintf(`\x%02X`, r)
	}
	return fmt.Sprintf(`\u%04X`, r)
}

// classChar reads one character of a class (a range's end) and returns it as
// the converter passes it on, and its length.
func classChar(s string) (string, int, bool) {
	switch c := s[0]; {
	case c == '\\':
		if h, v := hexEscape(s); h != "" {
			if v > 0xff {
				return h, len(h), true
			}
			return fmt.Sprintf(`\x%02X`, v), len(h), true
		}
		if len(s) > 1 && s[1] >= 0x20 && s[1] < 0x7f && !isAlnum(s[1]) {
			return fmt.Sprintf(`\x%02X`, s[1]), 2, true
		}
		return "", 0, false
	case c == ']' || c == '[' || c < 0x20:
		return "", 0, false
	case c < utf8.RuneSelf:
		return string(c), 1, true
	}
	return utf8Prefix(s)
}

// skippedKeys hold values, not schemas: a "pattern" within them is data.
var skippedKeys = []string{"const", "enum", "default", "examples"}

// RewritePatterns rewrites every pattern of a JSON schema with GrammarPattern,
// in place in its text (the order of keys, which the converter keeps, is
// kept); a pattern GrammarPattern refuses is an error. Its output is for the
// converter, not for RewritePatterns again.
func RewritePatterns(schema []byte) ([]byte, error) {
	return editPatterns(schema, false)
}

// DropPatterns leaves out (renames, so that the converter does not read them)
// the patterns of a JSON schema GrammarPattern refuses, and leaves the rest as
// they are.
func DropPatterns(schema []byte) []byte {
	out, _ := editPatterns(schema, true)
	return out
}

// nameMaps are the keys whose objects map names to schemas: their keys are
// names, whatever they are called.
var nameMaps = []string{"properties", "patternProperties", "$defs", "definitions", "dependentSchemas"}

// editPatterns rewrites every pattern (drop false) or renames those
// GrammarPattern refuses (drop true); schema is returned as it is when it is
// not JSON.
func editPatterns(schema []byte, drop bool) ([]byte, error) {
	type frame struct {
		object, skip bool
		names        bool // an object of name -> schema
		wantKey      bool // an object's next string is a key
		key          string
	}
	type edit struct {
		from, to int
		with     string
	}
	var edits []edit
	var stack []frame
	d := json.NewDecoder(bytes.NewReader(schema))
	d.UseNumber()
	keyStart, keyEnd := 0, 0
	for {
		before := int(d.InputOffset())
		tok, err := d.Token()
		if err != nil {
			break // the end, or JSON the converter refuses itself
		}
		var top *frame
		if len(stack) > 0 {
			top = &stack[len(stack)-1]
		}
		if top != nil && top.wantKey {
			if k, ok := tok.(string); ok { // a key
				top.key, top.wantKey, keyEnd = k, false, int(d.InputOffset())
				keyStart = before + bytes.IndexByte(schema[before:keyEnd], '"') // after a comma and blanks
				continue
			}
		}
		switch v := tok.(type) {
		case json.Delim:
			switch v {
			case '{', '[':
				// In a schema (not in a map of names), const, enum, default and
				// examples hold values: a "pattern" within them is data.
				inSchema := top != nil && top.object && !top.names
				f := frame{object: v == '{', wantKey: v == '{'}
				f.skip = top != nil && (top.skip || inSchema && slices.Contains(skippedKeys, top.key))
				f.names = v == '{' && inSchema && slices.Contains(nameMaps, top.key)
				stack = append(stack, f)
				continue
			default:
				stack = stack[:len(stack)-1]
			}
		case string:
			if top != nil && top.object && !top.names && top.key == "pattern" && !top.skip {
				from := keyEnd + bytes.IndexByte(schema[keyEnd:], '"')
				to := int(d.InputOffset())
				fixed, err := GrammarPattern(v)
				switch {
				case err == nil && !drop:
					q, _ := json.Marshal(fixed)
					edits = append(edits, edit{from, to, string(q)})
				case err == nil:
				case drop:
					// The key as written, escapes and all ("patt\u0065rn").
					edits = append(edits, edit{keyStart, keyEnd, `"x-unsupported-pattern"`})
				case !drop:
					return nil, err
				}
			}
		}
		if len(stack) > 0 && stack[len(stack)-1].object {
			stack[len(stack)-1].key, stack[len(stack)-1].wantKey = "", true // a value ends: a key comes next
		}
	}
	if len(edits) == 0 {
		return schema, nil
	}
	out := slices.Clone(schema)
	for i := len(edits) - 1; i >= 0; i-- {
		e := edits[i]
		out = slices.Concat(out[:e.from], []byte(e.with), out[e.to:])
	}
	return out, nil
}
