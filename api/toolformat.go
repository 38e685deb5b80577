package api

import (
	"encoding/json"
	"errors"
	"fmt"
	"regexp"
	"strings"

	"github.com/shoal-ai/shoal/engine"
	"github.com/shoal-ai/shoal/scheduler"
)

// A model whose chat template shows the tools itself was trained to call them
// in its own format. Then the tools go into the template, the model answers in
// its format, and a grammar holds each call to the offered tools' names and
// parameters: under tool_choice "auto" it is lazy, so that the model writes
// free text until it begins a call; under "required" or a named function the
// output must be calls from its first token.

// callFormat is a model's own way of writing tool calls: each call a JSON
// object {"name": ..., args: {...}}, either between an opening and a closing
// tag, with text before the first call, or bare: then the whole answer is one
// call. Mistral's formats open the calls with a tag and no closing one: a
// JSON list of calls follows it (list), or each call is the tag, the
// function's name, argsTag and the arguments.
type callFormat struct {
	name        string   // as logged
	args        string   // the arguments' key
	open, close string   // the tags around each call; "" for a bare call
	xml         *xmlTags // each call in XML within the tags (xmlcalls.go), not JSON
	list        bool     // the calls are one JSON list after open
	argsTag     string   // each call is open, name, argsTag, arguments
	callIDTag   string   // with argsTag: the model may write a call id after it, before argsTag
	// control: the tags are control tokens, which the output's text leaves
	// out unless asked (as vLLM does for Mistral's, the output keeps them).
	control bool
	// shortIDs: call ids are 9 letters and digits, the only ids the
	// template's history accepts.
	shortIDs bool
}

func (f *callFormat) bare() bool { return f.open == "" }

// hermesFormat is the format of Hermes, Qwen 2.5 and Qwen 3 and the many
// models tuned like them:
//
//	<tool_call>
//	{"name": "get_weather", "arguments": {"city": "Oslo"}}
//	</tool_call>
var hermesFormat = callFormat{name: "hermes", args: "arguments", open: "<tool_call>", close: "</tool_call>"}

// llama3Format is Llama 3.1, 3.2 and 3.3's JSON tool calls: the answer is one
// call, {"name": "get_weather", "parameters": {"city": "Oslo"}}.
var llama3Format = callFormat{name: "llama3", args: "parameters"}

// mistralFormat is the format of Mistral's models from tokenizer v11 on
// (Mistral Small 3.2, Magistral, Devstral, Ministral 3): each call is
//
//	[TOOL_CALLS]get_weather[ARGS]{"city": "Oslo"}
//
// with no space or tag between calls.
var mistralFormat = callFormat{name: "mistral", open: "[TOOL_CALLS]", argsTag: "[ARGS]", control: true, shortIDs: true}

// mistralIDFormat is mistralFormat where the template writes each earlier
// call's id after its name, [TOOL_CALLS]name[CALL_ID]id[ARGS]{...}: the
// model may write one too.
var mistralIDFormat = callFormat{name: "mistral", open: "[TOOL_CALLS]", argsTag: "[ARGS]", callIDTag: "[CALL_ID]", control: true, shortIDs: true}

// mistralListFormat is the format of Mistral's earlier models (Mistral 7B
// v0.3, Nemo, Small 3 and 3.1): one JSON list of calls,
//
//	[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Oslo"}}]
//
// each call possibly with the 9-character "id" the template writes in the
// history.
var mistralListFormat = callFormat{name: "mistral-list", args: "arguments", open: "[TOOL_CALLS]", list: true, control: true, shortIDs: true}

// detectCallFormat recognises the call format a template teaches its model;
// nil when it shows no tools, or writes calls in a format not supported here:
// the tool protocol is used for those.
func detectCallFormat(tmpl string) *callFormat {
	has := func(s string) bool { return strings.Contains(tmpl, s) }
	switch {
	case has("[TOOL_CALLS]") && has("[ARGS]") && has("[CALL_ID]"):
		return &mistralIDFormat
	case has("[TOOL_CALLS]") && has("[ARGS]"):
		return &mistralFormat
	case has("[TOOL_CALLS]"):
		return &mistralListFormat
	case has("<tool_call>") && has("<function=") && has("<parameter="):
		return &qwenXMLFormat
	case has("<tool_call>") && has("<arg_key>") && has("<arg_value>"):
		return &glmFormat
	case has("<tool_call>") && has(`"arguments"`) && !has("<function=") && !has("<arg_key>"):
		return &hermesFormat
	case has("<|start_header_id|>") && has(`"parameters"`) && has("tool_call"):
		return &llama3Format
	}
	return nil
}

