package cluster

import (
	"bytes"
	"context"
	"crypto/hmac"
	"crypto/sha256"
	"crypto/tls"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/url"
	"strconv"
	"strings"
	"time"
)

// Headers of a forwarded request. A request carrying HeaderHop was forwarded by a
// peer: it must carry a valid credential and is never forwarded again.
const (
	HeaderHop  = "X-Shoal-Hop"
	HeaderFrom = "X-Shoal-From"
	HeaderTime = "X-Shoal-Time"
	HeaderAuth = "X-Shoal-Auth"
	// HeaderRequestID names a request in every node's log; a forward carries
	// the client's (or the first node's) on.
	HeaderRequestID = "X-Request-Id"
	// maxSkew bounds the clock difference a credential tolerates (replay window).
	maxSkew = 2 * time.Minute
)

// ErrBadCredential: a request claimed to be forwarded without a valid credential.
var ErrBadCredential = errors.New("cluster: forwarded request without a valid cluster credential")

func sign(secret []byte, from, ts, method, path string, body []byte) string {
	bh := sha256.Sum256(body)
	m := hmac.New(sha256.New, secret)
	fmt.Fprintf(m, "%s\n%s\n%s\n%s\n%x", from, ts, method, path, bh)
	return hex.EncodeToString(m.Sum(nil))
}

// Verify reports whether r (with its body already read) is a forwarded request, and
// rejects a claim to be one that does not authenticate.
func Verify(secret []byte, r *http.Request, body []byte, now time.Time) (forwarded bool, err error) {
	if r.Header.Get(HeaderHop) == "" {
		return false, nil
	}
	ts := r.Header.Get(HeaderTime)
	sec, perr := strconv.ParseInt(ts, 10, 64)
	if perr != nil || len(secret) == 0 {
		return true, ErrBadCredential
	}
	if d := now.Sub(time.Unix(sec, 0)); d > maxSkew || d < -maxSkew {
		return true, fmt.Errorf("%w: timestamp %s is outside the accepted window", ErrBadCredential, ts)
	}
	want := sign(secret, r.Header.Get(HeaderFrom), ts, r.Method, r.URL.Path, body)
	if !hmac.Equal([]byte(want), []byte(r.Header.Get(HeaderAuth))) {
		return true, ErrBadCredential
	}
	return true, nil
}

// Forwarder relays requests to peers.
type Forwarder struct {
	from   string
	secret []byte
	client *http.Client
	tls    bool // forward over TLS only: the client's API key and prompt stay encrypted
	lost   func(peer string) bool
}

// ErrPeerLost is why a forward was given up: the cluster declared its peer
// dead (or it left) while the answer was awaited (Forwarder.Watch).
var ErrPeerLost = errors.New("the cluster declared the peer dead")

// ErrClientGone means the client left while its answer was relayed: what it
// did not read is lost to it, and nothing is wrong with the peer.
var ErrClientGone = errors.New("the client left mid-answer")

// peerCheck is how often a forward asks whether its peer is lost.
const peerCheck = 250 * time.Millisecond

// Watch makes f give up a forward whose peer lost reports gone (Node.Lost): a
// process that hangs (stopped, swapping, wedged) keeps its connections open and
// answers nothing, with no error to end the wait, while the cluster's probes
// declare it dead within seconds. Before its first byte the forward is then
// retried elsewhere (the peer will find its client gone, should it wake); a
// stream it began ends with the API's failure event. Call Watch before the
// first forward; lost must be safe to call from any goroutine.
func (f *Forwarder) Watch(lost func(peer string) bool) { f.lost = lost }

// watch cancels ctx with ErrPeerLost once f.lost reports peer gone.
func (f *Forwarder) watch(ctx context.Context, cancel context.CancelCauseFunc, peer string) {
	tick := time.NewTicker(peerCheck)
	defer tick.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-tick.C:
			if f.lost(peer) {
				cancel(ErrPeerLost)
				return
			}
		}
	}
}

