package api

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"maps"
	"net/http"
	"strings"

	"github.com/gin-gonic/gin"

	"github.com/shoal-ai/shoal/scheduler"
)

// Anthropic's Messages API (POST /v1/messages), as llama-server, vLLM and
// Ollama serve it for clients written against Anthropic's SDKs and tools: a
// request is translated into a chat request and served by the same plan, then
// its answer is written as a message of content blocks (thinking, text,
// tool_use), whole or as Anthropic's stream of events.

// MessagesRequest is the body of POST /v1/messages (and of count_tokens, which
// needs no max_tokens).
type MessagesRequest struct {
	Model         string               `json:"model"`
	MaxTokens     *int                 `json:"max_tokens"`
	Messages      []AnthropicMessage   `json:"messages"`
	System        AnthropicContent     `json:"system"`
	StopSequences []string             `json:"stop_sequences"`
	Stream        bool                 `json:"stream"`
	Temperature   *float64             `json:"temperature"`
	TopP          *float64             `json:"top_p"`
	TopK          *int                 `json:"top_k"`
	Tools         []AnthropicTool      `json:"tools"`
	ToolChoice    *AnthropicToolChoice `json:"tool_choice"`
	Thinking      *AnthropicThinking   `json:"thinking"`
	OutputConfig  *struct {
		Format *outputFormat `json:"format"`
	} `json:"output_config"` // effort: not used
	OutputFormat *outputFormat   `json:"output_format"` // the structured-outputs beta's spelling
	Metadata     json.RawMessage `json:"metadata"`      // user_id: not used
}

// outputFormat is structured output: {"type": "json_schema", "schema": ...}.
type outputFormat struct {
	Type   string          `json:"type"`
	Schema json.RawMessage `json:"schema"`
}

// AnthropicMessage is one turn: a user's or the assistant's.
type AnthropicMessage struct {
	Role    string           `json:"role"`
	Content AnthropicContent `json:"content"`
}

// AnthropicContent is a string or a list of content blocks; a string is one
// text block.
type AnthropicContent []ContentBlock

func (a *AnthropicContent) UnmarshalJSON(b []byte) error {
	b = bytes.TrimSpace(b)
	if bytes.Equal(b, []byte("null")) {
		*a = nil
		return nil
	}
	if len(b) > 0 && b[0] == '"' {
		var s string
		if err := json.Unmarshal(b, &s); err != nil {
			return err
		}
		*a = AnthropicContent{{Type: "text", Text: s}}
		return nil
	}
	var blocks []ContentBlock
	if err := json.Unmarshal(b, &blocks); err != nil {
		return err
	}
	*a = blocks
	return nil
}

// ContentBlock is one block of a message's content, of any type the request
// may hold: text, tool_use (the assistant's), tool_result (the user's),
// thinking; image (the user's, its bytes in source). Documents are refused.
type ContentBlock struct {
	Type   string `json:"type"`
	Text   string `json:"text"`
	Source *struct {
		Type string `json:"type"` // base64 or url
		Data string `json:"data"`
		URL  string `json:"url"`
	} `json:"source"`
	ID        string           `json:"id"`
	Name      string           `json:"name"`
	Input     json.RawMessage  `json:"input"`
	ToolUseID string           `json:"tool_use_id"`
	Content   AnthropicContent `json:"content"` // a tool result's
	IsError   bool             `json:"is_error"`
	noText    bool             // a text block without its text field
}

func (b *ContentBlock) UnmarshalJSON(data []byte) error {
	type Fields ContentBlock // without this method; the name is dropped from error paths (jsonField)
	var v struct {
		Fields
		Text *string `json:"text"`
	}
	if err := json.Unmarshal(data, &v); err != nil {
		return err
	}
	*b = ContentBlock(v.Fields)
	if v.Text != nil {
		b.Text = *v.Text
	}
	b.noText = v.Type == "text" && v.Text == nil
	return nil
}

