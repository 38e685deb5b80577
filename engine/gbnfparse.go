package engine

import (
	"fmt"
	"slices"
	"strconv"
	"strings"
	"unicode/utf8"
)

// Limits on a client's grammar (llama-server's "grammar", vLLM's
// guided_grammar, and the grammar a guided_regex is turned into). llama.cpp's
// parser recurses in C++ once per nested group, where running out of stack
// kills the process, and expands every repetition into copies and rules.
// Reading one in Go costs at most about a microsecond per byte
// (docs/benchmarks.md).
const (
	MaxGrammarBytes    = 256 << 10 // bytes of a client's grammar
	maxGrammarDepth    = 100       // nested groups
	maxGrammarElements = 1 << 20   // elements llama.cpp expands the grammar into (8 bytes each)
	maxGrammarRepeat   = 2000      // llama.cpp's own bound on {m,n}
	maxGrammarChain    = 1000      // rules entered one inside another at one place, groups and repetitions included (llama.cpp recurses along them)
	maxGrammarRun      = 16        // parts in a row that may each be left out
	maxStackedRepeats  = 4         // repetition operators in a row ("a"+?)
	// MaxAlternatives bounds the alternatives a grammar is written with:
	// llama.cpp sets out with one stack per alternative that may begin the
	// output and compares each with the others, so that 20,000 at the start
	// took a second to compile (and took again at every choice).
	MaxAlternatives = 16384
	// maxGrammarStacks bounds the ways llama.cpp follows from one position at
	// once (a stack each, compared with the others): alternatives that each
	// begin with further alternatives multiply them, and 16 levels of two
	// took 10.8 s to compile.
	maxGrammarStacks = MaxAlternatives
	// maxClassItems bounds a character class's characters and ranges, which
	// llama.cpp scans one by one for every character it matches: a class of
	// 20,000 characters under 100 alternatives took seconds per step (\p{L}
	// is 1,181).
	maxClassItems = 2048
)

// ParseGBNF reads a client's GBNF grammar as llama.cpp's parser reads it and
// returns it in a canonical form: one rule per line ("name ::= body"), no
// comments, literals and classes with their control characters escaped, so
// that it can be joined with other grammars (its rules renamed apart). vocab,
// when not nil, checks token references: <[id]> must be a token id and <text>
// exactly one token, as llama.cpp requires.
//
// Besides what llama.cpp refuses (with a message naming the line and column,
// where llama.cpp only logs it), ParseGBNF refuses what llama.cpp would take
// and then fail on: a NUL byte (the C string would end there), invalid UTF-8,
// more than MaxGrammarBytes, groups nested deeper than maxGrammarDepth, more
// than maxGrammarElements once repetitions are expanded, a repetition whose
// minimum passes its maximum (llama.cpp allocates without end), left recursion
// (llama.cpp refuses it, with a message only in its log), an empty class ([]
// or [^], which llama.cpp reads as matching nothing at all, not even a
// character), a repetition other than ? of something that can match
// nothing (unbounded, llama.cpp refuses it as left recursion; bounded, the
// ways of matching nothing multiply and each token's step slows down until
// the node stalls), more than maxStackedRepeats repetition operators in a
// row, and what costs checks: recursion deeper than maxGrammarChain, and runs
// of more than maxGrammarRun parts that may each be left out, more than
// MaxAlternatives alternatives, more than maxGrammarStacks ways followed from
// one position, and classes of more than maxClassItems characters and ranges.
func ParseGBNF(src string, vocab Vocab) (string, error) {
	switch {
	case len(src) > MaxGrammarBytes:
		return "", fmt.Errorf("grammar: %d bytes, more than %d: %w", len(src), MaxGrammarBytes, ErrInvalidInput)
	case !utf8.ValidString(src):
		return "", fmt.Errorf("grammar: not valid UTF-8: %w", ErrInvalidInput)
	case strings.IndexByte(src, 0) >= 0:
		return "", fmt.Errorf("grammar: a NUL byte at %s: %w", lineCol(src, strings.IndexByte(src, 0)), ErrInvalidInput)
	}
	p := &gbnfParser{src: src, vocab: vocab, rules: map[string]*gbnfRule{}, refs: map[string]int{}}
	if err := p.parse(); err != nil {
		return "", fmt.Errorf("grammar: %w: %w", err, ErrInvalidInput)
	}
	return p.out.String(), nil
}

