package cluster

import (
	"bytes"
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"maps"
	"net"
	"net/http"
	"net/http/httptest"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"testing/synctest"
	"time"

	"github.com/shoal-ai/shoal/kvcache"
)

type fakeLocal struct {
	mu  sync.Mutex
	l   Load
	sum *kvcache.Summary
}

func (f *fakeLocal) Load() Load {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.l
}

func (f *fakeLocal) Summary() *kvcache.Summary {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.sum
}

func (f *fakeLocal) set(l Load, hs []kvcache.Hash, gen uint64) {
	f.mu.Lock()
	f.l = l
	f.sum = &kvcache.Summary{Generation: gen, Hashes: hs}
	f.mu.Unlock()
}

func freePort(t *testing.T) string {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	return l.Addr().String()
}

func quiet() *slog.Logger { return slog.New(slog.NewTextHandler(io.Discard, nil)) }

func startTestNode(t *testing.T, name string, key []byte, join []string, local *fakeLocal, mods ...func(*Config)) *Node {
	t.Helper()
	cfg := DefaultConfig()
	cfg.Name, cfg.Bind = name, freePort(t)
	cfg.Join, cfg.GossipKey, cfg.Secret = join, key, []byte("s")
	cfg.Meta = Meta{HTTP: "127.0.0.1:1", Models: []string{"m"}, Capacity: 8}
	cfg.LoadInterval, cfg.ProbeInterval, cfg.ProbeTimeout = 50*time.Millisecond, 100*time.Millisecond, 50*time.Millisecond
	for _, m := range mods {
		m(&cfg)
	}
	n, err := New(cfg, local, quiet())
	if err != nil {
		t.Fatal(err)
	}
	if err := n.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { n.Leave(time.Second) })
	return n
}

func eventually(t *testing.T, what string, f func() bool) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for !f() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

func member(n *Node, name string) (Member, bool) {
	for _, m := range n.Members() {
		if m.Name == name {
			return m, true
		}
	}
	return Member{}, false
}

func TestGossipMembershipLoadAndSummaries(t *testing.T) {
	key := []byte("0123456789abcdef")
	la, lb, lc := &fakeLocal{}, &fakeLocal{}, &fakeLocal{}
	la.set(Load{Waiting: 1, PrefillTPS: 500}, []kvcache.Hash{1, 2, 3}, 1)
	a := startTestNode(t, "a", key, nil, la)
	b := startTestNode(t, "b", key, []string{a.GossipAddr()}, lb)
	c := startTestNode(t, "c", key, []string{b.GossipAddr()}, lc)
	eventually(t, "three alive members everywhere", func() bool {
		for _, n := range []*Node{a, b, c} {
			alive := 0
			for _, m := range n.Members() {
				if m.State == "alive" {
					alive++
				}
			}
			if alive != 3 {
				return false
			}
		}
		return true
	})
	eventually(t, "a's load and summary at c", func() bool {
		m, ok := member(c, "a")
		return ok && m.Load.Waiting == 1 && m.SummaryBlocks == 3 && m.UpdatedAgoMS >= 0
	})
	// Summaries grow by deltas.
	la.set(Load{Waiting: 4, PrefillTPS: 500}, []kvcache.Hash{1, 2, 3, 4, 5}, 2)
	eventually(t, "delta at b", func() bool { m, _ := member(b, "a"); return m.SummaryBlocks == 5 && m.Load.Waiting == 4 })
	// ... and shrink by them: evictions travel too.
	la.set(Load{Waiting: 4, PrefillTPS: 500}, []kvcache.Hash{1, 4, 5}, 3)
	eventually(t, "eviction at b", func() bool { m, _ := member(b, "a"); return m.SummaryBlocks == 3 })
	// Draining is metadata: peers see it.
	if err := b.SetDraining(true); err != nil {
		t.Fatal(err)
	}
	eventually(t, "b draining at a", func() bool { m, _ := member(a, "b"); return m.Draining })
	// Leaving shows as left, and counts as lost to forwards (a draining
	// member is not).
	if a.Lost("c") || a.Lost("b") {
		t.Fatal("a live member is lost")
	}
	c.Leave(time.Second)
	eventually(t, "c left at a", func() bool { m, _ := member(a, "c"); return m.State == "left" })
	if !a.Lost("c") || a.Lost("b") {
		t.Fatal("a member that left is not lost, or a draining one is")
	}
}

// TestEveryPeerGetsEveryDelta: with push/pull out of the way, each change of one
// node's cache summary reaches all of its peers within a second. (Sent through
// memberlist's gossip queue, each delta went out 3·log10(n) times: to at most 3 of
// the 4 peers here, 3 of 7 in a cluster of 8.)
func TestEveryPeerGetsEveryDelta(t *testing.T) {
	key := []byte("0123456789abcdef")
	// No push/pull; probes patient enough for the race detector on two cores.
	noPushPull := func(c *Config) {
		c.PushPull, c.LoadInterval = time.Hour, 100*time.Millisecond
		c.ProbeInterval, c.ProbeTimeout = 500*time.Millisecond, 250*time.Millisecond
	}
	src := &fakeLocal{} // no summary yet: peers learn all of it from deltas
	nodes := []*Node{startTestNode(t, "n0", key, nil, src, noPushPull)}
	const size = 5
	// Each node joins every earlier one: a join is a push/pull with each address,
	// so membership is whole without gossip. Joining n0 alone left membership to
	// memberlist's gossip of alive messages, whose bounded retransmits missed a
	// node now and then on a loaded machine, with no periodic push/pull to mend it.
	joined := []string{nodes[0].GossipAddr()}
	for i := 1; i < size; i++ {
		n := startTestNode(t, fmt.Sprintf("n%d", i), key, slices.Clone(joined), &fakeLocal{}, noPushPull)
		nodes, joined = append(nodes, n), append(joined, n.GossipAddr())
	}
	var view string
	defer func() {
		if t.Failed() {
			t.Log("membership:", view)
		}
	}()
	eventually(t, "every member alive everywhere", func() bool {
		view = ""
		ok := true
		for _, n := range nodes {
			alive := 0
			for _, m := range n.Members() {
				if m.State == "alive" {
					alive++
				}
			}
			view += fmt.Sprintf("%s:%d ", n.Name(), alive)
			ok = ok && alive == size
		}
		return ok
	})
	var hs []kvcache.Hash
	for gen := uint64(1); gen <= 6; gen++ {
		if gen%2 == 1 {
			hs = append(hs, kvcache.Hash(gen*100), kvcache.Hash(gen*100+1)) // added
		} else {
			hs = hs[1:] // evicted
		}
		src.set(Load{}, slices.Clone(hs), gen)
		deadline := time.Now().Add(time.Second)
		for _, n := range nodes[1:] {
			for {
				if m, _ := member(n, "n0"); m.SummaryBlocks == len(hs) {
					break
				}
				if time.Now().After(deadline) {
					m, _ := member(n, "n0")
					t.Fatalf("generation %d: %s shows %d blocks of n0's %d after 1 s", gen, n.Name(), m.SummaryBlocks, len(hs))
				}
				time.Sleep(10 * time.Millisecond)
			}
		}
	}
}

func TestWrongGossipKeyNeverJoins(t *testing.T) {
	a := startTestNode(t, "a", []byte("0123456789abcdef"), nil, &fakeLocal{})
	cfg := DefaultConfig()
	cfg.Name, cfg.Bind, cfg.Join = "intruder", freePort(t), []string{a.GossipAddr()}
	cfg.GossipKey, cfg.Secret = []byte("fedcba9876543210"), []byte("s")
	cfg.Meta = Meta{HTTP: "127.0.0.1:1", Models: []string{"m"}}
	n, err := New(cfg, &fakeLocal{}, quiet())
	if err != nil {
		t.Fatal(err)
	}
	if err := n.Start(); err == nil {
		n.Leave(time.Second)
		t.Fatal("a node with the wrong key joined")
	}
	time.Sleep(200 * time.Millisecond)
	if _, ok := member(a, "intruder"); ok {
		t.Fatal("a lists the intruder")
	}
}

// TestTakenNameNeverJoins: a node started under the name of a live member
// stops at start, saying so, and the member keeps its name and load.
func TestTakenNameNeverJoins(t *testing.T) {
	a := startTestNode(t, "a", nil, nil, &fakeLocal{})
	b := startTestNode(t, "b", nil, []string{a.GossipAddr()}, &fakeLocal{})
	eventually(t, "b sees a", func() bool { m, ok := member(b, "a"); return ok && m.State == "alive" })
	cfg := DefaultConfig()
	cfg.Name, cfg.Bind, cfg.Join, cfg.Secret = "a", freePort(t), []string{b.GossipAddr()}, []byte("s")
	cfg.Meta = Meta{HTTP: "127.0.0.1:2", Models: []string{"m"}}
	n, err := New(cfg, &fakeLocal{}, quiet())
	if err != nil {
		t.Fatal(err)
	}
	if err := n.Start(); err == nil || !strings.Contains(err.Error(), "--node-name") {
		if err == nil {
			n.Leave(time.Second)
		}
		t.Fatalf("a second node named a: %v", err)
	}
	time.Sleep(200 * time.Millisecond)
	if m, _ := member(b, "a"); m.Addr != "127.0.0.1:1" || m.State != "alive" {
		t.Fatalf("b's view of a: %+v", m)
	}
}

// routerWith builds a node (not started) with the given peers for routing tests.
func routerWith(t *testing.T, policy Policy, peers ...*peer) *Node {
	t.Helper()
	cfg := DefaultConfig()
	cfg.Name, cfg.Bind, cfg.Secret, cfg.Policy = "self", "127.0.0.1:1", []byte("s"), policy
	cfg.Meta = Meta{HTTP: "self:1", Models: []string{"m"}, Capacity: 8}
	cfg.BlockTokens = 4
	n, err := New(cfg, &fakeLocal{}, quiet())
	if err != nil {
		t.Fatal(err)
	}
	for _, p := range peers {
		if p.meta.HTTP == "" {
			p.meta = Meta{HTTP: p.name + ":1", Models: []string{"m"}, Capacity: 8}
		}
		p.metaOK, p.state = true, "alive"
		n.peers[p.name] = p
	}
	return n
}

