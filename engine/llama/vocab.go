package llama

/*
#include <stdlib.h>
#include "llama.h"
*/
import "C"

import (
	"errors"
	"fmt"
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

// Tokenize splits text into tokens.
func (v *Vocab) Tokenize(text string, addSpecial, parseSpecial bool) ([]engine.Token, error) {
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
