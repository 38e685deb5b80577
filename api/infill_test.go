package api

import (
	"encoding/json"
	"fmt"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/shoal-ai/shoal/engine"
	"github.com/shoal-ai/shoal/engine/enginetest"
)

// fimFake's FIM tokens lie above the fake's byte tokens (3..28).
var fimFake = engine.FIMTokens{Pre: 60, Suf: 61, Mid: 62, Pad: 63, Rep: engine.NoToken, Sep: engine.NoToken}

func TestInfillPrompt(t *testing.T) {
	f := enginetest.New(256, 4, 64)
	if _, err := newInfill(f.Vocab(), nil, "a", "b", "", true); err == nil {
		t.Fatal("a vocabulary without FIM tokens laid out an infill prompt")
	}
	tok := func(s string) []engine.Token { toks, _ := f.Vocab().Tokenize(s, false, false); return toks }
	cat := func(parts ...any) []engine.Token {
		var out []engine.Token
		for _, p := range parts {
			switch p := p.(type) {
			case engine.Token:
				out = append(out, p)
			case string:
				out = append(out, tok(p)...)
			}
		}
		return out
	}
	f.SetFIM(fimFake)
	extra := []InfillChunk{{Filename: "a.go", Text: "x"}, {Text: "y"}}
	repo := fimFake
	repo.Rep, repo.Sep = 58, 59
	for _, c := range []struct {
		name  string
		fim   engine.FIMTokens
		extra []InfillChunk
		repo  bool
		want  []engine.Token
	}{
		// The request's prompt (the cursor's line so far) ends the prefix, as llama-server lays it out.
		{"plain", fimFake, nil, true, cat(engine.Token(1), fimFake.Pre, "premid", fimFake.Suf, "suf", fimFake.Mid)},
		{"files as text", fimFake, extra, true, cat(engine.Token(1), "\n\n--- a.go ---\n\nx", "\n\n--- tmp ---\n\ny", fimFake.Pre, "premid", fimFake.Suf, "suf", fimFake.Mid)},
		{"repository", repo, extra, true, cat(engine.Token(1), repo.Rep, infillRepoName+"\n", repo.Sep, "a.go\nx", repo.Sep, "tmp\ny", repo.Sep, infillFileName+"\n", repo.Pre, "premid", repo.Suf, "suf", repo.Mid)},
		{"repository without files", repo, nil, true, cat(engine.Token(1), repo.Rep, infillRepoName+"\n", repo.Sep, infillFileName+"\n", repo.Pre, "premid", repo.Suf, "suf", repo.Mid)},
		{"suffix (no repository)", repo, nil, false, cat(engine.Token(1), repo.Pre, "premid", repo.Suf, "suf", repo.Mid)},
	} {
		f.SetFIM(c.fim)
		in, err := newInfill(f.Vocab(), c.extra, "pre", "suf", "mid", c.repo)
		if got := in.tokens(); err != nil || !slices.Equal(got, c.want) {
			t.Fatalf("%s: %v %v, want %v", c.name, got, err, c.want)
		}
	}

	// Fitting: the oldest files go first, then the prefix's start and the
	// suffix's end, 3:1.
	f.SetFIM(fimFake)
	files := []InfillChunk{{Filename: "old", Text: strings.Repeat("o", 40)}, {Filename: "new", Text: strings.Repeat("n", 40)}}
	in, _ := newInfill(f.Vocab(), files, strings.Repeat("p", 100), strings.Repeat("s", 100), "", true)
	whole := len(in.tokens())
	if in.fit(whole) || len(in.tokens()) != whole {
		t.Fatal("a prompt that fits was cut")
	}
	in.fit(whole - 30) // the oldest file (49 tokens) goes
	if got := in.tokens(); len(got) > whole-30 || len(in.files) != 1 || len(in.prefix) != 100 || len(in.suffix) != 100 {
		t.Fatalf("fit to %d: %d tokens, %d files, prefix %d, suffix %d", whole-30, len(got), len(in.files), len(in.prefix), len(in.suffix))
	}
	in.fit(1 + 3 + 80) // BOS and the three FIM tokens, 80 more
	if len(in.files) != 0 || len(in.prefix) != 60 || len(in.suffix) != 20 || in.prefix[0] != tok("p")[0] {
		t.Fatalf("fit to 84: %d files, prefix %d, suffix %d", len(in.files), len(in.prefix), len(in.suffix))
	}
}

