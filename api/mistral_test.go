package api

import (
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"strings"
	"testing"

	"github.com/shoal-ai/shoal/engine/enginetest"
	"github.com/shoal-ai/shoal/models"
)

func TestDetectMistralFormats(t *testing.T) {
	for tmpl, want := range map[string]*callFormat{
		models.MistralToolsTemplate:                               &mistralFormat,
		models.MistralListToolsTemplate:                           &mistralListFormat,
		`[TOOL_CALLS]{{ name }}[CALL_ID]{{ id }}[ARGS]{{ args }}`: &mistralIDFormat,
	} {
		if got := detectCallFormat(tmpl); got != want {
			t.Errorf("%.40q: format %v, want %v", tmpl, got, want)
		}
	}
}

// TestMistralCallStream: text before the calls is passed on, the calls come
// whole at the end with short ids, also cut short.
func TestMistralCallStream(t *testing.T) {
	ids := 0
	newID := func() string { ids++; return fmt.Sprintf("call_%d", ids) }
	for _, c := range []struct {
		name   string
		f      *callFormat
		pieces []string
		sent   string
		rest   string
		calls  []string
		finish string
	}{
		{"named", &mistralFormat, []string{"Let me look.", "[TOOL", "_CALLS]get_weather[ARGS]", `{"city": "Oslo"}`}, "Let me look.", "", []string{`get_weather{"city":"Oslo"}`}, "tool_calls"},
		{"named, two", &mistralFormat, []string{`[TOOL_CALLS]a[ARGS]{}[TOOL_CALLS]b[ARGS]{"x": [1, 2]}`}, "", "", []string{`a{}`, `b{"x":[1,2]}`}, "tool_calls"},
		{"named, with a call id", &mistralIDFormat, []string{`[TOOL_CALLS]a[CALL_ID]abcdefghi[ARGS]{"n": 1}`}, "", "", []string{`a{"n":1}`}, "tool_calls"},
		{"named, cut in the arguments", &mistralFormat, []string{`[TOOL_CALLS]a[ARGS]{"city": "Os`}, "", "", []string{`a{"city":"Os`}, "length"},
		{"named, cut in the name", &mistralFormat, []string{`[TOOL_CALLS]get_wea`}, "", "", nil, "length"},
		{"named, cut in the second tag", &mistralFormat, []string{`[TOOL_CALLS]a[ARGS]{}[TOOL_`}, "", "", []string{`a{}`}, "length"},
		{"named, text after", &mistralFormat, []string{`[TOOL_CALLS]a[ARGS]{} done`}, "", "done", []string{`a{}`}, "tool_calls"},
		{"named, not a call", &mistralFormat, []string{`[TOOL_CALLS] {oops}`}, "", "[TOOL_CALLS] {oops}", nil, "stop"},
		{"named, tags only", &mistralFormat, []string{`[TOOL_CALLS][TOOL_CALLS]`}, "", "[TOOL_CALLS][TOOL_CALLS]", nil, "stop"},
		{"named, cut in the arguments' tag", &mistralFormat, []string{`[TOOL_CALLS]a[AR`}, "", "", nil, "length"},
		{"named, cut in the call id", &mistralIDFormat, []string{`[TOOL_CALLS]a[CALL_ID]abc`}, "", "", nil, "length"},
		{"named, cut in the call id's tag", &mistralIDFormat, []string{`[TOOL_CALLS]a[CALL_`}, "", "", nil, "length"},
		{"list", &mistralListFormat, []string{"Sure. [TOOL_CALLS] [", `{"name": "a", "arguments": {"x": 1}, "id": "abcdefghi"}, `, `{"name": "b", "arguments": {}}]`}, "Sure. ", "", []string{`a{"x":1}`, `b{}`}, "tool_calls"},
		{"list, cut in the arguments", &mistralListFormat, []string{`[TOOL_CALLS][{"name": "a", "arguments": {"x": `}, "", "", []string{`a{"x":`}, "length"},
		{"list, cut in the id", &mistralListFormat, []string{`[TOOL_CALLS][{"name": "a", "arguments": {"x": 1}, "id": "abc`}, "", "", []string{`a{"x":1}`}, "length"},
		{"list, cut before the end", &mistralListFormat, []string{`[TOOL_CALLS][{"name": "a", "arguments": {}}`}, "", "", []string{`a{}`}, "length"},
		{"list, cut after the tag", &mistralListFormat, []string{`[TOOL_CALLS]`}, "", "", nil, "length"},
		{"list, not a call", &mistralListFormat, []string{`[TOOL_CALLS] hello`}, "", "[TOOL_CALLS] hello", nil, "stop"},
	} {
		t.Run(c.name, func(t *testing.T) {
			cs := &callStream{f: c.f}
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
				if !shortIDPattern.MatchString(call.ID) || call.Type != "function" {
					t.Fatalf("call %+v: want an id of 9 letters and digits", call)
				}
				got = append(got, call.Function.Name+call.Function.Arguments)
			}
			finish := cs.finishReason(map[bool]string{true: "length", false: "stop"}[c.finish == "length"], calls)
			if fmt.Sprint(got) != fmt.Sprint(c.calls) || finish != c.finish {
				t.Fatalf("calls %q, finish %q; want %q, %q", got, finish, c.calls, c.finish)
			}
		})
	}
}