// AnthropicTool is a client tool: its name, description and the JSON schema
// of its input.
type AnthropicTool struct {
	Type        string          `json:"type"` // "", "custom"; Anthropic's server tools are refused
	Name        string          `json:"name"`
	Description string          `json:"description"`
	InputSchema json.RawMessage `json:"input_schema"`
}

// AnthropicToolChoice is auto, any (a call is required), tool (that one) or none.
type AnthropicToolChoice struct {
	Type                   string `json:"type"`
	Name                   string `json:"name"`
	DisableParallelToolUse bool   `json:"disable_parallel_tool_use"`
}

// AnthropicThinking turns a reasoning model's thinking on or off (the
// template's enable_thinking; adaptive leaves the template's default);
// budget_tokens is not enforced.
type AnthropicThinking struct {
	Type         string `json:"type"`
	BudgetTokens int    `json:"budget_tokens"`
}

// MessageResponse is a whole message, and the message of message_start.
type MessageResponse struct {
	ID           string         `json:"id"`
	Type         string         `json:"type"`
	Role         string         `json:"role"`
	Model        string         `json:"model"`
	Content      []any          `json:"content"`
	StopReason   *string        `json:"stop_reason"`
	StopSequence *string        `json:"stop_sequence"`
	Usage        AnthropicUsage `json:"usage"`
}

// AnthropicUsage counts a message's tokens: input_tokens are the prompt's
// tokens not read from the prefix cache, cache_read_input_tokens those that were.
type AnthropicUsage struct {
	InputTokens              int `json:"input_tokens"`
	OutputTokens             int `json:"output_tokens"`
	CacheCreationInputTokens int `json:"cache_creation_input_tokens"`
	CacheReadInputTokens     int `json:"cache_read_input_tokens"`
}

func anthropicUsage(u Usage) AnthropicUsage {
	cached := u.PromptTokensDetails.CachedTokens
	return AnthropicUsage{InputTokens: u.PromptTokens - cached, OutputTokens: u.CompletionTokens, CacheReadInputTokens: cached}
}

type textBlock struct {
	Type string `json:"type"`
	Text string `json:"text"`
}

type thinkingBlock struct {
	Type      string `json:"type"`
	Thinking  string `json:"thinking"`
	Signature string `json:"signature"`
}

type toolUseBlock struct {
	Type  string          `json:"type"`
	ID    string          `json:"id"`
	Name  string          `json:"name"`
	Input json.RawMessage `json:"input"`
}

// anthropicKey marks a request of the Messages API: its errors are written in
// Anthropic's format.
const anthropicKey = "shoal.anthropic"

// anthropicErrors makes the handlers after it answer errors in Anthropic's
// format (auth's too).
func anthropicErrors(c *gin.Context) {
	c.Set(anthropicKey, true)
	c.Next()
}

// anthropicError is err's body in Anthropic's format.
func anthropicError(e *Error) gin.H {
	typ := "api_error"
	switch e.Status {
	case http.StatusBadRequest, http.StatusMethodNotAllowed:
		typ = "invalid_request_error"
	case http.StatusUnauthorized:
		typ = "authentication_error"
	case http.StatusForbidden:
		typ = "permission_error"
	case http.StatusNotFound:
		typ = "not_found_error"
	case http.StatusRequestEntityTooLarge:
		typ = "request_too_large"
	case http.StatusTooManyRequests:
		typ = "rate_limit_error"
	case http.StatusServiceUnavailable:
		typ = "overloaded_error"
	case http.StatusGatewayTimeout:
		typ = "timeout_error"
	}
	return gin.H{"type": "error", "error": gin.H{"type": typ, "message": e.Message}}
}