func TestInfillCut(t *testing.T) {
	for _, c := range []struct {
		name   string
		plan   infillPlan
		tokens []string
		late   int // tokens from this one on come after maxPredict (0: none)
		want   string
		stop   int // the token that stops it (-1: none)
		how    cutKind
	}{
		{"no options", infillPlan{}, []string{"a\n", "b\n", "c"}, 0, "a\nb\nc", -1, cutNone},
		{"indented enough", infillPlan{indent: 4}, []string{"x = 1\n", "    y", " = 2\n", "    \n", "\tz"}, 0, "x = 1\n    y = 2\n    \n", 4, cutIndent},
		{"first line free", infillPlan{indent: 4}, []string{"x", "\n  ", "  ", "ok\n  ", "bad"}, 0, "x\n    ok\n", 4, cutIndent},
		{"blank lines pass", infillPlan{indent: 2}, []string{"a\n\n", "  \n", "  b"}, 0, "a\n\n  \n  b", -1, cutNone},
		{"cut mid-token", infillPlan{indent: 2}, []string{"a\n  b\nc d"}, 0, "a\n  b\n", 0, cutIndent},
		{"time without a line break", infillPlan{maxPredict: time.Millisecond}, []string{"a", "b", "c"}, 1, "abc", -1, cutNone},
		{"time after a line break", infillPlan{maxPredict: time.Millisecond}, []string{"a", "b\n", "c", "d"}, 2, "ab\nc", 2, cutTime},
		{"time keeps a line's start", infillPlan{indent: 4, maxPredict: time.Millisecond}, []string{"a\n", "  "}, 1, "a\n  ", 1, cutTime},
	} {
		f := infillCut{infillPlan: c.plan}
		var out strings.Builder
		stopped, how := -1, cutNone
		for i, tok := range c.tokens {
			elapsed := time.Duration(0)
			if c.late > 0 && i >= c.late {
				elapsed = time.Second
			}
			text, stop := f.add(tok, elapsed)
			out.WriteString(text)
			if stop != cutNone && stopped < 0 {
				stopped, how = i, stop
			}
		}
		out.WriteString(f.end())
		if out.String() != c.want || stopped != c.stop || how != c.how {
			t.Errorf("%s: %q stopped at %d (%d), want %q at %d (%d)", c.name, out.String(), stopped, how, c.want, c.stop, c.how)
		}
	}
}