// lineCol names byte offset i of src as "line L, column C" (columns count runes).
func lineCol(src string, i int) string {
	line := 1 + strings.Count(src[:i], "\n")
	col := 1 + utf8.RuneCountInString(src[strings.LastIndexByte(src[:i], '\n')+1:i])
	return fmt.Sprintf("line %d, column %d", line, col)
}

// gbnfRule is a rule's alternatives; gbnfItem one element of a sequence, with
// its repetition.
type (
	gbnfRule []gbnfSeq
	gbnfSeq  []*gbnfItem
	gbnfItem struct {
		ref      string   // a rule reference
		group    gbnfRule // a group
		chars    int      // a literal's characters (0: an empty literal), or 1: a class, a token, .
		elems    int      // llama.cpp's elements for it, before its repetition
		chunk    int      // and after it (what a second repetition repeats)
		min, max int      // repetition: 1, 1 when none; max -1: unbounded
		at       int      // byte offset, for errors
		repeated bool     // a repetition was applied
	}
)

type gbnfParser struct {
	src   string
	pos   int
	vocab Vocab
	out   strings.Builder
	rules map[string]*gbnfRule // by name; a later definition replaces an earlier, as in llama.cpp
	order []string             // names in the order defined
	refs  map[string]int       // referenced names, where first referenced
	reps  []*gbnfItem          // items repeated more than ?
	elems int                  // elements llama.cpp expands the grammar into
	alts  int                  // alternatives of alternations written
	depth int
}

func (p *gbnfParser) errorf(at int, format string, args ...any) error {
	return fmt.Errorf("%s: %s", lineCol(p.src, min(at, len(p.src))), fmt.Sprintf(format, args...))
}

func (p *gbnfParser) peek(k int) byte {
	if p.pos+k < len(p.src) {
		return p.src[p.pos+k]
	}
	return 0
}

func isWordChar(c byte) bool {
	return c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9' || c == '-'
}

// space skips blanks and comments, and line breaks when newlines is set.
func (p *gbnfParser) space(newlines bool) {
	for p.pos < len(p.src) {
		switch c := p.src[p.pos]; {
		case c == ' ' || c == '\t' || newlines && (c == '\r' || c == '\n'):
			p.pos++
		case c == '#':
			for p.pos < len(p.src) && p.src[p.pos] != '\r' && p.src[p.pos] != '\n' {
				p.pos++
			}
		default:
			return
		}
	}
}

func (p *gbnfParser) name() (string, error) {
	start := p.pos
	for p.pos < len(p.src) && isWordChar(p.src[p.pos]) {
		p.pos++
	}
	if p.pos == start {
		return "", p.errorf(start, "expecting a rule name")
	}
	return p.src[start:p.pos], nil
}

func (p *gbnfParser) parse() error {
	p.space(true)
	for p.pos < len(p.src) {
		if err := p.rule(); err != nil {
			return err
		}
	}
	if _, ok := p.rules["root"]; !ok {
		return fmt.Errorf("no rule named root (the grammar's start)")
	}
	for name, at := range p.refs {
		if _, ok := p.rules[name]; !ok {
			return p.errorf(at, "rule %q is referred to but not defined", name)
		}
	}
	nullable := p.nullable()
	for _, it := range p.reps {
		if nullable.base(it) {
			return p.errorf(it.at, "a repetition of something that can match nothing (repeat what matches at least one character, and make the repetition optional: (x+)? for (x?)+)")
		}
	}
	if err := p.leftRecursion(nullable); err != nil {
		return err
	}
	return p.costs(nullable)
}

