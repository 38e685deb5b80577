package api

import (
	"bytes"
	"cmp"
	"context"
	"crypto/subtle"
	"encoding/base64"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"math"
	"net"
	"net/http"
	"net/url"
	"slices"
	"strconv"
	"strings"
	"sync/atomic"
	"time"

	"github.com/gin-gonic/gin"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"

	"github.com/shoal-ai/shoal/cluster"
	"github.com/shoal-ai/shoal/engine"
	"github.com/shoal-ai/shoal/scheduler"
)

// Defaults for the HTTP surface.
const (
	// DefaultMaxBodyBytes bounds request bodies (a long chat history fits easily).
	DefaultMaxBodyBytes = 8 << 20
	// DefaultMaxTokensCap rejects requests asking for more output than this; 0:
	// only the context bounds it, as in vLLM (a prompt plus max_tokens beyond the
	// context is refused either way).
	DefaultMaxTokensCap = 0
	// CompletionsMaxTokens is the legacy /v1/completions endpoint's max_tokens when
	// a request gives none, as OpenAI and vLLM (a base model seldom stops by
	// itself); chat requests generate until end-of-generation instead.
	CompletionsMaxTokens = 16
	// MaxStops bounds the stop strings of one request.
	MaxStops = 64
	// MaxStopTokens bounds a request's stop_token_ids.
	MaxStopTokens = 256
	// DefaultBodyIdleTimeout bounds how long a request's body may stall.
	DefaultBodyIdleTimeout = 60 * time.Second
)

// Config configures the API. Only cmd fills it.
type Config struct {
	// ModelName is the id clients use in "model"; empty requests are accepted.
	ModelName string
	// ModelAliases are other ids the model answers to (vLLM's served model
	// names after the first); answers name it ModelName.
	ModelAliases []string
	// AllowCacheReset serves POST /reset_prefix_cache (off: 403), which any
	// client could otherwise use to empty the node's prefix cache; vLLM serves
	// it only in its development mode.
	AllowCacheReset bool
	APIKeys         []string
	MaxBodyBytes    int64
	// VisionBodyBytes, when above MaxBodyBytes, bounds the bodies of requests
	// that may carry pictures in base64 (a phone's photo is 4-7 MB) while the
	// node or a member of its cluster reads images for a model; 0: MaxBodyBytes
	// always.
	VisionBodyBytes int64
	// BodyIdleTimeout ends a request whose body sends nothing for this long
	// (408), so that a stalled upload does not hold its buffer and connection
	// for ever; 0: no bound. (llama-server's --timeout bounds each socket
	// read alike.)
	BodyIdleTimeout time.Duration
	MaxTokensCap    int
	// SchemaToGrammar converts a JSON schema to GBNF (response_format json_schema).
	SchemaToGrammar func(schema []byte) (string, error)
	// CacheInfo labels vllm:cache_config_info (block_size, cache_dtype, ...).
	CacheInfo map[string]string
	// AllowedOrigins are the web origins whose pages may call the API from a
	// browser (CORS), or "*" for any. None by default: a page on any site could
	// otherwise use a node on the visitor's machine.
	AllowedOrigins []string
	// AllowedMediaDomains are the hosts whose http(s) image URLs the node
	// fetches (vLLM's --allowed-media-domains; "*": any). Empty: none, and
	// images come as data: URLs (a node fetches nothing for a client unless
	// told to).
	AllowedMediaDomains []string
	// PriorityScheduling honours a request's "priority" (vLLM's
	// --scheduling-policy priority): lower runs first, and below 0 is admitted
	// past a saturated cluster. Off, a priority other than 0 is refused (400), as
	// vLLM refuses it under fcfs, so that no client can jump the queue of others.
	PriorityScheduling bool
	// ReasoningFormat is "auto" (a reasoning model's thoughts come back as
	// reasoning_content, apart from content) or "none" (left in content).
	ReasoningFormat string
	// LogRequests logs a line per API request as it ends (requestLog).
	LogRequests bool
	// Adapters are the ids of the LoRA adapters served besides ModelName, as
	// model ids of their own (vLLM's --lora-modules): a request naming
	// Adapters[i] runs under scheduler adapter i+1.
	Adapters []string
}

// DefaultConfig returns the defaults with no API keys.
func DefaultConfig() Config {
	return Config{MaxBodyBytes: DefaultMaxBodyBytes, BodyIdleTimeout: DefaultBodyIdleTimeout, MaxTokensCap: DefaultMaxTokensCap, ReasoningFormat: "auto", LogRequests: true}
}

// Validate rejects unusable settings.
func (c Config) Validate() error {
	switch {
	case c.MaxBodyBytes < 1024:
		return fmt.Errorf("api: max body bytes %d is too small", c.MaxBodyBytes)
	case c.VisionBodyBytes < 0:
		return fmt.Errorf("api: vision body bytes %d must not be negative", c.VisionBodyBytes)
	case c.BodyIdleTimeout < 0:
		return fmt.Errorf("api: body idle timeout %v must not be negative", c.BodyIdleTimeout)
	case c.MaxTokensCap < 0:
		return fmt.Errorf("api: max tokens cap %d must not be negative", c.MaxTokensCap)
	case c.ModelName == "":
		return errors.New("api: model name is empty")
	case slices.Contains(c.Adapters, c.ModelName) || slices.Contains(c.Adapters, ""):
		return fmt.Errorf("api: adapter ids %q: empty or the model's own id", c.Adapters)
	case slices.Contains(c.ModelAliases, "") || slices.Contains(c.ModelAliases, c.ModelName):
		return fmt.Errorf("api: model aliases %q: empty or the model's own id", c.ModelAliases)
	case slices.ContainsFunc(c.ModelAliases, func(a string) bool { return slices.Contains(c.Adapters, a) }):
		return fmt.Errorf("api: model aliases %q: one is also an adapter's id (%q)", c.ModelAliases, c.Adapters)
	case !slices.Contains(ReasoningFormats, c.ReasoningFormat):
		return fmt.Errorf("api: reasoning format %q: want one of %s", c.ReasoningFormat, strings.Join(ReasoningFormats, ", "))
	}
	for _, k := range c.APIKeys {
		if k == "" {
			return errors.New("api: empty API key")
		}
	}
	for _, d := range c.AllowedMediaDomains {
		if d != "*" && (d == "" || strings.ContainsAny(d, "/:@ *") || d != strings.ToLower(d)) {
			return fmt.Errorf("api: allowed media domain %q: want a host name in lower case (images.example.com), or * for any (no patterns)", d)
		}
	}
	for _, o := range c.AllowedOrigins {
		u, err := url.Parse(o)
		if o != "*" && (err != nil || (u.Scheme != "http" && u.Scheme != "https") || u.Host == "" || u.Path != "" || u.RawQuery != "") {
			return fmt.Errorf("api: allowed origin %q: want * or scheme://host[:port], as a browser sends it (no path)", o)
		}
	}
	return nil
}

