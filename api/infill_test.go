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
	if _, err := infillPrompt(f.Vocab(), nil, "a", "b", ""); err == nil {
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
	v := f.Vocab()
	extra := []InfillChunk{{Filename: "a.go", Text: "x"}, {Text: "y"}}
	for _, c := range []struct {
		name  string
		fim   engine.FIMTokens
		extra []InfillChunk
		want  []engine.Token
	}{
		{"plain", fimFake, nil, cat(engine.Token(1), fimFake.Pre, "pre", fimFake.Suf, "suf", fimFake.Mid, "mid")},
		{"extra as text", fimFake, extra, cat(engine.Token(1), "\n\n--- a.go ---\n\nx", "\n\n--- tmp ---\n\ny", fimFake.Pre, "pre", fimFake.Suf, "suf", fimFake.Mid, "mid")},
	} {
		got, err := infillPrompt(v, c.extra, "pre", "suf", "mid")
		if err != nil || !slices.Equal(got, c.want) {
			t.Fatalf("%s: %v %v, want %v", c.name, got, err, c.want)
		}
	}
	repo := fimFake
	repo.Rep, repo.Sep = 58, 59
	f.SetFIM(repo)
	got, _ := infillPrompt(f.Vocab(), extra, "pre", "", "")
	want := cat(engine.Token(1), repo.Rep, infillRepoName+"\n", repo.Sep, "a.go\nx", repo.Sep, "tmp\ny", repo.Sep, infillFileName+"\n", repo.Pre, "pre", repo.Suf, repo.Mid)
	if !slices.Equal(got, want) {
		t.Fatalf("repository layout %v, want %v", got, want)
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
	}{
		{"no options", infillPlan{}, []string{"a\n", "b\n", "c"}, 0, "a\nb\nc", -1},
		{"indented enough", infillPlan{indent: 4}, []string{"x = 1\n", "    y", " = 2\n", "    \n", "\tz"}, 0, "x = 1\n    y = 2\n    \n", 4},
		{"first line free", infillPlan{indent: 4}, []string{"x", "\n  ", "  ", "ok\n  ", "bad"}, 0, "x\n    ok\n", 4},
		{"blank lines pass", infillPlan{indent: 2}, []string{"a\n\n", "  \n", "  b"}, 0, "a\n\n  \n  b", -1},
		{"cut mid-token", infillPlan{indent: 2}, []string{"a\n  b\nc d"}, 0, "a\n  b\n", 0},
		{"time without a line break", infillPlan{maxPredict: time.Millisecond}, []string{"a", "b", "c"}, 1, "abc", -1},
		{"time after a line break", infillPlan{maxPredict: time.Millisecond}, []string{"a", "b\n", "c", "d"}, 2, "ab\nc", 2},
	} {
		f := infillCut{infillPlan: c.plan}
		var out strings.Builder
		stopped := -1
		for i, tok := range c.tokens {
			elapsed := time.Duration(0)
			if c.late > 0 && i >= c.late {
				elapsed = time.Second
			}
			text, stop := f.add(tok, elapsed)
			out.WriteString(text)
			if stop && stopped < 0 {
				stopped = i
			}
		}
		out.WriteString(f.end())
		if out.String() != c.want || stopped != c.stop {
			t.Errorf("%s: %q stopped at %d, want %q at %d", c.name, out.String(), stopped, c.want, c.stop)
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
	const body = `{"input_prefix":"def f():\n","input_suffix":"\nf()\n","input_extra":[{"filename":"u.py","text":"import os"}],"prompt":"ret","n_predict":6,"temperature":0,"repeat_penalty":1.0,"cache_prompt":true,"samplers":["top_k"]`
	var whole InfillResponse
	w := s.do(t, "POST", "/infill", body+`}`)
	if err := json.Unmarshal(w.Body.Bytes(), &whole); err != nil || w.Code != 200 {
		t.Fatalf("%d %v: %s", w.Code, err, w.Body)
	}
	want, _ := infillPrompt(s.fake.Vocab(), []InfillChunk{{Filename: "u.py", Text: "import os"}}, "def f():\n", "\nf()\n", "ret")
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
	want, _ = infillPrompt(s.fake.Vocab(), nil, "def f():\n", "\nf()\n", "")
	if err := json.Unmarshal(w.Body.Bytes(), &cr); err != nil || w.Code != 200 || cr.Usage.PromptTokens != len(want) {
		t.Fatalf("suffix: %d %s (want %d prompt tokens)", w.Code, w.Body, len(want))
	}
	for _, c := range []struct{ body, param string }{
		{`{"input_prefix":"x","n":2}`, "n"},
		{`{"input_prefix":"x","n_indent":-1}`, "n_indent"},
		{`{"input_prefix":"x","t_max_predict_ms":-5}`, "t_max_predict_ms"},
		{`{"input_prefix":"x","n_predict":-2}`, "n_predict"},
		{`{"input_prefix":"x","input_extra":` + fmt.Sprintf("[%s{}]", strings.Repeat("{},", MaxInfillChunks)) + `}`, "input_extra"},
		{`{"prompt":[1,2],"suffix":"x"}`, "suffix"},
	} {
		path := "/infill"
		if strings.Contains(c.body, "suffix") {
			path = "/v1/completions"
		}
		if w := s.do(t, "POST", path, c.body); w.Code != 400 || !strings.Contains(w.Body.String(), `"param":"`+c.param+`"`) {
			t.Errorf("%s: %d %s, want 400 naming %s", c.body, w.Code, w.Body, c.param)
		}
	}
}
