package api

import (
	"encoding/json"
	"fmt"
	"strings"
	"testing"

	"github.com/shoal-ai/shoal/models"
)

func TestXMLCalls(t *testing.T) {
	params, _, err := toolParams(json.RawMessage(`{"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}, "tags": {"type": "array"}}, "required": ["city"]}`))
	if err != nil || len(params) != 3 || params[0].name != "city" || !params[0].text || !params[0].required || params[1].text || params[1].required {
		t.Fatalf("params %+v, %v", params, err)
	}
	tools := map[string][]toolParam{"get_weather": params}
	call := "<tool_call>\n<function=get_weather>\n<parameter=city>\nNew\nYork\n</parameter>\n<parameter=days>\n3\n</parameter>\n<parameter=tags>\n[\"a\", 1]\n</parameter>\n</function>\n</tool_call>"
	for _, c := range []struct {
		name, out string
		calls     []string
		whole, ok bool
	}{
		{"one call", call, []string{`get_weather{"city":"New\nYork","days":3,"tags":["a",1]}`}, true, true},
		{"two calls", call + "\n" + strings.Replace(call, "3", "x", 1), []string{`get_weather{"city":"New\nYork","days":3,"tags":["a",1]}`, `get_weather{"city":"New\nYork","days":"x","tags":["a",1]}`}, true, true},
		{"cut in a value", call[:strings.Index(call, "3")], []string{`get_weather{"city":"New\nYork"}`}, false, true},
		{"cut in the name", "<tool_call>\n<function=get_wea", nil, false, true},
		{"cut before the closing tag", call[:len(call)-5], []string{`get_weather{"city":"New\nYork","days":3,"tags":["a",1]}`}, false, true},
		{"not a call", "<tool_call> oops", nil, false, false},
	} {
		t.Run(c.name, func(t *testing.T) {
			calls, _, whole, ok := parseXML(c.out, &qwenXMLFormat, tools, func() string { return "id" })
			var got []string
			for _, x := range calls {
				got = append(got, x.Function.Name+x.Function.Arguments)
				if !json.Valid([]byte(x.Function.Arguments)) {
					t.Errorf("arguments %q are not JSON", x.Function.Arguments)
				}
			}
			if fmt.Sprint(got) != fmt.Sprint(c.calls) || whole != c.whole || ok != c.ok {
				t.Fatalf("calls %q, whole %v, ok %v; want %q, %v, %v", got, whole, ok, c.calls, c.whole, c.ok)
			}
		})
	}
}

// TestXMLCallGrammar: the grammar names each tool and parameter, strings as
// text up to the parameter's closing tag, enums as their values, other values
// through the JSON-schema converter with its rules kept apart per parameter.
func TestXMLCallGrammar(t *testing.T) {
	s := &Server{}
	s.cfg.SchemaToGrammar = func([]byte) (string, error) { return "root ::= \"1\" space\nspace ::= \" \"?\n", nil }
	var f ToolFields
	_ = json.Unmarshal([]byte(`{"tools": [{"type": "function", "function": {"name": "w", "parameters": {"type": "object",
		"properties": {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["c", "f"]}, "days": {"type": "integer"}, "hours": {"type": "integer"}}, "required": ["city", "days"]}}}]}`), &f)
	tp, err := toolsOf(&f, nil)
	if err != nil {
		t.Fatal(err)
	}
	tp.format = &qwenXMLFormat
	g, triggers, err := s.callGrammar(tp)
	if err != nil || fmt.Sprint(triggers) != "[{<tool_call> false false}]" {
		t.Fatalf("%v %v", triggers, err)
	}
	for _, want := range []string{
		`shoal-fn-0 ::= "<function=w>" "\n" shoal-fn-0-p0 shoal-fn-0-p1? shoal-fn-0-p2 shoal-fn-0-p3? "</function>"`,
		`shoal-fn-0-p0 ::= "<parameter=city>" "\n" shoal-text "\x0A</parameter>" "\n"`,
		`shoal-fn-0-p1-v ::= "c" | "f"`,
		`shoal-fn-0-p2-root ::= "1" shoal-fn-0-p2-space`,
		`shoal-fn-0-p2 ::= "<parameter=days>" "\n" shoal-fn-0-p2-root "\x0A</parameter>" "\n"`,
		`shoal-fn-0-p3-space ::= " "?`,
		`shoal-text-12 ::= | "\x0A" shoal-text-1 | [^>\n] shoal-text-0`,
		`shoal-block ::= "<tool_call>" "\n" shoal-call "\n" "</tool_call>"`,
	} {
		if !strings.Contains(g, want) {
			t.Errorf("grammar lacks %q:\n%s", want, g)
		}
	}
	if tp.params["w"] == nil {
		t.Fatal("the parameters were not kept for parsing")
	}
	// The template lays out earlier calls in the same form.
	if detectCallFormat(models.QwenXMLToolsTemplate) != &qwenXMLFormat {
		t.Fatal("the XML template's format was not recognised")
	}
}