func summaryOf(tokens []int32, blocks int) summary {
	var s summary
	s.add(1, kvcache.NewHasher(0, "m").Chain(tokens, 4)[:blocks])
	return s
}

// firstChoices routes tokens k times and counts each node's first places.
func firstChoices(t *testing.T, n *Node, tokens []int32, k int) map[string]int {
	t.Helper()
	seen := map[string]int{}
	for range k {
		ts, err := n.Route("m", tokens, 0)
		if err != nil {
			t.Fatal(err)
		}
		seen[ts[0].Name]++
	}
	return seen
}

// questionChoices routes skip+k questions about doc (doc followed by a few tokens
// of its own each) and counts the first places of the last k.
func questionChoices(t *testing.T, n *Node, doc []int32, skip, k int) map[string]int {
	t.Helper()
	seen := map[string]int{}
	for q := range skip + k {
		ts, err := n.Route("m", append(slices.Clip(doc), int32(q), 1, 2, 3), 0)
		if err != nil {
			t.Fatal(err)
		}
		if q >= skip {
			seen[ts[0].Name]++
		}
	}
	return seen
}

func TestPrefixAwarePicksTheCacheUnlessItsQueueCostsMore(t *testing.T) {
	prompt := make([]int32, 400)
	for i := range prompt {
		prompt[i] = int32(i)
	}
	warm := &peer{name: "self", load: Load{PrefillTPS: 1000}, summary: summaryOf(prompt, 99)}
	cold := &peer{name: "cold", load: Load{PrefillTPS: 1000}}
	n := routerWith(t, PrefixAware, warm, cold)
	// Each route below stands for one of many distinct prompts that share the
	// warm prefix: the router forgets the prompts it routed (one prompt routed
	// again and again is hot by the traffic, and a hot prompt goes in turn).
	route := func() []Target {
		t.Helper()
		n.recent = nil
		ts, err := n.Route("m", prompt, 0)
		if err != nil {
			t.Fatal(err)
		}
		return ts
	}
	// Self has no liveness entry from memberlist; routing treats it as alive.
	if ts := route(); ts[0].Name != "self" || ts[0].Cached != 396 || !ts[0].Local {
		t.Fatalf("warm node not preferred: %+v", ts)
	}
	// A long queue on the warm node outweighs the 396 cached tokens.
	warm.load.PendingTokens = 2000 // 2 s of prefill at 1,000 tokens/s
	if ts := route(); ts[0].Name != "cold" {
		t.Fatalf("hot spot: the queue should send the request to the cold node: %+v", ts)
	}
	// When requests queue everywhere, a miss delays those behind it too: the
	// same gap in queues no longer justifies recomputing the prefix.
	warm.load.Waiting, cold.load.Waiting = 8, 8
	cold.load.PendingTokens = 1000
	if ts := route(); ts[0].Name != "self" {
		t.Fatalf("saturated cluster: a miss should cost the requests queued behind it: %+v", ts)
	}
	warm.load.Waiting, cold.load.Waiting, cold.load.PendingTokens = 0, 0, 0
	// A hot prefix: every slot of the warm node is taken and cache hits queue
	// there. Their prefill is next to nothing, but each waits for a finish (4 per
	// second here): 2 s ahead, against 0.4 s to recompute the prefix on the cold
	// node.
	warm.load.Running, warm.load.Waiting, warm.load.PendingTokens, warm.load.FinishPS = 8, 7, 28, 4
	if ts := route(); ts[0].Name != "cold" {
		t.Fatalf("hot prefix: a full node's slot queue should count: %+v", ts)
	}
	warm.load.Running, warm.load.Waiting, warm.load.PendingTokens, warm.load.FinishPS = 0, 0, 0, 0
	// prefix-only ignores the queue (the ablation).
	n.cfg.Policy = PrefixOnly
	if ts := route(); ts[0].Name != "self" {
		t.Fatalf("prefix-only: %+v", ts)
	}
}

func TestRouterFiltersAndSaturation(t *testing.T) {
	other := &peer{name: "other", meta: Meta{HTTP: "o:1", Models: []string{"x"}, Capacity: 8}}
	draining := &peer{name: "drain", meta: Meta{HTTP: "d:1", Models: []string{"m"}, Capacity: 8, Draining: true}}
	full := &peer{name: "self", load: Load{Waiting: 10, MaxWaiting: 10}}
	n := routerWith(t, LeastLoaded, other, draining, full)
	if _, err := n.Route("m", nil, 0); err != ErrSaturated {
		t.Fatalf("all saturated: %v", err)
	}
	if ts, err := n.Route("m", nil, -1); err != nil || ts[0].Name != "self" {
		t.Fatalf("an urgent request (priority < 0) should still be admitted: %+v %v", ts, err)
	}
	if _, err := n.Route("m", nil, 5); err != ErrSaturated {
		t.Fatalf("a background request (priority > 0) when all are saturated: %v", err)
	}
	if _, err := n.Route("nope", nil, 0); err != ErrNoNode {
		t.Fatalf("unknown model: %v", err)
	}
	// A model whose nodes all drain comes back: not "no node serves it".
	n = routerWith(t, LeastLoaded, &peer{name: "self", meta: Meta{HTTP: "self:1", Models: []string{"x"}}},
		&peer{name: "drain", meta: Meta{HTTP: "d:1", Models: []string{"m"}, Capacity: 8, Draining: true}})
	if _, err := n.Route("m", nil, 0); err != ErrDraining {
		t.Fatalf("only a draining node serves it: %v", err)
	}
	// Requests sent there that its load does not show yet take its free
	// running slots first: only those beyond them wait.
	roomy := &peer{name: "self", meta: Meta{HTTP: "self:1", Models: []string{"m"}, Capacity: 2}, load: Load{MaxWaiting: 2}}
	n = routerWith(t, LeastLoaded, roomy)
	for i := range 4 {
		if _, err := n.Route("m", nil, 0); err != nil {
			t.Fatalf("with %d sent to 2 slots and a queue of 2: %v", i, err)
		}
		n.Sent(Target{Name: "self"})
	}
	if _, err := n.Route("m", nil, 0); err != ErrSaturated {
		t.Fatalf("2 slots and a queue of 2, 4 sent: %v", err)
	}
	// While some wait, no slot is free (KV space holds them back): a request
	// sent there waits too.
	busy := &peer{name: "self", meta: Meta{HTTP: "self:1", Models: []string{"m"}, Capacity: 2}, load: Load{Waiting: 1, MaxWaiting: 2}}
	n = routerWith(t, LeastLoaded, busy)
	n.Sent(Target{Name: "self"})
	if _, err := n.Route("m", nil, 0); err != ErrSaturated {
		t.Fatalf("1 waiting and 1 sent to a queue of 2: %v", err)
	}
}

func TestRoundRobinAndInflight(t *testing.T) {
	n := routerWith(t, RoundRobin, &peer{name: "self"}, &peer{name: "b"}, &peer{name: "c"})
	seen := firstChoices(t, n, nil, 9)
	if seen["self"] != 3 || seen["b"] != 3 || seen["c"] != 3 {
		t.Fatalf("round robin: %v", seen)
	}
	n.cfg.Policy = PrefixAware
	prompt := make([]int32, 100)
	n.Route("m", prompt, 0) // a router's first prompt goes in turn; the next by estimate
	// Requests this router just sent count against a node before gossip shows them.
	done := n.Sent(Target{Name: "self", compute: 100})
	done2 := n.Sent(Target{Name: "self", compute: 100})
	ts, _ := n.Route("m", prompt, 0)
	if ts[0].Name == "self" {
		t.Fatalf("in-flight requests ignored: %+v", ts)
	}
	if reqs, toks := n.peers["self"].unreflected(); reqs != 2 || toks != 200 {
		t.Fatalf("unreflected = %d requests, %d tokens; want 2, 200", reqs, toks)
	}
	// A batch of 8 inputs counts as 8 sequences, with all their tokens; a
	// saturated node is passed over.
	batch := n.Sent(Target{Name: "b", compute: 10}.With(7, 300))
	if reqs, toks := n.peers["b"].unreflected(); reqs != 8 || toks != 310 {
		t.Fatalf("a batch's flight = %d sequences, %d tokens; want 8, 310", reqs, toks)
	}
	n.peers["b"].load.Running, n.peers["b"].load.MaxWaiting = 8, 8
	if ts, _ := n.Route("m", prompt, 0); slices.ContainsFunc(ts, func(t Target) bool { return t.Name == "b" }) {
		t.Fatalf("a node with its slots taken and a full queue's worth of sequences in flight is a candidate: %+v", ts)
	}
	n.peers["b"].load.Running = 0
	batch()
	// Two load updates later the node's own load shows them: they stop counting twice.
	n.peers["self"].load.Seq += 2
	if reqs, toks := n.peers["self"].unreflected(); reqs != 0 || toks != 0 {
		t.Fatalf("flights shown by gossip still counted: %d, %d", reqs, toks)
	}
	done()
	done()
	done2()
	if len(n.peers["self"].flights) != 0 {
		t.Fatalf("done twice or leaked: %+v", n.peers["self"])
	}
}