func TestShortID(t *testing.T) {
	seen := map[string]bool{}
	for i := range 1000 {
		id := shortID(fmt.Sprintf("call_%x", i))
		if !shortIDPattern.MatchString(id) || seen[id] || shortID(fmt.Sprintf("call_%x", i)) != id {
			t.Fatalf("shortID: %q (seen before: %v)", id, seen[id])
		}
		seen[id] = true
	}
	if shortID("abcDEF123") != "abcDEF123" {
		t.Fatal("an id that fits was changed")
	}
}

// TestMistralCallGrammar: each tool's arguments are converted alone after its
// name and [ARGS]; the list format is one JSON list; both triggers read
// control tokens as text.
func TestMistralCallGrammar(t *testing.T) {
	s := &Server{}
	s.cfg.SchemaToGrammar = func([]byte) (string, error) { return "root ::= \"{}\" space\nspace ::= \" \"?\n", nil }
	var f ToolFields
	_ = json.Unmarshal([]byte(`{"tools": [{"type": "function", "function": {"name": "a"}}, {"type": "function", "function": {"name": "b"}}]}`), &f)
	tp, err := toolsOf(&f, nil)
	if err != nil {
		t.Fatal(err)
	}
	tp.format = &mistralIDFormat
	g, triggers, err := s.callGrammar(tp)
	if err != nil || fmt.Sprint(triggers) != "[{[TOOL_CALLS] false true}]" {
		t.Fatalf("%v %v", triggers, err)
	}
	for _, want := range []string{
		`shoal-call ::= "[TOOL_CALLS]" ("a" shoal-call-id? "[ARGS]" shoal-fn-0-root | "b" shoal-call-id? "[ARGS]" shoal-fn-1-root)`,
		`shoal-fn-1-root ::= "{}" shoal-fn-1-space`,
		`shoal-call-id ::= "[CALL_ID]" [a-zA-Z0-9]{9}`,
		"root ::= shoal-call shoal-call*\n",
	} {
		if !strings.Contains(g, want) {
			t.Errorf("grammar lacks %q:\n%s", want, g)
		}
	}
	tp.format, tp.parallel = &mistralListFormat, false
	var schema string
	s.cfg.SchemaToGrammar = func(b []byte) (string, error) { schema = string(b); return "root ::= \"{}\"\n", nil }
	if g, _, err = s.callGrammar(tp); err != nil || !strings.Contains(g, `root ::= "[TOOL_CALLS]" " "? "[" shoal-call "]"`) {
		t.Fatalf("list: %v\n%s", err, g)
	}
	if !strings.Contains(schema, `"id":{"pattern":"^[a-zA-Z0-9]{9}$","type":"string"}`) || !strings.Contains(schema, `"required":["name","arguments"]`) {
		t.Fatalf("list: the call's schema lacks an optional id: %s", schema)
	}
}

// TestMistralHistory: earlier calls and results are laid out in the
// template's form, their ids mapped to 9 letters and digits (the list
// template refuses others), a call and its result alike.
func TestMistralHistory(t *testing.T) {
	fk := enginetest.New(256, 4, 64)
	s := &Server{log: slog.New(slog.NewTextHandler(io.Discard, nil))}
	var req ChatRequest
	body := `{"messages": [
		{"role": "user", "content": "Weather in Oslo?"},
		{"role": "assistant", "content": "", "tool_calls": [{"id": "call_0123456789abcdef", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\": \"Oslo\"}"}}]},
		{"role": "tool", "tool_call_id": "call_0123456789abcdef", "content": "3 C"}],
		"tools": [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]}`
	if err := json.Unmarshal([]byte(body), &req); err != nil {
		t.Fatal(err)
	}
	id := shortID("call_0123456789abcdef")
	// A call sent without an id, and its result without one, get one.
	var unnamed ChatRequest
	if err := json.Unmarshal([]byte(strings.NewReplacer(`"id": "call_0123456789abcdef", `, "", `"tool_call_id": "call_0123456789abcdef", `, "").Replace(body)), &unnamed); err != nil {
		t.Fatal(err)
	}
	for tmpl, want := range map[string][]string{
		models.MistralListToolsTemplate: {`[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Oslo"}, "id": "` + id + `"}]`, `[TOOL_RESULTS]{"content": "3 C", "call_id": "` + id + `"}[/TOOL_RESULTS]`},
		models.MistralToolsTemplate:     {`[TOOL_CALLS]get_weather[ARGS]{"city": "Oslo"}`, "[TOOL_RESULTS]3 C[/TOOL_RESULTS]", `[AVAILABLE_TOOLS][{"type": "function"`},
	} {
		b := &Backend{Vocab: fk.Vocab(), Info: fk.Info(), Template: tmpl}
		s.compileTemplate(b)
		tp, err := toolsOf(&req.ToolFields, &req.SamplingFields)
		if err != nil {
			t.Fatal(err)
		}
		text, err := chatPrompt(b, req.Messages, tp, nil)
		if err != nil {
			t.Fatalf("%s: %v", b.chat.calls.name, err)
		}
		if _, err := chatPrompt(b, unnamed.Messages, tp, nil); err != nil {
			t.Fatalf("%s, calls without ids: %v", b.chat.calls.name, err)
		}
		for _, w := range want {
			if !strings.Contains(text, w) {
				t.Errorf("%s: prompt lacks %q:\n%s", b.chat.calls.name, w, text)
			}
		}
	}
}
