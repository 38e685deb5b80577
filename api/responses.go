package api

import (
	"encoding/json"
	"fmt"
	"net/http"
	"slices"
	"strings"
	"time"

	"github.com/gin-gonic/gin"
)

// OpenAI's Responses API (POST /v1/responses), as vLLM and Ollama serve it for
// clients built on it (Codex, the Agents SDK), without state: every request
// carries its whole conversation (previous_response_id is refused, nothing is
// stored). A request is translated into a chat request and served by the same
// plan; its answer is written as output items (reasoning, message,
// function_call), whole or as the Responses stream of events.

// ResponsesRequest is the body of POST /v1/responses.
type ResponsesRequest struct {
	Model              string          `json:"model"`
	Input              json.RawMessage `json:"input"` // a string, or input items
	Instructions       string          `json:"instructions"`
	MaxOutputTokens    *int            `json:"max_output_tokens"`
	Temperature        *float64        `json:"temperature"`
	TopP               *float64        `json:"top_p"`
	Tools              []ResponsesTool `json:"tools"`
	ToolChoice         json.RawMessage `json:"tool_choice"`
	ParallelToolCalls  *bool           `json:"parallel_tool_calls"`
	Stream             bool            `json:"stream"`
	PreviousResponseID string          `json:"previous_response_id"`
	Background         bool            `json:"background"`
	Conversation       json.RawMessage `json:"conversation"` // stored state: refused
	Prompt             json.RawMessage `json:"prompt"`       // a stored prompt: refused
	Reasoning          *struct {
		Effort string `json:"effort"` // none or minimal: the template's enable_thinking false
	} `json:"reasoning"`
	Text *struct {
		Format *struct {
			Type   string          `json:"type"`
			Name   string          `json:"name"`
			Schema json.RawMessage `json:"schema"`
		} `json:"format"`
	} `json:"text"`
	// Store, Metadata, User, Reasoning (effort), Include, Truncation: taken and
	// not used (nothing is stored; a reasoning model reasons as its template says).
	Store    *bool           `json:"store"`
	Metadata json.RawMessage `json:"metadata"`
}

// ResponsesTool is a tool, flat as the Responses API writes it: a function,
// or a custom (freeform) tool, whose one input is text.
type ResponsesTool struct {
	Type        string          `json:"type"`
	Name        string          `json:"name"`
	Description string          `json:"description,omitempty"`
	Parameters  json.RawMessage `json:"parameters,omitempty"`
	Strict      *bool           `json:"strict,omitempty"`
}

// responseItem is an input item: a message (type "message" or none), an
// earlier function_call, its function_call_output, or reasoning (left out).
type responseItem struct {
	Type      string          `json:"type"`
	Role      string          `json:"role"`
	Input     string          `json:"input"` // a custom_tool_call's
	Content   json.RawMessage `json:"content"`
	CallID    string          `json:"call_id"`
	Name      string          `json:"name"`
	Arguments string          `json:"arguments"`
	Output    json.RawMessage `json:"output"`
}

// Response is a whole response, and the response of the stream's first and
// last events.
type Response struct {
	ID                string          `json:"id"`
	Object            string          `json:"object"`
	CreatedAt         int64           `json:"created_at"`
	Status            string          `json:"status"`
	Model             string          `json:"model"`
	Output            []any           `json:"output"`
	Usage             *ResponseUsage  `json:"usage"`
	IncompleteDetails *incomplete     `json:"incomplete_details"`
	Error             *ErrorDetail    `json:"error"`
	Instructions      *string         `json:"instructions"`
	MaxOutputTokens   *int            `json:"max_output_tokens"`
	ParallelToolCalls bool            `json:"parallel_tool_calls"`
	ToolChoice        json.RawMessage `json:"tool_choice"`
	Tools             []ResponsesTool `json:"tools"`
	Store             bool            `json:"store"`
	Temperature       *float64        `json:"temperature"`
	TopP              *float64        `json:"top_p"`
	Metadata          json.RawMessage `json:"metadata"`
	Truncation        string          `json:"truncation"`
	Text              json.RawMessage `json:"text"`
	Reasoning         json.RawMessage `json:"reasoning"`
}

