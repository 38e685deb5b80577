package llama

/*
#include <stdlib.h>
#include "llama.h"
*/
import "C"

import (
	"errors"
	"fmt"
	"slices"
	"sync"
	"unsafe"

	"github.com/shoal-ai/shoal/engine"
)

// Vocab is the model's tokenizer. llama.cpp's vocabulary functions only read the
// loaded model, so every method is safe for concurrent use.
type Vocab struct {
	model *C.struct_llama_model
	v     *C.struct_llama_vocab
	n     int
	tmpl  *C.char // the model's chat template, when it is the one used
	// named is the chat format used instead: a built-in name or a template text
	// (Config.ChatTemplate, or ChatML for a model without a template).
	named string
	// unsupported: the model's own template is one llama.cpp does not recognise.
	unsupported bool
	// cut holds the special tokens long texts are cut at (Tokenize), without
	// and with parsing special tokens, built on first use.
	cut     [2]*specials
	cutOnce [2]sync.Once
}

var _ engine.Vocab = (*Vocab)(nil)

// newVocab reads m's vocabulary and picks the chat format: chatTemplate when set,
// else the model's own template, else ChatML.
func newVocab(m *C.struct_llama_model, chatTemplate string) *Vocab {
	v := C.llama_model_get_vocab(m)
	voc := &Vocab{model: m, v: v, n: int(C.llama_vocab_n_tokens(v))}
	switch own := C.llama_model_chat_template(m, nil); {
	case chatTemplate != "":
		voc.named = chatTemplate
	case own == nil:
		voc.named = chatMLTemplate
	default:
		voc.tmpl = own
		voc.unsupported = !chatTemplateWorks(own)
	}
	return voc
}

// ChatTemplate names the chat format messages are rendered in: "model" (the model's
// own template), or the built-in name or template text used instead.
func (v *Vocab) ChatTemplate() string {
	if v.tmpl != nil {
		return "model"
	}
	return v.named
}

// template is the model's own template text when it is the one used.
func (v *Vocab) template() string {
	if v.tmpl == nil {
		return ""
	}
	return C.GoString(v.tmpl)
}

// chatTemplateWorks reports whether llama.cpp renders a chat with tmpl, a built-in
// format's name or a template text it recognises.
func chatTemplateWorks(tmpl *C.char) bool {
	role, content := C.CString("user"), C.CString("hi")
	defer C.free(unsafe.Pointer(role))
	defer C.free(unsafe.Pointer(content))
	msg := C.struct_llama_chat_message{role: role, content: content}
	return C.llama_chat_apply_template(tmpl, &msg, 1, true, nil, 0) >= 0
}

// ChatTemplateNames lists llama.cpp's built-in chat formats (Config.ChatTemplate).
func ChatTemplateNames() []string {
	n := C.llama_chat_builtin_templates(nil, 0)
	if n <= 0 {
		return nil
	}
	names := make([]*C.char, n)
	C.llama_chat_builtin_templates(&names[0], C.size_t(n))
	out := make([]string, n)
	for i, c := range names {
		out[i] = C.GoString(c)
	}
	return out
}

// Size is the number of tokens.
func (v *Vocab) Size() int { return v.n }

// BOS is the beginning-of-sequence token.
func (v *Vocab) BOS() engine.Token { return engine.Token(C.llama_vocab_bos(v.v)) }

// EOS is the end-of-sequence token.
func (v *Vocab) EOS() engine.Token { return engine.Token(C.llama_vocab_eos(v.v)) }

// IsEOG reports whether t ends generation.
func (v *Vocab) IsEOG(t engine.Token) bool {
	return v.valid(t) && bool(C.llama_vocab_is_eog(v.v, C.llama_token(t)))
}

// AddBOS reports whether prompts start with BOS.
func (v *Vocab) AddBOS() bool { return bool(C.llama_vocab_get_add_bos(v.v)) }

// FIM returns the fill-in-the-middle tokens llama.cpp found: from the GGUF's
// tokenizer.ggml.fim_*_token_id, else by their text (<|fim_prefix|>, <PRE>,
// <fim-prefix>, ...). LLAMA_TOKEN_NULL is -1, engine.NoToken.
func (v *Vocab) FIM() engine.FIMTokens {
	return engine.FIMTokens{
		Pre: engine.Token(C.llama_vocab_fim_pre(v.v)),
		Suf: engine.Token(C.llama_vocab_fim_suf(v.v)),
		Mid: engine.Token(C.llama_vocab_fim_mid(v.v)),
		Pad: engine.Token(C.llama_vocab_fim_pad(v.v)),
		Rep: engine.Token(C.llama_vocab_fim_rep(v.v)),
		Sep: engine.Token(C.llama_vocab_fim_sep(v.v)),
	}
}

