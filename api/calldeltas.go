package api

import (
	"encoding/json"
	"strings"
	"unicode/utf8"
)

// Tool calls are streamed as they are written, as vLLM and llama-server
// stream them: each call's id and name once its name is whole, then its
// arguments as they grow. What is passed on of a call's arguments is always
// the start of those the whole answer gives it, so that a client that joins
// the deltas gets the same calls as one that waits for them.

// callIDs gives the calls of one output their ids, the same each time the
// output is read again.
type callIDs struct {
	ids  []string
	next int
}

// reader returns the ids in order for one reading of the output, making new
// ones with gen past those made before.
func (c *callIDs) reader(gen func() string) func() string {
	c.next = 0
	return func() string {
		if c.next == len(c.ids) {
			c.ids = append(c.ids, gen())
		}
		c.next++
		return c.ids[c.next-1]
	}
}

// stableJSON is the part of a call's JSON arguments written so far that its
// whole arguments begin with: all of them, compacted, once they are a whole
// JSON value ("{}" for null); else their text so far without the spaces
// between tokens (a string's stay), which compacting the whole keeps as the
// start.
func stableJSON(args string) string {
	dec := json.NewDecoder(strings.NewReader(args))
	var v json.RawMessage
	if dec.Decode(&v) == nil {
		if c := compactJSON(v); string(c) != "null" {
			return string(c)
		}
		return "{}"
	}
	var j jsonCompactor
	j.feed(args)
	s := j.out.String()
	if strings.HasPrefix("null", s) {
		return "" // may yet be null, whose arguments are {}
	}
	return s
}

// argsTail makes following calls as they are written cost what the output
// adds, not a reading of all of it per token: between full readings, while
// the last call's arguments are an open JSON object or list running to the
// output's end, only the new bytes are compacted (as stableJSON would), until
// the value closes and the calls are read again.
type argsTail struct {
	calls   []ToolCall // the last reading's, the last call's arguments open
	scanned int        // the bytes of the output compacted into comp
	comp    *jsonCompactor
}

// follow returns the calls that text holds, each with the part of its
// arguments that stays (stableJSON); read reads them with their arguments
// as written.
func (t *argsTail) follow(text string, read func(string) []ToolCall) []ToolCall {
	if t.calls != nil && len(text) >= t.scanned {
		t.comp.feed(text[t.scanned:])
		t.scanned = len(text)
		if !t.comp.closed && !t.comp.bad {
			calls := append([]ToolCall(nil), t.calls...)
			calls[len(calls)-1].Function.Arguments = t.comp.out.String() // no copy
			return calls
		}
	}
	t.calls = nil
	calls := read(text)
	if n := len(calls); n > 0 {
		raw := calls[n-1].Function.Arguments
		comp := &jsonCompactor{}
		comp.feed(raw)
		if !comp.closed && !comp.bad && comp.depth > 0 && strings.HasSuffix(text, raw) {
			t.calls, t.scanned, t.comp = calls, len(text), comp
		}
	}
	return stableArgs(calls)
}

// stableArgs gives each of calls the part of its arguments that stays
// (stableJSON), and returns them.
func stableArgs(calls []ToolCall) []ToolCall {
	for i := range calls {
		calls[i].Function.Arguments = stableJSON(calls[i].Function.Arguments)
	}
	return calls
}

// valueTail is argsTail for the XML formats: while the last call's last
// parameter is a string being written to the output's end, only its new
// bytes are escaped, until its closing tag comes and the calls are read
// again.
type valueTail struct {
	calls []ToolCall       // the last reading's, the last call's arguments ending in the open string
	args  *strings.Builder // those arguments up to the string's text, then its text escaped
	from  int              // where its text begins in the output
	done  int              // the bytes of its text escaped
}

