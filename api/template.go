package api

import (
	"bytes"
	"cmp"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"maps"
	"strings"

	"github.com/ardanlabs/jinja"

	"github.com/shoal-ai/shoal/cluster"
	"github.com/shoal-ai/shoal/engine"
)

// Chats are rendered with the model's own Jinja chat template when it has one
// (as llama-server --jinja and vLLM do): the template lays out system prompts,
// earlier tool calls and tool results, and the tools themselves, exactly as the
// model was trained. llama.cpp's built-in formats, which match a template by
// its text and render only roles and contents, are the fallback: for a model
// without a template, for --chat-template, and for a template the Jinja engine
// cannot run.

// chatTemplate is a model's compiled Jinja chat template.
type chatTemplate struct {
	t        *jinja.Template
	bos, eos string // bos_token and eos_token as the template sees them
	// stripBOS: tokenizing the prompt adds BOS, so a leading bos_token written by
	// the template is dropped (else the prompt would begin with two).
	stripBOS bool
	// calls is how the template shows tools and how its model calls them, nil
	// when it shows none: tools are then described in the system message (the
	// tool protocol, tools.go).
	calls *callFormat
	// foldSystem: the template refuses system turns (Gemma's, Mistral's
	// first), so their text opens the next user turn instead, as llama.cpp's
	// built-in formats for those models do.
	foldSystem bool
}

// CheckTemplate reports whether src parses as a Jinja template and, given the
// model's vocabulary, lays out a short chat.
func CheckTemplate(src string, v engine.Vocab) error {
	if v == nil {
		_, err := jinja.Compile(src)
		return err
	}
	_, err := newChatTemplate(&Backend{Vocab: v, Template: src})
	return err
}

// newChatTemplate compiles b.Template and checks that it renders a short chat.
func newChatTemplate(b *Backend) (*chatTemplate, error) {
	t, err := jinja.Compile(b.Template)
	if err != nil {
		return nil, err
	}
	ct := &chatTemplate{t: t, stripBOS: b.Vocab.AddBOS(), calls: detectCallFormat(b.Template)}
	if p, err := b.Vocab.Piece(b.Vocab.BOS(), true); err == nil {
		ct.bos = string(p)
	}
	if p, err := b.Vocab.Piece(b.Vocab.EOS(), true); err == nil {
		ct.eos = string(p)
	}
	probe := []chatTurn{{role: "system", content: "s"}, {role: "user", content: "u"}, {role: "assistant", content: "a"}, {role: "user", content: "u"}}
	if _, err := ct.render(values(probe), jinja.Undefined(), nil, turnEnd{}); err != nil {
		if _, err2 := ct.render(values(probe[1:]), jinja.Undefined(), nil, turnEnd{}); err2 != nil {
			return nil, err
		}
		ct.foldSystem = true
	}
	return ct, nil
}

// render lays out a chat, its assistant turn opened unless end says
// otherwise; tools is the tools the template shows (undefined for none), extra
// the request's own variables.
func (ct *chatTemplate) render(msgs []jinja.Value, tools jinja.Value, extra map[string]jinja.Value, end turnEnd) (string, error) {
	data := map[string]jinja.Value{}
	maps.Copy(data, extra)
	data["messages"] = jinja.NewList(msgs)
	data["add_generation_prompt"] = jinja.NewBool(end.open())
	data["bos_token"] = jinja.NewString(ct.bos)
	data["eos_token"] = jinja.NewString(ct.eos)
	if !tools.IsUndefined() {
		data["tools"] = tools
	}
	text, err := ct.t.RenderValues(data)
	if err != nil {
		return "", err
	}
	if ct.stripBOS && ct.bos != "" {
		text = strings.TrimPrefix(text, ct.bos)
	}
	return text, nil
}