func TestVerify(t *testing.T) {
	secret := []byte("cluster-secret")
	body := []byte(`{"prompt":"x"}`)
	req := httptest.NewRequest("POST", "/v1/completions", bytes.NewReader(body))
	if fwd, err := Verify(secret, req, body, time.Now()); fwd || err != nil {
		t.Fatalf("plain request: %v %v", fwd, err)
	}
	ts := "1700000000"
	req.Header.Set(HeaderHop, "1")
	req.Header.Set(HeaderFrom, "a")
	req.Header.Set(HeaderTime, ts)
	req.Header.Set(HeaderAuth, sign(secret, "a", ts, "POST", "/v1/completions", body))
	if _, err := Verify(secret, req, body, time.Unix(1700000030, 0)); err != nil {
		t.Fatalf("valid credential: %v", err)
	}
	if _, err := Verify(secret, req, []byte(`{"prompt":"y"}`), time.Unix(1700000030, 0)); err == nil {
		t.Fatal("tampered body accepted")
	}
	if _, err := Verify([]byte("other"), req, body, time.Unix(1700000030, 0)); err == nil {
		t.Fatal("wrong secret accepted")
	}
	if _, err := Verify(secret, req, body, time.Unix(1700009999, 0)); err == nil {
		t.Fatal("stale credential accepted")
	}
	req.Header.Del(HeaderAuth)
	if fwd, err := Verify(secret, req, body, time.Unix(1700000030, 0)); !fwd || err == nil {
		t.Fatal("claimed hop without credential accepted")
	}
}

func TestForwardRetryAndMidStreamFailure(t *testing.T) {
	secret := []byte("s")
	var seen http.Header
	good := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		seen = r.Header.Clone()
		body, _ := io.ReadAll(r.Body)
		if _, err := Verify(secret, r, body, time.Now()); err != nil {
			http.Error(w, err.Error(), 401)
			return
		}
		w.Header().Set("Content-Type", "text/event-stream")
		io.WriteString(w, "data: 1\n\n")
		w.(http.Flusher).Flush()
		io.WriteString(w, "data: [DONE]\n\n")
	}))
	defer good.Close()
	failing := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { http.Error(w, "boom", 503) }))
	defer failing.Close()
	dying := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "text/event-stream")
		io.WriteString(w, "data: 1\n\n")
		w.(http.Flusher).Flush()
		io.WriteString(w, "data: {\"hal")
		w.(http.Flusher).Flush()
		conn, _, _ := w.(http.Hijacker).Hijack()
		conn.Close()
	}))
	defer dying.Close()
	f := NewForwarder("a", secret, nil)
	host := func(s *httptest.Server) string { return strings.TrimPrefix(s.URL, "http://") }
	ctx := context.Background()
	body := []byte(`{"stream":true}`)

	w := httptest.NewRecorder()
	var re *RetryableError
	if err := f.Forward(ctx, Target{Name: "f", HTTP: host(failing)}, "POST", "/v1/completions", http.Header{}, body, w); err == nil || !asRetryable(err, &re) {
		t.Fatalf("5xx before the first byte must be retryable: %v", err)
	}
	if err := f.Forward(ctx, Target{Name: "gone", HTTP: "127.0.0.1:1"}, "POST", "/v1/completions", http.Header{}, body, w); !asRetryable(err, &re) {
		t.Fatalf("connect failure must be retryable: %v", err)
	}
	// A redirect is not followed: the prompt and the credential stay here.
	var followed atomic.Bool
	elsewhere := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { followed.Store(true) }))
	defer elsewhere.Close()
	redirecting := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		http.Redirect(w, r, elsewhere.URL+"/v1/completions", http.StatusTemporaryRedirect)
	}))
	defer redirecting.Close()
	if err := f.Forward(ctx, Target{Name: "r", HTTP: host(redirecting)}, "POST", "/v1/completions", http.Header{}, body, httptest.NewRecorder()); !asRetryable(err, &re) || followed.Load() {
		t.Fatalf("a redirect: %v, followed %v", err, followed.Load())
	}
	w = httptest.NewRecorder()
	if err := f.Forward(ctx, Target{Name: "g", HTTP: host(good)}, "POST", "/v1/completions", http.Header{}, body, w); err != nil {
		t.Fatal(err)
	}
	if w.Body.String() != "data: 1\n\ndata: [DONE]\n\n" || seen.Get(HeaderHop) != "1" {
		t.Fatalf("relayed %q", w.Body.String())
	}
	w = httptest.NewRecorder()
	err := f.Forward(ctx, Target{Name: "d", HTTP: host(dying)}, "POST", "/v1/completions", http.Header{}, body, w)
	// Events pass on whole: the one the peer left half written is dropped.
	if want := "data: 1\n\n" + openAIFailure("peer_failed", "peer d failed mid-stream"); err == nil || w.Body.String() != want {
		t.Fatalf("mid-stream death: %v %q, want %q", err, w.Body.String(), want)
	}
	// Newline-delimited JSON (Ollama's) passes on whole lines: a line the peer
	// left half written is dropped, and the failure's line ends the stream.
	dyingLines := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "application/x-ndjson")
		io.WriteString(w, `{"a":1}`+"\n"+`{"b":`)
		w.(http.Flusher).Flush()
		io.WriteString(w, `2}`+"\n"+`{"c":`)
		w.(http.Flusher).Flush()
		conn, _, _ := w.(http.Hijacker).Hijack()
		conn.Close()
	}))
	defer dyingLines.Close()
	w = httptest.NewRecorder()
	err = f.ForwardStream(ctx, Target{Name: "d", HTTP: host(dyingLines)}, "POST", "/api/chat", http.Header{}, body, w,
		func(code, message string) string { return `{"error":"` + message + `"}` + "\n" })
	if want := `{"a":1}` + "\n" + `{"b":2}` + "\n" + `{"error":"peer d failed mid-stream"}` + "\n"; err == nil || w.Body.String() != want {
		t.Fatalf("ndjson mid-stream death: %v %q, want %q", err, w.Body.String(), want)
	}
}

// TestForwardRefusalsAndCuts: a peer's 429 (its queue full; it ran nothing) may be
// retried elsewhere; a peer that accepted the connection and then failed may have run
// the request and is not; a body that is not a stream, cut short, is reported as such
// so that the caller can close the client's connection.
func TestForwardRefusalsAndCuts(t *testing.T) {
	full := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		http.Error(w, `{"error":{"code":"queue_full"}}`, 429)
	}))
	defer full.Close()
	reset := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		conn, _, _ := w.(http.Hijacker).Hijack()
		conn.Close() // no answer at all
	}))
	defer reset.Close()
	cut := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "application/json")
		w.Header().Set("Content-Length", "1000")
		io.WriteString(w, `{"choices":[{"text":"hello`)
		w.(http.Flusher).Flush()
		conn, _, _ := w.(http.Hijacker).Hijack()
		conn.Close()
	}))
	defer cut.Close()
	f := NewForwarder("a", []byte("s"), nil)
	host := func(s *httptest.Server) string { return strings.TrimPrefix(s.URL, "http://") }
	ctx, body := context.Background(), []byte(`{}`)
	var re *RetryableError
	if err := f.Forward(ctx, Target{Name: "full", HTTP: host(full)}, "POST", "/v1/completions", http.Header{}, body, httptest.NewRecorder()); !asRetryable(err, &re) || re.Unreachable {
		t.Fatalf("a 429 must be retryable (and the peer reachable): %v", err)
	}
	if err := f.Forward(ctx, Target{Name: "reset", HTTP: host(reset)}, "POST", "/v1/completions", http.Header{}, body, httptest.NewRecorder()); err == nil || asRetryable(err, &re) {
		t.Fatalf("a peer that took the request and failed must not be retried: %v", err)
	}
	tlsOnly := NewForwarder("a", []byte("s"), &tls.Config{})
	if err := tlsOnly.Forward(ctx, Target{Name: "plain", HTTP: host(full)}, "POST", "/v1/completions", http.Header{}, body, httptest.NewRecorder()); !asRetryable(err, &re) {
		t.Fatalf("a TLS forwarder sent to a plain-HTTP peer: %v", err)
	}
	var te *TruncatedError
	if err := f.Forward(ctx, Target{Name: "cut", HTTP: host(cut)}, "POST", "/v1/completions", http.Header{}, body, httptest.NewRecorder()); !errors.As(err, &te) {
		t.Fatalf("a cut body: %v, want a TruncatedError", err)
	}
}

// TestForwardGivesUpOnALostPeer: a peer that hangs answers nothing and keeps
// its connection open; once the cluster declares it dead, a forward awaiting
// its first byte is retryable, and a stream it began ends with the failure.
func TestForwardGivesUpOnALostPeer(t *testing.T) {
	release := make(chan struct{})
	silent := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		io.ReadAll(r.Body) // then a closed connection cancels r's context
		select {
		case <-release:
		case <-r.Context().Done():
		}
	}))
	defer silent.Close()
	stalled := stallingStream(release)
	defer stalled.Close()
	defer close(release) // before the servers close
	var lost atomic.Bool
	f := NewForwarder("a", []byte("s"), nil)
	f.Watch(func(peer string) bool { return lost.Load() && peer == "hung" })
	host := func(s *httptest.Server) string { return strings.TrimPrefix(s.URL, "http://") }
	forward := func(s *httptest.Server, w http.ResponseWriter) <-chan error {
		done := make(chan error, 1)
		go func() {
			done <- f.Forward(context.Background(), Target{Name: "hung", HTTP: host(s)}, "POST", "/v1/completions", http.Header{}, []byte(`{}`), w)
		}()
		return done
	}
	wait := func(done <-chan error) error {
		select {
		case err := <-done:
			return err
		case <-time.After(10 * time.Second):
			t.Fatal("the forward still waits on a peer declared dead")
			return nil
		}
	}
	before, during := forward(silent, httptest.NewRecorder()), httptest.NewRecorder()
	streaming := forward(stalled, during)
	select {
	case err := <-before:
		t.Fatalf("gave up on a live peer: %v", err)
	case <-time.After(3 * peerCheck):
	}
	lost.Store(true)
	var re *RetryableError
	if err := wait(before); !asRetryable(err, &re) || !re.Unreachable || !errors.Is(err, ErrPeerLost) {
		t.Fatalf("before the first byte: %v, want a retryable ErrPeerLost", err)
	}
	if err := wait(streaming); !errors.Is(err, ErrPeerLost) || !strings.Contains(during.Body.String(), "data: 1\n\n") || !strings.Contains(during.Body.String(), "peer_failed") {
		t.Fatalf("mid-stream: %v %q", err, during.Body.String())
	}
}

func asRetryable(err error, re **RetryableError) bool {
	r, ok := err.(*RetryableError)
	*re = r
	return ok
}

