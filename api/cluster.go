package api

import (
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"net/http"
	"slices"
	"strings"
	"time"

	"github.com/gin-gonic/gin"

	"github.com/shoal-ai/shoal/cluster"
	"github.com/shoal-ai/shoal/engine"
)

// maxForwardTries is the first choice plus two retries on the next best peers.
const maxForwardTries = 3

// SetCluster joins the server to a cluster: requests are routed with node's policy
// and forwarded at most one hop with fwd; secret authenticates forwarded requests.
// It may be called while the server is serving (the cluster starts once the model
// is loaded).
func (s *Server) SetCluster(node *cluster.Node, fwd *cluster.Forwarder, secret []byte) {
	s.cluster.Store(&clusterState{node: node, fwd: fwd, secret: secret})
}

// clusterState is what SetCluster gives; nil until then.
type clusterState struct {
	node   *cluster.Node
	fwd    *cluster.Forwarder
	secret []byte
}

// node is this server's cluster node, or nil.
func (s *Server) node() *cluster.Node {
	if cs := s.cluster.Load(); cs != nil {
		return cs.node
	}
	return nil
}

// clusterServes reports whether an alive member of this node's cluster serves model.
func (s *Server) clusterServes(model string) bool {
	node := s.node()
	return node != nil && slices.ContainsFunc(node.Models(), func(m cluster.ServedModel) bool { return m.ID == model })
}

func (s *Server) clusterInfo(c *gin.Context) {
	node := s.node()
	if node == nil {
		abort(c, &Error{Status: http.StatusNotFound, Type: "invalid_request_error", Message: "this node is not in a cluster"})
		return
	}
	c.JSON(http.StatusOK, gin.H{"self": node.Name(), "members": node.Members()})
}

// forwardedRequest checks the hop credential of a request whose body is read. A
// claim to be forwarded that does not authenticate is rejected (401).
func (s *Server) forwardedRequest(c *gin.Context, body []byte) (bool, error) {
	if c.GetHeader(cluster.HeaderHop) == "" {
		return false, nil
	}
	var secret []byte
	if cs := s.cluster.Load(); cs != nil {
		secret = cs.secret
	}
	fwd, err := cluster.Verify(secret, c.Request, body, time.Now())
	if err != nil {
		return fwd, &Error{Status: http.StatusUnauthorized, Type: "authentication_error", Code: "invalid_cluster_credential", Message: err.Error()}
	}
	if fwd {
		if _, checked := c.Get(forwardedByKey); !checked { // auth and the handler may both ask
			s.metrics.fromPeers.Inc()
		}
		c.Set(forwardedByKey, c.GetHeader(cluster.HeaderFrom)) // verified: the log may name it
	}
	return fwd, nil
}

// streamFailure ends c's stream, relayed from a peer, that failed mid-way
// (code peer_failed or draining), in the format of c's API: Anthropic's and the
// Responses API's clients act on named events only, Ollama's read lines of JSON.
func streamFailure(c *gin.Context) func(code, message string) string {
	event := func(name string, v any) string {
		b, _ := json.Marshal(v)
		return "event: " + name + "\ndata: " + string(b) + "\n\n"
	}
	failed := func(code, message string) *Error {
		if code == "draining" {
			return &Error{Status: errDraining.Status, Type: errDraining.Type, Code: code, Message: message}
		}
		return &Error{Status: http.StatusBadGateway, Type: "server_error", Code: code, Message: message}
	}
	switch {
	case c.GetBool(anthropicKey):
		return func(code, message string) string {
			return event("error", anthropicError(failed(code, message)))
		}
	case strings.HasSuffix(c.Request.URL.Path, "/responses"):
		return func(code, message string) string {
			return event("error", gin.H{"type": "error", "code": code, "message": message, "param": nil})
		}
	case c.GetBool(ollamaKey): // a line of newline-delimited JSON
		return func(code, message string) string {
			b, _ := json.Marshal(ollamaError(&Error{Message: message}))
			return string(b) + "\n"
		}
	case slices.Contains([]string{"/infill", "/completion", "/completions"}, c.Request.URL.Path): // llama-server's streams end without [DONE]
		return func(code, message string) string {
			b, _ := json.Marshal(failed(code, message).body())
			return "data: " + string(b) + "\n\n"
		}
	}
	return nil
}

