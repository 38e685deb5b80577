package sim

import (
	"strings"

	"github.com/shoal-ai/shoal/engine"
)

// vocab: 0 <unk>, 1 BOS, 2 EOS, then the 256 bytes. Safe for concurrent use.
type vocab struct{ n int }

func (v vocab) Size() int                 { return v.n }
func (v vocab) BOS() engine.Token         { return 1 }
func (v vocab) EOS() engine.Token         { return 2 }
func (v vocab) IsEOG(t engine.Token) bool { return t == 2 }
func (v vocab) AddBOS() bool              { return true }
func (v vocab) FIM() engine.FIMTokens     { return engine.NoFIM }

func (v vocab) Tokenize(s string, addSpecial, _ bool) ([]engine.Token, error) {
	out := make([]engine.Token, 0, len(s)+1)
	if addSpecial {
		out = append(out, 1)
	}
	for _, b := range []byte(s) {
		out = append(out, engine.Token(3+int(b)))
	}
	return out, nil
}

func (v vocab) Piece(t engine.Token, _ bool) ([]byte, error) {
	if t < 3 || int(t) >= v.n {
		return nil, nil
	}
	return []byte{byte(t - 3)}, nil
}

func (v vocab) Detokenize(ts []engine.Token, _, _ bool) (string, error) {
	var b strings.Builder
	for _, t := range ts {
		if t >= 3 && int(t) < v.n {
			b.WriteByte(byte(t - 3))
		}
	}
	return b.String(), nil
}

// ApplyChatTemplate renders ChatML.
func (v vocab) ApplyChatTemplate(m []engine.ChatMessage, addAssistant bool) (string, error) {
	var b strings.Builder
	for _, x := range m {
		b.WriteString("<|im_start|>" + x.Role + "\n" + x.Content + "<|im_end|>\n")
	}
	if addAssistant {
		b.WriteString("<|im_start|>assistant\n")
	}
	return b.String(), nil
}