// TestXMLFits: tools whose parameters the XML format cannot write take the
// tool protocol.
func TestXMLFits(t *testing.T) {
	for params, want := range map[string]bool{
		`{"type":"object","properties":{"city":{"type":"string"}}}`:      true,
		`{"type":"object","properties":{},"additionalProperties":false}`: true, // no arguments
		`{"type":"object"}`:                             true, // as clients write no arguments
		`{"type":"object","properties":{}}`:             true,
		`{"type":"object","additionalProperties":true}`: false, // any object
		`{"type":"object","properties":{"a":{"type":"string"}},"additionalProperties":{"type":"integer"}}`: false,
		`{"anyOf":[{"type":"object"}]}`:                                                                          false,
		`{"type":"object","properties":{"a>b":{"type":"string"}}}`:                                               false, // the tag could not be read back
		`{"type":"object","properties":{"a":{"$ref":"#/$defs/A"}},"$defs":{"A":{"type":"integer"}}}`:             true,
		`{"type":"object","properties":{"a":{"$ref":"#/properties/b"},"b":{"type":"integer"}}}`:                  false,
		`{"type":"object","properties":{"a":{"$ref":"#/definitions/A"}},"definitions":{"A":{"type":"integer"}}}`: true,
	} {
		if got := xmlFits([]FunctionDef{{Name: "f", Parameters: json.RawMessage(params)}}); got != want {
			t.Errorf("%s: fits %v, want %v", params, got, want)
		}
	}
	// A parameter's references resolve against the tool's definitions.
	merged := mergeDefs(json.RawMessage(`{"$ref":"#/definitions/A","$defs":{"B":{}}}`), map[string]json.RawMessage{
		"definitions": json.RawMessage(`{"A":{"type":"integer"}}`), "$defs": json.RawMessage(`{"B":{"type":"string"},"C":{}}`)})
	var m struct {
		Definitions map[string]json.RawMessage `json:"definitions"`
	}
	if json.Unmarshal(merged, &m) != nil || string(m.Definitions["A"]) != `{"type":"integer"}` || !strings.Contains(string(merged), `"B":{}`) || !strings.Contains(string(merged), `"C":{}`) {
		t.Errorf("merged %s", merged)
	}
	// Strings, also those that may be null, are written as text, and read back
	// without HTML escapes.
	params, _, _ := toolParams(json.RawMessage(`{"type":"object","properties":{"code":{"type":["string","null"]}}}`))
	if len(params) != 1 || !params[0].text {
		t.Fatalf("params %+v", params)
	}
	if v := string(paramValue("a < b && c", params, "code")); v != `"a < b && c"` {
		t.Errorf("value %s", v)
	}
}

// TestRootRefUnderAllOf: a schema whose root is a reference reaches llama.cpp's
// converter under allOf, where it resolves the references inside the target.
func TestRootRefUnderAllOf(t *testing.T) {
	var got string
	s := &Server{}
	s.cfg.SchemaToGrammar = func(b []byte) (string, error) { got = string(b); return "root ::= \"x\"\n", nil }
	if _, err := s.schemaGrammar("response_format", json.RawMessage(`{"$ref":"#/$defs/A","$defs":{"A":{"type":"object"}}}`)); err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(got, `"allOf":[{"$ref":"#/$defs/A"}]`) || strings.HasPrefix(got, `{"$ref"`) {
		t.Fatalf("converter got %s", got)
	}
}