// bareTrigger begins a bare format's call (Llama 3's JSON): at the start of
// the answer it makes the calls' lazy grammar hold.
const bareTrigger = `{"name"`

// callGrammar is the GBNF of tp's calls in its format, and the triggers that
// make it lazy when the model may also answer in text.
func (s *Server) callGrammar(tp *toolPlan) (gbnf string, triggers []engine.Trigger, err error) {
	f := tp.format
	if !tp.required {
		triggers = []engine.Trigger{{Text: f.open, Special: f.control}}
		if f.bare() {
			triggers = []engine.Trigger{{Text: bareTrigger, AtStart: true}}
		}
	}
	switch {
	case f.xml != nil:
		gbnf, err = s.xmlCallGrammar(tp)
		return gbnf, triggers, err
	case f.argsTag != "":
		gbnf, err = s.namedCallGrammar(tp)
		return gbnf, triggers, err
	}
	calls := tp.callSchemas("#/anyOf", f.args)
	if f.list {
		// The id Mistral's templates write after each earlier call's
		// arguments, which the model may write too.
		for _, c := range calls {
			m := c.(map[string]any)
			m["properties"] = append(m["properties"].(orderedProps), orderedProps{{"id", map[string]any{"type": "string", "pattern": "^[a-zA-Z0-9]{9}$"}}}...)
		}
	}
	schema, _ := json.Marshal(map[string]any{"anyOf": calls})
	call, err := s.convert(tp, schema)
	if err != nil {
		return "", nil, s.refusedTool(tp, err)
	}
	var b strings.Builder
	// The converter's rules, named apart from those added here.
	b.WriteString(prefixRules(call, "shoal-json-"))
	b.WriteString("\nshoal-call ::= shoal-json-root\n")
	switch {
	case f.list:
		fmt.Fprintf(&b, "\nroot ::= %s \" \"? \"[\" shoal-call", engine.GBNFLiteral(f.open))
		if tp.parallel {
			b.WriteString(` ("," " "? shoal-call)*`)
		}
		b.WriteString(` "]"` + "\n")
	case f.bare():
		b.WriteString("\nroot ::= shoal-call\n") // one call: Llama 3's templates refuse more
	default:
		b.WriteString("\nroot ::= shoal-block")
		if tp.parallel {
			b.WriteString(` ("\n"? "\n"? shoal-block)*`)
		}
		fmt.Fprintf(&b, "\nshoal-block ::= %s \"\\n\"? shoal-call \"\\n\"? %s\n", engine.GBNFLiteral(f.open), engine.GBNFLiteral(f.close))
	}
	return b.String(), triggers, nil
}

// namedCallGrammar is the GBNF of tp's calls in Mistral's format: the tag,
// the function's name, [ARGS] and its arguments, each tool's converted alone.
func (s *Server) namedCallGrammar(tp *toolPlan) (string, error) {
	f := tp.format
	var b strings.Builder
	var fns []string
	for i, fn := range tp.callable() {
		g, err := s.convert(tp, fn.Parameters)
		if err != nil {
			return "", s.refusedTool(tp, err)
		}
		rule := fmt.Sprintf("shoal-fn-%d-", i)
		b.WriteString(prefixRules(g, rule))
		b.WriteString("\n")
		id := ""
		if f.callIDTag != "" {
			id = " shoal-call-id?"
		}
		fns = append(fns, fmt.Sprintf("%s%s %s %sroot", engine.GBNFLiteral(fn.Name), id, engine.GBNFLiteral(f.argsTag), rule))
	}
	if f.callIDTag != "" {
		fmt.Fprintf(&b, "shoal-call-id ::= %s [a-zA-Z0-9]{9}\n", engine.GBNFLiteral(f.callIDTag))
	}
	fmt.Fprintf(&b, "shoal-call ::= %s (%s)\n", engine.GBNFLiteral(f.open), strings.Join(fns, " | "))
	b.WriteString("root ::= shoal-call")
	if tp.parallel {
		b.WriteString(" shoal-call*")
	}
	b.WriteString("\n")
	return b.String(), nil
}

// prefixRules puts prefix before the name of every rule gbnf defines, so that
// grammars converted one by one can be joined.
func prefixRules(gbnf, prefix string) string {
	defined := map[string]bool{}
	for _, line := range strings.Split(gbnf, "\n") {
		if name, _, ok := strings.Cut(line, " ::="); ok && !strings.ContainsAny(name, " \t\"[#") {
			defined[name] = true
		}
	}
	return renameRules(gbnf, func(name string) string {
		if defined[name] {
			return prefix + name
		}
		return name
	})
}

