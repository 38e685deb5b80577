package api

import (
	"bytes"
	"cmp"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"maps"
	"net/http"
	"reflect"
	"slices"
	"sort"
	"strconv"
	"strings"
	"time"

	"github.com/gin-gonic/gin"

	"github.com/shoal-ai/shoal/cluster"
	"github.com/shoal-ai/shoal/engine"
	"github.com/shoal-ai/shoal/scheduler"
)

// Ollama's own API (/api/chat, /api/generate, /api/embed, /api/tags, /api/show,
// /api/ps, /api/version), for the clients written against it: Ollama's CLI and
// libraries, Open WebUI, editor plugins. Requests are translated to chat and
// completion requests and answered in Ollama's shapes: streamed by default, as
// newline-delimited JSON, with durations in nanoseconds; errors are
// {"error": "..."}. Model management (pull, create, copy, delete, push) is
// refused: a node serves the model it was started with.

// ollamaKey marks a request of Ollama's API in its gin context: errors are
// written in Ollama's format.
const ollamaKey = "shoal.ollama"

// OllamaAPIVersion is the version of Ollama's API shoal follows (its Go
// client's types, of the ollama module shoal builds llama.cpp from), which
// /api/version reports: clients compare it to decide what they may send.
const OllamaAPIVersion = "0.24.0"

func ollamaErrors(c *gin.Context) {
	c.Set(ollamaKey, true)
	c.Next()
}

// ollamaError is e's body in Ollama's format.
func ollamaError(e *Error) gin.H {
	if e.Code == "model_not_found" {
		return gin.H{"error": "model not found: " + e.Message} // Ollama's clients look for "not found"
	}
	return gin.H{"error": e.Message}
}

// OllamaOptions are the options of Ollama's requests that shoal takes: the
// sampling ones. The others (num_ctx, num_gpu, num_thread, num_batch, ...)
// set up the runner, which a node's flags set here, and are ignored, as
// Ollama ignores options it does not know.
type OllamaOptions struct {
	NumPredict       *ollamaInt   `json:"num_predict"`
	Temperature      *float64     `json:"temperature"`
	TopP             *float64     `json:"top_p"`
	TopK             *ollamaInt   `json:"top_k"`
	MinP             *float64     `json:"min_p"`
	Seed             *ollamaInt   `json:"seed"`
	Stop             StringOrList `json:"stop"`
	RepeatPenalty    *float64     `json:"repeat_penalty"`
	RepeatLastN      *ollamaInt   `json:"repeat_last_n"`
	PresencePenalty  *float64     `json:"presence_penalty"`
	FrequencyPenalty *float64     `json:"frequency_penalty"`
	TypicalP         *float64     `json:"typical_p"`
	Mirostat         *ollamaInt   `json:"mirostat"`
	MirostatTau      *float64     `json:"mirostat_tau"`
	MirostatEta      *float64     `json:"mirostat_eta"`
}

// ollamaInt is an integer option, which Ollama takes as any JSON number
// (3.0, as computed settings are sent), cut to an integer.
type ollamaInt int64

func (n *ollamaInt) UnmarshalJSON(b []byte) error {
	var f float64
	if err := json.Unmarshal(b, &f); err != nil || f >= 1<<63 || f < -(1<<63) {
		return &json.UnmarshalTypeError{Value: jsonKind(bytes.TrimSpace(b)), Type: reflect.TypeFor[int]()}
	}
	*n = ollamaInt(f)
	return nil
}

// intOf is n as an int; nil stays nil.
func intOf(n *ollamaInt) *int {
	if n == nil {
		return nil
	}
	v := int(*n)
	return &v
}

// OllamaMessage is a message of Ollama's /api/chat.
type OllamaMessage struct {
	Role    string `json:"role"`
	Content string `json:"content"`
	// Thinking is an assistant turn's thoughts; in a request's history they
	// are left out of the prompt, as most reasoning models' templates leave
	// earlier turns' thoughts out.
	Thinking  string            `json:"thinking,omitempty"`
	Images    []json.RawMessage `json:"images,omitempty"`
	ToolCalls []OllamaToolCall  `json:"tool_calls,omitempty"`
	ToolName  string            `json:"tool_name,omitempty"` // a tool turn's function
	// ToolCallID is a tool turn's call.
	ToolCallID string `json:"tool_call_id,omitempty"`
}

// OllamaToolCall is a call in Ollama's shape: its arguments are an object.
type OllamaToolCall struct {
	ID       string `json:"id,omitempty"`
	Function struct {
		Index     int             `json:"index"`
		Name      string          `json:"name"`
		Arguments json.RawMessage `json:"arguments"`
	} `json:"function"`
}

// OllamaCommon are the fields /api/chat and /api/generate share.
type OllamaCommon struct {
	Model   string          `json:"model"`
	Format  json.RawMessage `json:"format"` // "json" or a JSON schema
	Options *OllamaOptions  `json:"options"`
	Stream  *bool           `json:"stream"` // true unless false
	// Think is true, false or an effort ("low", "medium", "high").
	Think     json.RawMessage `json:"think"`
	KeepAlive json.RawMessage `json:"keep_alive"` // the model stays loaded: ignored
	// Logprobs asks for each output token's log-probability, with TopLogprobs
	// alternatives (at most 20).
	Logprobs    bool `json:"logprobs"`
	TopLogprobs int  `json:"top_logprobs"`
}

// OllamaChatRequest is the body of POST /api/chat.
type OllamaChatRequest struct {
	OllamaCommon
	Messages []OllamaMessage `json:"messages"`
	Tools    json.RawMessage `json:"tools"` // OpenAI's shape
	// ToolChoice is shoal's extension, OpenAI's and vLLM's tool_choice
	// ("required", a function): Ollama's API has none, and the model calls
	// a tool when it chooses to.
	ToolChoice json.RawMessage `json:"tool_choice"`
	// Truncate (default true) drops the oldest messages after the system ones
	// when the chat does not fit the context (ollamaFit), as Ollama does;
	// false: such a chat is refused.
	Truncate *bool `json:"truncate"`
}

