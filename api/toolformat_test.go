package api

import (
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"strings"
	"testing"

	"github.com/shoal-ai/shoal/engine"
	"github.com/shoal-ai/shoal/engine/enginetest"
	"github.com/shoal-ai/shoal/models"
	"github.com/shoal-ai/shoal/scheduler"
)

func TestDetectCallFormat(t *testing.T) {
	for tmpl, want := range map[string]*callFormat{
		models.ChatTemplate:  nil,
		models.ToolsTemplate: &hermesFormat,
		// Qwen 3.5's XML calls also sit in <tool_call> tags, but are not JSON.
		`<tool_call>\n<function=name>\n<parameter=p>"arguments"`: &qwenXMLFormat,
		models.QwenXMLToolsTemplate:                              &qwenXMLFormat,
		`<tool_call>{name}<arg_key>k</arg_key> "arguments"`:      nil,
		models.Llama3ToolsTemplate:                               &llama3Format,
	} {
		if got := detectCallFormat(tmpl); got != want {
			t.Errorf("%.40q: format %v, want %v", tmpl, got, want)
		}
	}
}

// TestCallStream: text before a call is passed on as it comes, a tag split
// across pieces is held back, and calls come whole at the end, also cut short.
func TestCallStream(t *testing.T) {
	ids := 0
	newID := func() string { ids++; return fmt.Sprintf("call-%d", ids) }
	cases := []struct {
		name   string
		pieces []string
		sent   string // passed on while streaming
		rest   string // returned by end
		calls  []string
		finish string
	}{
		{"text", []string{"It is ", "sunny <", "b>"}, "It is sunny <b>", "", nil, "stop"},
		{"text ending in a partial tag", []string{"a <tool"}, "a ", "", nil, "stop"}, // a call cut in its tag
		{"text ending in <", []string{"a <"}, "a ", "<", nil, "stop"},
		{"call after text", []string{"Let me look.\n<to", "ol_call>\n{\"name\": \"get_weather\", ", "\"arguments\": {\"city\": \"Oslo\"}}\n</tool_call>"},
			"Let me look.\n", "", []string{`get_weather{"city":"Oslo"}`}, "tool_calls"},
		{"two calls", []string{"<tool_call>\n{\"name\": \"a\", \"arguments\": {}}\n</tool_call>\n<tool_call>{\"name\": \"b\", \"arguments\": {\"x\": [1, 2]}}</tool_call>"},
			"", "", []string{`a{}`, `b{"x":[1,2]}`}, "tool_calls"},
		{"cut in the arguments", []string{"<tool_call>\n{\"name\": \"a\", \"arguments\": {\"city\": \"Os"}, "", "", []string{`a{"city":"Os`}, "length"},
		{"cut before the closing tag", []string{"<tool_call>\n{\"name\": \"a\", \"arguments\": {}}\n</tool"}, "", "", []string{`a{}`}, "length"},
		{"not a call after all", []string{"<tool_call> oops"}, "", "<tool_call> oops", nil, "stop"},
		{"cut after the name", []string{"<tool_call>{ \"name\": \"add\", \"argum"}, "", "", []string{`add`}, "length"},
		{"cut in the name", []string{"<tool_call>\n{\"name\": \"ad"}, "", "", nil, "length"},
		{"cut after the tag", []string{"Sure. <tool_call>"}, "Sure. ", "", nil, "length"},
		{"cut before the second call's name", []string{"<tool_call>{\"name\": \"a\", \"arguments\": {}}</tool_call>\n<tool_call>\n{\"na"}, "", "", []string{`a{}`}, "length"},
		{"cut in the second call's tag", []string{"<tool_call>{\"name\": \"a\", \"arguments\": {}}</tool_call>\n<tool_"}, "", "", []string{`a{}`}, "length"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			cs := &callStream{f: &hermesFormat}
			var sent strings.Builder
			for _, p := range c.pieces {
				sent.WriteString(cs.add(p))
			}
			rest, calls := cs.end(newID)
			if sent.String() != c.sent || rest != c.rest {
				t.Fatalf("passed on %q then %q, want %q then %q", sent.String(), rest, c.sent, c.rest)
			}
			var got []string
			for _, call := range calls {
				if call.ID == "" || call.Type != "function" {
					t.Fatalf("call %+v", call)
				}
				got = append(got, call.Function.Name+call.Function.Arguments)
			}
			if fmt.Sprint(got) != fmt.Sprint(c.calls) {
				t.Fatalf("calls %q, want %q", got, c.calls)
			}
			generated := "stop"
			if c.finish == "length" {
				generated = "length"
			}
			if f := cs.finishReason(generated, calls); f != c.finish {
				t.Fatalf("finish %q, want %q", f, c.finish)
			}
		})
	}
}