// chatRequest translates r into a chat request: the system prompt first, each
// user turn's tool results as tool messages, the assistant's tool_use blocks
// as its calls. Thinking blocks of earlier turns are left out, as chat
// templates leave out earlier turns' thoughts.
func (r *MessagesRequest) chatRequest() (*ChatRequest, error) {
	if t := r.Temperature; t != nil && !(*t >= 0 && *t <= 1) {
		return nil, invalid("temperature", "temperature must be between 0 and 1, got %v", *t)
	}
	if k := r.TopK; k != nil && *k < 0 { // -1 is vLLM's "off", not Anthropic's
		return nil, invalid("top_k", "top_k must be at least 0, got %d", *k)
	}
	if m := bytes.TrimSpace(r.Metadata); len(m) > 0 && m[0] != '{' && !bytes.Equal(m, []byte("null")) {
		return nil, invalid("metadata", "metadata must be an object ({\"user_id\": ...})")
	}
	chat := &ChatRequest{}
	f := &chat.SamplingFields
	f.Model, f.Stream, f.Temperature, f.TopP, f.TopK = r.Model, r.Stream, r.Temperature, r.TopP, r.TopK
	f.Stop = r.StopSequences
	chat.MaxTokens = r.MaxTokens
	if len(r.System) > 0 {
		text, err := blockText(r.System, "system", false)
		if err != nil {
			return nil, err
		}
		chat.Messages = append(chat.Messages, Message{Role: "system", Content: Content(text)})
	}
	called := map[string]bool{} // ids of the tool_use blocks so far
	for i, m := range r.Messages {
		where := fmt.Sprintf("messages[%d]", i)
		var err error
		switch m.Role {
		case "user":
			chat.Messages, err = userTurn(chat.Messages, m.Content, where, called)
		case "system":
			// Clients add reminders as system turns within a conversation;
			// templates take system turns first only: it is the user's text.
			var text string
			if text, err = blockText(m.Content, where, false); err == nil {
				chat.Messages = append(chat.Messages, Message{Role: "user", Content: Content(text)})
			}
		case "assistant":
			if i == len(r.Messages)-1 && emptyTurn(m.Content) {
				continue // an empty prefill: the answer starts afresh
			}
			chat.Messages, err = assistantTurn(chat.Messages, m.Content, where, called)
			chat.ContinueFinalMessage = i == len(r.Messages)-1 // Anthropic's prefill: the answer goes on from it
		default:
			err = invalid("messages", "%s: role must be user or assistant, got %q", where, m.Role)
		}
		if err != nil {
			return nil, err
		}
	}
	chat.Messages = joinUserTurns(chat.Messages)
	if err := r.tools(chat); err != nil {
		return nil, err
	}
	format, param := r.formatParam()
	if format != nil {
		if format.Type != "json_schema" || !given(format.Schema) {
			return nil, invalid(param, "%s must be {\"type\": \"json_schema\", \"schema\": ...}", param)
		}
		f.ResponseFormat = &ResponseFormat{Type: "json_object", Schema: format.Schema} // llama-server's spelling of a schema
	}
	if r.Thinking != nil {
		switch r.Thinking.Type {
		case "enabled":
			// As Anthropic's API checks it (the budget is not enforced here, so
			// one beyond max_tokens is taken).
			if r.Thinking.BudgetTokens < 1024 {
				return nil, invalid("thinking.budget_tokens", "thinking.budget_tokens: at least 1024 when thinking is enabled, got %d", r.Thinking.BudgetTokens)
			}
			fallthrough
		case "disabled":
			chat.ChatTemplateKwargs = json.RawMessage(fmt.Sprintf(`{"enable_thinking": %v}`, r.Thinking.Type == "enabled"))
		case "adaptive": // the template's default
		default:
			return nil, invalid("thinking", "thinking.type must be enabled, disabled or adaptive, got %q", r.Thinking.Type)
		}
	}
	return chat, nil
}

// emptyTurn reports whether blocks hold no text and no call.
func emptyTurn(blocks AnthropicContent) bool {
	for _, b := range blocks {
		if b.Type != "text" || b.noText || strings.TrimSpace(b.Text) != "" {
			return false
		}
	}
	return true
}