// Generator is what the API needs of the scheduler.
//
// Concurrency: all methods are safe for concurrent use.
type Generator interface {
	Submit(ctx context.Context, req *scheduler.Request) (*scheduler.Stream, error)
	Load() scheduler.Load
	MaxContext() int
}

// Backend is a loaded model: its scheduler, tokenizer and metadata.
type Backend struct {
	Generator Generator
	Vocab     engine.Vocab
	Info      engine.ModelInfo
	Capacity  engine.Capacity // as the engine opened (its layout may be chosen at load)
	// Sampling is what a request's sampling starts from before its own fields
	// (unset: OpenAI's defaults, temperature 1 over the whole vocabulary).
	Sampling engine.SamplingDefaults
	// LlamaSampling is what a request's llama-server samplers (DRY, XTC, ...)
	// start from; unset: llama-server's defaults (all off).
	LlamaSampling LlamaSamplerFields
	// Template is the Jinja chat template chats are rendered with (the model's
	// own, Info.Template); empty: Vocab.ApplyChatTemplate, llama.cpp's formats.
	Template string
	// CheckGrammar, when set, checks a request's grammar before it is
	// answered (safe for concurrent use).
	CheckGrammar func(gbnf string) error
	// Projector reads the images of chat requests; nil: the model reads none.
	Projector engine.Projector

	chat *chatTemplate // Template compiled by SetBackend; nil when not used
	// imageSlots bounds the requests holding decoded images (withImages).
	imageSlots chan struct{}
	think      *thinkTags // the tags of its thoughts, when its template writes them: it reasons first
	dry        *dryBreakers
}

// Server serves the API. SetBackend makes it ready; Drain stops new work.
type Server struct {
	cfg      Config
	log      *slog.Logger
	backend  atomic.Pointer[Backend]
	draining atomic.Bool
	inflight atomic.Int64
	metrics  *metrics
	engine   *gin.Engine
	started  time.Time
	cluster  atomic.Pointer[clusterState]
	// relays is cancelled, with cause cluster.ErrStopping, by StopRelays.
	relays     context.Context
	stopRelays context.CancelCauseFunc
	// now and newID are replaced by golden tests for stable output.
	now   func() time.Time
	newID func(prefix string) string
}

