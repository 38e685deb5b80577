package api

import (
	"bytes"
	"encoding/json"
	"fmt"
	"maps"
	"slices"
	"strings"

	"github.com/shoal-ai/shoal/engine"
)

// qwenXMLFormat is the XML call format of Qwen3-Coder, Qwen 3.5 and 3.6 and
// Nemotron 3 (vLLM's qwen3_coder parser): each parameter in its own tag, a
// string as its raw text, any other value as JSON.
//
//	<tool_call>
//	<function=get_weather>
//	<parameter=city>
//	Oslo
//	</parameter>
//	</function>
//	</tool_call>
var qwenXMLFormat = callFormat{name: "qwen3-coder", open: "<tool_call>", close: "</tool_call>", xml: true}

// paramEnd ends a parameter's value.
const paramEnd = "\n</parameter>"

// toolParam is one parameter of a tool as the XML format writes it.
type toolParam struct {
	name     string
	schema   json.RawMessage
	required bool
	text     bool     // a string: written as its raw text
	enum     []string // a string's allowed values, if the schema lists them
}

// toolParams reads the parameters of a tool's schema in the order given, and
// the definitions its references may point into ($defs, definitions).
func toolParams(schema json.RawMessage) ([]toolParam, map[string]json.RawMessage, error) {
	var top struct {
		Properties  json.RawMessage `json:"properties"`
		Required    []string        `json:"required"`
		Defs        json.RawMessage `json:"$defs"`
		Definitions json.RawMessage `json:"definitions"`
	}
	if err := json.Unmarshal(schema, &top); err != nil {
		return nil, nil, err
	}
	defs := map[string]json.RawMessage{}
	if given(top.Defs) {
		defs["$defs"] = top.Defs
	}
	if given(top.Definitions) {
		defs["definitions"] = top.Definitions
	}
	var params []toolParam
	if given(top.Properties) && string(bytes.TrimSpace(top.Properties)) != "{}" {
		dec := json.NewDecoder(bytes.NewReader(top.Properties))
		if t, err := dec.Token(); err != nil || t != json.Delim('{') {
			return nil, nil, fmt.Errorf("properties must be an object")
		}
		for dec.More() {
			tok, err := dec.Token()
			if err != nil {
				return nil, nil, err
			}
			k, ok := tok.(string)
			if !ok {
				return nil, nil, fmt.Errorf("properties must be an object")
			}
			var raw json.RawMessage
			if err := dec.Decode(&raw); err != nil {
				return nil, nil, err
			}
			p := toolParam{name: k, schema: raw}
			var ps struct {
				Type json.RawMessage `json:"type"`
				Enum []any           `json:"enum"`
			}
			_ = json.Unmarshal(raw, &ps)
			if stringType(ps.Type) && !constrainedString(raw) {
				p.text = true
				for _, e := range ps.Enum {
					if s, ok := e.(string); ok {
						p.enum = append(p.enum, s)
					}
				}
			}
			for _, r := range top.Required {
				p.required = p.required || r == p.name
			}
			params = append(params, p)
		}
	}
	return params, defs, nil
}

// constrainedString reports whether a string schema limits its text beyond an
// enum (a pattern, a format, a length, a constant): such a parameter is
// written as a JSON string, which the converter's grammar holds to them.
func constrainedString(raw json.RawMessage) bool {
	var m map[string]json.RawMessage
	if json.Unmarshal(raw, &m) != nil {
		return true
	}
	for _, k := range []string{"pattern", "format", "minLength", "maxLength", "const"} {
		if _, ok := m[k]; ok {
			return true
		}
	}
	return false
}

// stringType reports whether a schema's type is a string (or a string or null,
// which the XML format writes as text all the same).
func stringType(raw json.RawMessage) bool {
	if isString(raw, "string") {
		return true
	}
	var l []string
	if json.Unmarshal(raw, &l) != nil || !slices.Contains(l, "string") {
		return false
	}
	for _, t := range l {
		if t != "string" && t != "null" {
			return false
		}
	}
	return true
}

