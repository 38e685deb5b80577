package engine

import (
	"bytes"
	"encoding/json"
	"fmt"
	"slices"
	"strings"
	"unicode/utf8"
)

// GrammarPattern rewrites a JSON schema's pattern, a regular expression that
// may match anywhere in the string, into the form llama.cpp's schema converter
// takes: anchored (^...$), with literals, ., [...] classes, groups, | and the
// quantifiers *, +, ?, {m}, {m,}, {m,n}. An unanchored end becomes .* (JSON
// Schema's patterns search), (?:...) a plain group, \d, \w, \s and their
// negations character classes. What the converter cannot take (lookarounds,
// backreferences, \b, \p{...}, a quantifier with nothing before it) is an
// error: the converter takes some of it for what it is not, and crashes the
// process on (?:...) followed by a quantifier.
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
	var b strings.Builder
	depth, atom := 0, false // atom: a quantifier may follow
	quantified := false     // a quantifier was just written
	// empty: what was written ends where an alternative or a group begins
	// (GBNF has no empty alternatives within parentheses).
	empty := func() bool {
		s := b.String()
		return s == "" || strings.HasSuffix(s, "(") || strings.HasSuffix(s, "|") && !escaped(s, len(s)-1)
	}
	for i := 0; i < len(body); i++ {
		c := body[i]
		if quantified && (c == '*' || c == '+' || c == '?' || c == '{') {
			if c != '?' {
				return bad("a quantifier on a quantifier")
			}
			continue // lazy: the same strings match
		}
		quantified = c == '*' || c == '+' || c == '?' || c == '{'
		switch c {
		case '\\':
			if i+1 >= len(body) {
				return bad("a trailing backslash")
			}
			s := hexEscape(body[i:])
			if s != "" {
				i += len(s) - 1
			} else {
				i++
				var ok bool
				if s, ok = escapeOutside(body[i]); !ok {
					return bad(`\` + string(body[i]))
				}
			}
			if s[0] == '\\' && i+1 < len(body) && strings.IndexByte("*+?{", body[i+1]) >= 0 {
				// The converter would repeat the literal the escape ends, or
				// split the escape: a group holds it whole.
				s = "(" + s + ")"
			}
			b.WriteString(s)
			atom = true
		case '(':
			if strings.HasPrefix(body[i+1:], "?") {
				if !strings.HasPrefix(body[i+1:], "?:") {
					return bad("a group starting (?") // lookarounds, named groups, flags
				}
				i += 2
			}
			depth++
			b.WriteByte('(')
			atom = false
		case ')':
			if depth--; depth < 0 {
				return bad("an unopened )")
			}
			if empty() {
				return bad("an empty group or alternative")
			}
			b.WriteByte(')')
			atom = true
		case '|':
			if empty() {
				return bad("an empty alternative")
			}
			b.WriteByte('|')
			atom = false
		case '*', '+', '?':
			if !atom {
				return bad("a quantifier with nothing before it")
			}
			b.WriteByte(c)
		case '{':
			lo, hi, n := repetition(body[i+1:])
			if !atom || n == 0 || (hi >= 0 && lo > hi) || hi == 0 || !digitsOnly(body[i+1:i+n]) {
				return bad("a { that is no {m}, {m,} or {m,n} (n > 0) after something to repeat")
			}
			b.WriteString(body[i : i+1+n])
			i += n
		case '[':
			class, n, ok := charClass(body[i:])
			if !ok {
				return bad("a character class it cannot read")
			}
			b.WriteString(class)
			i += n - 1
			atom = true
		case '}', ']', '^', '$':
			return bad("a " + string(c) + " out of place")
		case '"':
			b.WriteByte(c)
			atom = true
		case '\t', '\n', '\r':
			b.WriteString(map[byte]string{'\t': `(\t)`, '\n': `(\n)`, '\r': `(\r)`}[c])
			atom = true
		default:
			if c < 0x20 || c == 0x7f {
				return bad("a control character")
			}
			r := body[i : i+1]
			if c >= utf8.RuneSelf {
				_, n := utf8.DecodeRuneInString(body[i:])
				if !utf8.ValidString(body[i : i+n]) {
					return bad("text that is not UTF-8")
				}
				r, i = body[i:i+n], i+n-1
				if i+1 < len(body) && strings.IndexByte("*+?{", body[i+1]) >= 0 {
					r = "(" + r + ")" // the converter would repeat its last byte
				}
			}
			b.WriteString(r)
			atom = true
		}
	}
	if depth != 0 {
		return bad("an unclosed (")
	}
	if strings.HasSuffix(b.String(), "|") && !escaped(b.String(), b.Len()-1) {
		return bad("an empty alternative")
	}
	if start && end {
		return "^" + b.String() + "$", nil
	}
	out := "^"
	if !start {
		out += ".*"
	}
	out += "(" + b.String() + ")"
	if !end {
		out += ".*"
	}
	return out + "$", nil
}

// hexEscape is the \xHH or \uHHHH escape at the start of s, "" if none:
// GBNF reads both as regular expressions do.
func hexEscape(s string) string {
	for _, e := range []struct {
		prefix string
		n      int
	}{{`\x`, 2}, {`\u`, 4}} {
		if strings.HasPrefix(s, e.prefix) && len(s) >= 2+e.n && strings.Trim(s[2:2+e.n], "0123456789abcdefABCDEF") == "" {
			return s[:2+e.n]
		}
	}
	return ""
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

// escapeOutside is a regex escape \e outside a class, as the converter reads
// it.
func escapeOutside(e byte) (string, bool) {
	switch e {
	case 'd':
		return "[0-9]", true
	case 'D':
		return "[^0-9]", true
	case 'w':
		return "[a-zA-Z0-9_]", true
	case 'W':
		return "[^a-zA-Z0-9_]", true
	case 's':
		return `[ \t\n\r]`, true
	case 'S':
		return `[^ \t\n\r]`, true
	case 'n', 't', 'r':
		return `\` + string(e), true
	case 'f':
		return `\x0C`, true
	case 'v':
		return `\x0B`, true
	case '\\', '"', '^', '$', '.', '[', ']', '(', ')', '|', '{', '}', '*', '+', '?':
		return `\` + string(e), true // kept escaped: the converter unescapes them
	}
	if e < 0x80 && e >= 0x20 && e != 0x7f && !isAlnum(e) {
		return string(e), true // /, -, ', ...: itself
	}
	return "", false // \b, \B, \p, \1, \u{...}, \x (ambiguous lengths) and the like
}

func isAlnum(c byte) bool {
	return c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9'
}

// charClass reads the class at the start of s ("[...]") and returns it as the
// converter passes it on to GBNF, and its length.
func charClass(s string) (string, int, bool) {
	var b strings.Builder
	b.WriteByte('[')
	i := 1
	if strings.HasPrefix(s[i:], "^") {
		b.WriteByte('^')
		i++
	}
	first := i
	for ; i < len(s); i++ {
		c := s[i]
		switch {
		case c == ']' && i > first:
			b.WriteByte(']')
			return b.String(), i + 1, true
		case c == ']':
			return "", 0, false // []: matches nothing
		case c == '\\':
			if h := hexEscape(s[i:]); h != "" {
				b.WriteString(h)
				i += len(h) - 1
				continue
			}
			if i+1 >= len(s) {
				return "", 0, false
			}
			i++
			switch e := s[i]; {
			case e == 'd':
				b.WriteString("0-9")
			case e == 'w':
				b.WriteString("a-zA-Z0-9_")
			case e == 's':
				b.WriteString(` \t\n\r`)
			case e == 'n' || e == 't' || e == 'r':
				b.WriteString(`\` + string(e))
			case e < 0x80 && e != 0 && !isAlnum(e):
				fmt.Fprintf(&b, `\x%02X`, e) // ], -, \, ... as themselves
			default:
				return "", 0, false // \D, \b, \p{...} in a class
			}
		case c == '[':
			return "", 0, false // nested classes ([[:alpha:]]) are not read
		case c == 0:
			return "", 0, false
		case c < 0x20 || c == 0x7f:
			fmt.Fprintf(&b, `\x%02X`, c)
		default:
			b.WriteByte(c)
		}
	}
	return "", 0, false
}

// skippedKeys hold values, not schemas: a "pattern" within them is data.
var skippedKeys = []string{"const", "enum", "default", "examples"}

// RewritePatterns rewrites every pattern of a JSON schema with GrammarPattern,
// in place in its text (the order of keys, which the converter keeps, is
// kept). A pattern GrammarPattern refuses is an error, or with drop set, is
// left out (renamed, so that the converter does not read it).
func RewritePatterns(schema []byte, drop bool) ([]byte, error) {
	type frame struct {
		object, skip bool
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
	keyEnd := 0
	for {
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
				continue
			}
		}
		switch v := tok.(type) {
		case json.Delim:
			switch v {
			case '{', '[':
				skip := top != nil && (top.skip || top.object && slices.Contains(skippedKeys, top.key))
				stack = append(stack, frame{object: v == '{', wantKey: v == '{', skip: skip})
				continue
			default:
				stack = stack[:len(stack)-1]
			}
		case string:
			if top != nil && top.object && top.key == "pattern" && !top.skip {
				from := keyEnd + bytes.IndexByte(schema[keyEnd:], '"')
				to := int(d.InputOffset())
				fixed, err := GrammarPattern(v)
				switch {
				case err == nil:
					q, _ := json.Marshal(fixed)
					edits = append(edits, edit{from, to, string(q)})
				case drop && keyEnd >= len(`"pattern"`) && string(schema[keyEnd-len(`"pattern"`):keyEnd]) == `"pattern"`:
					edits = append(edits, edit{keyEnd - len(`"pattern"`), keyEnd, `"x-unsupported-pattern"`})
				default:
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
