package api

import (
	"bytes"
	"encoding/json"
	"fmt"
	"strconv"
	"strings"
	"testing"

	"github.com/shoal-ai/shoal/engine"
	"github.com/shoal-ai/shoal/engine/sample"
	"github.com/shoal-ai/shoal/scheduler"
)

// TestLlamaCompletion: llama-server's /completion answers a prompt given as
// text, token ids or both mixed (BOS before the first text only), whole or as
// data events in /infill's shape, with n_predict's meanings, and refuses what it
// does not do.
func TestLlamaCompletion(t *testing.T) {
	s := newTestServer(t, nil)
	answer := func(body string) InfillResponse {
		t.Helper()
		w := s.do(t, "POST", "/completion", body)
		var r InfillResponse
		if err := json.Unmarshal(w.Body.Bytes(), &r); err != nil || w.Code != 200 || !r.Stop {
			t.Fatalf("%s: %d %s", body, w.Code, w.Body)
		}
		return r
	}
	text := answer(`{"prompt":"abc","n_predict":4,"temperature":0}`)
	if text.TokensPredicted != 4 || text.TokensEvaluated != 4 || text.StopType != "limit" || text.Timings == nil {
		t.Fatalf("text prompt: %+v", text)
	}
	// The same prompt as ids, BOS included, and as text then an id.
	ids, _ := s.fake.Vocab().Tokenize("abc", true, true)
	if r := answer(fmt.Sprintf(`{"prompt":[%d,%d,%d,%d],"n_predict":4,"temperature":0}`, ids[0], ids[1], ids[2], ids[3])); r.Content != text.Content {
		t.Fatalf("as token ids %v: %q, as text: %q", ids, r.Content, text.Content)
	}
	if mixed := answer(fmt.Sprintf(`{"prompt":["ab",%d],"n_predict":4,"temperature":0}`, ids[3])); mixed.Content != text.Content || mixed.TokensEvaluated != 4 {
		t.Fatalf("mixed: %+v, as text: %q", mixed, text.Content)
	}
	if all := answer(`{"prompt":"abc","n_predict":-1,"max_tokens":2}`); all.TokensPredicted < 2 {
		t.Fatalf("n_predict -1 (until the end): %+v", all)
	}
	if warm := answer(`{"prompt":"abc","n_predict":0}`); warm.Content != "" || warm.StopType != "limit" {
		t.Fatalf("n_predict 0 (the prompt alone): %+v", warm)
	}
	// logit_bias in llama-server's forms: SillyTavern sends [] always, and bans
	// tokens with false; a text key biases the text's tokens.
	var pairs, object []string
	for id := range s.fake.Vocab().Size() {
		if p, _ := s.fake.Vocab().Piece(engine.Token(id), false); string(p) == text.Content[:1] {
			pairs, object = append(pairs, fmt.Sprintf("[%d,false]", id)), append(object, fmt.Sprintf(`"%d":-100`, id))
		}
	}
	for _, c := range []struct {
		bias    string
		changes bool // the first token is banned
	}{
		{`[]`, false}, {"[" + strings.Join(pairs, ",") + "]", true}, {"{" + strings.Join(object, ",") + "}", true},
		{`[["ab",false]]`, false}, {`{"ab":-3.5}`, false},
	} {
		r := answer(`{"prompt":"abc","n_predict":4,"temperature":0,"logit_bias":` + c.bias + `}`)
		if c.changes == (r.Content[:1] == text.Content[:1]) {
			t.Errorf("logit_bias %s: %q, without: %q", c.bias, r.Content, text.Content)
		}
	}
	lb := LogitBias{{Text: "ab", IsText: true, Bias: banBias}, {ID: 7, Bias: 2}}
	ab, _ := s.fake.Vocab().Tokenize("ab", false, false)
	if m, err := lb.tokens(s.fake.Vocab()); err != nil || len(m) != 3 || m[ab[0]] != -100 || m[ab[1]] != -100 || m[7] != 2 {
		t.Fatalf("a text's tokens and an id: %v %v", m, err)
	}
	// llama-server's meanings of values OpenAI's API refuses: top_p 0 and a
	// negative temperature draw the likeliest token, a negative seed is a new one,
	// an empty stop string stops nothing.
	for _, f := range []string{`"top_p":0`, `"temperature":-1`, `"temperature":0,"seed":-1,"stop":["","zzz"]`} {
		if r := answer(`{"prompt":"abc","n_predict":4,` + f + `}`); r.Content != text.Content {
			t.Errorf("%s: %q, greedy: %q", f, r.Content, text.Content)
		}
	}
	answer(`{"prompt":"abc","n_predict":4,"temperature":5}`) // any temperature, as llama.cpp's
	if w := s.do(t, "POST", "/v1/completions", `{"prompt":"abc","max_tokens":4,"temperature":5}`); w.Code != 400 {
		t.Errorf("temperature 5 on OpenAI's API: %d, want 400 as OpenAI answers", w.Code)
	}
	// Every count is there, 0 or not, as llama-server sends them.
	if w := s.do(t, "POST", "/completion", `{"prompt":"abc","n_predict":0}`); !strings.Contains(w.Body.String(), `"tokens_predicted":0`) ||
		!strings.Contains(w.Body.String(), `"tokens_cached":`) || !strings.Contains(w.Body.String(), `"stopping_word":""`) {
		t.Errorf("counts of 0 left out: %s", w.Body)
	}
	// cache_prompt false computes the whole prompt; the default takes the cache.
	long := `{"prompt":"` + strings.Repeat("a long prompt ", 20) + `","n_predict":2`
	answer(long + `}`)
	if r := answer(long + `,"cache_prompt":false}`); r.TokensCached != 0 || r.Timings.PromptN != r.TokensEvaluated {
		t.Errorf("cache_prompt false: %d tokens cached, %d of %d computed", r.TokensCached, r.Timings.PromptN, r.TokensEvaluated)
	}
	if r := answer(long + `,"cache_prompt":true}`); r.TokensCached == 0 {
		t.Error("cache_prompt true: nothing cached")
	}
	w := s.do(t, "POST", "/completion", `{"prompt":"abc","n_predict":3,"stream":true,"temperature":0}`)
	events := strings.Count(w.Body.String(), "data: ")
	if w.Code != 200 || events != 4 || !strings.Contains(w.Body.String(), `"stop":true`) || strings.Contains(w.Body.String(), "[DONE]") ||
		strings.Count(w.Body.String(), `"tokens_predicted"`) != 1 {
		t.Fatalf("stream (counts in the last event only): %d %s", w.Code, w.Body)
	}
	// n_probs: each token's log-probability and alternatives, as SillyTavern asks;
	// samplers sent turned off, as it always sends them, are taken.
	probs := answer(`{"prompt":"abc","n_predict":3,"n_probs":2,"mirostat":0,"typical_p":1,"tfs_z":1,"dry_multiplier":0,"xtc_probability":0,"dynatemp_range":0,"top_n_sigma":-1}`)
	if len(probs.CompletionProbabilities) != 3 || len(probs.CompletionProbabilities[0].TopLogprobs) != 2 || probs.CompletionProbabilities[0].Token == "" {
		t.Fatalf("n_probs: %+v", probs.CompletionProbabilities)
	}
	w = s.do(t, "POST", "/completion", `{"prompt":"abc","n_predict":3,"n_probs":1,"stream":true}`)
	if strings.Count(w.Body.String(), `"completion_probabilities"`) != 3 {
		t.Fatalf("n_probs streamed: %s", w.Body)
	}
	// Several prompts, as llama-server reads them: an array of answers, each
	// as the prompt alone gets it, with its index; streamed, each event says
	// whose it is.
	xy, _ := s.fake.Vocab().Tokenize("xy", true, false)
	idList, _ := json.Marshal(xy)
	alone := []InfillResponse{answer(`{"prompt":"abc","n_predict":4,"temperature":0}`), answer(`{"prompt":"q","n_predict":4,"temperature":0}`),
		answer(`{"prompt":` + string(idList) + `,"n_predict":4,"temperature":0}`), answer(`{"prompt":[` + strconv.Itoa(int(xy[0])) + `,"k"],"n_predict":4,"temperature":0}`)}
	w = s.do(t, "POST", "/completion", `{"prompt":["abc","q",`+string(idList)+`,[`+strconv.Itoa(int(xy[0]))+`,"k"]],"n_predict":4,"temperature":0}`)
	var several []InfillResponse
	if err := json.Unmarshal(w.Body.Bytes(), &several); err != nil || w.Code != 200 || len(several) != len(alone) {
		t.Fatalf("several prompts: %d %s", w.Code, w.Body)
	}
	for i, r := range several {
		if r.Index != i || r.Content != alone[i].Content || r.TokensEvaluated != alone[i].TokensEvaluated {
			t.Errorf("prompt %d of several: %+v, alone: %+v", i, r, alone[i])
		}
	}
	if r := answer(`{"prompt":["q"],"n_predict":4,"temperature":0}`); r.Content != alone[1].Content {
		t.Errorf("a list of one prompt: %+v, want the prompt's answer", r)
	}
	w = s.do(t, "POST", "/completion", `{"prompt":["abc","q"],"n_predict":4,"temperature":0,"stream":true}`)
	got := map[int]string{}
	for _, e := range strings.Split(strings.TrimSpace(w.Body.String()), "\n\n") {
		var r InfillResponse
		if err := json.Unmarshal([]byte(strings.TrimPrefix(e, "data: ")), &r); err != nil {
			t.Fatalf("several prompts streamed: %q: %v", e, err)
		}
		got[r.Index] += r.Content
	}
	if w.Code != 200 || len(got) != 2 || got[0] != alone[0].Content || got[1] != alone[1].Content {
		t.Fatalf("several prompts streamed: %v, alone %q %q", got, alone[0].Content, alone[1].Content)
	}
	w = s.do(t, "POST", "/completion", `{"prompt":"abc","n_predict":2,"response_fields":["content","timings/predicted_n"]}`)
	if w.Code != 200 || !strings.Contains(w.Body.String(), `"timings/predicted_n":2`) || strings.Contains(w.Body.String(), "tokens_evaluated") {
		t.Fatalf("response_fields: %s", w.Body)
	}
	for _, c := range []struct{ body, param string }{
		{`{"n_predict":2}`, "prompt"},
		{`{"prompt":[]}`, "prompt"},
		{`{"prompt":[99999]}`, "prompt"},
		{`{"prompt":"a","n_probs":99}`, "n_probs"},
		{`{"prompt":"a","mirostat":3}`, "mirostat"},
		{`{"prompt":"a","dry_multiplier":0.8,"dry_base":-1}`, "dry_base"},
		{`{"prompt":"a","dry_multiplier":0.8,"dry_sequence_breakers":[]}`, "dry_sequence_breakers"},
		{`{"prompt":"a","dry_multiplier":0.8,"dry_sequence_breakers":[` + strings.Repeat(`"x",`, sample.MaxBreakers) + `"x"]}`, "dry_sequence_breakers"},
		{`{"prompt":"a","dry_multiplier":0.8,"dry_penalty_last_n":-2}`, "dry_penalty_last_n"},
		{`{"prompt":"a","dynatemp_range":-0.5}`, "dynatemp_range"},
		{`{"prompt":"a","typical_p":1.5}`, "typical_p"},
		{`{"prompt":"a","xtc_probability":1.5}`, "xtc_probability"},
		{`{"prompt":"a","tfs_z":0.9}`, "tfs_z"},
		{`{"prompt":"a","min_keep":-1}`, "min_keep"},
		{`{"prompt":"a","n":2}`, "n"},
		{`{"prompt":"a","n_predict":-2}`, "n_predict"},
		{`{"prompt":[[["a"]],"b"]}`, ""},
		{`{"prompt":["abc",null,5]}`, ""},
		{`{"prompt":[["a","b"],"c"]}`, ""},
		{`{"prompt":[1.5,"c"]}`, ""},
		{`{"prompt":["a",{"b":1}]}`, ""},
		{`{"prompt":["a",[]]}`, "prompt"},
		{`{"prompt":["a",[99999]]}`, "prompt"},
		{`{"prompt":[` + strings.Repeat(`"a",`, 4*scheduler.MaxChoices) + `"a"]}`, "prompt"},
	} {
		w := s.do(t, "POST", "/completion", c.body)
		if strings.Contains(c.body, "99999]]") && !strings.Contains(w.Body.String(), "prompt 1, element 0") {
			t.Errorf("%s: %s, want the error to name prompt 1", c.body, w.Body)
		}
		var e struct{ Error *Error }
		if err := json.Unmarshal(w.Body.Bytes(), &e); err != nil || w.Code != 400 || e.Error == nil || e.Error.Param != c.param {
			t.Errorf("%s: %d %s", c.body, w.Code, w.Body)
		}
	}
}

