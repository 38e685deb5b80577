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
var qwenXMLFormat = callFormat{name: "qwen3-coder", open: "<tool_call>", close: "</tool_call>", xml: &qwenTags}

// glmFormat is the XML call format of GLM 4.5 to 4.7 (vLLM's glm45 parser):
// the function's name first, then each parameter as a key and a value tag.
//
//	<tool_call>get_weather
//	<arg_key>city</arg_key>
//	<arg_value>Oslo</arg_value>
//	</tool_call>
var glmFormat = callFormat{name: "glm", open: "<tool_call>", close: "</tool_call>", xml: &glmTags}

// xmlTags are the tags of an XML call format within its call tags: the
// function's name, its parameters' names and their values.
type xmlTags struct {
	fnOpen, fnName string // the name is after fnOpen, up to fnName
	fnClose        string // after the parameters ("" for none)
	keyOpen        string // a parameter's name is after keyOpen, up to keyClose
	keyClose       string
	valueOpen      string // its value is after valueOpen, up to valueClose
	valueClose     string
	// The grammar's: the space after the name and after each parameter,
	// and within the call tags.
	gap, inner string
}

var (
	qwenTags = xmlTags{fnOpen: "<function=", fnName: ">", fnClose: "</function>", keyOpen: "<parameter=", keyClose: ">",
		valueOpen: "\n", valueClose: "\n</parameter>", gap: `"\n"`, inner: `"\n"`}
	glmTags = xmlTags{fnName: "\n", keyOpen: "<arg_key>", keyClose: "</arg_key>", valueOpen: "<arg_value>", valueClose: "</arg_value>",
		gap: `"\n"?`}
)

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

// xmlCallGrammar is the GBNF of calls to tp's callable tools in its XML format.
func (s *Server) xmlCallGrammar(tp *toolPlan) (string, error) {
	x := tp.format.xml
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
				g, err := s.convert(tp, mergeDefs(p.schema, defs))
				if err != nil {
					return "", s.refusedTool(tp, err)
				}
				b.WriteString(prefixRules(g, rule+"-"))
				b.WriteString("\n")
				value = rule + "-root"
			}
			fmt.Fprintf(&b, "%s ::= %s %s %s %s\n", rule, x.gbnf(x.keyOpen+p.name+x.keyClose, x.valueOpen), value, engine.GBNFLiteral(x.valueClose), x.gap)
			if p.required {
				seq = append(seq, rule)
			} else {
				seq = append(seq, rule+"?")
			}
		}
		fmt.Fprintf(&b, "%s ::= %s %s %s", fn, engine.GBNFLiteral(x.fnOpen+f.Name+strings.TrimSuffix(x.fnName, "\n")), x.gap, strings.Join(seq, " "))
		if x.fnClose != "" {
			fmt.Fprintf(&b, " %s", engine.GBNFLiteral(x.fnClose))
		}
		b.WriteString("\n")
	}
	if textRule {
		b.WriteString(untilRules("shoal-text", x.valueClose))
	}
	fmt.Fprintf(&b, "shoal-call ::= %s\n", strings.Join(fns, " | "))
	b.WriteString("root ::= shoal-block")
	if tp.parallel {
		b.WriteString(` ("\n"? "\n"? shoal-block)*`)
	}
	block := []string{engine.GBNFLiteral(tp.format.open), x.inner, "shoal-call", x.inner, engine.GBNFLiteral(tp.format.close)}
	fmt.Fprintf(&b, "\nshoal-block ::= %s\n", strings.Join(slices.DeleteFunc(block, func(s string) bool { return s == "" }), " "))
	return b.String(), nil
}

