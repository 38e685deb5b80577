package api

import (
	"bytes"
	"cmp"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"maps"
	"regexp"
	"slices"
	"strings"
	"time"
	"unicode/utf16"
	"unicode/utf8"

	"github.com/shoal-ai/shoal/engine"
	"github.com/shoal-ai/shoal/scheduler"
)

// Tool calling works the same way for every model. llama.cpp's chat formats
// render a message's role and content only, so the tools cannot be shown to a
// model in the form it was trained on (that needs the model's Jinja template).
// Instead, as llama-server does for models without native tool support, the
// tools are described in the system message, and a grammar makes the model
// answer with one JSON object:
//
//	{"tool_calls": [{"name": "get_weather", "arguments": {"city": "Oslo"}}]}
//	{"response": "plain answer"}
//
// The grammar lets through only the offered tools' names, each with arguments
// matching its parameters schema; whether the model picks the right tool is up
// to the model. Earlier calls in the history are rendered in the same form, and
// tool results come back as user messages holding {"tool_response": ...}.

// Tool is one entry of a chat request's tools.
type Tool struct {
	Type     string       `json:"type"`
	Function *FunctionDef `json:"function"`
}

// FunctionDef describes a function the model may call.
type FunctionDef struct {
	Name        string          `json:"name"`
	Description string          `json:"description,omitempty"`
	Parameters  json.RawMessage `json:"parameters,omitempty"`
	Strict      *bool           `json:"strict,omitempty"`
}

// ToolCall is a call the model made (in a response) or made earlier (in a
// request's history); streamed, it goes out as ToolCallDeltas.
type ToolCall struct {
	ID       string       `json:"id"`
	Type     string       `json:"type"`
	Function FunctionCall `json:"function"`
}

// FunctionCall is a call's function and its arguments, a JSON object as text.
type FunctionCall struct {
	Name      string `json:"name"`
	Arguments string `json:"arguments"`
}

// UnmarshalJSON also takes arguments as an object, as some clients send them in
// a history (Ollama's API does).
func (f *FunctionCall) UnmarshalJSON(b []byte) error {
	var w struct {
		Name      string          `json:"name"`
		Arguments json.RawMessage `json:"arguments"`
	}
	if err := json.Unmarshal(b, &w); err != nil {
		return err
	}
	f.Name = w.Name
	if json.Unmarshal(w.Arguments, &f.Arguments) != nil && given(w.Arguments) {
		f.Arguments = string(compactJSON(w.Arguments))
	}
	return nil
}

// toolPlan is a request's validated tools and how the model must use them.
type toolPlan struct {
	tools    []FunctionDef // parameters filled in
	required bool          // tool_choice "required" or a named function
	named    string        // tool_choice's function, if one is named
	parallel bool          // parallel_tool_calls
	stopAt   stopMatcher   // the request's stop strings, matched in answers' text
	// answer is the JSON schema of an answer without calls: a string, or what
	// the request's output constraint (response_format, ...) asks for.
	answer json.RawMessage
	// constrained: the request has an output constraint (answer is its
	// schema, which may be a string's too: its answer is JSON still);
	// quoted: a JSON schema, so a string answer is passed on as its JSON,
	// quoted, as the same constraint gives without tools (guided_choice's,
	// guided_regex's are their text).
	constrained, quoted bool
	// format is the model's own way of calling tools (toolformat.go), when its
	// chat template shows the tools; nil: the tool protocol described here.
	format *callFormat
	// params are each callable tool's parameters, for the XML call format
	// (set with its grammar).
	params map[string][]toolParam
	// converting is the CPU time converting the tools' schemas has taken
	// (convert).
	converting time.Duration
}

// toolFollower follows one choice's output under tools.
type toolFollower interface {
	// follow takes the text of ev, an event of st, and returns the answer text
	// to pass on now.
	follow(st *scheduler.Stream, ev scheduler.Event) string
	// end is called when the output is whole. It returns the text not yet
	// passed on and the tool calls made.
	end(newID func() string) (text string, calls []ToolCall)
	// finishReason is the choice's finish_reason given the generator's (stop
	// or length) and the calls end returned.
	finishReason(generated string, calls []ToolCall) string
	// stopString is the stop string that ended the answer, "" if none did
	// (tokens after it are not the answer's).
	stopString() string
	// progress returns the calls written so far, for streaming them as they
	// are written: the same ids as end gives them, and of each call's
	// arguments a part that end's begin with.
	progress(newID func() string) []ToolCall
}