// NewForwarder makes a forwarder for node from. With tlsConf (nil: plain HTTP) it
// forwards only to peers that serve TLS, verified with it: a peer that advertises
// plain HTTP (misconfigured, or not a member at all) is refused rather than sent the
// client's API key and prompt in the clear.
func NewForwarder(from string, secret []byte, tlsConf *tls.Config) *Forwarder {
	tr := &http.Transport{
		DialContext:         (&net.Dialer{Timeout: 2 * time.Second, KeepAlive: 30 * time.Second}).DialContext,
		MaxIdleConnsPerHost: 64,
		IdleConnTimeout:     90 * time.Second,
		TLSClientConfig:     tlsConf,
		// A peer that takes the connection but never completes a handshake
		// (its accept backlog full) is given up as unreachable, and the next tried.
		TLSHandshakeTimeout: 5 * time.Second,
		// No header timeout: an answer that is not streamed sends its headers only
		// once the whole generation is done, which may take as long as it takes. A
		// peer that dies closes the connection; a client that leaves cancels.
	}
	// A redirect is not followed: it would carry the prompt, the client's key
	// and this node's credential to wherever the answer points, over plain
	// HTTP even.
	noRedirect := func(*http.Request, []*http.Request) error { return http.ErrUseLastResponse }
	return &Forwarder{from: from, secret: secret, client: &http.Client{Transport: tr, CheckRedirect: noRedirect}, tls: tlsConf != nil}
}

// RetryableError means nothing reached the client and the peer ran nothing (it could
// not be connected to, or it refused the request with 5xx or 429): the caller may try
// the next peer. Unreachable says it could not be connected to at all.
type RetryableError struct {
	Err         error
	Unreachable bool
	Status      int // the peer's answer (5xx or 429); 0 when it could not be reached
}

func (e *RetryableError) Error() string { return e.Err.Error() }
func (e *RetryableError) Unwrap() error { return e.Err }

// Forward sends body to target's path and relays the answer to w as it comes (SSE
// chunks pass through one by one). It fails with a RetryableError when the peer could
// not be reached or answered 5xx before anything was written to w. A peer that dies
// mid-stream ends an SSE response with an error event. Cancelling ctx (the client
// left) cancels the upstream request.
func (f *Forwarder) Forward(ctx context.Context, t Target, method, path string, header http.Header, body []byte, w http.ResponseWriter) error {
	return f.ForwardStream(ctx, t, method, path, header, body, w, openAIFailure)
}

// openAIFailure is the end of an OpenAI stream that failed mid-way.
func openAIFailure(code, message string) string {
	typ := "server_error"
	if code == "draining" {
		typ = "service_unavailable" // as the node's own drain says it
	}
	b, _ := json.Marshal(map[string]any{"error": map[string]any{"message": message, "type": typ, "param": nil, "code": code}})
	return "data: " + string(b) + "\n\ndata: [DONE]\n\n"
}

// ErrStopping, as the cause of a forward's context, means this node stops
// (its drain timed out): a relayed stream ends with a failure event, code
// "draining", rather than as one whose client left.
var ErrStopping = errors.New("this node is shutting down")

// stopping reports whether ctx was cancelled because this node stops.
func stopping(ctx context.Context) bool { return errors.Is(context.Cause(ctx), ErrStopping) }