// xmlFits reports whether every tool's parameters can be written in the XML
// format: named properties (not a free object or alternatives at the top),
// names that cannot be taken for the tags around them, and references only
// into the tool's definitions. Requests whose tools do not fit use the tool
// protocol.
func xmlFits(tools []FunctionDef) bool {
	for _, f := range tools {
		var top map[string]json.RawMessage
		if json.Unmarshal(f.Parameters, &top) != nil {
			return false
		}
		for _, k := range []string{"anyOf", "oneOf", "allOf", "$ref", "patternProperties"} {
			if _, ok := top[k]; ok {
				return false
			}
		}
		if ap, ok := top["additionalProperties"]; ok && string(bytes.TrimSpace(ap)) != "false" {
			return false // a free object: no parameter tags to write it in
		}
		params, _, err := toolParams(f.Parameters)
		if err != nil {
			return false
		}
		for _, p := range params {
			if p.name == "" || strings.ContainsAny(p.name, "<>=\r\n") {
				return false
			}
		}
		for _, m := range localRef.FindAllIndex(f.Parameters, -1) {
			rest := f.Parameters[m[1]:]
			if !bytes.HasPrefix(rest, []byte("/$defs/")) && !bytes.HasPrefix(rest, []byte("/definitions/")) {
				return false
			}
		}
	}
	return true
}

// xmlCallGrammar is the GBNF of calls to tp's callable tools in the XML format.
func (s *Server) xmlCallGrammar(tp *toolPlan) (string, error) {
	var b strings.Builder
	var fns []string
	textRule := false
	tp.params = map[string][]toolParam{}
	for i, f := range tp.callable() {
		params, defs, err := toolParams(f.Parameters)
		if err != nil {
			return "", invalid("tools", "tools: %s: parameters: %v", f.Name, err)
		}
		tp.params[f.Name] = params
		fn := fmt.Sprintf("shoal-fn-%d", i)
		fns = append(fns, fn)
		var seq []string
		for k, p := range params {
			rule := fmt.Sprintf("%s-p%d", fn, k)
			value := rule + "-v"
			switch {
			case p.text && len(p.enum) > 0:
				lits := make([]string, len(p.enum))
				for j, e := range p.enum {
					lits[j] = engine.GBNFLiteral(e)
				}
				fmt.Fprintf(&b, "%s ::= %s\n", value, strings.Join(lits, " | "))
			case p.text:
				value, textRule = "shoal-text", true
			default:
				g, err := s.convertSchema("tools", mergeDefs(p.schema, defs))
				if err != nil {
					return "", s.refusedTool(tp, err)
				}
				b.WriteString(prefixRules(g, rule+"-"))
				b.WriteString("\n")
				value = rule + "-root"
			}
			fmt.Fprintf(&b, "%s ::= %s \"\\n\" %s %s \"\\n\"\n", rule, engine.GBNFLiteral("<parameter="+p.name+">"), value, engine.GBNFLiteral(paramEnd))
			if p.required {
				seq = append(seq, rule)
			} else {
				seq = append(seq, rule+"?")
			}
		}
		fmt.Fprintf(&b, "%s ::= %s \"\\n\" %s %s\n", fn, engine.GBNFLiteral("<function="+f.Name+">"), strings.Join(seq, " "), engine.GBNFLiteral("</function>"))
	}
	if textRule {
		b.WriteString(untilRules("shoal-text", paramEnd))
	}
	fmt.Fprintf(&b, "shoal-call ::= %s\n", strings.Join(fns, " | "))
	b.WriteString("root ::= shoal-block")
	if tp.parallel {
		b.WriteString(` ("\n"? "\n"? shoal-block)*`)
	}
	fmt.Fprintf(&b, "\nshoal-block ::= %s \"\\n\" shoal-call \"\\n\" %s\n", engine.GBNFLiteral(qwenXMLFormat.open), engine.GBNFLiteral(qwenXMLFormat.close))
	return b.String(), nil
}

// mergeDefs is a parameter's schema with the tool's definitions beside it, so
// that its references ("#/$defs/...", "#/definitions/...") resolve when it is
// converted alone. Its own definitions of the same names win.
func mergeDefs(schema json.RawMessage, defs map[string]json.RawMessage) json.RawMessage {
	var m map[string]json.RawMessage
	if len(defs) == 0 || json.Unmarshal(schema, &m) != nil || m == nil {
		return schema
	}
	rootRefUnderAllOf(m)
	for key, tool := range defs {
		var own, all map[string]json.RawMessage
		_ = json.Unmarshal(m[key], &own)
		if json.Unmarshal(tool, &all) != nil {
			continue
		}
		maps.Copy(all, own)
		m[key], _ = json.Marshal(all)
	}
	b, _ := json.Marshal(m)
	return b
}

// rootRefUnderAllOf moves a schema's root reference under allOf: llama.cpp's
// converter resolves a reference at the root, but not the references inside
// what it points to (they become any object); under allOf it resolves them all.
func rootRefUnderAllOf(m map[string]json.RawMessage) {
	if ref, ok := m["$ref"]; ok && m["allOf"] == nil {
		delete(m, "$ref")
		m["allOf"], _ = json.Marshal([]map[string]json.RawMessage{{"$ref": ref}})
	}
}

