package api

import (
	"bytes"
	"cmp"
	"encoding/json"
	"errors"
	"net/http"

	"github.com/gin-gonic/gin"

	"github.com/shoal-ai/shoal/engine"
	"github.com/shoal-ai/shoal/engine/sample"
)

// llama-server's own endpoints beside /infill, for clients written against it
// (SillyTavern's and text-generation front ends' llama.cpp connections, scripts):
// /completion, /props and /apply-template.

// LlamaCompletionRequest is llama-server's /completion request: one prompt, the
// sampling fields under llama-server's names as well as OpenAI's, and the
// answer in llama-server's shape (InfillResponse).
type LlamaCompletionRequest struct {
	SamplingFields
	Prompt        *LlamaPrompt `json:"prompt"`
	NPredict      *int         `json:"n_predict"`
	RepeatPenalty *float64     `json:"repeat_penalty"`
	// NProbs asks for each token's log-probability and this many likeliest
	// alternatives (completion_probabilities).
	NProbs int `json:"n_probs"`
	// Samplers shoal does not have, which llama-server's clients send turned off
	// (SillyTavern always does): refused when turned on.
	Mirostat       *int     `json:"mirostat"`
	TypicalP       *float64 `json:"typical_p"`
	TFSZ           *float64 `json:"tfs_z"`
	DryMultiplier  *float64 `json:"dry_multiplier"`
	XTCProbability *float64 `json:"xtc_probability"`
	// ResponseFields answers only these fields, as /infill's.
	ResponseFields []string `json:"response_fields"`
}

// LlamaPrompt is llama-server's prompt: a string, token ids, or strings and token
// ids mixed, each string tokenized with control tokens parsed and the first
// with the model's BOS.
type LlamaPrompt []any // string or int64

// UnmarshalJSON takes a string or an array of strings and token ids.
func (p *LlamaPrompt) UnmarshalJSON(b []byte) error {
	if t := bytes.TrimSpace(b); len(t) > 0 && t[0] == '"' {
		var s string
		if err := json.Unmarshal(t, &s); err != nil {
			return err
		}
		*p = LlamaPrompt{s}
		return nil
	}
	var parts []json.RawMessage
	if err := json.Unmarshal(b, &parts); err != nil {
		return errors.New("prompt must be a string, or an array of strings and token ids")
	}
	out := make(LlamaPrompt, 0, len(parts))
	ids := false
	for _, raw := range parts {
		var s string
		var id int64
		switch {
		case json.Unmarshal(raw, &s) == nil:
			out = append(out, s)
		case json.Unmarshal(raw, &id) == nil:
			out, ids = append(out, id), true
		default:
			return errors.New("prompt must be one prompt: a string, or an array of strings and token ids (several prompts are answered by /v1/completions)")
		}
	}
	if len(out) > 1 && !ids {
		// llama-server reads strings alone as several prompts, each answered.
		return errors.New("prompt must be one prompt: an array of strings is several prompts, which /v1/completions answers")
	}
	*p = out
	return nil
}

// unsupported refuses samplers turned on that shoal does not have.
func (r *LlamaCompletionRequest) unsupported() error {
	switch {
	case r.Mirostat != nil && *r.Mirostat != 0:
		return invalid("mirostat", "mirostat sampling is not supported (0: off)")
	case r.TypicalP != nil && *r.TypicalP != 1:
		return invalid("typical_p", "typical_p sampling is not supported (1: off)")
	case r.TFSZ != nil && *r.TFSZ != 1:
		return invalid("tfs_z", "tail-free sampling is not supported (1: off)")
	case r.DryMultiplier != nil && *r.DryMultiplier != 0:
		return invalid("dry_multiplier", "DRY sampling is not supported (0: off)")
	case r.XTCProbability != nil && *r.XTCProbability != 0:
		return invalid("xtc_probability", "XTC sampling is not supported (0: off)")
	}
	return nil
}

// tokens lays out p as llama-server does.
func (p LlamaPrompt) tokens(v engine.Vocab) ([]engine.Token, error) {
	var out []engine.Token
	for i, part := range p {
		switch x := part.(type) {
		case string:
			toks, err := v.Tokenize(x, i == 0, true)
			if err != nil {
				return nil, err
			}
			out = append(out, toks...)
		case int64:
			if x < 0 || x >= int64(v.Size()) {
				return nil, invalid("prompt", "prompt element %d: token id %d is outside the vocabulary (0..%d)", i, x, v.Size()-1)
			}
			out = append(out, engine.Token(x))
		}
	}
	return out, nil
}