// ForwardStream is Forward, ending a stream whose peer failed mid-way with
// failure's events (each API has its own stream format) for an error code
// (peer_failed; draining when ctx's cause is ErrStopping) and message.
func (f *Forwarder) ForwardStream(ctx context.Context, t Target, method, path string, header http.Header, body []byte, w http.ResponseWriter, failure func(code, message string) string) error {
	if failure == nil {
		failure = openAIFailure
	}
	scheme := "http"
	if t.TLS {
		scheme = "https"
	} else if f.tls {
		// A misconfigured peer, not a failed one: not marked unreachable.
		return &RetryableError{Err: fmt.Errorf("forward to %s: it serves plain HTTP and this node forwards over TLS only", t.Name)}
	}
	client := ctx // the client's: cancelled when it leaves
	ctx, cancel := context.WithCancelCause(ctx)
	defer cancel(nil)
	if f.lost != nil {
		go f.watch(ctx, cancel, t.Name)
	}
	req, err := http.NewRequestWithContext(ctx, method, scheme+"://"+t.HTTP+path, strings.NewReader(string(body)))
	if err != nil {
		return err
	}
	for _, h := range []string{"Content-Type", "Accept", "Authorization", "X-Api-Key", HeaderRequestID} {
		if v := header.Get(h); v != "" {
			req.Header.Set(h, v)
		}
	}
	ts := strconv.FormatInt(time.Now().Unix(), 10)
	req.Header.Set(HeaderHop, "1")
	req.Header.Set(HeaderFrom, f.from)
	req.Header.Set(HeaderTime, ts)
	req.Header.Set(HeaderAuth, sign(f.secret, f.from, ts, method, path, body))
	resp, err := f.client.Do(req)
	if err != nil {
		if stopping(client) {
			return fmt.Errorf("forward to %s: %w", t.Name, ErrStopping)
		}
		if client.Err() != nil {
			return client.Err()
		}
		if errors.Is(context.Cause(ctx), ErrPeerLost) {
			return &RetryableError{Err: fmt.Errorf("forward to %s: no answer: %w", t.Name, ErrPeerLost), Unreachable: true}
		}
		if ue := (*url.Error)(nil); errors.As(err, &ue) {
			err = ue.Err // without the peer's URL, which clients see in errors
		}
		if dialFailed(err) {
			return &RetryableError{Err: fmt.Errorf("forward to %s: %w", t.Name, err), Unreachable: true}
		}
		// Connected: the peer may be running the request, so another peer must not
		// run it again.
		return fmt.Errorf("forward to %s: %w", t.Name, err)
	}
	defer resp.Body.Close()
	if resp.StatusCode >= 500 || resp.StatusCode == http.StatusTooManyRequests || resp.StatusCode == http.StatusUnauthorized ||
		resp.StatusCode >= 300 && resp.StatusCode < 400 {
		// Refused before running it (its own queue full: gossip lags; a
		// misconfigured peer refusing this node's credential; a redirect, not
		// followed), or failed.
		b, _ := io.ReadAll(io.LimitReader(resp.Body, 4096))
		return &RetryableError{Err: fmt.Errorf("forward to %s: status %d: %s", t.Name, resp.StatusCode, strings.TrimSpace(string(b))), Status: resp.StatusCode}
	}
	for _, h := range []string{"Content-Type", "Cache-Control", "Retry-After", "X-Accel-Buffering"} {
		if v := resp.Header.Get(h); v != "" {
			w.Header().Set(h, v)
		}
	}
	w.Header().Set("X-Shoal-Served-By", t.Name)
	w.WriteHeader(resp.StatusCode)
	flusher, _ := w.(http.Flusher)
	sse := strings.HasPrefix(resp.Header.Get("Content-Type"), "text/event-stream")
	// A stream passes on whole events (SSE) or whole lines (newline-delimited
	// JSON, Ollama's streams) only, so that a peer failing mid-event leaves no
	// half event before the failure's.
	ndjson := strings.HasPrefix(resp.Header.Get("Content-Type"), "application/x-ndjson")
	var end []byte // what ends an event or line
	switch {
	case sse:
		end = []byte("\n\n")
	case ndjson:
		end = []byte("\n")
	}
	var partial []byte // the event begun, not yet passed on
	buf := make([]byte, 32<<10)
	for {
		n, rerr := resp.Body.Read(buf)
		out := buf[:n]
		if end != nil {
			partial = append(partial, out...)
			i := bytes.LastIndex(partial, end) + len(end)
			if i < len(end) {
				i = 0
			}
			out = partial[:i]
			partial = partial[i:]
		}
		if len(out) > 0 {
			if _, werr := w.Write(out); werr != nil {
				return ErrClientGone // ctx cancels upstream
			}
			if flusher != nil {
				flusher.Flush()
			}
		}
		if end != nil {
			partial = bytes.Clone(partial) // out, written, may share its array
		}
		if rerr == io.EOF {
			if len(partial) > 0 { // a last event without its end
				_, _ = w.Write(partial)
			}
			return nil
		}
		if rerr != nil {
			code, message := "peer_failed", "peer "+t.Name+" failed mid-stream"
			switch cause := context.Cause(ctx); {
			case stopping(client):
				rerr, code, message = ErrStopping, "draining", "the node relaying this answer is shutting down"
			case client.Err() != nil:
				return ErrClientGone
			case errors.Is(cause, ErrPeerLost):
				rerr = cause
			}
			switch {
			case end != nil:
				_, _ = io.WriteString(w, failure(code, message))
			default:
				// A body cut short must not end like a whole one: the caller
				// aborts the connection.
				return &TruncatedError{Err: fmt.Errorf("forward to %s: mid-body: %w", t.Name, rerr)}
			}
			if flusher != nil {
				flusher.Flush()
			}
			return fmt.Errorf("forward to %s: mid-stream: %w", t.Name, rerr)
		}
	}
}

// TruncatedError means a response that is not a stream was cut short after its
// first bytes reached the client: only closing the connection tells the client.
type TruncatedError struct{ Err error }

func (e *TruncatedError) Error() string { return e.Err.Error() }
func (e *TruncatedError) Unwrap() error { return e.Err }

// dialFailed reports whether err happened while connecting or in the TLS handshake
// (nothing was sent).
func dialFailed(err error) bool {
	var op *net.OpError
	var cert *tls.CertificateVerificationError
	var rec tls.RecordHeaderError
	return errors.As(err, &op) && (op.Op == "dial" || op.Op == "remote error") ||
		errors.As(err, &cert) || errors.As(err, &rec) ||
		err.Error() == "net/http: TLS handshake timeout" // net/http's unexported error: nothing was sent
}