// follow follows one choice's output.
func (tp *toolPlan) follow() toolFollower {
	if tp.format != nil {
		cs := &callStream{f: tp.format, params: tp.params, stop: tp.stopAt, lazy: !tp.required}
		if cs.lazy {
			cs.offered = map[string]bool{}
			for _, t := range tp.tools {
				cs.offered[t.Name] = true
			}
		}
		return cs
	}
	return &answerStream{stop: tp.stopAt, str: jsonString{quoted: tp.quoted}}
}

// maxTools bounds a request's tools.
const maxTools = 512 // clients with many MCP servers offer hundreds

var toolName = regexp.MustCompile(`^[a-zA-Z0-9_.-]{1,128}$`) // MCP tools' names run long

// toolsOf validates a chat request's tools and tool_choice; out, when given, holds
// the request's output constraint (response_format, guided_json, ...), which
// answers without calls follow. It returns nil when the model is not to be
// offered tools: none were given, or tool_choice is "none" (the tools are then
// not shown, as the model may not call them).
func toolsOf(req *ToolFields, out *SamplingFields) (*toolPlan, error) {
	if (given(req.Functions) || given(req.FunctionCall)) && !isString(req.FunctionCall, "none") {
		param := "functions"
		if !given(req.Functions) {
			param = "function_call"
		}
		return nil, invalid(param, "functions and function_call are deprecated and not supported: send tools and tool_choice")
	}
	var tools []Tool
	if given(req.Tools) {
		if err := json.Unmarshal(req.Tools, &tools); err != nil {
			return nil, invalid("tools", "tools must be an array of {\"type\": \"function\", \"function\": {...}}: %v", err)
		}
	}
	if len(tools) > maxTools {
		return nil, invalid("tools", "at most %d tools are allowed, got %d", maxTools, len(tools))
	}
	tp := &toolPlan{parallel: req.ParallelToolCalls == nil || *req.ParallelToolCalls, answer: json.RawMessage(textAnswer)}
	seen := map[string]bool{}
	for i, t := range tools {
		param := fmt.Sprintf("tools[%d]", i)
		if t.Type != "function" || t.Function == nil {
			return nil, invalid(param, "%s: want {\"type\": \"function\", \"function\": {...}}, got type %q", param, t.Type)
		}
		f := *t.Function
		if !toolName.MatchString(f.Name) {
			return nil, invalid(param, "%s: function name %q must be 1 to 128 letters, digits, '_', '.' or '-'", param, f.Name)
		}
		if seen[f.Name] {
			return nil, invalid(param, "%s: function %q is offered twice", param, f.Name)
		}
		seen[f.Name] = true
		if !given(f.Parameters) || string(bytes.TrimSpace(f.Parameters)) == "{}" {
			f.Parameters = json.RawMessage(`{"type":"object","properties":{},"additionalProperties":false}`) // no parameters
		}
		var params map[string]any
		if err := json.Unmarshal(f.Parameters, &params); err != nil {
			return nil, invalid(param, "%s: parameters must be a JSON schema object: %v", param, err)
		}
		if t, ok := params["type"]; ok && t != "object" && !slices.Contains(anySlice(t), any("object")) {
			return nil, invalid(param, "%s: parameters must describe an object (arguments are passed by name), got type %v", param, t)
		}
		if d := schemaDepth(f.Parameters); d > maxSchemaDepth {
			return nil, invalid(param, "%s: parameters nest %d levels deep, more than %d", param, d, maxSchemaDepth)
		}
		if at := emptyChoice(params, "parameters"); at != "" {
			return nil, invalid(param, "%s: %s is an empty list: no value would match", param, at)
		}
		tp.tools = append(tp.tools, f)
	}
	choice := "auto"
	if given(req.ToolChoice) {
		var named struct {
			Type     string `json:"type"`
			Function struct {
				Name string `json:"name"`
			} `json:"function"`
		}
		switch {
		case json.Unmarshal(req.ToolChoice, &choice) == nil:
			if choice != "none" && choice != "auto" && choice != "required" {
				return nil, invalid("tool_choice", "tool_choice %q: want \"none\", \"auto\", \"required\" or {\"type\": \"function\", \"function\": {\"name\": ...}}", choice)
			}
		case json.Unmarshal(req.ToolChoice, &named) == nil && named.Type == "function" && named.Function.Name != "":
			if !seen[named.Function.Name] {
				return nil, invalid("tool_choice", "tool_choice names function %q, which is not among the tools", named.Function.Name)
			}
			// One call of it, as vLLM answers a named choice.
			choice, tp.named, tp.parallel = "named", named.Function.Name, false
		default:
			return nil, invalid("tool_choice", "tool_choice must be \"none\", \"auto\", \"required\" or {\"type\": \"function\", \"function\": {\"name\": ...}}")
		}
	}
	switch {
	case choice == "none":
		return nil, nil
	case len(tp.tools) == 0 && choice != "auto":
		return nil, invalid("tool_choice", "tool_choice %q needs tools", choice)
	case len(tp.tools) == 0:
		return nil, nil
	}
	tp.required = choice != "auto"
	if out != nil {
		oc, err := constraintOf(out)
		if err != nil {
			return nil, err
		}
		if tp.answer, err = answerSchema(oc); err != nil {
			return nil, err
		}
		tp.constrained = oc != nil
		tp.quoted = oc != nil && oc.schema != nil
	}
	return tp, nil
}