// OllamaGenerateRequest is the body of POST /api/generate.
type OllamaGenerateRequest struct {
	OllamaCommon
	Prompt string `json:"prompt"`
	Suffix string `json:"suffix"`
	System string `json:"system"`
	// Template is a Go template replacing the model's: refused.
	Template string `json:"template"`
	// Context is an earlier answer's context (its prompt and output tokens): the
	// prompt goes on from it.
	Context TokenIDs[int64]   `json:"context"`
	Raw     bool              `json:"raw"` // the prompt as it is, without the chat template
	Images  []json.RawMessage `json:"images"`
}

// ollamaBody decodes an Ollama request into req and reads its model's name as
// the id it stands for (ollamaModel).
type ollamaBody struct {
	req   any
	model *string
}

func (o ollamaBody) UnmarshalJSON(b []byte) error {
	if err := json.Unmarshal(b, o.req); err != nil {
		return err
	}
	*o.model = ollamaModel(*o.model)
	return nil
}

// ollamaModel is the model id an Ollama client's name stands for: Ollama's
// default tag ":latest" is dropped ("name:latest" names the model "name").
func ollamaModel(name string) string {
	if base, ok := strings.CutSuffix(name, ":latest"); ok && !strings.Contains(base, ":") {
		return base
	}
	return name
}

// ollamaPlan answers a plan in Ollama's shapes.
type ollamaPlan struct {
	generate bool      // /api/generate's shape (response, thinking, context); else /api/chat's
	start    time.Time // when the request came, for total_duration
	// context is the prompt's tokens, which with the output's make a
	// generate answer's context; none for a prompt with images, whose
	// tokens are no vocabulary's (a follow-up sends the image again).
	context []engine.Token
}

// sampling sets f from the options and the fields Ollama's requests share.
func (o *OllamaCommon) sampling(f *SamplingFields, kwargs *json.RawMessage, b *Backend) error {
	f.Model = o.Model
	f.Stream = o.Stream == nil || *o.Stream
	if opt := o.Options; opt != nil {
		switch n := intOf(opt.NumPredict); {
		case n == nil || *n == 0 || *n == -1 || *n == -2:
			// Until the end, as Ollama's runner takes 0 and -1 (-2: "fill the
			// context").
		case *n < -2:
			return invalid("options.num_predict", "options.num_predict must be -1 (no limit), -2 (fill the context) or at least 0, got %d", *n)
		default:
			f.MaxTokens = n
		}
		f.Temperature, f.TopP, f.TopK, f.MinP = opt.Temperature, opt.TopP, intOf(opt.TopK), opt.MinP
		f.RepetitionPenalty, f.PresencePenalty, f.FrequencyPenalty = opt.RepeatPenalty, opt.PresencePenalty, opt.FrequencyPenalty
		f.RepeatLastN = intOf(opt.RepeatLastN)
		f.TypicalP, f.Mirostat, f.MirostatTau, f.MirostatEta = opt.TypicalP, intOf(opt.Mirostat), opt.MirostatTau, opt.MirostatEta
		if opt.Seed != nil && *opt.Seed >= 0 { // Ollama's -1: a random seed
			seed := int64(*opt.Seed)
			f.Seed = &seed
		}
		f.Stop = opt.Stop
	}
	f.llamaMeanings()
	format := bytes.TrimSpace(o.Format)
	switch {
	case len(format) == 0 || string(format) == "null" || string(format) == `""`:
	case string(format) == `"json"`:
		f.ResponseFormat = &ResponseFormat{Type: "json_object"}
	case format[0] == '{':
		f.ResponseFormat = &ResponseFormat{Type: "json_schema", JSONSchema: &struct {
			Name   string          `json:"name"`
			Schema json.RawMessage `json:"schema"`
			Strict *bool           `json:"strict"`
		}{Name: "format", Schema: format}}
	default:
		return invalid("format", `format must be "json" or a JSON schema object`)
	}
	think := bytes.TrimSpace(o.Think)
	vars := map[string]any{}
	switch string(think) {
	case "", "null":
	case "false":
		vars["enable_thinking"] = false
	case "true", `"low"`, `"medium"`, `"high"`, `"max"`:
		if b.think == nil {
			return invalid("think", "the model %q does not think (its chat template writes no thoughts): leave think out or false", cmp.Or(o.Model, "served"))
		}
		vars["enable_thinking"] = true
		if think[0] == '"' { // gpt-oss's templates read it; "max" is its "high", as Ollama maps it
			vars["reasoning_effort"] = strings.Replace(strings.Trim(string(think), `"`), "max", "high", 1)
		}
	default:
		return invalid("think", `think must be true, false, "low", "medium", "high" or "max"`)
	}
	if len(vars) > 0 {
		*kwargs, _ = json.Marshal(vars)
	}
	return nil
}

// logprobsTop is top_logprobs for a chat request: nil without logprobs
// (Ollama then ignores top_logprobs).
func (o *OllamaCommon) logprobsTop() *int {
	if !o.Logprobs {
		return nil
	}
	return &o.TopLogprobs
}