// compileTemplate prepares b's Jinja template, or logs why llama.cpp's formats
// render its chats instead, and warns when neither can.
func (s *Server) compileTemplate(b *Backend) {
	b.think = thinkTagsOf(b.Template, b.Info.Template)
	if b.Template != "" && b.Vocab != nil {
		ct, err := newChatTemplate(b)
		if err == nil {
			b.chat = ct
			format := "described in the system message"
			if ct.calls != nil {
				format = ct.calls.name
			}
			s.log.Info("chat template", "renderer", "jinja", "tool_calls", format, "system_turns", !ct.foldSystem)
			return
		}
		s.log.Warn("the chat template does not run as Jinja here: chats are laid out by llama.cpp's built-in format for it instead, and tools are described in the system message",
			"err", err)
	}
	if b.Vocab == nil || TaskOf(b.Info) != cluster.TaskGenerate {
		return
	}
	if _, err := b.Vocab.ApplyChatTemplate([]engine.ChatMessage{{Role: "user", Content: "hi"}}, true); err == nil {
		s.log.Info("chat template", "renderer", "llama.cpp", "format", b.Info.ChatTemplate, "tool_calls", "described in the system message")
	} else {
		s.log.Warn("chat requests will be refused: no chat format renders this model's chats (give --chat-template NAME for a llama.cpp built-in format, or --chat-template-file FILE for a Jinja template)",
			"err", err)
	}
}

// chatPrompt renders messages, with tp's tools when it offers any and the
// request's chat_template_kwargs; chat and /tokenize share it so that /tokenize
// counts the prompt chat builds. When the template shows tools itself, earlier
// calls are laid out by it, and an offer of tools whose answer is free text is
// switched to the model's own format for calls.
func chatPrompt(b *Backend, in []Message, tp *toolPlan, kwargs json.RawMessage) (string, error) {
	return chatPromptEnding(b, in, tp, kwargs, turnEnd{})
}

// turnEnd says how a chat's prompt ends: by default with the assistant's turn
// opened; vLLM's add_generation_prompt false leaves it out, and its
// continue_final_message (Anthropic's and llama-server's prefill: a chat that
// ends with an assistant message) leaves that message open, to be continued.
type turnEnd struct {
	noGeneration bool
	continueLast bool
}

func (e turnEnd) open() bool { return !e.noGeneration && !e.continueLast }

// turnEndOf reads vLLM's add_generation_prompt and continue_final_message.
func turnEndOf(add *bool, cont bool) (turnEnd, error) {
	if cont && add != nil && *add {
		return turnEnd{}, invalid("continue_final_message", "continue_final_message continues the last message: add_generation_prompt cannot also be true")
	}
	return turnEnd{noGeneration: add != nil && !*add, continueLast: cont}, nil
}

// chatPromptEnding is chatPrompt, its end as end says.
func chatPromptEnding(b *Backend, in []Message, tp *toolPlan, kwargs json.RawMessage, end turnEnd) (string, error) {
	for i, m := range in {
		if m.noContent {
			want := "content (a string or an array of content parts)"
			if m.Role == "assistant" {
				want += " or tool_calls"
			}
			return "", invalid(fmt.Sprintf("messages[%d].content", i), "messages[%d]: a %q message needs %s", i, m.Role, want)
		}
	}
	if !end.continueLast {
		return layOut(b, in, tp, kwargs, end)
	}
	if len(in) == 0 {
		return "", invalid("messages", "messages must not be empty")
	}
	last := in[len(in)-1]
	if last.Role != "assistant" || last.Content == "" || given(last.ToolCalls) {
		return "", invalid("messages", "continuing the final message needs it to be an assistant message with text content (and no tool calls)")
	}
	text, err := layOut(b, in, tp, kwargs, end)
	if err != nil {
		return "", err
	}
	// The text up to the final message's content: its end of turn is cut off,
	// as vLLM cuts it. Templates may trim the content.
	for _, c := range []string{string(last.Content), strings.TrimSpace(string(last.Content))} {
		if i := strings.LastIndex(text, c); i >= 0 && c != "" {
			return text[:i+len(c)], nil
		}
	}
	return "", invalid("messages", "the chat template does not show the final assistant message's content as given, so it cannot be continued")
}