// joinUserTurns joins consecutive user messages into one, as Anthropic does
// (and templates that want roles to alternate need).
func joinUserTurns(msgs []Message) []Message {
	var out []Message
	for i := 0; i < len(msgs); {
		m, j := msgs[i], i+1
		if m.Role == "user" {
			for j < len(msgs) && msgs[j].Role == "user" {
				j++
			}
			if j > i+1 { // joined at once: one by one, the copies grow with the square of the turns
				parts := make([]string, j-i)
				for k, t := range msgs[i:j] {
					parts[k] = string(t.Content)
				}
				m.Content = Content(strings.Join(parts, "\n\n"))
			}
		}
		out = append(out, m)
		i = j
	}
	return out
}

// blockText joins text blocks (a system prompt, a tool result) and, with
// images (a tool result: Anthropic takes none in system text), images.
func blockText(blocks AnthropicContent, where string, images bool) (string, error) {
	var parts []string
	for _, b := range blocks {
		switch {
		case b.Type == "text":
			if b.noText {
				return "", errNoText(where)
			}
			parts = append(parts, b.Text)
		case b.Type == "image" && images:
			m, err := b.image(where)
			if err != nil {
				return "", err
			}
			parts = append(parts, m)
		case images:
			return "", invalid("messages", "%s: text and image blocks are read here, got %q", where, b.Type)
		default:
			return "", invalid("messages", "%s: only text blocks are read here, got %q", where, b.Type)
		}
	}
	return strings.Join(parts, "\n"), nil
}

// errNoText refuses a text block without its text, as Anthropic's API does.
func errNoText(where string) error {
	return invalid("messages", "%s: a text block needs its text field", where)
}

// image is an image block's marker.
func (b *ContentBlock) image(where string) (string, error) {
	if b.Source != nil && b.Source.Type == "url" {
		m, err := imageURLMarker(b.Source.URL)
		if err != nil {
			return "", invalid("messages", "%s: %v", where, err)
		}
		return m, nil
	}
	if b.Source == nil || b.Source.Type != "base64" {
		return "", invalid("messages", "%s: an image block's source must be {\"type\": \"base64\", \"media_type\": ..., \"data\": ...} or {\"type\": \"url\", \"url\": ...}", where)
	}
	data, err := decodeBase64(b.Source.Data)
	if err != nil {
		return "", invalid("messages", "%s: image: %v", where, err)
	}
	return imageMarker(data), nil
}

// userTurn appends a user turn's blocks: runs of text as user messages, tool
// results as tool messages, in their order. A tool result answers one of the
// calls called has, as Anthropic's API requires.
func userTurn(out []Message, blocks AnthropicContent, where string, called map[string]bool) ([]Message, error) {
	var text []string
	flush := func() {
		if len(text) > 0 {
			out = append(out, Message{Role: "user", Content: Content(strings.Join(text, "\n"))})
			text = nil
		}
	}
	for _, b := range blocks {
		switch b.Type {
		case "text":
			if b.noText {
				return nil, errNoText(where)
			}
			text = append(text, b.Text)
		case "image":
			m, err := b.image(where)
			if err != nil {
				return nil, err
			}
			text = append(text, m)
		case "tool_result":
			if b.ToolUseID == "" {
				return nil, invalid("messages", "%s: a tool_result needs its tool_use_id", where)
			}
			if !called[b.ToolUseID] {
				return nil, invalid("messages", "%s: tool_result for tool_use_id %q, which no earlier tool_use block has", where, b.ToolUseID)
			}
			result, err := blockText(b.Content, where+" tool_result", true)
			if err != nil {
				return nil, err
			}
			if b.IsError {
				result = "Error: " + result
			}
			flush()
			out = append(out, Message{Role: "tool", ToolCallID: b.ToolUseID, Content: Content(result)})
		default:
			return nil, invalid("messages", "%s: content blocks of type %q are not supported in a user turn (text and tool_result are)", where, b.Type)
		}
	}
	flush()
	return out, nil
}

