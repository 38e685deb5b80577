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
	"errors"
	"fmt"
	"math"
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

// NewGrammar compiles a GBNF grammar whose start rule is "root".
func (e *Engine) NewGrammar(gbnf string) (engine.Grammar, error) {
	if e.closed.Load() {
		return nil, engine.ErrClosed
	}
	return newGrammar(e.vocab, gbnf)
}

func newGrammar(v *Vocab, gbnf string) (*Grammar, error) {
	if gbnf == "" {
		return nil, fmt.Errorf("grammar: empty: %w", engine.ErrInvalidInput)
	}
	cg := C.CString(gbnf)
	defer C.free(unsafe.Pointer(cg))
	s := C.shoal_grammar_init(v.v, cg)
	if s == nil {
		return nil, fmt.Errorf("grammar: llama.cpp could not parse it (GBNF with a root rule expected): %w", engine.ErrInvalidInput)
	}
	return &Grammar{s: s, v: v}, nil
}

// Apply sets the logits of forbidden candidates to -Inf.
func (g *Grammar) Apply(cands []engine.TokenLogit) {
	if g.s == nil || len(cands) == 0 || g.err != nil {
		return
	}
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
	if C.shoal_grammar_accept(g.s, C.llama_token(t)) != 0 {
		g.err = fmt.Errorf("grammar rejected token %d", t)
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
// converted again into a larger one (ollama's own wrapper would return it cut).
func SchemaToGrammar(schema []byte) (string, error) {
	cs := C.CString(string(schema))
	defer C.free(unsafe.Pointer(cs))
	for size := min(max(32<<10, 4*len(schema)), maxGrammarBytes); ; size = min(size*4, maxGrammarBytes) {
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