// route sends a request elsewhere when the router prefers another node. It returns
// true when the request was answered (forwarded, or refused with 429), false when it
// should be served here; then the caller calls done when the local request ends, so
// that the router counts it until the node's gossiped load shows it. tokens may be
// nil (model served only elsewhere); uncached: the request reads nothing from the
// prefix cache (Node.RouteUncached). more are the request's other prompts (a
// batch's other inputs, a completion request's other prompts) and choices the
// sequences it runs besides tokens' (n): the router counts them all against
// the node it is sent to. need is what the request asks of a node (its
// length, output and sequences), which only nodes whose limits it fits give.
func (s *Server) route(c *gin.Context, model string, tokens []engine.Token, more [][]engine.Token, choices int, need cluster.Need, priority int, uncached bool) (answered bool, done func()) {
	noop := func() {}
	cs := s.cluster.Load()
	if cs == nil {
		return false, noop
	}
	var t32 []int32
	if tokens != nil {
		t32 = make([]int32, len(tokens))
		for i, t := range tokens {
			t32[i] = int32(t)
		}
	}
	targets, err := cs.node.RouteTask(c.GetString(taskKey), model, t32, need, priority, !uncached)
	switch {
	case errors.Is(err, cluster.ErrSaturated):
		s.metrics.rejected(errSaturatedMarker)
		abort(c, &Error{Status: http.StatusTooManyRequests, Type: "rate_limit_error", Code: "cluster_saturated",
			Message: "every node serving this model is at capacity; retry later", RetryAfter: 1})
		return true, noop
	case errors.Is(err, cluster.ErrNoNode), errors.Is(err, cluster.ErrDraining), errors.Is(err, cluster.ErrUnavailable):
		switch {
		case tokens != nil:
			return false, noop // no member serves it: this node, if it can
		case errors.Is(err, cluster.ErrDraining):
			abort(c, allDraining(model))
		case errors.Is(err, cluster.ErrUnavailable):
			// Its nodes left or died moments ago (a restart): not unknown.
			abort(c, retryLater("model_unavailable", "no node serving the model "+model+" is up now (restarting, or failed); retry later"))
		default:
			task := c.GetString(taskKey)
			if m, ok := s.servingMember(func(m cluster.Member) bool {
				return cmp.Or(m.Task, cluster.TaskGenerate) != task && m.Serves(model)
			}); ok && taskNeeds[task] != "" {
				// Served, for another task (an embedding model asked to generate):
				// what a node of its own would answer.
				abort(c, invalid("model", "the model %s is served as %s; %s", model, taskUse[cmp.Or(m.Task, cluster.TaskGenerate)], taskNeeds[task]))
				return true, noop
			}
			abort(c, &Error{Status: http.StatusNotFound, Type: "invalid_request_error", Code: "model_not_found", Param: "model",
				Message: "no node of this cluster serves the model " + model})
		}
		return true, noop
	case err != nil:
		abort(c, err)
		return true, noop
	}
	c.Set(routedModelKey, model)
	body, _ := c.Get(bodyKey)
	raw, _ := body.([]byte)
	seqs, moreTok := (1+len(more))*max(choices, 1)-1, 0
	for _, m := range more {
		moreTok += len(m)
	}
	path := c.Request.URL.Path
	if path == "/chat/completions" {
		path = "/v1/chat/completions" // llama-server's path of it: a peer of an older version has only OpenAI's
	}
	var lastErr error
	// Peers that answered 429 (queue full), that failed, that answered 401,
	// that were shutting down, that were starting.
	busy, broken, refused, draining, starting := 0, 0, 0, 0, 0
	for i, t := range targets {
		if i == maxForwardTries {
			break
		}
		t = t.With(seqs, moreTok)
		if t.Local {
			s.metrics.routedTo(cs.node.Name())
			return false, cs.node.Sent(t)
		}
		done := cs.node.Sent(t)
		err := s.forward(c, cs.fwd, t, path, raw)
		var re *cluster.RetryableError
		if errors.As(err, &re) {
			cs.node.Refused(t)
			done()
			s.log.Warn("forward failed; trying the next node", "peer", t.Name, "err", err)
			if re.Unreachable {
				cs.node.Unreachable(t.Name)
			}
			reason := "failed"
			switch re.Status {
			case http.StatusTooManyRequests:
				busy++
				reason = "busy"
			case http.StatusUnauthorized:
				if strings.Contains(err.Error(), "invalid_cluster_credential") {
					broken++ // another --cluster-secret: misconfigured, logged above
				} else {
					refused++ // the client's key
					reason = "refused"
				}
			case http.StatusServiceUnavailable:
				switch msg := err.Error(); { // in any API's error format
				case strings.Contains(msg, errDraining.Message):
					draining++ // its drain ended before it ran the request
				case strings.Contains(msg, errNotReady.Message):
					starting++ // joined, its model not yet loaded
				default:
					broken++
				}
			default:
				broken++
			}
			s.metrics.forwardFailedAt(t.Name, reason)
			lastErr = err
			continue
		}
		done()
		s.metrics.routedTo(t.Name) // the peer took it, whatever came of it
		if err != nil && !errors.Is(err, cluster.ErrClientGone) {
			s.log.Warn("forward ended with an error", "peer", t.Name, "err", err)
		}
		var te *cluster.TruncatedError
		if errors.As(err, &te) {
			// The status and part of the body are out: only a closed connection
			// (no final chunk) tells the client the body is incomplete.
			closeConnection(c)
			return true, noop
		}
		if errors.Is(err, cluster.ErrStopping) && !c.Writer.Written() {
			abort(c, errDraining)
			return true, noop
		}
		if err != nil && !c.Writer.Written() {
			// Connected, but no answer (the peer may have run it, so no retry).
			abort(c, &Error{Status: http.StatusBadGateway, Type: "server_error", Code: "peer_failed", Message: err.Error()})
			return true, noop
		}
		if st := statsOf(c.Request.Context()); err != nil && st != nil {
			st.incomplete.Store(true) // not relayed whole
		}
		c.Abort()
		return true, noop
	}
	if tokens != nil {
		s.metrics.routedTo(cs.node.Name())
		return false, noop // no peer answered: serve here if this node can
	}
	if refused > 0 && busy == 0 && broken == 0 {
		// Every peer refused the client's key (this node, without keys of its
		// own, forwarded it): the client's to mend, not a failure.
		abort(c, errUnauthorized)
		return true, noop
	}
	switch {
	case starting > 0 && busy == 0 && broken == 0:
		abort(c, retryLater("not_ready", "the nodes serving the model "+model+" are starting; retry later"))
		return true, noop
	case draining > 0 && busy == 0 && broken == 0:
		abort(c, allDraining(model))
		return true, noop
	}
	if busy > 0 && broken == 0 { // every peer tried was busy, none broken: come back later
		s.metrics.rejected(errSaturatedMarker)
		abort(c, &Error{Status: http.StatusTooManyRequests, Type: "rate_limit_error", Code: "cluster_saturated",
			Message: "every node serving this model is at capacity; retry later", RetryAfter: 1})
		return true, noop
	}
	// Unreachable or failing peers: a failed node is found out within seconds
	// and its requests go elsewhere, so the client may retry.
	abort(c, &Error{Status: http.StatusBadGateway, Type: "server_error", Code: "peers_unavailable", Message: "no peer serving the model answered: " + errString(lastErr), RetryAfter: 1})
	return true, noop
}

