package api

import (
	"encoding/json"
	"fmt"
	"net/http"
	"slices"
	"strings"
	"testing"

	"github.com/shoal-ai/shoal/models"
	"github.com/shoal-ai/shoal/scheduler"
)

func TestOllamaNames(t *testing.T) {
	for in, want := range map[string]string{"qwen": "qwen", "qwen:latest": "qwen", "qwen:7b": "qwen:7b", "a:b:latest": "a:b:latest", ":latest": "", "org/m:latest": "org/m"} {
		if got := ollamaModel(in); got != want {
			t.Errorf("ollamaModel(%q) = %q, want %q", in, got, want)
		}
	}
	for in, want := range map[string]string{"llama 8B Q4_K - Medium": "Q4_K_M", "llama ?B all F32": "F32", "qwen2 7B F16": "F16",
		"llama 7B IQ2_XXS - 2.0625 bpw": "IQ2_XXS", "llama 1B Q8_0 (guessed)": "Q8_0", "llama": "", "gemma3 4B Q3_K - Small": "Q3_K_S"} {
		if got := quantization(in); got != want {
			t.Errorf("quantization(%q) = %q, want %q", in, got, want)
		}
	}
	for n, want := range map[uint64]string{7_615_616_512: "7.6B", 110_200_000: "110.2M", 260_000: "260.0K", 12: "12"} {
		if got := parameterSize(n); got != want {
			t.Errorf("parameterSize(%d) = %q, want %q", n, got, want)
		}
	}
}