// emptyChoice is the path of the first keyword in a JSON schema that lists no
// choices (enum, anyOf, oneOf, allOf or type as []), "" when there is none:
// llama.cpp's converter turns those into grammars that let through values
// that are not JSON, or that do not parse.
func emptyChoice(v any, at string) string {
	switch v := v.(type) {
	case map[string]any:
		for _, k := range []string{"enum", "anyOf", "oneOf", "allOf", "type"} {
			if l, ok := v[k].([]any); ok && len(l) == 0 {
				return at + "." + k
			}
		}
		for _, k := range slices.Sorted(maps.Keys(v)) {
			if p := emptyChoice(v[k], at+"."+k); p != "" {
				return p
			}
		}
	case []any:
		for i, x := range v {
			if p := emptyChoice(x, fmt.Sprintf("%s[%d]", at, i)); p != "" {
				return p
			}
		}
	}
	return ""
}

// anySlice is v as a list, or nil when it is not one.
func anySlice(v any) []any {
	l, _ := v.([]any)
	return l
}

func isString(raw json.RawMessage, want string) bool {
	var s string
	return json.Unmarshal(raw, &s) == nil && s == want
}

// callable lists the tools the model may call: all, or the one tool_choice names.
func (tp *toolPlan) callable() []FunctionDef {
	if tp.named == "" {
		return tp.tools
	}
	for _, f := range tp.tools {
		if f.Name == tp.named {
			return []FunctionDef{f}
		}
	}
	return nil
}

// system is the text that tells the model its tools and how to answer.
func (tp *toolPlan) system() string {
	var b strings.Builder
	b.WriteString("You have access to the following tools, each given by its name, what it does and a JSON schema of its arguments:\n")
	for _, f := range tp.tools {
		d := jsonText(struct {
			Name        string          `json:"name"`
			Description string          `json:"description,omitempty"`
			Parameters  json.RawMessage `json:"parameters"`
		}{f.Name, f.Description, compactJSON(f.Parameters)})
		b.Write(d)
		b.WriteByte('\n')
	}
	b.WriteString("\nReply with exactly one JSON object and nothing else.\n")
	calls := `To call tools: {"tool_calls": [{"name": "<tool name>", "arguments": {<arguments>}}]}`
	if !tp.parallel {
		calls = `To call a tool: {"tool_calls": [{"name": "<tool name>", "arguments": {<arguments>}}]}`
	}
	b.WriteString(calls + "\n")
	switch {
	case tp.named != "":
		fmt.Fprintf(&b, "Call the tool %q now.\n", tp.named)
	case tp.required:
		b.WriteString("Call at least one tool now.\n")
	case tp.plainAnswer():
		b.WriteString(`To answer without calling a tool: {"response": "<your answer>"}` + "\n")
	default:
		fmt.Fprintf(&b, "To answer without calling a tool: {\"response\": <your answer>}, where your answer follows this JSON schema: %s\n", compactJSON(tp.answer))
	}
	b.WriteString(`Tool results come back as {"tool_response": {"name": ..., "content": ...}}.`)
	return b.String()
}

