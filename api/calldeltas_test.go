package api

import (
	"fmt"
	"strings"
	"testing"
)

// streamedFollower is a call follower fed piece by piece.
type streamedFollower interface {
	toolFollower
	add(piece string) string
}

// joinStreamed feeds out to f in pieces of k, streaming its calls as they are
// written, and fails unless the deltas join up to the calls end gives:
// ids, names and arguments.
func joinStreamed(t *testing.T, f streamedFollower, out string, k int) []ToolCall {
	t.Helper()
	ids := 0
	newID := func() string { ids++; return fmt.Sprintf("call_%d", ids) }
	var d callDeltas
	var deltas []ToolCallDelta
	for i := 0; i < len(out); i += k {
		f.add(out[i:min(i+k, len(out))])
		deltas = append(deltas, d.next(f.progress(newID))...)
	}
	_, calls := f.end(newID)
	deltas = append(deltas, d.next(calls)...)
	var joined []ToolCall
	for _, x := range deltas {
		switch {
		case x.Index == len(joined) && x.ID != "":
			joined = append(joined, ToolCall{ID: x.ID, Type: x.Type, Function: FunctionCall{Name: x.Function.Name, Arguments: x.Function.Arguments}})
		case x.Index < len(joined) && x.ID == "" && x.Function.Name == "":
			joined[x.Index].Function.Arguments += x.Function.Arguments
		default:
			t.Fatalf("%q in pieces of %d: delta %+v after %d calls", out, k, x, len(joined))
		}
	}
	if len(calls) == 0 {
		// Not calls after all: output no grammar would let through (under
		// tools the calls are held to one from their first tag on).
		return nil
	}
	if fmt.Sprint(joined) != fmt.Sprint(calls) {
		t.Fatalf("%q in pieces of %d: the deltas join up to %v, the calls are %v", out, k, joined, calls)
	}
	return calls
}

// TestStreamedCalls: calls are streamed as they are written, their
// arguments growing, and the deltas join up to the whole answer's calls.
func TestStreamedCalls(t *testing.T) {
	params := map[string][]toolParam{"f": {{name: "a", text: true}, {name: "b"}}}
	for _, c := range []struct {
		f   *callFormat
		out string
	}{
		{&hermesFormat, "Sure.\n<tool_call>\n{\"name\": \"f\", \"arguments\": {\"a\": \"x y\", \"b\": [1, 2]}}\n</tool_call>\n<tool_call>{\"name\": \"g\", \"arguments\": null}</tool_call>"},
		{&hermesFormat, "<tool_call>{\"name\": \"f\", \"arguments\": {\"a\": \"cut \\\"sh"},
		{&hermesFormat, "<tool_call>{\"name\": \"f\", \"arguments\": {\"a\": \"cut in spaces    "},
		{&mistralFormat, "[TOOL_CALLS]f[ARGS]{\"a\": \"x  "},
		{&llama3Format, `{"name": "f", "parameters": {"a": 1}}`},
		{&qwenXMLFormat, "<tool_call>\n<function=f>\n<parameter=a>\nx y\n</parameter>\n<parameter=b>\n3\n</parameter>\n</function>\n</tool_call>"},
		{&glmFormat, "<tool_call>f\n<arg_key>a</arg_key>\n<arg_value>x</arg_value>\n</tool_call><tool_call>g</tool_call>"},
		{&mistralFormat, `[TOOL_CALLS]f[ARGS]{"a": "x"}[TOOL_CALLS]g[ARGS]{}`},
		{&mistralListFormat, `[TOOL_CALLS] [{"name": "f", "arguments": {"a": 1}, "id": "abcdefghi"}, {"name": "g", "arguments": {}}]`},
	} {
		for _, k := range []int{1, 2, 3, 7, len(c.out)} {
			calls := joinStreamed(t, &callStream{f: c.f, params: params}, c.out, k)
			if len(calls) == 0 {
				t.Fatalf("%s: no calls in %q", c.f.name, c.out)
			}
		}
	}
	out := `{"tool_calls": [{"name": "f", "arguments": {"a": "x  "}}, {"name": "g", "arguments": {"b": [1, "  `
	for _, k := range []int{1, 4, len(out)} {
		if calls := joinStreamed(t, &answerStream{}, out, k); len(calls) != 2 || calls[1].Function.Arguments != `{"b":[1,"  ` {
			t.Fatalf("the tool protocol: %v", calls)
		}
	}
	// Each piece of a call's arguments is passed on as it is written.
	cs := &callStream{f: &hermesFormat}
	var d callDeltas
	var got []string
	for _, p := range []string{`<tool_call>{"name": "f", `, `"arguments": {"a"`, `: "x`, ` y"}}`, "</tool_call>"} {
		cs.add(p)
		for _, x := range d.next(cs.progress(func() string { return "id" })) {
			got = append(got, x.Function.Arguments)
		}
	}
	if strings.Join(got, "|") != `|{"a"|:"x| y"}` {
		t.Fatalf("argument deltas %q", got)
	}
	// In the XML formats a string parameter streams as it is written, less
	// what may begin its closing tag; other values once whole (and the
	// closing brace once the output is: end).
	cs, d, got = &callStream{f: &qwenXMLFormat, params: params}, callDeltas{}, nil
	for _, p := range []string{"<tool_call>\n<function=f>\n<parameter=b>\n", "[1]\n</parameter>\n<parameter=a>\nline \"1\"\n", "line 2\n</para", "meter>\n</function>\n</tool_call>"} {
		cs.add(p)
		for _, x := range d.next(cs.progress(func() string { return "id" })) {
			got = append(got, x.Function.Arguments)
		}
	}
	if strings.Join(got, "|") != `{|"b":[1],"a":"line \"1\"|\nline 2|"` {
		t.Fatalf("XML argument deltas %q", got)
	}
}

