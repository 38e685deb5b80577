package api

import (
	"encoding/json"
	"fmt"
	"strings"
	"testing"
	"unicode/utf8"

	"github.com/shoal-ai/shoal/engine"
	"github.com/shoal-ai/shoal/models"
	"github.com/shoal-ai/shoal/scheduler"
)

func TestToolsOf(t *testing.T) {
	const weather = `{"type":"function","function":{"name":"get_weather","parameters":{"type":"object","properties":{"city":{"type":"string"}}}}}`
	ok := []struct {
		body     string
		offered  bool
		required bool
		named    string
		parallel bool
	}{
		{`{}`, false, false, "", true},
		{`{"tools":[` + weather + `]}`, true, false, "", true},
		{`{"tools":[` + weather + `],"tool_choice":"auto","parallel_tool_calls":false}`, true, false, "", false},
		{`{"tools":[` + weather + `],"tool_choice":"required"}`, true, true, "", true},
		{`{"tools":[` + weather + `],"tool_choice":{"type":"function","function":{"name":"get_weather"}}}`, true, true, "get_weather", false}, // one call, as vLLM
		{`{"tools":[` + weather + `],"tool_choice":"none"}`, false, false, "", true},
		{`{"tools":[],"tool_choice":"auto"}`, false, false, "", true},
		{`{"tool_choice":"none"}`, false, false, "", true},
		{`{"functions":[{"name":"f"}],"function_call":"none"}`, false, false, "", true},
		{`{"tools":[{"type":"function","function":{"name":"f","parameters":{"type":["object","null"]}}}]}`, true, false, "", true},
	}
	for _, c := range ok {
		var f ToolFields
		if err := json.Unmarshal([]byte(c.body), &f); err != nil {
			t.Fatal(err)
		}
		tp, err := toolsOf(&f, nil)
		if err != nil {
			t.Errorf("%s: %v", c.body, err)
			continue
		}
		if (tp != nil) != c.offered {
			t.Errorf("%s: offered %v, want %v", c.body, tp != nil, c.offered)
			continue
		}
		if tp != nil && (tp.required != c.required || tp.named != c.named || tp.parallel != c.parallel) {
			t.Errorf("%s: plan %+v", c.body, tp)
		}
	}
	bad := map[string]string{
		`{"tools":{"type":"function"}}`:                                                          "tools",
		`{"tools":[{"type":"code_interpreter"}]}`:                                                "tools[0]",
		`{"tools":[{"type":"function"}]}`:                                                        "tools[0]",
		`{"tools":[{"type":"function","function":{"name":"no spaces"}}]}`:                        "tools[0]",
		`{"tools":[` + weather + `,` + weather + `]}`:                                            "tools[1]",
		`{"tools":[{"type":"function","function":{"name":"f","parameters":[1]}}]}`:               "tools[0]",
		`{"tools":[{"type":"function","function":{"name":"f","parameters":{"type":"string"}}}]}`: "tools[0]",
		`{"tools":[{"type":"function","function":{"name":"f","parameters":{"type":"object","properties":{"x":` + strings.Repeat(`{"items":`, 70) + `{}` + strings.Repeat(`}`, 70) + `}}}}]}`: "tools[0]",
		`{"tools":[` + weather + `],"tool_choice":"always"}`:                                           "tool_choice",
		`{"tools":[` + weather + `],"tool_choice":{"type":"function","function":{"name":"get_time"}}}`: "tool_choice",
		`{"tools":[` + weather + `],"tool_choice":{"type":"allowed_tools"}}`:                           "tool_choice",
		`{"tool_choice":"required"}`:                                                                   "tool_choice",
		`{"tool_choice":{"type":"function","function":{"name":"f"}}}`:                                  "tool_choice",
		`{"functions":[{"name":"f"}]}`:                                                                 "functions",
		`{"function_call":"auto"}`:                                                                     "function_call",
		`{"tools":[{"type":"function","function":{"name":"f","parameters":{"type":"object","properties":{"c":{"enum":[]}}}}}]}`:           "tools[0]",
		`{"tools":[{"type":"function","function":{"name":"f","parameters":{"type":"object","properties":{"c":{"anyOf":[]}}}}}]}`:          "tools[0]",
		`{"tools":[{"type":"function","function":{"name":"f","parameters":{"type":"object","properties":{"c":{"items":{"type":[]}}}}}}]}`: "tools[0]",
		`{"tools":[` + strings.TrimSuffix(strings.Repeat(`{"type":"function","function":{"name":"f"}},`, maxTools+1), ",") + `]}`:         "tools",
	}
	for body, param := range bad {
		var f ToolFields
		if err := json.Unmarshal([]byte(body), &f); err != nil {
			t.Fatal(err)
		}
		_, err := toolsOf(&f, nil)
		var e *Error
		if !asError(err, &e) || e.Param != param {
			t.Errorf("%.80s: error %v, want one naming %s", body, err, param)
		}
	}
}

