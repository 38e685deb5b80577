package llama

/*
#cgo CXXFLAGS: -std=c++17
#include <stdlib.h>
#include "llama.h"
#include "grammar_shim.h"

// llama.cpp's JSON-schema converter, as the ollama package compiles it
// (sampling_ext.cpp): it writes at most max_len-1 bytes and returns how many, 0
// when the schema is refused.
int schema_to_grammar(const char *json_schema, char *grammar, size_t max_len);
*/
import "C"

import (
	"bytes"
	"errors"
	"fmt"
	"math"
	"time"
	"unsafe"

	"github.com/shoal-ai/shoal/engine"
)

// Grammar is llama.cpp's GBNF grammar sampler for one request.
type Grammar struct {
	s    *C.struct_llama_sampler
	v    *Vocab
	data *C.llama_token_data // scratch for Apply, grown on demand
	cap  int
	err  error // set once the grammar has failed; later calls are no-ops
}

var _ engine.Grammar = (*Grammar)(nil)

// NewGrammar compiles a GBNF grammar whose start rule is "root", lazy when
// triggers are given (engine.Engine).
func (e *Engine) NewGrammar(gbnf string, triggers []engine.Trigger) (engine.Grammar, error) {
	if e.closed.Load() {
		return nil, engine.ErrClosed
	}
	g, err := newGrammar(e.vocab, gbnf, "root")
	if err != nil || len(triggers) == 0 {
		return g, err
	}
	l := &lazyGrammar{v: e.vocab, gbnf: gbnf, triggers: triggers, ready: g, lead: -1}
	for _, t := range triggers {
		if t.Text == "" {
			g.Close()
			return nil, fmt.Errorf("grammar: empty trigger: %w", engine.ErrInvalidInput)
		}
		l.longest = max(l.longest, len(t.Text))
		l.special = l.special || t.Special
	}
	return l, nil
}

// CheckGrammar reports whether llama.cpp parses gbnf (start rule "root"). Like
// every Vocab method it is safe for concurrent use: the API checks a request's
// grammar before it answers, so that one llama.cpp refuses is a 400, not an
// error in the middle of a stream.
func (v *Vocab) CheckGrammar(gbnf string) error {
	g, err := newGrammar(v, gbnf, "root")
	if err == nil {
		g.Close()
	}
	return err
}

func newGrammar(v *Vocab, gbnf, root string) (*Grammar, error) {
	if gbnf == "" {
		return nil, fmt.Errorf("grammar: empty: %w", engine.ErrInvalidInput)
	}
	if err := engine.CheckRepetitions(gbnf); err != nil {
		return nil, err // llama.cpp would allocate without end
	}
	cg, cr := C.CString(gbnf), C.CString(root)
	defer C.free(unsafe.Pointer(cg))
	defer C.free(unsafe.Pointer(cr))
	s := C.shoal_grammar_init(v.v, cg, cr)
	if s == nil {
		return nil, fmt.Errorf("grammar: llama.cpp could not parse it (GBNF with a root rule expected): %w", engine.ErrInvalidInput)
	}
	return &Grammar{s: s, v: v}, nil
}

// lazyGrammar constrains nothing until a trigger appears in the output, then
// the output from the trigger on. llama.cpp's own lazy grammar matches its
// triggers with std::regex over all the output so far, which recurses once per
// character and overflows the stack on long outputs; here the triggers are
// plain strings, searched for in Go over the output's last bytes.
//
// A trigger may begin inside a token ("\n<tool" then "_call>"): the grammar
// then starts from that token, with the token's text before the trigger as a
// literal prefix of its start rule.
type lazyGrammar struct {
	v        *Vocab
	gbnf     string
	triggers []engine.Trigger
	longest  int      // the longest trigger's length
	special  bool     // control tokens are read as their text
	ready    *Grammar // the grammar as given, for a trigger at a token's start
	// While waiting: the output's tail from absolute offset off, its tokens and
	// where each begins (absolute), and where the output's first byte other
	// than whitespace is (-1: none yet).
	text   []byte
	off    int
	toks   []engine.Token
	starts []int
	lead   int
	g      *Grammar // set once triggered
	err    error
}