// TestLlamaProps: /props gives the context a request may use and the slots, and
// /apply-template lays out a chat as chat completions would, without running it.
func TestLlamaProps(t *testing.T) {
	s := newTestServer(t, nil)
	w := s.do(t, "GET", "/props", "")
	var p LlamaProps
	if err := json.Unmarshal(w.Body.Bytes(), &p); err != nil || w.Code != 200 || p.DefaultGenerationSettings.NCtx == 0 || p.TotalSlots != 16 || p.ModelPath != "fake" {
		t.Fatalf("props: %d %s", w.Code, w.Body)
	}
	w = s.do(t, "POST", "/apply-template", `{"messages":[{"role":"user","content":"hi"}]}`)
	var a struct{ Prompt string }
	if err := json.Unmarshal(w.Body.Bytes(), &a); err != nil || w.Code != 200 || !strings.Contains(a.Prompt, "hi") {
		t.Fatalf("apply-template: %d %s", w.Code, w.Body)
	}
	if w := s.do(t, "POST", "/apply-template", `{"messages":[]}`); w.Code != 400 || !bytes.Contains(w.Body.Bytes(), []byte(`"param":"messages"`)) {
		t.Fatalf("apply-template without messages: %d %s", w.Code, w.Body)
	}
}

// FuzzLlamaServerRequests: no body makes /completion or /apply-template fail
// with a 5xx or an error outside OpenAI's format.
func FuzzLlamaServerRequests(f *testing.F) {
	s := newTestServer(f, func(c *Config, sc *scheduler.Config) { c.MaxTokensCap, sc.DefaultMaxTokens = 8, 8 })
	fuzzOpenAIErrors(f, s, "/completion", "/apply-template",
		`{"prompt":"abc","n_predict":3,"stop":["x"],"stream":true}`, `{"prompt":["a",3,"b"],"n_predict":0}`,
		`{"prompt":[1,2],"n_predict":-1,"repeat_penalty":1.1}`, `{"prompt":"a","grammar":"root ::= \"x\""}`,
		`{"messages":[{"role":"user","content":"hi"}],"add_generation_prompt":false}`, `null`, `[]`, `{"prompt":null}`,
		`{"prompt":["a",[1,"b"],[2]],"n_predict":2,"stream":true}`, `{"prompt":["a","b"],"n_predict":1,"response_fields":["index"]}`,
		`{"prompt":"abcabc","n_predict":4,"dry_multiplier":0.8,"dry_penalty_last_n":5,"dry_sequence_breakers":["b","\n"],"xtc_probability":1,"xtc_threshold":0.01,"temperature":2,"samplers":["dry","xtc","typ_p","temperature"],"typical_p":0.5}`,
		`{"prompt":"a","mirostat":1,"mirostat_tau":0,"temperature":0.5,"n_predict":3,"min_keep":5,"top_p":0.1}`, `{"prompt":"a","mirostat":2,"mirostat_eta":9,"n_predict":3,"repeat_penalty":1e-9}`,
		`{"prompt":"a","top_n_sigma":0.5,"dynatemp_range":2,"dynatemp_exponent":0,"samplers":"kxtys","n_predict":3,"min_p":0.5}`)
}