func asError(err error, e **Error) bool {
	x, ok := err.(*Error)
	*e = x
	return ok
}

// TestRenderMessages: a history with calls and their results is rendered in the
// protocol's JSON form, with the tools described in the first system message.
func TestRenderMessages(t *testing.T) {
	var req ChatRequest
	body := `{
	"messages": [
		{"role": "developer", "content": "Be brief."},
		{"role": "user", "content": "Weather in Oslo and Paris?"},
		{"role": "assistant", "content": null, "tool_calls": [
			{"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\": \"Oslo\"}"}},
			{"id": "c2", "type": "function", "function": {"name": "get_weather", "arguments": "not json"}}]},
		{"role": "tool", "tool_call_id": "c1", "content": "{\"c\": 3}"},
		{"role": "tool", "tool_call_id": "c2", "content": "sunny"},
		{"role": "assistant", "content": "Cold in Oslo."},
		{"role": "assistant", "content": "Checking.", "tool_calls": [
			{"id": "c3", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Rome"}}}]},
		{"role": "user", "content": "Thanks"}],
	"tools": [{"type": "function", "function": {"name": "get_weather", "description": "Weather now"}}]}`
	if err := json.Unmarshal([]byte(body), &req); err != nil {
		t.Fatal(err)
	}
	tp, err := toolsOf(&req.ToolFields, nil)
	if err != nil || tp == nil {
		t.Fatal(tp, err)
	}
	msgs, err := renderMessages(req.Messages, tp)
	if err != nil {
		t.Fatal(err)
	}
	want := []engine.ChatMessage{
		{Role: "system", Content: "Be brief.\n\n" + tp.system()},
		{Role: "user", Content: "Weather in Oslo and Paris?"},
		{Role: "assistant", Content: `{"tool_calls":[{"name":"get_weather","arguments":{"city":"Oslo"}},{"name":"get_weather","arguments":"not json"}]}`},
		{Role: "user", Content: `{"tool_response":{"name":"get_weather","tool_call_id":"c1","content":{"c":3}}}`},
		{Role: "user", Content: `{"tool_response":{"name":"get_weather","tool_call_id":"c2","content":"sunny"}}`},
		{Role: "assistant", Content: `{"response":"Cold in Oslo."}`},
		{Role: "assistant", Content: `{"tool_calls":[{"name":"get_weather","arguments":{"city":"Rome"}}]}`},
		{Role: "user", Content: "Thanks"},
	}
	if len(msgs) != len(want) {
		t.Fatalf("%d messages, want %d: %+v", len(msgs), len(want), msgs)
	}
	for i := range want {
		if msgs[i] != want[i] {
			t.Errorf("message %d:\n got %+v\nwant %+v", i, msgs[i], want[i])
		}
	}
	if !strings.Contains(tp.system(), `{"name":"get_weather","description":"Weather now","parameters":{"type":"object","properties":{},"additionalProperties":false}}`) {
		t.Errorf("tools not described: %s", tp.system())
	}

	// Without tools offered, earlier answers stay plain text, but calls and
	// results keep their form; a system message is not added.
	msgs, err = renderMessages(req.Messages[1:], nil)
	if err != nil {
		t.Fatal(err)
	}
	if msgs[0].Role != "user" || msgs[4].Content != "Cold in Oslo." || msgs[1].Content != want[2].Content {
		t.Errorf("without tools: %+v", msgs)
	}

	for _, bad := range []string{
		`[{"role":"assistant","tool_calls":{"id":"x"}}]`,
		`[{"role":"assistant","tool_calls":[{"id":"x","type":"function","function":{"arguments":"{}"}}]}]`,
		`[{"role":"assistant","function_call":{"name":"f","arguments":"{}"}}]`,
		`[{"role":"robot","content":"x"}]`,
	} {
		var in []Message
		if err := json.Unmarshal([]byte(bad), &in); err != nil {
			t.Fatal(err)
		}
		if _, err := renderMessages(in, nil); err == nil {
			t.Errorf("%s: rendered", bad)
		}
	}
}

