package api

import (
	"fmt"
	"strings"
	"testing"

	"github.com/shoal-ai/shoal/engine"
	"github.com/shoal-ai/shoal/scheduler"
)

// TestThinkSplit: thoughts between <think> and </think> (or from the start,
// when the prompt opened them) come apart from the answer, whatever the pieces;
// a call in the model's own format ends them.
func TestThinkSplit(t *testing.T) {
	cases := []struct {
		name            string
		plan            thinkPlan
		tools           bool
		out             string
		reasoning, text string
		calls           int
	}{
		{"thoughts then answer", thinkPlan{tags: xmlThink}, false, "<think>\nHmm, 2+2.\n</think>\n\nIt is 4.", "Hmm, 2+2.", "It is 4.", 0},
		{"no thoughts", thinkPlan{tags: xmlThink}, false, "It is <think> 4.", "", "It is <think> 4.", 0},
		{"opened by the prompt", thinkPlan{open: true, tags: xmlThink}, false, "\nSo 4.</think>4", "So 4.", "4", 0},
		{"cut short while thinking", thinkPlan{tags: xmlThink}, false, "  <think>Let me see", "Let me see", "", 0},
		{"only a tag's start", thinkPlan{tags: xmlThink}, false, "<thi", "", "<thi", 0},
		{"a call ends the thoughts", thinkPlan{call: "<tool_call>", tags: xmlThink}, true,
			"<think>I will call f.\n<tool_call>\n{\"name\": \"f\", \"arguments\": {}}\n</tool_call>", "I will call f.", "", 1},
		{"thoughts, then a call", thinkPlan{call: "<tool_call>", tags: xmlThink}, true,
			"<think>f it is</think>\n\n<tool_call>{\"name\": \"f\", \"arguments\": {}}</tool_call>", "f it is", "", 1},
		{"Magistral's thoughts", thinkPlan{tags: mistralThink}, false, "[THINK]Hmm, 2+2.[/THINK]It is 4.", "Hmm, 2+2.", "It is 4.", 0},
		{"Magistral's thoughts, then a call", thinkPlan{tags: mistralThink, call: "[TOOL_CALLS]"}, true, "[THINK]f it is[/THINK][TOOL_CALLS]f[ARGS]{}", "f it is", "", 1},
	}
	for _, c := range cases {
		for _, k := range []int{1, 2, 3, 7, len(c.out)} {
			t.Run(fmt.Sprintf("%s/%d", c.name, k), func(t *testing.T) {
				p := &plan{think: &c.plan}
				if c.tools {
					p.tools = &toolPlan{format: &hermesFormat}
					if c.plan.call == "[TOOL_CALLS]" {
						p.tools.format = &mistralFormat
					}
				}
				o := p.newOutput()
				var reasoning, text strings.Builder
				for i := 0; i < len(c.out); i += k {
					ev := scheduler.Event{Kind: scheduler.EventToken, Text: c.out[i:min(i+k, len(c.out))]}
					if i+k >= len(c.out) {
						ev.Kind = scheduler.EventFinish
					}
					r, tx := o.follow(nil, ev)
					reasoning.WriteString(r)
					text.WriteString(tx)
				}
				rest, calls, _ := o.end(func() string { return "id" }, "stop")
				text.WriteString(rest)
				if reasoning.String() != c.reasoning || text.String() != c.text || len(calls) != c.calls {
					t.Fatalf("reasoning %q, text %q, %d calls; want %q, %q, %d", reasoning.String(), text.String(), len(calls), c.reasoning, c.text, c.calls)
				}
			})
		}
	}
}