// TestBareCallStream: a bare format's answer is one call when it begins with
// "{", else text passed on as it comes.
func TestBareCallStream(t *testing.T) {
	newID := func() string { return "call-1" }
	for _, c := range []struct {
		pieces     []string
		sent, rest string
		call       string
		generated  string
		wantFinish string
	}{
		{[]string{" ", "It is ", "sunny."}, " It is sunny.", "", "", "stop", "stop"},
		{[]string{"\n", `{"name": "get_weather", `, `"parameters": {"city": "Oslo"}}`}, "", "", `get_weather{"city":"Oslo"}`, "stop", "tool_calls"},
		{[]string{`{"type": "function", "name": "f", "parameters": {}}`}, "", "", `f{}`, "stop", "tool_calls"},
		{[]string{`{"name": "f", "parameters": {"x": "ab`}, "", "", `f{"x":"ab`, "length", "length"},
		{[]string{`{"answer": 42}`}, "", `{"answer": 42}`, "", "stop", "stop"},
		{[]string{`{"nam`}, "", "", "", "length", "length"},
		{[]string{`{"answer": 4`}, "", `{"answer": 4`, "", "length", "length"},
	} {
		cs := &callStream{f: &llama3Format}
		var sent strings.Builder
		for _, p := range c.pieces {
			sent.WriteString(cs.add(p))
		}
		rest, calls := cs.end(newID)
		var call string
		if len(calls) == 1 {
			call = calls[0].Function.Name + calls[0].Function.Arguments
		}
		if sent.String() != c.sent || rest != c.rest || call != c.call || len(calls) > 1 || cs.finishReason(c.generated, calls) != c.wantFinish {
			t.Errorf("%q: passed on %q then %q, calls %v, finish %q", c.pieces, sent.String(), rest, calls, cs.finishReason(c.generated, calls))
		}
	}
	// Under tool_choice auto the grammar holds a call only once its trigger
	// begins the answer (after any spaces): another spelling of a call is
	// read as one only if it calls an offered tool, else as text.
	for pieces, call := range map[string]string{
		`{"name": "get_weather", "parameters": {"city": "Oslo"}}`:        `get_weather{"city":"Oslo"}`,
		"\n" + `{"name": "get_weather", "parameters": {"city": "Oslo"}}`: `get_weather{"city":"Oslo"}`,
		`{"type": "function", "name": "get_weather", "parameters": {}}`:  `get_weather{}`,
		`{"type": "function", "name": "rm_rf", "parameters": {}}`:        "",
		`{ "name": "nope", "parameters": {}}`:                            "",
	} {
		cs := &callStream{f: &llama3Format, lazy: true, offered: map[string]bool{"get_weather": true}}
		sent := cs.add(pieces[:3]) + cs.add(pieces[3:])
		rest, calls := cs.end(newID)
		var got string
		if len(calls) == 1 {
			got = calls[0].Function.Name + calls[0].Function.Arguments
		}
		if got != call || call == "" && sent+rest != pieces {
			t.Errorf("lazy %q: passed on %q then %q, calls %v", pieces, sent, rest, calls)
		}
	}
}