// chatRequest translates an /api/chat request.
func (r *OllamaChatRequest) chatRequest(b *Backend) (*ChatRequest, error) {
	chat := &ChatRequest{}
	if err := r.sampling(&chat.SamplingFields, &chat.ChatTemplateKwargs, b); err != nil {
		return nil, err
	}
	chat.Tools, chat.ToolChoice = r.Tools, r.ToolChoice
	chat.Logprobs, chat.TopLogprobs = r.Logprobs, r.logprobsTop()
	for i, m := range r.Messages {
		images, err := ollamaImages(m.Images, fmt.Sprintf("message %d: ", i))
		if err != nil {
			return nil, invalid("messages", "%v", err)
		}
		role := strings.ToLower(m.Role) // as Ollama reads it
		out := Message{Role: role, Content: Content(images + m.Content)}
		switch role {
		case "system", "user":
		case "assistant":
			if len(m.ToolCalls) > 0 {
				calls := make([]ToolCall, len(m.ToolCalls))
				for j, tc := range m.ToolCalls {
					args := bytes.TrimSpace(tc.Function.Arguments)
					if len(args) > 0 && args[0] == '"' { // arguments written as a string of JSON
						var s string
						if err := json.Unmarshal(args, &s); err != nil {
							return nil, invalid("messages", "message %d: tool call %d: arguments: %v", i, j, err)
						}
						args = []byte(s)
					}
					if len(args) == 0 || string(args) == "null" {
						args = []byte("{}")
					}
					calls[j] = ToolCall{ID: cmp.Or(tc.ID, fmt.Sprintf("call_%d_%d", i, j)), Type: "function", Function: FunctionCall{Name: tc.Function.Name, Arguments: string(args)}}
				}
				out.ToolCalls, _ = json.Marshal(calls)
			}
		case "tool":
			out.Name, out.ToolCallID = m.ToolName, m.ToolCallID
		default:
			return nil, invalid("messages", "message %d: role %q: want system, user, assistant or tool", i, m.Role)
		}
		chat.Messages = append(chat.Messages, out)
	}
	// A final assistant message is continued (prefilled), as Ollama
	// continues it: Open WebUI's "continue response" sends one.
	if n := len(r.Messages); n > 0 {
		last := r.Messages[n-1]
		chat.ContinueFinalMessage = strings.ToLower(last.Role) == "assistant" && strings.TrimSpace(last.Content) != "" && len(last.Images) == 0 && len(last.ToolCalls) == 0
	}
	return chat, nil
}

// ollamaParams are the chat fields Ollama's requests name otherwise.
var ollamaParams = map[string]string{"max_tokens": "options.num_predict", "stop": "options.stop", "temperature": "options.temperature",
	"top_p": "options.top_p", "top_k": "options.top_k", "min_p": "options.min_p", "repetition_penalty": "options.repeat_penalty", "repeat_last_n": "options.repeat_last_n",
	"presence_penalty": "options.presence_penalty", "frequency_penalty": "options.frequency_penalty", "seed": "options.seed",
	"typical_p": "options.typical_p", "mirostat": "options.mirostat", "mirostat_tau": "options.mirostat_tau", "mirostat_eta": "options.mirostat_eta",
	"response_format": "format", "chat_template_kwargs": "think", "logprobs": "top_logprobs"}

// ollamaGenerateParams are those of /api/generate, whose prompt is a chat's
// messages.
var ollamaGenerateParams = func() map[string]string {
	m := maps.Clone(ollamaParams)
	m["messages"] = "prompt"
	return m
}()

// ollamaChat serves POST /api/chat.
func (s *Server) ollamaChat(c *gin.Context) {
	start := s.now() // the clock total_duration is read on
	var req OllamaChatRequest
	b, forwarded, ok := s.beginGeneration(c, &ollamaBody{&req, &req.Model}, &req.Model, nil)
	if !ok {
		return
	}
	if len(req.Messages) == 0 { // Ollama's clients load a model so
		s.ollamaLoaded(c, req.Model, false, req.KeepAlive)
		return
	}
	translate := func() (*ChatRequest, error) { return req.chatRequest(b) }
	p, ok := s.translatedPlan(c, b, translate, ollamaParams)
	if !ok {
		return
	}
	fit := req.Truncate == nil || *req.Truncate
	switch {
	case p.images == nil || !fit:
	case b.Projector == nil:
		// A node reading images fits it (it is forwarded there), or none
		// does and it is refused: cut here, its images would be dropped.
		fit = false
	case !s.imageTokens(c, b, p): // its images' tokens counted too
		return
	}
	if limit := fitLimit(b, &req); fit && len(p.prompts[0]) > limit {
		if fitted := s.ollamaFit(c.Request.Context(), b, &req, len(p.prompts[0]), limit); len(fitted) < len(req.Messages) {
			req.Messages = fitted
			if p, ok = s.translatedPlan(c, b, translate, ollamaParams); !ok {
				return
			}
		}
	}
	p.ollama = &ollamaPlan{start: start}
	s.routeOrRun(c, b, p, forwarded)
}

// fitSearchMax bounds the chats ollamaFit shortens: at most this many times
// the context.
const fitSearchMax = 16

// fitLimit is the longest prompt that leaves room in the context for the
// answer: num_predict's tokens, or an eighth of the context, and at most half
// of it.
func fitLimit(b *Backend, req *OllamaChatRequest) int {
	maxCtx := b.Generator.MaxContext()
	room := maxCtx / 8
	if o := req.Options; o != nil && o.NumPredict != nil && *o.NumPredict > 0 {
		room = int(*o.NumPredict)
	}
	return maxCtx - min(room, maxCtx/2)
}