// schema is the JSON schema of the answers the model may give.
func (tp *toolPlan) schema() json.RawMessage {
	calls := tp.callSchemas("#/anyOf/0/properties/tool_calls/items/anyOf", "arguments")
	list := map[string]any{"type": "array", "items": map[string]any{"anyOf": calls}, "minItems": 1}
	if !tp.parallel {
		list["maxItems"] = 1
	}
	answers := []any{map[string]any{
		"type":                 "object",
		"properties":           map[string]any{"tool_calls": list},
		"required":             []string{"tool_calls"},
		"additionalProperties": false,
	}}
	if !tp.required {
		answers = append(answers, map[string]any{
			"type":                 "object",
			"properties":           map[string]any{"response": rebaseRefs(tp.answer, "#/anyOf/1/properties/response")},
			"required":             []string{"response"},
			"additionalProperties": false,
		})
	}
	b, _ := json.Marshal(map[string]any{"anyOf": answers})
	return b
}

// callSchemas are the JSON schemas of one call to each callable tool,
// {"name": ..., args: {...}}, to sit at base/0, base/1, ... in a larger schema.
func (tp *toolPlan) callSchemas(base, args string) []any {
	var calls []any
	for i, f := range tp.callable() {
		calls = append(calls, map[string]any{
			"type": "object",
			"properties": orderedProps{
				{"name", map[string]any{"const": f.Name}},
				{args, rebaseRefs(f.Parameters, fmt.Sprintf("%s/%d/properties/%s", base, i, args))},
			},
			"required":             []string{"name", args},
			"additionalProperties": false,
		})
	}
	return calls
}

// localRef matches a "$ref" key with a local reference ("#..."): a token, not
// text inside a string, where a quote is always escaped.
var localRef = regexp.MustCompile(`([{,]\s*"\$ref"\s*:\s*")#`)

// rebaseRefs makes a schema's local references ("#/$defs/X", "#") point into it
// where it sits in a larger schema, at the JSON pointer at (as nested Pydantic
// models send their $defs). The schema's text is kept, and its property order.
func rebaseRefs(schema json.RawMessage, at string) json.RawMessage {
	return localRef.ReplaceAll(schema, []byte("${1}"+at))
}

// maxSchemaDepth bounds how deeply a schema nests: llama.cpp's converter
// recurses on the C stack.
const maxSchemaDepth = 64

// schemaDepth is how deeply raw's objects and arrays nest.
func schemaDepth(raw []byte) int {
	depth, deepest := 0, 0
	inString, escaped := false, false
	for _, c := range raw {
		switch {
		case escaped:
			escaped = false
		case inString && c == '\\':
			escaped = true
		case c == '"':
			inString = !inString
		case inString:
		case c == '{' || c == '[':
			depth++
			deepest = max(deepest, depth)
		case c == '}' || c == ']':
			depth--
		}
	}
	return deepest
}

// textAnswer is the schema of an answer without calls unless the request
// constrains it: any text.
const textAnswer = `{"type":"string"}`

// plainAnswer reports whether an answer is any text.
func (tp *toolPlan) plainAnswer() bool {
	return !tp.constrained
}

// orderedProps marshals as a JSON object keeping its order: llama.cpp's converter
// emits properties in the order given, and the call's name should come before
// its arguments.
type orderedProps []struct {
	key string
	val any
}

func (o orderedProps) MarshalJSON() ([]byte, error) {
	var b bytes.Buffer
	b.WriteByte('{')
	for i, p := range o {
		if i > 0 {
			b.WriteByte(',')
		}
		k, _ := json.Marshal(p.key)
		v, err := json.Marshal(p.val)
		if err != nil {
			return nil, err
		}
		b.Write(k)
		b.WriteByte(':')
		b.Write(v)
	}
	b.WriteByte('}')
	return b.Bytes(), nil
}

