package api

import (
	"net/http"
	"unicode/utf8"

	"github.com/gin-gonic/gin"

	"github.com/shoal-ai/shoal/engine"
)

// decodeFor returns the backend after decoding req and checking its model; ok is
// false when the request was answered (not ready, bad body, unknown model, or
// forwarded to the node that serves its model: the answer must come from that
// model's vocabulary or weights).
func (s *Server) decodeFor(c *gin.Context, req any, model *string) (*Backend, bool) {
	b, ok := s.readyBackend(c)
	if !ok {
		return nil, false
	}
	if _, ok := s.begin(c, req, model, nil); !ok {
		return nil, false
	}
	if err := s.checkModel(*model); err != nil {
		abort(c, err)
		return nil, false
	}
	return b, true
}

// chatText lays out f's chat as chat completions would lay it out for b.
func (f *ChatFields) chatText(b *Backend) (string, error) {
	tp, err := toolsOf(&f.ToolFields, &SamplingFields{ResponseFormat: f.ResponseFormat, StructuredFields: f.StructuredFields})
	if err != nil {
		return "", err
	}
	end, err := turnEndOf(f.AddGenerationPrompt, f.ContinueFinalMessage)
	if err != nil {
		return "", err
	}
	return chatPromptEnding(b, f.Messages, tp, f.ChatTemplateKwargs, end)
}

func (s *Server) tokenize(c *gin.Context) {
	var req TokenizeRequest
	b, ok := s.decodeFor(c, &req, &req.Model)
	if !ok {
		return
	}
	if req.Content != nil {
		llamaTokenize(c, b, &req)
		return
	}
	add := true
	if req.AddSpecialTokens != nil {
		add = *req.AddSpecialTokens
	}
	var text string
	switch {
	case req.Prompt != nil && len(req.Messages) == 0:
		text = *req.Prompt
	case req.Prompt == nil && len(req.Messages) > 0:
		var err error
		if text, err = req.chatText(b); err != nil {
			abort(c, err)
			return
		}
		if hasImages(text) {
			abort(c, invalid("messages", "a chat with images is not tokenized here: its images become tokens only where it is computed (the answer's usage counts them)"))
			return
		}
	default:
		abort(c, invalid("prompt", "give exactly one of prompt and messages"))
		return
	}
	toks, err := b.Vocab.Tokenize(text, add, true)
	if err != nil {
		abort(c, err)
		return
	}
	resp := TokenizeResponse{Count: len(toks), MaxModelLen: b.Generator.MaxContext(), Tokens: make([]int32, len(toks))}
	for i, t := range toks {
		resp.Tokens[i] = int32(t)
		if req.ReturnTokenStrs {
			resp.TokenStrs = append(resp.TokenStrs, pieceString(b.Vocab, t))
		}
	}
	c.JSON(http.StatusOK, resp)
}

func (s *Server) detokenize(c *gin.Context) {
	var req DetokenizeRequest
	b, ok := s.decodeFor(c, &req, &req.Model)
	if !ok {
		return
	}
	if req.Tokens == nil {
		abort(c, invalid("tokens", "tokens is required (a list of token ids)"))
		return
	}
	toks := make([]engine.Token, len(req.Tokens))
	for i, t := range req.Tokens {
		if t < 0 || t >= int64(b.Vocab.Size()) {
			abort(c, invalid("tokens", "token %d at %d is outside the vocabulary (0..%d)", t, i, b.Vocab.Size()-1))
			return
		}
		toks[i] = engine.Token(t)
	}
	text, err := b.Vocab.Detokenize(toks, false, false)
	if err != nil {
		abort(c, err)
		return
	}
	c.JSON(http.StatusOK, DetokenizeResponse{Prompt: text, Content: text})
}

// llamaTokenize answers a /tokenize request in llama-server's shape.
func llamaTokenize(c *gin.Context, b *Backend, req *TokenizeRequest) {
	if req.Prompt != nil || len(req.Messages) > 0 {
		abort(c, invalid("content", "give content (llama-server's field) or prompt or messages (vLLM's), not both"))
		return
	}
	toks, err := b.Vocab.Tokenize(*req.Content, req.AddSpecial, req.ParseSpecial == nil || *req.ParseSpecial)
	if err != nil {
		abort(c, err)
		return
	}
	resp := LlamaTokenizeResponse{Tokens: make([]any, len(toks))}
	for i, t := range toks {
		resp.Tokens[i] = int32(t)
		if req.WithPieces {
			var piece any = pieceString(b.Vocab, t)
			if p, _ := b.Vocab.Piece(t, true); !utf8.Valid(p) {
				piece = pieceBytes(b.Vocab, t)
			}
			resp.Tokens[i] = gin.H{"id": int32(t), "piece": piece}
		}
	}
	c.JSON(http.StatusOK, resp)
}