// fuzzOpenAIErrors fuzzes bodies posted to s at path a or b (seeded with
// seeds on both): none may fail with a 5xx or an error outside OpenAI's format.
func fuzzOpenAIErrors(f *testing.F, s *testServer, a, b string, seeds ...string) {
	for _, body := range seeds {
		f.Add(body, false)
		f.Add(body, true)
	}
	f.Fuzz(func(t *testing.T, body string, second bool) {
		path := a
		if second {
			path = b
		}
		w := s.do(t, "POST", path, body)
		if w.Code >= 500 {
			t.Fatalf("status %d for %q at %s: %s", w.Code, body, path, w.Body)
		}
		if w.Code != 200 {
			var e ErrorBody
			if err := json.Unmarshal(w.Body.Bytes(), &e); err != nil || e.Error.Message == "" {
				t.Fatalf("status %d without an error body: %s", w.Code, w.Body)
			}
		}
	})
}

// TestLlamaTokenize: /tokenize in llama-server's shape (content, add_special
// off by default, with_pieces) and /detokenize's content, as SillyTavern's
// llama.cpp connection counts tokens.
func TestLlamaTokenize(t *testing.T) {
	s := newTestServer(t, nil)
	want, _ := s.fake.Vocab().Tokenize("abc", false, true)
	w := s.do(t, "POST", "/tokenize", `{"content":"abc"}`)
	var r struct{ Tokens []int32 }
	if err := json.Unmarshal(w.Body.Bytes(), &r); err != nil || w.Code != 200 || len(r.Tokens) != len(want) || r.Tokens[0] != int32(want[0]) {
		t.Fatalf("content: %d %s, want %v", w.Code, w.Body, want)
	}
	w = s.do(t, "POST", "/tokenize", `{"content":"abc","add_special":true,"with_pieces":true}`)
	var pieces struct {
		Tokens []struct {
			ID    int32
			Piece any
		}
	}
	if err := json.Unmarshal(w.Body.Bytes(), &pieces); err != nil || len(pieces.Tokens) != len(want)+1 || pieces.Tokens[0].ID != 1 || pieces.Tokens[1].Piece == nil {
		t.Fatalf("with_pieces: %d %s", w.Code, w.Body)
	}
	if w := s.do(t, "POST", "/tokenize", `{"content":"a","prompt":"b"}`); w.Code != 400 {
		t.Fatalf("content and prompt: %d %s", w.Code, w.Body)
	}
	w = s.do(t, "POST", "/detokenize", fmt.Sprintf(`{"tokens":[%d,%d]}`, want[0], want[1]))
	var d DetokenizeResponse
	if err := json.Unmarshal(w.Body.Bytes(), &d); err != nil || d.Content == "" || d.Content != d.Prompt {
		t.Fatalf("detokenize: %d %s", w.Code, w.Body)
	}
}