// TestCallStreamStops: stop strings end the text before calls, and are not
// matched inside a call.
func TestCallStreamStops(t *testing.T) {
	call := "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Oslo\"}}\n</tool_call>"
	for _, c := range []struct {
		pieces     []string
		sent, rest string
		calls      int
		finish     string
	}{
		{[]string{"Weather in Os", "lo? " + call}, "Weather in ", "", 0, "stop"},
		{[]string{"Let me see.\n", call}, "Let me see.\n", "", 1, "tool_calls"},
		{[]string{"Nothing in O"}, "Nothing in ", "O", 0, "stop"},
		{[]string{"Nothing in O<tool_c"}, "Nothing in ", "O", 0, "stop"},  // a call cut in its tag: the text held stays
		{[]string{"In Oslo", "? " + call}, "In Oslo", "", 0, "stop"},      // include_stop_str_in_output
		{[]string{"Oslo ", "Oslo ", "Oslo"}, "Oslo Oslo ", "", 0, "stop"}, // min_tokens 2
		// Text held as the possible start of a stop string goes out before
		// the calls begin (they are streamed as written).
		{[]string{"Off to Os", call}, "Off to Os", "", 1, "tool_calls"},
	} {
		cs := &callStream{f: &hermesFormat, stop: stopMatcher{stops: []string{"Oslo"}}}
		switch c.pieces[0] {
		case "In Oslo":
			cs.stop.include = true
		case "Oslo ":
			cs.stop.min = 2
		}
		ev := scheduler.Event{Kind: scheduler.EventToken}
		var sent strings.Builder
		for _, p := range c.pieces {
			ev.Text = p
			sent.WriteString(cs.follow(&scheduler.Stream{}, ev))
		}
		rest, calls := cs.end(func() string { return "id" })
		if sent.String() != c.sent || rest != c.rest || len(calls) != c.calls || cs.finishReason("stop", calls) != c.finish {
			t.Errorf("%q: passed on %q then %q, %d calls, finish %q", c.pieces, sent.String(), rest, len(calls), cs.finishReason("stop", calls))
		}
	}
}

func TestJSONField(t *testing.T) {
	for in, want := range map[string]string{"ToolFields.parallel_tool_calls": "parallel_tool_calls", "messages.content": "messages.content", "SamplingFields.StructuredFields.guided_json": "guided_json"} {
		if got := jsonField(in); got != want {
			t.Errorf("jsonField(%q) = %q, want %q", in, got, want)
		}
	}
}

func TestRenameRule(t *testing.T) {
	in := "root ::= \"{\" space root-x (\"root\" | [root]) root # root here\nroot-x ::= root\n"
	want := "shoal-call ::= \"{\" space root-x (\"root\" | [root]) shoal-call # root here\nroot-x ::= shoal-call\n"
	rename := func(name string) string {
		if name == "root" {
			return "shoal-call"
		}
		return name
	}
	if got := renameRules(in, rename); got != want {
		t.Fatalf("got  %q\nwant %q", got, want)
	}
}

func TestJSONValueKeepsOrder(t *testing.T) {
	v, err := jsonValue([]byte(`{"z": 1, "a": [true, null, 2.5, "s"], "m": {"y": 9007199254740993, "b": {}}}`))
	if err != nil {
		t.Fatal(err)
	}
	if got := v.AsDict().OrderedKeys(); fmt.Sprint(got) != "[z a m]" {
		t.Fatalf("keys %v", got)
	}
	for _, bad := range []string{`{"a":`, `{} {}`, strings.Repeat("[", 100) + strings.Repeat("]", 100)} {
		if _, err := jsonValue([]byte(bad)); err == nil {
			t.Errorf("%q accepted", bad)
		}
	}
}