// forward relays c's request to t until it ends, the client leaves or the
// node stops (StopRelays).
func (s *Server) forward(c *gin.Context, fwd *cluster.Forwarder, t cluster.Target, path string, body []byte) error {
	ctx, cancel := context.WithCancelCause(c.Request.Context())
	defer cancel(nil)
	stop := context.AfterFunc(s.relays, func() { cancel(context.Cause(s.relays)) })
	defer stop()
	return fwd.ForwardStream(ctx, t, c.Request.Method, path, c.Request.Header, body, c.Writer, streamFailure(c))
}

// taskModel is the model the first alive member serving task serves ("" when
// none does), for a request that names no model at a node that does not
// compute its task.
func (s *Server) taskModel(task string) string {
	m, ok := s.servingMember(func(m cluster.Member) bool { return cmp.Or(m.Task, cluster.TaskGenerate) == task && len(m.Models) > 0 })
	if !ok {
		return ""
	}
	return m.Models[0]
}

// visionServes reports whether an alive member reads images for model.
func (s *Server) visionServes(model string) bool {
	_, ok := s.servingMember(func(m cluster.Member) bool {
		return m.Vision && m.Serves(model)
	})
	return ok
}

// servingMember is the first member, this node first, that is alive, not
// draining, and of which want is true.
func (s *Server) servingMember(want func(cluster.Member) bool) (cluster.Member, bool) {
	if n := s.node(); n != nil {
		for _, m := range n.Members() {
			if m.State == "alive" && !m.Draining && want(m) {
				return m, true
			}
		}
	}
	return cluster.Member{}, false
}

// closeConnection cuts the client's connection (HTTP/1) or stream (HTTP/2) without
// finishing the response, through the server's recovery (see recovery). It does not
// return.
func closeConnection(c *gin.Context) {
	c.Abort()
	panic(errCloseConnection)
}

// errCloseConnection is closeConnection's panic value.
var errCloseConnection = errors.New("api: close the connection mid-response")

func errString(err error) string {
	if err == nil {
		return "no candidates"
	}
	return err.Error()
}

// routedModelKey holds the model a request was routed for, for the log line
// of one answered by a peer.
const routedModelKey = "shoal.routedModel"

// allDraining is the answer when every node serving model is shutting down.
func allDraining(model string) *Error {
	return retryLater("draining", "every node serving the model "+model+" is shutting down; retry later")
}

// retryLater is a 503 to retry soon under code: the nodes serving a model
// draining, starting or gone for a moment (a rolling restart).
func retryLater(code, message string) *Error {
	return &Error{Status: http.StatusServiceUnavailable, Type: "service_unavailable", Code: code, Message: message, RetryAfter: 1}
}

// errSaturatedMarker labels cluster-wide 429s in shoal_requests_rejected_total.
var errSaturatedMarker = errors.New("cluster saturated")