func (v *Vocab) valid(t engine.Token) bool { return t >= 0 && int(t) < v.n }

// Tokenize splits text into tokens. A long text is tokenized in pieces, cut
// where llama.cpp's own partition of it at special tokens has a boundary
// (cuts): the same tokens, without the cost that grows with the square of the
// special tokens in one call.
func (v *Vocab) Tokenize(text string, addSpecial, parseSpecial bool) ([]engine.Token, error) {
	if len(text) < cutMinBytes {
		return v.tokenize(text, addSpecial, parseSpecial)
	}
	sp := v.cutter(parseSpecial)
	var cuts []int
	if sp != nil && (sp.wrapOK || !addSpecial) {
		cuts = sp.cuts(text)
	}
	if len(cuts) == 0 {
		return v.tokenize(text, addSpecial, parseSpecial)
	}
	var out []engine.Token
	if addSpecial {
		out = append(out, sp.pre...)
	}
	from := 0
	for _, to := range append(cuts, len(text)) {
		toks, err := v.tokenize(text[from:to], false, parseSpecial)
		if err != nil {
			return nil, err
		}
		out, from = append(out, toks...), to
	}
	if addSpecial {
		out = append(out, sp.post...)
	}
	return out, nil
}

// tokenize is one call of llama.cpp's tokenizer.
func (v *Vocab) tokenize(text string, addSpecial, parseSpecial bool) ([]engine.Token, error) {
	ctext := C.CString(text)
	defer C.free(unsafe.Pointer(ctext))
	// One token per byte plus BOS/EOS is an upper bound for every llama.cpp tokenizer.
	capacity := len(text) + 2
	buf := make([]engine.Token, capacity)
	n := C.llama_tokenize(v.v, ctext, C.int32_t(len(text)), (*C.llama_token)(unsafe.Pointer(&buf[0])), C.int32_t(capacity), C.bool(addSpecial), C.bool(parseSpecial))
	if n < 0 {
		if n == C.int32_t(-2147483648) {
			return nil, fmt.Errorf("tokenize: text of %d bytes is too long", len(text))
		}
		// The bound above should hold; retry with the size llama.cpp asked for.
		capacity = int(-n)
		buf = make([]engine.Token, capacity)
		n = C.llama_tokenize(v.v, ctext, C.int32_t(len(text)), (*C.llama_token)(unsafe.Pointer(&buf[0])), C.int32_t(capacity), C.bool(addSpecial), C.bool(parseSpecial))
		if n < 0 {
			return nil, fmt.Errorf("tokenize: llama.cpp failed (%d)", int(n))
		}
	}
	return buf[:n], nil
}

// Piece returns the bytes of one token.
func (v *Vocab) Piece(t engine.Token, special bool) ([]byte, error) {
	if !v.valid(t) {
		return nil, fmt.Errorf("piece of token %d: outside vocabulary [0,%d): %w", t, v.n, engine.ErrInvalidInput)
	}
	var small [64]byte
	buf := small[:]
	for range 2 {
		n := C.llama_token_to_piece(v.v, C.llama_token(t), (*C.char)(unsafe.Pointer(&buf[0])), C.int32_t(len(buf)), 0, C.bool(special))
		if n >= 0 {
			return append([]byte(nil), buf[:n]...), nil
		}
		buf = make([]byte, int(-n))
	}
	return nil, fmt.Errorf("piece of token %d: llama.cpp failed", t)
}

// Detokenize renders whole token sequences.
func (v *Vocab) Detokenize(tokens []engine.Token, removeSpecial, unparseSpecial bool) (string, error) {
	for i, t := range tokens {
		if !v.valid(t) {
			return "", fmt.Errorf("detokenize: token %d at %d outside vocabulary [0,%d): %w", t, i, v.n, engine.ErrInvalidInput)
		}
	}
	if len(tokens) == 0 {
		return "", nil
	}
	size := len(tokens)*8 + 16
	for range 2 {
		buf := make([]byte, size)
		n := C.llama_detokenize(v.v, (*C.llama_token)(unsafe.Pointer(&tokens[0])), C.int32_t(len(tokens)),
			(*C.char)(unsafe.Pointer(&buf[0])), C.int32_t(size), C.bool(removeSpecial), C.bool(unparseSpecial))
		if n >= 0 {
			return string(buf[:n]), nil
		}
		size = int(-n)
	}
	return "", errors.New("detokenize: llama.cpp failed")
}

// chatMLTemplate is the fallback for models without a template: llama.cpp recognises
// the name and renders ChatML, the format most chat-tuned open models use.
const chatMLTemplate = "chatml"