// TestRebaseRefs: a tool's local references point into it inside the answers'
// schema; text that only looks like a reference is left alone.
func TestRebaseRefs(t *testing.T) {
	in := `{"$defs":{"A":{"type":"object","properties":{"next":{"$ref" : "#"}}}},"type":"object","properties":{"a":{"$ref":"#/$defs/A"},"d":{"description":"{\"$ref\":\"#/x\"}"},"r":{"$ref":"https://example.com/s.json"}}}`
	want := `{"$defs":{"A":{"type":"object","properties":{"next":{"$ref" : "#/P"}}}},"type":"object","properties":{"a":{"$ref":"#/P/$defs/A"},"d":{"description":"{\"$ref\":\"#/x\"}"},"r":{"$ref":"https://example.com/s.json"}}}`
	if got := string(rebaseRefs(json.RawMessage(in), "#/P")); got != want {
		t.Errorf("got  %s\nwant %s", got, want)
	}
}

// TestToolSchema: the grammar's schema admits exactly the calls tool_choice allows.
func TestToolSchema(t *testing.T) {
	var f ToolFields
	_ = json.Unmarshal([]byte(`{"tools":[
		{"type":"function","function":{"name":"a","parameters":{"type":"object","properties":{"x":{"type":"integer"}}}}},
		{"type":"function","function":{"name":"b"}}],
		"tool_choice":{"type":"function","function":{"name":"b"}},"parallel_tool_calls":false}`), &f)
	tp, err := toolsOf(&f, nil)
	if err != nil {
		t.Fatal(err)
	}
	got := string(tp.schema())
	want := `{"anyOf":[{"additionalProperties":false,"properties":{"tool_calls":{"items":{"anyOf":[{"additionalProperties":false,"properties":{"name":{"const":"b"},"arguments":{"type":"object","properties":{},"additionalProperties":false}},"required":["name","arguments"],"type":"object"}]},"maxItems":1,"minItems":1,"type":"array"}},"required":["tool_calls"],"type":"object"}]}`
	if got != want {
		t.Errorf("named, one call:\n got %s\nwant %s", got, want)
	}
	tp.named, tp.required, tp.parallel = "", false, true
	var s struct {
		AnyOf []map[string]any `json:"anyOf"`
	}
	if err := json.Unmarshal(tp.schema(), &s); err != nil || len(s.AnyOf) != 2 {
		t.Fatalf("auto: %s", tp.schema())
	}
	if !strings.Contains(string(tp.schema()), `"const":"a"`) || strings.Contains(string(tp.schema()), "maxItems") {
		t.Errorf("auto, parallel: %s", tp.schema())
	}
}

// feed streams out through an answerStream in pieces of size k (every byte when
// k is 1) and returns the text passed on, the calls and whether a stop string
// ended the answer.
func feed(out string, k int, stops ...string) (string, []ToolCall, bool) {
	a := answerStream{stop: stopMatcher{stops: stops}}
	var text strings.Builder
	for i := 0; i < len(out); i += k {
		text.WriteString(a.add(out[i:min(i+k, len(out))]))
	}
	rest, calls := a.end(func() string { return "call-1" })
	return text.String() + rest, calls, a.stop.stopped
}

