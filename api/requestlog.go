package api

import (
	"context"
	crand "crypto/rand"
	"encoding/hex"
	"net/http"
	"sync/atomic"
	"time"

	"github.com/gin-gonic/gin"

	"github.com/shoal-ai/shoal/cluster"
	"github.com/shoal-ai/shoal/scheduler"
)

// requestIDKey holds a request's id in its gin context; forwardedByKey, the
// peer that forwarded it, once its credential checked out.
const (
	requestIDKey   = "shoal.request_id"
	forwardedByKey = "shoal.forwarded_by"
)

// requestStats gathers what a request's log line reports from the handlers
// that serve it (they run on the request's goroutine; atomics keep the
// keep-alive goroutines of streams out of the question).
type requestStats struct {
	prompt, cached, completion atomic.Int64
	model                      atomic.Pointer[string]
	// queued is the longest any of its sequences waited to be scheduled;
	// first, when its first token came (Unix nanoseconds, 0: none yet).
	queued, first atomic.Int64
	// images its prompt held, and the time the projector took to lay them out and encode them.
	images, imageTime atomic.Int64
	// A client that hangs up once it has read the whole answer (as clients do)
	// did not leave it; one did when something was written after it hung up
	// (missed), or its choices were not all written (incomplete).
	missed, incomplete atomic.Bool
}

// goneWriter notes a write made after its request's client hung up.
type goneWriter struct {
	gin.ResponseWriter
	ctx context.Context
	st  *requestStats
}

func (w *goneWriter) Write(b []byte) (int, error) {
	w.note()
	return w.ResponseWriter.Write(b)
}

func (w *goneWriter) WriteString(s string) (int, error) {
	w.note()
	return w.ResponseWriter.WriteString(s)
}

func (w *goneWriter) note() {
	if w.ctx.Err() != nil {
		w.st.missed.Store(true)
	}
}

// Unwrap lets http.ResponseController reach the connection.
func (w *goneWriter) Unwrap() http.ResponseWriter { return w.ResponseWriter }

type requestStatsKey struct{}

// statsOf is ctx's request's stats; nil outside a request.
func statsOf(ctx context.Context) *requestStats {
	st, _ := ctx.Value(requestStatsKey{}).(*requestStats)
	return st
}

// count adds a finished sequence's usage.
func (st *requestStats) count(u scheduler.Usage) {
	if st == nil {
		return
	}
	st.prompt.Add(int64(u.PromptTokens))
	st.cached.Add(int64(u.CachedTokens))
	st.completion.Add(int64(u.CompletionTokens))
	for q := int64(u.QueueTime); ; {
		old := st.queued.Load()
		if q <= old || st.queued.CompareAndSwap(old, q) {
			break
		}
	}
}

// token notes a token produced at at: the first is the time to first token.
func (st *requestStats) token(at time.Time) {
	if st != nil && st.first.Load() == 0 {
		st.first.CompareAndSwap(0, at.UnixNano())
	}
}

// serves records the model the request ran on here.
func (st *requestStats) serves(model string) {
	if st != nil {
		st.model.Store(&model)
	}
}

