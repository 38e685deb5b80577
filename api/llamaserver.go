package api

import (
	"bytes"
	"cmp"
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"net/http"

	"github.com/gin-gonic/gin"

	"github.com/shoal-ai/shoal/cluster"
	"github.com/shoal-ai/shoal/engine"
	"github.com/shoal-ai/shoal/engine/sample"
	"github.com/shoal-ai/shoal/scheduler"
)

// llama-server's own endpoints beside /infill, for clients written against it
// (SillyTavern's and text-generation front ends' llama.cpp connections, scripts):
// /completion, /props and /apply-template.

// LlamaCompletionRequest is llama-server's /completion request: a prompt or
// several, the sampling fields under llama-server's names as well as OpenAI's,
// and the answer in llama-server's shape (InfillResponse; an array of them,
// each with its index, for several prompts).
type LlamaCompletionRequest struct {
	SamplingFields
	LlamaFields
	Prompt *LlamaPrompts `json:"prompt"`
}

// LlamaFields are what llama-server's own endpoints (/completion, /infill) take
// beside OpenAI's fields, or name their own way.
type LlamaFields struct {
	NPredict      *int     `json:"n_predict"`      // max_tokens; -1: until the end, 0: the prompt alone
	RepeatPenalty *float64 `json:"repeat_penalty"` // repetition_penalty
	// NProbs asks for each token's log-probability and this many likeliest
	// alternatives (completion_probabilities).
	NProbs int `json:"n_probs"`
	// ResponseFields answers only these fields, nested ones named by their path
	// ("timings/prompt_n"), as llama-server's (llama.vim asks so).
	ResponseFields []string `json:"response_fields"`
	// TFSZ is tail-free sampling, which llama.cpp itself has dropped and
	// older clients send turned off: refused when turned on.
	TFSZ *float64 `json:"tfs_z"`
	// CachePrompt false computes the whole prompt, no cached prefix taken
	// (llama-server's; true by default).
	CachePrompt *bool `json:"cache_prompt"`
}

// LlamaPrompt is llama-server's prompt: a string, token ids, or strings and token
// ids mixed, each string tokenized with control tokens parsed, and the model's
// BOS added when the prompt begins with a string (as llama-server's
// tokenize_mixed adds it).
type LlamaPrompt []any // string or int64

// LlamaPrompts are /completion's prompts, read as llama-server reads them: a
// string, or an array of token ids with or without strings among them, is one
// prompt; any other array lists prompts, each a string or such an array
// (["a", "b"] is two prompts, [[1, 2], "c"] two as well).
type LlamaPrompts []LlamaPrompt

// UnmarshalJSON takes a prompt or an array of prompts.
func (p *LlamaPrompts) UnmarshalJSON(b []byte) error {
	if one, ok := llamaPrompt(b, false); ok {
		*p = LlamaPrompts{one}
		return nil
	}
	var parts []json.RawMessage
	if err := json.Unmarshal(b, &parts); err != nil {
		return errors.New("prompt must be a string, an array of strings and token ids, or an array of such prompts")
	}
	out := make(LlamaPrompts, 0, len(parts))
	for i, raw := range parts {
		one, ok := llamaPrompt(raw, true)
		if !ok {
			return fmt.Errorf("prompt %d must be a string, or an array of token ids and strings", i)
		}
		out = append(out, one)
	}
	*p = out
	return nil
}

// llamaPrompt reads b as one prompt: a string, or an array of token ids and
// strings with at least one id (as llama-server reads one: an array of
// strings alone lists prompts), or empty when listed.
func llamaPrompt(b []byte, listed bool) (LlamaPrompt, bool) {
	b = bytes.TrimSpace(b)
	if len(b) > 0 && b[0] == '"' {
		var s string
		if json.Unmarshal(b, &s) != nil {
			return nil, false
		}
		return LlamaPrompt{s}, true
	}
	var parts []json.RawMessage
	if json.Unmarshal(b, &parts) != nil || parts == nil {
		return nil, false
	}
	out := make(LlamaPrompt, 0, len(parts))
	ids := false
	for _, raw := range parts {
		var s string
		var id int64
		switch raw = bytes.TrimSpace(raw); {
		case len(raw) > 0 && raw[0] == '"' && json.Unmarshal(raw, &s) == nil:
			out = append(out, s)
		case len(raw) > 0 && (raw[0] == '-' || raw[0] >= '0' && raw[0] <= '9') && json.Unmarshal(raw, &id) == nil:
			out, ids = append(out, id), true
		default:
			return nil, false // null, true, an object, a nested array, a fraction
		}
	}
	return out, ids || listed && len(out) == 0
}

// unsupported refuses a sampler turned on that shoal does not have.
func (r *LlamaFields) unsupported() error {
	if r.TFSZ != nil && *r.TFSZ != 1 {
		return invalid("tfs_z", "tail-free sampling is not supported, as in llama.cpp since 2024 (1: off)")
	}
	return nil
}

// tokens lays out p as llama-server does.
func (p LlamaPrompt) tokens(v engine.Vocab, where string) ([]engine.Token, error) {
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
				return nil, invalid("prompt", "%s, element %d: token id %d is outside the vocabulary (0..%d)", where, i, x, v.Size()-1)
			}
			out = append(out, engine.Token(x))
		}
	}
	return out, nil
}