// TestRepeatLastN: llama-server's and Ollama's repeat_last_n sets the window of
// the repetition penalty; 0 turns it off; below -1 is refused.
func TestRepeatLastN(t *testing.T) {
	s := newTestServer(t, nil)
	b := s.backend.Load()
	penalty, window := 1.3, 32
	p, err := s.samplingPlan(b, &SamplingFields{RepetitionPenalty: &penalty, RepeatLastN: &window}, "max_tokens", nil)
	if err != nil || p.req.Sampling.RepeatLastN != 32 || p.req.Sampling.RepeatPenalty != float32(penalty) {
		t.Fatalf("window 32: %+v %v", p.req.Sampling, err)
	}
	off := 0
	if p, err = s.samplingPlan(b, &SamplingFields{RepetitionPenalty: &penalty, RepeatLastN: &off}, "max_tokens", nil); err != nil || p.req.Sampling.RepeatPenalty != 1 {
		t.Fatalf("window 0: %+v %v", p.req.Sampling, err)
	}
	if w := s.do(t, "POST", "/api/generate", `{"model":"fake","prompt":"a","stream":false,"options":{"repeat_last_n":-2,"num_predict":1}}`); w.Code != 400 || !strings.Contains(w.Body.String(), "repeat_last_n") {
		t.Fatalf("Ollama's repeat_last_n -2: %d %s", w.Code, w.Body)
	}
}