// rule reads "name ::= alternatives" up to its line's end.
func (p *gbnfParser) rule() error {
	name, err := p.name()
	if err != nil {
		return err
	}
	p.space(false)
	if !strings.HasPrefix(p.src[p.pos:], "::=") {
		return p.errorf(p.pos, "expecting ::= after the rule name %q", name)
	}
	p.pos += 3
	p.space(true)
	p.out.WriteString(name)
	p.out.WriteString(" ::=")
	r, err := p.alternates(false)
	if err != nil {
		return err
	}
	p.out.WriteByte('\n')
	p.elems++ // END
	if _, ok := p.rules[name]; !ok {
		p.order = append(p.order, name)
	}
	p.rules[name] = &r
	switch c := p.peek(0); c {
	case '\r', '\n':
		p.pos++
	case 0:
	default:
		return p.errorf(p.pos, "unexpected %q: expecting the rule's line to end", c)
	}
	p.space(true)
	return nil
}

func (p *gbnfParser) alternates(nested bool) (gbnfRule, error) {
	var r gbnfRule
	for {
		s, err := p.sequence(nested)
		if err != nil {
			return nil, err
		}
		if len(s) == 0 {
			// Written as "", so that nothing after the rule's ::= or | (a
			// grammar joined after this one) is read as part of it.
			p.out.WriteString(` ""`)
		}
		r = append(r, s)
		if p.peek(0) != '|' {
			if len(r) > 1 {
				p.alts += len(r) // of alternations: a lone sequence is none
			}
			return r, nil
		}
		if p.alts+len(r) >= MaxAlternatives {
			return nil, p.errorf(p.pos, "more than %d alternatives", MaxAlternatives)
		}
		p.pos++
		p.out.WriteString(" |")
		p.elems++ // ALT
		p.space(true)
	}
}

func (p *gbnfParser) sequence(nested bool) (gbnfSeq, error) {
	var s gbnfSeq
	var last *gbnfItem
	stacked := 0 // repetition operators applied to last beyond its first
	add := func(it *gbnfItem, text string, elems int) {
		it.elems = elems
		s = append(s, it)
		last = it
		p.elems += elems
		p.out.WriteByte(' ')
		p.out.WriteString(text)
		p.space(nested)
	}
	for p.pos < len(p.src) {
		at := p.pos
		switch c := p.src[p.pos]; {
		case c == '"':
			p.pos++
			var b strings.Builder
			n := 0
			for p.peek(0) != '"' {
				r, err := p.char()
				if err != nil {
					return nil, err
				}
				b.WriteString(gbnfChar(r, false))
				n++
			}
			p.pos++
			it := &gbnfItem{chars: n, min: 1, max: 1, at: at}
			add(it, `"`+b.String()+`"`, n)
		case c == '[':
			p.pos++
			var b strings.Builder
			b.WriteByte('[')
			if p.peek(0) == '^' {
				p.pos++
				b.WriteByte('^')
			}
			n := 0
			for p.peek(0) != ']' {
				r, err := p.char()
				if err != nil {
					return nil, err
				}
				b.WriteString(gbnfChar(r, true))
				n++
				if p.peek(0) == '-' && p.peek(1) != ']' {
					p.pos++
					if p.pos >= len(p.src) {
						return nil, p.errorf(p.pos, "unexpected end inside a character class")
					}
					hi, err := p.char()
					if err != nil {
						return nil, err
					}
					b.WriteByte('-')
					b.WriteString(gbnfChar(hi, true))
					n++
				}
			}
			p.pos++
			if n == 0 {
				return nil, p.errorf(at, "an empty character class (llama.cpp would read it as matching nothing, not one character)")
			}
			if n > maxClassItems {
				return nil, p.errorf(at, "a character class of %d characters and ranges, more than %d (llama.cpp reads them one by one for every character: write ranges)", n, maxClassItems)
			}
			b.WriteByte(']')
			add(&gbnfItem{chars: 1, min: 1, max: 1, at: at}, b.String(), n)
		case c == '<' || c == '!':
			text, err := p.token()
			if err != nil {
				return nil, err
			}
			add(&gbnfItem{chars: 1, min: 1, max: 1, at: at}, text, 1)
		case isWordChar(c):
			name, _ := p.name()
			if _, ok := p.refs[name]; !ok {
				p.refs[name] = at
			}
			add(&gbnfItem{ref: name, min: 1, max: 1, at: at}, name, 1)
		case c == '(':
			if p.depth++; p.depth > maxGrammarDepth {
				return nil, p.errorf(at, "groups nested more than %d deep", maxGrammarDepth)
			}
			p.pos++
			p.space(true)
			p.out.WriteString(" (")
			g, err := p.alternates(true)
			if err != nil {
				return nil, err
			}
			p.depth--
			if p.peek(0) != ')' {
				return nil, p.errorf(p.pos, "expecting ) to close the group opened at %s", lineCol(p.src, at))
			}
			p.pos++
			p.elems++ // the group's rule's END
			add(&gbnfItem{group: g, min: 1, max: 1, at: at}, ")", 1)
		case c == '.':
			p.pos++
			add(&gbnfItem{chars: 1, min: 1, max: 1, at: at}, ".", 1)
		case c == '*' || c == '+' || c == '?' || c == '{':
			lo, hi, text, err := p.repetition(nested)
			if err != nil {
				return nil, err
			}
			if last == nil {
				return nil, p.errorf(at, "%s with nothing before it to repeat", text)
			}
			if last.repeated { // llama.cpp repeats the repetition's rule
				if stacked++; stacked >= maxStackedRepeats {
					return nil, p.errorf(at, "more than %d repetition operators in a row", maxStackedRepeats)
				}
				last = &gbnfItem{group: gbnfRule{{last}}, elems: last.chunk, min: 1, max: 1, at: last.at}
				s[len(s)-1] = last
			} else {
				stacked = 0
			}
			last.min, last.max, last.repeated = lo, hi, true
			if hi != 1 {
				p.reps = append(p.reps, last)
			}
			if err := p.expand(last, lo, hi); err != nil {
				return nil, err
			}
			p.out.WriteString(text)
			p.space(nested)
		default:
			return s, nil
		}
		if p.elems > maxGrammarElements {
			return nil, p.errorf(at, "the grammar expands to more than %d elements (its repetitions are too large)", maxGrammarElements)
		}
	}
	return s, nil
}