// TestNativeToolPrompt: with a template that shows tools, chat renders them in
// the client's order, earlier calls with their arguments as objects and tool
// results as the template lays them out, and the grammar holds the calls.
func TestNativeToolPrompt(t *testing.T) {
	f := enginetest.New(256, 4, 64)
	b := &Backend{Vocab: f.Vocab(), Info: f.Info(), Template: models.ToolsTemplate}
	s := &Server{log: slog.New(slog.NewTextHandler(io.Discard, nil))}
	s.compileTemplate(b)
	if b.chat == nil || b.chat.calls != &hermesFormat {
		t.Fatalf("template not compiled as hermes: %+v", b.chat)
	}
	var req ChatRequest
	body := `{"messages": [
		{"role": "developer", "content": "Be brief."},
		{"role": "user", "content": "Weather in Oslo?"},
		{"role": "assistant", "content": null, "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": "{\"zcity\": \"Oslo\", \"a\": 1}"}}]},
		{"role": "tool", "tool_call_id": "c1", "content": "3 C"}],
		"tools": [{"type": "function", "function": {"name": "get_weather", "description": "Weather now", "parameters": {"type": "object", "properties": {"zcity": {"type": "string"}, "a": {"type": "integer"}}}}}],
		"tool_choice": "required"}`
	if err := json.Unmarshal([]byte(body), &req); err != nil {
		t.Fatal(err)
	}
	tp, err := toolsOf(&req.ToolFields, &req.SamplingFields)
	if err != nil {
		t.Fatal(err)
	}
	text, err := chatPrompt(b, req.Messages, tp, nil)
	if err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{
		"<|im_start|>system\nBe brief.\n\n",
		`{"type": "function", "function": {"name": "get_weather", "description": "Weather now", "parameters": {"type": "object", "properties": {"zcity": {"type": "string"}, "a": {"type": "integer"}}}}}`,
		"<|im_start|>assistant\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"zcity\": \"Oslo\", \"a\": 1}}\n</tool_call><|im_end|>\n",
		"<|im_start|>user\n<tool_response>\n3 C\n</tool_response><|im_end|>\n<|im_start|>assistant\n",
	} {
		if !strings.Contains(text, want) {
			t.Errorf("prompt lacks %q:\n%s", want, text)
		}
	}
	if tp.format != &hermesFormat {
		t.Fatal("the plan does not use the template's call format")
	}
	s.cfg.SchemaToGrammar = func([]byte) (string, error) { return "root ::= \"{}\"\n", nil }
	g, triggers, err := s.callGrammar(tp)
	if err != nil || triggers != nil || !strings.Contains(g, `shoal-json-root ::= "{}"`) || !strings.Contains(g, `shoal-block ::= "<tool_call>"`) {
		t.Fatalf("required: grammar %q, triggers %v, %v", g, triggers, err)
	}
	tp.required = false
	if _, triggers, _ = s.callGrammar(tp); fmt.Sprint(triggers) != "[{<tool_call> false false}]" {
		t.Fatalf("auto: triggers %v", triggers)
	}

	// Llama 3: one bare call, lazily only at the answer's start.
	b = &Backend{Vocab: f.Vocab(), Info: f.Info(), Template: models.Llama3ToolsTemplate}
	s.compileTemplate(b)
	tp, _ = toolsOf(&req.ToolFields, &req.SamplingFields)
	if text, err = chatPrompt(b, req.Messages, tp, nil); err != nil || tp.format != &llama3Format {
		t.Fatalf("llama3: format %v, %v", tp.format, err)
	}
	for _, want := range []string{
		`{"type": "function", "function": {"name": "get_weather"`,
		"<|start_header_id|>assistant<|end_header_id|>\n\n{\"name\": \"get_weather\", \"parameters\": {\"zcity\": \"Oslo\", \"a\": 1}}<|eot_id|>",
		"<|start_header_id|>ipython<|end_header_id|>\n\n3 C<|eot_id|>",
	} {
		if !strings.Contains(text, want) {
			t.Errorf("llama3 prompt lacks %q:\n%s", want, text)
		}
	}
	tp.required = false
	g, triggers, err = s.callGrammar(tp)
	if err != nil || fmt.Sprint(triggers) != `[{{"name" true false}]` || !strings.Contains(g, "root ::= shoal-call\n") {
		t.Fatalf("llama3 auto: grammar %q, triggers %v, %v", g, triggers, err)
	}
	tp.format = nil
	tp.required = true

	// Under an output constraint the tool protocol is used: an answer in the
	// model's own format would be free text.
	req.ResponseFormat = &ResponseFormat{Type: "json_object"}
	tp, err = toolsOf(&req.ToolFields, &req.SamplingFields)
	if err != nil {
		t.Fatal(err)
	}
	if text, err = chatPrompt(b, req.Messages, tp, nil); err != nil || tp.format != nil || !strings.Contains(text, `{"tool_calls"`) {
		t.Fatalf("with response_format: format %v, %v, prompt:\n%s", tp.format, err, text)
	}

	// A template that fails on a history is a 400 naming it.
	b.Template = `{{ raise_exception("roles must alternate") }}`
	b.chat = nil
	s.compileTemplate(b)
	if b.chat != nil {
		t.Fatal("a template that fails on every chat was kept")
	}
	ct, err := newChatTemplate(&Backend{Vocab: f.Vocab(), Template: `{% if messages|length > 4 %}{{ raise_exception("too long") }}{% endif %}ok`})
	if err != nil {
		t.Fatal(err)
	}
	b.chat = ct
	long := make([]Message, 5)
	for i := range long {
		long[i] = Message{Role: []string{"user", "assistant"}[i%2], Content: "x"}
	}
	if _, err := chatPrompt(b, long, nil, nil); err == nil || !strings.Contains(err.Error(), "too long") {
		t.Fatalf("template error: %v", err)
	}
}