type incomplete struct {
	Reason string `json:"reason"`
}

// ResponseUsage counts a response's tokens.
type ResponseUsage struct {
	InputTokens        int `json:"input_tokens"`
	InputTokensDetails struct {
		CachedTokens int `json:"cached_tokens"`
	} `json:"input_tokens_details"`
	OutputTokens        int `json:"output_tokens"`
	OutputTokensDetails struct {
		ReasoningTokens int `json:"reasoning_tokens"`
	} `json:"output_tokens_details"`
	TotalTokens int `json:"total_tokens"`
}

type outputText struct {
	Type        string `json:"type"`
	Text        string `json:"text"`
	Annotations []any  `json:"annotations"`
}

type messageItem struct {
	Type    string       `json:"type"`
	ID      string       `json:"id"`
	Status  string       `json:"status"`
	Role    string       `json:"role"`
	Content []outputText `json:"content"`
}

type reasoningText struct {
	Type string `json:"type"`
	Text string `json:"text"`
}

type reasoningItem struct {
	Type    string          `json:"type"`
	ID      string          `json:"id"`
	Summary []any           `json:"summary"`
	Content []reasoningText `json:"content"`
}

type functionCallItem struct {
	Type      string `json:"type"`
	ID        string `json:"id"`
	CallID    string `json:"call_id"`
	Name      string `json:"name"`
	Arguments string `json:"arguments"`
	Status    string `json:"status"`
}

// customCallItem is a call of a custom tool: its input is text.
type customCallItem struct {
	Type   string `json:"type"`
	ID     string `json:"id"`
	CallID string `json:"call_id"`
	Name   string `json:"name"`
	Input  string `json:"input"`
	Status string `json:"status"`
}

// customInput is the parameter a custom tool's one text input is asked as.
var customInput = json.RawMessage(`{"type":"object","properties":{"input":{"type":"string"}},"required":["input"],"additionalProperties":false}`)

// hostedTools are tools the Responses API runs itself: a server without them
// leaves them out rather than fail every request of a client that offers them.
var hostedTools = []string{"web_search", "web_search_preview", "web_search_2025_08_26", "file_search", "code_interpreter",
	"image_generation", "computer_use_preview", "local_shell", "mcp"}