// assistantTurn appends an assistant turn: its text, and its tool_use blocks
// as calls, their ids added to called.
func assistantTurn(out []Message, blocks AnthropicContent, where string, called map[string]bool) ([]Message, error) {
	var text []string
	var calls []ToolCall
	for _, b := range blocks {
		switch b.Type {
		case "text":
			if b.noText {
				return nil, errNoText(where)
			}
			text = append(text, b.Text)
		case "tool_use":
			if b.ID == "" || b.Name == "" {
				return nil, invalid("messages", "%s: a tool_use needs an id and a name", where)
			}
			input := bytes.TrimSpace(b.Input)
			if len(input) == 0 || input[0] != '{' {
				return nil, invalid("messages", "%s: tool_use %q: input must be an object", where, b.Name)
			}
			calls = append(calls, ToolCall{ID: b.ID, Type: "function", Function: FunctionCall{Name: b.Name, Arguments: string(input)}})
			called[b.ID] = true
		case "thinking", "redacted_thinking":
		default:
			return nil, invalid("messages", "%s: content blocks of type %q are not supported in an assistant turn", where, b.Type)
		}
	}
	m := Message{Role: "assistant", Content: Content(strings.Join(text, ""))}
	if len(calls) > 0 {
		raw, err := json.Marshal(calls)
		if err != nil {
			return nil, err
		}
		m.ToolCalls = raw
	}
	return append(out, m), nil
}

// formatParam is r's output format and the field it is in: output_config.format,
// or the older output_format.
func (r *MessagesRequest) formatParam() (*outputFormat, string) {
	if oc := r.OutputConfig; oc != nil && oc.Format != nil {
		return oc.Format, "output_config.format"
	}
	return r.OutputFormat, "output_format"
}

// tools translates r's tools and tool_choice into chat's.
func (r *MessagesRequest) tools(chat *ChatRequest) error {
	if len(r.Tools) > 0 {
		type function struct {
			Name        string          `json:"name"`
			Description string          `json:"description,omitempty"`
			Parameters  json.RawMessage `json:"parameters,omitempty"`
		}
		type tool struct {
			Type     string   `json:"type"`
			Function function `json:"function"`
		}
		var tools []tool
		for i, t := range r.Tools {
			if t.Type != "" && t.Type != "custom" {
				return invalid("tools", "tools[%d]: %q tools are Anthropic's own and not served here; client tools (with an input_schema) are", i, t.Type)
			}
			if !given(t.InputSchema) {
				return invalid("tools", "tools[%d].input_schema is required", i)
			}
			tools = append(tools, tool{Type: "function", Function: function{Name: t.Name, Description: t.Description, Parameters: t.InputSchema}})
		}
		raw, err := json.Marshal(tools)
		if err != nil {
			return err
		}
		chat.Tools = raw
	}
	tc := r.ToolChoice
	if tc == nil {
		return nil
	}
	var choice any
	switch tc.Type {
	case "auto":
		choice = "auto"
	case "any":
		choice = "required"
	case "none":
		choice = "none"
	case "tool":
		if tc.Name == "" {
			return invalid("tool_choice", `tool_choice {"type": "tool"} needs the tool's "name"`)
		}
		choice = map[string]any{"type": "function", "function": map[string]string{"name": tc.Name}}
	default:
		return invalid("tool_choice", "tool_choice.type must be auto, any, tool or none, got %q", tc.Type)
	}
	raw, _ := json.Marshal(choice)
	chat.ToolChoice = raw
	if tc.DisableParallelToolUse {
		no := false
		chat.ParallelToolCalls = &no
	}
	return nil
}