// Apply constrains the candidates once the grammar is triggered.
func (l *lazyGrammar) Apply(cands []engine.TokenLogit) {
	if l.g != nil {
		l.g.Apply(cands)
	}
}

// Accept advances the grammar past t, or looks for a trigger.
func (l *lazyGrammar) Accept(t engine.Token) {
	switch {
	case l.g != nil:
		l.g.Accept(t)
		return
	case l.err != nil || l.v.IsEOG(t):
		return
	}
	piece, err := l.v.Piece(t, l.special) // the output's text, as the API reads it
	if err != nil {
		l.err = err
		return
	}
	from := l.off + len(l.text)
	l.toks, l.starts = append(l.toks, t), append(l.starts, from)
	l.text = append(l.text, piece...)
	if l.lead < 0 {
		if i := bytes.IndexFunc(piece, func(r rune) bool { return r != ' ' && r != '\t' && r != '\n' && r != '\r' }); i >= 0 {
			l.lead = from + i
		}
	}
	at := -1
	for _, tr := range l.triggers {
		i := -1
		switch {
		case tr.AtStart:
			if l.lead >= l.off && bytes.HasPrefix(l.text[l.lead-l.off:], []byte(tr.Text)) {
				i = l.lead
			}
		default:
			lo := max(l.off, from-len(tr.Text)+1)
			if j := bytes.Index(l.text[lo-l.off:], []byte(tr.Text)); j >= 0 {
				i = lo + j
			}
		}
		if i >= 0 && (at < 0 || i < at) {
			at = i
		}
	}
	if at < 0 {
		l.trim()
		return
	}
	k := 0 // the token the trigger begins in
	for k+1 < len(l.starts) && l.starts[k+1] <= at {
		k++
	}
	if prefix := l.text[l.starts[k]-l.off : at-l.off]; len(prefix) == 0 {
		l.g, l.ready = l.ready, nil
	} else {
		root := "shoal-lazy-root"
		l.g, l.err = newGrammar(l.v, l.gbnf+"\n"+root+" ::= "+engine.GBNFLiteral(string(prefix))+" root\n", root)
		if l.err != nil {
			return
		}
	}
	for _, tok := range l.toks[k:] {
		l.g.Accept(tok)
	}
	l.text, l.toks, l.starts = nil, nil, nil
}

// trim forgets, in bulk, the tokens that end before any trigger could still
// begin (a trigger at the start begins at or before the first such token).
func (l *lazyGrammar) trim() {
	end := l.off + len(l.text)
	drop := 0
	for drop+1 < len(l.starts) && end-l.starts[drop+1] >= l.longest {
		drop++
	}
	if drop > 64 && drop > len(l.toks)/2 { // in bulk: trimming costs O(1) per token
		base := l.starts[drop]
		l.text = append(l.text[:0], l.text[base-l.off:]...)
		l.off = base
		l.toks = append(l.toks[:0], l.toks[drop:]...)
		l.starts = append(l.starts[:0], l.starts[drop:]...)
	}
}

// Close frees the grammar. Safe twice.
func (l *lazyGrammar) Close() error {
	for _, g := range []*Grammar{l.ready, l.g} {
		if g != nil {
			g.Close()
		}
	}
	return nil
}

// maxGrammarStep bounds one step of a grammar (Apply or Accept). llama.cpp
// follows every way the output so far may continue; a grammar whose
// alternatives overlap (nested anyOf of arrays) multiplies them with each
// token, each step several times slower than the last, and a step cannot be
// interrupted while the whole batch waits. Past this, the grammar allows
// nothing more: the request fails (400), and the others go on.
const maxGrammarStep = time.Second

// errGrammarTooSlow is the failure of a grammar whose step took too long.
var errGrammarTooSlow = errors.New("grammar: a step took longer than a second (a schema whose alternatives overlap?)")