// New builds the server and registers its metrics on reg.
func New(cfg Config, reg prometheus.Registerer, log *slog.Logger) (*Server, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	if log == nil {
		log = slog.Default()
	}
	gin.SetMode(gin.ReleaseMode)
	s := &Server{cfg: cfg, log: log, started: time.Now(), now: time.Now, newID: randomID}
	s.relays, s.stopRelays = context.WithCancelCause(context.Background())
	m, err := newMetrics(reg, s)
	if err != nil {
		return nil, err
	}
	s.metrics = m
	r := gin.New()
	r.Use(recovery(s.log))
	r.Use(s.requestLog)
	r.Use(s.cors)
	r.Use(s.limitBody)
	// What may be read may be asked for by HEAD (a load balancer's health
	// check, curl -I), answered as GET without the body.
	get := func(g gin.IRoutes, path string, h ...gin.HandlerFunc) {
		g.GET(path, h...)
		g.HEAD(path, h...)
	}
	health := func(c *gin.Context) { c.JSON(http.StatusOK, gin.H{"status": "ok"}) }
	get(r, "/health", health)
	get(r, "/v1/health", health) // llama-server's
	get(r, "/ready", s.ready)
	if g, ok := reg.(prometheus.Gatherer); ok {
		h := promhttp.HandlerFor(g, promhttp.HandlerOpts{})
		get(r, "/metrics", func(c *gin.Context) {
			if n := s.node(); n != nil {
				s.metrics.syncPeers(n.Members(), n.Name()) // before the series are read
			}
			h.ServeHTTP(c.Writer, c.Request)
		})
	}
	v1 := r.Group("/v1", s.counted, s.auth)
	get(v1, "/models", s.models)
	get(v1, "/models/*id", s.model) // ids may hold slashes ("org/name")
	v1.POST("/chat/completions", s.chat)
	v1.POST("/completions", s.completions)
	embed, rerank, anyTask := withTask(cluster.TaskEmbed), withTask(cluster.TaskRerank), withTask(cluster.TaskAny)
	v1.POST("/embeddings", embed, s.embeddings)
	v1.POST("/rerank", rerank, s.rerank)
	v1.POST("/reranking", rerank, s.rerank) // llama-server's
	v1.POST("/score", rerank, s.score)
	v1.POST("/responses", s.responses)
	r.POST("/v1/messages", anthropicErrors, s.counted, s.auth, s.messages)
	r.POST("/v1/messages/count_tokens", anthropicErrors, s.counted, s.auth, s.countTokens)
	r.POST("/infill", s.counted, s.auth, s.infill)
	for _, path := range []string{"/rerank", "/reranking", "/v2/rerank"} { // TEI's, llama-server's, Cohere's v2
		r.POST(path, rerank, s.counted, s.auth, s.rerank)
	}
	r.POST("/score", rerank, s.counted, s.auth, s.score) // vLLM's
	// llama-server's paths of OpenAI's endpoints without /v1, for clients given
	// the server's address as their base URL.
	get(r, "/models", s.counted, s.auth, s.models)
	r.POST("/chat/completions", s.counted, s.auth, s.chat)
	// llama-server's own completion endpoint (OpenAI's is /v1/completions).
	for _, path := range []string{"/completion", "/completions"} {
		r.POST(path, s.counted, s.auth, s.llamaCompletion)
	}
	get(r, "/props", s.counted, s.auth, s.props)
	r.POST("/reset_prefix_cache", s.counted, s.auth, s.resetPrefixCache) // vLLM's
	r.POST("/apply-template", s.counted, s.auth, s.applyTemplate)
	r.POST("/tokenize", anyTask, s.counted, s.auth, s.tokenize)
	r.POST("/detokenize", anyTask, s.counted, s.auth, s.detokenize)
	get(r, "/cluster", s.auth, s.clusterInfo) // 404 until SetCluster
	ollama := r.Group("/api", ollamaErrors, s.counted, s.auth)
	ollama.POST("/chat", s.ollamaChat)
	ollama.POST("/generate", s.ollamaGenerate)
	ollama.POST("/embed", embed, s.ollamaEmbed(false))
	ollama.POST("/embeddings", embed, s.ollamaEmbed(true))
	get(ollama, "/tags", s.ollamaTags)
	get(ollama, "/ps", s.ollamaPS)
	ollama.POST("/show", anyTask, s.ollamaShow)
	get(ollama, "/version", s.ollamaVersion)
	for _, path := range []string{"/pull", "/push", "/create", "/copy", "/delete"} {
		ollama.Handle(http.MethodPost, path, s.ollamaManage)
	}
	ollama.DELETE("/delete", s.ollamaManage)
	// Ollama's clients check that a server is up with GET or HEAD /.
	get(r, "/", func(c *gin.Context) { c.String(http.StatusOK, "shoal is running") })
	r.NoRoute(func(c *gin.Context) {
		markAPI(c)
		abort(c, &Error{Status: http.StatusNotFound, Type: "invalid_request_error", Code: "not_found",
			Message: fmt.Sprintf("no route %s %s", c.Request.Method, c.Request.URL.Path)})
	})
	r.HandleMethodNotAllowed = true
	// A path with a trailing slash is a 404 (through the middleware, with an id
	// and a log line), not gin's redirect, which clients do not follow with a body.
	r.RedirectTrailingSlash = false
	routes := map[string]bool{} // the routes' paths, which a 405 is counted under
	for _, rt := range r.Routes() {
		routes[rt.Path] = true
	}
	r.NoMethod(func(c *gin.Context) {
		markAPI(c)
		if routes[c.Request.URL.Path] {
			c.Set(routePathKey, c.Request.URL.Path)
		}
		abort(c, &Error{Status: http.StatusMethodNotAllowed, Type: "invalid_request_error",
			Message: fmt.Sprintf("method %s not allowed on %s", c.Request.Method, c.Request.URL.Path)})
	})
	s.engine = r
	return s, nil
}

// markAPI marks a request gin found no handler for with the API its path
// belongs to, so that its error is written in that API's format.
func markAPI(c *gin.Context) {
	switch path := c.Request.URL.Path; {
	case strings.HasPrefix(path, "/v1/messages"):
		c.Set(anthropicKey, true)
	case strings.HasPrefix(path, "/api/"):
		c.Set(ollamaKey, true)
	}
}

// recovery answers a handler's panic with 500, except errCloseConnection, which it
// hands to net/http as http.ErrAbortHandler: the connection (HTTP/1) or stream
// (HTTP/2) is then cut without finishing the response. (gin takes
// http.ErrAbortHandler itself for a broken pipe and ends the response normally.)
func recovery(log *slog.Logger) gin.HandlerFunc {
	return gin.CustomRecoveryWithWriter(nil, func(c *gin.Context, rec any) {
		if rec == errCloseConnection {
			panic(http.ErrAbortHandler)
		}
		log.Error("handler panic", "panic", rec, "path", c.Request.URL.Path, "id", c.GetString(requestIDKey))
		abort(c, &Error{Status: http.StatusInternalServerError, Type: "server_error", Message: "internal error"})
	})
}

// cors answers browsers' preflight requests and marks responses readable by the
// allowed origins (Config.AllowedOrigins); without any, it does nothing.
func (s *Server) cors(c *gin.Context) {
	if len(s.cfg.AllowedOrigins) == 0 {
		c.Next()
		return
	}
	h := c.Writer.Header()
	h.Add("Vary", "Origin") // the answer depends on it, allowed or not
	origin := c.GetHeader("Origin")
	if origin == "" || !slices.Contains(s.cfg.AllowedOrigins, "*") && !slices.Contains(s.cfg.AllowedOrigins, origin) {
		c.Next() // no CORS headers: the browser keeps the answer from the page
		return
	}
	h.Set("Access-Control-Allow-Origin", origin)
	h.Set("Access-Control-Expose-Headers", "Retry-After, X-Shoal-Served-By, X-Request-Id")
	if c.Request.Method == http.MethodOptions && c.GetHeader("Access-Control-Request-Method") != "" {
		h.Set("Access-Control-Allow-Methods", "GET, POST, OPTIONS")
		// Whatever the page asks to send: SDKs add their own (OpenAI's JS SDK sends
		// x-stainless-*), and only the API key authorises anything.
		allow := c.GetHeader("Access-Control-Request-Headers")
		if allow == "" {
			allow = "Authorization, Content-Type"
		}
		h.Set("Access-Control-Allow-Headers", allow)
		h.Add("Vary", "Access-Control-Request-Headers")
		h.Set("Access-Control-Max-Age", "600")
		c.AbortWithStatus(http.StatusNoContent)
		return
	}
	c.Next()
}