// untilRules defines name as any text that does not contain end: one rule per
// state of the automaton that looks for end (whose first byte occurs in it only
// there), each state the bytes of end matched so far.
func untilRules(name, end string) string {
	var b strings.Builder
	state := func(k int) string { return fmt.Sprintf("%s-%d", name, k) }
	class := func(excl ...byte) string {
		var c strings.Builder
		c.WriteString("[^")
		for _, x := range excl {
			if x == '\n' {
				c.WriteString(`\n`)
			} else {
				c.WriteByte(x)
			}
		}
		c.WriteString("]")
		return c.String()
	}
	first := engine.GBNFLiteral(end[:1])
	fmt.Fprintf(&b, "%s ::= %s\n", name, state(0))
	fmt.Fprintf(&b, "%s ::= | %s %s | %s %s\n", state(0), class(end[0]), state(0), first, state(1))
	for k := 1; k < len(end); k++ {
		fmt.Fprintf(&b, "%s ::= | %s %s | %s %s", state(k), first, state(1), class(end[k], end[0]), state(0))
		if k+1 < len(end) {
			fmt.Fprintf(&b, " | %s %s", engine.GBNFLiteral(end[k:k+1]), state(k+1))
		}
		b.WriteString("\n")
	}
	return b.String()
}

// parseXML reads calls in the XML format from text, which begins with its
// opening tag; params gives each tool's parameters, to tell strings (raw
// text) from other values (JSON). Cut short, the last call has the
// parameters written in full so far and whole is false.
func parseXML(text string, params map[string][]toolParam, newID func() string) (calls []ToolCall, after string, whole, ok bool) {
	f := &qwenXMLFormat
	rest := text
	for {
		t := strings.TrimLeft(rest, jsonSpace)
		body, found := strings.CutPrefix(t, f.open)
		if !found {
			if len(calls) > 0 && t != "" && strings.HasPrefix(f.open, t) {
				return calls, "", false, true
			}
			break
		}
		body = strings.TrimLeft(body, jsonSpace)
		name, body, found := cutTag(body, "<function=")
		if !found {
			if strings.HasPrefix("<function=", body) || name != "" || len(calls) > 0 {
				return calls, "", false, true // cut before the function's name ended
			}
			return nil, "", false, false
		}
		var args bytes.Buffer
		args.WriteByte('{')
		complete := false
		for {
			body = strings.TrimLeft(body, jsonSpace)
			if b, ok := strings.CutPrefix(body, "</function>"); ok {
				body, complete = b, true
				break
			}
			key, b, found := cutTag(body, "<parameter=")
			if !found {
				break // cut short
			}
			b = strings.TrimPrefix(b, "\n")
			i := strings.Index(b, paramEnd)
			if i < 0 {
				break // cut in the value
			}
			value := b[:i]
			body = b[i+len(paramEnd):]
			if args.Len() > 1 {
				args.WriteString(",")
			}
			args.Write(jsonText(key))
			args.WriteByte(':')
			args.Write(paramValue(value, params[name], key))
		}
		args.WriteByte('}')
		calls = append(calls, ToolCall{ID: newID(), Type: "function", Function: FunctionCall{Name: name, Arguments: args.String()}})
		tail := strings.TrimLeft(body, jsonSpace)
		rest = strings.TrimPrefix(tail, f.close)
		if !complete || len(rest) == len(tail) {
			return calls, "", false, true
		}
	}
	if len(calls) == 0 {
		return nil, "", false, false
	}
	return calls, strings.TrimSpace(rest), true, true
}

// cutTag reads "<tag=value>" at the start of s: the value and what follows.
// found is false when s does not hold the whole tag.
func cutTag(s, tag string) (value, rest string, found bool) {
	after, ok := strings.CutPrefix(s, tag)
	if !ok {
		return "", s, false
	}
	i := strings.IndexByte(after, '>')
	if i < 0 {
		return after, s, false
	}
	return after[:i], after[i+1:], true
}

// paramValue is a parameter's value as JSON: a string parameter's raw text as
// a string, any other value as the JSON it is (else as a string).
func paramValue(value string, params []toolParam, key string) []byte {
	for _, p := range params {
		if p.name == key && p.text {
			return jsonText(value)
		}
	}
	if v := strings.TrimSpace(value); v != "" && json.Valid([]byte(v)) {
		return compactJSON(json.RawMessage(v))
	}
	return jsonText(value)
}