// layOut renders in.
func layOut(b *Backend, in []Message, tp *toolPlan, kwargs json.RawMessage, end turnEnd) (string, error) {
	ct := b.chat
	var extra map[string]jinja.Value
	if given(kwargs) {
		var err error
		if extra, err = templateKwargs(kwargs); err != nil {
			return "", err
		}
	}
	if ct != nil && ct.calls != nil && (tp == nil || tp.plainAnswer() && (ct.calls.xml == nil || xmlFits(tp.tools))) {
		turns, err := nativeTurns(in, ct.calls.shortIDs)
		if err != nil {
			return "", err
		}
		tools := jinja.Undefined()
		if tp != nil {
			tp.format, tools = ct.calls, toolsValue(tp.tools)
		}
		return renderErr(ct.render(values(fold(turns, ct.foldSystem, false)), tools, extra, end))
	}
	msgs, err := renderMessages(in, tp)
	if err != nil {
		return "", err
	}
	if ct == nil {
		return renderErr(b.Vocab.ApplyChatTemplate(msgs, end.open()))
	}
	turns := make([]chatTurn, len(msgs))
	for i, m := range msgs {
		turns[i] = chatTurn{role: m.Role, content: m.Content}
	}
	// The tool protocol's results are user turns: one after another, they are
	// joined, as templates that want roles to alternate require.
	return renderErr(ct.render(values(fold(turns, ct.foldSystem, tp != nil)), jinja.Undefined(), extra, end))
}

// templateKwargs reads chat_template_kwargs: an object whose keys become
// template variables, other than those the chat itself sets.
func templateKwargs(raw json.RawMessage) (map[string]jinja.Value, error) {
	v, err := jsonValue(raw)
	if err != nil || !v.IsDict() {
		return nil, invalid("chat_template_kwargs", "chat_template_kwargs must be a JSON object of template variables")
	}
	extra := map[string]jinja.Value{}
	d := v.AsDict()
	for _, k := range d.OrderedKeys() {
		switch k {
		case "messages", "tools", "add_generation_prompt", "bos_token", "eos_token":
			return nil, invalid("chat_template_kwargs", "chat_template_kwargs must not set %q: the request sets it", k)
		}
		extra[k], _ = d.Get(k)
	}
	return extra, nil
}

func renderErr(text string, err error) (string, error) {
	if err != nil {
		return "", invalid("messages", "chat template: %v", err)
	}
	return text, nil
}

// chatTurn is one message as a template reads it.
type chatTurn struct {
	role, content string
	calls         []jinja.Value // an assistant turn's, as callValue makes them
	callID, name  string        // a tool turn's
}

// turn is a message with a role and a text.
func turn(role, content string) jinja.Value {
	m := jinja.NewDict()
	d := m.AsDict()
	d.Set("role", jinja.NewString(role))
	d.Set("content", jinja.NewString(content))
	return m
}

// values are turns as the template reads them: assistant turns with their
// tool_calls (arguments as objects, which templates write with tojson), tool
// turns with tool_call_id and name.
func values(turns []chatTurn) []jinja.Value {
	out := make([]jinja.Value, len(turns))
	for i, t := range turns {
		v := turn(t.role, t.content)
		d := v.AsDict()
		if len(t.calls) > 0 {
			d.Set("tool_calls", jinja.NewList(t.calls))
		}
		if t.callID != "" {
			d.Set("tool_call_id", jinja.NewString(t.callID))
		}
		if t.name != "" {
			d.Set("name", jinja.NewString(t.name))
		}
		out[i] = v
	}
	return out
}