// chatRequest translates r into a chat request.
func (r *ResponsesRequest) chatRequest() (*ChatRequest, error) {
	switch {
	case r.PreviousResponseID != "":
		return nil, invalid("previous_response_id", "responses are not stored here: send the whole conversation in input")
	case r.Background:
		return nil, invalid("background", "background responses are not supported")
	case given(r.Conversation):
		return nil, invalid("conversation", "conversations are not stored here: send the whole conversation in input")
	case given(r.Prompt):
		return nil, invalid("prompt", "stored prompts are not served here: send instructions and input")
	}
	chat := &ChatRequest{}
	f := &chat.SamplingFields
	f.Model, f.Stream, f.Temperature, f.TopP = r.Model, r.Stream, r.Temperature, r.TopP
	chat.MaxTokens = r.MaxOutputTokens
	if r.Instructions != "" {
		chat.Messages = append(chat.Messages, Message{Role: "system", Content: Content(r.Instructions)})
	}
	msgs, err := inputMessages(r.Input)
	if err != nil {
		return nil, err
	}
	chat.Messages = append(chat.Messages, msgs...)
	var tools []Tool
	for i, t := range r.Tools {
		switch {
		case t.Type == "function":
			tools = append(tools, Tool{Type: "function", Function: &FunctionDef{Name: t.Name, Description: t.Description, Parameters: t.Parameters, Strict: t.Strict}})
		case t.Type == "custom":
			tools = append(tools, Tool{Type: "function", Function: &FunctionDef{Name: t.Name, Description: t.Description, Parameters: customInput}})
		case slices.Contains(hostedTools, t.Type):
		default:
			return nil, invalid("tools", "tools[%d]: %q tools are not served here; function and custom tools are", i, t.Type)
		}
	}
	if len(tools) > 0 {
		chat.Tools, _ = json.Marshal(tools)
	}
	if given(r.ToolChoice) {
		var named struct {
			Type string `json:"type"`
			Name string `json:"name"`
		}
		var word string
		switch {
		case json.Unmarshal(r.ToolChoice, &word) == nil && (word == "auto" || word == "none" || word == "required"):
			chat.ToolChoice = r.ToolChoice
		case json.Unmarshal(r.ToolChoice, &named) == nil && (named.Type == "function" || named.Type == "custom") && named.Name != "":
			chat.ToolChoice, _ = json.Marshal(map[string]any{"type": "function", "function": map[string]string{"name": named.Name}})
		default:
			return nil, invalid("tool_choice", "tool_choice must be auto, none, required or {\"type\": \"function\" (or \"custom\"), \"name\": ...}")
		}
	}
	chat.ParallelToolCalls = r.ParallelToolCalls
	if rs := r.Reasoning; rs != nil && (rs.Effort == "none" || rs.Effort == "minimal") {
		chat.ChatTemplateKwargs = json.RawMessage(`{"enable_thinking": false}`)
	}
	if r.Text != nil && r.Text.Format != nil {
		switch tf := r.Text.Format; tf.Type {
		case "text":
		case "json_object":
			f.ResponseFormat = &ResponseFormat{Type: "json_object"}
		case "json_schema":
			if !given(tf.Schema) {
				return nil, invalid("text", "text.format json_schema needs a schema")
			}
			f.ResponseFormat = &ResponseFormat{Type: "json_object", Schema: tf.Schema} // llama-server's spelling of a schema
		default:
			return nil, invalid("text", "text.format.type must be text, json_object or json_schema, got %q", tf.Type)
		}
	}
	return chat, nil
}

// inputMessages translates input (a string, or items) into chat messages:
// function calls join the assistant turn before them, their outputs become
// tool messages, reasoning items are left out.
func inputMessages(input json.RawMessage) ([]Message, error) {
	var text string
	if json.Unmarshal(input, &text) == nil {
		return []Message{{Role: "user", Content: Content(text)}}, nil
	}
	var items []responseItem
	if err := json.Unmarshal(input, &items); err != nil || len(items) == 0 {
		return nil, invalid("input", "input must be a string or a non-empty list of items")
	}
	var out []Message
	var calls []ToolCall        // of the assistant turn being built
	called := map[string]bool{} // call ids of the calls so far
	flush := func() {
		if len(calls) == 0 {
			return
		}
		raw, _ := json.Marshal(calls)
		if n := len(out); n > 0 && out[n-1].Role == "assistant" && !given(out[n-1].ToolCalls) {
			out[n-1].ToolCalls = raw // the text the calls followed
		} else {
			out = append(out, Message{Role: "assistant", ToolCalls: raw})
		}
		calls = nil
	}
	for i, it := range items {
		where := fmt.Sprintf("input[%d]", i)
		switch it.Type {
		case "", "message":
			flush()
			switch it.Role {
			case "user", "system", "developer", "assistant":
			default:
				return nil, invalid("input", "%s: role must be user, system, developer or assistant, got %q", where, it.Role)
			}
			text, err := itemText(it.Content, where)
			if err != nil {
				return nil, err
			}
			out = append(out, Message{Role: it.Role, Content: Content(text)})
		case "function_call", "custom_tool_call":
			if it.CallID == "" || it.Name == "" {
				return nil, invalid("input", "%s: a %s needs a call_id and a name", where, it.Type)
			}
			args := it.Arguments
			if it.Type == "custom_tool_call" {
				b, _ := json.Marshal(map[string]string{"input": it.Input})
				args = string(b)
			} else if !jsonObject(args) {
				args = "{}" // a call cut short by max_output_tokens, as clients send it back
			}
			calls = append(calls, ToolCall{ID: it.CallID, Type: "function", Function: FunctionCall{Name: it.Name, Arguments: args}})
			called[it.CallID] = true
		case "function_call_output", "custom_tool_call_output":
			if it.CallID == "" {
				return nil, invalid("input", "%s: a %s needs the call_id of its call", where, it.Type)
			}
			if !called[it.CallID] {
				// As OpenAI's API refuses it: the input carries the whole conversation.
				return nil, invalid("input", "%s: no tool call found for %s with call_id %q", where, it.Type, it.CallID)
			}
			flush()
			result, err := itemText(it.Output, where)
			if err != nil {
				return nil, err
			}
			out = append(out, Message{Role: "tool", ToolCallID: it.CallID, Content: Content(result)})
		case "reasoning", "web_search_call", "file_search_call", "image_generation_call", "code_interpreter_call":
			// Thoughts (templates leave earlier ones out), hosted tools' work.
		default:
			return nil, invalid("input", "%s: items of type %q are not supported (message, function_call, function_call_output, custom_tool_call, custom_tool_call_output and reasoning are)", where, it.Type)
		}
	}
	flush()
	return out, nil
}