// ollamaFit shortens a chat whose prompt has n tokens, more than limit, as
// Ollama truncates a chat by default: it drops the oldest messages after the
// leading system ones (system messages among them are kept), as few as it must, cutting only where the rest begins
// with a user message (so that no answer or tool result is left without what
// it answers, and templates that want turns to alternate take it), found by
// bisection. Failing that, the last message alone is kept when it fits the
// context. A chat that fits no way, or is over fitSearchMax contexts long, is
// left whole: refused if it passes the context, else run with less room.
func (s *Server) ollamaFit(ctx context.Context, b *Backend, req *OllamaChatRequest, n, limit int) []OllamaMessage {
	msgs := req.Messages
	maxCtx := b.Generator.MaxContext()
	if n > fitSearchMax*maxCtx {
		return msgs
	}
	keep := 0 // the leading system messages
	for keep < len(msgs)-1 && strings.EqualFold(msgs[keep].Role, "system") {
		keep++
	}
	// cut drops the first drop messages after the leading system ones, but
	// keeps the system messages among them, as Ollama does.
	cut := func(drop int) []OllamaMessage {
		out := slices.Clone(msgs[:keep])
		for _, m := range msgs[keep : keep+drop] {
			if strings.EqualFold(m.Role, "system") {
				out = append(out, m)
			}
		}
		return append(out, msgs[keep+drop:]...)
	}
	// tokens is the prompt's length without the first drop messages after
	// the system ones; -1 when it cannot be laid out.
	tokens := func(drop int) int {
		r := *req
		r.Messages = cut(drop)
		chat, err := r.chatRequest(b)
		n := 0
		if err == nil {
			n, err = chatPromptTokens(ctx, b, chat)
		}
		if err != nil {
			return -1
		}
		return n
	}
	var drops []int // where the rest begins with a user message
	for d := 1; keep+d < len(msgs); d++ {
		if strings.EqualFold(msgs[keep+d].Role, "user") {
			drops = append(drops, d)
		}
	}
	fits := func(d int) bool { t := tokens(d); return t >= 0 && t <= limit }
	// The fewest drops that fit: dropping more never lengthens the prompt.
	if i := sort.Search(len(drops), func(i int) bool { return fits(drops[i]) }); i < len(drops) {
		return cut(drops[i])
	}
	if last := len(msgs) - 1 - keep; last > 0 {
		if t := tokens(last); t >= 0 && t < maxCtx {
			return cut(last)
		}
	}
	return msgs
}

// ollamaGenerate serves POST /api/generate.
func (s *Server) ollamaGenerate(c *gin.Context) {
	start := s.now()
	var req OllamaGenerateRequest
	b, forwarded, ok := s.beginGeneration(c, &ollamaBody{&req, &req.Model}, &req.Model, nil)
	if !ok {
		return
	}
	switch {
	case req.Template != "":
		abort(c, invalid("template", "template is not supported: prompts are laid out by the model's chat template (or given as they are with raw)"))
		return
	case len(req.Images) > 0 && (req.Raw || req.Suffix != "" || len(req.Context) > 0):
		abort(c, invalid("images", "images are laid out by the model's chat template: not with raw, suffix or context"))
		return
	case req.Raw && (req.System != "" || len(req.Context) > 0):
		abort(c, invalid("raw", "raw mode does not support system or context (the prompt is given as it is)"))
		return
	case req.Prompt == "" && req.Suffix == "" && len(req.Context) == 0:
		s.ollamaLoaded(c, req.Model, true, req.KeepAlive) // Ollama's clients load a model so
		return
	}
	var p *plan
	if req.Raw || req.Suffix != "" {
		// As it is (a suffix: laid out for fill-in-the-middle, as
		// /v1/completions lays out its suffix, without a system prompt, which
		// Ollama also leaves out then; think has nothing to switch).
		var f SamplingFields
		var ignored json.RawMessage
		err := req.sampling(&f, &ignored, b)
		if err == nil {
			cr := &CompletionRequest{SamplingFields: f, Prompt: &Prompt{Texts: []string{req.Prompt}}}
			if req.Logprobs {
				cr.Logprobs = &req.TopLogprobs
			}
			if req.Suffix != "" {
				cr.Suffix = &req.Suffix
			}
			unbounded := f.MaxTokens == nil
			if unbounded {
				one := 1 // not /v1/completions' default of 16: replaced below
				cr.MaxTokens = &one
			}
			if p, err = s.completionPlan(b, cr); err == nil {
				if unbounded {
					p.req.MaxTokens = 0 // until the end or a full context, as Ollama's -1
				}
				// A bound the context caps, as translated requests' (translatedPlan).
				p.maxTokensAsked, p.params = false, ollamaGenerateParams
			}
		}
		if err != nil {
			abort(c, err)
			return
		}
	} else {
		p, ok = s.translatedPlan(c, b, func() (*ChatRequest, error) {
			chat := &ChatRequest{}
			if err := req.sampling(&chat.SamplingFields, &chat.ChatTemplateKwargs, b); err != nil {
				return nil, err
			}
			if req.System != "" {
				chat.Messages = append(chat.Messages, Message{Role: "system", Content: Content(req.System)})
			}
			images, err := ollamaImages(req.Images, "")
			if err != nil {
				return nil, invalid("images", "%v", err)
			}
			chat.Messages = append(chat.Messages, Message{Role: "user", Content: Content(images + req.Prompt)})
			chat.Logprobs, chat.TopLogprobs = req.Logprobs, req.logprobsTop()
			return chat, nil
		}, ollamaGenerateParams)
		if !ok {
			return
		}
	}
	if len(req.Context) > 0 {
		// The prompt goes on from an earlier answer's tokens (its own BOS dropped).
		ctx, err := tokenIDs(req.Context, b.Vocab.Size(), "context", 0)
		if err != nil {
			abort(c, err)
			return
		}
		toks := p.prompts[0]
		if b.Vocab.AddBOS() && len(toks) > 0 && toks[0] == b.Vocab.BOS() {
			toks = toks[1:]
		}
		p.prompts[0] = append(ctx, toks...)
	}
	p.ollama = &ollamaPlan{generate: true, start: start, context: p.prompts[0]}
	s.routeOrRun(c, b, p, forwarded)
}