// TestOllamaShapes: the fake engine's answers in Ollama's shapes, whole and
// as newline-delimited JSON, and its errors as {"error": "..."}.
func TestOllamaShapes(t *testing.T) {
	s := newTestServer(t, nil)
	w := s.do(t, "POST", "/api/chat", `{"model": "fake:latest", "messages": [{"role": "user", "content": "hi"}], "stream": false, "options": {"num_predict": 3, "num_ctx": 99, "mirostat": 2}}`)
	var chat struct {
		Model   string
		Message struct{ Role, Content string }
		Done    bool
		Reason  string `json:"done_reason"`
		Evals   int    `json:"eval_count"`
		Prompt  int    `json:"prompt_eval_count"`
	}
	if w.Code != 200 || json.Unmarshal(w.Body.Bytes(), &chat) != nil || chat.Model != "fake" || chat.Message.Role != "assistant" ||
		chat.Message.Content == "" || !chat.Done || chat.Reason != "length" || chat.Evals != 3 || chat.Prompt == 0 {
		t.Fatalf("%d %s", w.Code, w.Body)
	}
	w = s.do(t, "POST", "/api/generate", `{"model": "fake", "prompt": "hi", "raw": true, "options": {"num_predict": 3}}`)
	lines := strings.Split(strings.TrimSuffix(w.Body.String(), "\n"), "\n")
	var text strings.Builder
	for i, l := range lines {
		var r struct {
			Response *string
			Done     bool
			Context  []int
		}
		if err := json.Unmarshal([]byte(l), &r); err != nil || r.Response == nil || r.Done != (i == len(lines)-1) || r.Done != (len(r.Context) > 0) {
			t.Fatalf("line %d %q: %v", i, l, err)
		}
		text.WriteString(*r.Response)
	}
	// A line per token that has text (a sampled token may have none), then the last.
	if w.Header().Get("Content-Type") != "application/x-ndjson" || len(lines) < 2 || len(lines) > 4 || text.Len() == 0 {
		t.Fatalf("generate stream: %s", w.Body)
	}
	// The end-of-generation token that ends an answer is neither in its
	// logprobs nor in its context, as Ollama leaves it out.
	s.fake.EOSAt = 6
	w = s.do(t, "POST", "/api/generate", `{"prompt": "hi", "raw": true, "stream": false, "logprobs": true, "options": {"num_predict": 50}}`)
	s.fake.EOSAt = 0
	var ended struct {
		Context  []int
		Logprobs []struct{ Token string }
		Reason   string `json:"done_reason"`
		Evals    int    `json:"eval_count"`
	}
	eos := int(s.backend.Load().Vocab.EOS())
	if w.Code != 200 || json.Unmarshal(w.Body.Bytes(), &ended) != nil || ended.Reason != "stop" || len(ended.Logprobs) != ended.Evals-1 || slices.Contains(ended.Context, eos) {
		t.Fatalf("an answer ended by EOS: %d %s", w.Code, w.Body)
	}
	// A final assistant message is continued, as Ollama continues it.
	msgs := `[{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hello there,"}]`
	w = s.do(t, "POST", "/api/chat", `{"messages": `+msgs+`, "stream": false, "options": {"num_predict": 1}}`)
	var tok TokenizeResponse
	json.Unmarshal(s.do(t, "POST", "/tokenize", `{"messages": `+msgs+`, "continue_final_message": true, "add_generation_prompt": false}`).Body.Bytes(), &tok)
	if w.Code != 200 || !strings.Contains(w.Body.String(), fmt.Sprintf(`"prompt_eval_count":%d,`, tok.Count)) {
		t.Fatalf("a final assistant message, continued: %d %s, want %d prompt tokens", w.Code, w.Body, tok.Count)
	}
	// Integer options as JSON floats, roles in capitals, as Ollama reads them.
	w = s.do(t, "POST", "/api/chat", `{"messages": [{"role": "User", "content": "hi"}], "stream": false, "options": {"num_predict": 2.0, "top_k": 40.0, "seed": 7.0}}`)
	if w.Code != 200 || !strings.Contains(w.Body.String(), `"eval_count":2`) {
		t.Fatalf("float options: %d %s", w.Code, w.Body)
	}
	// Loading and unloading, as Ollama's clients ask for them.
	for body, reason := range map[string]string{`{"model": "fake"}`: "load", `{"keep_alive": "0m"}`: "unload", `{"keep_alive": 0}`: "unload", `{"keep_alive": -1}`: "load"} {
		if w := s.do(t, "POST", "/api/chat", body); w.Code != 200 || !strings.Contains(w.Body.String(), `"done_reason":"`+reason+`"`) {
			t.Errorf("%s: %d %s, want %s", body, w.Code, w.Body, reason)
		}
	}
	// llama.cpp's values, which Ollama passes on: top_p 0 and a temperature
	// below 0 draw the likeliest token; any temperature above is taken.
	for _, o := range []string{`"top_p": 0`, `"temperature": -1`, `"temperature": 5`} {
		if w := s.do(t, "POST", "/api/chat", `{"messages": [{"role": "user", "content": "hi"}], "stream": false, "options": {"num_predict": 2, `+o+`}}`); w.Code != 200 {
			t.Errorf("%s: %d %s", o, w.Code, w.Body)
		}
	}
	for _, tc := range []struct {
		method, path, body string
		status             int
		says               string
	}{
		{"POST", "/api/chat", `{"model": "other", "messages": [{"role": "user", "content": "hi"}]}`, 404, `"other" does not exist`},
		{"POST", "/api/chat", `{"messages": [{"role": "user", "content": "hi"}], "options": {"num_predict": -3}}`, 400, "options.num_predict"},
		{"POST", "/api/chat", `{"messages": [{"role": "user", "content": "hi"}], "options": {"top_k": "x"}}`, 400, "options.top_k"},
		{"POST", "/api/chat", `{"messages": [{"role": "robot", "content": "hi"}]}`, 400, `role "robot"`},
		{"POST", "/api/chat", `{"messages": [{"role": "user", "content": "hi"}], "format": "yaml"}`, 400, "format"},
		{"POST", "/api/chat", `{"messages": [{"role": "user", "content": "hi"}], "think": "maximal"}`, 400, "think"},
		{"POST", "/api/chat", `{"messages": [{"role": "user", "content": "hi"}], "think": "max"}`, 400, "does not think"},
		{"POST", "/api/chat", `{"model": "nope", "messages": []}`, 404, "not found"},
		{"POST", "/api/chat", `{"messages": [{"role": "user", "content": "hi"}], "options": {"num_predict": 1.5e300}}`, 400, "options.num_predict"},
		{"POST", "/api/chat", `{"messages": [{"role": "user", "content": "hi"}], "options": {"temperature": "hot"}}`, 400, "options.temperature"},
		{"POST", "/api/chat", `{"messages": [{"role": "user", "content": "hi"}], "options": {"min_p": 2}}`, 400, "options.min_p must be"},
		{"POST", "/api/chat", `{"messages": [{"role": "user", "content": "hi"}], "options": {"mirostat": 3}}`, 400, "mirostat must be 0 (off), 1 or 2"},
		{"POST", "/api/chat", `{"messages": [{"role": "user", "content": "hi"}], "options": {"typical_p": 2}}`, 400, "typical_p must be"},
		{"POST", "/api/generate", `{"prompt": "hi", "template": "{{ .Prompt }}"}`, 400, "template"},
		{"POST", "/api/generate", `{"prompt": "hi", "raw": true, "system": "s"}`, 400, "raw"},
		{"POST", "/api/generate", `{"prompt": "hi", "raw": true, "context": [1]}`, 400, "raw"},
		{"POST", "/api/generate", `{"prompt": "hi", "context": [1, 99999999]}`, 400, "context"},
		{"POST", "/api/generate", `{"prompt": "hi", "logprobs": true, "top_logprobs": 30}`, 400, "top_logprobs"},
		{"POST", "/api/embed", `{"input": "hi"}`, 400, "embeddings"},
		{"POST", "/api/create", `{"model": "x"}`, 501, "serves the model it was started with"},
		{"POST", "/api/show", `{"model": "nope"}`, 404, "not found"},
		{"GET", "/api/nope", ``, 404, "no route"},
		{"GET", "/api/chat", ``, 405, "not allowed"},
		{"POST", "/api/chat", `{"messages": `, 400, "JSON"},
	} {
		w := s.do(t, tc.method, tc.path, tc.body)
		var e struct{ Error *string }
		if w.Code != tc.status || json.Unmarshal(w.Body.Bytes(), &e) != nil || e.Error == nil || !strings.Contains(*e.Error, tc.says) {
			t.Errorf("%s %s %s: %d %s, want %d saying %q", tc.method, tc.path, tc.body, w.Code, w.Body, tc.status, tc.says)
		}
	}
	for _, path := range []string{"/api/tags", "/api/ps", "/api/version", "/"} {
		if w := s.do(t, "GET", path, ""); w.Code != http.StatusOK {
			t.Errorf("GET %s: %d %s", path, w.Code, w.Body)
		}
	}
}