// llamaCompletion serves llama-server's /completion: the prompt as given (no
// chat template), answered as /infill answers, whole or as data events.
func (s *Server) llamaCompletion(c *gin.Context) {
	var req LlamaCompletionRequest
	b, forwarded, ok := s.beginGeneration(c, &req, &req.Model, &req.Priority)
	if !ok {
		return
	}
	if req.NProbs < 0 || req.NProbs > sample.MaxTopLogprobs {
		abort(c, invalid("n_probs", "n_probs must be between 0 and %d, got %d", sample.MaxTopLogprobs, req.NProbs))
		return
	}
	if err := req.unsupported(); err != nil {
		abort(c, err)
		return
	}
	p, _, warm, err := s.llamaPlan(b, &req.SamplingFields, req.NPredict, req.RepeatPenalty, "/completion")
	if err != nil {
		abort(c, err)
		return
	}
	if req.NProbs > 0 {
		p.logprobs, p.top = true, req.NProbs
	}
	if req.Prompt == nil {
		abort(c, invalid("prompt", "prompt is required"))
		return
	}
	toks, err := req.Prompt.tokens(b.Vocab)
	if err != nil {
		abort(c, err)
		return
	}
	if len(toks) == 0 {
		abort(c, invalid("prompt", "prompt is empty"))
		return
	}
	// n_predict is a most: the context ends the completion, as llama-server's.
	p.prompts, p.warm, p.maxTokensAsked = [][]engine.Token{toks}, warm, false
	p.infill = &infillPlan{fields: req.ResponseFields}
	s.routeOrRun(c, b, &p, forwarded)
}

// LlamaProps is what llama-server's GET /props says of the model and the server.
type LlamaProps struct {
	DefaultGenerationSettings LlamaSettings   `json:"default_generation_settings"`
	TotalSlots                int             `json:"total_slots"`
	ModelPath                 string          `json:"model_path"` // the model's id: shoal does not show paths
	ChatTemplate              string          `json:"chat_template"`
	Modalities                map[string]bool `json:"modalities"`
	BuildInfo                 string          `json:"build_info"`
}

// LlamaSettings is the part of /props' generation settings clients read.
type LlamaSettings struct {
	NCtx int `json:"n_ctx"` // the longest sequence one request may have
}

func (s *Server) props(c *gin.Context) {
	b, ok := s.readyBackend(c)
	if !ok {
		return
	}
	c.JSON(http.StatusOK, LlamaProps{
		DefaultGenerationSettings: LlamaSettings{NCtx: b.Generator.MaxContext()},
		TotalSlots:                b.Generator.Load().MaxRunning,
		ModelPath:                 s.cfg.ModelName,
		ChatTemplate:              cmp.Or(b.Template, b.Info.ChatTemplate),
		Modalities:                map[string]bool{"vision": false, "audio": false},
		BuildInfo:                 "shoal",
	})
}

// ApplyTemplateRequest is llama-server's /apply-template request: a chat laid
// out as /v1/chat/completions would lay it out, without running it.
type ApplyTemplateRequest struct {
	Model    string    `json:"model"`
	Messages []Message `json:"messages"`
	ToolFields
	ResponseFormat *ResponseFormat `json:"response_format"`
	StructuredFields
	ChatTemplateKwargs   json.RawMessage `json:"chat_template_kwargs"`
	AddGenerationPrompt  *bool           `json:"add_generation_prompt"`
	ContinueFinalMessage bool            `json:"continue_final_message"`
}

func (s *Server) applyTemplate(c *gin.Context) {
	var req ApplyTemplateRequest
	b, ok := s.decodeFor(c, &req, &req.Model)
	if !ok || !generates(c, b) {
		return
	}
	if len(req.Messages) == 0 {
		abort(c, invalid("messages", "messages must not be empty"))
		return
	}
	tp, err := toolsOf(&req.ToolFields, &SamplingFields{ResponseFormat: req.ResponseFormat, StructuredFields: req.StructuredFields})
	var end turnEnd
	if err == nil {
		end, err = turnEndOf(req.AddGenerationPrompt, req.ContinueFinalMessage)
	}
	var text string
	if err == nil {
		text, err = chatPromptEnding(b, req.Messages, tp, req.ChatTemplateKwargs, end)
	}
	if err != nil {
		abort(c, err)
		return
	}
	c.JSON(http.StatusOK, gin.H{"prompt": text})
}