func TestLoadWireVersions(t *testing.T) {
	l := Load{Waiting: 3, Running: 16, PrefillTPS: 10, Seq: 9, FinishPS: 12.5, Boot: 1234}
	b := encodeLoad("n", l)
	if name, got, err := decodeLoad(b); err != nil || name != "n" || got != l {
		t.Fatalf("round trip: %q %+v %v", name, got, err)
	}
	// Nodes of earlier releases send 11 or 12 fields: the rest read as zero.
	want := l
	want.Boot = 0
	if _, got, err := decodeLoad(b[:len(b)-8]); err != nil || got != want {
		t.Fatalf("12-field load: %+v %v", got, err)
	}
	want.FinishPS = 0
	if _, got, err := decodeLoad(b[:len(b)-16]); err != nil || got != want {
		t.Fatalf("11-field load: %+v %v", got, err)
	}
	// A newer node may append fields: they are ignored; a torn field is refused.
	if _, got, err := decodeLoad(append(slices.Clone(b), make([]byte, 8)...)); err != nil || got != l {
		t.Fatalf("14-field load: %+v %v", got, err)
	}
	if _, _, err := decodeLoad(append(slices.Clone(b), 1)); err == nil {
		t.Fatal("a load message with a partial field was accepted")
	}
	// A wait no node measures (it would overflow a time.Duration) is refused.
	if _, _, err := decodeLoad(encodeLoad("n", Load{QueueWaitMS: 1e300})); err == nil {
		t.Fatal("a load message with a wait of 1e300 ms was accepted")
	}
}

// TestRestartedPeer: a node that restarts under the same name starts its load
// sequence again; its first load replaces the old process's (which had counted far
// higher) and drops the old cache summary, and the old process's late messages are
// ignored.
func TestRestartedPeer(t *testing.T) {
	n := routerWith(t, PrefixAware, &peer{name: "self"}, &peer{name: "b"})
	d := &delegate{n: n}
	d.NotifyMsg(encodeLoad("b", Load{Seq: 100000, Waiting: 5, Boot: 1}))
	d.NotifyMsg(encodeHashes(msgPrefix, "b", 3, []kvcache.Hash{42}))
	d.NotifyMsg(encodeLoad("b", Load{Seq: 1, Waiting: 0, Boot: 2}))      // restarted
	d.NotifyMsg(encodeLoad("b", Load{Seq: 100001, Waiting: 7, Boot: 1})) // the old process, late
	n.mu.Lock()
	p := n.peers["b"]
	load, sum := p.load, p.summary.len()
	n.mu.Unlock()
	if load.Boot != 2 || load.Seq != 1 || load.Waiting != 0 || sum != 0 {
		t.Fatalf("after a restart: load %+v, %d cached blocks", load, sum)
	}
	d.NotifyMsg(encodeLoad("b", Load{Seq: 2, Waiting: 1, Boot: 2}))
	n.mu.Lock()
	load = n.peers["b"].load
	n.mu.Unlock()
	if load.Seq != 2 || load.Waiting != 1 {
		t.Fatalf("the restarted process's next load was dropped: %+v", load)
	}
	// A restart into a release that sends no Boot (or a clock set back) is taken
	// once the process known before has been quiet for restartQuiet.
	d.NotifyMsg(encodeLoad("b", Load{Seq: 1, Waiting: 3}))
	n.mu.Lock()
	if n.peers["b"].load.Boot != 2 {
		n.mu.Unlock()
		t.Fatal("a Boot-less load replaced a live process's")
	}
	n.peers["b"].loadAt = time.Now().Add(-restartQuiet - time.Second)
	n.mu.Unlock()
	d.NotifyMsg(encodeLoad("b", Load{Seq: 1, Waiting: 3}))
	n.mu.Lock()
	load = n.peers["b"].load
	n.mu.Unlock()
	if load.Boot != 0 || load.Waiting != 3 {
		t.Fatalf("a restart into a release without Boot was ignored: %+v", load)
	}
}

// TestBootlessRestart: a node of a release without Boot that restarts (its Seq
// starts again) is taken for new once the old process has been quiet.
func TestBootlessRestart(t *testing.T) {
	var p peer
	now := time.Now()
	p.takeLoad(Load{Seq: 500}, now.Add(-time.Minute))
	p.takeLoad(Load{Seq: 1, Waiting: 7}, now)
	if p.load.Seq != 1 || p.load.Waiting != 7 {
		t.Fatalf("a restart of a Boot-less node was ignored: %+v", p.load)
	}
	p.takeLoad(Load{Seq: 0, Waiting: 9}, now.Add(time.Second)) // not quiet, not later
	if p.load.Waiting != 7 {
		t.Fatalf("an older load replaced a live one: %+v", p.load)
	}
}

// TestUpgradedPeerDropsOldSummary: a node of a release without Boot, restarted into
// this one, is a new process: its old cache summary goes.
func TestUpgradedPeerDropsOldSummary(t *testing.T) {
	n := routerWith(t, PrefixAware, &peer{name: "self"}, &peer{name: "b"})
	d := &delegate{n: n}
	d.NotifyMsg(encodeLoad("b", Load{Seq: 500}))
	d.NotifyMsg(encodeHashes(msgPrefix, "b", 3, []kvcache.Hash{42}))
	d.NotifyMsg(encodeLoad("b", Load{Seq: 1, Boot: 7}))
	n.mu.Lock()
	defer n.mu.Unlock()
	if p := n.peers["b"]; p.load.Boot != 7 || p.summary.len() != 0 {
		t.Fatalf("after an upgrade: load %+v, %d cached blocks", p.load, p.summary.len())
	}
}

// TestOutOfOrderSummaries: what a message says of a block counts unless a later
// generation has said otherwise (a push/pull overtaken by deltas, UDP reordering, a
// newcomer's whole summary arriving after deltas): a late eviction does not drop
// a block cached again since, a late addition does not restore one evicted since,
// and the rest of a late message is still taken.
func TestOutOfOrderSummaries(t *testing.T) {
	n := routerWith(t, PrefixAware, &peer{name: "self"}, &peer{name: "b"})
	d := &delegate{n: n}
	held := func() []kvcache.Hash {
		n.mu.Lock()
		defer n.mu.Unlock()
		return slices.Sorted(maps.Keys(n.peers["b"].summary.at))
	}
	check := func(what string, want ...kvcache.Hash) {
		t.Helper()
		if got := held(); !slices.Equal(got, want) {
			t.Fatalf("%s: the summary is %v, want %v", what, got, want)
		}
	}
	d.NotifyMsg(encodeLoad("b", Load{Seq: 1, Boot: 1}))
	d.MergeRemoteState(encodeHashes(stateFull, "b", 5, []kvcache.Hash{1, 2}), false)
	d.NotifyMsg(encodeHashes(msgPrefix, "b", 7, []kvcache.Hash{3}))
	d.NotifyMsg(encodeHashes(msgEvict, "b", 7, []kvcache.Hash{1}))
	d.MergeRemoteState(encodeHashes(stateFull, "b", 6, []kvcache.Hash{1, 2}), false) // taken before 7
	check("a full state overtaken by deltas", 2, 3)
	d.NotifyMsg(encodeHashes(msgEvict, "b", 6, []kvcache.Hash{3}))
	d.NotifyMsg(encodeHashes(msgPrefix, "b", 6, []kvcache.Hash{1}))
	check("deltas overtaken by later ones", 2, 3)
	d.MergeRemoteState(encodeHashes(stateFull, "b", 9, []kvcache.Hash{4}), false)
	check("a later full state", 4)
	d.NotifyMsg(encodeHashes(msgPrefix, "b", 8, []kvcache.Hash{5}))
	check("a delta older than the full state", 4)

	// A restart starts the generations again.
	d.NotifyMsg(encodeLoad("b", Load{Seq: 1, Boot: 2}))
	d.NotifyMsg(encodeHashes(msgPrefix, "b", 12, []kvcache.Hash{99}))
	d.NotifyMsg(encodeHashes(msgPrefix, "b", 11, []kvcache.Hash{1, 2, 3})) // the join summary, late
	d.NotifyMsg(encodeHashes(msgPrefix, "b", 5, []kvcache.Hash{10}))       // a delta, late
	d.NotifyMsg(encodeHashes(msgEvict, "b", 4, []kvcache.Hash{99, 10}))    // evictions before both
	check("after a restart, late additions", 1, 2, 3, 10, 99)
	d.MergeRemoteState(encodeHashes(stateFull, "b", 11, []kvcache.Hash{1, 2, 3, 10}), false)
	check("a full state without a later addition", 1, 2, 3, 10, 99)
}

// TestPeersStayBounded: names heard from without a join (spoofed, or members long
// gone) neither grow the peers map without bound nor count in routing.
func TestPeersStayBounded(t *testing.T) {
	n := routerWith(t, PrefixAware, &peer{name: "self"})
	d := &delegate{n: n}
	for i := range 1000 {
		d.NotifyMsg(encodeLoad(fmt.Sprintf("ghost-%d", i), Load{Seq: 1, FinishPS: 100}))
	}
	n.mu.Lock()
	size, others, overdue := len(n.peers), n.othersPerOwn(), n.loadOverdue()
	n.mu.Unlock()
	if size > maxPlaceholders+1 || others != 1 || overdue != overdueRounds*n.cfg.LoadInterval {
		t.Fatalf("after 1000 unknown names: %d peers, others per own %v, load overdue %v", size, others, overdue)
	}
	n.mu.Lock()
	n.prune(time.Now().Add(placeholderLimit + time.Second))
	size = len(n.peers)
	n.mu.Unlock()
	if size != 1 {
		t.Fatalf("%d peers after pruning placeholders, want 1 (self)", size)
	}
	d.NotifyMsg(encodeLoad("late", Load{Seq: 1}))
	n.mu.Lock()
	defer n.mu.Unlock()
	if n.peers["late"] == nil {
		t.Fatal("no room for a placeholder after pruning")
	}
}