// renameRules maps every rule name in gbnf, defined or referred to, through
// rename, leaving string literals, character classes, token references
// (<[12]>, <think>) and comments as they are.
func renameRules(gbnf string, rename func(string) string) string {
	var out strings.Builder
	isName := func(c byte) bool {
		return c == '-' || c == '_' || c >= '0' && c <= '9' || c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z'
	}
	for i := 0; i < len(gbnf); {
		c := gbnf[i]
		switch {
		case c == '"' || c == '[' || c == '<':
			end := map[byte]byte{'"': '"', '[': ']', '<': '>'}[c]
			j := i + 1
			for j < len(gbnf) && gbnf[j] != end {
				if gbnf[j] == '\\' && c != '<' { // a token reference has no escapes
					j++
				}
				j++
			}
			j = min(j+1, len(gbnf))
			out.WriteString(gbnf[i:j])
			i = j
		case c == '#':
			j := strings.IndexByte(gbnf[i:], '\n')
			if j < 0 {
				j = len(gbnf) - i
			}
			out.WriteString(gbnf[i : i+j])
			i += j
		case isName(c):
			j := i
			for j < len(gbnf) && isName(gbnf[j]) {
				j++
			}
			out.WriteString(rename(gbnf[i:j]))
			i = j
		default:
			out.WriteByte(c)
			i++
		}
	}
	return out.String()
}

// callStream follows one choice's output in a model's own call format: text
// before the first call is passed on as it comes (holding back what may begin
// a call, and cut at a stop string), the calls are kept until the output is
// whole. Stop strings are matched in the text only, never inside a call.
type callStream struct {
	f      *callFormat
	params map[string][]toolParam // the XML format's: each tool's parameters
	stop   stopMatcher
	buf    strings.Builder
	sent   int  // bytes of buf passed on, or held as the start of the calls
	calls  bool // buf[sent:] begins the calls
	text   bool // a bare format's answer is text, not a call
	// lazy: the calls' grammar holds only once triggered (tool_choice auto).
	// A bare format's answer that did not trigger it (another spelling of a
	// call, as {"type": "function", "name": ...}) is unchecked: read as a
	// call only if it calls an offered tool (offered), else as text, and not
	// streamed until then.
	lazy, unchecked bool
	offered         map[string]bool
	partial         bool // end: the last call was cut short
	ids             callIDs
	tail            argsTail
	xmlTail         valueTail
}

func (c *callStream) follow(st *scheduler.Stream, ev scheduler.Event) string {
	return c.stop.follow(c.add, st, ev)
}

// add takes the next piece of output and returns the text to pass on.
func (c *callStream) add(piece string) string {
	if c.stop.stopped {
		return ""
	}
	c.buf.WriteString(piece)
	text := c.next()
	// Once the calls begin, the text before them is whole: what was held as
	// the possible start of a stop string goes out before the calls.
	return c.stop.cut(text, c.calls)
}

// next moves on past the text that can be passed on and returns it.
func (c *callStream) next() string {
	if c.calls {
		return ""
	}
	s := c.buf.String()
	if c.f.bare() && !c.text {
		// One call or text: decided by the answer's first character; under a
		// lazy grammar, one that did not begin with its trigger (after any
		// spaces, as the engine matches it) is unchecked.
		switch t := strings.TrimLeft(s, jsonSpace); {
		case c.lazy && strings.HasPrefix(t, bareTrigger):
			c.calls = true
			return ""
		case c.lazy && strings.HasPrefix(bareTrigger, t):
			return "" // undecided yet
		case t == "":
			return ""
		case t[0] == '{':
			c.calls, c.unchecked = true, c.lazy
			return ""
		}
		c.text = true
	}
	if c.text {
		text := s[c.sent:]
		c.sent = len(s)
		return text
	}
	if i := strings.Index(s[c.sent:], c.f.open); i >= 0 {
		text := s[c.sent : c.sent+i]
		c.sent += i
		c.calls = true
		return text
	}
	keep := len(s) - c.sent
	for keep > 0 && !strings.HasPrefix(c.f.open, s[len(s)-keep:]) {
		keep--
	}
	text := s[c.sent : len(s)-keep]
	c.sent = len(s) - keep
	return text
}