// expand counts the elements llama.cpp writes for repeating it lo to hi
// times: lo copies of its elements, and hi-lo rules (one when unbounded) of
// them with a reference, an alternative and an end.
func (p *gbnfParser) expand(it *gbnfItem, lo, hi int) error {
	n := it.elems
	if n == 0 {
		return p.errorf(it.at, "nothing to repeat (an empty literal, or a repetition of none)")
	}
	opt := 1
	if hi >= 0 {
		opt = hi - lo
	}
	p.elems += n*(max(lo, 1)-1) + opt*(n+3) + 1
	it.chunk = n * lo
	if opt > 0 {
		it.chunk++
	}
	return nil
}

// repetition reads *, +, ? or {m}, {m,}, {m,n} (blanks allowed inside the
// braces, line breaks too inside a group, as llama.cpp allows them) and
// returns the bounds and the canonical text.
func (p *gbnfParser) repetition(nested bool) (lo, hi int, text string, err error) {
	at := p.pos
	c := p.src[p.pos]
	p.pos++
	switch c {
	case '*':
		return 0, -1, "*", nil
	case '+':
		return 1, -1, "+", nil
	case '?':
		return 0, 1, "?", nil
	}
	num := func() (int, error) {
		start := p.pos
		for p.pos < len(p.src) && p.src[p.pos] >= '0' && p.src[p.pos] <= '9' {
			p.pos++
		}
		if p.pos == start {
			return 0, p.errorf(p.pos, "expecting a number in the repetition's braces")
		}
		v, err := strconv.Atoi(p.src[start:p.pos])
		if err != nil || v > maxGrammarRepeat {
			return 0, p.errorf(start, "a repetition count above %d", maxGrammarRepeat)
		}
		return v, nil
	}
	p.space(nested)
	if lo, err = num(); err != nil {
		return 0, 0, "", err
	}
	p.space(nested)
	hi = lo
	if p.peek(0) == ',' {
		p.pos++
		p.space(nested)
		hi = -1
		if c := p.peek(0); c >= '0' && c <= '9' {
			if hi, err = num(); err != nil {
				return 0, 0, "", err
			}
			p.space(nested)
		}
	}
	if p.peek(0) != '}' {
		return 0, 0, "", p.errorf(p.pos, "expecting } to close the repetition")
	}
	p.pos++
	switch {
	case hi >= 0 && lo > hi:
		return 0, 0, "", p.errorf(at, "repetition {%d,%d}: its minimum exceeds its maximum", lo, hi)
	case hi == lo:
		text = fmt.Sprintf("{%d}", lo)
	case hi < 0:
		text = fmt.Sprintf("{%d,}", lo)
	default:
		text = fmt.Sprintf("{%d,%d}", lo, hi)
	}
	return lo, hi, text, nil
}