func compactJSON(raw json.RawMessage) json.RawMessage {
	var b bytes.Buffer
	if json.Compact(&b, raw) != nil {
		return raw
	}
	return b.Bytes()
}

// protocolCall is one call as the model writes it.
type protocolCall struct {
	Name      string          `json:"name"`
	Arguments json.RawMessage `json:"arguments"`
}

// renderMessages maps a chat history to the messages the template renders: roles
// as the template knows them, earlier tool calls and tool results in the JSON
// form the model is told about, and, when tp offers tools, their description in
// the system message and earlier answers as {"response": ...}.
func renderMessages(in []Message, tp *toolPlan) ([]engine.ChatMessage, error) {
	msgs := make([]engine.ChatMessage, 0, len(in)+1)
	names := map[string]string{} // tool call id → function name
	for i, m := range in {
		param := fmt.Sprintf("messages[%d]", i)
		switch m.Role {
		case "system", "developer":
			msgs = append(msgs, engine.ChatMessage{Role: "system", Content: string(m.Content)})
		case "user":
			msgs = append(msgs, engine.ChatMessage{Role: "user", Content: string(m.Content)})
		case "assistant":
			calls, err := historyCalls(m, param)
			if err != nil {
				return nil, err
			}
			msgs = append(msgs, engine.ChatMessage{Role: "assistant", Content: assistantText(string(m.Content), calls, tp != nil)})
			for _, c := range calls {
				if c.ID != "" {
					names[c.ID] = c.Function.Name
				}
			}
		case "tool":
			name := cmp.Or(names[m.ToolCallID], m.Name)
			resp := struct {
				Name       string          `json:"name,omitempty"`
				ToolCallID string          `json:"tool_call_id,omitempty"`
				Content    json.RawMessage `json:"content"`
			}{name, m.ToolCallID, jsonOrString(string(m.Content))}
			b := jsonText(map[string]any{"tool_response": resp})
			msgs = append(msgs, engine.ChatMessage{Role: "user", Content: string(b)})
		default:
			return nil, invalid(param+".role", "unknown role %q: want system, developer, user, assistant or tool", m.Role)
		}
	}
	if tp != nil {
		if len(msgs) > 0 && msgs[0].Role == "system" {
			msgs[0].Content += "\n\n" + tp.system()
		} else {
			msgs = append([]engine.ChatMessage{{Role: "system", Content: tp.system()}}, msgs...)
		}
	}
	return msgs, nil
}

// assistantText renders an earlier assistant turn: its tool calls as the model
// writes them, else its text, as {"response": ...} when the model answers in JSON.
func assistantText(content string, calls []ToolCall, protocol bool) string {
	if len(calls) == 0 {
		if !protocol {
			return content
		}
		b := jsonText(map[string]string{"response": content})
		return string(b)
	}
	pc := make([]protocolCall, len(calls))
	for i, c := range calls {
		pc[i] = protocolCall{Name: c.Function.Name, Arguments: jsonOrString(c.Function.Arguments)}
	}
	// Any text beside the calls is left out: the model is shown only answers
	// of the form it is asked for.
	b := jsonText(map[string]any{"tool_calls": pc})
	return string(b)
}

// jsonOrString is s itself when it is JSON, else s as a JSON string.
func jsonOrString(s string) json.RawMessage {
	if t := strings.TrimSpace(s); t != "" && json.Valid([]byte(t)) {
		return compactJSON(json.RawMessage(t))
	}
	return jsonText(s)
}