// bosVocab reads BOS as "<s>", EOS as "</s>".
type bosVocab struct{ engine.Vocab }

func (v bosVocab) Piece(t engine.Token, special bool) ([]byte, error) {
	switch t {
	case v.BOS():
		return []byte("<s>"), nil
	case v.EOS():
		return []byte("</s>"), nil
	}
	return v.Vocab.Piece(t, special)
}

// TestTemplateBOS: a template's leading bos_token is dropped, since tokenizing
// the prompt adds BOS (the vocabulary's AddBOS); eos_token is given as is.
func TestTemplateBOS(t *testing.T) {
	v := bosVocab{enginetest.New(256, 4, 64).Vocab()}
	ct, err := newChatTemplate(&Backend{Vocab: v, Template: `{{ bos_token }}{{ messages[-1].content }}{{ eos_token }}`})
	if err != nil {
		t.Fatal(err)
	}
	if got, err := chatPrompt(&Backend{Vocab: v, chat: ct}, []Message{{Role: "user", Content: "hi"}}, nil, nil); err != nil || got != "hi</s>" {
		t.Fatalf("rendered %q, %v; want %q", got, err, "hi</s>")
	}
}

// TestChatTemplateKwargs: chat_template_kwargs become template variables (as
// vLLM's enable_thinking for Qwen 3); the variables a chat sets are refused.
func TestChatTemplateKwargs(t *testing.T) {
	f := enginetest.New(256, 4, 64)
	ct, err := newChatTemplate(&Backend{Vocab: f.Vocab(), Template: `{% if enable_thinking is defined and not enable_thinking %}<think></think>{% endif %}{{ messages[-1].content }}`})
	if err != nil {
		t.Fatal(err)
	}
	b := &Backend{Vocab: f.Vocab(), chat: ct}
	msgs := []Message{{Role: "user", Content: "hi"}}
	for kwargs, want := range map[string]string{``: "hi", `{"enable_thinking": false}`: "<think></think>hi", `{"enable_thinking": true}`: "hi"} {
		if got, err := chatPrompt(b, msgs, nil, json.RawMessage(kwargs)); err != nil || got != want {
			t.Errorf("%s: %q, %v; want %q", kwargs, got, err, want)
		}
	}
	for _, bad := range []string{`[1]`, `{"messages": []}`, `{"add_generation_prompt": false}`} {
		if _, err := chatPrompt(b, msgs, nil, json.RawMessage(bad)); err == nil || !strings.Contains(err.Error(), "chat_template_kwargs") {
			t.Errorf("%s: %v", bad, err)
		}
	}
}

// TestTurnEnd: vLLM's add_generation_prompt false leaves the assistant's turn
// out; continue_final_message (Anthropic's prefill) leaves the final assistant
// message open, its end of turn cut off; with Jinja and llama.cpp's formats.
func TestTurnEnd(t *testing.T) {
	f := enginetest.New(256, 4, 64)
	ct, err := newChatTemplate(&Backend{Vocab: f.Vocab(), Template: models.ChatTemplate})
	if err != nil {
		t.Fatal(err)
	}
	msgs := []Message{{Role: "user", Content: "hi"}, {Role: "assistant", Content: "Once upon"}}
	for _, b := range []*Backend{{Vocab: f.Vocab(), chat: ct}, {Vocab: f.Vocab()}} {
		jinja := b.chat != nil
		want := map[turnEnd]string{ // the fake engine's own format
			{}:                   "user: hi\nassistant: Once upon\nassistant:",
			{noGeneration: true}: "user: hi\nassistant: Once upon\n",
			{continueLast: true}: "user: hi\nassistant: Once upon",
		}
		if jinja {
			want = map[turnEnd]string{
				{}:                   "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\nOnce upon<|im_end|>\n<|im_start|>assistant\n",
				{noGeneration: true}: "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\nOnce upon<|im_end|>\n",
				{continueLast: true}: "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\nOnce upon",
			}
		}
		for end, want := range want {
			if got, err := chatPromptEnding(b, msgs, nil, nil, end); err != nil || got != want {
				t.Errorf("jinja %v, %+v: %q, %v; want %q", jinja, end, got, err, want)
			}
		}
		if _, err := chatPromptEnding(b, msgs[:1], nil, nil, turnEnd{continueLast: true}); err == nil {
			t.Errorf("jinja %v: a user message continued", jinja)
		}
	}
	yes := true
	if _, err := turnEndOf(&yes, true); err == nil {
		t.Error("add_generation_prompt and continue_final_message both true")
	}
}

