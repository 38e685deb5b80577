package api

import (
	"bufio"
	"bytes"
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/gin-gonic/gin"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/shoal-ai/shoal/cluster"
	"github.com/shoal-ai/shoal/engine"
	"github.com/shoal-ai/shoal/engine/enginetest"
	"github.com/shoal-ai/shoal/models"
	"github.com/shoal-ai/shoal/scheduler"
)

var update = flag.Bool("update", false, "rewrite golden files")

type testServer struct {
	*Server
	sched *scheduler.Scheduler
	fake  *enginetest.Fake
	reg   *prometheus.Registry
}

func newTestServer(t testing.TB, mod func(*Config, *scheduler.Config)) *testServer {
	t.Helper()
	f := enginetest.New(4096, 32, 512)
	cfg := DefaultConfig()
	cfg.ModelName = "fake"
	cfg.CacheInfo = map[string]string{"block_size": "16"}
	sc := scheduler.DefaultConfig()
	sc.MaxRunning = 16
	if mod != nil {
		mod(&cfg, &sc)
	}
	sched, err := scheduler.New(sc, f, nil)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { defer close(done); sched.Run(ctx) }()
	t.Cleanup(func() { cancel(); <-done })
	reg := prometheus.NewRegistry()
	s, err := New(cfg, reg, slog.New(slog.NewTextHandler(io.Discard, nil)))
	if err != nil {
		t.Fatal(err)
	}
	s.now = func() time.Time { return time.Unix(1700000000, 0) }
	s.newID = func(p string) string { return p + "-test" }
	s.SetBackend(&Backend{Generator: sched, Vocab: f.Vocab(), Info: f.Info(), Capacity: f.Capacity()})
	return &testServer{Server: s, sched: sched, fake: f, reg: reg}
}

func (s *testServer) do(t testing.TB, method, path, body string, hdr ...string) *httptest.ResponseRecorder {
	t.Helper()
	req := httptest.NewRequest(method, path, strings.NewReader(body))
	req.Header.Set("Content-Type", "application/json")
	for i := 0; i+1 < len(hdr); i += 2 {
		req.Header.Set(hdr[i], hdr[i+1])
	}
	w := httptest.NewRecorder()
	s.Handler().ServeHTTP(w, req)
	return w
}

func golden(t *testing.T, name string, got []byte) {
	t.Helper()
	p := filepath.Join("testdata", name+".golden")
	if *update {
		if err := os.WriteFile(p, got, 0o644); err != nil {
			t.Fatal(err)
		}
		return
	}
	want, err := os.ReadFile(p)
	if err != nil {
		t.Fatalf("%v (run go test ./api -update to create it)", err)
	}
	if !bytes.Equal(got, want) {
		t.Fatalf("%s differs from golden file:\n--- got\n%s\n--- want\n%s", name, got, want)
	}
}

func TestGoldenEncodings(t *testing.T) {
	s := newTestServer(t, nil)
	cases := []struct{ name, path, body string }{
		{"chat", "/v1/chat/completions", `{"model":"fake","messages":[{"role":"user","content":"hi"}],"max_tokens":5,"temperature":0}`},
		{"chat_stream", "/v1/chat/completions", `{"messages":[{"role":"system","content":[{"type":"text","text":"be brief"}]},{"role":"user","content":"hi"}],"max_tokens":4,"temperature":0,"stream":true,"stream_options":{"include_usage":true}}`},
		{"chat_logprobs", "/v1/chat/completions", `{"messages":[{"role":"user","content":"hi"}],"max_tokens":2,"temperature":0,"logprobs":true,"top_logprobs":2}`},
		{"completion", "/v1/completions", `{"model":"fake","prompt":"abc","max_tokens":4,"temperature":0,"echo":true}`},
		{"completion_multi", "/v1/completions", `{"prompt":["abc","xyz"],"max_tokens":3,"temperature":0,"n":2}`},
		{"completion_tokens_stream", "/v1/completions", `{"prompt":[1,5,6,7],"max_tokens":3,"temperature":0,"stream":true}`},
		{"completion_stop", "/v1/completions", `{"prompt":"abc","max_tokens":20,"temperature":0,"stop":["zz","q"]}`},
		{"models", "/v1/models", ``},
		{"model", "/v1/models/fake", ``},
		{"tokenize", "/tokenize", `{"prompt":"abc"}`},
		{"detokenize", "/detokenize", `{"tokens":[3,4,5]}`},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			method := http.MethodPost
			if c.body == "" {
				method = http.MethodGet
			}
			w := s.do(t, method, c.path, c.body)
			if w.Code != http.StatusOK {
				t.Fatalf("status %d: %s", w.Code, w.Body)
			}
			body := w.Body.Bytes()
			if c.name == "models" || c.name == "model" {
				body = bytes.ReplaceAll(body, fmt.Appendf(nil, `"created":%d`, s.started.Unix()), []byte(`"created":0`))
			}
			golden(t, c.name, body)
		})
	}
}

func TestStreamFormat(t *testing.T) {
	s := newTestServer(t, nil)
	w := s.do(t, "POST", "/v1/chat/completions", `{"messages":[{"role":"user","content":"hi"}],"max_tokens":3,"stream":true}`)
	if ct := w.Header().Get("Content-Type"); ct != "text/event-stream" {
		t.Fatalf("content type %q", ct)
	}
	events := strings.Split(strings.TrimSuffix(w.Body.String(), "\n\n"), "\n\n")
	if events[len(events)-1] != "data: [DONE]" {
		t.Fatalf("last event %q", events[len(events)-1])
	}
	for _, e := range events[:len(events)-1] {
		var chunk ChatChunk
		if err := json.Unmarshal([]byte(strings.TrimPrefix(e, "data: ")), &chunk); err != nil || chunk.Object != "chat.completion.chunk" {
			t.Fatalf("event %q: %v", e, err)
		}
		if strings.Contains(e, `"usage"`) {
			t.Fatalf("usage without include_usage: %q", e)
		}
	}
}

func TestErrors(t *testing.T) {
	s := newTestServer(t, func(c *Config, sc *scheduler.Config) {
		c.APIKeys = []string{"k1", "k2"}
		c.MaxBodyBytes = 2048
		c.MaxTokensCap = 100
	})
	auth := []string{"Authorization", "Bearer k2"}
	long := strings.Repeat("a", 5000)
	cases := []struct {
		name, path, body string
		hdr              []string
		status           int
		code             string
	}{
		{"no key", "/v1/models", "", nil, 401, "invalid_api_key"},
		{"wrong key", "/v1/chat/completions", `{}`, []string{"Authorization", "Bearer nope"}, 401, "invalid_api_key"},
		{"bad json", "/v1/chat/completions", `{"messages":`, auth, 400, ""},
		{"wrong type", "/v1/chat/completions", `{"messages":"hi"}`, auth, 400, ""},
		{"empty messages", "/v1/chat/completions", `{"messages":[]}`, auth, 400, ""},
		{"bad role", "/v1/chat/completions", `{"messages":[{"role":"robot","content":"x"}]}`, auth, 400, ""},
		{"unknown model id", "/v1/models/gpt-9", "", auth, 404, "model_not_found"},
		{"unknown model", "/v1/chat/completions", `{"model":"gpt-9","messages":[{"role":"user","content":"x"}]}`, auth, 404, "model_not_found"},
		{"temperature", "/v1/completions", `{"prompt":"x","temperature":7}`, auth, 400, ""},
		{"max tokens cap", "/v1/completions", `{"prompt":"x","max_tokens":101}`, auth, 400, ""},
		{"long stop", "/v1/completions", `{"prompt":"x","stop":["` + strings.Repeat("s", 1025) + `"]}`, auth, 400, ""},
		{"too many stops", "/v1/completions", `{"prompt":"x","stop":["` + strings.Repeat(`s","`, MaxStops) + `s"]}`, auth, 400, ""},
		{"token out of range", "/v1/completions", `{"prompt":[1,999]}`, auth, 400, ""},
		{"body too large", "/v1/completions", `{"prompt":"` + long + `"}`, auth, 413, "request_too_large"},
		{"prompt too long", "/v1/completions", `{"prompt":[` + strings.TrimSuffix(strings.Repeat("5,", 1500), ",") + `]}`, auth, 413, "request_too_large"},
		{"no route", "/v2/nothing", `{}`, auth, 404, "not_found"},
		{"embeddings", "/v1/embeddings", `{"input":"x"}`, auth, 400, ""},
		{"bad schema", "/v1/chat/completions", `{"messages":[{"role":"user","content":"x"}],"response_format":{"type":"json_schema"}}`, auth, 400, ""},
		{"tool type", "/v1/chat/completions", `{"messages":[{"role":"user","content":"x"}],"tools":[{"type":"retrieval"}]}`, auth, 400, ""},
		{"tool choice unknown function", "/v1/chat/completions", `{"messages":[{"role":"user","content":"x"}],"tools":[{"type":"function","function":{"name":"f"}}],"tool_choice":{"type":"function","function":{"name":"g"}}}`, auth, 400, ""},
		{"tool choice required", "/v1/chat/completions", `{"messages":[{"role":"user","content":"x"}],"tool_choice":"required"}`, auth, 400, ""},
		{"functions", "/v1/chat/completions", `{"messages":[{"role":"user","content":"x"}],"functions":[{"name":"f"}]}`, auth, 400, ""},
		{"function call history", "/v1/chat/completions", `{"messages":[{"role":"user","content":"x"},{"role":"assistant","content":null,"function_call":{"name":"f","arguments":"{}"}}]}`, auth, 400, ""},
		{"malformed tool call history", "/v1/chat/completions", `{"messages":[{"role":"user","content":"x"},{"role":"assistant","tool_calls":[{"function":{"arguments":"{}"}}]}]}`, auth, 400, ""},
		{"logit bias key", "/v1/completions", `{"prompt":"x","logit_bias":{"-5":1}}`, auth, 400, ""},
		{"logit bias pair", "/v1/completions", `{"prompt":"x","logit_bias":[[3,true]]}`, auth, 400, ""},
		{"logit bias value", "/v1/completions", `{"prompt":"x","logit_bias":{"3":1000}}`, auth, 400, ""},
		{"penalty", "/v1/completions", `{"prompt":"x","frequency_penalty":5}`, auth, 400, ""},
		{"min tokens", "/v1/completions", `{"prompt":"x","max_tokens":2,"min_tokens":3}`, auth, 400, ""},
		{"stop token ids", "/v1/completions", `{"prompt":"x","stop_token_ids":[-1]}`, auth, 400, ""},
		{"detokenize without tokens", "/detokenize", `{}`, auth, 400, ""},
		{"continue a user message", "/v1/chat/completions", `{"messages":[{"role":"user","content":"x"}],"continue_final_message":true}`, auth, 400, ""},
		{"messages without max_tokens", "/v1/messages", `{"messages":[{"role":"user","content":"x"}]}`, auth, 400, ""},
		{"priority under fcfs", "/v1/chat/completions", `{"messages":[{"role":"user","content":"x"}],"priority":-1}`, auth, 400, ""},
		{"compressed body", "/v1/completions", `{"prompt":"x"}`, []string{"Authorization", "Bearer k2", "Content-Encoding", "gzip"}, 415, "unsupported_content_encoding"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			method := "POST"
			if c.body == "" {
				method = "GET"
			}
			w := s.do(t, method, c.path, c.body, c.hdr...)
			if w.Code != c.status {
				t.Fatalf("status %d, want %d: %s", w.Code, c.status, w.Body)
			}
			var e ErrorBody
			if err := json.Unmarshal(w.Body.Bytes(), &e); err != nil || e.Error.Message == "" || e.Error.Type == "" {
				t.Fatalf("not an OpenAI error body: %s", w.Body)
			}
			if c.code != "" && (e.Error.Code == nil || *e.Error.Code != c.code) {
				t.Fatalf("code %v, want %s", e.Error.Code, c.code)
			}
		})
	}
}