// parseCalls reads an output as the tool protocol's answer. Cut short by
// max_tokens, its complete calls are returned, and a call cut in its arguments
// with the arguments generated so far (as OpenAI returns a cut call). ok is
// false when the output is not a protocol answer.
func parseCalls(text string, newID func() string) (calls []ToolCall, response *string, ok bool) {
	var a struct {
		ToolCalls []protocolCall  `json:"tool_calls"`
		Response  json.RawMessage `json:"response"`
	}
	whole := json.Unmarshal([]byte(text), &a) == nil && (len(a.ToolCalls) > 0 || a.Response != nil)
	if whole && a.Response != nil {
		// A string answer is its text; another JSON value (under an output
		// constraint) is its JSON.
		response = new(string)
		if a.Response[0] != '"' || json.Unmarshal(a.Response, response) != nil {
			*response = string(compactJSON(a.Response))
		}
	}
	if !whole {
		if a.ToolCalls, ok = cutCalls(text); !ok {
			return nil, nil, false
		}
	}
	for i, c := range a.ToolCalls {
		args := compactJSON(c.Arguments)
		if len(args) == 0 && (whole || i < len(a.ToolCalls)-1) {
			args = json.RawMessage("{}")
		}
		calls = append(calls, ToolCall{ID: newID(), Type: "function", Function: FunctionCall{Name: c.Name, Arguments: string(args)}})
	}
	return calls, response, true
}

// cutCall matches a call cut short in its arguments, named by key.
func cutCallIn(key string) *regexp.Regexp {
	if key == "parameters" {
		return cutCallParams
	}
	return cutCall
}

var (
	cutCall       = cutCallRE("arguments")
	cutCallParams = cutCallRE("parameters")
)

func cutCallRE(key string) *regexp.Regexp {
	return regexp.MustCompile(`(?s)^[ \t\n\r]*,?[ \t\n\r]*\{[ \t\n\r]*"name"[ \t\n\r]*:[ \t\n\r]*("(?:[^"\\]|\\.)*")[ \t\n\r]*,[ \t\n\r]*"` + key + `"[ \t\n\r]*:[ \t\n\r]*(.*)$`)
}

// cutCalls reads the calls of an output cut short; ok is false unless the
// output begins as a list of calls.
func cutCalls(text string) (calls []protocolCall, ok bool) {
	dec := json.NewDecoder(strings.NewReader(text))
	for _, want := range []any{json.Delim('{'), "tool_calls", json.Delim('[')} {
		switch t, err := dec.Token(); {
		case err == io.EOF || errors.Is(err, io.ErrUnexpectedEOF):
			return nil, true // cut before the first call
		case err != nil || t != want:
			return nil, false
		}
	}
	for dec.More() {
		off := dec.InputOffset()
		var c protocolCall
		if dec.Decode(&c) != nil {
			if m := cutCall.FindStringSubmatch(text[off:]); m != nil {
				var name string
				if json.Unmarshal([]byte(m[1]), &name) == nil {
					calls = append(calls, protocolCall{Name: name, Arguments: json.RawMessage(strings.TrimLeft(m[2], jsonSpace))})
				}
			}
			break
		}
		calls = append(calls, c)
	}
	return calls, true
}

// answerStream follows one choice's output under the tool protocol: an
// answer's text is passed on as it is generated, decoded from its JSON string
// and cut at the request's first stop string; tool calls are kept until the
// output is whole. (The scheduler matches stop strings in the output it
// generates, here JSON, so it is not given them.)
type answerStream struct {
	stop stopMatcher
	buf  strings.Builder // the output so far
	mode int             // streamUndecided, streamResponse, streamCalls
	str  jsonString      // streamResponse: the answer, a JSON string
	done bool            // the answer's text has ended
	ids  callIDs
	tail argsTail
}

// stopMatcher cuts an answer's text at the first of the request's stop
// strings, matched across pieces.
type stopMatcher struct {
	stops    []string
	include  bool   // a stop string is part of the answer (include_stop_str_in_output)
	min, gen int    // none is matched within the first min tokens (min_tokens); gen so far
	held     string // text that may begin a stop string
	stopped  bool   // a stop string ended the answer
	matched  string // which
}

// cut returns what of the next piece of text can be passed on: all of it up to
// a stop string, holding back an end that may begin one unless final.
func (m *stopMatcher) cut(text string, final bool) string {
	switch {
	case m.stopped:
		return ""
	case len(m.stops) == 0:
		return text
	}
	emit, held, stop := scheduler.MatchStopAfter(m.held+text, m.stops, m.include, m.gen, m.min)
	m.held = held
	if stop != "" {
		m.stopped, m.held, m.matched = true, "", stop
	}
	if final {
		emit, m.held = emit+m.held, ""
	}
	return emit
}