// char reads one character of a literal or class: an escape (\x, \u, \U with
// 2, 4, 8 hex digits, \t \r \n \\ \" \[ \]) or a UTF-8 character.
func (p *gbnfParser) char() (rune, error) {
	if p.pos >= len(p.src) {
		return 0, p.errorf(p.pos, "unexpected end inside a literal or class")
	}
	if p.src[p.pos] != '\\' {
		r, n := utf8.DecodeRuneInString(p.src[p.pos:])
		p.pos += n
		return r, nil
	}
	at := p.pos
	e := p.peek(1)
	p.pos += 2
	digits := map[byte]int{'x': 2, 'u': 4, 'U': 8}[e]
	switch e {
	case 't':
		return '\t', nil
	case 'r':
		return '\r', nil
	case 'n':
		return '\n', nil
	case '\\', '"', '[', ']':
		return rune(e), nil
	case 'x', 'u', 'U':
		if p.pos+digits > len(p.src) {
			return 0, p.errorf(at, "\\%c needs %d hex digits", e, digits)
		}
		v, err := strconv.ParseUint(p.src[p.pos:p.pos+digits], 16, 32)
		if err != nil {
			return 0, p.errorf(at, "\\%c needs %d hex digits", e, digits)
		}
		p.pos += digits
		return rune(v), nil
	}
	return 0, p.errorf(at, "unknown escape \\%s (known: \\x \\u \\U \\t \\r \\n \\\\ \\\" \\[ \\])", string(rune(e)))
}

// token reads <[id]>, <text> or either after !, and checks it against the
// vocabulary.
func (p *gbnfParser) token() (string, error) {
	at := p.pos
	if p.src[p.pos] == '!' {
		p.pos++
	}
	if p.peek(0) != '<' {
		return "", p.errorf(p.pos, "expecting < after !")
	}
	end := strings.IndexByte(p.src[p.pos:], '>')
	if end < 0 {
		return "", p.errorf(p.pos, "expecting > to close the token")
	}
	text := p.src[p.pos : p.pos+end+1]
	p.pos += end + 1
	if strings.ContainsAny(text, "\r\n") {
		return "", p.errorf(at, "a line break inside a token reference")
	}
	if id, ok := strings.CutPrefix(text, "<["); ok {
		id, ok = strings.CutSuffix(id, "]>")
		n, err := strconv.Atoi(id)
		if !ok || err != nil || n < 0 || id == "" || id[0] < '0' || id[0] > '9' {
			return "", p.errorf(at, "token %s: want <[id]> with a token id", text)
		}
		if p.vocab != nil && n >= p.vocab.Size() {
			return "", p.errorf(at, "token %s: this model's token ids are 0..%d", text, p.vocab.Size()-1)
		}
		return p.src[at:p.pos], nil
	}
	if p.vocab != nil {
		toks, err := p.vocab.Tokenize(text, false, true)
		if err != nil || len(toks) != 1 {
			return "", p.errorf(at, "token %s is not one token of this model", text)
		}
	}
	return p.src[at:p.pos], nil
}