// ApplyChatTemplate renders messages in the format ChatTemplate names. llama.cpp
// matches a template against its built-in formats; a model template it does not
// recognise is an error rather than a silent fallback (Open logs a warning, and
// Config.ChatTemplate chooses a format).
func (v *Vocab) ApplyChatTemplate(msgs []engine.ChatMessage, addAssistant bool) (string, error) {
	if v.unsupported {
		return "", fmt.Errorf("apply chat template: llama.cpp does not support this model's template; choose a built-in chat format for it (shoal serve --chat-template): %w", engine.ErrUnsupported)
	}
	tmpl := v.tmpl
	if tmpl == nil {
		tmpl = C.CString(v.named)
		defer C.free(unsafe.Pointer(tmpl))
	}
	n := len(msgs)
	cmsgs := (*C.struct_llama_chat_message)(C.calloc(C.size_t(max(n, 1)), C.size_t(unsafe.Sizeof(C.struct_llama_chat_message{}))))
	defer C.free(unsafe.Pointer(cmsgs))
	view := unsafe.Slice(cmsgs, max(n, 1))
	total := 0
	for i, m := range msgs {
		view[i].role = C.CString(m.Role)
		view[i].content = C.CString(m.Content)
		total += len(m.Role) + len(m.Content)
	}
	defer func() {
		for i := range n {
			C.free(unsafe.Pointer(view[i].role))
			C.free(unsafe.Pointer(view[i].content))
		}
	}()
	size := 2*total + 256
	for range 2 {
		buf := (*C.char)(C.malloc(C.size_t(size)))
		r := C.llama_chat_apply_template(tmpl, cmsgs, C.size_t(n), C.bool(addAssistant), buf, C.int32_t(size))
		if r < 0 {
			C.free(unsafe.Pointer(buf))
			return "", fmt.Errorf("apply chat template: llama.cpp does not support this model's template: %w", engine.ErrUnsupported)
		}
		if int(r) <= size {
			s := C.GoStringN(buf, r)
			C.free(unsafe.Pointer(buf))
			return s, nil
		}
		C.free(unsafe.Pointer(buf))
		size = int(r)
	}
	return "", errors.New("apply chat template: output size changed between calls")
}

// llama.cpp's tokenizer finds special tokens in a text (tokenizer_st_partition)
// at a cost that grows with the square of how many it finds: a walk from the
// start of its list of fragments per match. A chat of 20,000 short turns (700
// KB, 40,000 <|im_start|> and <|im_end|>) took 3.8 s to tokenize, 60,000 turns
// 45 s, within one request body. Tokenize therefore cuts a long text where
// llama.cpp's partition of it has a boundary anyway, after every few hundred
// special tokens, and tokenizes the pieces apart: the same tokens, at a cost
// that grows with the text.

// Cutting thresholds (variables for the tests): texts shorter than cutMinBytes
// are tokenized whole; longer ones are cut after every cutEvery special
// tokens found, where a cut is safe.
var (
	cutMinBytes = 16 << 10
	cutEvery    = 256
)

// specials are the texts llama.cpp's partition looks for: those of control,
// user-defined and unknown tokens (only user-defined ones when special tokens
// are not parsed), in a trie.
type specials struct {
	root   [256]int32 // first byte → node, 0: none
	nodes  []specialNode
	maxLen int
	wrapOK bool // addSpecial's tokens around a text are known (pre, post)
	pre    []engine.Token
	post   []engine.Token
}

type specialNode struct {
	next map[byte]int32
	tok  int32 // the special token whose text ends here, -1: none
	// rstrip, lstrip: that token strips the whitespace after, before it.
	rstrip, lstrip bool
}

// cutter returns the specials for parseSpecial, built on first use.
func (v *Vocab) cutter(parseSpecial bool) *specials {
	i := 0
	if parseSpecial {
		i = 1
	}
	v.cutOnce[i].Do(func() { v.cut[i] = v.buildSpecials(parseSpecial) })
	return v.cut[i]
}