// FuzzCallStream: whatever the model writes, following it in a call format
// never panics, does not depend on how the output is cut into pieces, and loses
// nothing: without calls, the text passed on and the rest are the output.
func FuzzCallStream(f *testing.F) {
	f.Add("Sure.\n<tool_call>\n{\"name\": \"f\", \"arguments\": {\"a\": 1}}\n</tool_call>", 3, uint8(0))
	f.Add("<tool_call>{\"name\": \"f\", \"arguments\": {\"a\": \"x", 1, uint8(0))
	f.Add("  {\"name\": \"f\", \"parameters\": {}}", 2, uint8(1))
	f.Add("<tool_<tool_call>call>", 4, uint8(0))
	f.Add("Ok <tool_call>\n<function=f>\n<parameter=a>\nx\n</parameter>\n</function>\n</tool_call>", 5, uint8(2))
	f.Add("Ok [TOOL_CALLS]f[ARGS]{\"a\": 1}[TOOL_CALLS]g[CALL_ID]abcdefghi[ARGS]{}", 3, uint8(3))
	f.Add("[TOOL_CALLS] [{\"name\": \"f\", \"arguments\": {}, \"id\": \"abcdefghi\"}, {\"name\": \"g\"", 2, uint8(4))
	params := map[string][]toolParam{"f": {{name: "a", text: true}, {name: "b"}}}
	f.Add("<tool_call>f<arg_key>a</arg_key><arg_value>x</arg_value>\n<arg_key>b</arg", 4, uint8(5))
	f.Add("<tool_call>\n<function=f>\n<parameter=a>\né \u2028😀", 1, uint8(2)) // characters split between pieces
	formats := []*callFormat{&hermesFormat, &llama3Format, &qwenXMLFormat, &mistralIDFormat, &mistralListFormat, &glmFormat}
	f.Fuzz(func(t *testing.T, out string, k int, which uint8) {
		format := formats[int(which)%len(formats)]
		run := func(k int) ([2]string, []ToolCall) {
			cs := &callStream{f: format, params: params}
			var sent strings.Builder
			for i := 0; i < len(out); i += k {
				sent.WriteString(cs.add(out[i:min(i+k, len(out))]))
			}
			rest, calls := cs.end(func() string { return "id" })
			return [2]string{sent.String(), rest}, calls
		}
		if k < 1 || k > len(out) {
			k = 1
		}
		text, calls := run(k)
		wholeText, wholeCalls := run(max(len(out), 1))
		joinStreamed(t, &callStream{f: format, params: params}, out, k) // streamed calls join up to the whole
		if text != wholeText || fmt.Sprint(calls) != fmt.Sprint(wholeCalls) {
			t.Fatalf("pieces of %d: %q %v; whole: %q %v", k, text, calls, wholeText, wholeCalls)
		}
		// Without calls, all is passed on but a call cut before its name (or in
		// its opening tag).
		if got := text[0] + text[1]; len(calls) == 0 && got != out {
			cut := strings.TrimLeft(out[min(len(got), len(out)):], jsonSpace)
			tag := format.open != "" && (strings.HasPrefix(cut, format.open) || len(cut) > 1 && strings.HasPrefix(format.open, cut))
			if !strings.HasPrefix(out, got) || !(tag || format.bare() && strings.HasPrefix(cut, "{")) {
				t.Fatalf("no calls, but %q passed on for %q", text, out)
			}
		}
	})
}