// ollamaLoaded answers a request without messages or a prompt, with which
// Ollama's clients load a model (or, keep_alive 0, unload it): the model is
// loaded while the node serves.
func (s *Server) ollamaLoaded(c *gin.Context, model string, generate bool, keepAlive json.RawMessage) {
	if err := s.checkModel(model); err != nil {
		abort(c, err)
		return
	}
	reason := "load"
	if keptFor(keepAlive) == 0 {
		reason = "unload" // said, not done: the node serves it until it stops
	}
	out := gin.H{"model": cmp.Or(model, s.cfg.ModelName), "created_at": s.now().UTC().Format(time.RFC3339Nano), "done": true, "done_reason": reason}
	if generate {
		out["response"] = ""
	} else {
		out["message"] = gin.H{"role": "assistant", "content": ""}
	}
	c.JSON(http.StatusOK, out)
}

// keptFor reads keep_alive as Ollama does: seconds, or a duration ("5m",
// "0s"); unset or unreadable, 5 minutes; negative, forever (-1).
func keptFor(raw json.RawMessage) time.Duration {
	var v any
	if json.Unmarshal(raw, &v) != nil {
		return 5 * time.Minute
	}
	switch t := v.(type) {
	case float64:
		if t < 0 {
			return -1
		}
		return time.Duration(t * float64(time.Second))
	case string:
		if d, err := time.ParseDuration(t); err == nil {
			return max(d, -1)
		}
	}
	return 5 * time.Minute
}

// ollamaStats are the counts and durations (nanoseconds) of an answer's last
// object.
type ollamaStats struct {
	TotalDuration      int64 `json:"total_duration"`
	LoadDuration       int64 `json:"load_duration"`
	PromptEvalCount    int   `json:"prompt_eval_count"`
	PromptEvalDuration int64 `json:"prompt_eval_duration"`
	EvalCount          int   `json:"eval_count"`
	EvalDuration       int64 `json:"eval_duration"`
}

// OllamaChatResponse is an /api/chat answer, or one object of its stream.
type OllamaChatResponse struct {
	Model      string              `json:"model"`
	CreatedAt  string              `json:"created_at"`
	Message    OllamaAnswerMessage `json:"message"`
	Done       bool                `json:"done"`
	DoneReason string              `json:"done_reason,omitempty"`
	*ollamaStats
	Logprobs []OllamaLogprob `json:"logprobs,omitempty"`
}

// OllamaAnswerMessage is the assistant message of an /api/chat answer.
type OllamaAnswerMessage struct {
	Role      string           `json:"role"`
	Content   string           `json:"content"`
	Thinking  string           `json:"thinking,omitempty"`
	ToolCalls []OllamaToolCall `json:"tool_calls,omitempty"`
}

// OllamaGenerateResponse is an /api/generate answer, or one object of its stream.
type OllamaGenerateResponse struct {
	Model      string `json:"model"`
	CreatedAt  string `json:"created_at"`
	Response   string `json:"response"`
	Thinking   string `json:"thinking,omitempty"`
	Done       bool   `json:"done"`
	DoneReason string `json:"done_reason,omitempty"`
	Context    []int  `json:"context,omitempty"`
	*ollamaStats
	Logprobs []OllamaLogprob `json:"logprobs,omitempty"`
}

// OllamaTokenLogprob is a token, its log-probability and its bytes.
type OllamaTokenLogprob struct {
	Token   string  `json:"token"`
	Logprob float32 `json:"logprob"`
	Bytes   []int   `json:"bytes,omitempty"`
}

// OllamaLogprob is an output token's log-probability and its alternatives.
type OllamaLogprob struct {
	OllamaTokenLogprob
	TopLogprobs []OllamaTokenLogprob `json:"top_logprobs,omitempty"`
}

// ndjsonWriter writes newline-delimited JSON, Ollama's stream format, through
// an sseWriter's sending (writes after the client left are dropped).
type ndjsonWriter struct{ sseWriter }

func (w *ndjsonWriter) start() {
	w.c.Writer.Header().Set("Content-Type", "application/x-ndjson")
	w.c.Status(http.StatusOK)
	w.c.Writer.WriteHeaderNow()
}

func (w *ndjsonWriter) line(v any) {
	if b, err := json.Marshal(v); err == nil {
		w.send(append(b, '\n'))
	}
}