// Handler is the server's http.Handler.
func (s *Server) Handler() http.Handler { return s.engine }

// SetBackend makes the server ready with a loaded model.
// It compiles b's chat template first.
func (s *Server) SetBackend(b *Backend) {
	s.compileTemplate(b)
	b.imageSlots = make(chan struct{}, maxDecoding)
	b.dry = &dryBreakers{}
	s.backend.Store(b)
}

// Drain makes the server refuse new generation requests with 503.
func (s *Server) Drain() { s.draining.Store(true) }

// StopRelays ends the answers this node is relaying from peers, as a drain
// that timed out ends its own: a stream with an error event (code draining),
// an answer not begun with 503. Call it after the scheduler has stopped.
func (s *Server) StopRelays() { s.stopRelays(cluster.ErrStopping) }

// InFlight is how many API requests are being answered now: served here, being
// forwarded to a peer, or still being read. A draining node waits for it to reach 0
// (its scheduler alone does not see forwarded requests).
func (s *Server) InFlight() int { return int(s.inflight.Load()) }

// counted keeps InFlight for the handlers after it.
func (s *Server) counted(c *gin.Context) {
	s.inflight.Add(1)
	defer s.inflight.Add(-1)
	c.Next()
}

func (s *Server) ready(c *gin.Context) {
	switch {
	case s.backend.Load() == nil:
		abort(c, errNotReady)
	case s.draining.Load():
		abort(c, errDraining)
	default:
		c.JSON(http.StatusOK, gin.H{"status": "ready", "model": s.cfg.ModelName})
	}
}

// prefixResetter is a Generator whose prefix cache can be dropped
// (scheduler.Scheduler.ResetPrefixCache); safe for concurrent use.
type prefixResetter interface {
	ResetPrefixCache(ctx context.Context) (int, error)
}

// resetPrefixCache answers POST /reset_prefix_cache, vLLM's: this node drops
// every cached prefix no running request uses (benchmarks start cold with it).
func (s *Server) resetPrefixCache(c *gin.Context) {
	if !s.cfg.AllowCacheReset {
		abort(c, &Error{Status: http.StatusForbidden, Type: "permission_error",
			Message: "POST /reset_prefix_cache is off on this node: start it with --allow-cache-reset (vLLM serves it only with VLLM_SERVER_DEV_MODE=1)"})
		return
	}
	b, ok := s.readyBackend(c)
	if !ok {
		return
	}
	r, ok := b.Generator.(prefixResetter)
	if !ok {
		abort(c, &Error{Status: http.StatusNotImplemented, Type: "invalid_request_error", Message: "this node's engine has no prefix cache to reset"})
		return
	}
	n, err := r.ResetPrefixCache(c.Request.Context())
	if err != nil {
		abort(c, toAPIError(err))
		return
	}
	c.JSON(http.StatusOK, gin.H{"dropped_blocks": n})
}

// readyBackend returns the backend or aborts with 503.
func (s *Server) readyBackend(c *gin.Context) (*Backend, bool) {
	b := s.backend.Load()
	if b == nil {
		abort(c, errNotReady)
		return nil, false
	}
	if s.draining.Load() {
		abort(c, errDraining)
		return nil, false
	}
	return b, true
}

func (s *Server) limitBody(c *gin.Context) {
	if c.Request.Body != nil && c.Request.Body != http.NoBody {
		if enc := c.Request.Header.Get("Content-Encoding"); enc != "" && !strings.EqualFold(enc, "identity") {
			markAPI(c)
			abort(c, &Error{Status: http.StatusUnsupportedMediaType, Type: "invalid_request_error", Code: "unsupported_content_encoding",
				Message: fmt.Sprintf("Content-Encoding %q is not accepted: send the body uncompressed", enc)})
			return
		}
		limit := s.bodyLimit(c.Request.URL.Path, c.Request.ContentLength)
		if limit > s.cfg.MaxBodyBytes {
			c.Set(imageBodyKey, s.cfg.MaxBodyBytes) // decodeBody refuses more without images
		}
		body := http.MaxBytesReader(c.Writer, c.Request.Body, limit)
		if s.cfg.BodyIdleTimeout > 0 {
			body = &idleBody{ReadCloser: body, rc: http.NewResponseController(c.Writer), idle: s.cfg.BodyIdleTimeout}
		}
		c.Request.Body = body
	}
	c.Next()
}

// idleBody bounds the silences of a request body: each read must bring
// something within idle. The connection's read deadline is cleared when the
// body ends (or fails otherwise, or is closed), before the server watches
// the connection for the client leaving, which a deadline would pass for.
type idleBody struct {
	io.ReadCloser
	rc   *http.ResponseController
	idle time.Duration
	done bool
}