func FuzzDecoders(f *testing.F) {
	f.Add(encodeLoad("node-a", Load{Waiting: 3, PrefillTPS: 10}))
	f.Add(encodeLoad("node-a", Load{Waiting: 3, PrefillTPS: 10})[:3+6+8*11])
	f.Add(encodeHashes(msgPrefix, "n", 7, []kvcache.Hash{1, 2}))
	f.Add(encodeHashes(stateFull, "n", 7, []kvcache.Hash{1}))
	f.Add(encodeHashes(msgEvict, "n", 8, []kvcache.Hash{2}))
	m, _ := encodeMeta(Meta{HTTP: "h:1", Models: []string{"a"}})
	f.Add(m)
	f.Add([]byte{1, 2, 255})
	f.Fuzz(func(t *testing.T, b []byte) {
		if name, l, err := decodeLoad(b); err == nil {
			if again := encodeLoad(name, l); !bytes.Equal(again, b) && len(name) < 256 {
				// Round trip must hold for everything accepted (counts are clamped).
				_, l2, err := decodeLoad(again)
				if err != nil || l2 != l {
					t.Fatalf("load round trip: %+v vs %+v", l, l2)
				}
			}
		}
		for _, kind := range []byte{msgPrefix, msgEvict, stateFull} {
			decodeHashes(kind, b)
		}
		decodeMeta(b)
		d := &delegate{n: &Node{cfg: Config{Name: "self"}, peers: map[string]*peer{"n": {name: "n"}, "node-a": {name: "node-a"}}}}
		d.NotifyMsg(b)
		d.MergeRemoteState(b, false)
	})
}

// TestRoutersFedInTurnInterleave: routers that receive requests in turn (a load
// balancer in front) each take their turns from their own place among the members,
// so together they make one round robin: every four consecutive requests reach four
// different nodes.
func TestRoutersFedInTurnInterleave(t *testing.T) {
	names := []string{"self", "b", "c", "d"}
	var routers []*Node
	for _, name := range names {
		var peers []*peer
		for _, p := range names {
			peers = append(peers, &peer{name: p})
		}
		n := routerWith(t, RoundRobin, peers...)
		n.cfg.Name = name
		routers = append(routers, n)
	}
	for round := range 5 {
		seen := map[string]bool{}
		for _, n := range routers {
			ts, err := n.Route("m", nil, 0)
			if err != nil {
				t.Fatal(err)
			}
			seen[ts[0].Name] = true
		}
		if len(seen) != 4 {
			t.Fatalf("round %d: four routers fed in turn reached %d nodes: %v", round, len(seen), seen)
		}
	}
}

func TestPrefixAwareAffinityAndSentPrefixes(t *testing.T) {
	a := &peer{name: "self", load: Load{PrefillTPS: 1000}}
	b := &peer{name: "b", load: Load{PrefillTPS: 1000}}
	n := routerWith(t, PrefixAware, a, b)
	prompt := func(group, q int32) []int32 {
		p := make([]int32, 200)
		for i := range p {
			p[i] = group*1000 + int32(i)
		}
		return append(p, q, q+1, q+2)
	}
	// Idle nodes, nothing cached: every router sends a prefix to the node rendezvous
	// hashing ranks first (here, the same choice each time), and different prefixes
	// spread. (The router has routed other prompts before: at a fresh router a
	// prompt that the one before shares is a hot prefix, which goes in turn.)
	for g := range int32(recentPromptsN) {
		n.Route("m", prompt(500+g, 0), 0)
	}
	chosen := map[string]int{}
	for g := range int32(16) {
		first, _ := n.Route("m", prompt(g, 0), 0)
		again, _ := n.Route("m", prompt(g, 7), 0)
		if first[0].Name != again[0].Name {
			t.Fatalf("group %d: %s then %s for the same prefix", g, first[0].Name, again[0].Name)
		}
		chosen[first[0].Name]++
	}
	if chosen["self"] == 0 || chosen["b"] == 0 {
		t.Fatalf("16 prefixes all on one node: %v", chosen)
	}
	// Once a prefix is sent somewhere, the next request with it follows, although
	// the node has no summary yet and the first request's prefill is ahead of it
	// (this router is the cluster's only entry point: its flights are all there is).
	n.routeRate = 10
	for _, p := range n.peers {
		p.load.FinishPS = 5
	}
	ts, _ := n.Route("m", prompt(99, 0), 0)
	done := n.Sent(ts[0])
	defer done()
	next, _ := n.Route("m", prompt(99, 50), 0)
	if next[0].Name != ts[0].Name || next[0].Cached != 200 {
		t.Fatalf("second request of a burst: %+v, first went to %s", next[0], ts[0].Name)
	}
	// The provisional entries expire.
	p := n.peers[ts[0].Name]
	if !p.sending(next[0].hashes[0], time.Now()) || p.sending(next[0].hashes[0], time.Now().Add(sentTTL+time.Millisecond)) {
		t.Fatal("sent prefixes should count for sentTTL and then stop")
	}
	p.willHold(nil, time.Now().Add(2*sentTTL))
	if len(p.sent) != 0 || len(p.sentOrder) != 0 {
		t.Fatalf("expired entries kept: %d, %d", len(p.sent), len(p.sentOrder))
	}
}

func TestOthersPerOwn(t *testing.T) {
	n := routerWith(t, PrefixAware, &peer{name: "self"}, &peer{name: "b"}, &peer{name: "c"}, &peer{name: "d"})
	if got := n.othersPerOwn(); got != 4 {
		t.Fatalf("nothing measured: %v, want every node an entry point (4)", got)
	}
	for _, p := range n.peers {
		p.load.FinishPS = 10 // the cluster finishes 40 requests/s
	}
	for _, c := range []struct{ routed, want float64 }{{40, 1}, {10, 4}, {20, 2}, {1, 4}, {80, 1}} {
		n.routeRate = c.routed
		if got := n.othersPerOwn(); got != c.want {
			t.Fatalf("routing %v/s of 40/s: %v, want %v", c.routed, got, c.want)
		}
	}
}

// TestHotPrefixGoesRoundRobin: a prefix every node holds goes to each node in turn,
// not to whichever looks best this instant, except to a node well behind the others.
func TestHotPrefixGoesRoundRobin(t *testing.T) {
	prompt := make([]int32, 400)
	for i := range prompt {
		prompt[i] = int32(i)
	}
	var peers []*peer
	for _, name := range []string{"self", "b", "c", "d"} {
		peers = append(peers, &peer{name: name, load: Load{PrefillTPS: 1000, FinishPS: 10}, summary: summaryOf(prompt, 99)})
	}
	peers[1].load.Running = 3 // a little busier than the rest: still takes its turn
	n := routerWith(t, PrefixAware, peers...)
	n.routeRate = 40
	seen := firstChoices(t, n, prompt, 8)
	if len(seen) != 4 || seen["b"] != 2 {
		t.Fatalf("hot prefix not spread in turn: %v", seen)
	}
	// d has a backlog (20 requests queued behind full slots): it still takes its
	// turns (every router would pass it over at once and idle it), until its
	// queue is full.
	peers[3].load.Running, peers[3].load.Waiting, peers[3].load.MaxWaiting = 8, 20, 64
	seen = firstChoices(t, n, prompt, 8)
	if seen["d"] != 2 {
		t.Fatalf("a node with a backlog should take its turns: %v", seen)
	}
	peers[3].load.Waiting = 64
	seen = firstChoices(t, n, prompt, 9)
	if seen["d"] != 0 || seen["self"] != 3 || seen["b"] != 3 || seen["c"] != 3 {
		t.Fatalf("a saturated node should miss its turns: %v", seen)
	}
}

// TestPromptsThatShareNothingGoInTurn: while the prompts a router routes share
// nothing with what the cluster holds, a new one goes to the next node in turn (not
// wherever a hash of it points); once prompts share again, new prefixes go by
// affinity (every router to the same node). A burst of new prompts, faster than
// routers hear from each other, does not count as prompts that share nothing.
func TestPromptsThatShareNothingGoInTurn(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		var peers []*peer
		for _, name := range []string{"self", "b", "c", "d"} {
			peers = append(peers, &peer{name: name, load: Load{PrefillTPS: 1000, FinishPS: 10}})
		}
		n := routerWith(t, PrefixAware, peers...)
		n.routeRate = 40
		unique := func(i int) []int32 {
			p := make([]int32, 64)
			for j := range p {
				p[j] = int32(i*1000 + j)
			}
			return p
		}
		// A burst: new prefixes go by affinity. (The router has routed other
		// prompts before: at a fresh router a prompt that the one before shares
		// is a hot prefix, which goes in turn.)
		for i := range recentPromptsN {
			n.Route("m", unique(200+i), 0)
		}
		for i := range 32 {
			first, _ := n.Route("m", unique(i), 0)
			again, _ := n.Route("m", unique(i), 0)
			if first[0].Name != again[0].Name {
				t.Fatalf("a burst of new prefixes should go by affinity: %s then %s", first[0].Name, again[0].Name)
			}
		}
		// A few prompts that share nothing, a load interval apart, tip it.
		for i := 32; i < 40; i++ {
			time.Sleep(n.cfg.LoadInterval)
			n.Route("m", unique(i), 0)
		}
		if n.reuse >= reuseRotateBelow {
			t.Fatalf("reuse rate %v after 8 prompts that share nothing", n.reuse)
		}
		seen := map[string]int{}
		var last string
		for i := 100; i < 108; i++ {
			time.Sleep(n.cfg.LoadInterval)
			ts, _ := n.Route("m", unique(i), 0)
			if ts[0].Name == last {
				t.Fatalf("two prompts in a row to %s", last)
			}
			last = ts[0].Name
			seen[last]++
		}
		if len(seen) != 4 || seen["self"] != 2 {
			t.Fatalf("prompts that share nothing not spread in turn: %v", seen)
		}
		// Prompts that some node holds raise the rate again.
		peers[1].summary = summaryOf(unique(7), 8)
		for range 8 {
			time.Sleep(n.cfg.LoadInterval)
			n.Route("m", unique(7), 0)
		}
		if n.reuse < reuseRotateBelow {
			t.Fatalf("reuse rate %v after 8 prompts a node holds", n.reuse)
		}
	})
}