// fold opens the next user turn with the system turns' text when the template
// refuses system turns, and joins consecutive user turns when asked.
func fold(turns []chatTurn, system, users bool) []chatTurn {
	if !system && !users {
		return turns
	}
	out := make([]chatTurn, 0, len(turns))
	// parts holds the texts of the turn being joined (out's last): joined at
	// once when it is whole, since one by one the copies grow with the square
	// of the turns.
	var parts []string
	flush := func() {
		if len(parts) > 1 {
			out[len(out)-1].content = strings.Join(parts, "\n\n")
		}
		parts = nil
	}
	var pending []string // system text for the next user turn
	for _, t := range turns {
		switch {
		case system && t.role == "system":
			pending = append(pending, t.content)
			continue
		case t.role == "user" && len(pending) > 0:
			t.content = strings.Join(append(pending, t.content), "\n\n")
			pending = nil
		}
		if n := len(out); users && t.role == "user" && n > 0 && out[n-1].role == "user" {
			parts = append(parts, t.content)
			continue
		}
		flush()
		out = append(out, t)
		parts = []string{t.content}
	}
	if len(pending) > 0 { // system text with no user turn after it
		text := strings.Join(pending, "\n\n")
		if n := len(out); n > 0 && out[n-1].role == "user" {
			parts = append(parts, text)
		} else {
			flush()
			out = append(out, chatTurn{role: "user", content: text})
		}
	}
	flush()
	return out
}

// nativeTurns maps a chat history to the template's messages as OpenAI sends
// them: assistant turns with their tool calls, tool results as "tool" turns.
// short maps call ids to ones of 9 letters and digits (shortID), giving one
// to a call sent without (and to the result that follows it without one),
// since the templates that want such ids refuse calls without.
func nativeTurns(in []Message, short bool) ([]chatTurn, error) {
	id := func(s string) string {
		if short && s != "" {
			return shortID(s)
		}
		return s
	}
	var unnamed []string // ids given to calls sent without, for their results in turn
	out := make([]chatTurn, 0, len(in))
	names := map[string]string{} // tool call id → function name
	for i, m := range in {
		param := fmt.Sprintf("messages[%d]", i)
		t := chatTurn{role: m.Role, content: string(m.Content)}
		switch m.Role {
		case "system", "user":
		case "developer":
			t.role = "system"
		case "assistant":
			calls, err := historyCalls(m, param)
			if err != nil {
				return nil, err
			}
			for j, c := range calls {
				// Templates write the arguments out key by key: they must be
				// an object (vLLM decodes them too).
				args := jinja.NewDict()
				if a := strings.TrimSpace(c.Function.Arguments); a != "" {
					v, err := jsonValue([]byte(a))
					if err != nil || !v.IsDict() {
						return nil, invalid(param+".tool_calls", "%s.tool_calls[%d].function.arguments must be a JSON object, got %.40q", param, j, a)
					}
					args = v
				}
				if c.ID != "" {
					names[c.ID] = c.Function.Name
				}
				c.ID = id(c.ID)
				if short && c.ID == "" {
					c.ID = shortID(fmt.Sprintf("%s.tool_calls[%d]", param, j))
					unnamed = append(unnamed, c.ID)
				}
				t.calls = append(t.calls, callValue(c, args))
			}
		case "tool":
			t.callID, t.name = id(m.ToolCallID), cmp.Or(names[m.ToolCallID], m.Name)
			if t.callID == "" && len(unnamed) > 0 {
				t.callID, unnamed = unnamed[0], unnamed[1:]
			}
		default:
			return nil, invalid(param+".role", "unknown role %q: want system, developer, user, assistant or tool", m.Role)
		}
		out = append(out, t)
	}
	return out, nil
}

// callValue is an earlier call as templates read it: {"id", "type",
// "function": {"name", "arguments"}}, with its arguments decoded.
func callValue(c ToolCall, args jinja.Value) jinja.Value {
	fn := jinja.NewDict()
	fn.AsDict().Set("name", jinja.NewString(c.Function.Name))
	fn.AsDict().Set("arguments", args)
	v := jinja.NewDict()
	if c.ID != "" {
		v.AsDict().Set("id", jinja.NewString(c.ID))
	}
	v.AsDict().Set("type", jinja.NewString("function"))
	v.AsDict().Set("function", fn)
	return v
}