// TestAnswerUnderSchema: under a JSON schema a string answer is passed on as
// its JSON, quoted, as the same constraint gives without tools, streamed as it
// is generated and cut at a stop string matched in that JSON; otherwise it is
// its text.
func TestAnswerUnderSchema(t *testing.T) {
	pieces := []string{`{"resp`, `onse": "a \`, `"b\"`, ` c\u00e9"}`}
	for _, tc := range []struct {
		quoted      bool
		stops       []string
		first, want string
	}{
		{false, nil, "a ", `a "b" cé`},
		{true, nil, `"a `, `"a \"b\" c\u00e9"`},
		{true, []string{`\"b`}, `"a `, `"a `},
		{false, []string{`"b`}, "a ", `a `},
	} {
		a := answerStream{stop: stopMatcher{stops: tc.stops}, str: jsonString{quoted: tc.quoted}}
		var got strings.Builder
		for i, piece := range pieces {
			got.WriteString(a.add(piece))
			if i == 1 && got.String() != tc.first {
				t.Errorf("quoted %v, stops %q: %q passed on after two pieces, want %q", tc.quoted, tc.stops, got.String(), tc.first)
			}
		}
		rest, calls := a.end(func() string { return "id" })
		if got.String()+rest != tc.want || len(calls) != 0 {
			t.Errorf("quoted %v, stops %q: %q then %q, want %q", tc.quoted, tc.stops, got.String(), rest, tc.want)
		}
	}
}

// TestStopMatcherMinTokens: no stop string that ends within the first
// min_tokens ends the answer, but one that ends after them does, even begun
// within them.
func TestStopMatcherMinTokens(t *testing.T) {
	m := stopMatcher{stops: []string{"END"}, min: 4}
	var out strings.Builder
	for _, piece := range []string{"END", "a", "b", "E", "ND", "x"} {
		m.gen++
		out.WriteString(m.cut(piece, false))
	}
	if out.String() != "ENDab" || !m.stopped || m.matched != "END" {
		t.Fatalf("passed on %q, stopped %v; want \"ENDab\", stopped at the END that ends in token 5", out.String(), m.stopped)
	}
}

func TestAnswerStream(t *testing.T) {
	cases := []struct {
		out, text string
		calls     []FunctionCall
		stops     []string
		stopped   bool
	}{
		{out: `{"response": "Hello"}`, text: "Hello"},
		{out: " {\n  \"response\" :\"a\\\"b\\\\c\\/d\\n\\t\\u00e9\\ud83d\\ude00\\ud800x\" }", text: "a\"b\\c/d\n\té😀\uFFFDx"},
		{out: `{"response": "cut sho`, text: "cut sho"}, // max_tokens: what was generated
		{out: `{"tool_calls": [{"name": "f", "arguments": {"x": 1,  "y": [true]}}, {"name": "g", "arguments": {}}]}`,
			calls: []FunctionCall{{"f", `{"x":1,"y":[true]}`}, {"g", "{}"}}},
		// Cut short: the complete calls, and one cut in its arguments as generated.
		{out: `{"tool_calls": [{"name": "f", "arguments": {"x"`, calls: []FunctionCall{{"f", `{"x"`}}},
		{out: `{"tool_calls": [{"name": "f", "arguments": {}}, {"name": "g", "argu`, calls: []FunctionCall{{"f", "{}"}}},
		{out: `{"tool_calls": [{"name": "f", "arguments": {}}, {"name": "g", "arguments": `, calls: []FunctionCall{{"f", "{}"}, {"g", ""}}},
		{out: `{"tool_calls"`},
		// Answers other than strings (under an output constraint): their JSON.
		{out: `{"response": null}`, text: "null"},
		{out: `{"response": {"a": 1, "b": [2]} }`, text: `{"a":1,"b":[2]}`},
		{out: `{"response": {"a": 1, "b":`, text: `{"a": 1, "b":`}, // cut short: the value so far
		{out: `plain text`, text: "plain text"},
		{out: ``},
		{out: `{`},
		{out: "{\"response\" :\n"}, // cut before the answer began
		// Stop strings are matched in the answer's text, not in its JSON.
		{out: `{"response": "Hello\nUser: hi"}`, text: "Hello", stops: []string{"\nUser:"}, stopped: true},
		{out: `{"response": "ab"}`, text: "ab", stops: []string{"bc"}},
		{out: `{"response": "a\"b"}`, text: "a", stops: []string{`"`}, stopped: true},
		{out: `{"tool_calls": [{"name": "f", "arguments": {"s": "\n"}}]}`, calls: []FunctionCall{{"f", `{"s":"\n"}`}}, stops: []string{"\n", "}"}},
	}
	for _, c := range cases {
		for _, k := range []int{1, 3, len(c.out) + 1} {
			text, calls, stopped := feed(c.out, k, c.stops...)
			if text != c.text || len(calls) != len(c.calls) || stopped != c.stopped {
				t.Errorf("%q in pieces of %d: text %q, %d calls, stopped %v; want %q, %d, %v", c.out, k, text, len(calls), stopped, c.text, len(c.calls), c.stopped)
				continue
			}
			for i, call := range calls {
				if call.Function != c.calls[i] || call.Type != "function" || call.ID == "" {
					t.Errorf("%q: call %d %+v, want %+v", c.out, i, call, c.calls[i])
				}
			}
		}
	}
}