// TestLogitBiasForms: an object's keys are ids when they read as ids, an
// array's strings are always texts, and null is refused.
func TestLogitBiasForms(t *testing.T) {
	var l LogitBias
	if err := json.Unmarshal([]byte(`{"3":1,"ab":false}`), &l); err != nil || len(l) != 2 || l[0].ID != 3 || l[0].IsText || !l[1].IsText || l[1].Bias != banBias {
		t.Fatalf("object: %+v %v", l, err)
	}
	if err := json.Unmarshal([]byte(`[["3",-1],[5,2]]`), &l); err != nil || !l[0].IsText || l[0].Text != "3" || l[1].ID != 5 {
		t.Fatalf("array: %+v %v", l, err)
	}
	for _, bad := range []string{`{"3":null}`, `[[null,5]]`, `[[3,true]]`, `[[3]]`, `"x"`, `{"3":"1"}`} {
		if err := json.Unmarshal([]byte(bad), &l); err == nil {
			t.Errorf("%s accepted: %+v", bad, l)
		}
	}
}

// TestLlamaProbsStop: the tokens a stop string took out of the answer are not in
// its completion_probabilities.
func TestLlamaProbsStop(t *testing.T) {
	s := newTestServer(t, nil)
	w := s.do(t, "POST", "/completion", `{"prompt":"abc","n_predict":4,"temperature":0}`)
	var whole InfillResponse
	if err := json.Unmarshal(w.Body.Bytes(), &whole); err != nil || len(whole.Content) != 4 {
		t.Fatalf("%d %s", w.Code, w.Body)
	}
	w = s.do(t, "POST", "/completion", `{"prompt":"abc","n_predict":4,"temperature":0,"n_probs":1,"stop":["`+whole.Content[2:]+`"]}`)
	var cut InfillResponse
	if err := json.Unmarshal(w.Body.Bytes(), &cut); err != nil || cut.Content != whole.Content[:2] || len(cut.CompletionProbabilities) != 2 {
		t.Fatalf("stopped at %q: %s", whole.Content[2:], w.Body)
	}
}

// TestLlamaServerPaths: llama-server's paths of OpenAI's endpoints without
// /v1 answer as those do, behind the same key.
func TestLlamaServerPaths(t *testing.T) {
	s := newTestServer(t, func(c *Config, _ *scheduler.Config) { c.APIKeys = []string{"k"} })
	key := "Bearer k"
	for _, c := range []struct{ method, path, body, want string }{
		{"GET", "/models", "", `"id":"fake"`},
		{"POST", "/chat/completions", `{"messages":[{"role":"user","content":"hi"}],"max_tokens":2}`, `"object":"chat.completion"`},
		{"GET", "/v1/health", "", `"status":"ok"`},
	} {
		w := s.do(t, c.method, c.path, c.body, "Authorization", key)
		if w.Code != 200 || !strings.Contains(w.Body.String(), c.want) {
			t.Errorf("%s %s: %d %s", c.method, c.path, w.Code, w.Body)
		}
		if c.path != "/v1/health" {
			if w := s.do(t, c.method, c.path, c.body); w.Code != 401 {
				t.Errorf("%s %s without the key: %d", c.method, c.path, w.Code)
			}
		}
	}
}