func TestStableJSON(t *testing.T) {
	for in, want := range map[string]string{
		`{"a": 1}`:            `{"a":1}`,
		`{"a": 1}, "id": "ab`: `{"a":1}`,
		`{ "a" : "x  y`:       `{"a":"x  y`,
		`{"a": "q\" b`:        `{"a":"q\" b`,
		`nul`:                 ``,
		`null`:                `{}`,
		``:                    ``,
		"{\n  \"b\": [1,\n  ": `{"b":[1,`,
	} {
		if got := stableJSON(in); got != want {
			t.Errorf("stableJSON(%q) = %q, want %q", in, got, want)
		}
	}
}

// BenchmarkStreamedCall: following a 32 KB call (a file written by an agent)
// piece by piece and streaming it as written, in a JSON and an XML format:
// progress (with its tail caches) beside reading all of the call again at
// each piece, which progress would do without them.
func BenchmarkStreamedCall(b *testing.B) {
	body := strings.Repeat(`line of code with some text \"quoted\"\n`, 800)
	newID := func() string { return "id" }
	for _, c := range []struct {
		f   *callFormat
		out string
	}{
		{&hermesFormat, "<tool_call>\n{\"name\": \"write\", \"arguments\": {\"path\": \"a.go\", \"text\": \"" + body + "\"}}\n</tool_call>"},
		{&qwenXMLFormat, "<tool_call>\n<function=write>\n<parameter=path>\na.go\n</parameter>\n<parameter=text>\n" + body + "\n</parameter>\n</function>\n</tool_call>"},
	} {
		params := map[string][]toolParam{"write": {{name: "path", text: true}, {name: "text", text: true}}}
		for _, way := range []string{"as-written", "reread"} {
			b.Run(c.f.name+"/"+way, func(b *testing.B) {
				for b.Loop() {
					cs := &callStream{f: c.f, params: params}
					var d callDeltas
					for i := 0; i < len(c.out); i += 4 {
						cs.add(c.out[i:min(i+4, len(c.out))])
						if way == "reread" {
							calls, _, _, _ := cs.parse(cs.buf.String()[cs.sent:], newID)
							d.next(calls)
						} else {
							d.next(cs.progress(newID))
						}
					}
				}
			})
		}
	}
}