// jsonObject reports whether s is a JSON object.
func jsonObject(s string) bool {
	var m map[string]json.RawMessage
	return json.Unmarshal([]byte(s), &m) == nil && m != nil
}

// itemText is a message's (or a function output's) content: a string, or
// text parts joined.
func itemText(raw json.RawMessage, where string) (string, error) {
	var s string
	if json.Unmarshal(raw, &s) == nil {
		return s, nil
	}
	var parts []struct {
		Type     string `json:"type"`
		Text     string `json:"text"`
		Refusal  string `json:"refusal"`
		ImageURL string `json:"image_url"` // an input_image's data: URL
	}
	if err := json.Unmarshal(raw, &parts); err != nil {
		return "", invalid("input", "%s: content must be a string or a list of text parts", where)
	}
	var texts []string
	for _, p := range parts {
		switch p.Type {
		case "input_text", "output_text", "text":
			texts = append(texts, p.Text)
		case "refusal":
			texts = append(texts, p.Refusal)
		case "input_image":
			m, err := imageURLMarker(p.ImageURL)
			if err != nil {
				return "", invalid("input", "%s: %v", where, err)
			}
			texts = append(texts, m)
		default:
			return "", invalid("input", "%s: content parts of type %q are not supported (text and input_image parts are)", where, p.Type)
		}
	}
	return strings.Join(texts, "\n"), nil
}

// responses serves POST /v1/responses.
func (s *Server) responses(c *gin.Context) {
	var req ResponsesRequest
	b, forwarded, ok := s.beginGeneration(c, &req, &req.Model, nil)
	if !ok {
		return
	}
	if p, ok := s.translatedPlan(c, b, req.chatRequest, responsesParams); ok {
		p.responses = &req
		s.routeOrRun(c, b, p, forwarded)
	}
}

// newResponse is the response object of p, as its stream starts.
func (s *Server) newResponse(p *plan) Response {
	r := p.responses
	resp := Response{ID: s.newID("resp"), Object: "response", CreatedAt: s.now().Unix(), Status: "in_progress", Model: p.model,
		Output: []any{}, MaxOutputTokens: r.MaxOutputTokens, ParallelToolCalls: r.ParallelToolCalls == nil || *r.ParallelToolCalls,
		ToolChoice: r.ToolChoice, Tools: r.Tools, Temperature: r.Temperature, TopP: r.TopP, Metadata: r.Metadata, Truncation: "disabled",
		Text: json.RawMessage(`{"format":{"type":"text"}}`), Reasoning: json.RawMessage(`{"effort":null,"summary":null}`)}
	if r.Instructions != "" {
		resp.Instructions = &r.Instructions
	}
	if !given(resp.ToolChoice) {
		resp.ToolChoice = json.RawMessage(`"auto"`)
	}
	if resp.Tools == nil {
		resp.Tools = []ResponsesTool{}
	}
	if !given(resp.Metadata) {
		resp.Metadata = json.RawMessage(`{}`)
	}
	if r.Text != nil && r.Text.Format != nil {
		resp.Text, _ = json.Marshal(r.Text)
	}
	return resp
}