// ollamaAnswer answers p, a request of Ollama's API, whole or streamed.
func (s *Server) ollamaAnswer(c *gin.Context, b *Backend, p *plan, sub submitted) {
	o := p.ollama
	created := func() string { return s.now().UTC().Format(time.RFC3339Nano) }
	var w *ndjsonWriter
	if p.stream {
		w = &ndjsonWriter{sseWriter{c: c}}
		w.start()
	}
	var times tokenTimes
	var output []engine.Token
	var logprobs []OllamaLogprob // not yet sent
	seen := func(ev scheduler.Event) {
		if ev.Kind != scheduler.EventToken {
			return
		}
		times.see(ev)
		if ev.EndOfGeneration {
			return // as Ollama: neither in the logprobs nor in the context
		}
		output = append(output, ev.Token)
		if p.logprobs {
			logprobs = append(logprobs, ollamaLogprob(b.Vocab, p, ev))
		}
	}
	// object is one answer object, which takes the log-probabilities not yet sent.
	object := func(thinking, text string, calls []OllamaToolCall, done bool, stats *ollamaStats, reason string) any {
		lp := logprobs
		logprobs = nil
		if o.generate {
			r := OllamaGenerateResponse{Model: p.model, CreatedAt: created(), Response: text, Thinking: thinking, Done: done, DoneReason: reason, ollamaStats: stats, Logprobs: lp}
			if done && p.images == nil {
				for _, t := range append(o.context[:len(o.context):len(o.context)], output...) {
					r.Context = append(r.Context, int(t))
				}
			}
			return r
		}
		return OllamaChatResponse{Model: p.model, CreatedAt: created(), Message: OllamaAnswerMessage{Role: "assistant", Content: text, Thinking: thinking, ToolCalls: calls},
			Done: done, DoneReason: reason, ollamaStats: stats, Logprobs: lp}
	}
	var text, thinking strings.Builder
	emit := func(reasoning, t string) {
		switch {
		case reasoning == "" && t == "":
		case w != nil:
			w.line(object(reasoning, t, nil, false, nil, ""))
		default:
			thinking.WriteString(reasoning)
			text.WriteString(t)
		}
	}
	a, u, err := s.followOne(c.Request.Context(), b, p, sub, seen, emit, nil)
	if err != nil {
		if w == nil {
			abort(c, err)
		} else if c.Request.Context().Err() == nil {
			w.line(ollamaError(toAPIError(err))) // the status is sent: the error ends the stream
		}
		return
	}
	calls := ollamaCalls(a.calls)
	text.WriteString(a.text) // what the answer held back to the end
	if w != nil && (text.Len() > 0 || len(calls) > 0) {
		w.line(object("", text.String(), calls, false, nil, "")) // Ollama sends calls whole
		text.Reset()
		calls = nil
	}
	stats := &ollamaStats{TotalDuration: int64(s.now().Sub(o.start)), PromptEvalCount: u.PromptTokens, EvalCount: u.CompletionTokens,
		PromptEvalDuration: int64(times.prompt(sub, u)), EvalDuration: int64(times.generating())}
	if stats.EvalCount > 0 && stats.EvalDuration <= 0 {
		// One token: drawn with the prompt's pass, it took no time of its own to
		// measure; clients divide by this (tokens per second), so never 0.
		stats.EvalDuration = int64(time.Microsecond)
	}
	reason := "stop"
	if a.finish == "length" {
		reason = "length"
	}
	out := object(thinking.String(), text.String(), calls, true, stats, reason)
	if w != nil {
		w.line(out)
		return
	}
	c.JSON(http.StatusOK, out)
}

// ollamaLogprob is a token event's log-probabilities in Ollama's shape: the
// chat's (plan.tokenLogprob), finite.
func ollamaLogprob(v engine.Vocab, p *plan, ev scheduler.Event) OllamaLogprob {
	tl := p.tokenLogprob(v, ev)
	l := OllamaLogprob{OllamaTokenLogprob: OllamaTokenLogprob{Token: tl.Token, Logprob: finite(tl.Logprob), Bytes: tl.Bytes}}
	for _, a := range tl.TopLogprobs[:min(p.top, len(tl.TopLogprobs))] {
		l.TopLogprobs = append(l.TopLogprobs, OllamaTokenLogprob{Token: a.Token, Logprob: finite(a.Logprob), Bytes: a.Bytes})
	}
	return l
}

// ollamaCalls are calls in Ollama's shape; a call cut short by num_predict,
// whose arguments are not whole JSON, gets empty ones.
func ollamaCalls(calls []ToolCall) []OllamaToolCall {
	var out []OllamaToolCall
	for i, tc := range calls {
		var oc OllamaToolCall
		oc.ID = tc.ID
		oc.Function.Index, oc.Function.Name, oc.Function.Arguments = i, tc.Function.Name, callInput(tc.Function.Arguments)
		out = append(out, oc)
	}
	return out
}

// OllamaModelDetails are Ollama's details of a model.
type OllamaModelDetails struct {
	ParentModel       string   `json:"parent_model"`
	Format            string   `json:"format"`
	Family            string   `json:"family"`
	Families          []string `json:"families"`
	ParameterSize     string   `json:"parameter_size"`
	QuantizationLevel string   `json:"quantization_level"`
}

// OllamaModel is an entry of /api/tags and /api/ps.
type OllamaModel struct {
	Name       string             `json:"name"`
	Model      string             `json:"model"`
	ModifiedAt string             `json:"modified_at,omitempty"`
	Size       uint64             `json:"size"`
	Digest     string             `json:"digest"`
	Details    OllamaModelDetails `json:"details"`
	// /api/ps's: when the model would be unloaded (never, while the node
	// serves), the part in GPU memory, the context in force.
	ExpiresAt     string  `json:"expires_at,omitempty"`
	SizeVRAM      *uint64 `json:"size_vram,omitempty"` // /api/ps's, 0 included
	ContextLength int     `json:"context_length,omitempty"`
}

// ollamaModels lists the models this node serves (and, in a cluster, those of
// the others, with what their ids say of them); running adds /api/ps's fields.
func (s *Server) ollamaModels(running bool) []OllamaModel {
	b := s.backend.Load()
	var out []OllamaModel
	for _, m := range s.modelList().Data {
		_, here := s.adapterOf(m.ID)
		if running && !here {
			continue // another node's
		}
		om := OllamaModel{Name: m.ID, Model: m.ID, ModifiedAt: s.started.UTC().Format(time.RFC3339Nano), Details: OllamaModelDetails{Format: "gguf", ParentModel: m.Parent}}
		if here && b != nil {
			om.Size, om.Details = b.Info.SizeBytes, ollamaDetails(b.Info, m.Parent)
		}
		om.Digest = ollamaDigest(m.ID, om.Size, om.Details)
		if running {
			om.ExpiresAt = time.Date(2318, 1, 1, 0, 0, 0, 0, time.UTC).Format(time.RFC3339) // never, as Ollama writes keep_alive -1
			if b != nil {
				om.ContextLength = b.Generator.MaxContext() // this node's, not the cluster's longest
			}
			var vram uint64
			switch {
			case b == nil || b.Info.GPULayers <= 0:
			case b.Info.GPULayers >= b.Info.Layers: // every layer offloaded
				vram = om.Size
			default:
				vram = om.Size * uint64(b.Info.GPULayers) / uint64(b.Info.Layers+1)
			}
			om.SizeVRAM = &vram
		}
		out = append(out, om)
	}
	return out
}