// Apply sets the logits of forbidden candidates to -Inf.
func (g *Grammar) Apply(cands []engine.TokenLogit) {
	if g.err == errGrammarTooSlow {
		for i := range cands {
			cands[i].Logit = float32(math.Inf(-1))
		}
		return
	}
	if g.s == nil || len(cands) == 0 || g.err != nil {
		return
	}
	defer g.timed(time.Now())
	if len(cands) > g.cap {
		C.free(unsafe.Pointer(g.data))
		g.data = (*C.llama_token_data)(C.malloc(C.size_t(len(cands)) * C.size_t(unsafe.Sizeof(C.llama_token_data{}))))
		g.cap = len(cands)
	}
	d := unsafe.Slice(g.data, len(cands))
	for i, c := range cands {
		d[i] = C.llama_token_data{id: C.llama_token(c.Token), logit: C.float(c.Logit)}
	}
	if C.shoal_grammar_apply(g.s, g.data, C.size_t(len(cands))) != 0 {
		g.err = errors.New("grammar apply failed")
		return
	}
	for i := range cands {
		// llama.cpp keeps the order of an unsorted array; ids are rechecked to be safe.
		if engine.Token(d[i].id) == cands[i].Token {
			cands[i].Logit = float32(d[i].logit)
		} else {
			cands[i].Logit = float32(math.Inf(-1))
		}
	}
}

// Accept advances the grammar past t.
func (g *Grammar) Accept(t engine.Token) {
	if g.s == nil || g.err != nil {
		return
	}
	if g.v != nil && g.v.IsEOG(t) {
		// llama.cpp aborts the process (not a C++ exception) on an end of
		// generation the grammar does not allow yet: ask it first.
		c := []engine.TokenLogit{{Token: t}}
		if g.Apply(c); math.IsInf(float64(c[0].Logit), -1) || g.err != nil {
			g.err = fmt.Errorf("grammar: end of generation (token %d) before the grammar is complete", t)
			return
		}
	}
	defer g.timed(time.Now())
	if C.shoal_grammar_accept(g.s, C.llama_token(t)) != 0 {
		g.err = fmt.Errorf("grammar rejected token %d", t)
	}
}

// timed stops the grammar once a step that began at start took too long.
func (g *Grammar) timed(start time.Time) {
	if time.Since(start) > maxGrammarStep && g.err == nil {
		g.err = errGrammarTooSlow
	}
}

// Close frees the sampler. Safe twice.
func (g *Grammar) Close() error {
	if g.s != nil {
		C.llama_sampler_free(g.s)
		g.s = nil
	}
	if g.data != nil {
		C.free(unsafe.Pointer(g.data))
		g.data, g.cap = nil, 0
	}
	return nil
}

// maxGrammarBytes bounds a converted grammar (a request's schema is bounded
// by the request body, a grammar by this).
const maxGrammarBytes = 64 << 20

// SchemaToGrammar converts a JSON schema to GBNF with llama.cpp's converter. It
// fails on invalid JSON or an unsupported schema. The converter's output is cut
// at its buffer's size without telling, so a result that fills the buffer is
// converted again into the largest (ollama's own wrapper would return it cut):
// at most twice. The first buffer is large enough for nearly every schema;
// only what is written of it is touched, but a failed conversion clears it
// all (the wrapper's strncpy pads), so it is not the largest at once.
func SchemaToGrammar(schema []byte) (string, error) {
	// The converter crashes the process on some patterns it does not take, and
	// writes others' quotes raw into the JSON string: every pattern goes
	// through GrammarPattern first.
	if err := engine.CheckSchema(schema); err != nil {
		return "", fmt.Errorf("json schema to grammar: %w", err)
	}
	schema, err := engine.RewritePatterns(schema)
	if err != nil {
		return "", fmt.Errorf("json schema to grammar: %w", err)
	}
	cs := C.CString(string(schema))
	defer C.free(unsafe.Pointer(cs))
	for size := min(max(1<<20, 4*len(schema)), maxGrammarBytes); ; size = maxGrammarBytes {
		buf := C.malloc(C.size_t(size))
		n := int(C.schema_to_grammar(cs, (*C.char)(buf), C.size_t(size)))
		g := C.GoStringN((*C.char)(buf), C.int(n))
		C.free(buf)
		switch {
		case n == 0:
			return "", fmt.Errorf("json schema to grammar: invalid or unsupported schema: %w", engine.ErrInvalidInput)
		case n < size-1:
			return g, nil
		case size >= maxGrammarBytes:
			return "", fmt.Errorf("json schema to grammar: the grammar is larger than %d MiB: %w", maxGrammarBytes>>20, engine.ErrInvalidInput)
		}
	}
}