// TestOverdueAndUnreachablePeersAreSuspect: a peer whose load stops arriving, or
// that refused a forward a moment ago, is suspect: listed so and not routed to,
// until it is heard from again (or the moment passes).
func TestOverdueAndUnreachablePeersAreSuspect(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		b, c := &peer{name: "b", loadAt: time.Now()}, &peer{name: "c", loadAt: time.Now()}
		n := routerWith(t, RoundRobin, &peer{name: "self"}, b, c)
		routed := func() map[string]int { return firstChoices(t, n, nil, 6) }
		state := func(name string) string { m, _ := member(n, name); return m.State }
		time.Sleep(n.loadOverdue() + time.Millisecond)
		c.loadAt = time.Now() // c kept sending its load; b stopped
		if state("b") != "suspect" || state("c") != "alive" || state("self") != "alive" {
			t.Fatalf("overdue load: b %s, c %s, self %s", state("b"), state("c"), state("self"))
		}
		if seen := routed(); seen["b"] != 0 || seen["self"] != 3 {
			t.Fatalf("a suspect peer was routed to: %v", seen)
		}
		b.loadAt = time.Now()
		n.Unreachable("c")
		if state("b") != "alive" || state("c") != "suspect" {
			t.Fatalf("b heard from again (%s), c refused a forward (%s)", state("b"), state("c"))
		}
		if seen := routed(); seen["c"] != 0 || seen["b"] != 3 {
			t.Fatalf("an unreachable peer was routed to: %v", seen)
		}
		time.Sleep(unreachableHold)
		b.loadAt, c.loadAt = time.Now(), time.Now()
		if seen := routed(); seen["c"] != 2 || seen["b"] != 2 {
			t.Fatalf("after the hold every peer takes its turn: %v", seen)
		}
	})
}

// systemAndDocs returns a 16-token system prompt (4 blocks of 4 tokens) and
// doc(i, n): the system prompt followed by n tokens of document i.
func systemAndDocs() ([]int32, func(i, n int) []int32) {
	system := make([]int32, 16)
	for i := range system {
		system[i] = int32(9000 + i)
	}
	return system, func(i, n int) []int32 {
		p := slices.Clone(system)
		for j := range n {
			p = append(p, int32(i*1000+j))
		}
		return p
	}
}

// systemPromptCluster returns a prefix-aware router among four nodes (self, b, c,
// d) that all hold the system prompt of systemAndDocs, the nodes, and doc.
func systemPromptCluster(t *testing.T) (*Node, []*peer, func(i, n int) []int32) {
	t.Helper()
	system, doc := systemAndDocs()
	var peers []*peer
	for _, name := range []string{"self", "b", "c", "d"} {
		peers = append(peers, &peer{name: name, load: Load{PrefillTPS: 1000, FinishPS: 10}, summary: summaryOf(system, 4)})
	}
	n := routerWith(t, PrefixAware, peers...)
	n.routeRate = 40
	return n, peers, doc
}

// TestCommonHeadIsNotAPrefixToShare: when every node holds the same system prompt,
// a new document behind it still goes by affinity (every router to one node, chosen
// by the document, not the system prompt), prompts that share nothing beyond it go
// in turn, and a prompt held alike almost whole everywhere (a hot prefix) goes in turn.
func TestCommonHeadIsNotAPrefixToShare(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		n, peers, doc := systemPromptCluster(t)
		for i := range recentPromptsN { // prompts routed before (see TestPromptsThatShareNothingGoInTurn)
			n.Route("m", doc(900+i, 64), 0)
		}
		to := map[string]int{}
		for i := range 16 {
			first, _ := n.Route("m", doc(i, 64), 0)
			again, _ := n.Route("m", doc(i, 64), 0)
			if first[0].Name != again[0].Name {
				t.Fatalf("a new document behind the common head should go by affinity: %s then %s", first[0].Name, again[0].Name)
			}
			to[first[0].Name]++
		}
		if len(to) < 3 {
			t.Fatalf("new documents should spread by what follows the common head, not all go where it points: %v", to)
		}
		// Prompts that share nothing beyond the head, a load interval apart.
		seen := map[string]int{}
		var last string
		for i := 100; i < 116; i++ {
			time.Sleep(n.cfg.LoadInterval)
			ts, _ := n.Route("m", doc(i, 64), 0)
			if i >= 108 {
				if ts[0].Name == last {
					t.Fatalf("two prompts in a row to %s", last)
				}
				seen[ts[0].Name]++
			}
			last = ts[0].Name
		}
		if len(seen) != 4 {
			t.Fatalf("prompts that share nothing beyond the head not spread in turn: %v", seen)
		}
		// A hot prefix: every node holds the system prompt and the document.
		for _, p := range peers {
			p.summary = summaryOf(doc(7, 64), 20)
		}
		if seen := questionChoices(t, n, doc(7, 64), 0, 8); len(seen) != 4 || seen["self"] != 2 {
			t.Fatalf("hot prefix not spread in turn: %v", seen)
		}
	})
}

// TestDifferencesWithinTheHeadSayNothing: nodes that differ only in holding the
// head most prompts share (one evicted the system prompt; a hot document is on some
// nodes and not yet on others) do not draw the prompts behind it: prompts that share
// nothing beyond the head still go in turn, and so does the hot document once the
// nodes that hold it are busy.
func TestDifferencesWithinTheHeadSayNothing(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		n, peers, doc := systemPromptCluster(t)
		peers[2].summary = summary{} // c evicted the system prompt
		seen := map[string]int{}
		for i := 100; i < 116; i++ {
			time.Sleep(n.cfg.LoadInterval)
			ts, _ := n.Route("m", doc(i, 64), 0)
			if i >= 108 {
				seen[ts[0].Name]++
			}
		}
		if len(seen) != 4 || seen["c"] != 2 {
			t.Fatalf("one node without the system prompt should not decide where prompts behind it go: %v", seen)
		}
		// A hot document, held by two nodes so far, under load (prefill queued
		// everywhere): in turn.
		peers[0].summary, peers[1].summary = summaryOf(doc(7, 64), 20), summaryOf(doc(7, 64), 20)
		for _, p := range peers {
			p.load.PendingTokens = 100
		}
		if seen := questionChoices(t, n, doc(7, 64), 32, 8); len(seen) != 4 || seen["c"] != 2 {
			t.Fatalf("a hot document should go in turn while only some nodes hold it: %v", seen)
		}
		// While a node that holds it can start it at once, it goes there.
		peers[1].load.PendingTokens = 0
		if seen := questionChoices(t, n, doc(7, 64), 0, 4); seen["b"] != 4 {
			t.Fatalf("a hot document should go to an idle node that holds it: %v", seen)
		}
		peers[1].load.PendingTokens = 100
		// A conversation on it that one node holds goes there.
		peers[3].summary = summaryOf(append(doc(7, 64), 5, 5, 5, 5, 6, 6, 6, 6), 22)
		ts, _ := n.Route("m", append(doc(7, 64), 5, 5, 5, 5, 6, 6, 6, 6, 1), 0)
		if ts[0].Name != "d" {
			t.Fatalf("a prompt held beyond the hot head should go to its holder: %+v", ts[0])
		}
	})
}

// TestHeadLearnedFromTraffic: at a cold start no node holds the system prompt yet,
// so the head most prompts share is learned from the prompts themselves: new
// documents behind it spread by what follows it, and a document most prompts share
// is hot (spread in turn) before any node holds it.
func TestHeadLearnedFromTraffic(t *testing.T) {
	_, doc := systemAndDocs()
	h := func(p []int32) []kvcache.Hash { return kvcache.NewHasher(0, "m").Chain(p, 4) }
	var r recentPrompts
	for i := range headQuorum - 1 {
		if got, _ := r.head(h(doc(i, 64))); got != 0 {
			t.Fatalf("prompt %d: head %d before a quorum of prompts shares one", i, got)
		}
	}
	if got, _ := r.head(h(doc(3, 64))); got != 4 {
		t.Fatalf("the system prompt (4 blocks) should be the head once %d prompts share it: %d", headQuorum, got)
	}
	for range 40 {
		r.head(h(doc(7, 64)))
	}
	if got, _ := r.head(h(append(doc(7, 64), 1, 2, 3, 4))); got != 20 {
		t.Fatalf("a document most recent prompts share should be the head: %d blocks", got)
	}

	var peers []*peer
	for _, name := range []string{"self", "b", "c", "d"} {
		peers = append(peers, &peer{name: name, load: Load{PrefillTPS: 1000, FinishPS: 10}})
	}
	n := routerWith(t, PrefixAware, peers...)
	n.routeRate = 40
	to := map[string]int{}
	for i := range 16 {
		ts, _ := n.Route("m", doc(i, 64), 0)
		to[ts[0].Name]++
	}
	if len(to) < 3 {
		t.Fatalf("new documents behind a system prompt nobody holds yet should spread by what follows it: %v", to)
	}
	// Once half the recent prompts are for one document (here the 16 before it
	// were not), it goes in turn, though no node holds it yet.
	if to := questionChoices(t, n, doc(99, 64), 16, 8); len(to) != 4 || to["self"] != 2 {
		t.Fatalf("a document most prompts share should go in turn before any node holds it: %v", to)
	}
}

// TestHolderWinsTiesOverTheKey: when recomputing a prefix elsewhere costs less than
// the slack (a fast prefill), the node that holds it still gets the request, not the
// node the affinity key points to.
func TestHolderWinsTiesOverTheKey(t *testing.T) {
	prompt := make([]int32, 40)
	for i := range prompt {
		prompt[i] = int32(7 + i)
	}
	for _, holder := range []string{"self", "b"} {
		a := &peer{name: "self", load: Load{PrefillTPS: 1e6}}
		b := &peer{name: "b", load: Load{PrefillTPS: 1e6}}
		n := routerWith(t, PrefixAware, a, b)
		n.peers[holder].summary = summaryOf(prompt, 9)
		n.Route("m", []int32{1, 2, 3, 4, 5}, 0) // a router's first prompt goes in turn
		if ts, _ := n.Route("m", prompt, 0); ts[0].Name != holder {
			t.Fatalf("prefix held by %s went to %s", holder, ts[0].Name)
		}
	}
}