func (c *callStream) end(newID func() string) (string, []ToolCall) {
	if c.stop.stopped {
		return "", nil // what followed the stop string is not the answer's
	}
	rest := c.buf.String()[c.sent:]
	if !c.calls {
		if len(rest) > 1 && c.f.open != "" && strings.HasPrefix(c.f.open, rest) {
			c.partial = true
			return c.stop.cut("", true), nil // a call cut in its opening tag
		}
		return c.stop.cut(rest, true), nil
	}
	calls, after, whole, ok := c.parse(rest, newID)
	if ok && c.lazy && c.f.bare() {
		// Held to the tools only if the grammar held it (not after thoughts,
		// nor an unchecked spelling): a call of another name is text.
		for _, call := range calls {
			ok = ok && c.offered[call.Function.Name]
		}
	}
	if !ok {
		return c.stop.cut(rest, true), nil // not calls after all: nothing generated is lost
	}
	c.partial = !whole
	return c.stop.cut(after, true), calls
}

// progress returns the calls written so far, each with the part of its
// arguments that the whole answer's begin with (calldeltas.go).
func (c *callStream) progress(newID func() string) []ToolCall {
	if !c.calls || c.unchecked || c.stop.stopped {
		return nil
	}
	text := c.buf.String()[c.sent:]
	if c.f.xml != nil {
		return c.xmlTail.follow(text, c.f.xml.valueClose, func(text string) ([]ToolCall, string) {
			calls, _, _, ok, open, raw := readXML(text, c.f, c.params, c.ids.reader(c.idGen(newID)))
			if n := len(calls); ok && n > 0 {
				// Parameters may follow the last one written, and the one
				// being written streams if it is a string.
				args := strings.TrimSuffix(calls[n-1].Function.Arguments, "}")
				if open {
					args = strings.TrimSuffix(args, `"`) // the string goes on
				}
				calls[n-1].Function.Arguments = args
			}
			return calls, raw
		})
	}
	return c.tail.follow(text, func(text string) []ToolCall {
		calls, _, _, _ := c.parseRaw(text, newID)
		return calls
	})
}

// parse reads the calls that text, the output from the first call's tag on,
// holds so far, their ids the same at each reading, each cut short with the
// part of its arguments that stays (stableJSON).
func (c *callStream) parse(text string, newID func() string) (calls []ToolCall, after string, whole, ok bool) {
	calls, after, whole, ok = c.parseRaw(text, newID)
	if c.f.xml == nil {
		stableArgs(calls)
	}
	return calls, after, whole, ok
}

// idGen makes the format's call ids from newID's.
func (c *callStream) idGen(newID func() string) func() string {
	if c.f.shortIDs {
		return func() string { return shortID(newID()) }
	}
	return newID
}

// parseRaw is parse with the arguments as written.
func (c *callStream) parseRaw(text string, newID func() string) (calls []ToolCall, after string, whole, ok bool) {
	id := c.ids.reader(c.idGen(newID))
	switch {
	case c.f.xml != nil:
		return parseXML(text, c.f, c.params, id)
	case c.f.list:
		calls, after, whole, ok = parseList(text, c.f, id)
	case c.f.argsTag != "":
		calls, after, whole, ok = parseNamed(text, c.f, id)
	case c.f.bare():
		calls, after, whole, ok = parseBare(text, c.f, id)
	default:
		calls, after, whole, ok = parseTagged(text, c.f, id)
	}
	return calls, after, whole, ok
}

// finishReason is tool_calls for calls ended in full.
func (c *callStream) finishReason(generated string, calls []ToolCall) string {
	switch {
	case len(calls) > 0 && !c.partial && generated != "length":
		return "tool_calls" // also when a stop string came in text after them
	case c.stop.stopped:
		return "stop"
	}
	return generated
}

func (c *callStream) stopString() string { return c.stop.matched }

// openCall reads the opening tag of the next call in rest, after spaces:
// body is the text after it. cut: after earlier calls, rest is only the
// start of the tag (the output was cut short in it).
func (f *callFormat) openCall(rest string, earlier bool) (body string, found, cut bool) {
	t := strings.TrimLeft(rest, jsonSpace)
	body, found = strings.CutPrefix(t, f.open)
	return body, found, !found && earlier && t != "" && strings.HasPrefix(f.open, t)
}

// callsEnded is what a parser returns when no call follows its calls: rest
// is the text after them, and not even one call is not calls.
func callsEnded(calls []ToolCall, rest string) (_ []ToolCall, after string, whole, ok bool) {
	if len(calls) == 0 {
		return nil, "", false, false
	}
	return calls, strings.TrimSpace(rest), true, true
}