// TestClientGoneCountsAbort: the choices of a client that left count as
// finished_reason "abort", as vLLM counts them; every reason is there at 0
// first; the request is answered (and counted) as 499, not as a server error.
func TestClientGoneCountsAbort(t *testing.T) {
	s := newTestServer(t, nil)
	abort := s.metrics.success.WithLabelValues("abort")
	if n := testutil.CollectAndCount(s.metrics.success); n != 3 {
		t.Fatalf("%d finish reasons before any request, want stop, length and abort", n)
	}
	s.fake.Delay = time.Millisecond
	for _, stream := range []bool{false, true} {
		before := testutil.ToFloat64(abort)
		ctx, cancel := context.WithCancel(context.Background())
		body := fmt.Sprintf(`{"prompt":["a","b"],"n":2,"max_tokens":2000,"ignore_eos":true,"stream":%v}`, stream)
		req := httptest.NewRequestWithContext(ctx, "POST", "/v1/completions", strings.NewReader(body))
		req.Header.Set("Content-Type", "application/json")
		done := make(chan struct{})
		w := httptest.NewRecorder()
		go func() { defer close(done); s.Handler().ServeHTTP(w, req) }()
		deadline := time.Now().Add(5 * time.Second)
		for s.sched.Load().Running == 0 {
			if time.Now().After(deadline) {
				t.Fatal("the request never ran")
			}
			time.Sleep(time.Millisecond)
		}
		cancel()
		<-done
		if got := testutil.ToFloat64(abort) - before; got != 4 {
			t.Fatalf("stream %v: %v choices counted as aborted, want 2 prompts × n=2", stream, got)
		}
		if want := map[bool]int{false: StatusClientClosed, true: 200}[stream]; w.Code != want {
			t.Errorf("stream %v: status %d, want %d", stream, w.Code, want)
		}
	}
	if body := s.do(t, "GET", "/metrics", "").Body.String(); strings.Contains(body, `status="5xx"`) {
		t.Error("a client that hung up was counted as a server error")
	}
}

// TestPriorityScheduling: priority 0 is every server's default; another priority
// is taken only when the server schedules by priority.
func TestPriorityScheduling(t *testing.T) {
	body := func(p int) string {
		return fmt.Sprintf(`{"prompt":"x","max_tokens":1,"priority":%d}`, p)
	}
	fcfs := newTestServer(t, nil)
	if w := fcfs.do(t, "POST", "/v1/completions", body(0)); w.Code != 200 {
		t.Fatalf("priority 0 under fcfs: status %d: %s", w.Code, w.Body)
	}
	w := fcfs.do(t, "POST", "/v1/completions", body(5))
	if w.Code != 400 || !strings.Contains(w.Body.String(), "--scheduling-policy priority") {
		t.Fatalf("priority 5 under fcfs: status %d: %s", w.Code, w.Body)
	}
	prio := newTestServer(t, func(c *Config, _ *scheduler.Config) { c.PriorityScheduling = true })
	for _, p := range []int{-3, 0, 5} {
		if w := prio.do(t, "POST", "/v1/completions", body(p)); w.Code != 200 {
			t.Fatalf("priority %d under priority scheduling: status %d: %s", p, w.Code, w.Body)
		}
	}
}

// TestToolsWithToolChoiceNone: tools the model may not call anyway are not shown
// to it, so a client that always sends its tool list can ask for plain answers;
// a history with calls is rendered without offering tools.
func TestToolsWithToolChoiceNone(t *testing.T) {
	s := newTestServer(t, nil)
	for _, body := range []string{
		`{"messages":[{"role":"user","content":"x"}],"max_tokens":2,"tools":[{"type":"function","function":{"name":"f"}}],"tool_choice":"none"}`,
		`{"messages":[{"role":"user","content":"x"}],"max_tokens":2,"tools":[],"tool_choice":"auto"}`,
		`{"messages":[{"role":"assistant","content":"a","tool_calls":[]},{"role":"user","content":"x"}],"max_tokens":2,"tools":null}`,
		`{"messages":[{"role":"user","content":"x"},{"role":"assistant","content":null,"tool_calls":[{"id":"a","type":"function","function":{"name":"f","arguments":"{}"}}]},{"role":"tool","tool_call_id":"a","content":"1"}],"max_tokens":2}`,
	} {
		if w := s.do(t, "POST", "/v1/chat/completions", body); w.Code != 200 {
			t.Errorf("%s: status %d: %s", body, w.Code, w.Body)
		}
	}
}

// TestCompletionTextOffsets: text_offset indexes the choice's text, streamed or
// whole (as OpenAI and vLLM count it).
func TestCompletionTextOffsets(t *testing.T) {
	s := newTestServer(t, nil)
	var whole CompletionResponse
	w := s.do(t, "POST", "/v1/completions", `{"prompt":"abc","max_tokens":4,"logprobs":1,"temperature":0}`)
	if err := json.Unmarshal(w.Body.Bytes(), &whole); err != nil || len(whole.Choices) != 1 {
		t.Fatalf("%v: %s", err, w.Body)
	}
	lp := whole.Choices[0].Logprobs
	text := whole.Choices[0].Text
	for i, off := range lp.TextOffset {
		if !strings.HasPrefix(text[off:], lp.Tokens[i]) {
			t.Fatalf("token %d %q at offset %d of %q", i, lp.Tokens[i], off, text)
		}
	}
	if lp.TextOffset[0] != 0 {
		t.Fatalf("first generated token at %d, want 0", lp.TextOffset[0])
	}
	w = s.do(t, "POST", "/v1/completions", `{"prompt":"abc","max_tokens":4,"logprobs":1,"stream":true,"temperature":0}`)
	var streamed strings.Builder
	for _, line := range strings.Split(w.Body.String(), "\n") {
		data, ok := strings.CutPrefix(line, "data: ")
		if !ok || data == "[DONE]" {
			continue
		}
		var chunk CompletionResponse
		if err := json.Unmarshal([]byte(data), &chunk); err != nil {
			t.Fatal(err)
		}
		for _, c := range chunk.Choices {
			if c.Logprobs != nil && c.Logprobs.TextOffset[0] != streamed.Len() {
				t.Fatalf("chunk %q at text_offset %d, after %d characters", c.Text, c.Logprobs.TextOffset[0], streamed.Len())
			}
			streamed.WriteString(c.Text)
		}
	}
}

// TestTokenizeMessagesLikeChat: /tokenize renders messages as chat does.
func TestTokenizeMessagesLikeChat(t *testing.T) {
	s := newTestServer(t, nil)
	count := func(role string) (int, int) {
		w := s.do(t, "POST", "/tokenize", `{"messages":[{"role":"`+role+`","content":"be brief"},{"role":"user","content":"hi"}]}`)
		var r TokenizeResponse
		json.Unmarshal(w.Body.Bytes(), &r)
		return w.Code, r.Count
	}
	codeDev, dev := count("developer")
	codeSys, sys := count("system")
	if codeDev != 200 || codeSys != 200 || dev != sys {
		t.Fatalf("developer: %d (%d tokens), system: %d (%d tokens)", codeDev, dev, codeSys, sys)
	}
	if code, _ := count("robot"); code != 400 {
		t.Fatalf("unknown role: %d", code)
	}
}

// TestMessageWithoutContent: a message needs content, or an assistant's
// tool_calls, as OpenAI's API and llama-server require; content null on an
// assistant turn with calls is fine.
func TestMessageWithoutContent(t *testing.T) {
	s := newTestServer(t, nil)
	for body, want := range map[string]string{
		`{"messages":[{"role":"user"}]}`: "messages[0].content",
		`{"messages":[{"role":"system","content":"hi"},{"role":"user","content":null}]}`: "messages[1].content",
		`{"messages":[{"role":"user","content":"hi"},{"role":"assistant"}]}`:             "messages[1].content",
		`{"messages":[{"role":"user","content":"hi"},{"role":"assistant","content":null,"tool_calls":[{"id":"c1","type":"function","function":{"name":"f","arguments":"{}"}}]},{"role":"tool","tool_call_id":"c1","content":"ok"}],"max_tokens":2}`: "",
		`{"messages":[{"role":"user","content":""}],"max_tokens":2}`: "",
		`{"messages":[{"role":"user","content":"x"},{"role":"assistant","content":[{"type":"refusal","refusal":"no"}]},{"role":"user","content":[{"type":"input_text","text":"y"}]}],"max_tokens":2}`: "",
	} {
		w := s.do(t, "POST", "/v1/chat/completions", body)
		var e struct {
			Error struct{ Param *string } `json:"error"`
		}
		json.Unmarshal(w.Body.Bytes(), &e)
		switch {
		case want == "" && w.Code != 200:
			t.Errorf("%s: %d %s", body, w.Code, w.Body)
		case want != "" && (w.Code != 400 || e.Error.Param == nil || *e.Error.Param != want):
			t.Errorf("%s: %d %s, want 400 on %s", body, w.Code, w.Body, want)
		}
	}
	// A field of the wrong type is still named by its path.
	w := s.do(t, "POST", "/v1/chat/completions", `{"messages":[{"role":5,"content":"hi"}]}`)
	if w.Code != 400 || !strings.Contains(w.Body.String(), `"messages.role"`) {
		t.Fatalf("role 5: %d %s", w.Code, w.Body)
	}
}

// TestCloseConnectionMidBody: a forwarded answer cut short after its first bytes
// reaches the client as a broken response, not as a complete one.
func TestCloseConnectionMidBody(t *testing.T) {
	r := gin.New()
	r.Use(recovery(slog.New(slog.NewTextHandler(io.Discard, nil))))
	r.GET("/", func(c *gin.Context) {
		c.Writer.Header().Set("Content-Type", "application/json")
		c.Writer.WriteHeader(http.StatusOK)
		io.WriteString(c.Writer, `{"choices":[{"text":"hel`)
		c.Writer.Flush()
		closeConnection(c)
	})
	for _, h2 := range []bool{false, true} { // HTTP/1.1, and HTTP/2 over TLS (serve --tls-cert)
		srv := httptest.NewUnstartedServer(r)
		srv.EnableHTTP2 = h2
		if h2 {
			srv.StartTLS()
		} else {
			srv.Start()
		}
		resp, err := srv.Client().Get(srv.URL)
		if err != nil {
			t.Fatal(err)
		}
		if b, err := io.ReadAll(resp.Body); err == nil {
			t.Fatalf("%s: a cut body read as whole: %q", resp.Proto, b)
		}
		resp.Body.Close()
		srv.Close()
	}
}