// finishResponse completes resp with a's output items (as given) and the usage.
func finishResponse(resp *Response, a *chatAnswer, items []any, u Usage) {
	resp.Output = items
	if items == nil {
		resp.Output = []any{} // always an array, cut before any item too
	}
	resp.Status = "completed"
	if a.finish == "length" {
		resp.Status, resp.IncompleteDetails = "incomplete", &incomplete{Reason: "max_output_tokens"}
	}
	ru := &ResponseUsage{InputTokens: u.PromptTokens, OutputTokens: u.CompletionTokens, TotalTokens: u.TotalTokens}
	ru.InputTokensDetails.CachedTokens = u.PromptTokensDetails.CachedTokens
	ru.OutputTokensDetails.ReasoningTokens = a.reasoningTokens
	resp.Usage = ru
}

// cutBeforeText reports whether max_output_tokens cut a before any text or
// call (while it thought, or named a call): it has no message item.
func cutBeforeText(a *chatAnswer) bool {
	return a.finish == "length" && a.text == "" && len(a.calls) == 0
}

// itemStatus is the status of a's items: incomplete when max_output_tokens cut it.
func (a *chatAnswer) itemStatus() string {
	if a.finish == "length" {
		return "incomplete"
	}
	return "completed"
}

// callItem is call tc as an output item: a function_call, or a
// custom_tool_call for a custom tool (its input the text it was asked for).
func (s *Server) callItem(r *ResponsesRequest, tc ToolCall, status string) any {
	for _, t := range r.Tools {
		if t.Type == "custom" && t.Name == tc.Function.Name {
			return customCallItem{Type: "custom_tool_call", ID: s.newID("ctc"), CallID: tc.ID, Name: tc.Function.Name, Input: callText(tc.Function.Arguments), Status: status}
		}
	}
	return functionCallItem{Type: "function_call", ID: s.newID("fc"), CallID: tc.ID, Name: tc.Function.Name, Arguments: tc.Function.Arguments, Status: status}
}

// callText is a custom tool call's input: the string its arguments,
// {"input": "..."}, hold, or for a call cut short what was written of it.
func callText(args string) string {
	var in struct {
		Input string `json:"input"`
	}
	if json.Unmarshal([]byte(args), &in) == nil {
		return in.Input
	}
	var d inputDecoder
	return d.more(args)
}

// inputDecoder decodes a custom tool call's input from its arguments as they
// are written, {"input":"... (compacted JSON), each byte once.
type inputDecoder struct {
	at  int // the bytes of the arguments read
	str jsonString
}

// more returns the input that args, the arguments so far, adds to what was
// returned before.
func (d *inputDecoder) more(args string) string {
	const head = `{"input":"`
	if d.at == 0 {
		if !strings.HasPrefix(args, head) {
			return ""
		}
		d.at = len(head) - 1 // from the string's opening quote
	}
	piece := args[d.at:]
	d.at = len(args)
	return d.str.add(piece)
}

// responseItems are a's output items: its reasoning, its text, its calls.
func (s *Server) responseItems(r *ResponsesRequest, a *chatAnswer) []any {
	items := []any{}
	if a.reasoning != "" {
		items = append(items, reasoningItem{Type: "reasoning", ID: s.newID("rs"), Summary: []any{}, Content: []reasoningText{{Type: "reasoning_text", Text: a.reasoning}}})
	}
	status := a.itemStatus()
	if a.text != "" && (len(a.calls) == 0 || strings.TrimSpace(a.text) != "") || len(a.calls) == 0 && !cutBeforeText(a) {
		// An empty answer is an empty message (unless max_output_tokens cut it
		// before it began, as OpenAI leaves it out then).
		items = append(items, messageItem{Type: "message", ID: s.newID("msg"), Status: status, Role: "assistant",
			Content: []outputText{{Type: "output_text", Text: a.text, Annotations: []any{}}}})
	}
	for i, tc := range a.calls {
		st := "completed"
		if i == len(a.calls)-1 {
			st = status // the last call is the one max_output_tokens cut
		}
		items = append(items, s.callItem(r, tc, st))
	}
	return items
}