// ollamaDetails are a model's details as Ollama's API gives them.
func ollamaDetails(info engine.ModelInfo, parent string) OllamaModelDetails {
	return OllamaModelDetails{ParentModel: parent, Format: "gguf", Family: info.Architecture, Families: []string{info.Architecture},
		ParameterSize: parameterSize(info.Params), QuantizationLevel: quantization(info.Description)}
}

// ollamaDigest identifies a model served under id: Ollama's clients show and
// compare digests. It is not the file's own SHA-256 (reading a model of many
// GiB at start to name it is not worth it), but changes with what it says.
func ollamaDigest(id string, size uint64, d OllamaModelDetails) string {
	h := sha256.Sum256(fmt.Appendf(nil, "%s\x00%d\x00%s\x00%s\x00%s", id, size, d.Family, d.ParameterSize, d.QuantizationLevel))
	return hex.EncodeToString(h[:])
}

// parameterSize writes a parameter count as Ollama does: "7.6B", "110.2M".
func parameterSize(n uint64) string {
	switch {
	case n >= 1e9:
		return strconv.FormatFloat(float64(n)/1e9, 'f', 1, 64) + "B"
	case n >= 1e6:
		return strconv.FormatFloat(float64(n)/1e6, 'f', 1, 64) + "M"
	case n >= 1e3:
		return strconv.FormatFloat(float64(n)/1e3, 'f', 1, 64) + "K"
	}
	return strconv.FormatUint(n, 10)
}

// quantization is the weights' type in Ollama's spelling ("Q4_K_M", "F16")
// from llama.cpp's model description ("llama 8B Q4_K - Medium", "llama 1B
// all F32", "llama 7B IQ2_XXS - 2.0625 bpw").
func quantization(desc string) string {
	f := strings.Fields(desc)
	if len(f) < 3 {
		return ""
	}
	q := strings.TrimSuffix(strings.TrimPrefix(strings.Join(f[2:], " "), "all "), " (guessed)")
	name, size, _ := strings.Cut(q, " - ")
	switch size {
	case "Small":
		name += "_S"
	case "Medium":
		name += "_M"
	case "Large":
		name += "_L"
	}
	return strings.ToUpper(strings.ReplaceAll(name, " ", "_"))
}

// ollamaTags and ollamaPS answer 503 while the model loads, as /v1/models
// does (its size and details are not known yet).
func (s *Server) ollamaTags(c *gin.Context) {
	if s.loading(c) {
		return
	}
	c.JSON(http.StatusOK, gin.H{"models": s.ollamaModels(false)})
}

func (s *Server) ollamaPS(c *gin.Context) {
	if s.loading(c) {
		return
	}
	c.JSON(http.StatusOK, gin.H{"models": s.ollamaModels(true)})
}

func (s *Server) ollamaVersion(c *gin.Context) {
	c.JSON(http.StatusOK, gin.H{"version": OllamaAPIVersion})
}

// OllamaShowRequest is the body of POST /api/show.
type OllamaShowRequest struct {
	Model string `json:"model"`
	Name  string `json:"name"` // Ollama's older field
}

func (r *OllamaShowRequest) UnmarshalJSON(b []byte) error {
	type plain OllamaShowRequest
	if err := json.Unmarshal(b, (*plain)(r)); err != nil {
		return err
	}
	r.Model = cmp.Or(r.Model, r.Name)
	return nil
}

// ollamaShow serves POST /api/show: a model's details, template, parameters,
// model_info (whose "<architecture>.context_length" clients read) and
// capabilities.
func (s *Server) ollamaShow(c *gin.Context) {
	var req OllamaShowRequest
	if err := decodeBody(c, &ollamaBody{&req, &req.Model}); err != nil {
		abort(c, err)
		return
	}
	// A model served elsewhere in the cluster is shown by a node serving it,
	// busy or not: the priority of a request admitted past saturation.
	if forwarded, ok := s.checkHop(c); !ok || !s.routeElsewhere(c, forwarded, req.Model, -1, cluster.Need{}) {
		return
	}
	b, ok := s.readyBackend(c)
	if !ok {
		return
	}
	id := req.Model
	adapter, here := s.adapterOf(id)
	if !here || id == "" {
		abort(c, &Error{Status: http.StatusNotFound, Message: fmt.Sprintf("model %q not found; %s", id, s.served())})
		return
	}
	info := b.Info
	parent := ""
	if adapter > 0 {
		parent = s.cfg.ModelName
	}
	caps := []string{"completion", "tools"}
	switch {
	case info.Pooling:
		caps = []string{"embedding"}
	case info.Rerank != nil:
		caps = []string{} // Ollama names no capability for scoring pairs
	default:
		if b.think != nil {
			caps = append(caps, "thinking")
		}
		if b.Projector != nil {
			caps = append(caps, "vision")
		}
		if b.Vocab.FIM().Infill() {
			caps = append(caps, "insert")
		}
	}
	arch := info.Architecture
	var params strings.Builder
	sd := b.Sampling
	for _, kv := range []struct {
		name string
		v    any
	}{{"temperature", sd.Temperature}, {"top_p", sd.TopP}, {"top_k", sd.TopK}, {"min_p", sd.MinP}, {"repeat_penalty", sd.RepeatPenalty}} {
		if v := ollamaParamValue(kv.v); v != "" {
			fmt.Fprintf(&params, "%-30s %s\n", kv.name, v)
		}
	}
	c.JSON(http.StatusOK, gin.H{
		"modelfile":  "# served by shoal\nFROM " + id + "\n",
		"parameters": params.String(),
		"template":   b.Template,
		"details":    ollamaDetails(info, parent),
		"model_info": gin.H{
			"general.architecture":     arch,
			"general.name":             info.Name,
			"general.parameter_count":  info.Params,
			arch + ".context_length":   b.Generator.MaxContext(),
			arch + ".embedding_length": info.EmbeddingSize,
			arch + ".block_count":      info.Layers,
		},
		"capabilities": caps,
		"modified_at":  s.started.UTC().Format(time.RFC3339Nano),
	})
}