// messages serves POST /v1/messages.
func (s *Server) messages(c *gin.Context) {
	var req MessagesRequest
	b, forwarded, ok := s.beginGeneration(c, &req, &req.Model, nil)
	if !ok {
		return
	}
	if req.MaxTokens == nil {
		abort(c, invalid("max_tokens", "max_tokens is required"))
		return
	}
	// max_tokens 0 warms the prompt cache (Anthropic's): the prompt is
	// computed (and a token drawn, unseen), the answer is empty.
	warm := *req.MaxTokens == 0
	if warm {
		one := 1
		req.MaxTokens = &one
	}
	params := anthropicParams
	if _, at := req.formatParam(); at != params["response_format"] {
		params = maps.Clone(params)
		params["response_format"] = at
	}
	if p, ok := s.translatedPlan(c, b, req.chatRequest, params); ok {
		p.anthropic, p.warm = true, warm
		s.routeOrRun(c, b, p, forwarded)
	}
}

// translatedPlan plans a request of another API (Anthropic's, the Responses
// API) as the chat request translate makes of it; false when it answered with
// an error. Its output limit is a bound the context caps (Anthropic's
// max_tokens is required, and clients send large ones: Claude Code 32000)
// rather than a reason to refuse the request, as llama-server and Ollama
// take it.
// params names the chat fields the request has under other names: its errors
// name its own.
func (s *Server) translatedPlan(c *gin.Context, b *Backend, translate func() (*ChatRequest, error), params map[string]string) (*plan, bool) {
	chat, err := translate()
	var p *plan
	if err == nil {
		p, err = s.chatPlan(b, chat)
	}
	if err != nil {
		if e := (*Error)(nil); errors.As(err, &e) {
			err = e.renamed(params)
		}
		abort(c, err)
		return nil, false
	}
	p.maxTokensAsked, p.params = false, params
	return p, true
}

// anthropicParams are the chat fields a message request names otherwise
// (a tool's parameters its input_schema).
var anthropicParams = map[string]string{"stop": "stop_sequences", "response_format": "output_config.format", "parameters": "input_schema"}

// responsesParams are the chat fields a Responses request names otherwise.
var responsesParams = map[string]string{"max_tokens": "max_output_tokens", "messages": "input", "response_format": "text.format"}

// countTokens serves POST /v1/messages/count_tokens: the prompt tokens a
// message request would have.
func (s *Server) countTokens(c *gin.Context) {
	var req MessagesRequest
	b, ok := s.decodeFor(c, &req, &req.Model)
	if !ok {
		return
	}
	chat, err := req.chatRequest()
	if err == nil && len(chat.Messages) == 0 {
		err = invalid("messages", "messages must not be empty")
	}
	n := 0
	if err == nil {
		n, err = chatPromptTokens(c.Request.Context(), b, chat)
	}
	if err != nil {
		abort(c, err)
		return
	}
	c.JSON(http.StatusOK, gin.H{"input_tokens": n})
}

// chatPromptTokens counts the tokens of the prompt chatPlan would lay out for
// chat, without planning the rest of it (grammars, sampling).
func chatPromptTokens(ctx context.Context, b *Backend, chat *ChatRequest) (int, error) {
	tp, err := toolsOf(&chat.ToolFields, &chat.SamplingFields)
	if err != nil {
		return 0, err
	}
	end, err := turnEndOf(chat.AddGenerationPrompt, chat.ContinueFinalMessage)
	if err != nil {
		return 0, err
	}
	text, err := chatPromptEnding(b, chat.Messages, tp, chat.ChatTemplateKwargs, end)
	if err != nil {
		return 0, err
	}
	if hasImages(text) {
		return countWithImages(ctx, b, text)
	}
	toks, err := b.Vocab.Tokenize(text, true, true)
	return len(toks), err
}

// stopReason is Anthropic's stop_reason and stop_sequence of an answer.
func (a *chatAnswer) anthropicStop() (reason string, sequence *string) {
	switch a.finish {
	case "length":
		return "max_tokens", nil
	case "tool_calls":
		return "tool_use", nil
	}
	if s, ok := a.stop.(string); ok {
		return "stop_sequence", &s
	}
	return "end_turn", nil
}