// buildSpecials reads the vocabulary's special tokens; nil when cutting cannot
// be proven safe for it (a special token with no text, or addSpecial's tokens
// not found around a probe).
func (v *Vocab) buildSpecials(parseSpecial bool) *specials {
	want := C.enum_llama_token_attr(C.LLAMA_TOKEN_ATTR_USER_DEFINED)
	if parseSpecial {
		want |= C.LLAMA_TOKEN_ATTR_CONTROL | C.LLAMA_TOKEN_ATTR_UNKNOWN
	}
	sp := &specials{nodes: []specialNode{{tok: -1}}}
	for id := 0; id < v.n; id++ {
		attr := C.llama_vocab_get_attr(v.v, C.llama_token(id))
		if attr&want == 0 {
			continue
		}
		text := C.GoString(C.llama_vocab_get_text(v.v, C.llama_token(id)))
		if text == "" {
			return nil
		}
		sp.maxLen = max(sp.maxLen, len(text))
		n := int32(0)
		for i := 0; i < len(text); i++ {
			var next int32
			if n == 0 {
				next = sp.root[text[i]]
			} else {
				next = sp.nodes[n].next[text[i]]
			}
			if next == 0 {
				next = int32(len(sp.nodes))
				sp.nodes = append(sp.nodes, specialNode{tok: -1})
				if n == 0 {
					sp.root[text[i]] = next
				} else {
					if sp.nodes[n].next == nil {
						sp.nodes[n].next = map[byte]int32{}
					}
					sp.nodes[n].next[text[i]] = next
				}
			}
			n = next
		}
		sp.nodes[n].tok = int32(id)
		sp.nodes[n].rstrip = sp.nodes[n].rstrip || attr&C.LLAMA_TOKEN_ATTR_RSTRIP != 0
		sp.nodes[n].lstrip = sp.nodes[n].lstrip || attr&C.LLAMA_TOKEN_ATTR_LSTRIP != 0
	}
	// What addSpecial puts around a text (BOS; EOS, SEP where the model adds
	// them): the tokens of a probe with it, around those without.
	with, err1 := v.tokenize("a", true, false)
	without, err2 := v.tokenize("a", false, false)
	if err1 != nil || err2 != nil || len(without) == 0 {
		return sp
	}
	for i := 0; i+len(without) <= len(with); i++ {
		if slices.Equal(with[i:i+len(without)], without) {
			sp.pre, sp.post, sp.wrapOK = with[:i], with[i+len(without):], true
			break
		}
	}
	return sp
}

// match calls fn for each special token whose text begins text[i:], shortest
// first, with the length of its text and its node; fn returns false to stop.
func (sp *specials) match(text string, i int, fn func(n int, node *specialNode) bool) {
	n := sp.root[text[i]]
	for j := i; n != 0; {
		if node := &sp.nodes[n]; node.tok >= 0 && !fn(j+1-i, node) {
			return
		}
		if j++; j == len(text) {
			return
		}
		n = sp.nodes[n].next[text[j]]
	}
}

// cuts are the offsets at which text may be tokenized in pieces with the
// tokens of the whole: each just after a special token T at [p, q) that
// llama.cpp's partition takes as it stands, so that no fragment crosses q.
// The partition takes special tokens longest first, each at its leftmost
// occurrences in what is still text. T at p is taken when no occurrence of a
// token at least as long overlaps [p, q) but its own (a shorter one comes
// later, when [p, q) is taken: it matches on neither side of q, whole or
// cut), and when its first and last bytes are not spaces, so that a
// neighbour's stripping of whitespace (the LSTRIP and RSTRIP attributes) stops
// at it. A T that strips the whitespace after it (Phi-3's do) is cut before
// instead, the piece after beginning with it, unless it strips the whitespace
// before it too. A cut follows every cutEvery special tokens found.
func (sp *specials) cuts(text string) []int {
	var out []int
	found := 0
	for i := 0; i < len(text); i++ {
		if sp.root[text[i]] == 0 {
			continue
		}
		longest, strip := 0, (*specialNode)(nil)
		sp.match(text, i, func(n int, node *specialNode) bool { longest, strip = n, node; return true })
		if longest == 0 {
			continue
		}
		if found++; found < cutEvery {
			continue
		}
		q := i + longest
		if isSpace(text[i]) || isSpace(text[q-1]) || !sp.alone(text, i, q) {
			continue
		}
		cut := q
		if strip.rstrip {
			if strip.lstrip || i == 0 || len(out) > 0 && out[len(out)-1] >= i {
				continue
			}
			cut = i
		}
		out = append(out, cut)
		found = 0
		i = q - 1
	}
	return out
}

// alone reports whether no special token at least as long as the one at
// [p, q) overlaps [p, q), but that one.
func (sp *specials) alone(text string, p, q int) bool {
	ok := true
	for s := max(0, p-sp.maxLen+1); s < q && ok; s++ {
		sp.match(text, s, func(n int, _ *specialNode) bool {
			if n >= q-p && s+n > p && !(s == p && n == q-p) {
				ok = false
			}
			return ok
		})
	}
	return ok
}

// isSpace is C's isspace, which llama.cpp's stripping uses.
func isSpace(b byte) bool {
	return b == ' ' || b == '\t' || b == '\n' || b == '\v' || b == '\f' || b == '\r'
}
