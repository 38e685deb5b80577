package api

import (
	"encoding/json"
	"hash/fnv"
	"regexp"
	"strings"
)

// Mistral's call formats (mistralFormat, mistralListFormat): the tags are
// control tokens, and the templates want call ids of 9 letters and digits.

// parseList reads calls in Mistral's list format from text, which begins
// with its tag: [TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]. Cut
// short, the calls read so far are returned, the last with the arguments
// generated so far, and whole is false.
func parseList(text string, f *callFormat, newID func() string) (calls []ToolCall, after string, whole, ok bool) {
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
		switch {
		case body == "":
			return calls, "", false, true // cut after the tag
		case body[0] != '[':
			return callsEnded(calls, rest)
		}
		body = body[1:]
		for {
			body = strings.TrimLeft(body, jsonSpace)
			call, n, complete, cut := readCall(body, f, newID)
			switch {
			case call == nil && (cut || body == ""):
				return calls, "", false, true // cut before the call's name
			case call == nil:
				return callsEnded(calls, body)
			}
			calls = append(calls, *call)
			if !complete {
				return calls, "", false, true // (cut in its id, its arguments are whole: stableJSON)
			}
			body = strings.TrimLeft(body[n:], jsonSpace)
			if body == "" {
				return calls, "", false, true // cut before the list's end
			}
			if body[0] == ',' {
				body = body[1:]
				continue
			}
			if body[0] == ']' {
				body = body[1:]
			}
			break
		}
		rest = body
	}
	return callsEnded(calls, rest)
}

// parseNamed reads calls in Mistral's format from text, which begins with its
// tag: [TOOL_CALLS]name[ARGS]{...}, one after another. Cut short, the calls
// read so far are returned, the last with the arguments generated so far, and
// whole is false.
func parseNamed(text string, f *callFormat, newID func() string) (calls []ToolCall, after string, whole, ok bool) {
	rest := text
	for {
		body, found, cut := f.openCall(rest, len(calls) > 0)
		if cut {
			return calls, "", false, true // cut in the next call's opening tag
		}
		if !found {
			break
		}
		name, args, state := namedHead(body, f)
		switch state {
		case headCut:
			return calls, "", false, true // cut before its arguments
		case headInvalid:
			return callsEnded(calls, rest)
		}
		dec := json.NewDecoder(strings.NewReader(args))
		var raw json.RawMessage
		if err := dec.Decode(&raw); err != nil {
			// Cut in its arguments: those generated so far, as OpenAI returns
			// a cut call.
			calls = append(calls, ToolCall{ID: newID(), Type: "function", Function: FunctionCall{Name: name, Arguments: strings.TrimLeft(args, jsonSpace)}})
			return calls, "", false, true
		}
		a := compactJSON(raw)
		if string(a) == "null" {
			a = json.RawMessage("{}")
		}
		calls = append(calls, ToolCall{ID: newID(), Type: "function", Function: FunctionCall{Name: name, Arguments: string(a)}})
		rest = args[dec.InputOffset():]
	}
	return callsEnded(calls, rest)
}

// The states of a call's head in Mistral's format.
const (
	headWhole   = iota // the name, any call id, and the arguments' tag
	headCut            // cut short before the arguments
	headInvalid        // not a call's head
)

// namedHead reads a call's head in Mistral's format: the function's name, a
// call id after callIDTag if the format has one, and argsTag; args is the
// text after it.
func namedHead(body string, f *callFormat) (name, args string, state int) {
	n := strings.IndexFunc(body, func(r rune) bool { return !isNameChar(r) })
	if n < 0 {
		return "", "", headCut // cut in the name
	}
	name, rest := body[:n], body[n:]
	if name == "" {
		return "", "", headInvalid
	}
	if f.callIDTag != "" {
		if id, ok := strings.CutPrefix(rest, f.callIDTag); ok {
			k := strings.IndexFunc(id, func(r rune) bool { return !strings.ContainsRune(shortIDChars, r) })
			if k < 0 {
				return "", "", headCut // cut in the id
			}
			rest = id[k:]
		} else if strings.HasPrefix(f.callIDTag, rest) {
			return "", "", headCut // cut in the id's tag
		}
	}
	if args, ok := strings.CutPrefix(rest, f.argsTag); ok {
		return name, args, headWhole
	}
	if strings.HasPrefix(f.argsTag, rest) {
		return "", "", headCut // cut in the arguments' tag
	}
	return "", "", headInvalid
}

// isNameChar reports whether r may be part of a tool's name (toolName).
func isNameChar(r rune) bool {
	return r == '_' || r == '.' || r == '-' || r >= '0' && r <= '9' || r >= 'a' && r <= 'z' || r >= 'A' && r <= 'Z'
}

// shortIDChars are the characters of a short call id.
const shortIDChars = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789"

// shortIDPattern matches the call ids Mistral's templates accept.
var shortIDPattern = regexp.MustCompile(`^[a-zA-Z0-9]{9}$`)

// shortID is a call id of 9 letters and digits standing for id: id itself
// when it is one, else drawn from its hash, so that a call and its result,
// which carry the same id, map to the same short one.
func shortID(id string) string {
	if shortIDPattern.MatchString(id) {
		return id
	}
	h := fnv.New64a()
	h.Write([]byte(id))
	v := h.Sum64()
	var b [9]byte
	for i := range b {
		b[i] = shortIDChars[v%uint64(len(shortIDChars))]
		v /= uint64(len(shortIDChars))
	}
	return string(b[:])
}