// blocks are a's content blocks: its thinking, its text, its calls.
func (a *chatAnswer) blocks() []any {
	out := []any{}
	if a.reasoning != "" {
		out = append(out, thinkingBlock{Type: "thinking", Thinking: a.reasoning})
	}
	if a.text != "" && (len(a.calls) == 0 || strings.TrimSpace(a.text) != "") {
		out = append(out, textBlock{Type: "text", Text: a.text})
	}
	for _, tc := range a.calls {
		out = append(out, toolUseBlock{Type: "tool_use", ID: tc.ID, Name: tc.Function.Name, Input: callInput(tc.Function.Arguments)})
	}
	return out
}

// spaceHold holds back streamed text that is only whitespace so far, before
// a text block opens: when calls follow, the whole answer leaves such a
// block out (blocks), and the stream does too.
type spaceHold struct{ held string }

// add returns the text to pass on now; open: a text block is open.
func (h *spaceHold) add(text string, open bool) string {
	if !open && strings.TrimSpace(h.held+text) == "" {
		h.held += text
		return ""
	}
	text, h.held = h.held+text, ""
	return text
}

// drop returns the text held, and forgets it.
func (h *spaceHold) drop() string {
	held := h.held
	h.held = ""
	return held
}

// callInput is a call's arguments as an object; a call cut short by
// max_tokens, whose arguments are not whole JSON, gets an empty one.
func callInput(args string) json.RawMessage {
	if json.Valid([]byte(args)) && strings.HasPrefix(strings.TrimSpace(args), "{") {
		return json.RawMessage(args)
	}
	return json.RawMessage("{}")
}

// messageWhole answers a message request with the whole message.
func (s *Server) messageWhole(c *gin.Context, b *Backend, p *plan, subs []submitted) {
	choices, usage, ok := s.collect(c, b, p, subs)
	if !ok {
		return
	}
	a := s.answer(&choices[0])
	if p.warm {
		a, usage.CompletionTokens = chatAnswer{finish: "length"}, 0
	}
	reason, seq := a.anthropicStop()
	c.JSON(http.StatusOK, MessageResponse{ID: s.newID("msg"), Type: "message", Role: "assistant", Model: p.model,
		Content: a.blocks(), StopReason: &reason, StopSequence: seq, Usage: anthropicUsage(usage)})
}

// followOne reads p's one choice to its end, passing its thoughts and text to
// emit as they come, and returns its answer once whole (the text held back
// until the end, the calls) and the scheduler's usage. seen, when set, sees
// each token and finish event first.
func (s *Server) followOne(ctx context.Context, b *Backend, p *plan, sub submitted, seen func(scheduler.Event), emit func(reasoning, text string), calls func([]ToolCallDelta)) (chatAnswer, scheduler.Usage, error) {
	var ch choiceState
	u, err := s.drain(ctx, b, p, sub, func(ev scheduler.Event) {
		if seen != nil {
			seen(ev)
		}
		if !ch.started {
			ch.output, ch.started = p.newOutput(), true
		}
		reasoning, text := "", ev.Text
		if ch.output != nil {
			reasoning, text = ch.output.follow(sub.stream, ev)
		}
		ch.countThought(ev, reasoning)
		emit(reasoning, text)
		if calls != nil && ch.output != nil && ev.Kind == scheduler.EventToken {
			if d := ch.output.callProgress(s.newCallID); len(d) > 0 {
				calls(d)
			}
		}
		if ev.Kind == scheduler.EventFinish {
			ch.finish, ch.stop = finishString(ev.Finish), stopReason(ev)
		}
	})
	if err != nil {
		return chatAnswer{}, u, err
	}
	a := s.answer(&ch) // ch holds no text (it was passed on): a.text is what was held
	if calls != nil && ch.output != nil {
		if d := ch.output.callRest(a.calls); len(d) > 0 {
			calls(d)
		}
	}
	return a, u, nil
}