// llamaPlan is the sampling plan of a request to one of llama-server's own
// endpoints, with its fields (l) and llama-server's meanings: n_predict (else
// max_tokens; maxTokens is nil for -1, until the end, as llama-server's
// default; 0 computes the prompt and answers nothing, warm: llama.vscode warms
// the cache with its context so), repeat_penalty (repetition_penalty) and
// n_probs. endpoint names it in errors.
func (s *Server) llamaPlan(b *Backend, f *SamplingFields, l *LlamaFields, endpoint string) (p plan, maxTokens *int, warm bool, err error) {
	if l.NProbs < 0 || l.NProbs > sample.MaxTopLogprobs {
		return p, nil, false, invalid("n_probs", "n_probs must be between 0 and %d, got %d", sample.MaxTopLogprobs, l.NProbs)
	}
	if err := l.unsupported(); err != nil {
		return p, nil, false, err
	}
	maxTokens, param := f.MaxTokens, "max_tokens"
	if l.NPredict != nil {
		maxTokens, param = l.NPredict, "n_predict"
	}
	if maxTokens != nil && *maxTokens <= 0 {
		if *maxTokens < -1 {
			return p, nil, false, invalid(param, "%s must be -1 (until the end), 0 (the prompt alone) or more, got %d", param, *maxTokens)
		}
		if *maxTokens == 0 {
			one := 1
			maxTokens, warm = &one, true
		} else {
			maxTokens = nil
		}
	}
	if f.RepetitionPenalty == nil {
		f.RepetitionPenalty = l.RepeatPenalty
	}
	// Values llama-server gives meanings OpenAI's API refuses: a negative seed,
	// or 4294967295 (its LLAMA_DEFAULT_SEED), is a new one each time; and
	// llama.cpp's sampling values (llamaMeanings).
	if f.Seed != nil && (*f.Seed < 0 || *f.Seed == math.MaxUint32) {
		f.Seed = nil
	}
	f.llamaMeanings()
	if f.N != nil && *f.N != 1 {
		return p, nil, false, invalid("n", "%s answers one completion", endpoint)
	}
	if p, err = s.samplingPlan(b, f, param, maxTokens); err != nil {
		return p, nil, false, err
	}
	if p.promptScores {
		return p, nil, false, invalid("prompt_logprobs", "%s does not answer prompt_logprobs", endpoint)
	}
	if l.NProbs > 0 {
		p.logprobs, p.top = true, l.NProbs
	}
	p.req.NoCache = l.CachePrompt != nil && !*l.CachePrompt
	return p, maxTokens, warm, nil
}

// llamaCompletion serves llama-server's /completion: the prompt as given (no
// chat template), answered as /infill answers, whole or as data events.
func (s *Server) llamaCompletion(c *gin.Context) {
	var req LlamaCompletionRequest
	b, forwarded, ok := s.beginGeneration(c, &req, &req.Model, &req.Priority)
	if !ok {
		return
	}
	p, _, warm, err := s.llamaPlan(b, &req.SamplingFields, &req.LlamaFields, "/completion")
	if err != nil {
		abort(c, err)
		return
	}
	if req.Prompt == nil {
		abort(c, invalid("prompt", "prompt is required"))
		return
	}
	switch n := len(*req.Prompt); {
	case n == 0:
		abort(c, invalid("prompt", "prompt is empty"))
		return
	case n > scheduler.MaxChoices*4:
		abort(c, invalid("prompt", "%d prompts are too many for one request (at most %d)", n, scheduler.MaxChoices*4))
		return
	}
	for i, one := range *req.Prompt {
		toks, err := one.tokens(b.Vocab, which("prompt", i, len(*req.Prompt)))
		if err != nil {
			abort(c, err)
			return
		}
		if len(toks) == 0 {
			abort(c, invalid("prompt", "%s is empty", which("prompt", i, len(*req.Prompt))))
			return
		}
		p.prompts = append(p.prompts, toks)
	}
	// n_predict is a most: the context ends the completion, as llama-server's.
	p.warm, p.maxTokensAsked = warm, false
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
		Modalities:                map[string]bool{"vision": b.Projector != nil, "audio": false},
		BuildInfo:                 "shoal",
	})
}

// ApplyTemplateRequest is llama-server's /apply-template request: a chat laid
// out as /v1/chat/completions would lay it out, without running it.
type ApplyTemplateRequest struct {
	Model string `json:"model"`
	ChatFields
}

func (s *Server) applyTemplate(c *gin.Context) {
	var req ApplyTemplateRequest
	b, ok := s.decodeFor(c, &req, &req.Model)
	if !ok || !serves(c, b, cluster.TaskGenerate) {
		return
	}
	if len(req.Messages) == 0 {
		abort(c, invalid("messages", "messages must not be empty"))
		return
	}
	text, err := req.chatText(b)
	if err != nil {
		abort(c, err)
		return
	}
	// Images shown as llama.cpp's marker, as llama-server shows them.
	text, _ = takeImages(text, "<__media__>")
	c.JSON(http.StatusOK, gin.H{"prompt": text})
}