// TestHeadAndStalledBody: what may be read answers HEAD as GET; a request
// whose body stalls for BodyIdleTimeout is answered 408 and its connection
// let go, while a body that keeps coming (slowly) is read whole.
func TestHeadAndStalledBody(t *testing.T) {
	s := newTestServer(t, func(c *Config, _ *scheduler.Config) { c.BodyIdleTimeout = 300 * time.Millisecond })
	for _, path := range []string{"/", "/health", "/ready", "/metrics", "/v1/models", "/v1/models/fake", "/models", "/props", "/api/tags", "/api/ps", "/api/version"} {
		if w := s.do(t, http.MethodHead, path, ""); w.Code != http.StatusOK {
			t.Errorf("HEAD %s: %d %s", path, w.Code, w.Body)
		}
	}
	srv := httptest.NewServer(s.Handler())
	defer srv.Close()
	send := func(parts ...string) string {
		t.Helper()
		conn, err := net.Dial("tcp", srv.Listener.Addr().String())
		if err != nil {
			t.Fatal(err)
		}
		defer conn.Close()
		body := strings.Join(parts, "")
		fmt.Fprintf(conn, "POST /tokenize HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n", len(body)+1)
		for i, p := range parts {
			if i > 0 {
				time.Sleep(200 * time.Millisecond) // under the bound each time, over it in all
			}
			io.WriteString(conn, p)
		}
		// One byte short: the server waits for it.
		conn.SetReadDeadline(time.Now().Add(10 * time.Second))
		resp, err := http.ReadResponse(bufio.NewReader(conn), nil)
		if err != nil {
			t.Fatalf("no answer to a stalled body: %v", err)
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		return fmt.Sprint(resp.StatusCode, " ", string(b))
	}
	if got := send(`{"prompt": "hi"`, `, "add_special": false`); !strings.HasPrefix(got, "408 ") || !strings.Contains(got, "request_timeout") {
		t.Fatalf("a stalled body: %s", got)
	}
	// The whole body, in pieces slower than the bound altogether: it is read.
	conn, err := net.Dial("tcp", srv.Listener.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	parts := []string{`{"prompt":`, ` "hi",`, ` "add_special": false}`}
	fmt.Fprintf(conn, "POST /tokenize HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n", len(strings.Join(parts, "")))
	for _, p := range parts {
		time.Sleep(200 * time.Millisecond)
		io.WriteString(conn, p)
	}
	conn.SetReadDeadline(time.Now().Add(10 * time.Second))
	resp, err := http.ReadResponse(bufio.NewReader(conn), nil)
	if err != nil || resp.StatusCode != http.StatusOK {
		t.Fatalf("a slow but steady body: %v %v", resp, err)
	}
	resp.Body.Close()
}

// TestCORS: browsers may call the API only from the allowed origins; none by default.
func TestCORS(t *testing.T) {
	s := newTestServer(t, func(c *Config, _ *scheduler.Config) { c.AllowedOrigins = []string{"https://app.example"} })
	w := s.do(t, "OPTIONS", "/v1/chat/completions", "", "Origin", "https://app.example", "Access-Control-Request-Method", "POST",
		"Access-Control-Request-Headers", "authorization,content-type,x-stainless-os") // OpenAI's JS SDK
	if w.Code != 204 || w.Header().Get("Access-Control-Allow-Origin") != "https://app.example" || !strings.Contains(w.Header().Get("Access-Control-Allow-Headers"), "x-stainless-os") {
		t.Fatalf("preflight: %d %v", w.Code, w.Header())
	}
	if w := s.do(t, "GET", "/v1/models", "", "Origin", "https://app.example"); w.Header().Get("Access-Control-Allow-Origin") != "https://app.example" {
		t.Fatalf("an allowed origin's request: %v", w.Header())
	}
	if w := s.do(t, "GET", "/v1/models", "", "Origin", "https://evil.example"); w.Header().Get("Access-Control-Allow-Origin") != "" {
		t.Fatalf("another origin got CORS headers: %v", w.Header())
	}
	plain := newTestServer(t, nil)
	if w := plain.do(t, "GET", "/v1/models", "", "Origin", "https://app.example"); w.Header().Get("Access-Control-Allow-Origin") != "" {
		t.Fatalf("CORS headers without allowed origins: %v", w.Header())
	}
	cfg := DefaultConfig()
	for _, bad := range []string{"app.example", "https://app.example/", "https://app.example/x"} {
		cfg.ModelName, cfg.AllowedOrigins = "m", []string{bad}
		if cfg.Validate() == nil {
			t.Fatalf("origin %q accepted: a browser never sends it", bad)
		}
	}
}

func TestContextLengthError(t *testing.T) {
	s := newTestServer(t, nil)
	prompt := strings.TrimSuffix(strings.Repeat("5,", 4200), ",")
	w := s.do(t, "POST", "/v1/completions", `{"prompt":[`+prompt+`]}`)
	if w.Code != 400 || !strings.Contains(w.Body.String(), "4200 tokens") || !strings.Contains(w.Body.String(), "context_length_exceeded") {
		t.Fatalf("%d %s", w.Code, w.Body)
	}
	if m := s.do(t, "GET", "/metrics", "").Body.String(); !strings.Contains(m, `shoal_requests_rejected_total{model_name="fake",reason="too_long"} 1`) {
		t.Fatalf("the refusal is not counted as too_long:\n%s", m)
	}
	// A max_tokens whose sum with the prompt overflows is refused all the same.
	w = s.do(t, "POST", "/v1/completions", `{"prompt":"hi","max_tokens":9223372036854775807}`)
	if w.Code != 400 || !strings.Contains(w.Body.String(), "9223372036854775") {
		t.Fatalf("max_tokens near the largest integer: %d %s", w.Code, w.Body)
	}
}

// Without max_tokens, completions stop at 16 tokens as in OpenAI and vLLM, and
// chat runs to end-of-generation; a prompt that leaves fewer than 16 tokens of
// context is not refused for a default it never asked for. With no cap
// configured, any max_tokens the context has room for is taken, and an error
// names the field the client used.
func TestMaxTokensDefaults(t *testing.T) {
	s := newTestServer(t, nil)
	s.fake.EOSAt = 300
	usage := func(path, body string) (int, string) {
		t.Helper()
		w := s.do(t, "POST", path, body)
		var r struct {
			Choices []struct {
				FinishReason string `json:"finish_reason"`
			} `json:"choices"`
			Usage struct {
				CompletionTokens int `json:"completion_tokens"`
			} `json:"usage"`
		}
		if w.Code != 200 || json.Unmarshal(w.Body.Bytes(), &r) != nil || len(r.Choices) != 1 {
			t.Fatalf("%s %s: %d %s", path, body, w.Code, w.Body)
		}
		return r.Usage.CompletionTokens, r.Choices[0].FinishReason
	}
	if n, why := usage("/v1/completions", `{"prompt":"abc","seed":1}`); n != 16 || why != "length" {
		t.Fatalf("completions without max_tokens: %d tokens, %s", n, why)
	}
	// EOS at position 300: the chat prompt is a few dozen tokens, so well past 256.
	// (Seeded: an unseeded sample may draw EOS early, about one run in fifty.)
	if n, why := usage("/v1/chat/completions", `{"messages":[{"role":"user","content":"abc"}],"seed":1}`); n < 257 || why != "stop" {
		t.Fatalf("chat without max_tokens: %d tokens, %s", n, why)
	}
	s.fake.EOSAt = 0
	prompt := strings.TrimSuffix(strings.Repeat("5,", 4090), ",")
	if n, why := usage("/v1/completions", `{"prompt":[`+prompt+`]}`); n != 6 || why != "length" {
		t.Fatalf("completions near the context's end: %d tokens, %s", n, why)
	}
	w := s.do(t, "POST", "/v1/chat/completions", `{"messages":[{"role":"user","content":"x"}],"max_completion_tokens":0}`)
	if w.Code != 400 || !strings.Contains(w.Body.String(), `"param":"max_completion_tokens"`) {
		t.Fatalf("max_completion_tokens 0: %d %s", w.Code, w.Body)
	}
}

func TestQueueFull429(t *testing.T) {
	s := newTestServer(t, func(c *Config, sc *scheduler.Config) { sc.MaxWaiting = 1; sc.MaxRunning = 1; sc.MaxBatchTokens = 16 })
	s.fake.Delay = 5 * time.Millisecond
	// Six at once: one runs, one waits, the rest are refused at once.
	codes := make(chan *httptest.ResponseRecorder, 6)
	for range 6 {
		go func() { codes <- s.do(t, "POST", "/v1/completions", `{"prompt":"abc","max_tokens":10}`) }()
	}
	ok, full := 0, 0
	for range 6 {
		w := <-codes
		switch w.Code {
		case 200:
			ok++
		case 429:
			full++
			if w.Header().Get("Retry-After") == "" || !strings.Contains(w.Body.String(), "queue_full") {
				t.Fatalf("429 without Retry-After or code: %s", w.Body)
			}
		default:
			t.Fatalf("status %d: %s", w.Code, w.Body)
		}
	}
	if full == 0 || ok == 0 {
		t.Fatalf("%d succeeded, %d refused", ok, full)
	}
	// A request with more sequences than the queue holds is never admitted:
	// 400, not a 429 no retry gets past.
	for _, body := range []string{`{"prompt":"abc","max_tokens":2,"n":2}`, `{"prompt":["a","b"],"max_tokens":2}`} {
		if w := s.do(t, "POST", "/v1/completions", body); w.Code != 400 || !strings.Contains(w.Body.String(), "--max-waiting 1") {
			t.Errorf("%s: %d %s", body, w.Code, w.Body)
		}
	}
}

func TestNotReadyAndDrain(t *testing.T) {
	reg := prometheus.NewRegistry()
	cfg := DefaultConfig()
	cfg.ModelName = "m"
	s, err := New(cfg, reg, slog.New(slog.NewTextHandler(io.Discard, nil)))
	if err != nil {
		t.Fatal(err)
	}
	ts := &testServer{Server: s}
	if w := ts.do(t, "GET", "/ready", ""); w.Code != 503 {
		t.Fatalf("ready before load: %d", w.Code)
	}
	if w := ts.do(t, "POST", "/v1/completions", `{"prompt":"x"}`); w.Code != 503 || w.Header().Get("Retry-After") == "" {
		t.Fatalf("completion before load: %d", w.Code)
	}
	if w := ts.do(t, "GET", "/health", ""); w.Code != 200 {
		t.Fatalf("health: %d", w.Code)
	}
	for _, path := range []string{"/v1/models", "/v1/models/m", "/models", "/api/tags", "/api/ps"} {
		if w := ts.do(t, "GET", path, ""); w.Code != 503 || strings.Contains(w.Body.String(), "max_model_len") || strings.Contains(w.Body.String(), `"models"`) {
			t.Fatalf("%s before load: %d %s", path, w.Code, w.Body)
		}
	}
	full := newTestServer(t, nil)
	if w := full.do(t, "GET", "/ready", ""); w.Code != 200 {
		t.Fatalf("ready: %d", w.Code)
	}
	full.Drain()
	if w := full.do(t, "POST", "/v1/completions", `{"prompt":"x"}`); w.Code != 503 {
		t.Fatalf("while draining: %d", w.Code)
	}
}

func TestMetricsNames(t *testing.T) {
	s := newTestServer(t, nil)
	s.do(t, "POST", "/v1/completions", `{"prompt":"abc","max_tokens":3}`)
	w := s.do(t, "GET", "/metrics", "")
	for _, name := range []string{"vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
		"vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total", "vllm:prompt_tokens_total", "vllm:generation_tokens_total",
		`vllm:request_success_total{finished_reason="length",model_name="fake"} 1`, "vllm:time_to_first_token_seconds_bucket",
		"vllm:inter_token_latency_seconds", "vllm:e2e_request_latency_seconds", "vllm:request_queue_time_seconds", "vllm:cache_config_info{",
		`num_gpu_blocks="`, `kv_unified="true"`, `shoal_device_info{description="fake",device="CPU",kind="cpu"} 1`, `shoal_gpu_layers{model_name="fake"} 0`} {
		if !strings.Contains(w.Body.String(), name) {
			t.Errorf("metrics lack %s", name)
		}
	}
	// A request with n = 2 counts as two, as vLLM counts its children.
	s.do(t, "POST", "/v1/completions", `{"prompt":"abc","max_tokens":3,"n":2}`)
	w = s.do(t, "GET", "/metrics", "")
	for _, name := range []string{"vllm:e2e_request_latency_seconds_count", "vllm:request_queue_time_seconds_count", "vllm:request_prompt_tokens_count"} {
		if want := name + `{model_name="fake"} 3`; !strings.Contains(w.Body.String(), want) {
			t.Errorf("metrics lack %s", want)
		}
	}
}

// FuzzRequests posts arbitrary bodies to every JSON endpoint: the answer is never a
// 5xx and never a panic, and the server keeps serving.
func FuzzRequests(f *testing.F) {
	s := newTestServer(f, func(c *Config, sc *scheduler.Config) { c.MaxTokensCap = 8 })
	for _, b := range []string{
		`{"messages":[{"role":"user","content":"hi"}],"max_tokens":2}`,
		`{"prompt":"abc","max_tokens":2,"n":2,"stop":"b"}`,
		`{"prompt":[[1,2],[3]],"max_tokens":1,"logprobs":3}`,
		`{"messages":[{"role":"user","content":[{"type":"text","text":"x"}]}],"response_format":{"type":"json_object"},"max_tokens":2}`,
		`{"messages":[{"role":"user","content":"x"}],"tools":[{"type":"function"}],"tool_choice":{"type":"function"}}`,
		`{"prompt":"a","guided_choice":["x\"","\u0000"],"structured_outputs":{"json":"{}"},"response_format":{"type":"json_object","schema":true}}`,
		`{"prompt":"a","guided_regex":"(a|b?)*[\\d]{2}","max_tokens":2}`, `{"prompt":"a","grammar":"root ::= x\nx ::= [a-c]{1,3}","max_tokens":2}`,
		`{"prompt":"\xff\xfe","max_tokens":1e309}`, `{"n":-1}`, `[]`, `null`, `{"logit_bias":{"3":1e40}}`,
	} {
		f.Add(b, uint8(0))
		f.Add(b, uint8(1))
	}
	// A second server renders chats with a Jinja template that shows tools in
	// the Hermes format (its grammars then come from a stand-in converter).
	js := newTestServer(f, func(c *Config, sc *scheduler.Config) {
		c.MaxTokensCap = 8
		c.SchemaToGrammar = func([]byte) (string, error) { return "root ::= \"{}\"\n", nil }
	})
	b := *js.backend.Load()
	b.Template = models.ToolsTemplate
	js.SetBackend(&b)
	f.Add(`{"messages":[{"role":"user","content":"x"},{"role":"assistant","tool_calls":[{"function":{"name":"f","arguments":"{\"a\":1}"}}]},{"role":"tool","content":"r"}],"tools":[{"type":"function","function":{"name":"f"}}],"max_tokens":3,"chat_template_kwargs":{"x":1}}`, uint8(7))
	// Anthropic's Messages API (its errors also have error.message).
	for _, b := range []string{
		`{"max_tokens":3,"system":[{"type":"text","text":"s"}],"messages":[{"role":"user","content":"x"},{"role":"assistant","content":[{"type":"tool_use","id":"t","name":"f","input":{"a":1}}]},{"role":"user","content":[{"type":"tool_result","tool_use_id":"t","content":"r"},{"type":"text","text":"y"}]}],"tools":[{"name":"f","input_schema":{"type":"object"}}],"tool_choice":{"type":"any"},"stream":true}`,
		`{"max_tokens":2,"messages":[{"role":"user","content":"x"}],"thinking":{"type":"enabled","budget_tokens":1024},"output_config":{"format":{"type":"json_schema","schema":{"type":"object"}}},"stop_sequences":["a"]}`,
	} {
		f.Add(b, uint8(4))
		f.Add(b, uint8(5))
		f.Add(b, uint8(11))
	}
	// OpenAI's Responses API.
	for _, b := range []string{
		`{"input":"x","instructions":"s","max_output_tokens":3,"stream":true}`,
		`{"input":[{"role":"user","content":[{"type":"input_text","text":"x"}]},{"type":"function_call","call_id":"c","name":"f","arguments":"{}"},{"type":"function_call_output","call_id":"c","output":"r"}],"tools":[{"type":"function","name":"f","parameters":{"type":"object"}}],"tool_choice":"required","max_output_tokens":3,"text":{"format":{"type":"json_schema","name":"n","schema":{"type":"object"}}}}`,
	} {
		f.Add(b, uint8(6))
		f.Add(b, uint8(13))
	}
	paths := []string{"/v1/chat/completions", "/v1/completions", "/tokenize", "/detokenize", "/v1/messages", "/v1/messages/count_tokens", "/v1/responses"}
	f.Fuzz(func(t *testing.T, body string, which uint8) {
		srv := s
		if which >= 7 {
			srv = js
		}
		w := srv.do(t, "POST", paths[int(which)%len(paths)], body)
		if w.Code >= 500 {
			t.Fatalf("status %d for %q (jinja %v): %s", w.Code, body, which >= 7, w.Body)
		}
		if w.Code != 200 {
			var e ErrorBody
			if err := json.Unmarshal(w.Body.Bytes(), &e); err != nil || e.Error.Message == "" {
				t.Fatalf("status %d without an error body: %s", w.Code, w.Body)
			}
		}
	})
}

var _ = io.EOF

// TestPromtoolCheckMetrics lints the exposition with promtool (make test installs it).
func TestPromtoolCheckMetrics(t *testing.T) {
	path := promtool(t)
	s := newTestServer(t, nil)
	s.do(t, "POST", "/v1/completions", `{"prompt":"abc","max_tokens":3}`)
	w := s.do(t, "GET", "/metrics", "")
	cmd := exec.Command(path, "check", "metrics")
	cmd.Stdin = bytes.NewReader(w.Body.Bytes())
	out, err := cmd.CombinedOutput()
	if err == nil {
		return
	}
	// Exit status 3 is lint findings. vLLM's names contain ':' by design (dashboards
	// and routers expect them), which promtool's style lint reports, and vLLM names
	// a histogram vllm:iteration_tokens_total; anything else (exit 1: unparsable
	// exposition, or any other lint finding) fails the test.
	var ee *exec.ExitError
	if !errors.As(err, &ee) || ee.ExitCode() != 3 {
		t.Fatalf("promtool check metrics: %v\n%s", err, out)
	}
	for _, line := range strings.Split(strings.TrimSpace(string(out)), "\n") {
		vllmName := strings.HasPrefix(line, "vllm:") && strings.HasSuffix(line, "metric names should not contain ':'") ||
			line == `vllm:iteration_tokens_total non-counter metrics should not have "_total" suffix`
		if !vllmName {
			t.Errorf("promtool: %s", line)
		}
	}
}

// TestGrammarCheckedBeforeAnswer: a grammar llama.cpp would refuse is a 400
// before anything is sent, streamed or not (not an error event mid-stream).
func TestGrammarCheckedBeforeAnswer(t *testing.T) {
	s := newTestServer(t, func(c *Config, _ *scheduler.Config) {
		c.SchemaToGrammar = func([]byte) (string, error) { return "root ::= (", nil }
	})
	b := *s.backend.Load()
	b.CheckGrammar = func(string) error { return errors.New("parse error") }
	s.SetBackend(&b)
	for _, stream := range []string{"false", "true"} {
		w := s.do(t, "POST", "/v1/chat/completions", `{"messages":[{"role":"user","content":"x"}],"max_tokens":2,"stream":`+stream+
			`,"response_format":{"type":"json_schema","json_schema":{"name":"n","schema":{"type":"object"}}}}`)
		var e ErrorBody
		if w.Code != 400 || json.Unmarshal(w.Body.Bytes(), &e) != nil || e.Error.Param == nil || *e.Error.Param != "response_format" {
			t.Errorf("stream %s: %d %s", stream, w.Code, w.Body)
		}
	}
}

// TestGrammarCompileBound: a grammar whose compiling, once per choice, would
// hold up the scheduler past maxGrammarCompile is refused, naming what it
// took; a quick one is not.
func TestGrammarCompileBound(t *testing.T) {
	s := newTestServer(t, func(c *Config, _ *scheduler.Config) {
		c.SchemaToGrammar = func([]byte) (string, error) { return "root ::= \"{}\"", nil }
	})
	for _, c := range []struct {
		check  time.Duration
		n      int
		refuse bool
	}{{maxGrammarCompile + 10*time.Millisecond, 1, true}, {maxGrammarCompile / 10, 16, true}, {0, 16, false}} {
		b := *s.backend.Load()
		b.CheckGrammar = func(string) error { burn(c.check); return nil }
		s.SetBackend(&b)
		w := s.do(t, "POST", "/v1/chat/completions", fmt.Sprintf(`{"messages":[{"role":"user","content":"x"}],"max_tokens":2,"n":%d,`+
			`"response_format":{"type":"json_schema","json_schema":{"name":"n","schema":{"type":"object"}}}}`, c.n))
		if refused := w.Code == 400 && strings.Contains(w.Body.String(), "to compile"); refused != c.refuse {
			t.Errorf("check %v, n %d: %d %s", c.check, c.n, w.Code, w.Body)
		}
	}
}

// TestTokenStrs: /tokenize returns each token's text with return_token_strs,
// as vLLM's.
func TestTokenStrs(t *testing.T) {
	s := newTestServer(t, nil)
	w := s.do(t, "POST", "/tokenize", `{"prompt":"hello","add_special_tokens":false,"return_token_strs":true}`)
	var r TokenizeResponse
	if w.Code != 200 || json.Unmarshal(w.Body.Bytes(), &r) != nil || len(r.TokenStrs) != r.Count || r.Count == 0 || r.TokenStrs[0] == "" {
		t.Fatalf("%d %s", w.Code, w.Body)
	}
	if w := s.do(t, "POST", "/tokenize", `{"prompt":"hello"}`); strings.Contains(w.Body.String(), "token_strs") {
		t.Fatalf("token_strs unasked: %s", w.Body)
	}
}

// sseData is the JSON of each data event of a streamed answer, before [DONE].
func sseData(t *testing.T, body string) [][]byte {
	t.Helper()
	var out [][]byte
	for _, line := range strings.Split(body, "\n") {
		if data, ok := strings.CutPrefix(line, "data: "); ok && data != "[DONE]" {
			out = append(out, []byte(data))
		}
	}
	return out
}

// TestPromptLogprobs: echo with logprobs scores the echoed prompt's tokens in
// the completions format (the first has none), streamed as whole; vLLM's
// prompt_logprobs come on each completions choice and on a chat answer; what
// cannot be answered is refused.
func TestPromptLogprobs(t *testing.T) {
	s := newTestServer(t, nil)
	const body = `{"prompt":["abc","xyzw"],"max_tokens":3,"logprobs":2,"echo":true,"temperature":0,"n":2`
	var whole CompletionResponse
	w := s.do(t, "POST", "/v1/completions", body+`}`)
	if err := json.Unmarshal(w.Body.Bytes(), &whole); err != nil || w.Code != 200 || len(whole.Choices) != 4 {
		t.Fatalf("%d %v: %s", w.Code, err, w.Body)
	}
	for i, c := range whole.Choices {
		prompt := []string{"abc", "xyzw"}[i/2]
		lp, n := c.Logprobs, len(prompt)+1 // BOS, the prompt's bytes
		if !strings.HasPrefix(c.Text, prompt) || len(lp.Tokens) != n+3 || len(lp.TokenLogprobs) != n+3 || len(lp.TopLogprobs) != n+3 || len(lp.TextOffset) != n+3 {
			t.Fatalf("choice %d: %q %+v", i, c.Text, lp)
		}
		if lp.TokenLogprobs[0] != nil || len(lp.TopLogprobs[0]) != 0 || lp.TextOffset[n] != len(prompt) {
			t.Fatalf("choice %d: the first token has %v %v; the first generated token is at %d", i, lp.TokenLogprobs[0], lp.TopLogprobs[0], lp.TextOffset[n])
		}
		for j := 1; j < n+3; j++ {
			if lp.TokenLogprobs[j] == nil || *lp.TokenLogprobs[j] > 0 || !slices.Equal(lp.TopLogprobs[j], slices.SortedStableFunc(slices.Values(lp.TopLogprobs[j]), func(a, b NamedLogprob) int { return cmp.Compare(b.Logprob, a.Logprob) })) ||
				!hasLogprob(lp.TopLogprobs[j], lp.Tokens[j], *lp.TokenLogprobs[j]) || len(lp.TopLogprobs[j]) > 3 {
				t.Fatalf("choice %d token %d: %q %v %v", i, j, lp.Tokens[j], lp.TokenLogprobs[j], lp.TopLogprobs[j])
			}
		}
		if c.PromptLogprobs != nil {
			t.Fatalf("choice %d: prompt_logprobs not asked for: %v", i, c.PromptLogprobs)
		}
	}
	// Streamed: the echo comes with its scores, then the tokens.
	streamed := make([]CompletionLogprobs, 4)
	texts := make([]string, 4)
	for _, data := range sseData(t, s.do(t, "POST", "/v1/completions", body+`,"stream":true}`).Body.String()) {
		var chunk CompletionResponse
		if err := json.Unmarshal(data, &chunk); err != nil {
			t.Fatal(err)
		}
		for _, c := range chunk.Choices {
			texts[c.Index] += c.Text
			if l := c.Logprobs; l != nil {
				sl := &streamed[c.Index]
				sl.Tokens, sl.TokenLogprobs = append(sl.Tokens, l.Tokens...), append(sl.TokenLogprobs, l.TokenLogprobs...)
				sl.TopLogprobs, sl.TextOffset = append(sl.TopLogprobs, l.TopLogprobs...), append(sl.TextOffset, l.TextOffset...)
			}
		}
	}
	for i, c := range whole.Choices {
		a, _ := json.Marshal(c.Logprobs)
		b, _ := json.Marshal(streamed[i])
		if texts[i] != c.Text || !bytes.Equal(a, b) {
			t.Fatalf("choice %d streamed %q %s\nwhole %q %s", i, texts[i], b, c.Text, a)
		}
	}

	// Offsets never go back: they count the tokens' names, here "token_id:N",
	// through the prompt and on into the output, as vLLM's do.
	for _, stream := range []string{"false", "true"} {
		w := s.do(t, "POST", "/v1/completions", `{"prompt":"abc","max_tokens":3,"logprobs":1,"echo":true,"return_tokens_as_token_ids":true,"stream":`+stream+`}`)
		datas := [][]byte{w.Body.Bytes()}
		if stream == "true" {
			datas = sseData(t, w.Body.String())
		}
		var offsets []int
		var names []string
		for _, data := range datas {
			var r CompletionResponse
			if err := json.Unmarshal(data, &r); err != nil || w.Code != 200 {
				t.Fatalf("%d %v: %s", w.Code, err, w.Body)
			}
			for _, c := range r.Choices {
				if c.Logprobs != nil {
					offsets, names = append(offsets, c.Logprobs.TextOffset...), append(names, c.Logprobs.Tokens...)
				}
			}
		}
		if len(offsets) != 7 {
			t.Fatalf("stream %s: offsets %v", stream, offsets)
		}
		for i := 1; i < len(offsets); i++ {
			if offsets[i] != offsets[i-1]+len(names[i-1]) || !strings.HasPrefix(names[i], "token_id:") {
				t.Fatalf("stream %s: offsets %v for %q", stream, offsets, names)
			}
		}
	}

	// max_tokens 0 with echo: the prompt alone, scored (vLLM's).
	for _, stream := range []bool{false, true} {
		w := s.do(t, "POST", "/v1/completions", fmt.Sprintf(`{"prompt":"abc","max_tokens":0,"echo":true,"logprobs":1,"stream":%v,"stream_options":%s}`, stream, map[bool]string{false: "null", true: `{"include_usage":true}`}[stream]))
		var text, finish string
		var lps []*float32
		var usage *Usage
		datas := [][]byte{w.Body.Bytes()}
		if stream {
			datas = sseData(t, w.Body.String())
		}
		for _, data := range datas {
			var r CompletionResponse
			if err := json.Unmarshal(data, &r); err != nil || w.Code != 200 {
				t.Fatalf("%d %v: %s", w.Code, err, w.Body)
			}
			for _, c := range r.Choices {
				text += c.Text
				if c.FinishReason != nil {
					finish = *c.FinishReason
				}
				if c.Logprobs != nil {
					lps = append(lps, c.Logprobs.TokenLogprobs...)
				}
			}
			if r.Usage != nil {
				usage = r.Usage
			}
		}
		if text != "abc" || finish != "length" || len(lps) != 4 || lps[0] != nil || usage == nil || usage.CompletionTokens != 0 || usage.PromptTokens != 4 {
			t.Fatalf("stream %v: %q %q %d logprobs, usage %+v: %s", stream, text, finish, len(lps), usage, w.Body)
		}
	}
	if w := s.do(t, "POST", "/v1/completions", `{"prompt":"abc","max_tokens":0}`); w.Code != 400 || !strings.Contains(w.Body.String(), "echo") {
		t.Fatalf("max_tokens 0 without echo: %d %s", w.Code, w.Body)
	}

	// vLLM's prompt_logprobs, by token id.
	var pl CompletionResponse
	w = s.do(t, "POST", "/v1/completions", `{"prompt":[[1,5,9,7]],"max_tokens":2,"prompt_logprobs":1}`)
	if err := json.Unmarshal(w.Body.Bytes(), &pl); err != nil || w.Code != 200 {
		t.Fatalf("%d %v: %s", w.Code, err, w.Body)
	}
	ps := pl.Choices[0].PromptLogprobs
	if len(ps) != 4 || ps[0] != nil || pl.Choices[0].Logprobs != nil {
		t.Fatalf("prompt_logprobs %+v", pl.Choices[0])
	}
	for i, id := range []string{"5", "9", "7"} {
		m := ps[i+1]
		if e, ok := m[id]; !ok || len(m) > 2 || e.Rank < 1 || e.Logprob > 0 || e.DecodedToken == "" {
			t.Fatalf("prompt token %d (%s): %+v", i+1, id, m)
		}
	}
	var chat struct {
		PromptLogprobs []map[string]PromptLogprob `json:"prompt_logprobs"`
		Usage          Usage                      `json:"usage"`
	}
	w = s.do(t, "POST", "/v1/chat/completions", `{"messages":[{"role":"user","content":"hi"}],"max_tokens":2,"prompt_logprobs":0}`)
	if err := json.Unmarshal(w.Body.Bytes(), &chat); err != nil || w.Code != 200 || len(chat.PromptLogprobs) != chat.Usage.PromptTokens || chat.PromptLogprobs[0] != nil {
		t.Fatalf("%d %v: %s", w.Code, err, w.Body)
	}
	for i, m := range chat.PromptLogprobs[1:] {
		if len(m) != 1 {
			t.Fatalf("chat prompt token %d: %v", i+1, m)
		}
	}

	for _, bad := range []string{
		`{"prompt":"abc","prompt_logprobs":21}`,
		`{"prompt":"abc","prompt_logprobs":-1}`,
		`{"prompt":"abc","prompt_logprobs":1,"stream":true}`,
		`{"prompt":"abc","prompt_logprobs":"1"}`,
	} {
		if w := s.do(t, "POST", "/v1/completions", bad); w.Code != 400 || !strings.Contains(w.Body.String(), "prompt_logprobs") {
			t.Fatalf("%s: %d %s", bad, w.Code, w.Body)
		}
	}
}

// TestGrammarConstraints: a client's GBNF grammar or regular expression is
// checked before it reaches llama.cpp, its errors name the field and the
// place, and neither is combined with tools.
func TestGrammarConstraints(t *testing.T) {
	s := newTestServer(t, nil)
	for body, want := range map[string]string{
		`{"prompt":"a","grammar":"root ::= \"a\"\nb ::= (\"c\"","max_tokens":2}`:                                                        `"param":"grammar"`,
		`{"prompt":"a","guided_grammar":"root ::= [a-z]{9,2}","max_tokens":2}`:                                                          `line 1, column 15: repetition {9,2}`,
		`{"prompt":"a","guided_regex":"a(?=b)","max_tokens":2}`:                                                                         `"param":"guided_regex"`,
		`{"prompt":"a","structured_outputs":{"grammar":"root ::= x"},"max_tokens":2}`:                                                   `rule \"x\" is referred to but not defined`,
		`{"messages":[{"role":"user","content":"x"}],"tools":[{"type":"function","function":{"name":"f"}}],"guided_regex":"a+"}`:        `guided_regex cannot be combined with tools`,
		`{"messages":[{"role":"user","content":"x"}],"tools":[{"type":"function","function":{"name":"f"}}],"grammar":"root ::= \"a\""}`: `grammar cannot be combined with tools`,
	} {
		path := "/v1/completions"
		if strings.Contains(body, "messages") {
			path = "/v1/chat/completions"
		}
		w := s.do(t, "POST", path, body)
		if w.Code != 400 || !strings.Contains(w.Body.String(), want) {
			t.Errorf("%s: %d %s, want 400 with %s", body, w.Code, w.Body, want)
		}
	}
	// llama-server's clients send "grammar": "" for none.
	if w := s.do(t, "POST", "/v1/completions", `{"prompt":"a","grammar":"","max_tokens":2}`); w.Code != 200 {
		t.Errorf("an empty grammar: %d %s", w.Code, w.Body)
	}
}

// TestPrefixRules: renaming a client's grammar apart leaves its literals,
// classes, token references and comments alone.
func TestPrefixRules(t *testing.T) {
	g := "root ::= x <think> <[12]> \"x\" [x] # x\nx ::= \"a\" 12\n12 ::= !<x>\n"
	want := "p-root ::= p-x <think> <[12]> \"x\" [x] # x\np-x ::= \"a\" p-12\np-12 ::= !<x>\n"
	if got := prefixRules(g, "p-"); got != want {
		t.Errorf("got  %q\nwant %q", got, want)
	}
}

// TestClientGrammarsWrapForThoughts: a client's grammar or regex, in its
// canonical form, joined after a reasoning model's thoughts (thinkPlan.wrap)
// is still one grammar that reads as intended, whatever rule names it uses.
func TestClientGrammarsWrapForThoughts(t *testing.T) {
	for _, g := range []string{
		"root ::= x |\n  \"b\" # comment\nx ::= \"a\" root?",
		"root ::= shoal-thought\nshoal-thought ::= [0-9]+",
		"root ::= \"a\" |",
	} {
		c, err := engine.ParseGBNF(g, nil)
		if err != nil {
			t.Fatal(err)
		}
		for _, open := range []bool{false, true} {
			w := (&thinkPlan{open: open, tags: xmlThink}).wrap(c)
			if _, err := engine.ParseGBNF(w, nil); err != nil {
				t.Errorf("%q wrapped (open %v): %v\n%s", g, open, err, w)
			}
		}
	}
	re, err := engine.RegexGrammar(`^$|\d+`)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := engine.ParseGBNF((&thinkPlan{tags: xmlThink}).wrap(re), nil); err != nil {
		t.Errorf("a regex's grammar wrapped: %v", err)
	}
}

// TestAdapterMetrics: a node serving LoRA adapters reports vLLM's
// vllm:lora_requests_info, and requests name the adapter they ran under.
func TestAdapterMetrics(t *testing.T) {
	s := newTestServer(t, func(c *Config, sc *scheduler.Config) {
		c.Adapters, sc.Adapters = []string{"tuned", "other"}, []string{"tuned", "other"}
	})
	s.fake.Adapters = 2
	base := s.do(t, "POST", "/v1/completions", `{"prompt":"abc","max_tokens":4}`)
	tuned := s.do(t, "POST", "/v1/completions", `{"model":"tuned","prompt":"abc","max_tokens":4}`)
	if base.Code != 200 || tuned.Code != 200 || !strings.Contains(tuned.Body.String(), `"model":"tuned"`) || base.Body.String() == strings.ReplaceAll(tuned.Body.String(), `"tuned"`, `"fake"`) {
		t.Fatalf("base %d %s\ntuned %d %s", base.Code, base.Body, tuned.Code, tuned.Body)
	}
	// The scheduler publishes its load after the step that ended the requests,
	// which may come after their answers: wait for it (bounded).
	want := `vllm:lora_requests_info{max_lora="1",running_lora_adapters="",waiting_lora_adapters=""}`
	w := s.do(t, "GET", "/metrics", "")
	for deadline := time.Now().Add(5 * time.Second); !strings.Contains(w.Body.String(), want) && time.Now().Before(deadline); {
		time.Sleep(10 * time.Millisecond)
		w = s.do(t, "GET", "/metrics", "")
	}
	if !strings.Contains(w.Body.String(), want) {
		t.Errorf("metrics lack vllm:lora_requests_info:\n%s", w.Body)
	}
}

// TestRequestHistograms: the per-request histograms vLLM's dashboard reads
// count each finished choice once, with its own tokens, and each prompt once.
func TestRequestHistograms(t *testing.T) {
	s := newTestServer(t, nil)
	if w := s.do(t, "POST", "/v1/completions", `{"prompt":"abc","max_tokens":3,"n":2}`); w.Code != 200 {
		t.Fatalf("completion: %d %s", w.Code, w.Body)
	}
	if w := s.do(t, "POST", "/v1/chat/completions", `{"messages":[{"role":"user","content":"hi"}],"max_tokens":4,"stream":true}`); w.Code != 200 {
		t.Fatalf("chat: %d %s", w.Code, w.Body)
	}
	body := s.do(t, "GET", "/metrics", "").Body.String()
	for _, want := range []string{
		// three choices: 3 + 3 + 4 tokens, 2 + 2 + 3 gaps between them
		`vllm:request_generation_tokens_count{model_name="fake"} 3`,
		`vllm:request_generation_tokens_sum{model_name="fake"} 10`,
		`vllm:request_params_max_tokens_sum{model_name="fake"} 10`,
		`vllm:request_prompt_tokens_count{model_name="fake"} 3`,
		`vllm:time_per_output_token_seconds_count{model_name="fake"} 7`,
		`vllm:inter_token_latency_seconds_count{model_name="fake"} 7`,
		`vllm:request_time_per_output_token_seconds_count{model_name="fake"} 3`,
		`vllm:request_prefill_time_seconds_count{model_name="fake"} 3`,
		`vllm:request_decode_time_seconds_count{model_name="fake"} 3`,
		`vllm:request_inference_time_seconds_count{model_name="fake"} 3`,
		// two prompts: n 2 and 1; the most one choice generated, 3 and 4
		`vllm:request_params_n_sum{model_name="fake"} 3`,
		`vllm:request_params_n_count{model_name="fake"} 2`,
		`vllm:request_max_num_generation_tokens_sum{model_name="fake"} 7`,
		`vllm:num_preemptions_total{model_name="fake"} 0`,
		`vllm:gpu_cache_usage_perc{model_name="fake"}`,
		`vllm:iteration_tokens_total_bucket{model_name="fake",le="1"}`,
	} {
		if !strings.Contains(body, want+"\n") && !strings.Contains(body, want+" ") {
			t.Errorf("metrics lack %s", want)
		}
	}
	// Every forward pass is in the step histogram, and its tokens are at least
	// the 10 generated.
	steps := metricValue(t, body, `vllm:iteration_tokens_total_count{model_name="fake"}`)
	if want := metricValue(t, body, `shoal_scheduler_steps_total{model_name="fake"}`); steps != want || steps == 0 {
		t.Errorf("iteration_tokens_total counts %v passes, the scheduler %v", steps, want)
	}
	if sum := metricValue(t, body, `vllm:iteration_tokens_total_sum{model_name="fake"}`); sum < 10 {
		t.Errorf("iteration_tokens_total_sum %v, want at least the 10 tokens generated", sum)
	}
}

// metricValue is the value of the exposition line that starts with series.
func metricValue(t *testing.T, body, series string) float64 {
	t.Helper()
	for _, line := range strings.Split(body, "\n") {
		if v, ok := strings.CutPrefix(line, series+" "); ok {
			f, err := strconv.ParseFloat(v, 64)
			if err != nil {
				t.Fatalf("%s: %v", line, err)
			}
			return f
		}
	}
	t.Fatalf("no %s in the metrics", series)
	return 0
}

// descRecorder is a prometheus.Registerer that keeps the names of what is
// registered: every series a node may export, whether or not it has samples yet.
type descRecorder struct{ names map[string]bool }

func (r *descRecorder) Register(c prometheus.Collector) error {
	ch := make(chan *prometheus.Desc, 16)
	go func() { c.Describe(ch); close(ch) }()
	for d := range ch {
		if m := fqNameRE.FindStringSubmatch(d.String()); m != nil {
			r.names[m[1]] = true
		}
	}
	return nil
}

func (r *descRecorder) MustRegister(cs ...prometheus.Collector) {
	for _, c := range cs {
		r.Register(c)
	}
}

func (r *descRecorder) Unregister(prometheus.Collector) bool { return false }

var fqNameRE = regexp.MustCompile(`fqName: "([^"]+)"`)

// exported records the series a node registers.
func exported(t *testing.T) *descRecorder {
	t.Helper()
	rec := &descRecorder{names: map[string]bool{}}
	cfg := DefaultConfig()
	cfg.ModelName = "m"
	if _, err := New(cfg, rec, nil); err != nil {
		t.Fatal(err)
	}
	return rec
}

// promtool is promtool's path; without it the test is skipped, but in CI,
// whose scripts/test-deps.sh installs it.
func promtool(t *testing.T) string {
	t.Helper()
	path, err := exec.LookPath("promtool")
	if err != nil {
		if os.Getenv("CI") != "" {
			t.Fatal("promtool missing in CI: scripts/test-deps.sh installs it")
		}
		t.Skip("promtool not installed (run scripts/test-deps.sh)")
	}
	return path
}

// TestGrafanaDashboard: every series docs/grafana/shoal.json reads is one a
// node exports, so that no panel stays empty after a rename.
func TestGrafanaDashboard(t *testing.T) {
	rec := exported(t)
	b, err := os.ReadFile("../docs/grafana/shoal.json")
	if err != nil {
		t.Fatal(err)
	}
	var dash struct {
		Panels []struct {
			Title   string `json:"title"`
			Type    string `json:"type"`
			Targets []struct {
				Expr string `json:"expr"`
			} `json:"targets"`
		} `json:"panels"`
	}
	if err := json.Unmarshal(b, &dash); err != nil {
		t.Fatal(err)
	}
	read := 0
	for _, p := range dash.Panels {
		if p.Type != "row" && len(p.Targets) == 0 {
			t.Errorf("panel %q reads nothing", p.Title)
		}
		for _, tg := range p.Targets {
			for _, name := range seriesRE.FindAllString(tg.Expr, -1) {
				read++
				base := name
				for _, suffix := range []string{"_bucket", "_sum", "_count"} {
					if s, ok := strings.CutSuffix(name, suffix); ok && rec.names[s] {
						base = s
					}
				}
				if !rec.names[base] {
					t.Errorf("panel %q reads %s, which no node exports", p.Title, name)
				}
			}
		}
	}
	if read < 30 || !rec.names["shoal_routed_requests_total"] || !rec.names["vllm:iteration_tokens_total"] {
		t.Errorf("%d series read; exported %v", read, rec.names)
	}
	// The queries parse as PromQL, Grafana's variables given values (promtool
	// checks them as recording rules).
	promtool := promtool(t)
	vars := strings.NewReplacer("$__rate_interval", "1m", "$model_name", ".*", "$instance", ".*")
	var rules strings.Builder
	rules.WriteString("groups:\n- name: dashboard\n  rules:\n")
	n := 0
	for _, p := range dash.Panels {
		for _, tg := range p.Targets {
			n++
			q, _ := json.Marshal(vars.Replace(tg.Expr)) // a JSON string is a YAML string
			fmt.Fprintf(&rules, "  - record: dashboard_query_%d\n    expr: %s\n", n, q)
		}
	}
	file := filepath.Join(t.TempDir(), "rules.yml")
	if err := os.WriteFile(file, []byte(rules.String()), 0o644); err != nil {
		t.Fatal(err)
	}
	if out, err := exec.Command(promtool, "check", "rules", file).CombinedOutput(); err != nil {
		t.Errorf("promtool check rules: %v\n%s", err, out)
	}
}

// TestPrometheusAlerts: docs/prometheus/alerts.yml parses as Prometheus
// rules and reads only series a node exports (and Prometheus' own up).
func TestPrometheusAlerts(t *testing.T) {
	rec := exported(t)
	rec.names["up"] = true // Prometheus' own
	b, err := os.ReadFile("../docs/prometheus/alerts.yml")
	if err != nil {
		t.Fatal(err)
	}
	n := 0
	for _, line := range strings.Split(string(b), "\n") {
		expr, ok := strings.CutPrefix(strings.TrimSpace(line), "expr: ")
		if !ok {
			continue
		}
		n++
		for _, m := range alertSeriesRE.FindAllStringSubmatch(expr, -1) {
			name := m[1]
			if base, ok := strings.CutSuffix(name, "_bucket"); !rec.names[name] && !(ok && rec.names[base]) {
				t.Errorf("%s reads %s, which no node exports", expr, name)
			}
		}
	}
	if n < 8 {
		t.Fatalf("%d rules read", n)
	}
	if out, err := exec.Command(promtool(t), "check", "rules", "../docs/prometheus/alerts.yml").CombinedOutput(); err != nil {
		t.Errorf("promtool check rules: %v\n%s", err, out)
	}
}

// alertSeriesRE finds the series an alert reads: names before '{' or '['.
var alertSeriesRE = regexp.MustCompile(`([a-z_:][a-z0-9_:]*)(?:\{|\[)`)

var seriesRE = regexp.MustCompile(`\b(?:vllm:|shoal_)[a-z0-9_:]+`)

// TestSyncPeers: each member has its routing series from the start, at 0; a
// member gone from the cluster's view takes its series with it; the others
// stay.
func TestSyncPeers(t *testing.T) {
	s := newTestServer(t, nil)
	s.metrics.routedTo("gone")
	s.metrics.forwardFailedAt("gone", "busy")
	s.metrics.routedTo("here")
	s.metrics.syncPeers([]cluster.Member{{Name: "here"}, {Name: "new"}}, "here")
	body := s.do(t, "GET", "/metrics", "").Body.String()
	for _, want := range []string{`shoal_routed_requests_total{model_name="fake",node="here"} 1`, `shoal_routed_requests_total{model_name="fake",node="new"} 0`,
		`shoal_forward_failures_total{model_name="fake",node="new",reason="busy"} 0`, `shoal_forward_failures_total{model_name="fake",node="new",reason="refused"} 0`} {
		if !strings.Contains(body, want+"\n") {
			t.Errorf("metrics lack %s", want)
		}
	}
	if strings.Contains(body, `node="gone"`) || strings.Contains(body, `shoal_forward_failures_total{model_name="fake",node="here"`) {
		t.Fatalf("after syncing:\n%s", body)
	}
}

// TestResetPrefixCache: vLLM's POST /reset_prefix_cache drops what earlier
// requests left cached, behind the API key.
func TestResetPrefixCache(t *testing.T) {
	off := newTestServer(t, nil)
	if w := off.do(t, "POST", "/reset_prefix_cache", ""); w.Code != 403 || !strings.Contains(w.Body.String(), "--allow-cache-reset") {
		t.Fatalf("without --allow-cache-reset: %d %s", w.Code, w.Body)
	}
	s := newTestServer(t, func(c *Config, _ *scheduler.Config) { c.APIKeys, c.AllowCacheReset = []string{"k"}, true })
	body := `{"prompt":"` + strings.Repeat("the same long prompt ", 20) + `","max_tokens":2}`
	cached := func() int {
		w := s.do(t, "POST", "/v1/completions", body, "Authorization", "Bearer k")
		var r CompletionResponse
		if err := json.Unmarshal(w.Body.Bytes(), &r); err != nil || w.Code != 200 {
			t.Fatalf("%d %s", w.Code, w.Body)
		}
		return r.Usage.PromptTokensDetails.CachedTokens
	}
	cached()
	if cached() == 0 {
		t.Fatal("the same prompt again found nothing cached")
	}
	if w := s.do(t, "POST", "/reset_prefix_cache", ""); w.Code != 401 {
		t.Fatalf("without the key: %d", w.Code)
	}
	w := s.do(t, "POST", "/reset_prefix_cache", "", "Authorization", "Bearer k")
	var r struct {
		Dropped int `json:"dropped_blocks"`
	}
	if err := json.Unmarshal(w.Body.Bytes(), &r); err != nil || w.Code != 200 || r.Dropped == 0 {
		t.Fatalf("reset: %d %s", w.Code, w.Body)
	}
	if n := cached(); n != 0 {
		t.Fatalf("after the reset, %d prompt tokens were cached", n)
	}
}

// TestHTTPMetrics: answers are counted by route, method and status class, an
// unknown path under "none", a method a route does not take (405) under the
// route, and a made-up method as "other".
func TestHTTPMetrics(t *testing.T) {
	s := newTestServer(t, nil)
	s.do(t, "POST", "/v1/completions", `{"prompt":"abc","max_tokens":2}`)
	s.do(t, "POST", "/v1/completions", `{"prompt":"abc","max_tokens":-2}`)
	s.do(t, "GET", "/no/such/path/123", "")
	s.do(t, "BREW", "/v1/models", "")
	s.do(t, "GET", "/v1/completions", "")
	body := s.do(t, "GET", "/metrics", "").Body.String()
	for _, want := range []string{
		`http_requests_total{handler="/v1/completions",method="POST",status="2xx"} 1`,
		`http_requests_total{handler="/v1/completions",method="POST",status="4xx"} 1`,
		`http_requests_total{handler="none",method="GET",status="4xx"} 1`,
		`http_requests_total{handler="/v1/models",method="other",status="4xx"} 1`,
		`http_requests_total{handler="/v1/completions",method="GET",status="4xx"} 1`,
		`http_request_duration_seconds_count{handler="/v1/completions",method="POST"} 2`,
	} {
		if !strings.Contains(body, want+"\n") {
			t.Errorf("metrics lack %s", want)
		}
	}
	if strings.Contains(body, "/no/such/path") || strings.Contains(body, "BREW") {
		t.Error("a client's path or method became a label value")
	}
}

// TestErrorsNameRequestFields: an error names the field as the request's API
// spells it, in its param and its message, and a wrong JSON type in words.
func TestErrorsNameRequestFields(t *testing.T) {
	s := newTestServer(t, nil)
	for _, ok := range []string{`{"prompt":"x","max_tokens":1,"best_of":1}`, `{"prompt":"x","max_tokens":1,"n":2,"best_of":2}`, `{"prompt":"x","max_tokens":1,"n":2,"best_of":1}`, `{"prompt":"x","max_tokens":1,"logit_bias":{" 5":1}}`, `{"prompt":"x","max_tokens":1,"logit_bias":{"+5":1}}`} {
		if w := s.do(t, "POST", "/v1/completions", ok); w.Code != 200 {
			t.Errorf("%s: %d %s", ok, w.Code, w.Body)
		}
	}
	for _, c := range []struct {
		path, body string
		says, not  string
	}{
		{"/v1/completions", `{"prompt":"x","stop":5}`, `expected a string or an array of strings, got JSON number","type":"invalid_request_error","param":"stop"`, ""},
		{"/v1/completions", `{"prompt":["x",5]}`, `expected a string, an array of strings, an array of token ids, or an array of such arrays, got JSON array","type":"invalid_request_error","param":"prompt"`, ""},
		{"/v1/completions", `{"prompt":"x","max_tokens":"5"}`, `expected an integer, got JSON string","type":"invalid_request_error","param":"max_tokens"`, ""},
		{"/v1/completions", `[]`, "the request body must be a JSON object, got JSON array", "api."},
		{"/v1/completions", `{"prompt":"x","best_of":3}`, "best_of 3 is not served", ""},
		{"/v1/completions", `{"prompt":"x","n":3,"best_of":2}`, "best_of must be at least n (3), got 2", ""},
		{"/v1/responses", `{"input":"x","max_output_tokens":-1}`, "max_output_tokens must be at least 1", "max_tokens must"},
		{"/v1/messages", `{"max_tokens":2,"temperature":1.5,"messages":[{"role":"user","content":"x"}]}`, "temperature must be between 0 and 1", ""},
		{"/v1/messages", `{"max_tokens":2,"tools":[{"name":"f"}],"messages":[{"role":"user","content":"x"}]}`, "tools[0].input_schema is required", ""},
		{"/v1/messages", `{"max_tokens":2,"tools":[{"name":"f","input_schema":{"type":"string"}}],"messages":[{"role":"user","content":"x"}]}`, "input_schema must describe an object", "parameters"},
		{"/v1/messages", `{"max_tokens":2,"output_config":{"format":{"type":"xml"}},"messages":[{"role":"user","content":"x"}]}`, "output_config.format must be", ""},
		{"/v1/messages", `{"max_tokens":2,"output_format":{"type":"xml"},"messages":[{"role":"user","content":"x"}]}`, "output_format must be", ""},
		{"/v1/messages", `{"max_tokens":2,"tools":[{"name":"f","input_schema":{"type":"object"}}],"tool_choice":{"type":"tool"},"messages":[{"role":"user","content":"x"}]}`, `needs the tool's \"name\"`, `\"function\"`},
		{"/v1/messages", `{"max_tokens":2,"thinking":{"type":"enabled"},"messages":[{"role":"user","content":"x"}]}`, "budget_tokens: at least 1024", ""},
		{"/v1/messages", `{"max_tokens":2,"messages":[{"role":"user","content":[{"type":"tool_result","tool_use_id":"t9","content":"r"}]}]}`, `tool_use_id \"t9\", which no earlier tool_use`, ""},
		{"/v1/messages", `{"max_tokens":2,"messages":[{"role":"user","content":[{"type":"text","text":5}]}]}`, `field \"messages.content.text\": expected a string, got JSON number`, ""},
		{"/v1/completions", `{"prompt":"a","structured_outputs":{"structural_tag":{"type":"structural_tag"}}}`, "structural_tag is not supported", ""},
		{"/v1/completions", `{"prompt":"a","structured_outputs":{"json_object":true},"guided_json":{}}`, "at most one output constraint", ""},
		{"/v1/completions", `{"prompt":[null,5]}`, `field \"prompt\": expected an integer, got JSON null","type":"invalid_request_error","param":"prompt"`, ""},
		{"/v1/completions", `{"prompt":[[1,2],null]}`, `field \"prompt\": expected an integer, got JSON null`, ""},
		{"/v1/completions", `{"prompt":[[1],[2,null]]}`, `field \"prompt\": expected an integer, got JSON null`, ""},
		{"/v1/completions", `{"prompt":["a",null]}`, `field \"prompt\": expected a string, got JSON null`, ""},
		{"/v1/completions", `{"prompt":"a","stop_token_ids":[null]}`, `"param":"stop_token_ids"`, ""},
		{"/detokenize", `{"tokens":[1,null]}`, `"param":"tokens"`, ""},
		{"/v1/completions", `{"prompt":"a","logit_bias":{"99999999999999999999":100}}`, `logit_bias key \"99999999999999999999\" is not a token id of this model","type":"invalid_request_error","param":"logit_bias"`, ""},
		{"/v1/completions", `{"prompt":"a","logit_bias":{" 99999":100}}`, `logit_bias key 99999 is not a token id`, ""},
		{"/v1/completions", `{"prompt":"a","logit_bias":5}`, `logit_bias must be {\"token id\": bias}`, "invalid JSON body"},
		{"/v1/chat/completions", `{"messages":[{"role":"user","content":[{"type":"input_audio","input_audio":{}}]}]}`, `messages: content part 0: parts of type \"text\" with a text field, \"refusal\" with a refusal field, or \"image_url\" are read, got type \"input_audio\"","type":"invalid_request_error","param":"messages"`, ""},
		{"/v1/chat/completions", `{"messages":[{"role":"user","content":"x"}],"max_completion_tokens":100000}`, `"param":"max_completion_tokens","code":"context_length_exceeded"`, ""},
		{"/v1/messages", `{"max_tokens":2,"top_k":-1,"messages":[{"role":"user","content":"x"}]}`, "top_k must be at least 0", ""},
		{"/v1/messages", `{"max_tokens":2,"metadata":"me","messages":[{"role":"user","content":"x"}]}`, "metadata must be an object", ""},
		{"/v1/messages", `{"max_tokens":2,"messages":[{"role":"user","content":[{"type":"text"}]}]}`, "messages[0]: a text block needs its text field", ""},
		{"/v1/messages", `{"max_tokens":2,"messages":[{"role":"user","content":"x"},{"role":"assistant","content":[{"type":"text"}]}]}`, "messages[1]: a text block needs its text field", ""},
		{"/v1/messages", `{"max_tokens":2,"system":[{"type":"text"}],"messages":[{"role":"user","content":"x"}]}`, "system: a text block needs its text field", ""},
		{"/v1/responses", `{"input":[{"type":"function_call_output","call_id":"c9","output":"r"}]}`, `no tool call found for function_call_output with call_id \"c9\"`, ""},
		{"/v1/responses", `{"input":"x","tool_choice":"bogus"}`, `{\"type\": \"function\" (or \"custom\"), \"name\": ...}`, ""},
		{"/v1/responses", `{"input":"x","tool_choice":{"type":"function","function":{"name":"f"}}}`, `{\"type\": \"function\" (or \"custom\"), \"name\": ...}`, ""},
	} {
		w := s.do(t, "POST", c.path, c.body)
		if w.Code != 400 || !strings.Contains(w.Body.String(), c.says) || c.not != "" && strings.Contains(w.Body.String(), c.not) {
			t.Errorf("%s %s: %d %s, want 400 saying %q and not %q", c.path, c.body, w.Code, w.Body, c.says, c.not)
		}
	}
}

func TestRenameWord(t *testing.T) {
	e := invalid("response_format", "response_format: temperature, top_p, top_p_x, options.top_p and (top_p)")
	got := e.renamed(map[string]string{"response_format": "format", "top_p": "options.top_p", "temperature": "options.temperature"})
	if want := "format: options.temperature, options.top_p, top_p_x, options.top_p and (options.top_p)"; got.Message != want || got.Param != "format" {
		t.Fatalf("%q (%s), want %q", got.Message, got.Param, want)
	}
}

// hasLogprob reports whether r gives token logprob.
func hasLogprob(r RankedLogprobs, token string, logprob float32) bool {
	lp, ok := r.Logprob(token)
	return ok && lp == logprob
}

// TestRankedLogprobs: a legacy top_logprobs entry is written most likely
// first, holds a text once, and reads back in its order.
func TestRankedLogprobs(t *testing.T) {
	var r RankedLogprobs
	for _, x := range []NamedLogprob{{"b", -0.5}, {"a", -1}, {"b", -3}, {"<z>", -0.1}, {"c", -1}} {
		r = r.with(x.Token, x.Logprob)
	}
	b, err := json.Marshal(r)
	if want := `{"\u003cz\u003e":-0.1,"b":-0.5,"a":-1,"c":-1}`; err != nil || string(b) != want {
		t.Fatalf("%s, %v; want %s", b, err, want)
	}
	var back RankedLogprobs
	if err := json.Unmarshal(b, &back); err != nil || !slices.Equal(back, r) {
		t.Fatalf("read back %v, %v; want %v", back, err, r)
	}
	if err := json.Unmarshal([]byte(`[1]`), &back); err == nil {
		t.Fatal("an array read as an entry")
	}
	if b, _ := json.Marshal(RankedLogprobs{}); string(b) != "{}" {
		t.Fatalf("empty: %s", b)
	}
}

// TestVLLMSamplingExtras: vLLM's allowed_token_ids, bad_words,
// truncate_prompt_tokens and continuous_usage_stats do what vLLM does with
// them; use_beam_search is refused, not ignored.
func TestVLLMSamplingExtras(t *testing.T) {
	s := newTestServer(t, nil)
	tokensOf := func(body string) []string {
		t.Helper()
		w := s.do(t, "POST", "/v1/completions", body)
		var r CompletionResponse
		if w.Code != 200 || json.Unmarshal(w.Body.Bytes(), &r) != nil || r.Choices[0].Logprobs == nil {
			t.Fatalf("%s: %d %s", body, w.Code, w.Body)
		}
		return r.Choices[0].Logprobs.Tokens
	}
	const base = `"prompt":"hello","max_tokens":6,"temperature":1,"seed":3,"ignore_eos":true,"logprobs":0,"return_tokens_as_token_ids":true`
	for _, tok := range tokensOf(`{` + base + `,"allowed_token_ids":[7,9]}`) {
		if tok != "token_id:7" && tok != "token_id:9" {
			t.Fatalf("allowed 7 and 9, drew %s", tok)
		}
	}
	// Of two tokens allowed, the bad word's is never drawn.
	x, _ := s.fake.Vocab().Tokenize("x", false, false)
	bad := fmt.Sprintf("token_id:%d", x[0])
	for _, tok := range tokensOf(`{` + base + fmt.Sprintf(`,"allowed_token_ids":[%d,40],"bad_words":["x"]}`, x[0])) {
		if tok != "token_id:40" {
			t.Fatalf("bad word x (%s) or a token not allowed drawn: %s", bad, tok)
		}
	}
	w := s.do(t, "POST", "/v1/completions", `{"prompt":[`+strings.TrimSuffix(strings.Repeat("5,", 100), ",")+`],"max_tokens":1,"truncate_prompt_tokens":10}`)
	if w.Code != 200 || !strings.Contains(w.Body.String(), `"prompt_tokens":10,`) {
		t.Fatalf("truncate_prompt_tokens 10: %d %s", w.Code, w.Body)
	}
	for _, body := range []string{
		`{"prompt":"x","use_beam_search":true}`,
		`{"prompt":"x","allowed_token_ids":[]}`,
		fmt.Sprintf(`{"prompt":"x","allowed_token_ids":[%d],"bad_words":["x"]}`, x[0]), // nothing left to draw
	} {
		if w := s.do(t, "POST", "/v1/completions", body); w.Code != 400 {
			t.Fatalf("%s: %d %s", body, w.Code, w.Body)
		}
	}
	w = s.do(t, "POST", "/v1/chat/completions", `{"messages":[{"role":"user","content":"hi"}],"max_tokens":3,"ignore_eos":true,"stream":true,
		"stream_options":{"include_usage":true,"continuous_usage_stats":true}}`)
	last := -1
	for line := range strings.Lines(w.Body.String()) {
		data, ok := strings.CutPrefix(strings.TrimSpace(line), "data: ")
		if !ok || data == "[DONE]" {
			continue
		}
		var chunk struct{ Usage *Usage }
		if err := json.Unmarshal([]byte(data), &chunk); err != nil || chunk.Usage == nil || chunk.Usage.PromptTokens == 0 || chunk.Usage.CompletionTokens < last {
			t.Fatalf("a chunk without the usage so far: %s", data)
		}
		last = chunk.Usage.CompletionTokens
	}
	if last != 3 {
		t.Fatalf("the last chunk counts %d tokens, want 3:\n%s", last, w.Body)
	}
}

// TestAnthropicModels: Anthropic's SDK (anthropic-version on every request)
// gets GET /v1/models in Anthropic's shape; other clients in OpenAI's.
func TestAnthropicModels(t *testing.T) {
	s := newTestServer(t, nil)
	w := s.do(t, "GET", "/v1/models", "", "anthropic-version", "2023-06-01")
	var list struct {
		Data []struct {
			Type        string
			ID          string
			DisplayName string `json:"display_name"`
			CreatedAt   string `json:"created_at"`
		}
		HasMore bool   `json:"has_more"`
		FirstID string `json:"first_id"`
	}
	if w.Code != 200 || json.Unmarshal(w.Body.Bytes(), &list) != nil || len(list.Data) != 1 || list.FirstID != "fake" || list.Data[0].Type != "model" || list.Data[0].DisplayName != "fake" || list.Data[0].CreatedAt == "" || list.HasMore {
		t.Fatalf("%d %s", w.Code, w.Body)
	}
	if w := s.do(t, "GET", "/v1/models/fake", "", "anthropic-version", "2023-06-01"); w.Code != 200 || !strings.Contains(w.Body.String(), `"type":"model"`) {
		t.Fatalf("one model: %d %s", w.Code, w.Body)
	}
	if w := s.do(t, "GET", "/v1/models/nope", "", "anthropic-version", "2023-06-01"); w.Code != 404 || !strings.Contains(w.Body.String(), `"type":"error"`) {
		t.Fatalf("an unknown model: %d %s", w.Code, w.Body)
	}
	if w := s.do(t, "GET", "/v1/models", ""); !strings.Contains(w.Body.String(), `"object":"list"`) {
		t.Fatalf("OpenAI's shape: %s", w.Body)
	}
}

// TestResponseFailedKeepsOutput: a Responses stream that fails midway says so
// in response.failed, with the output streamed before it.
func TestResponseFailedKeepsOutput(t *testing.T) {
	s := newTestServer(t, nil)
	var steps atomic.Int32
	s.fake.Failing = func(*engine.Batch) error {
		if steps.Add(1) > 6 {
			return errors.New("the device fell over")
		}
		return nil
	}
	w := s.do(t, "POST", "/v1/responses", `{"input":"hi","max_output_tokens":50,"stream":true}`)
	i := strings.Index(w.Body.String(), "event: response.failed")
	if i < 0 {
		t.Fatalf("no response.failed:\n%s", w.Body)
	}
	failed := w.Body.String()[i:]
	if !strings.Contains(failed, `"status":"failed"`) || !strings.Contains(failed, `"type":"message"`) || !strings.Contains(failed, `"status":"incomplete"`) {
		t.Fatalf("response.failed without what was streamed: %s", failed)
	}
}

// TestResponseOutputAlwaysAnArray: a Responses answer cut before any item
// has output [], never null (clients range over it).
func TestResponseOutputAlwaysAnArray(t *testing.T) {
	var resp Response
	finishResponse(&resp, &chatAnswer{finish: "length"}, nil, Usage{})
	if b, _ := json.Marshal(resp); !strings.Contains(string(b), `"output":[]`) || resp.Status != "incomplete" {
		t.Fatalf("%s", b)
	}
}

// TestCapNamesTheField: --max-tokens-cap's refusal names the field as the
// request's API calls it.
func TestCapNamesTheField(t *testing.T) {
	s := newTestServer(t, func(c *Config, sc *scheduler.Config) { c.MaxTokensCap = 8 })
	for path, c := range map[string]struct{ body, param string }{
		"/v1/completions":      {`{"prompt":"x","max_tokens":9}`, "max_tokens"},
		"/v1/chat/completions": {`{"messages":[{"role":"user","content":"x"}],"max_completion_tokens":9}`, "max_completion_tokens"},
		"/v1/responses":        {`{"input":"x","max_output_tokens":9}`, "max_output_tokens"},
		"/api/generate":        {`{"prompt":"x","stream":false,"options":{"num_predict":9}}`, "options.num_predict"},
	} {
		w := s.do(t, "POST", path, c.body)
		if w.Code != 400 || !strings.Contains(w.Body.String(), c.param+" 9 exceeds this server's cap of 8") {
			t.Errorf("%s: %d %s", path, w.Code, w.Body)
		}
	}
}

// TestAudioOutputRefused: spoken output, which a node cannot give, is refused
// rather than ignored.
func TestAudioOutputRefused(t *testing.T) {
	s := newTestServer(t, nil)
	for body, param := range map[string]string{
		`{"messages":[{"role":"user","content":"x"}],"modalities":["text","audio"],"audio":{"voice":"alloy","format":"wav"}}`: "modalities",
		`{"messages":[{"role":"user","content":"x"}],"audio":{"voice":"alloy","format":"wav"}}`:                               "audio",
	} {
		if w := s.do(t, "POST", "/v1/chat/completions", body); w.Code != 400 || !strings.Contains(w.Body.String(), `"param":"`+param+`"`) {
			t.Errorf("%s: %d %s", body, w.Code, w.Body)
		}
	}
	if w := s.do(t, "POST", "/v1/chat/completions", `{"messages":[{"role":"user","content":"x"}],"modalities":["text"],"max_tokens":2}`); w.Code != 200 {
		t.Errorf("modalities text: %d %s", w.Code, w.Body)
	}
}

// TestAnthropicClientsModels: with anthropic-version, GET /v1/models refuses a
// wrong key in Anthropic's shape, and answers carry request-id, where
// Anthropic's SDKs read the request's id.
func TestAnthropicClientsModels(t *testing.T) {
	s := newTestServer(t, func(c *Config, sc *scheduler.Config) { c.APIKeys = []string{"k"} })
	w := s.do(t, "GET", "/v1/models", "", "anthropic-version", "2023-06-01", "x-api-key", "wrong")
	if w.Code != 401 || !strings.Contains(w.Body.String(), `"type":"error"`) || w.Header().Get("request-id") == "" || w.Header().Get("request-id") != w.Header().Get("X-Request-Id") {
		t.Fatalf("%d %v %s", w.Code, w.Header(), w.Body)
	}
}