// parseTagged reads calls in format f from text, which begins with f.open.
// A call cut short (by max_tokens) is returned with the arguments generated so
// far, as OpenAI returns one, and whole is false. after is the text after the
// last call; ok is false when not even one call could be read.
func parseTagged(text string, f *callFormat, newID func() string) (calls []ToolCall, after string, whole, ok bool) {
	rest := text
	for {
		body, found, cut := f.openCall(rest, len(calls) > 0)
		if cut {
			return calls, "", false, true // cut in the next call's opening tag
		}
		if !found {
			break
		}
		body = strings.TrimLeft(body, jsonSpace)
		call, n, complete, cut := readCall(body, f, newID)
		switch {
		case call == nil && (len(calls) > 0 || cut || body == ""):
			// After a call only calls follow (the grammar holds them): this is
			// the next one, cut before its name; so is an object cut short.
			return calls, "", false, true
		case call == nil:
			return nil, "", false, false
		}
		calls = append(calls, *call)
		if !complete {
			return calls, "", false, true
		}
		tail := strings.TrimLeft(body[n:], jsonSpace)
		rest = strings.TrimPrefix(tail, f.close)
		if len(rest) == len(tail) { // cut before the closing tag
			return calls, "", false, true
		}
	}
	return callsEnded(calls, rest)
}

// parseBare reads a bare format's one call from text.
func parseBare(text string, f *callFormat, newID func() string) (calls []ToolCall, after string, whole, ok bool) {
	body := strings.TrimLeft(text, jsonSpace)
	call, n, complete, cut := readCall(body, f, newID)
	switch {
	case call == nil && cut:
		return nil, "", false, true // cut before its name
	case call == nil:
		return nil, "", false, false
	}
	return []ToolCall{*call}, strings.TrimSpace(body[n:]), complete, true
}

const jsonSpace = " \t\r\n"

// readCall reads the call that body begins with, and n, the bytes it took.
// Cut short, the call holds what was generated of it (its name, and its
// arguments so far, as OpenAI returns a cut call) and whole is false; cut
// before its name, call is nil and cut true. call is nil and cut false when
// body does not begin with a call.
func readCall(body string, f *callFormat, newID func() string) (call *ToolCall, n int, whole, cut bool) {
	dec := json.NewDecoder(strings.NewReader(body))
	var obj map[string]json.RawMessage
	var name string
	if err := dec.Decode(&obj); err == nil && json.Unmarshal(obj["name"], &name) == nil && name != "" {
		args := compactJSON(obj[f.args])
		if len(args) == 0 || string(args) == "null" {
			args = json.RawMessage("{}")
		}
		return &ToolCall{ID: newID(), Type: "function", Function: FunctionCall{Name: name, Arguments: string(args)}}, int(dec.InputOffset()), true, false
	}
	if !cutCallStart(body) {
		return nil, 0, false, false
	}
	var args string
	if m := cutCallIn(f.args).FindStringSubmatch(body); m != nil {
		name, args = m[1], strings.TrimLeft(m[2], jsonSpace) // spaces at the end may be in a string
	} else if m := cutName.FindStringSubmatch(body); m != nil {
		name = m[1]
	} else {
		return nil, 0, false, true
	}
	if json.Unmarshal([]byte(name), &name) != nil {
		return nil, 0, false, true
	}
	return &ToolCall{ID: newID(), Type: "function", Function: FunctionCall{Name: name, Arguments: args}}, len(body), false, true
}

// cutName matches a call cut short after its name.
var cutName = regexp.MustCompile(`^[ \t\n\r]*\{[ \t\n\r]*"name"[ \t\n\r]*:[ \t\n\r]*("(?:[^"\\]|\\.)*")`)

// cutCallStart reports whether s is a call cut short: a JSON object whose first
// key is (or may yet be) "name", valid as far as it goes, and not closed.
func cutCallStart(s string) bool {
	t := strings.TrimLeft(s, jsonSpace)
	if t == "" || t[0] != '{' {
		return false
	}
	switch key := strings.TrimLeft(t[1:], jsonSpace); {
	case strings.HasPrefix(`"name"`, key):
		return true // cut in or before the first key
	case !strings.HasPrefix(key, `"name"`):
		return false
	}
	dec := json.NewDecoder(strings.NewReader(t))
	depth := 0
	for {
		tok, err := dec.Token()
		switch {
		case err != nil:
			var se *json.SyntaxError
			return depth > 0 && !errors.As(err, &se)
		case tok == json.Delim('{') || tok == json.Delim('['):
			depth++
		case tok == json.Delim('}') || tok == json.Delim(']'):
			if depth--; depth == 0 {
				return false // closed: whole, and not a call
			}
		}
	}
}