// ollamaParamValue writes a sampling default set by the model or a flag; ""
// when unset.
func ollamaParamValue(v any) string {
	switch x := v.(type) {
	case *float64:
		if x != nil {
			return strconv.FormatFloat(*x, 'g', -1, 64)
		}
	case *int:
		if x != nil {
			return strconv.Itoa(*x)
		}
	}
	return ""
}

// OllamaEmbedRequest is the body of POST /api/embed (input) and of the older
// POST /api/embeddings (prompt).
type OllamaEmbedRequest struct {
	Model  string  `json:"model"`
	Input  *Prompt `json:"input"`
	Prompt *string `json:"prompt"`
	// Truncate (default true) cuts inputs longer than the context to fit; false:
	// they are refused.
	Truncate   *bool           `json:"truncate"`
	Dimensions *int            `json:"dimensions"`
	Options    json.RawMessage `json:"options"`
	KeepAlive  json.RawMessage `json:"keep_alive"`
}

// ollamaEmbed serves POST /api/embed and, legacy true, /api/embeddings.
func (s *Server) ollamaEmbed(legacy bool) gin.HandlerFunc {
	return func(c *gin.Context) {
		start := time.Now()
		var req OllamaEmbedRequest
		b, ok := s.decodeFor(c, &ollamaBody{&req, &req.Model}, &req.Model)
		if !ok {
			return
		}
		if !serves(c, b, cluster.TaskEmbed) {
			return
		}
		if req.Dimensions != nil && *req.Dimensions < 0 {
			abort(c, invalid("dimensions", "dimensions must not be negative, got %d", *req.Dimensions))
			return
		}
		var texts []string
		var ids [][]int64
		switch {
		case legacy && req.Prompt != nil:
			texts = []string{*req.Prompt}
		case !legacy && req.Input != nil:
			texts, ids = req.Input.Texts, req.Input.Tokens
		}
		if len(texts)+len(ids) == 0 && !legacy {
			// As Ollama answers no input (its clients load a model so).
			c.JSON(http.StatusOK, gin.H{"model": cmp.Or(req.Model, s.cfg.ModelName), "embeddings": [][]float32{}})
			return
		}
		if len(texts)+len(ids) > maxInputs {
			abort(c, invalid("input", "at most %d inputs per request", maxInputs))
			return
		}
		limit := stepTokens(b) // truncate cuts to what the node computes
		var inputs [][]engine.Token
		for i, t := range texts {
			toks, err := b.Vocab.Tokenize(t, true, false)
			if err != nil {
				abort(c, err)
				return
			}
			if len(toks) == 0 && !legacy {
				abort(c, invalid("input", "input %d is empty", i))
				return
			}
			inputs = append(inputs, toks)
		}
		for i, raw := range ids {
			toks, err := tokenIDs(raw, b.Vocab.Size(), "input", i)
			if err != nil {
				abort(c, err)
				return
			}
			inputs = append(inputs, toks)
		}
		for i, toks := range inputs {
			if len(toks) > limit {
				if req.Truncate != nil && !*req.Truncate {
					abort(c, invalid("input", "input %d has %d tokens, more than the %d the node computes in one pass (truncate: false)", i, len(toks), limit))
					return
				}
				inputs[i] = toks[:limit]
			}
		}
		if legacy && (req.Prompt == nil || *req.Prompt == "") {
			c.JSON(http.StatusOK, gin.H{"embedding": []float32{}}) // as Ollama answers an empty prompt
			return
		}
		answered, done := s.spread(c, b, req.Model, inputs)
		defer done()
		if answered {
			return
		}
		adapter, _ := s.adapterOf(req.Model)
		// The older endpoint answers the model's vector as it is, as Ollama's does.
		vecs, tokens, ok := s.embed(c, b, inputs, adapter, "input", !legacy)
		if !ok {
			return
		}
		if legacy {
			c.JSON(http.StatusOK, gin.H{"embedding": vecs[0]})
			return
		}
		if d := req.Dimensions; d != nil && *d > 0 && *d < b.Info.EmbeddingSize {
			for i, v := range vecs { // the first d, at unit length again, as Ollama cuts them
				vecs[i] = normalize(v[:*d])
			}
		}
		c.JSON(http.StatusOK, gin.H{"model": cmp.Or(req.Model, s.cfg.ModelName), "embeddings": vecs,
			"total_duration": int64(time.Since(start)), "load_duration": 0, "prompt_eval_count": tokens})
	}
}

// ollamaManage refuses Ollama's model management: a node serves the model it
// was started with. Ollama's CLI pulls a model /api/show does not know, so the
// refusal names those that are served.
func (s *Server) ollamaManage(c *gin.Context) {
	abort(c, &Error{Status: http.StatusNotImplemented, Message: fmt.Sprintf("%s is not supported: a shoal node serves the model it was started with (serve --model FILE); %s",
		c.Request.URL.Path, s.served())})
}

// ollamaImages reads Ollama's images (base64 strings) into their markers, put
// before the text of their message as Ollama puts them.
func ollamaImages(raw []json.RawMessage, where string) (string, error) {
	var b strings.Builder
	for i, r := range raw {
		var s string
		if err := json.Unmarshal(r, &s); err != nil {
			return "", fmt.Errorf("%simage %d: want a base64 string", where, i)
		}
		data, err := decodeBase64(s)
		if err != nil {
			return "", fmt.Errorf("%simage %d: %v", where, i, err)
		}
		b.WriteString(imageMarker(data))
	}
	return b.String(), nil
}