func (b *idleBody) Read(p []byte) (int, error) {
	if b.done {
		return b.ReadCloser.Read(p)
	}
	if err := b.rc.SetReadDeadline(time.Now().Add(b.idle)); err != nil {
		b.done = true // a writer that cannot (a test's recorder): no bound
	}
	n, err := b.ReadCloser.Read(p)
	if ne, ok := errors.AsType[net.Error](err); ok && ne.Timeout() {
		// The deadline stays: the server reads what is left of the body before
		// it answers, and must not wait for it again.
		b.done = true
		err = &Error{Status: http.StatusRequestTimeout, Type: "invalid_request_error", Code: codeBodyStalled,
			Message: fmt.Sprintf("the request body sent nothing for %v", b.idle)}
	} else if err != nil {
		b.end()
	}
	return n, err
}

func (b *idleBody) Close() error {
	b.end()
	return b.ReadCloser.Close()
}

// codeBodyStalled is the code of idleBody's error.
const codeBodyStalled = "request_timeout"

func (b *idleBody) end() {
	if !b.done {
		b.done = true
		b.rc.SetReadDeadline(time.Time{})
	}
}

// imageBodyKey holds, when a request may send more than MaxBodyBytes for its
// images, MaxBodyBytes: a body beyond it with no image in it is refused
// before it is decoded (a large body costs many times its size to decode).
const imageBodyKey = "shoal.imageBody"

// mayCarryImages reports whether a JSON body could hold an image, in any of
// the shapes the API takes them ("image_url", "images", Anthropic's "image"
// blocks, "input_image"): false means it surely holds none.
func mayCarryImages(body []byte) bool {
	return bytes.Contains(body, []byte(`"image`)) || bytes.Contains(body, []byte(`_image"`))
}

// bodyLimit is the largest body accepted for a request to path declaring
// length bytes (-1: unknown): VisionBodyBytes for the endpoints that take
// images where images are read, on this node or on an alive member that a
// request reaching this one may be forwarded to.
func (s *Server) bodyLimit(path string, length int64) int64 {
	if s.cfg.VisionBodyBytes <= s.cfg.MaxBodyBytes || (length >= 0 && length <= s.cfg.MaxBodyBytes) || !imagePaths[path] {
		return s.cfg.MaxBodyBytes
	}
	if b := s.backend.Load(); b != nil && b.Projector != nil {
		return s.cfg.VisionBodyBytes
	}
	if n := s.node(); n != nil && slices.ContainsFunc(n.Members(), func(m cluster.Member) bool { return m.Vision && m.State == "alive" }) {
		return s.cfg.VisionBodyBytes
	}
	return s.cfg.MaxBodyBytes
}

// imagePaths are the endpoints whose requests may carry images.
var imagePaths = map[string]bool{"/v1/chat/completions": true, "/chat/completions": true, "/v1/responses": true, "/v1/messages": true,
	"/v1/messages/count_tokens": true, "/api/chat": true, "/api/generate": true}

func (s *Server) auth(c *gin.Context) {
	if len(s.cfg.APIKeys) == 0 {
		c.Next()
		return
	}
	var keys []string
	if scheme, key, ok := strings.Cut(c.GetHeader("Authorization"), " "); ok && strings.EqualFold(scheme, "Bearer") {
		keys = append(keys, strings.TrimSpace(key))
	}
	if key := c.GetHeader("X-Api-Key"); key != "" {
		keys = append(keys, key) // as Anthropic's clients send it (some send both)
	}
	for _, key := range keys {
		for _, k := range s.cfg.APIKeys {
			if subtle.ConstantTimeCompare([]byte(key), []byte(k)) == 1 {
				c.Next()
				return
			}
		}
	}
	if anthropicClient(c) && strings.HasPrefix(c.Request.URL.Path, "/v1/models") {
		c.Set(anthropicKey, true) // the refusal in Anthropic's shape, as its answer would be
	}
	switch ok, err := s.admittedByMember(c); {
	case err != nil:
		abort(c, err)
	case ok:
		c.Next()
	default:
		abort(c, errUnauthorized)
	}
}

// admittedByMember reports whether c is a request forwarded, with a valid
// credential, by a cluster member that requires API keys itself: that member
// checked the client's key against its own, so nodes need not share their
// keys. A member without keys admits anyone, so what it forwards needs a key
// of this node's. The body, read to verify the credential, is put back for the
// handler; err is a body over the limit.
func (s *Server) admittedByMember(c *gin.Context) (bool, error) {
	cs := s.cluster.Load()
	from := c.GetHeader(cluster.HeaderFrom)
	if cs == nil || c.GetHeader(cluster.HeaderHop) == "" || c.Request.Body == nil || !cs.node.ChecksKeys(from) {
		return false, nil
	}
	body, err := io.ReadAll(c.Request.Body)
	if err != nil {
		return false, err // 413 past the limit
	}
	c.Request.Body = io.NopCloser(bytes.NewReader(body))
	fwd, err := s.forwardedRequest(c, body)
	return fwd && err == nil, nil
}

// abort writes err in OpenAI's format (Anthropic's on the Messages API,
// Ollama's on its API) and stops the handler chain.
func abort(c *gin.Context, err error) {
	// (A stalled body's read error cancels the request's context too, but its
	// client is there to read why.)
	if ae, ok := errors.AsType[*Error](err); errors.Is(c.Request.Context().Err(), context.Canceled) && (!ok || ae.Code != codeBodyStalled) {
		// The client hung up: no one reads an answer, and whatever err is
		// (the cancel's own, mostly), it is not the server's failure.
		c.AbortWithStatus(StatusClientClosed)
		return
	}
	e := toAPIError(err)
	if e.RetryAfter > 0 {
		c.Header("Retry-After", fmt.Sprint(e.RetryAfter))
	}
	switch {
	case c.GetBool(anthropicKey):
		c.AbortWithStatusJSON(e.Status, anthropicError(e))
	case c.GetBool(ollamaKey):
		c.AbortWithStatusJSON(e.Status, ollamaError(e))
	default:
		c.AbortWithStatusJSON(e.Status, e.body())
	}
}