// gbnf is the GBNF of a parameter's head: its name's tags, then the value's
// opening, a newline alone written as the gap between tags.
func (x *xmlTags) gbnf(key, valueOpen string) string {
	if valueOpen == "\n" {
		return engine.GBNFLiteral(key) + ` "\n"`
	}
	return engine.GBNFLiteral(key) + " " + x.gap + " " + engine.GBNFLiteral(valueOpen)
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
			switch x {
			case '\n':
				c.WriteString(`\n`)
			case ']', '[', '\\', '^', '-':
				fmt.Fprintf(&c, `\x%02X`, x) // else "[^][]" would close at the first "]"
			default:
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
// parameters written in full so far, and of a string cut short what was
// written, and whole is false.
func parseXML(text string, f *callFormat, params map[string][]toolParam, newID func() string) (calls []ToolCall, after string, whole, ok bool) {
	calls, after, whole, ok, _, _ = readXML(text, f, params, newID)
	return calls, after, whole, ok
}

// readXML is parseXML, and open when text ends within a string parameter's
// value: the last call's arguments then end with it as written so far (less
// an end that may begin the value's closing tag), closed, and raw is the
// value's text (the end of text). A string streams as it is written (a file a
// coding model writes is one).
func readXML(text string, f *callFormat, params map[string][]toolParam, newID func() string) (calls []ToolCall, after string, whole, ok, open bool, raw string) {
	x := f.xml
	rest := text
	for {
		body, found, cut := f.openCall(rest, len(calls) > 0)
		if cut {
			return calls, "", false, true, false, "" // cut in the next call's opening tag
		}
		if !found {
			break
		}
		body = strings.TrimLeft(body, jsonSpace)
		name, body, found := cutTag(body, x.fnOpen, x.fnName)
		if i := strings.IndexByte(name, '<'); x.fnName == "\n" && i >= 0 {
			// GLM 4.7 writes the first parameter (or the call's end) right
			// after the name.
			rest := name[i:]
			if found {
				rest += "\n" + body
			}
			name, body, found = name[:i], rest, true
		}
		switch {
		case found && name != "" && strings.IndexFunc(name, func(r rune) bool { return !isNameChar(r) }) < 0:
		case len(calls) > 0, !found && !strings.ContainsAny(name, "<>") && (name != "" || strings.HasPrefix(x.fnOpen, body)):
			return calls, "", false, true, false, "" // cut before the function's name ended
		default:
			return nil, "", false, false, false, ""
		}
		var args bytes.Buffer
		args.WriteByte('{')
		complete := false
		for {
			body = strings.TrimLeft(body, jsonSpace)
			end := x.fnClose
			if end == "" {
				end = f.close // the call's end is the function's
			}
			if b, ok := strings.CutPrefix(body, end); ok {
				body, complete = b, true
				if x.fnClose == "" {
					body = end + body
				}
				break
			}
			key, b, found := cutTag(body, x.keyOpen, x.keyClose)
			if !found {
				break // cut short
			}
			if x.valueOpen == "\n" {
				b = strings.TrimPrefix(b, "\n")
			} else if b, found = strings.CutPrefix(strings.TrimLeft(b, jsonSpace), x.valueOpen); !found {
				break // cut before the value
			}
			var value []byte
			i := strings.Index(b, x.valueClose)
			switch {
			case i >= 0:
				value, body = paramValue(b[:i], params[name], key), b[i+len(x.valueClose):]
			case textParam(params[name], key):
				// Cut in the value: a string has what was written of it.
				open, raw = true, b
				value = jsonText(b[:wholeRunes(b[:len(b)-holdBack(b, x.valueClose)])])
			}
			if value != nil {
				if args.Len() > 1 {
					args.WriteString(",")
				}
				args.Write(jsonText(key))
				args.WriteByte(':')
				args.Write(value)
			}
			if i < 0 {
				break // cut in the value
			}
		}
		args.WriteByte('}')
		calls = append(calls, ToolCall{ID: newID(), Type: "function", Function: FunctionCall{Name: name, Arguments: args.String()}})
		tail := strings.TrimLeft(body, jsonSpace)
		rest = strings.TrimPrefix(tail, f.close)
		if !complete || len(rest) == len(tail) {
			return calls, "", false, true, open, raw
		}
	}
	calls, after, whole, ok = callsEnded(calls, rest)
	return calls, after, whole, ok, false, ""
}

// cutTag reads open, a value and end ("<parameter=" key ">") at the start
// of s: the value and what follows. found is false when s does not hold them
// whole.
func cutTag(s, open, end string) (value, rest string, found bool) {
	after, ok := strings.CutPrefix(s, open)
	if !ok {
		return "", s, false
	}
	i := strings.Index(after, end)
	if i < 0 {
		return after, s, false
	}
	return after[:i], after[i+len(end):], true
}

// textParam reports whether key is a string parameter, written as raw text.
func textParam(params []toolParam, key string) bool {
	for _, p := range params {
		if p.name == key {
			return p.text
		}
	}
	return false
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