// TestInfillEndpoint: /infill answers in llama-server's format, whole and
// streamed alike; n_predict 0 answers nothing; the completions suffix lays out
// the same prompt; a model without FIM tokens refuses both.
func TestInfillEndpoint(t *testing.T) {
	plain := newTestServer(t, nil)
	if w := plain.do(t, "POST", "/infill", `{"input_prefix":"a","input_suffix":"b"}`); w.Code != 400 || !strings.Contains(w.Body.String(), "fill-in-the-middle") {
		t.Fatalf("no FIM tokens: %d %s", w.Code, w.Body)
	}
	if w := plain.do(t, "POST", "/v1/completions", `{"prompt":"a","suffix":"b"}`); w.Code != 400 || !strings.Contains(w.Body.String(), `"param":"suffix"`) {
		t.Fatalf("suffix without FIM tokens: %d %s", w.Code, w.Body)
	}
	if w := plain.do(t, "POST", "/v1/completions", `{"prompt":"a","suffix":"","max_tokens":2}`); w.Code != 200 {
		t.Fatalf("empty suffix without FIM tokens: %d %s", w.Code, w.Body)
	}

	s := newTestServer(t, nil)
	s.fake.SetFIM(fimFake)
	s.SetBackend(&Backend{Generator: s.sched, Vocab: s.fake.Vocab(), Info: s.fake.Info(), Capacity: s.fake.Capacity()})
	const body = `{"input_prefix":"def f():\n","input_suffix":"\nf()\n","input_extra":[{"filename":"u.py","text":"import os"}],"prompt":"ret","n_predict":6,"temperature":0,"repeat_penalty":1.0,"cache_prompt":true,"samplers":["top_k","temperature"]`
	var whole InfillResponse
	w := s.do(t, "POST", "/infill", body+`}`)
	if err := json.Unmarshal(w.Body.Bytes(), &whole); err != nil || w.Code != 200 {
		t.Fatalf("%d %v: %s", w.Code, err, w.Body)
	}
	in, _ := newInfill(s.fake.Vocab(), []InfillChunk{{Filename: "u.py", Text: "import os"}}, "def f():\n", "\nf()\n", "ret", true)
	want := in.tokens()
	if !whole.Stop || whole.StopType != "limit" || whole.TokensPredicted != 6 || whole.TokensEvaluated != len(want) || whole.Model != "fake" ||
		whole.Timings == nil || whole.Timings.PredictedN != 6 || whole.Timings.PromptN != len(want) || len(whole.Content) == 0 {
		t.Fatalf("whole: %s", w.Body)
	}
	var streamed strings.Builder
	var last InfillResponse
	w = s.do(t, "POST", "/infill", body+`,"stream":true}`)
	if strings.Contains(w.Body.String(), "[DONE]") {
		t.Fatalf("llama-server's streams end without [DONE]: %s", w.Body)
	}
	for _, data := range sseData(t, w.Body.String()) {
		if err := json.Unmarshal(data, &last); err != nil {
			t.Fatal(err)
		}
		streamed.WriteString(last.Content)
	}
	if streamed.String() != whole.Content || !last.Stop || last.TokensPredicted != 6 || last.TokensCached == 0 {
		t.Fatalf("streamed %q (last %+v), whole %q", streamed.String(), last, whole.Content)
	}
	// n_predict 0: the prompt computed, nothing answered.
	w = s.do(t, "POST", "/infill", `{"input_prefix":"x","n_predict":0}`)
	var warm InfillResponse
	if err := json.Unmarshal(w.Body.Bytes(), &warm); err != nil || w.Code != 200 || warm.Content != "" || warm.TokensPredicted != 0 || warm.StopType != "limit" {
		t.Fatalf("n_predict 0: %d %s", w.Code, w.Body)
	}
	// The completions suffix: the same layout, without other files.
	w = s.do(t, "POST", "/v1/completions", `{"prompt":"def f():\n","suffix":"\nf()\n","max_tokens":3,"temperature":0}`)
	var cr CompletionResponse
	in, _ = newInfill(s.fake.Vocab(), nil, "def f():\n", "\nf()\n", "", false)
	want = in.tokens()
	if err := json.Unmarshal(w.Body.Bytes(), &cr); err != nil || w.Code != 200 || cr.Usage.PromptTokens != len(want) {
		t.Fatalf("suffix: %d %s (want %d prompt tokens)", w.Code, w.Body, len(want))
	}
	// An editor's view larger than the context is cut to fit, as llama-server
	// fits it, and says so; n_predict past the context is a most.
	big := fmt.Sprintf(`{"input_prefix":%q,"input_suffix":%q,"input_extra":[{"filename":"a","text":%q}],"n_predict":3000,"response_fields":["content","truncated","timings/prompt_n","nope/x"]}`,
		strings.Repeat("p", 3000), strings.Repeat("s", 3000), strings.Repeat("x", 3000))
	w = s.do(t, "POST", "/infill", big)
	var fields map[string]any
	if err := json.Unmarshal(w.Body.Bytes(), &fields); err != nil || w.Code != 200 || fields["truncated"] != true || len(fields) != 3 || fields["timings/prompt_n"].(float64) > 4096-2048 {
		t.Fatalf("a view over the context: %d %s", w.Code, w.Body)
	}
	if w := s.do(t, "POST", "/v1/completions", `{"prompt":[[1,5]],"suffix":"","max_tokens":2}`); w.Code != 200 {
		t.Fatalf("an empty suffix with token ids: %d %s", w.Code, w.Body)
	}
	for _, c := range []struct{ body, param string }{
		{`{"prompt":"a","suffix":"b","echo":true}`, "echo"},
		{`{"input_prefix":"x","prompt_logprobs":1}`, "prompt_logprobs"},
		{`{"input_prefix":"x","n":2}`, "n"},
		{`{"input_prefix":"x","n_indent":-1}`, "n_indent"},
		{`{"input_prefix":"x","t_max_predict_ms":-5}`, "t_max_predict_ms"},
		{`{"input_prefix":"x","n_predict":-2}`, "n_predict"},
		{`{"input_prefix":"x","input_extra":` + fmt.Sprintf("[%s{}]", strings.Repeat("{},", MaxInfillChunks)) + `}`, "input_extra"},
		{`{"prompt":[1,2],"suffix":"x"}`, "suffix"},
	} {
		path := "/infill"
		if strings.Contains(c.body, `"prompt"`) {
			path = "/v1/completions"
		}
		if w := s.do(t, "POST", path, c.body); w.Code != 400 || !strings.Contains(w.Body.String(), `"param":"`+c.param+`"`) {
			t.Errorf("%s: %d %s, want 400 naming %s", c.body, w.Code, w.Body, c.param)
		}
	}
}