// TestThinkingPlan: thoughts are separated for a model whose template writes
// </think>, unless a grammar holds the output from its first token.
func TestThinkingPlan(t *testing.T) {
	s := &Server{cfg: DefaultConfig()}
	b := &Backend{think: &xmlThink}
	if p := s.thinkingPlan(b, "<|im_start|>assistant\n<think>\n", nil, &scheduler.Request{}); p == nil || !p.open {
		t.Fatalf("an open <think>: %+v", p)
	}
	// A grammar that holds the whole output lets the thoughts come first.
	req := &scheduler.Request{Grammar: "root ::= \"a\" root?\n"}
	if p := s.thinkingPlan(b, "<think>\n", nil, req); p == nil || !strings.Contains(req.Grammar, `shoal-answer-root ::= "a" shoal-answer-root?`) ||
		!strings.Contains(req.Grammar, `root ::= shoal-thought "</think>" [ \t\r\n]{0,4} shoal-answer-root`) {
		t.Fatalf("an open <think> under a grammar: %+v\n%s", p, req.Grammar)
	}
	req = &scheduler.Request{Grammar: "root ::= \"a\"\n"}
	if p := s.thinkingPlan(b, "x", nil, req); p == nil || !strings.Contains(req.Grammar, `root ::= ("<think>" shoal-thought "</think>" [ \t\r\n]{0,4})? shoal-answer-root`) {
		t.Fatalf("a grammar, no <think> in the prompt: %+v\n%s", p, req.Grammar)
	}
	if p := s.thinkingPlan(b, "x", &toolPlan{format: &hermesFormat}, &scheduler.Request{Grammar: "g", GrammarTriggers: []engine.Trigger{{Text: "<tool_call>"}}}); p == nil || p.call != "<tool_call>" {
		t.Fatalf("under a lazy grammar: %+v", p)
	}
	// Magistral's tags are control tokens: the output keeps them.
	b.think, req = thinkTagsOf("{{ '[THINK]' + thought + '[/THINK]' }}"), &scheduler.Request{Grammar: "root ::= \"a\"\n"}
	if p := s.thinkingPlan(b, "[INST]x[/INST]", nil, req); p == nil || p.tags.open != "[THINK]" || !req.SpecialTokens ||
		!strings.Contains(req.Grammar, `root ::= ("[THINK]" shoal-thought "[/THINK]" [ \t\r\n]{0,4})? shoal-answer-root`) {
		t.Fatalf("[THINK] tags: %+v, %+v\n%s", p, req, req.Grammar)
	}
	// "]" in a class is escaped: "[^][]" would end at its first "]".
	if !strings.Contains(req.Grammar, `shoal-thought-7 ::= | "[" shoal-thought-1 | [^\x5D\x5B] shoal-thought-0`) {
		t.Fatalf("[/THINK]'s last state:\n%s", req.Grammar)
	}
	b.think = &xmlThink
	s.cfg.ReasoningFormat = "none"
	if p := s.thinkingPlan(b, "x", nil, &scheduler.Request{}); p != nil {
		t.Fatal("thoughts separated under --reasoning-format none")
	}
}

// FuzzThinkSplit: splitting never panics and does not depend on how the
// output is cut into pieces.
func FuzzThinkSplit(f *testing.F) {
	f.Add("<think>a</think>b", 2, false)
	f.Add(" <thi</think>", 1, true)
	f.Add("[THINK]a[/TH[/THINK]b[TOOL_CALLS]", 3, false)
	f.Fuzz(func(t *testing.T, out string, k int, open bool) {
		run := func(k int) string {
			s := newThinkSplit(&thinkPlan{open: open, call: "<tool_call>", tags: xmlThink})
			if strings.Contains(out, "[THINK]") {
				s = newThinkSplit(&thinkPlan{open: open, call: "[TOOL_CALLS]", tags: mistralThink})
			}
			var r, x strings.Builder
			for i := 0; i < len(out); i += k {
				a, b := s.add(out[i:min(i+k, len(out))])
				r.WriteString(a)
				x.WriteString(b)
			}
			a, b := s.flush()
			return r.String() + a + "|" + x.String() + b
		}
		if k < 1 || k > len(out) {
			k = 1
		}
		if got, want := run(k), run(max(len(out), 1)); got != want {
			t.Fatalf("pieces of %d: %q; whole: %q", k, got, want)
		}
	})
}
