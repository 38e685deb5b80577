package api

import (
	"bytes"
	"context"
	"log/slog"
	"net/http/httptest"
	"regexp"
	"strings"
	"sync"
	"testing"

	"github.com/gin-gonic/gin"
	"github.com/shoal-ai/shoal/scheduler"
)

// syncBuffer is a log sink the handlers' goroutines may write while a test reads.
type syncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (w *syncBuffer) Write(p []byte) (int, error) {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.b.Write(p)
}

func (w *syncBuffer) String() string {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.b.String()
}

// TestRequestLog: a request's id comes from X-Request-Id when it is one, else
// is made; the answer carries it; a line per request names it with the route,
// status, model and tokens; probes are not logged, and nothing is without
// LogRequests.
func TestRequestLog(t *testing.T) {
	s := newTestServer(t, nil)
	var logs syncBuffer
	s.log = slog.New(slog.NewTextHandler(&logs, nil))
	w := s.do(t, "POST", "/v1/completions", `{"prompt": "hello", "max_tokens": 2}`, "X-Request-Id", "trace-1.a:b_c")
	if w.Code != 200 || w.Header().Get("X-Request-Id") != "trace-1.a:b_c" {
		t.Fatalf("%d, id %q: %s", w.Code, w.Header().Get("X-Request-Id"), w.Body)
	}
	line := logs.String()
	for _, want := range []string{"msg=request", "id=trace-1.a:b_c", "method=POST", "path=/v1/completions", "status=200", "model=fake", "prompt_tokens=", "completion_tokens=2", "queue_ms=", "ttft_ms="} {
		if !strings.Contains(line, want) {
			t.Fatalf("the log line lacks %q: %s", want, line)
		}
	}
	for _, bad := range []string{"two words", "a\nmsg=forged", strings.Repeat("x", 129), "é"} {
		w := s.do(t, "POST", "/v1/completions", `{"prompt": "hello", "max_tokens": 1}`, "X-Request-Id", bad)
		if id := w.Header().Get("X-Request-Id"); !regexp.MustCompile(`^[0-9a-f]{24}$`).MatchString(id) || strings.Contains(logs.String(), "forged") {
			t.Fatalf("id %q for the client's %q", id, bad)
		}
	}
	before := logs.String()
	s.do(t, "GET", "/health", "")
	s.do(t, "GET", "/metrics", "")
	if w := s.do(t, "POST", "/v1/chat/completions", `{"model": "nope", "messages": []}`); w.Code != 404 || !strings.Contains(logs.String()[len(before):], "status=404") {
		t.Fatalf("a refused request's line: %d %s", w.Code, logs.String()[len(before):])
	}
	if n := strings.Count(logs.String()[len(before):], "msg=request"); n != 1 {
		t.Fatalf("%d lines for a probe, a scrape and a request:\n%s", n, logs.String()[len(before):])
	}
	// A panic is logged on its way to recovery, and a forged hop is not named.
	s.engine.GET("/v1/panics", func(*gin.Context) { panic("boom") })
	before = logs.String()
	if w := s.do(t, "GET", "/v1/panics", "", "X-Shoal-Hop", "1", "X-Shoal-From", "mallory", "X-Forwarded-For", "6.6.6.6"); w.Code != 500 {
		t.Fatalf("panic: %d", w.Code)
	}
	if l := logs.String()[len(before):]; !strings.Contains(l, "msg=request") || !strings.Contains(l, "status=500") || !strings.Contains(l, "panic=true") ||
		strings.Contains(l, "mallory") || strings.Contains(l, "6.6.6.6") {
		t.Fatalf("the panicked request's lines: %s", l)
	}
	quiet := newTestServer(t, func(c *Config, _ *scheduler.Config) { c.LogRequests = false })
	var none syncBuffer
	quiet.log = slog.New(slog.NewTextHandler(&none, nil))
	if w := quiet.do(t, "POST", "/v1/completions", `{"prompt": "hello", "max_tokens": 1}`); w.Code != 200 || none.String() != "" || w.Header().Get("X-Request-Id") == "" {
		t.Fatalf("LogRequests false: %d, logged %q", w.Code, none.String())
	}
}

// cancelAfter is a response writer whose client hangs up once the answer holds
// mark: its request's context is cancelled then.
type cancelAfter struct {
	*httptest.ResponseRecorder
	mark   string
	cancel context.CancelFunc
}

func (w *cancelAfter) Write(p []byte) (int, error) {
	n, err := w.ResponseRecorder.Write(p)
	if strings.Contains(w.Body.String(), w.mark) {
		w.cancel()
	}
	return n, err
}

// TestClientGoneLogged: a stream's client that hangs up once it has read the
// whole answer did not leave it; one that hangs up in the middle did.
func TestClientGoneLogged(t *testing.T) {
	s := newTestServer(t, nil)
	var logs syncBuffer
	s.log = slog.New(slog.NewTextHandler(&logs, nil))
	for mark, gone := range map[string]bool{"[DONE]": false, `"index":0`: true} {
		ctx, cancel := context.WithCancel(context.Background())
		req := httptest.NewRequestWithContext(ctx, "POST", "/v1/completions", strings.NewReader(`{"prompt": "hello", "max_tokens": 50, "ignore_eos": true, "stream": true}`))
		req.Header.Set("Content-Type", "application/json")
		before := len(logs.String())
		s.Handler().ServeHTTP(&cancelAfter{httptest.NewRecorder(), mark, cancel}, req)
		cancel()
		if line := logs.String()[before:]; strings.Contains(line, "client_gone=true") != gone {
			t.Errorf("a client gone after %s: client_gone %v wanted, logged %s", mark, gone, line)
		}
	}
}