// requestLog gives every request an id: the client's X-Request-Id when it is
// one (1 to 128 letters, digits and ._:-), as a node forwarding a request sends
// its own, else a new one; the answer carries it back. With
// Config.LogRequests, a line per request records how it ended: the route,
// status, time (and, for a request run here, its longest queue wait and time
// to first token), the client's address, the peer that forwarded it (its
// credential checked), the model and tokens run here, and the node it was
// forwarded to. Probes and scrapes
// (/health, /ready, /metrics) are not logged.
func (s *Server) requestLog(c *gin.Context) {
	id := c.GetHeader(cluster.HeaderRequestID)
	if !requestID(id) {
		var b [12]byte
		_, _ = crand.Read(b[:])
		id = hex.EncodeToString(b[:])
		c.Request.Header.Set(cluster.HeaderRequestID, id) // a forward carries it on
	}
	c.Header(cluster.HeaderRequestID, id)
	if anthropicClient(c) {
		c.Header("request-id", id) // where Anthropic's SDKs read it (err.requestID, _request_id)
	}
	c.Set(requestIDKey, id)
	st := &requestStats{}
	c.Request = c.Request.WithContext(context.WithValue(c.Request.Context(), requestStatsKey{}, st))
	c.Writer = &goneWriter{ResponseWriter: c.Writer, ctx: c.Request.Context(), st: st}
	start := time.Now()
	defer func() {
		// A panic (a forward cut short closes the connection so) is logged on
		// its way to recovery.
		if p := recover(); p != nil {
			s.logRequest(c, id, st, start, p)
			panic(p)
		}
	}()
	c.Next()
	s.logRequest(c, id, st, start, nil)
}

// logRequest writes c's line (requestLog); panicked is the panic it ends with.
func (s *Server) logRequest(c *gin.Context, id string, st *requestStats, start time.Time, panicked any) {
	status := c.Writer.Status()
	if panicked != nil && !c.Writer.Written() {
		status = 500 // what recovery answers
	}
	elapsed := time.Since(start)
	s.metrics.answered(c, status, elapsed)
	switch c.Request.URL.Path {
	case "/health", "/v1/health", "/ready", "/metrics":
		return
	}
	if !s.cfg.LogRequests {
		return
	}
	path := c.Request.URL.Path
	if len(path) > 256 {
		path = path[:256] + "..."
	}
	// The peer's address, not X-Forwarded-For: no proxy is trusted to name clients.
	attrs := []any{"id", id, "method", c.Request.Method, "path", path, "status", status,
		"ms", elapsed.Milliseconds(), "client", c.RemoteIP()}
	if from := c.GetString(forwardedByKey); from != "" {
		attrs = append(attrs, "forwarded_by", from)
	}
	if m := st.model.Load(); m != nil {
		attrs = append(attrs, "model", *m, "prompt_tokens", st.prompt.Load(), "cached_tokens", st.cached.Load(), "completion_tokens", st.completion.Load(),
			"queue_ms", time.Duration(st.queued.Load()).Milliseconds())
		if first := st.first.Load(); first != 0 {
			attrs = append(attrs, "ttft_ms", time.Unix(0, first).Sub(start).Milliseconds())
		}
		if n := st.images.Load(); n > 0 {
			attrs = append(attrs, "images", n, "encode_ms", time.Duration(st.imageTime.Load()).Milliseconds())
		}
	}
	if peer := c.Writer.Header().Get("X-Shoal-Served-By"); peer != "" {
		// Its tokens are in the peer's line, under the same id.
		if m := st.model.Load(); m == nil && c.GetString(routedModelKey) != "" {
			attrs = append(attrs, "model", c.GetString(routedModelKey))
		}
		attrs = append(attrs, "served_by", peer)
	}
	switch {
	case panicked == errCloseConnection:
		attrs = append(attrs, "cut", true) // a forwarded answer cut short: the connection was closed
	case panicked != nil:
		attrs = append(attrs, "panic", true)
	case c.Request.Context().Err() != nil && (st.missed.Load() || st.incomplete.Load() || status == StatusClientClosed) &&
		status != http.StatusRequestTimeout: // a stalled body's 408 cancels the context too
		attrs = append(attrs, "client_gone", true) // its tokens are those it was sent
	}
	s.log.Info("request", attrs...)
}

// requestID reports whether id may name a request in logs: short, and of
// characters that need no quoting (nothing a client could forge a log line with).
func requestID(id string) bool {
	if id == "" || len(id) > 128 {
		return false
	}
	for _, r := range id {
		switch {
		case r >= 'a' && r <= 'z', r >= 'A' && r <= 'Z', r >= '0' && r <= '9', r == '.', r == '_', r == ':', r == '-':
		default:
			return false
		}
	}
	return true
}