// follow returns the calls that text holds as read returns them; read also
// returns the text of the string parameter the output ends in, if it does.
func (t *valueTail) follow(text, end string, read func(string) ([]ToolCall, string)) []ToolCall {
	if t.calls != nil && len(text) >= t.from+t.done {
		raw := text[t.from:]
		if !strings.Contains(raw[t.done:], end) {
			t.escape(raw, end)
			calls := append([]ToolCall(nil), t.calls...)
			calls[len(calls)-1].Function.Arguments = t.args.String() // no copy
			return calls
		}
	}
	t.calls = nil
	calls, raw := read(text)
	if n := len(calls); n > 0 && raw != "" {
		t.from, t.done, t.args = len(text)-len(raw), 0, &strings.Builder{}
		t.escape(raw, end)
		args, esc := calls[n-1].Function.Arguments, t.args.String()
		if strings.HasSuffix(args, esc) {
			t.args.Reset()
			t.args.WriteString(args)
			t.calls = calls
		}
	}
	return calls
}

// escape escapes raw's new bytes into args, less an end that may begin the
// value's closing tag or an unfinished character.
func (t *valueTail) escape(raw, end string) {
	if upto := wholeRunes(raw[:len(raw)-holdBack(raw, end)]); upto > t.done {
		q := jsonText(raw[t.done:upto])
		t.args.Write(q[1 : len(q)-1])
		t.done = upto
	}
}

// wholeRunes is the length of s up to the end of its last whole UTF-8
// character (the output's pieces are whole characters; its bytes need not
// be).
func wholeRunes(s string) int {
	for i := len(s) - 1; i >= 0 && i >= len(s)-utf8.UTFMax; i-- {
		if utf8.RuneStart(s[i]) {
			if !utf8.FullRuneInString(s[i:]) {
				return i
			}
			break
		}
	}
	return len(s)
}

// jsonCompactor compacts JSON text fed in pieces, leaving out the spaces
// between tokens (a string's stay), and follows its nesting: closed once the
// object or list it began with closes; bad when it begins with anything else
// (a scalar, which argsTail reads whole each time: they are short).
type jsonCompactor struct {
	out                       strings.Builder
	depth                     int
	inString, escape, started bool
	closed, bad               bool
}

func (j *jsonCompactor) feed(s string) {
	for i := 0; i < len(s); i++ {
		c := s[i]
		if j.inString {
			switch {
			case j.escape:
				j.escape = false
			case c == '\\':
				j.escape = true
			case c == '"':
				j.inString = false
			}
			j.out.WriteByte(c)
			continue
		}
		if c == ' ' || c == '\t' || c == '\n' || c == '\r' {
			continue
		}
		if !j.started {
			j.started, j.bad = true, c != '{' && c != '['
		}
		switch c {
		case '"':
			j.inString = true
		case '{', '[':
			j.depth++
		case '}', ']':
			if j.depth--; j.depth == 0 {
				j.closed = true
			}
		}
		j.out.WriteByte(c)
	}
}

// callDeltas follows what has been passed on of one choice's calls.
type callDeltas struct {
	sent []string // each call's arguments passed on
}

// next returns the deltas that bring what was passed on up to calls: a new
// call's id, type and name (with its arguments so far), then what each
// call's arguments gained. A call whose arguments no longer begin with what
// was passed on (which the parsers never give) gets nothing more.
func (d *callDeltas) next(calls []ToolCall) []ToolCallDelta {
	var out []ToolCallDelta
	for i, c := range calls {
		if i == len(d.sent) {
			d.sent = append(d.sent, c.Function.Arguments)
			out = append(out, ToolCallDelta{Index: i, ID: c.ID, Type: "function", Function: FunctionCallDelta{Name: c.Function.Name, Arguments: c.Function.Arguments}})
			continue
		}
		more, ok := strings.CutPrefix(c.Function.Arguments, d.sent[i])
		if !ok || more == "" {
			continue
		}
		d.sent[i] = c.Function.Arguments
		out = append(out, ToolCallDelta{Index: i, Function: FunctionCallDelta{Arguments: more}})
	}
	return out
}