// TestGLMCalls: GLM's calls, the name then a key and a value tag per
// parameter, also with the first parameter right after the name (GLM 4.7),
// and cut short.
func TestGLMCalls(t *testing.T) {
	params, _, _ := toolParams(json.RawMessage(`{"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}`))
	tools := map[string][]toolParam{"get_weather": params}
	call := "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>New\nYork</arg_value>\n<arg_key>days</arg_key>\n<arg_value>3</arg_value>\n</tool_call>"
	for _, c := range []struct {
		name, out string
		calls     []string
		whole, ok bool
	}{
		{"one call", call, []string{`get_weather{"city":"New\nYork","days":3}`}, true, true},
		{"two calls", call + "\n" + call, []string{`get_weather{"city":"New\nYork","days":3}`, `get_weather{"city":"New\nYork","days":3}`}, true, true},
		{"no newlines", "<tool_call>get_weather<arg_key>days</arg_key><arg_value>2</arg_value></tool_call>", []string{`get_weather{"days":2}`}, true, true},
		{"no parameters", "<tool_call>get_time\n</tool_call>", []string{`get_time{}`}, true, true},
		{"no parameters, no newline", "<tool_call>get_time</tool_call>", []string{`get_time{}`}, true, true},
		{"cut in a value", call[:strings.Index(call, "3")], []string{`get_weather{"city":"New\nYork"}`}, false, true},
		{"cut in the name", "<tool_call>get_wea", nil, false, true},
		{"cut before the closing tag", call[:len(call)-5], []string{`get_weather{"city":"New\nYork","days":3}`}, false, true},
		{"not a call", "<tool_call> <oops>", nil, false, false},
		{"JSON, not GLM's", `<tool_call>{"name": "f", "arguments": {}}</tool_call>`, nil, false, false},
	} {
		t.Run(c.name, func(t *testing.T) {
			calls, _, whole, ok := parseXML(c.out, &glmFormat, tools, func() string { return "id" })
			var got []string
			for _, x := range calls {
				got = append(got, x.Function.Name+x.Function.Arguments)
			}
			if fmt.Sprint(got) != fmt.Sprint(c.calls) || whole != c.whole || ok != c.ok {
				t.Fatalf("calls %q, whole %v, ok %v; want %q, %v, %v", got, whole, ok, c.calls, c.whole, c.ok)
			}
		})
	}
}

// TestGLMCallGrammar: the name, then each parameter's key and value tags,
// strings as text up to </arg_value>.
func TestGLMCallGrammar(t *testing.T) {
	s := &Server{}
	s.cfg.SchemaToGrammar = func([]byte) (string, error) { return "root ::= \"1\" space\nspace ::= \" \"?\n", nil }
	var f ToolFields
	_ = json.Unmarshal([]byte(`{"tools": [{"type": "function", "function": {"name": "w", "parameters": {"type": "object",
		"properties": {"city": {"type": "string"}, "days": {"type": "integer"}}, "required": ["city"]}}}]}`), &f)
	tp, err := toolsOf(&f, nil)
	if err != nil {
		t.Fatal(err)
	}
	if tp.format = detectCallFormat(models.GLMToolsTemplate); tp.format != &glmFormat {
		t.Fatalf("GLM's template: format %v", tp.format)
	}
	g, _, err := s.callGrammar(tp)
	if err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{
		`shoal-fn-0 ::= "w" "\n"? shoal-fn-0-p0 shoal-fn-0-p1?` + "\n",
		`shoal-fn-0-p0 ::= "<arg_key>city</arg_key>" "\n"? "<arg_value>" shoal-text "</arg_value>" "\n"?`,
		`shoal-fn-0-p1 ::= "<arg_key>days</arg_key>" "\n"? "<arg_value>" shoal-fn-0-p1-root "</arg_value>" "\n"?`,
		`shoal-block ::= "<tool_call>" shoal-call "</tool_call>"`,
	} {
		if !strings.Contains(g, want) {
			t.Errorf("grammar lacks %q:\n%s", want, g)
		}
	}
}