// follow calls add and, when a stop string ends the answer, asks the
// scheduler to end the choice: the scheduler is not given the stop strings of
// a request with tools.
func (m *stopMatcher) follow(add func(string) string, st *scheduler.Stream, ev scheduler.Event) string {
	stopped := m.stopped
	if ev.Kind == scheduler.EventToken {
		m.gen++
	}
	text := add(ev.Text)
	if m.stopped && !stopped {
		st.Stop(ev.Index)
	}
	return text
}

const (
	streamUndecided = iota
	streamResponse
	streamCalls
)

// answerStart matches the start of any answer: {"response":.
var answerStart = regexp.MustCompile(`^[ \t\n\r]*\{[ \t\n\r]*"response"[ \t\n\r]*:[ \t\n\r]*`)

// responseStart matches the start of an answer: {"response": ".
var responseStart = regexp.MustCompile(`^[ \t\n\r]*\{[ \t\n\r]*"response"[ \t\n\r]*:[ \t\n\r]*"`)

// mayStartResponse reports whether s could still grow into responseStart.
func mayStartResponse(s string) bool {
	const start = `{"response":"`
	i := 0
	for _, c := range []byte(s) {
		switch {
		case i == len(start):
			return true
		case c == start[i]:
			i++
		case c == ' ' || c == '\t' || c == '\n' || c == '\r':
			if i > 1 && i < len(`{"response"`) { // inside the key
				return false
			}
		default:
			return false
		}
	}
	return true
}

// end is called when the output is whole. It returns the text not yet passed
// on and the tool calls made. Output that is not a protocol answer is passed on
// as it is, so that nothing generated is lost.
func (a *answerStream) end(newID func() string) (text string, calls []ToolCall) {
	switch {
	case a.mode == streamResponse:
		text = a.stop.cut("", true) // the rest; cut short, it ends where it was cut
		return text, nil
	case a.mode == streamUndecided && mayStartResponse(a.buf.String()):
		return "", nil // cut short before the answer's text began
	}
	calls, response, ok := parseCalls(a.buf.String(), a.ids.reader(newID))
	stableArgs(calls) // a call cut short has its arguments as far as they stay
	switch {
	case !ok && answerStart.MatchString(a.buf.String()):
		// An answer other than a string (under an output constraint), cut short:
		// the value as far as it was generated.
		a.done = true
		return a.release(answerStart.ReplaceAllString(a.buf.String(), "")), nil
	case !ok:
		return a.buf.String(), nil
	case response == nil:
		return "", calls
	}
	a.done = true
	return a.release(*response), nil
}

func (a *answerStream) stopString() string { return a.stop.matched }

// progress returns the calls written so far, each with the part of its
// arguments that the whole answer's begin with (calldeltas.go).
func (a *answerStream) progress(newID func() string) []ToolCall {
	if a.mode != streamCalls {
		return nil
	}
	return a.tail.follow(a.buf.String(), func(text string) []ToolCall {
		calls, response, ok := parseCalls(text, a.ids.reader(newID))
		if !ok || response != nil {
			return nil
		}
		return calls
	})
}

// finishReason is a choice's finish_reason given the generator's (stop or
// length) and the calls end returned: tool_calls for a call list ended in full,
// stop when a stop string ended the answer.
func (a *answerStream) finishReason(generated string, calls []ToolCall) string {
	switch {
	case len(calls) > 0 && generated != "length":
		return "tool_calls"
	case a.stop.stopped:
		return "stop"
	}
	return generated
}

// follow is add for the text of ev, an event of st; a stop string in the
// answer ends the choice (the output's JSON would otherwise go on being
// generated until it closes).
func (a *answerStream) follow(st *scheduler.Stream, ev scheduler.Event) string {
	return a.stop.follow(a.add, st, ev)
}