// TestRejoinAfterRestart: a node that starts before the nodes it is told to
// join keeps trying them, though another joined it meanwhile (else the two
// would be a cluster apart), and a failed member that restarts with no --join
// (a cluster's first node) is found again by the others.
func TestRejoinAfterRestart(t *testing.T) {
	fast := func(c *Config) { c.Reconnect = 100 * time.Millisecond }
	seedAddr := freePort(t)
	// b starts first: its --join address answers nothing yet; c joins b.
	b := startTestNode(t, "b", nil, []string{seedAddr}, &fakeLocal{}, fast)
	startTestNode(t, "c", nil, []string{b.GossipAddr()}, &fakeLocal{}, fast)
	alive := func(n *Node, name string) func() bool {
		return func() bool { m, ok := member(n, name); return ok && m.State == "alive" }
	}
	eventually(t, "b sees c", alive(b, "c"))
	time.Sleep(300 * time.Millisecond) // reconnect rounds with c in the cluster
	seed := startTestNode(t, "seed", nil, nil, &fakeLocal{}, fast, func(c *Config) { c.Bind = seedAddr })
	eventually(t, "b joins the seed once it is up", alive(b, "seed"))
	eventually(t, "the seed sees b and c", func() bool { return alive(seed, "b")() && alive(seed, "c")() })

	// The seed fails (no leave) and restarts alone on its address.
	seed.stopOnce.Do(func() { close(seed.stop) }) // Leave, in the cleanup, does nothing more
	seed.ml.Shutdown()
	eventually(t, "b sees the seed dead", func() bool { m, ok := member(b, "seed"); return ok && m.State == "dead" })
	again := startTestNode(t, "seed", nil, nil, &fakeLocal{}, fast, func(c *Config) { c.Bind = seedAddr })
	eventually(t, "b finds the restarted seed", alive(b, "seed"))
	eventually(t, "the restarted seed sees b", alive(again, "b"))
}

// TestRouteUncached: a request that reads nothing from the cache goes by load
// and its whole prefill, not to the node holding its prefix.
func TestRouteUncached(t *testing.T) {
	prompt := make([]int32, 400)
	for i := range prompt {
		prompt[i] = int32(i)
	}
	warm := &peer{name: "self", load: Load{PrefillTPS: 1000, PendingTokens: 300}, summary: summaryOf(prompt, 99)}
	cold := &peer{name: "cold", load: Load{PrefillTPS: 1000}}
	n := routerWith(t, PrefixAware, warm, cold)
	ts, err := n.Route("m", prompt, 0)
	if err != nil || ts[0].Name != "self" || ts[0].Cached != 396 {
		t.Fatalf("the warm node's cache outweighs its short queue: %+v %v", ts, err)
	}
	n.recent = nil
	ts, err = n.RouteUncached("m", prompt, 0)
	if err != nil || ts[0].Name != "cold" || ts[0].Cached != 0 {
		t.Fatalf("uncached: the idle node, nothing counted as cached: %+v %v", ts, err)
	}
}

// TestMetaFitsWhenLeaving: a node whose metadata (its model and LoRA adapter
// ids) would pass memberlist's limit once it drains and leaves is refused at
// start, not found out when peers lose it.
func TestMetaFitsWhenLeaving(t *testing.T) {
	models := []string{"Meta-Llama-3.1-8B-Instruct"}
	for i := 0; ; i++ {
		m := Meta{HTTP: "10.0.0.1:8080", Models: models, Capacity: 64}
		b, _ := encodeMeta(m)
		m.Draining, m.Leaving = true, true
		if _, err := encodeMeta(m); err != nil {
			if len(b) > maxMetaLen {
				t.Fatalf("no metadata fits between the two checks: %d bytes", len(b))
			}
			cfg := DefaultConfig()
			cfg.Name, cfg.Bind, cfg.Secret = "n", "127.0.0.1:1", []byte("s")
			cfg.Meta = Meta{HTTP: "10.0.0.1:8080", Models: models, Capacity: 64}
			if _, err := New(cfg, &fakeLocal{}, quiet()); err == nil || !strings.Contains(err.Error(), "LoRA adapters") {
				t.Fatalf("%d bytes now, over the limit when leaving: New gave %v", len(b), err)
			}
			return
		}
		models = append(models, fmt.Sprintf("customer-%02d-support-lora", i))
	}
}

// TestSuspectPeerAsLastResort: when the only members serving a model are
// suspect (a load report late), a request for it is routed to them, after
// every member that is not; a dead member is never a candidate.
func TestSuspectPeerAsLastResort(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		b := &peer{name: "b", loadAt: time.Now()}
		c := &peer{name: "c", loadAt: time.Now(), meta: Meta{HTTP: "c:1", Models: []string{"x"}, Capacity: 8}}
		n := routerWith(t, PrefixAware, &peer{name: "self", meta: Meta{HTTP: "self:1", Models: []string{"x"}, Capacity: 8}}, b, c)
		time.Sleep(n.loadOverdue() + time.Millisecond)
		c.loadAt = time.Now()
		if m, _ := member(n, "b"); m.State != "suspect" {
			t.Fatalf("b is %s", m.State)
		}
		if ts, err := n.Route("m", nil, 0); err != nil || len(ts) != 1 || ts[0].Name != "b" {
			t.Fatalf("only a suspect member serves m: %+v %v", ts, err)
		}
		if ts, err := n.Route("x", nil, 0); err != nil || len(ts) != 2 {
			t.Fatalf("x, served by members that are not suspect: %+v %v", ts, err)
		}
		b.state = "dead"
		if _, err := n.Route("m", nil, 0); err != ErrUnavailable {
			t.Fatalf("only a dead member serves m: %v", err)
		}
		delete(n.peers, "b") // no longer listed
		if _, err := n.Route("m", nil, 0); err != ErrNoNode {
			t.Fatalf("no member serves m: %v", err)
		}
	})
}

// TestServedModelsAndParents: the models every alive member serves, each with
// the largest max_model_len any gives (requests are routed to a node they
// fit; a generation node's over an embedding node's), and a LoRA adapter with
// its base model, the first of its member's models.
func TestServedModelsAndParents(t *testing.T) {
	n := routerWith(t, RoundRobin,
		&peer{name: "self", meta: Meta{HTTP: "self:1", Models: []string{"base", "tuned"}, Capacity: 8, MaxModelLen: 4096}},
		&peer{name: "b", meta: Meta{HTTP: "b:1", Models: []string{"base"}, Capacity: 8, MaxModelLen: 2048}},
		&peer{name: "c", meta: Meta{HTTP: "c:1", Models: []string{"other"}, Capacity: 8}},
		&peer{name: "e", meta: Meta{HTTP: "e:1", Models: []string{"base"}, Capacity: 8, MaxModelLen: 8192, Task: TaskEmbed}})
	n.peers["c"].state = "dead"
	got := n.Models()
	want := []ServedModel{{ID: "base", MaxModelLen: 4096}, {ID: "tuned", MaxModelLen: 4096, Parent: "base"}}
	if !slices.Equal(got, want) {
		t.Fatalf("models %+v, want %+v", got, want)
	}
}

// TestRouteFitsLimits: in a cluster of unlike nodes a request goes only to
// nodes whose context, output cap and queue it fits, however loaded the
// others are; one that fits none goes to the node it misses least by (whose
// refusal names its limits), unless one it fits is draining.
func TestRouteFitsLimits(t *testing.T) {
	n := routerWith(t, LeastLoaded,
		&peer{name: "self", meta: Meta{HTTP: "self:1", Models: []string{"m"}, Capacity: 8, MaxModelLen: 64, MaxTokensCap: 10}, load: Load{MaxWaiting: 2}},
		&peer{name: "b", meta: Meta{HTTP: "b:1", Models: []string{"m"}, Capacity: 8, MaxModelLen: 1024}, load: Load{MaxWaiting: 64, Running: 8, Waiting: 20}},
		&peer{name: "c", meta: Meta{HTTP: "c:1", Models: []string{"m"}, Capacity: 8, MaxModelLen: 2048}, load: Load{MaxWaiting: 4, Running: 8, Waiting: 3}})
	names := func(need Need) []string {
		t.Helper()
		ts, err := n.RouteTask(TaskGenerate, "m", nil, need, 0, true)
		if err != nil {
			t.Fatalf("%+v: %v", need, err)
		}
		var out []string
		for _, t := range ts {
			out = append(out, t.Name)
		}
		slices.Sort(out)
		return out
	}
	for _, c := range []struct {
		need Need
		want []string
	}{
		{Need{}, []string{"b", "c", "self"}},
		{Need{Length: 64, Seqs: 1}, []string{"b", "c", "self"}},
		{Need{Length: 65, Seqs: 1}, []string{"b", "c"}},
		{Need{Length: 1500, Seqs: 1}, []string{"c"}},
		{Need{Length: 20, Seqs: 1, MaxTokens: 11}, []string{"b", "c"}},
		{Need{Length: 20, Seqs: 3}, []string{"b", "c"}},
		{Need{Length: 1500, Seqs: 8}, []string{"c"}}, // fits none: c misses by its queue alone
		{Need{Length: 4000, Seqs: 1}, []string{"c"}}, // fits none: c's context is the longest
		{Need{Length: 20, Seqs: 100}, []string{"b"}}, // fits none: b's queue is the longest
	} {
		if got := names(c.need); !slices.Equal(got, c.want) {
			t.Errorf("%+v: routed to %v, want %v", c.need, got, c.want)
		}
	}
	// c fits but is saturated (its queue full): 429, not the node it misses least by.
	n.peers["c"].load.Waiting = 4
	if _, err := n.RouteTask(TaskGenerate, "m", nil, Need{Length: 1500, Seqs: 1}, 0, true); err != ErrSaturated {
		t.Fatalf("the one node it fits is saturated: %v", err)
	}
	// c fits but drains (a restart): 503 to retry, not the others' 400; so
	// while it is gone, until it is listed no more.
	n.peers["c"].load.Waiting, n.peers["c"].meta.Draining = 0, true
	if _, err := n.RouteTask(TaskGenerate, "m", nil, Need{Length: 1500, Seqs: 1}, 0, true); err != ErrDraining {
		t.Fatalf("the one node it fits drains: %v", err)
	}
	n.peers["c"].state = "left"
	if _, err := n.RouteTask(TaskGenerate, "m", nil, Need{Length: 1500, Seqs: 1}, 0, true); err != ErrUnavailable {
		t.Fatalf("the one node it fits has left: %v", err)
	}
	delete(n.peers, "c")
	if ts, err := n.RouteTask(TaskGenerate, "m", nil, Need{Length: 1500, Seqs: 1}, 0, true); err != nil || len(ts) != 1 || ts[0].Name != "b" {
		t.Fatalf("no node it fits: %+v %v", ts, err)
	}
}