// FuzzJSONValue: request JSON (tool schemas, arguments, chat_template_kwargs)
// becomes a template value or an error, never a panic; valid JSON within the
// depth bound always converts.
func FuzzJSONValue(f *testing.F) {
	for _, s := range []string{`{"a": [1, 2.5, "x", null, true]}`, `[[[]]]`, `"s"`, `{"a":`, `1e999`} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, s string) {
		_, err := jsonValue([]byte(s))
		if err != nil && json.Valid([]byte(s)) && schemaDepth([]byte(s)) <= maxSchemaDepth {
			t.Fatalf("valid JSON %q refused: %v", s, err)
		}
	})
}

// TestTemplateTurns: a template that refuses system turns gets their text at
// the start of the next user turn; tool results under the tool protocol are
// joined into one user turn for templates that want roles to alternate; and a
// template that shows tools lays out earlier calls itself even when the
// request offers none.
func TestTemplateTurns(t *testing.T) {
	f := enginetest.New(256, 4, 64)
	const strict = `{%- for m in messages %}{%- if m.role == 'system' %}{{ raise_exception("System role not supported") }}{% endif %}` +
		`{%- if (m.role == 'user') != (loop.index0 % 2 == 0) %}{{ raise_exception("Conversation roles must alternate") }}{% endif %}` +
		`[{{ m.role }}: {{ m.content }}]{% endfor %}`
	b := &Backend{Vocab: f.Vocab(), Template: strict}
	s := &Server{log: slog.New(slog.NewTextHandler(io.Discard, nil))}
	s.compileTemplate(b)
	if b.chat == nil || !b.chat.foldSystem {
		t.Fatalf("a template refusing system turns: %+v", b.chat)
	}
	var req ChatRequest
	if err := json.Unmarshal([]byte(`{"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather?"},
		{"role": "assistant", "tool_calls": [{"id": "a", "type": "function", "function": {"name": "f", "arguments": "{}"}}, {"id": "b", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
		{"role": "tool", "tool_call_id": "a", "content": "1"}, {"role": "tool", "tool_call_id": "b", "content": "2"}],
		"tools": [{"type": "function", "function": {"name": "f"}}]}`), &req); err != nil {
		t.Fatal(err)
	}
	tp, err := toolsOf(&req.ToolFields, nil)
	if err != nil {
		t.Fatal(err)
	}
	text, err := chatPrompt(b, req.Messages, tp, nil)
	if err != nil {
		t.Fatal(err)
	}
	if !strings.HasPrefix(text, "[user: Be brief.\n\n") || strings.Count(text, "[user:") != 2 || !strings.Contains(text, `"tool_call_id":"a"`) || !strings.Contains(text, `"tool_call_id":"b"`) {
		t.Fatalf("prompt:\n%s", text)
	}

	if text, err = chatPrompt(b, []Message{{Role: "user", Content: "hi"}, {Role: "system", Content: "s"}}, nil, nil); err != nil || text != "[user: hi\n\ns]" {
		t.Fatalf("system text after the last user turn: %q, %v", text, err)
	}

	// Without tools, consecutive user turns stay apart.
	b = &Backend{Vocab: f.Vocab(), Template: models.ChatTemplate}
	s.compileTemplate(b)
	if text, err = chatPrompt(b, []Message{{Role: "user", Content: "a"}, {Role: "user", Content: "b"}}, nil, nil); err != nil || strings.Count(text, "<|im_start|>user") != 2 {
		t.Fatalf("two user turns without tools: %q, %v", text, err)
	}

	b = &Backend{Vocab: f.Vocab(), Template: models.ToolsTemplate}
	s.compileTemplate(b)
	text, err = chatPrompt(b, req.Messages, nil, nil)
	if err != nil || !strings.Contains(text, "<tool_call>\n{\"name\": \"f\", \"arguments\": {}}\n</tool_call>") || !strings.Contains(text, "<tool_response>\n2\n</tool_response>") {
		t.Fatalf("no tools offered, history laid out by the template: %v\n%s", err, text)
	}
}