// toolsValue is the request's tools as templates read them, in OpenAI's form
// with each schema's keys in the order the client sent them.
func toolsValue(tools []FunctionDef) jinja.Value {
	list := make([]jinja.Value, len(tools))
	for i, f := range tools {
		fn := jinja.NewDict()
		fn.AsDict().Set("name", jinja.NewString(f.Name))
		if f.Description != "" {
			fn.AsDict().Set("description", jinja.NewString(f.Description))
		}
		params, err := jsonValue(f.Parameters)
		if err != nil {
			params = jinja.NewDict()
		}
		fn.AsDict().Set("parameters", params)
		t := jinja.NewDict()
		t.AsDict().Set("type", jinja.NewString("function"))
		t.AsDict().Set("function", fn)
		list[i] = t
	}
	return jinja.NewList(list)
}

// jsonValue decodes JSON into a template value, keeping objects' key order
// (templates write schemas back out with tojson) and integers as integers.
func jsonValue(raw []byte) (jinja.Value, error) {
	dec := json.NewDecoder(bytes.NewReader(raw))
	dec.UseNumber()
	v, err := decodeValue(dec, 0)
	if err != nil {
		return jinja.Undefined(), err
	}
	if _, err := dec.Token(); err != io.EOF {
		return jinja.Undefined(), errors.New("json: text after the value")
	}
	return v, nil
}

func decodeValue(dec *json.Decoder, depth int) (jinja.Value, error) {
	if depth > maxSchemaDepth {
		return jinja.Undefined(), errors.New("json: nested too deeply")
	}
	tok, err := dec.Token()
	if err != nil {
		return jinja.Undefined(), err
	}
	switch t := tok.(type) {
	case json.Delim:
		if t == '[' {
			var items []jinja.Value
			for dec.More() {
				v, err := decodeValue(dec, depth+1)
				if err != nil {
					return jinja.Undefined(), err
				}
				items = append(items, v)
			}
			_, err := dec.Token()
			return jinja.NewList(items), err
		}
		d := jinja.NewDict()
		for dec.More() {
			k, err := dec.Token()
			if err != nil {
				return jinja.Undefined(), err
			}
			v, err := decodeValue(dec, depth+1)
			if err != nil {
				return jinja.Undefined(), err
			}
			d.AsDict().Set(k.(string), v)
		}
		_, err := dec.Token()
		return d, err
	default:
		return jinja.FromGoValue(t), nil // nil, bool, string, json.Number
	}
}

// jsonText is v as JSON, leaving <, > and & as they are (json.Marshal writes
// them as \u003c and the like, which a model reads as something else).
func jsonText(v any) []byte {
	var b bytes.Buffer
	enc := json.NewEncoder(&b)
	enc.SetEscapeHTML(false)
	if err := enc.Encode(v); err != nil {
		return []byte("null")
	}
	return bytes.TrimSuffix(b.Bytes(), []byte("\n"))
}

// historyCalls decodes an earlier assistant turn's tool calls.
func historyCalls(m Message, param string) ([]ToolCall, error) {
	if given(m.FunctionCall) {
		return nil, invalid(param+".function_call", "%s: function_call is deprecated and not supported: send tool_calls", param)
	}
	var calls []ToolCall
	if given(m.ToolCalls) {
		if err := json.Unmarshal(m.ToolCalls, &calls); err != nil {
			return nil, invalid(param+".tool_calls", "%s.tool_calls: %v", param, err)
		}
	}
	for j, c := range calls {
		if c.Function.Name == "" {
			return nil, invalid(param+".tool_calls", "%s.tool_calls[%d] has no function name", param, j)
		}
	}
	return calls, nil
}