// TestAliasesRouteAsTheirModel: a request naming an alias goes only to members
// that list it, and by the prefix its model's blocks hold (hashed under the
// model's own id); the alias is served as a model of its own.
func TestAliasesRouteAsTheirModel(t *testing.T) {
	tokens := make([]int32, 64)
	for i := range tokens {
		tokens[i] = int32(100 + i)
	}
	b := &peer{name: "b", meta: Meta{HTTP: "b:1", Models: []string{"m"}, Aliases: []string{"qwen"}, Capacity: 8}}
	c := &peer{name: "c", meta: Meta{HTTP: "c:1", Models: []string{"m"}, Aliases: []string{"qwen"}, Capacity: 8}}
	n := routerWith(t, PrefixAware, &peer{name: "self", meta: Meta{HTTP: "self:1", Models: []string{"m"}, Capacity: 8}}, b, c)
	b.summary = summaryOf(tokens, 16)
	for range 4 {
		ts, err := n.Route("qwen", tokens, 0)
		if err != nil {
			t.Fatal(err)
		}
		if ts[0].Name != "b" || ts[0].Cached != 64 || slices.ContainsFunc(ts, func(t Target) bool { return t.Name == "self" }) {
			t.Fatalf("routed %+v: want b first, with its 64 cached tokens, and never self", ts)
		}
	}
	if _, err := n.Route("other", tokens, 0); err == nil {
		t.Fatal("a model nobody serves was routed")
	}
	if got := n.Models(); !slices.Contains(got, ServedModel{ID: "qwen"}) || !slices.Contains(got, ServedModel{ID: "m"}) {
		t.Fatalf("models %+v", got)
	}
}

// TestAliasesHashedPerNode: where an alias names different models, or a model
// another node serves under that id itself, each node's blocks are matched as
// it holds them, under its own model's id.
func TestAliasesHashedPerNode(t *testing.T) {
	tokens := make([]int32, 64)
	for i := range tokens {
		tokens[i] = int32(300 + i)
	}
	held := func(id string) summary {
		var s summary
		s.add(1, kvcache.NewHasher(0, id).Chain(tokens, 4))
		return s
	}
	for _, c := range []struct {
		name   string
		peers  []*peer
		holder string
		model  string
	}{
		{"a rename: the old node serves the name as its own", []*peer{
			{name: "old", meta: Meta{HTTP: "old:1", Models: []string{"qwen"}, Capacity: 8}, summary: held("qwen")},
			{name: "new", meta: Meta{HTTP: "new:1", Models: []string{"qwen-7b"}, Aliases: []string{"qwen"}, Capacity: 8}},
		}, "old", "qwen"},
		{"the same, the new node holding it", []*peer{
			{name: "old", meta: Meta{HTTP: "old:1", Models: []string{"qwen"}, Capacity: 8}},
			{name: "new", meta: Meta{HTTP: "new:1", Models: []string{"qwen-7b"}, Aliases: []string{"qwen"}, Capacity: 8}, summary: held("qwen-7b")},
		}, "new", "qwen"},
		{"one friendly name for two models", []*peer{
			{name: "q4", meta: Meta{HTTP: "q4:1", Models: []string{"llama-q4"}, Aliases: []string{"llama"}, Capacity: 8}},
			{name: "q8", meta: Meta{HTTP: "q8:1", Models: []string{"llama-q8"}, Aliases: []string{"llama"}, Capacity: 8}, summary: held("llama-q8")},
		}, "q8", "llama"},
	} {
		n := routerWith(t, PrefixAware, append([]*peer{{name: "self", meta: Meta{HTTP: "self:1", Models: []string{"x"}, Capacity: 8}}}, c.peers...)...)
		for range 10 {
			ts, err := n.Route(c.model, tokens, 0)
			if err != nil {
				t.Fatalf("%s: %v", c.name, err)
			}
			if ts[0].Name != c.holder || ts[0].Cached != 64 {
				t.Fatalf("%s: routed %+v, want %s first with 64 cached tokens", c.name, ts, c.holder)
			}
		}
	}
}

// TestForwardClientGone: a client that leaves mid-relay ends the forward with
// ErrClientGone, not as a whole answer.
func TestForwardClientGone(t *testing.T) {
	release := make(chan struct{})
	slow := stallingStream(release)
	defer slow.Close()
	defer close(release)
	f := NewForwarder("a", []byte("s"), nil)
	ctx, cancel := context.WithCancel(context.Background())
	w := &cancelOnWrite{ResponseRecorder: httptest.NewRecorder(), cancel: cancel}
	err := f.ForwardStream(ctx, Target{Name: "slow", HTTP: strings.TrimPrefix(slow.URL, "http://")}, "POST", "/v1/completions", http.Header{}, []byte(`{}`), w, nil)
	if !errors.Is(err, ErrClientGone) {
		t.Fatalf("a client gone mid-relay: %v", err)
	}
}

// TestForwardStopping: a node that stops (its drain timed out) ends the
// streams it relays with a failure event, code draining, not as if their
// clients had left.
func TestForwardStopping(t *testing.T) {
	release := make(chan struct{})
	slow := stallingStream(release)
	defer slow.Close()
	defer close(release)
	f := NewForwarder("a", []byte("s"), nil)
	ctx, cancel := context.WithCancelCause(context.Background())
	w := &cancelOnWrite{ResponseRecorder: httptest.NewRecorder(), cancel: func() { cancel(ErrStopping) }}
	err := f.ForwardStream(ctx, Target{Name: "slow", HTTP: strings.TrimPrefix(slow.URL, "http://")}, "POST", "/v1/completions", http.Header{}, []byte(`{}`), w, nil)
	if want := "data: 1\n\n" + openAIFailure("draining", "the node relaying this answer is shutting down"); !errors.Is(err, ErrStopping) || w.Body.String() != want {
		t.Fatalf("stopping mid-relay: %v %q, want %q", err, w.Body.String(), want)
	}
}

// cancelOnWrite is a client that leaves once it has read something.
type cancelOnWrite struct {
	*httptest.ResponseRecorder
	cancel context.CancelFunc
}

func (w *cancelOnWrite) Write(p []byte) (int, error) {
	defer w.cancel()
	return w.ResponseRecorder.Write(p)
}

// stallingStream serves one SSE event, then nothing until release is closed or
// the request ends.
func stallingStream(release <-chan struct{}) *httptest.Server {
	return httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		io.ReadAll(r.Body)
		w.Header().Set("Content-Type", "text/event-stream")
		io.WriteString(w, "data: 1\n\n")
		w.(http.Flusher).Flush()
		select {
		case <-release:
		case <-r.Context().Done():
		}
	}))
}

// lockedBuffer is a log's output, written by memberlist's goroutines.
type lockedBuffer struct {
	mu sync.Mutex
	b  strings.Builder
}

func (l *lockedBuffer) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.Write(p)
}

func (l *lockedBuffer) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.String()
}

// TestUnlikeBlockHashingLogged: a member that hashes prompt blocks otherwise
// (another --hash-seed), is simulated where this node is not under the same
// model id, or serves another model under one of this node's ids, is logged
// once; one alike is not.
func TestUnlikeBlockHashingLogged(t *testing.T) {
	key := []byte("0123456789abcdef")
	var logs lockedBuffer
	cfg := DefaultConfig()
	cfg.Name, cfg.Bind, cfg.GossipKey, cfg.Secret = "a", freePort(t), key, []byte("s")
	cfg.Meta = Meta{HTTP: "127.0.0.1:1", Models: []string{"m"}, Capacity: 8}
	a, err := New(cfg, &fakeLocal{}, slog.New(slog.NewTextHandler(&logs, nil)))
	if err != nil {
		t.Fatal(err)
	}
	if err := a.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { a.Leave(time.Second) })
	startTestNode(t, "alike", key, []string{a.GossipAddr()}, &fakeLocal{})
	startTestNode(t, "unlike", key, []string{a.GossipAddr()}, &fakeLocal{}, func(c *Config) { c.HashSeed = 7 })
	startTestNode(t, "sim", key, []string{a.GossipAddr()}, &fakeLocal{}, func(c *Config) { c.Meta.Simulated = true })
	startTestNode(t, "other", key, []string{a.GossipAddr()}, &fakeLocal{}, func(c *Config) { c.Meta.Models, c.Meta.Aliases = []string{"o"}, []string{"m"} })
	eventually(t, "five members", func() bool { return len(a.Members()) == 5 })
	eventually(t, "the unlike, simulated and other-named members logged", func() bool {
		s := logs.String()
		return strings.Contains(s, "peer=unlike") && strings.Contains(s, "peer=sim") && strings.Contains(s, "peer=other")
	})
	if s := logs.String(); strings.Contains(s, "peer=alike") || strings.Count(s, "hashes prompt blocks otherwise") != 1 ||
		strings.Count(s, "simulated node and a real one") != 1 || strings.Count(s, "another model answers") != 1 {
		t.Fatalf("logs:\n%s", s)
	}
}