// add takes the next piece of output and returns the answer text to pass on.
func (a *answerStream) add(piece string) string {
	a.buf.WriteString(piece)
	switch a.mode {
	case streamUndecided:
		s := a.buf.String()
		if loc := responseStart.FindStringIndex(s); loc != nil {
			a.mode = streamResponse
			return a.release(a.decode(s[loc[1]-1:]))
		}
		if !mayStartResponse(s) {
			a.mode = streamCalls // tool calls, or not a protocol answer: kept to the end
		}
		return ""
	case streamResponse:
		if a.done {
			return ""
		}
		return a.release(a.decode(piece))
	}
	return ""
}

// decode returns the answer's text that piece, the next of its JSON string,
// completes; the answer's text has ended with the string.
func (a *answerStream) decode(piece string) string {
	text := a.str.add(piece)
	a.done = a.str.done
	return text
}

// release returns the decoded text that can be passed on: all of it up to a
// stop string, holding back an end that may begin one until the answer ends.
func (a *answerStream) release(text string) string {
	emit := a.stop.cut(text, a.done)
	if a.stop.stopped {
		a.done = true
	}
	return emit
}

// jsonString decodes a JSON string's text as it comes, from its opening
// quote: whole characters as they complete, an escape cut short kept for the
// next piece; done once the closing quote has come. Quoted, it passes on the
// string's JSON as it is, quotes and escapes included.
type jsonString struct {
	rest   []byte // not yet decoded
	opened bool   // the opening quote has come
	done   bool
	quoted bool
}

// add takes the next piece of the string's JSON and returns the text it
// completes.
func (j *jsonString) add(piece string) string {
	j.rest = append(j.rest, piece...)
	var out strings.Builder
	s := j.rest
	for len(s) > 0 && !j.done {
		c := s[0]
		switch {
		case c == '"':
			j.done, j.opened = j.opened, true
			if j.quoted {
				out.WriteByte(c)
			}
			s = s[1:]
		case c != '\\':
			out.WriteByte(c)
			s = s[1:]
		default:
			r, n := unescape(s)
			switch {
			case n == 0:
				j.rest = s
				return out.String()
			case j.quoted:
				out.Write(s[:n])
			default:
				out.WriteRune(r)
			}
			s = s[n:]
		}
	}
	j.rest = s
	return out.String()
}

// unescape decodes the JSON escape that s begins with; n is 0 when s holds only
// part of it.
func unescape(s []byte) (r rune, n int) {
	if len(s) < 2 {
		return 0, 0
	}
	switch s[1] {
	case 'n':
		return '\n', 2
	case 't':
		return '\t', 2
	case 'r':
		return '\r', 2
	case 'b':
		return '\b', 2
	case 'f':
		return '\f', 2
	case 'u':
		u, ok, bad := hex4(s[2:])
		switch {
		case bad:
			return utf8.RuneError, 2
		case !ok:
			return 0, 0
		case !utf16.IsSurrogate(rune(u)):
			return rune(u), 6
		}
		// A surrogate pair is two escapes; a lone half decodes to U+FFFD.
		if len(s) < 8 {
			return 0, 0
		}
		if s[6] != '\\' || s[7] != 'u' {
			return utf8.RuneError, 6
		}
		lo, ok, bad := hex4(s[8:])
		switch {
		case bad:
			return utf8.RuneError, 6
		case !ok:
			return 0, 0
		}
		if r := utf16.DecodeRune(rune(u), rune(lo)); r != utf8.RuneError {
			return r, 12
		}
		return utf8.RuneError, 6
	default: // '"', '\\', '/'; the grammar allows no others
		return rune(s[1]), 2
	}
}

// hex4 decodes the four hex digits s begins with; ok is false when s holds
// fewer, bad when one is not a hex digit.
func hex4(s []byte) (v uint16, ok, bad bool) {
	for i := range 4 {
		if i >= len(s) {
			return 0, false, false
		}
		c := s[i]
		var d byte
		switch {
		case c >= '0' && c <= '9':
			d = c - '0'
		case c >= 'a' && c <= 'f':
			d = c - 'a' + 10
		case c >= 'A' && c <= 'F':
			d = c - 'A' + 10
		default:
			return 0, false, true
		}
		v = v<<4 | uint16(d)
	}
	return v, true, false
}
