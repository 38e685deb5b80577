package api

import (
	"fmt"
	"strings"

	"github.com/shoal-ai/shoal/engine"
	"github.com/shoal-ai/shoal/scheduler"
)

// Reasoning models (Qwen 3, QwQ, DeepSeek R1 and their distillations) think
// between <think> and </think> before they answer. As llama-server's
// --reasoning-format and vLLM's reasoning parsers do, the thoughts come back
// apart from the answer, as reasoning_content (streamed as reasoning_content
// deltas), and the answer as content. A model is taken to think this way when
// its chat template writes </think>. Magistral and Ministral 3 think between
// [THINK] and [/THINK], control tokens, which the output then keeps as text.
//
// The thoughts begin where the output begins with <think>, or at once when the
// prompt itself ends in an open <think> (DeepSeek R1's and Qwen 3.5's templates
// open it). They end at </think>, or where a call in the model's own tagged
// format begins: Qwen 3 sometimes opens <tool_call> without closing its
// thoughts, and the call is taken as a call (as Ollama and Transformers do).

// thinkTags are the tags a model's thoughts sit between.
type thinkTags struct {
	open, close string
	// control: the tags are control tokens (Magistral's), which the output's
	// text leaves out unless asked: it keeps them, to be read.
	control bool
}

var (
	xmlThink = thinkTags{open: "<think>", close: "</think>"}
	// mistralThink is Magistral's and Ministral 3's: [THINK]...[/THINK].
	mistralThink = thinkTags{open: "[THINK]", close: "[/THINK]", control: true}
)

// thinkTagsOf are the tags of a model that reasons first, nil for one that
// does not: its chat template writes the closing tag.
func thinkTagsOf(templates ...string) *thinkTags {
	for _, tags := range []*thinkTags{&xmlThink, &mistralThink} {
		for _, t := range templates {
			if strings.Contains(t, tags.close) {
				return tags
			}
		}
	}
	return nil
}

// ReasoningFormats are the values of Config.ReasoningFormat: "auto" separates
// the thoughts of models whose template writes </think>, "none" leaves them
// in content.
var ReasoningFormats = []string{"auto", "none"}

// thinkPlan says how a request's choices separate their thoughts.
type thinkPlan struct {
	open bool      // the prompt ends in an open <think>
	call string    // the tag that begins a call in the model's own format, if any
	tags thinkTags // the model's: <think> and </think>, or another pair
}

// thinkingPlan is the plan for a chat prompt of b's, nil when thoughts are not
// separated. A grammar that holds the output from its first token (the tool
// protocol, a required call, response_format) is made to let the thoughts
// come first, as llama-server does: the model thinks, then answers in form.
func (s *Server) thinkingPlan(b *Backend, prompt string, tp *toolPlan, req *scheduler.Request) *thinkPlan {
	if b.think != nil && b.think.control {
		// The tags are kept, to be read or (under "none") left in content
		// as <think> is.
		req.SpecialTokens = true
	}
	if s.cfg.ReasoningFormat == "none" || b.think == nil {
		return nil
	}
	t := &thinkPlan{open: strings.HasSuffix(strings.TrimRight(prompt, jsonSpace), b.think.open), tags: *b.think}
	if tp != nil && tp.format != nil {
		t.call = tp.format.open
	}
	if req.Grammar != "" && len(req.GrammarTriggers) == 0 {
		// The grammar ends the thoughts at </think>, whatever they hold.
		req.Grammar, t.call = t.wrap(req.Grammar), ""
	}
	return t
}

// wrap lets gbnf's strings follow thoughts: when the prompt opened them, text
// up to </think> first; else an optional <think>...</think> block.
func (t *thinkPlan) wrap(gbnf string) string {
	var b strings.Builder
	b.WriteString(prefixRules(gbnf, "shoal-answer-")) // named apart from the rules added here
	b.WriteString("\n")
	b.WriteString(untilRules("shoal-thought", t.tags.close))
	thought := fmt.Sprintf(`shoal-thought %s [ \t\r\n]{0,4}`, engine.GBNFLiteral(t.tags.close))
	if t.open {
		fmt.Fprintf(&b, "root ::= %s shoal-answer-root\n", thought)
	} else {
		fmt.Fprintf(&b, "root ::= (%s %s)? shoal-answer-root\n", engine.GBNFLiteral(t.tags.open), thought)
	}
	return b.String()
}

// thinkSplit splits one choice's output into thoughts and the rest.
type thinkSplit struct {
	plan *thinkPlan
	mode int    // thinkUndecided, thinkInside, thinkDone
	held string // output that may begin <think> (undecided) or </think> (inside)
	// trim: the thoughts just began or ended; the whitespace after the tag is
	// neither the thoughts' nor the answer's.
	trim bool
}

const (
	thinkUndecided = iota
	thinkInside
	thinkDone
)

func newThinkSplit(p *thinkPlan) *thinkSplit {
	t := &thinkSplit{plan: p}
	if p.open {
		t.mode, t.trim = thinkInside, true
	}
	return t
}