// FuzzAnswerStream: the text passed on does not depend on how the output is cut
// into pieces, and an answer's text is what a JSON decoder reads from it.
func FuzzAnswerStream(f *testing.F) {
	f.Add(`{"response": "a\u00e9\ud83d\ude00"}`, 2)
	f.Add(`{"tool_calls": [{"name": "f", "arguments": {}}]}`, 5)
	f.Add(`{"response": "\ud800\u0041\uzzzz"}`, 1)
	f.Fuzz(func(t *testing.T, out string, k int) {
		if k < 1 || k > len(out)+1 {
			k = 1
		}
		joinStreamed(t, &answerStream{}, out, k) // streamed calls join up to the whole
		whole, wholeCalls, _ := feed(out, len(out)+1, "\n\n")
		text, calls, _ := feed(out, k, "\n\n")
		if text != whole || len(calls) != len(wholeCalls) {
			t.Fatalf("pieces of %d: %q, %d calls; whole: %q, %d calls", k, text, len(calls), whole, len(wholeCalls))
		}
		var v struct {
			Response *string `json:"response"`
		}
		if responseStart.MatchString(out) && json.Unmarshal([]byte(out), &v) == nil && v.Response != nil && utf8.ValidString(out) &&
			text != strings.SplitN(*v.Response, "\n\n", 2)[0] {
			t.Fatalf("%q: passed on %q, JSON reads %q", out, text, *v.Response)
		}
	})
}

// TestTokenizeToolsWithOutputConstraint: /tokenize renders tools with the answer
// schema an output constraint gives them, as chat does.
func TestTokenizeToolsWithOutputConstraint(t *testing.T) {
	s := newTestServer(t, nil)
	count := func(extra string) int {
		w := s.do(t, "POST", "/tokenize", `{"messages":[{"role":"user","content":"x"}],"tools":[{"type":"function","function":{"name":"f"}}]`+extra+`}`)
		var r TokenizeResponse
		if w.Code != 200 || json.Unmarshal(w.Body.Bytes(), &r) != nil {
			t.Fatalf("%s: %d %s", extra, w.Code, w.Body)
		}
		return r.Count
	}
	plain := count("")
	if constrained := count(`,"response_format":{"type":"json_object","schema":{"type":"object","properties":{"verdict":{"type":"boolean"}}}}`); constrained <= plain {
		t.Errorf("with an answer schema %d tokens, without %d", constrained, plain)
	}
}

// TestToolConvertingBound: call formats that convert each tool's (or each
// parameter's) schema apart stop converting once one request's conversions
// took maxToolConverting of CPU, with 400.
func TestToolConvertingBound(t *testing.T) {
	calls := 0
	s := newTestServer(t, func(c *Config, _ *scheduler.Config) {
		c.SchemaToGrammar = func([]byte) (string, error) { calls++; burn(maxToolConverting / 4); return "root ::= \"1\"\n", nil }
	})
	b := *s.backend.Load()
	b.Template = models.MistralToolsTemplate // each tool's parameters converted alone
	s.SetBackend(&b)
	var tools []string
	for i := range 20 {
		tools = append(tools, fmt.Sprintf(`{"type":"function","function":{"name":"f%d","parameters":{"type":"object","properties":{"n":{"type":"integer"}}}}}`, i))
	}
	w := s.do(t, "POST", "/v1/chat/completions", `{"messages":[{"role":"user","content":"x"}],"max_tokens":2,"tool_choice":"required","tools":[`+strings.Join(tools, ",")+`]}`)
	if w.Code != 400 || !strings.Contains(w.Body.String(), "converting the tools' parameters") || calls > 6 {
		t.Fatalf("%d after %d conversions: %s", w.Code, calls, w.Body)
	}
}