// adapterName is the id of scheduler adapter a ("" for the model itself).
func (s *Server) adapterName(a int) string {
	if a < 1 || a > len(s.cfg.Adapters) {
		return ""
	}
	return s.cfg.Adapters[a-1]
}

// adapterOf reports whether model is served here, and under which adapter
// (0: the model itself).
func (s *Server) adapterOf(model string) (adapter int, here bool) {
	if model == "" || model == s.cfg.ModelName || slices.Contains(s.cfg.ModelAliases, model) {
		return 0, true
	}
	if i := slices.Index(s.cfg.Adapters, model); i >= 0 {
		return i + 1, true
	}
	return 0, false
}

func (s *Server) checkModel(model string) error {
	if _, here := s.adapterOf(model); !here {
		if s.clusterServes(model) {
			return nil // served elsewhere in the cluster: routed by the caller
		}
		return s.unknownModel(model)
	}
	return nil
}

func (s *Server) unknownModel(id string) *Error {
	return &Error{Status: http.StatusNotFound, Type: "invalid_request_error", Code: "model_not_found", Param: "model",
		Message: fmt.Sprintf("the model %q does not exist; %s", id, s.served())}
}

// served says which models requests may name: "this server serves "a", "b"".
func (s *Server) served() string {
	var ids []string
	for _, m := range s.modelList().Data {
		ids = append(ids, strconv.Quote(m.ID))
	}
	where := "this server serves"
	if s.node() != nil {
		where = "the cluster serves"
	}
	return where + " " + strings.Join(ids, ", ")
}

func (s *Server) models(c *gin.Context) {
	if s.loading(c) {
		return
	}
	list := s.modelList()
	if anthropicClient(c) {
		out := anthropicModelList{Data: []anthropicModel{}}
		for _, m := range list.Data {
			out.Data = append(out.Data, anthropicModelOf(m))
		}
		if n := len(out.Data); n > 0 {
			out.FirstID, out.LastID = out.Data[0].ID, out.Data[n-1].ID
		}
		c.JSON(http.StatusOK, out)
		return
	}
	c.JSON(http.StatusOK, list)
}

// anthropicClient reports whether c comes from Anthropic's SDK (which sends
// anthropic-version on every request): GET /v1/models answers it in
// Anthropic's shape.
func anthropicClient(c *gin.Context) bool { return c.GetHeader("anthropic-version") != "" }

// anthropicModelList is Anthropic's GET /v1/models answer.
type anthropicModelList struct {
	Data    []anthropicModel `json:"data"`
	HasMore bool             `json:"has_more"`
	FirstID string           `json:"first_id"`
	LastID  string           `json:"last_id"`
}

// anthropicModel is Anthropic's model object.
type anthropicModel struct {
	Type        string `json:"type"`
	ID          string `json:"id"`
	DisplayName string `json:"display_name"`
	CreatedAt   string `json:"created_at"`
}

func anthropicModelOf(m Model) anthropicModel {
	return anthropicModel{Type: "model", ID: m.ID, DisplayName: m.ID, CreatedAt: time.Unix(m.Created, 0).UTC().Format(time.RFC3339)}
}

// loading answers 503 while the model loads, as llama-server does: a
// client reading max_model_len at its start must not read 0.
func (s *Server) loading(c *gin.Context) bool {
	if s.backend.Load() == nil {
		abort(c, errNotReady)
		return true
	}
	return false
}

// model answers GET /v1/models/{id}, as OpenAI's models.retrieve.
func (s *Server) model(c *gin.Context) {
	if anthropicClient(c) {
		c.Set(anthropicKey, true) // its errors in Anthropic's shape too
	}
	if s.loading(c) {
		return
	}
	id := strings.TrimPrefix(c.Param("id"), "/")
	for _, m := range s.modelList().Data {
		if m.ID == id {
			if anthropicClient(c) {
				c.JSON(http.StatusOK, anthropicModelOf(m))
				return
			}
			c.JSON(http.StatusOK, m)
			return
		}
	}
	abort(c, s.unknownModel(id))
}

// modelList is this node's model and the others its cluster serves.
func (s *Server) modelList() ModelList {
	b := s.backend.Load()
	maxLen := 0
	if b != nil {
		maxLen = b.Generator.MaxContext()
	}
	owner := "shoal"
	sim := b != nil && b.Info.Architecture == "sim"
	if sim {
		owner = "shoal (simulated engine)"
	}
	var served []cluster.ServedModel
	if node := s.node(); node != nil {
		served = node.Models()
		// The longest any node of the cluster takes: requests go to one they fit.
		if i := slices.IndexFunc(served, func(m cluster.ServedModel) bool { return m.ID == s.cfg.ModelName }); i >= 0 {
			maxLen = max(maxLen, served[i].MaxModelLen)
		}
	}
	list := ModelList{Object: "list", Data: []Model{{
		ID: s.cfg.ModelName, Object: "model", Created: s.started.Unix(), OwnedBy: owner, MaxModelLen: maxLen, Simulated: sim,
	}}}
	for _, a := range s.cfg.ModelAliases { // as vLLM lists each served name
		list.Data = append(list.Data, Model{ID: a, Object: "model", Created: s.started.Unix(), OwnedBy: owner, MaxModelLen: maxLen, Simulated: sim})
	}
	for _, a := range s.cfg.Adapters {
		list.Data = append(list.Data, Model{ID: a, Object: "model", Created: s.started.Unix(), OwnedBy: owner, MaxModelLen: maxLen, Parent: s.cfg.ModelName})
	}
	for _, m := range served {
		if _, here := s.adapterOf(m.ID); !here {
			list.Data = append(list.Data, Model{ID: m.ID, Object: "model", Created: s.started.Unix(), OwnedBy: "shoal", MaxModelLen: m.MaxModelLen, Parent: m.Parent})
		}
	}
	return list
}