// responseWhole answers a Responses request with the whole response.
func (s *Server) responseWhole(c *gin.Context, b *Backend, p *plan, subs []submitted) {
	choices, usage, ok := s.collect(c, b, p, subs)
	if !ok {
		return
	}
	a := s.answer(&choices[0])
	resp := s.newResponse(p)
	finishResponse(&resp, &a, s.responseItems(p.responses, &a), usage)
	c.JSON(http.StatusOK, resp)
}

// keepAliveEvery is how often a stream with nothing else to send says it is
// alive: clients give up on a silent stream (a long prefill, a call written
// whole before it is sent).
const keepAliveEvery = 10 * time.Second

// responseStream answers a Responses request with its events: the response
// created and in progress; per output item its addition, its parts and deltas
// (thoughts, text and calls' arguments as they are written) and its
// completion; then the response completed (or incomplete), whole. An SSE
// comment goes out every keepAliveEvery.
func (s *Server) responseStream(c *gin.Context, b *Backend, p *plan, subs []submitted) {
	ctx := c.Request.Context()
	w := &sseWriter{c: c}
	w.start()
	defer w.keepAlive(keepAliveEvery, func() { w.comment("keep-alive") })()
	seq := 0
	send := func(typ string, fields gin.H) {
		fields["type"], fields["sequence_number"] = typ, seq
		seq++
		w.event(typ, fields)
	}
	resp := s.newResponse(p)
	send("response.created", gin.H{"response": resp})
	send("response.in_progress", gin.H{"response": resp})
	var items []any
	open, id := "", "" // the item being streamed: reasoning or message
	var text strings.Builder
	part := func() any { // the open item's content part, as far as written
		if open == "reasoning" {
			return reasoningText{Type: "reasoning_text", Text: text.String()}
		}
		return outputText{Type: "output_text", Text: text.String(), Annotations: []any{}}
	}
	closeItem := func(status string) {
		if open == "" {
			return
		}
		idx, t := len(items), text.String()
		var item any
		if open == "reasoning" {
			send("response.reasoning_text.done", gin.H{"item_id": id, "output_index": idx, "content_index": 0, "text": t})
			item = reasoningItem{Type: "reasoning", ID: id, Summary: []any{}, Content: []reasoningText{{Type: "reasoning_text", Text: t}}}
		} else {
			send("response.output_text.done", gin.H{"item_id": id, "output_index": idx, "content_index": 0, "text": t, "logprobs": []any{}})
			item = messageItem{Type: "message", ID: id, Status: status, Role: "assistant", Content: []outputText{{Type: "output_text", Text: t, Annotations: []any{}}}}
		}
		send("response.content_part.done", gin.H{"item_id": id, "output_index": idx, "content_index": 0, "part": part()})
		send("response.output_item.done", gin.H{"output_index": idx, "item": item})
		items = append(items, item)
		open = ""
		text.Reset()
	}
	start := func(kind string) {
		closeItem("completed")
		idx := len(items)
		open = kind
		text.Reset()
		if kind == "reasoning" {
			id = s.newID("rs")
			send("response.output_item.added", gin.H{"output_index": idx, "item": reasoningItem{Type: "reasoning", ID: id, Summary: []any{}, Content: []reasoningText{}}})
		} else {
			id = s.newID("msg")
			send("response.output_item.added", gin.H{"output_index": idx, "item": messageItem{Type: "message", ID: id, Status: "in_progress", Role: "assistant", Content: []outputText{}}})
		}
		send("response.content_part.added", gin.H{"item_id": id, "output_index": idx, "content_index": 0, "part": part()})
	}
	emit := func(kind, delta string) {
		if delta == "" {
			return
		}
		if open != kind {
			start(kind)
		}
		idx := len(items)
		text.WriteString(delta)
		if kind == "reasoning" {
			send("response.reasoning_text.delta", gin.H{"item_id": id, "output_index": idx, "content_index": 0, "delta": delta})
		} else {
			send("response.output_text.delta", gin.H{"item_id": id, "output_index": idx, "content_index": 0, "delta": delta, "logprobs": []any{}})
		}
	}
	// The call being streamed: its item, and its arguments (a custom tool's
	// input) passed on so far.
	var call any
	var args strings.Builder
	var input inputDecoder
	endCall := func(status string) {
		idx := len(items)
		switch it := call.(type) {
		case functionCallItem:
			send("response.function_call_arguments.done", gin.H{"item_id": it.ID, "output_index": idx, "name": it.Name, "arguments": args.String()})
			it.Arguments, it.Status = args.String(), status
			call = it
		case customCallItem:
			it.Input, it.Status = callText(args.String()), status
			send("response.custom_tool_call_input.done", gin.H{"item_id": it.ID, "output_index": idx, "input": it.Input})
			call = it
		default:
			return
		}
		send("response.output_item.done", gin.H{"output_index": idx, "item": call})
		items = append(items, call)
		call = nil
	}
	toolCalls := func(ds []ToolCallDelta) {
		for _, d := range ds {
			if d.ID != "" { // a new call: its item
				closeItem("completed")
				endCall("completed")
				call = s.callItem(p.responses, ToolCall{ID: d.ID, Function: FunctionCall{Name: d.Function.Name}}, "in_progress")
				args.Reset()
				input = inputDecoder{}
				send("response.output_item.added", gin.H{"output_index": len(items), "item": call})
			}
			args.WriteString(d.Function.Arguments) // grown in place: a long call costs what each delta adds
			switch it := call.(type) {
			case functionCallItem:
				if d.Function.Arguments != "" {
					send("response.function_call_arguments.delta", gin.H{"item_id": it.ID, "output_index": len(items), "delta": d.Function.Arguments})
				}
			case customCallItem:
				if more := input.more(args.String()); more != "" {
					send("response.custom_tool_call_input.delta", gin.H{"item_id": it.ID, "output_index": len(items), "delta": more})
				}
			}
		}
	}
	a, u, err := s.followOne(ctx, b, p, subs[0], nil, func(reasoning, text string) {
		emit("reasoning", reasoning)
		emit("message", text)
	}, toolCalls)
	if err != nil {
		if ctx.Err() == nil {
			// Headers are sent: the failure is the response's, as OpenAI sends
			// it, with what was streamed of it.
			closeItem("incomplete")
			endCall("incomplete")
			if len(items) > 0 {
				resp.Output = items
			}
			e := toAPIError(err)
			resp.Status, resp.Error = "failed", &ErrorDetail{Message: e.Message, Type: e.Type}
			if e.Code != "" {
				resp.Error.Code = &e.Code
			}
			send("response.failed", gin.H{"response": resp})
		}
		return
	}
	var usage Usage
	addUsage(&usage, u)
	endCall(a.itemStatus())
	emit("message", a.text)
	if open != "message" && len(a.calls) == 0 && !cutBeforeText(&a) && !slices.ContainsFunc(items, func(it any) bool { _, ok := it.(messageItem); return ok }) {
		start("message") // an empty answer is an empty message, as in a whole response
	}
	closeItem(a.itemStatus())
	finishResponse(&resp, &a, items, usage)
	if resp.Status == "incomplete" {
		send("response.incomplete", gin.H{"response": resp})
	} else {
		send("response.completed", gin.H{"response": resp})
	}
}