// FuzzOllamaRequests: no body makes Ollama's endpoints fail with 5xx or answer
// an error outside Ollama's format.
func FuzzOllamaRequests(f *testing.F) {
	// Ollama's requests leave num_predict unset more often than not: they stop
	// at 8 tokens here, not at the fake's full context, so that fuzzing moves.
	s := newTestServer(f, func(c *Config, sc *scheduler.Config) { c.MaxTokensCap, sc.DefaultMaxTokens = 8, 8 })
	js := newTestServer(f, func(c *Config, sc *scheduler.Config) {
		c.MaxTokensCap, sc.DefaultMaxTokens = 8, 8
		c.SchemaToGrammar = func([]byte) (string, error) { return "root ::= \"{}\"\n", nil }
	})
	b := *js.backend.Load()
	b.Template = models.ToolsTemplate
	js.SetBackend(&b)
	for i, body := range []string{
		`{"model":"fake","messages":[{"role":"user","content":"hi"}],"options":{"num_predict":2,"stop":["a"],"seed":-1}}`,
		`{"messages":[{"role":"user","content":"x"},{"role":"assistant","tool_calls":[{"function":{"name":"f","arguments":{"a":1}}}]},{"role":"tool","tool_name":"f","content":"r"}],"tools":[{"type":"function","function":{"name":"f"}}],"format":"json","options":{"num_predict":3}}`,
		`{"prompt":"x","system":"s","format":{"type":"object"},"think":false,"options":{"num_predict":2},"context":[1,2],"stream":false}`,
		`{"prompt":"x","raw":true,"suffix":"y","logprobs":true,"top_logprobs":2,"options":{"num_predict":1}}`,
		`{"messages":[],"keep_alive":0}`, `{"prompt":"","keep_alive":"5m"}`, `{"input":["a","b"],"truncate":false}`, `{"model":"fake:latest"}`,
		`null`, `[]`, `{"options":null,"messages":null}`, `{"think":"high","messages":[{"role":"user","content":"x"}]}`,
	} {
		for which := range uint8(4) {
			f.Add(body, which+uint8(i%2)*4)
		}
	}
	paths := []string{"/api/chat", "/api/generate", "/api/embed", "/api/show"}
	f.Fuzz(func(t *testing.T, body string, which uint8) {
		srv := s
		if which >= 4 {
			srv = js
		}
		w := srv.do(t, "POST", paths[int(which)%len(paths)], body)
		if w.Code >= 500 {
			t.Fatalf("status %d for %q: %s", w.Code, body, w.Body)
		}
		if w.Code != 200 {
			var e struct{ Error *string }
			if err := json.Unmarshal(w.Body.Bytes(), &e); err != nil || e.Error == nil || *e.Error == "" {
				t.Fatalf("status %d without an error in Ollama's format: %s", w.Code, w.Body)
			}
		}
	})
}