func (s *Server) embeddings(c *gin.Context) {
	var req EmbeddingRequest
	b, ok := s.decodeFor(c, &req, &req.Model)
	if !ok {
		return
	}
	if !serves(c, b, cluster.TaskEmbed) {
		return
	}
	switch req.EncodingFormat {
	case "", "float", "base64":
	default:
		abort(c, invalid("encoding_format", "encoding_format %q: want float or base64", req.EncodingFormat))
		return
	}
	if req.Dimensions != nil {
		abort(c, invalid("dimensions", "dimensions is not supported: this model returns %d dimensions", b.Info.EmbeddingSize))
		return
	}
	if req.Input == nil || len(req.Input.Texts)+len(req.Input.Tokens) == 0 {
		abort(c, invalid("input", "input is required"))
		return
	}
	var inputs [][]engine.Token
	for i, t := range req.Input.Texts {
		toks, err := b.Vocab.Tokenize(t, true, false)
		if err != nil || len(toks) == 0 {
			abort(c, invalid("input", "input %d is empty", i))
			return
		}
		inputs = append(inputs, toks)
	}
	for i, ids := range req.Input.Tokens {
		toks, err := tokenIDs(ids, b.Vocab.Size(), "input", i)
		if err != nil {
			abort(c, err)
			return
		}
		inputs = append(inputs, toks)
	}
	if len(inputs) > maxInputs {
		abort(c, invalid("input", "at most %d inputs per request", maxInputs))
		return
	}
	if k := req.TruncatePromptTokens; k != nil {
		keep := *k
		switch {
		case keep == -1:
			keep = stepTokens(b)
		case keep < 1:
			abort(c, invalid("truncate_prompt_tokens", "truncate_prompt_tokens must be -1 (as many as one pass computes) or at least 1, got %d", keep))
			return
		}
		for i := range inputs {
			inputs[i] = keepLast(b, inputs[i], keep)
		}
	}
	answered, done := s.spread(c, b, req.Model, inputs)
	defer done()
	if answered {
		return
	}
	adapter, _ := s.adapterOf(req.Model)
	vecs, tokens, ok := s.embed(c, b, inputs, adapter, "input", req.Normalize == nil || *req.Normalize)
	if !ok {
		return
	}
	resp := EmbeddingResponse{Object: "list", Model: cmp.Or(req.Model, s.cfg.ModelName)}
	for i, vec := range vecs {
		d := EmbeddingData{Object: "embedding", Index: i}
		if req.EncodingFormat == "base64" {
			d.Embedding = base64Floats(vec)
		} else {
			d.Embedding = vec
		}
		resp.Data = append(resp.Data, d)
	}
	resp.Usage.PromptTokens, resp.Usage.TotalTokens = tokens, tokens
	c.JSON(http.StatusOK, resp)
}

// taskKey holds what a request asks of the node that runs it (cluster.Meta.Task;
// unset: generation).
const taskKey = "shoal.task"

// withTask marks a route's requests as of task.
func withTask(task string) gin.HandlerFunc {
	return func(c *gin.Context) { c.Set(taskKey, task) }
}

// servesTask reports whether this node computes what c asks (its model aside).
func (s *Server) servesTask(c *gin.Context) bool {
	b := s.backend.Load()
	task := c.GetString(taskKey)
	return b == nil || task == cluster.TaskAny || task == TaskOf(b.Info)
}

// TaskOf is what a node serving a model of info computes (cluster.Meta.Task).
func TaskOf(info engine.ModelInfo) string {
	switch {
	case info.Rerank != nil:
		return cluster.TaskRerank
	case info.Pooling:
		return cluster.TaskEmbed
	}
	return cluster.TaskGenerate
}

// spread routes an embedding, rerank or score request as generation is routed,
// among the nodes that serve model for its task: where inputs start from a
// cached prefix (Capacity.PoolsLast: a rerank request's pairs share the query)
// by where the first input is cached, else as a request without blocks (in
// turn); the router counts all inputs against the node it is sent to.
// answered: it was forwarded (or refused); else the caller serves it and calls
// done when it ends. A forwarded request has made its one hop.
func (s *Server) spread(c *gin.Context, b *Backend, model string, inputs [][]engine.Token) (answered bool, done func()) {
	if _, forwarded := c.Get(forwardedByKey); forwarded || len(inputs) == 0 {
		return false, func() {}
	}
	return s.route(c, cmp.Or(model, s.cfg.ModelName), inputs[0], inputs[1:], 1, cluster.Need{}, 0, !b.Capacity.PoolsLast)
}

// taskUse names what a node of each task serves and the endpoints that ask for
// it; taskNeeds, what a request of each task needs.
var (
	taskUse = map[string]string{
		cluster.TaskGenerate: "a generation model: use /v1/chat/completions or /v1/completions",
		cluster.TaskEmbed:    "an embedding model: use /v1/embeddings",
		cluster.TaskRerank:   "a reranker, which scores pairs of texts: use /v1/rerank or /v1/score",
	}
	taskNeeds = map[string]string{
		cluster.TaskGenerate: "generation needs a node serving its model without --embeddings or --reranking",
		cluster.TaskEmbed:    "embeddings need an embedding node: --embeddings (and --pooling for models without their own)",
		cluster.TaskRerank:   "rerank and score need a reranker served with --reranking",
	}
)

// serves reports whether b computes task (generation, embeddings or ranking),
// else answers c with what it computes and what task needs.
func serves(c *gin.Context, b *Backend, task string) bool {
	if have := TaskOf(b.Info); have != task {
		abort(c, invalid("model", "this node serves %s; %s", taskUse[have], taskNeeds[task]))
		return false
	}
	return true
}