// messageStream answers a message request with Anthropic's events:
// message_start, then each content block's start, deltas and stop (thinking
// and text as they come, tool calls' input as it is written), message_delta with the
// stop reason and usage, and message_stop.
func (s *Server) messageStream(c *gin.Context, b *Backend, p *plan, subs []submitted) {
	ctx := c.Request.Context()
	w := &sseWriter{c: c}
	w.start()
	sub := subs[0]
	w.event("message_start", gin.H{"type": "message_start", "message": MessageResponse{ID: s.newID("msg"), Type: "message",
		Role: "assistant", Model: p.model, Content: []any{}, Usage: AnthropicUsage{InputTokens: len(p.prompts[0])}}})
	ping := func() { w.event("ping", gin.H{"type": "ping"}) }
	ping()
	defer w.keepAlive(keepAliveEvery, ping)()
	index, open := -1, "" // the open block and its kind
	closeBlock := func() {
		if open == "thinking" { // no signature here, but the event Anthropic always sends
			w.event("content_block_delta", gin.H{"type": "content_block_delta", "index": index, "delta": gin.H{"type": "signature_delta", "signature": ""}})
		}
		if open != "" {
			w.event("content_block_stop", gin.H{"type": "content_block_stop", "index": index})
			open = ""
		}
	}
	emit := func(kind, text string) {
		if text == "" || p.warm {
			return
		}
		if open != kind {
			closeBlock()
			index, open = index+1, kind
			var block any = textBlock{Type: "text"}
			if kind == "thinking" {
				block = thinkingBlock{Type: "thinking"}
			}
			w.event("content_block_start", gin.H{"type": "content_block_start", "index": index, "content_block": block})
		}
		delta := gin.H{"type": "text_delta", "text": text}
		if kind == "thinking" {
			delta = gin.H{"type": "thinking_delta", "thinking": text}
		}
		w.event("content_block_delta", gin.H{"type": "content_block_delta", "index": index, "delta": delta})
	}
	var spaces spaceHold
	emitText := func(text string) { emit("text", spaces.add(text, open == "text")) }
	toolUse := func(ds []ToolCallDelta) {
		for _, d := range ds {
			if d.ID != "" { // a new call: its block
				spaces.drop()
				closeBlock()
				index, open = index+1, "tool_use"
				w.event("content_block_start", gin.H{"type": "content_block_start", "index": index,
					"content_block": toolUseBlock{Type: "tool_use", ID: d.ID, Name: d.Function.Name, Input: json.RawMessage("{}")}})
			}
			if d.Function.Arguments != "" {
				w.event("content_block_delta", gin.H{"type": "content_block_delta", "index": index,
					"delta": gin.H{"type": "input_json_delta", "partial_json": d.Function.Arguments}})
			}
		}
	}
	a, u, err := s.followOne(ctx, b, p, sub, nil, func(reasoning, text string) {
		emit("thinking", reasoning)
		emitText(text)
	}, toolUse)
	if err != nil {
		if ctx.Err() == nil {
			// Headers are sent: the error is an event, as Anthropic sends one.
			w.event("error", anthropicError(toAPIError(err)))
		}
		return
	}
	var usage Usage
	addUsage(&usage, u)
	if p.warm {
		a, usage.CompletionTokens = chatAnswer{finish: "length"}, 0
	}
	emitText(a.text)
	if len(a.calls) == 0 {
		emit("text", spaces.drop()) // an answer of only whitespace is one
	}
	closeBlock()
	reason, seq := a.anthropicStop()
	w.event("message_delta", gin.H{"type": "message_delta", "delta": gin.H{"stop_reason": reason, "stop_sequence": seq},
		"usage": anthropicUsage(usage)})
	w.event("message_stop", gin.H{"type": "message_stop"})
}