// gbnfChar writes r as a literal's (class false) or a class's character:
// quotes, backslashes and control characters escaped (GBNFLiteral's too).
func gbnfChar(r rune, class bool) string {
	switch {
	case r < 0 || !utf8.ValidRune(r):
		return fmt.Sprintf(`\U%08X`, uint32(r))
	case r == '"' || r == '\\':
		return `\` + string(r)
	case r < 0x20 || r == 0x7f:
		return fmt.Sprintf(`\x%02X`, r)
	case class && (r == ']' || r == '['):
		return `\` + string(r)
	case class && (r == '-' || r == '^'):
		return fmt.Sprintf(`\x%02X`, r)
	}
	return string(r)
}

// emptiness answers which rules, groups and items can match nothing; groups
// are remembered, so that groups nested deep are walked once.
type emptiness struct {
	rules  map[string]bool
	groups map[*gbnfItem]bool
}

// nullable is, per rule, whether it can match nothing (a least fixpoint,
// rules taken last defined first, as grammars written top down refer on).
func (p *gbnfParser) nullable() *emptiness {
	e := &emptiness{rules: map[string]bool{}}
	for changed := true; changed; {
		changed = false
		e.groups = map[*gbnfItem]bool{} // what a group's answer rests on may have changed
		for _, name := range slices.Backward(p.order) {
			if !e.rules[name] && e.rule(*p.rules[name]) {
				e.rules[name], changed = true, true
			}
		}
	}
	return e
}

func (e *emptiness) rule(r gbnfRule) bool {
	for _, s := range r {
		if e.seq(s) {
			return true
		}
	}
	return false
}

func (e *emptiness) seq(s gbnfSeq) bool {
	for _, it := range s {
		if it.min > 0 && !e.base(it) {
			return false
		}
	}
	return true
}

// base reports whether the item, without its repetition, can match nothing.
func (e *emptiness) base(it *gbnfItem) bool {
	switch {
	case it.ref != "":
		return e.rules[it.ref]
	case it.group != nil:
		v, ok := e.groups[it]
		if !ok {
			v = e.rule(it.group)
			e.groups[it] = v
		}
		return v
	}
	return it.chars == 0
}

// leftRecursion refuses a rule that can come back to itself before matching
// a character: llama.cpp refuses such a grammar (it would recurse without
// end). It also refuses a chain of more than maxGrammarChain rules each
// beginning with the next, along which llama.cpp recurses in C++.
func (p *gbnfParser) leftRecursion(null *emptiness) error {
	first := map[string][]string{} // rules each rule may begin with
	var starts func(r gbnfRule, into *[]string)
	starts = func(r gbnfRule, into *[]string) {
		for _, s := range r {
			for _, it := range s {
				switch {
				case it.ref != "":
					*into = append(*into, it.ref)
				case it.group != nil:
					starts(it.group, into)
				}
				if it.min > 0 && !null.base(it) {
					break
				}
			}
		}
	}
	for name, r := range p.rules {
		var l []string
		starts(*r, &l)
		first[name] = l
	}
	const (
		unseen = iota
		open
		done
	)
	state := map[string]int{}
	chain := map[string]int{} // the longest chain of rules a rule begins, itself included
	var path []string
	var visit func(name string) error
	visit = func(name string) error {
		switch state[name] {
		case open:
			i := len(path) - 1
			for path[i] != name {
				i--
			}
			return fmt.Errorf("left recursion: %s -> %s can come back to itself before matching a character (llama.cpp cannot run it; recurse after something, as in x ::= item x?)", strings.Join(path[i:], " -> "), name)
		case done:
			return nil
		}
		state[name] = open
		path = append(path, name)
		chain[name] = 1
		for _, next := range first[name] {
			if err := visit(next); err != nil {
				return err
			}
			chain[name] = max(chain[name], chain[next]+1)
		}
		if chain[name] > maxGrammarChain {
			return fmt.Errorf("rule %s begins a chain of more than %d rules each beginning with the next", name, maxGrammarChain)
		}
		path = path[:len(path)-1]
		state[name] = done
		return nil
	}
	for _, name := range p.order {
		if err := visit(name); err != nil {
			return err
		}
	}
	return nil
}

// gbnfCost is what llama.cpp's grammar pays at a position: how deep it
// recurses (llama_grammar_advance_stack, once per rule it enters there,
// groups and repetitions being rules, and once per part it leaves out), and
// the longest run of parts that may each be left out, nested ones counted.
//
// stacks counts the ways llama.cpp follows from a position at once: one per
// character, class or token that may come first, through every rule and group
// begun there and every part that may be left out.
type gbnfCost struct{ depth, run, stacks int }

// addStacks adds stack counts, saturating (they can grow exponentially).
func addStacks(a, b int) int { return min(a+b, 1<<40) }

// costs refuses a grammar whose recursion at some position passes
// maxGrammarChain (a stack overflow in C++ kills the process) or that has a
// run of more than maxGrammarRun parts that may each be left out: to match a
// token's characters, llama.cpp follows every way of placing them among such
// parts, which for n parts and a token of k characters is C(n, k) ways, for
// every token of the vocabulary and step (a hundred "x"? in a row stalled a
// node for seconds per token, a thousand for minutes). Run after
// leftRecursion: the rules begun at a position form no cycle.
func (p *gbnfParser) costs(null *emptiness) error {
	atPos := map[*gbnfItem]gbnfCost{} // a sequence's position, by the item there
	ofRule := map[string]gbnfCost{}
	var seqAt func(s gbnfSeq, i int) gbnfCost
	var rule func(r gbnfRule) gbnfCost
	rule = func(r gbnfRule) gbnfCost {
		var c gbnfCost
		for _, s := range r {
			x := seqAt(s, 0)
			c.depth, c.run, c.stacks = max(c.depth, x.depth), max(c.run, x.run), addStacks(c.stacks, x.stacks)
		}
		return c
	}
	var bad error
	seqAt = func(s gbnfSeq, i int) gbnfCost {
		if i == len(s) || bad != nil {
			return gbnfCost{}
		}
		it := s[i]
		if c, ok := atPos[it]; ok {
			return c
		}
		var c gbnfCost
		switch {
		case it.ref != "":
			r, ok := ofRule[it.ref]
			if !ok {
				r = rule(*p.rules[it.ref])
				ofRule[it.ref] = r
			}
			c = gbnfCost{r.depth + 1, r.run, r.stacks}
		case it.group != nil:
			g := rule(it.group)
			c = gbnfCost{g.depth + 1, g.run, g.stacks}
		case it.chars > 0:
			c.stacks = 1
		}
		if it.min == 0 {
			c.depth++ // the repetition's own rule
		}
		if it.min == 0 || null.base(it) {
			next := seqAt(s, i+1)
			c.depth = max(c.depth, next.depth+1)
			c.run = max(c.run, 1) + next.run
			c.stacks = addStacks(c.stacks, next.stacks)
		}
		switch {
		case bad != nil:
		case c.depth > maxGrammarChain:
			bad = p.errorf(it.at, "llama.cpp would recurse more than %d rules deep here (groups, repetitions and parts left out each count): its stack could run out", maxGrammarChain)
		case c.run > maxGrammarRun:
			bad = p.errorf(it.at, "%d parts in a row from here may each be left out, more than %d: llama.cpp would follow every way of placing a token's characters among them, for every token at every step (write the run as a repetition, or make fewer parts optional)", c.run, maxGrammarRun)
		case c.stacks > maxGrammarStacks:
			bad = p.errorf(it.at, "llama.cpp would follow %d ways from here at once, more than %d (alternatives that begin with further alternatives multiply them)", c.stacks, maxGrammarStacks)
		}
		atPos[it] = c
		return c
	}
	var walk func(r gbnfRule)
	walk = func(r gbnfRule) {
		for _, s := range r {
			for i, it := range s {
				seqAt(s, i)
				if it.group != nil {
					walk(it.group)
				}
			}
		}
	}
	for _, name := range p.order {
		walk(*p.rules[name])
		if bad != nil {
			return bad
		}
	}
	return bad
}