// embed computes each input's embedding under adapter (at unit length when
// unit) and counts their tokens; ok is false when it answered c with an error
// (param names the inputs' field).
func (s *Server) embed(c *gin.Context, b *Backend, inputs [][]engine.Token, adapter int, param string, unit bool) (vecs [][]float32, tokens int, ok bool) {
	ctx := c.Request.Context()
	statsOf(ctx).serves(cmp.Or(s.adapterName(adapter), s.cfg.ModelName))
	// Inputs are submitted as a window that moves on as results come back: all at
	// once, 2,048 inputs would overflow a queue of --max-waiting 1,024 on an idle
	// node and earn a 429 that no retry could ever get past.
	load := b.Generator.Load()
	// Every input is checked before any is computed: one too long among
	// thousands would otherwise be found only when its turn came.
	for i, in := range inputs {
		if err := fitsOnePass(len(in), b); err != nil {
			s.metrics.rejected(err)
			abort(c, &Error{Status: http.StatusBadRequest, Type: "invalid_request_error", Code: "context_length_exceeded", Param: param,
				Message: fmt.Sprintf("%s %d: %v", param, i, err)})
			return nil, 0, false
		}
	}
	window := embedWindow
	if mw := load.MaxWaiting; mw > 0 {
		window = max(1, min(window, mw/2))
	}
	streams := make([]*scheduler.Stream, len(inputs))
	started := make([]time.Time, len(inputs))
	submit := func(i int) bool {
		started[i] = time.Now()
		st, err := b.Generator.Submit(ctx, &scheduler.Request{Prompt: inputs[i], Embed: true, Adapter: adapter})
		if err != nil {
			s.metrics.rejected(err)
			if errors.Is(err, scheduler.ErrPromptTooLong) {
				err = &Error{Status: http.StatusBadRequest, Type: "invalid_request_error", Code: "context_length_exceeded", Param: param,
					Message: fmt.Sprintf("%s %d: %v", param, i, err)}
			}
			abort(c, err)
			return false
		}
		streams[i] = st
		return true
	}
	for i := range min(window, len(inputs)) {
		if !submit(i) {
			return nil, 0, false
		}
	}
	for i, st := range streams {
		var vec []float32
		for {
			ev, ok := st.Next(ctx)
			if !ok {
				abort(c, errors.New("embedding stream ended without a result"))
				return nil, 0, false
			}
			if ev.Kind == scheduler.EventEmbedding {
				vec = ev.Vector
				if unit {
					vec = normalize(vec)
				}
			}
			if ev.Kind == scheduler.EventError {
				abort(c, ev.Err)
				return nil, 0, false
			}
			if ev.Kind == scheduler.EventDone {
				statsOf(ctx).count(ev.Usage)
				tokens += ev.Usage.PromptTokens
				// Each input is a request, as vLLM counts a pooling one.
				s.metrics.finished(scheduler.FinishStop)
				s.metrics.e2e.Observe(ev.At.Sub(started[i]).Seconds())
				s.metrics.queue.Observe(ev.Usage.QueueTime.Seconds())
				s.metrics.promptLen.Observe(float64(ev.Usage.PromptTokens))
				break
			}
		}
		if j := i + window; j < len(inputs) && !submit(j) { // input i is done: the next may wait
			return nil, 0, false
		}
		vecs = append(vecs, vec)
	}
	return vecs, tokens, true
}

// fitsOnePass says why an embedding input of n tokens cannot be computed by b,
// as its scheduler would refuse it: in one step (Load.MaxBatchTokens, 0: any),
// shorter than the context.
func fitsOnePass(n int, b *Backend) error {
	// The smaller bound is the one to say.
	switch budget, maxContext := b.Generator.Load().MaxBatchTokens, b.Generator.MaxContext(); {
	case budget > 0 && budget < maxContext && n > budget:
		return tooLongError(fmt.Sprintf("%d tokens exceed the step budget of %d (--max-batch-tokens), in which an input is computed", n, budget))
	case n >= maxContext:
		return tooLongError(fmt.Sprintf("%d tokens, more than the %d an input may have (the context's %d, less one)", n, maxContext-1, maxContext))
	}
	return nil
}

// tooLongError is an input too long to compute: a scheduler.ErrPromptTooLong
// (counted as too_long), said in its own words.
type tooLongError string

func (e tooLongError) Error() string        { return string(e) }
func (e tooLongError) Is(target error) bool { return target == scheduler.ErrPromptTooLong }

// stepTokens is the longest input b computes in one pass: what one step takes,
// shorter than the context.
func stepTokens(b *Backend) int {
	n := b.Generator.MaxContext() - 1
	if budget := b.Generator.Load().MaxBatchTokens; budget > 0 {
		n = min(n, budget)
	}
	return n
}

// maxInputs bounds one request's embedding inputs, and a rerank or score
// request's pairs.
const maxInputs = 2048

// embedWindow is how many inputs of one embeddings request wait in the scheduler at
// most: enough to fill a batch.
const embedWindow = 64

// normalize scales v to unit length, as OpenAI's and llama-server's embeddings are.
func normalize(v []float32) []float32 {
	var sum float64
	for _, x := range v {
		sum += float64(x) * float64(x)
	}
	if sum == 0 {
		return v
	}
	n := float32(1 / math.Sqrt(sum))
	out := make([]float32, len(v))
	for i, x := range v {
		out[i] = x * n
	}
	return out
}

// base64Floats is OpenAI's base64 encoding: little-endian float32s.
func base64Floats(v []float32) string {
	b := make([]byte, 4*len(v))
	for i, x := range v {
		binary.LittleEndian.PutUint32(b[4*i:], math.Float32bits(x))
	}
	return base64.StdEncoding.EncodeToString(b)
}