// add takes the next piece of output and returns the thoughts and the rest of
// the output that can be passed on.
func (t *thinkSplit) add(piece string) (reasoning, rest string) {
	s := t.held + piece
	t.held = ""
	if t.mode == thinkUndecided {
		lead, open := strings.TrimLeft(s, jsonSpace), t.plan.tags.open
		switch {
		case strings.HasPrefix(lead, open):
			t.mode, t.trim, s = thinkInside, true, lead[len(open):]
		case strings.HasPrefix(open, lead):
			t.held = s // may yet begin <think>
			return "", ""
		default:
			t.mode = thinkDone
		}
	}
	if t.trim {
		s = strings.TrimLeft(s, jsonSpace)
		t.trim = s == ""
	}
	if t.mode == thinkDone {
		return "", s
	}
	// Inside: thoughts up to </think> or a call, holding back what may begin one.
	closing := t.plan.tags.close
	end, after := strings.Index(s, closing), len(closing)
	if t.plan.call != "" {
		if i := strings.Index(s, t.plan.call); i >= 0 && (end < 0 || i < end) {
			end, after = i, 0 // the call is the answer's
		}
	}
	if end >= 0 {
		rest = strings.TrimLeft(s[end+after:], jsonSpace)
		t.mode, t.trim = thinkDone, rest == ""
		return strings.TrimRight(s[:end], jsonSpace), rest
	}
	keep := holdBack(s, closing)
	if t.plan.call != "" {
		keep = max(keep, holdBack(s, t.plan.call))
	}
	// Whitespace before a tag is neither's: held until it is known not to be.
	for keep < len(s) && strings.IndexByte(jsonSpace, s[len(s)-keep-1]) >= 0 {
		keep++
	}
	t.held = s[len(s)-keep:]
	return s[:len(s)-keep], ""
}

// flush returns what is held once the output is whole: thoughts cut short
// stay thoughts.
func (t *thinkSplit) flush() (reasoning, rest string) {
	held := t.held
	t.held = ""
	if t.mode == thinkInside {
		return held, ""
	}
	return "", held
}

// holdBack is the length of the longest end of s that begins tag.
func holdBack(s, tag string) int {
	for keep := min(len(s), len(tag)-1); keep > 0; keep-- {
		if strings.HasPrefix(tag, s[len(s)-keep:]) {
			return keep
		}
	}
	return 0
}

// choiceOutput follows one chat choice's output: its thoughts apart, then the
// answer's text and, under tools, its calls.
type choiceOutput struct {
	think  *thinkSplit  // nil: thoughts are not separated
	tools  toolFollower // nil: no tools offered
	deltas callDeltas   // the calls passed on while streamed
}

// callProgress returns the deltas of the calls written so far, to stream
// them as they are written.
func (o *choiceOutput) callProgress(newID func() string) []ToolCallDelta {
	if o.tools == nil {
		return nil
	}
	return o.deltas.next(o.tools.progress(newID))
}

// callRest returns the deltas that complete what was streamed of calls, the
// whole answer's calls (end's).
func (o *choiceOutput) callRest(calls []ToolCall) []ToolCallDelta {
	return o.deltas.next(calls)
}

// newOutput is a follower for one of p's choices, nil when the output is
// passed on as it is.
func (p *plan) newOutput() *choiceOutput {
	if p.think == nil && p.tools == nil {
		return nil
	}
	o := &choiceOutput{}
	if p.think != nil {
		o.think = newThinkSplit(p.think)
	}
	if p.tools != nil {
		o.tools = p.tools.follow()
	}
	return o
}

// follow takes ev, an event of st, and returns the thoughts and the answer
// text to pass on.
func (o *choiceOutput) follow(st *scheduler.Stream, ev scheduler.Event) (reasoning, text string) {
	text = ev.Text
	if o.think != nil {
		reasoning, text = o.think.add(text)
		if ev.Kind == scheduler.EventFinish {
			r, t := o.think.flush()
			reasoning, text = reasoning+r, text+t
		}
	}
	if o.tools != nil {
		ev.Text = text
		text = o.tools.follow(st, ev)
	}
	return reasoning, text
}

// end is called after the finish event: the answer's text not yet passed on,
// the calls made, and the choice's finish_reason given the generator's.
func (o *choiceOutput) end(newID func() string, generated string) (text string, calls []ToolCall, finish string) {
	if o.tools == nil {
		return "", nil, generated
	}
	text, calls = o.tools.end(newID)
	return text, calls, o.tools.finishReason(generated, calls)
}

// thinking reports whether the output is within its thoughts.
func (o *choiceOutput) thinking() bool { return o.think != nil && o.think.mode == thinkInside }

// cutByStop reports whether a stop string ended the answer.
func (o *choiceOutput) cutByStop() bool { return o.stopString() != "" }

// stopString is the stop string that ended the answer, if one did under
// tools (otherwise the scheduler matches them).
func (o *choiceOutput) stopString() string {
	if o.tools == nil {
		return ""
	}
	return o.tools.stopString()
}
