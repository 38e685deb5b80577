package main

import (
	"bytes"
	"cmp"
	"encoding/json"
	"fmt"
	"io"
	"math"
	"net"
	"net/http"
	"slices"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/shoal-ai/shoal/api"
	"github.com/shoal-ai/shoal/cluster"
)

func freeAddr(t *testing.T) string { return freeAddrTB(t) }

func netListen() (net.Listener, error) { return net.Listen("tcp", "127.0.0.1:0") }

func clusterMembers(t *testing.T, n *node) []cluster.Member {
	t.Helper()
	resp, err := http.Get(n.url + "/cluster")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	var info struct {
		Members []cluster.Member `json:"members"`
	}
	json.NewDecoder(resp.Body).Decode(&info)
	return info.Members
}

func waitFor(t *testing.T, what string, f func() bool) {
	t.Helper()
	deadline := time.Now().Add(20 * time.Second)
	for !f() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

func post(t *testing.T, url, body string, hdr ...string) (*http.Response, string) {
	t.Helper()
	req, _ := http.NewRequest("POST", url, strings.NewReader(body))
	req.Header.Set("Content-Type", "application/json")
	for i := 0; i+1 < len(hdr); i += 2 {
		req.Header.Set(hdr[i], hdr[i+1])
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp, string(b)
}

// TestClusterRoutesAndForwards runs three real nodes on 127.0.0.1: they gossip,
// route by prefix and load, forward one hop, refuse forged hops, and survive a node's
// death and another's drain.
func TestClusterRoutesAndForwards(t *testing.T) {
	model := smallModel(t)
	key := "MDEyMzQ1Njc4OWFiY2RlZjAxMjM0NTY3ODlhYmNkZWY=" // 32 bytes
	common := []string{"--model", model, "--gossip-key", key, "--ctx-size", "4096", "--parallel", "32", "--threads", "1"}
	g1 := freeAddr(t)
	a := startNode(t, append([]string{"--gossip-addr", g1, "--node-name", "a"}, common...)...)
	b := startNode(t, append([]string{"--gossip-addr", freeAddr(t), "--node-name", "b", "--join", g1}, common...)...)
	c := startNode(t, append([]string{"--gossip-addr", freeAddr(t), "--node-name", "c", "--join", g1}, common...)...)
	waitFor(t, "3 alive members on every node", func() bool {
		for _, n := range []*node{a, b, c} {
			alive := 0
			for _, m := range clusterMembers(t, n) {
				if m.State == "alive" && m.Load.Seq > 0 && m.Device == "CPU" {
					alive++
				}
			}
			if alive != 3 {
				return false
			}
		}
		return true
	})

	// A long shared prompt: after its first request, routing follows the cache.
	prompt := strings.Repeat("The quick brown fox jumps over the lazy dog. ", 20)
	body := `{"model":"small","prompt":"` + prompt + `","max_tokens":4,"temperature":0}`
	resp, out := post(t, b.url+"/v1/completions", body)
	if resp.StatusCode != 200 {
		t.Fatalf("first request: %d %s", resp.StatusCode, out)
	}
	first := resp.Header.Get("X-Shoal-Served-By") // empty: served by b itself
	waitFor(t, "the cache summary to reach a", func() bool {
		for _, m := range clusterMembers(t, a) {
			if m.SummaryBlocks > 0 {
				return true
			}
		}
		return false
	})
	servedBy := map[string]int{}
	for range 4 {
		resp, out = post(t, a.url+"/v1/completions", body)
		if resp.StatusCode != 200 {
			t.Fatalf("routed request: %d %s", resp.StatusCode, out)
		}
		var r struct {
			Usage struct {
				Details struct {
					Cached int `json:"cached_tokens"`
				} `json:"prompt_tokens_details"`
			} `json:"usage"`
		}
		json.Unmarshal([]byte(out), &r)
		by := resp.Header.Get("X-Shoal-Served-By")
		if by == "" {
			by = "a"
		}
		servedBy[by]++
		if r.Usage.Details.Cached == 0 {
			t.Errorf("request routed to %s found no cached prefix (first was served by %q)", by, first)
		}
	}
	t.Logf("served by: %v", servedBy)
	// a's metrics say where it routed them, and the nodes that ran another's
	// requests count them: the first request (routed by b) and a's 4.
	for name, n := range servedBy {
		if got := a.metricSum(t, `shoal_routed_requests_total{model_name="small",node="`+name+`"}`); got != float64(n) {
			t.Errorf("a routed %v requests to %s by its metrics, %d by the answers", got, name, n)
		}
	}
	fromPeers := 0.0
	for _, n := range []*node{a, b, c} {
		fromPeers += n.metricSum(t, "shoal_requests_from_peers_total")
	}
	if forwarded := 4 - servedBy["a"] + min(len(first), 1); fromPeers != float64(forwarded) {
		t.Errorf("%v requests ran for another node, %d were forwarded", fromPeers, forwarded)
	}
	if got := a.metricSum(t, `shoal_cluster_members{model_name="small",state="alive"}`); got != 3 {
		t.Errorf("a counts %v alive members", got)
	}

	// Streams relay through the hop.
	resp, out = post(t, c.url+"/v1/chat/completions", `{"messages":[{"role":"user","content":"hi"}],"max_tokens":3,"stream":true}`)
	if resp.StatusCode != 200 || !strings.HasSuffix(out, "data: [DONE]\n\n") {
		t.Fatalf("stream: %d %q", resp.StatusCode, out)
	}

	// A forged hop is refused.
	resp, out = post(t, a.url+"/v1/completions", body, "X-Shoal-Hop", "1", "X-Shoal-From", "b", "X-Shoal-Time", "1", "X-Shoal-Auth", "00")
	if resp.StatusCode != 401 || !strings.Contains(out, "invalid_cluster_credential") {
		t.Fatalf("forged hop: %d %s", resp.StatusCode, out)
	}

	// shoal status prints the table.
	var stdout, stderr bytes.Buffer
	if code := run([]string{"status", "--addr", strings.TrimPrefix(a.url, "http://")}, &stdout, &stderr); code != 0 {
		t.Fatalf("status: %s", stderr.String())
	}
	var v1 bytes.Buffer
	if code := run([]string{"status", "--addr", a.url + "/v1"}, &v1, &stderr); code != 0 || !strings.Contains(v1.String(), "a (self)") {
		t.Fatalf("status at the API's base URL: %s", stderr.String())
	}
	if !strings.Contains(stdout.String(), "a (self)") || strings.Count(stdout.String(), "alive") != 3 {
		t.Fatalf("status table:\n%s", stdout.String())
	}

	// c dies: the others notice, and requests to a still succeed.
	c.cmd.Process.Signal(syscall.SIGKILL)
	<-c.done
	waitFor(t, "c marked not alive at a", func() bool {
		for _, m := range clusterMembers(t, a) {
			if m.Name == "c" {
				return m.State != "alive"
			}
		}
		return false
	})
	for range 3 {
		if resp, out = post(t, a.url+"/v1/completions", `{"prompt":"hello there","max_tokens":2}`); resp.StatusCode != 200 {
			t.Fatalf("after c died: %d %s", resp.StatusCode, out)
		}
	}

	// b drains: a sees it and stops routing there; b exits 0.
	b.cmd.Process.Signal(syscall.SIGTERM)
	if err := <-b.done; err != nil {
		t.Fatalf("b exit: %v", err)
	}
	waitFor(t, "b gone from a's routes", func() bool {
		for _, m := range clusterMembers(t, a) {
			if m.Name == "b" {
				return m.State == "left" || m.Draining
			}
		}
		return false
	})
	for range 3 {
		resp, out = post(t, a.url+"/v1/completions", body)
		if resp.StatusCode != 200 || resp.Header.Get("X-Shoal-Served-By") != "" {
			t.Fatalf("with b drained, a serves itself: %d %q %s", resp.StatusCode, resp.Header.Get("X-Shoal-Served-By"), out)
		}
	}
}

func TestWrongGossipKeyProcessFails(t *testing.T) {
	g1 := freeAddr(t)
	startNode(t, "--model", smallModel(t), "--gossip-addr", g1, "--gossip-key", "MDEyMzQ1Njc4OWFiY2RlZg==")
	var stdout, stderr bytes.Buffer
	code := run([]string{"serve", "--model", smallModel(t), "--addr", "127.0.0.1:0", "--gossip-addr", freeAddr(t), "--join", g1,
		"--gossip-key", "ZmVkY2JhOTg3NjU0MzIxMA=="}, &stdout, &stderr)
	if code == 0 || !strings.Contains(stderr.String(), "another --gossip-key") || strings.Contains(stderr.String(), "\n\n") {
		t.Fatalf("a node with the wrong key joined (exit %d): %s", code, stderr.String())
	}
}

// TestPeerKilledMidStream: a stream relayed from a peer that is killed ends with an
// error event, and new requests succeed on the surviving node.
func TestPeerKilledMidStream(t *testing.T) {
	model := smallModel(t)
	key := "MDEyMzQ1Njc4OWFiY2RlZjAxMjM0NTY3ODlhYmNkZWY="
	g1 := freeAddr(t)
	common := []string{"--model", model, "--gossip-key", key, "--threads", "1"}
	a := startNode(t, append([]string{"--gossip-addr", g1, "--node-name", "a", "--route", "round-robin"}, common...)...)
	gb := freeAddr(t)
	b := startNode(t, append([]string{"--gossip-addr", gb, "--node-name", "b", "--join", g1}, common...)...)
	waitFor(t, "b known to a", func() bool {
		for _, m := range clusterMembers(t, a) {
			if m.Name == "b" && m.State == "alive" {
				return true
			}
		}
		return false
	})
	body := `{"prompt":"Once upon a time","max_tokens":4000,"ignore_eos":true,"stream":true}`
	var resp *http.Response
	for range 4 { // round robin: one of the next requests goes to b
		req, _ := http.NewRequest("POST", a.url+"/v1/completions", strings.NewReader(body))
		req.Header.Set("Content-Type", "application/json")
		r, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		if r.Header.Get("X-Shoal-Served-By") == "b" {
			resp = r
			break
		}
		r.Body.Close()
	}
	if resp == nil {
		t.Fatal("no request was forwarded to b")
	}
	defer resp.Body.Close()
	buf := make([]byte, 4096)
	if _, err := resp.Body.Read(buf); err != nil {
		t.Fatal(err)
	}
	b.cmd.Process.Signal(syscall.SIGKILL)
	<-b.done
	rest, err := io.ReadAll(resp.Body) // must end, not hang
	if err != nil {
		t.Fatalf("stream did not end cleanly after the peer died: %v", err)
	}
	if !strings.Contains(string(rest), "peer_failed") || !strings.HasSuffix(string(rest), "data: [DONE]\n\n") {
		t.Fatalf("no error event at the end of the relayed stream: %q", tail(string(rest)))
	}
	for range 4 {
		if r, out := post(t, a.url+"/v1/completions", `{"prompt":"hi","max_tokens":2}`); r.StatusCode != 200 {
			t.Fatalf("after b died: %d %s", r.StatusCode, out)
		}
	}
	// b comes back under its name: a takes its new process's load at once (its load
	// sequence starts again) and routes to it, rather than marking it suspect until
	// the new count passes the old.
	b = startNode(t, append([]string{"--gossip-addr", gb, "--node-name", "b", "--join", g1}, common...)...)
	bAlive := func() bool {
		for _, m := range clusterMembers(t, a) {
			if m.Name == "b" {
				return m.State == "alive" && m.UpdatedAgoMS >= 0 && m.UpdatedAgoMS < 1000
			}
		}
		return false
	}
	waitFor(t, "the restarted b alive on a", bAlive)
	time.Sleep(3 * time.Second) // past the 2 s after which a peer whose load is overdue is suspect
	if !bAlive() {
		t.Fatalf("the restarted b is not alive on a: %+v", clusterMembers(t, a))
	}
	servedByB := false
	for range 4 {
		r, out := post(t, a.url+"/v1/completions", `{"prompt":"hi","max_tokens":2}`)
		if r.StatusCode != 200 {
			t.Fatalf("after b restarted: %d %s", r.StatusCode, out)
		}
		servedByB = servedByB || r.Header.Get("X-Shoal-Served-By") == "b"
	}
	if !servedByB {
		t.Fatal("round robin never sent a request to the restarted b")
	}
	// A request that claims a valid hop is never forwarded again, even for a model
	// this node does not serve.
	resp2, out := post(t, a.url+"/v1/completions", `{"model":"elsewhere","prompt":"x"}`)
	if resp2.StatusCode != 404 {
		t.Fatalf("unknown model: %d %s", resp2.StatusCode, out)
	}
}

func tail(s string) string {
	if len(s) > 300 {
		return s[len(s)-300:]
	}
	return s
}

// TestDifferentPrefixesSpread: concurrent requests with distinct long prompts do not
// all stay on the node that received them.
func TestDifferentPrefixesSpread(t *testing.T) {
	model := smallModel(t)
	key := "MDEyMzQ1Njc4OWFiY2RlZjAxMjM0NTY3ODlhYmNkZWY="
	g1 := freeAddr(t)
	common := []string{"--model", model, "--gossip-key", key, "--threads", "1"}
	a := startNode(t, append([]string{"--gossip-addr", g1, "--node-name", "a"}, common...)...)
	startNode(t, append([]string{"--gossip-addr", freeAddr(t), "--node-name", "b", "--join", g1}, common...)...)
	startNode(t, append([]string{"--gossip-addr", freeAddr(t), "--node-name", "c", "--join", g1}, common...)...)
	waitAlive(t, a, 3)
	var bodies []string
	for i, w := range []string{"apple", "river", "stone", "cloud", "tiger", "maple", "ocean", "ember", "frost"} {
		prompt := strings.Repeat(fmt.Sprintf("%s %d is here. ", w, i), 40)
		bodies = append(bodies, `{"prompt":"`+prompt+`","max_tokens":16,"ignore_eos":true}`)
	}
	served := servedBy(t, a.url+"/v1/completions", "a", bodies, "")
	if len(served) < 2 {
		t.Fatalf("9 concurrent requests with different prefixes all served by one node: %v", served)
	}
}

// TestTLSAndManyModels: two nodes serving different models over TLS, behind an API
// key; either node answers for both models (generation and /tokenize), forwarding
// over verified TLS with the client's key, and /cluster needs the key too.
func TestTLSAndManyModels(t *testing.T) {
	dir := t.TempDir()
	cert, key, ca := writeTestCert(t, dir)
	model := smallModel(t)
	gk := "MDEyMzQ1Njc4OWFiY2RlZjAxMjM0NTY3ODlhYmNkZWY="
	g1 := freeAddr(t)
	tlsArgs := []string{"--tls-cert", cert, "--tls-key", key, "--tls-ca", ca, "--gossip-key", gk, "--model", model, "--threads", "1"}
	// Each node its own API key: a request forwarded by a member that checked
	// the client's key is taken on the cluster's credential.
	x := startNode(t, append([]string{"--gossip-addr", g1, "--model-name", "x", "--api-key", "k1"}, tlsArgs...)...)
	y := startNode(t, append([]string{"--gossip-addr", freeAddr(t), "--model-name", "y", "--join", g1, "--max-model-len", "300", "--api-key", "k2"}, tlsArgs...)...)
	if !strings.HasPrefix(x.url, "https://") || !strings.HasPrefix(y.url, "https://") {
		t.Fatalf("nodes not on TLS: %s %s", x.url, y.url)
	}
	client := tlsClient(t, ca)
	do := func(method, url, body, key string) (*http.Response, string) {
		req, err := http.NewRequest(method, url, strings.NewReader(body))
		if err != nil {
			t.Fatal(err)
		}
		req.Header.Set("Content-Type", "application/json")
		if key != "" {
			req.Header.Set("Authorization", "Bearer "+key)
		}
		resp, err := client.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		return resp, string(b)
	}
	waitFor(t, "x lists y's model", func() bool {
		_, b := do("GET", x.url+"/v1/models", "", "k1")
		return strings.Contains(b, `"id":"y"`)
	})
	// With the max_model_len y serves it with.
	if _, b := do("GET", x.url+"/v1/models/y", "", "k1"); !strings.Contains(b, `"max_model_len":300`) {
		t.Fatalf("y's model as x lists it: %s", b)
	}
	for _, m := range []string{"x", "y"} {
		resp, b := do("POST", x.url+"/v1/completions", `{"model":"`+m+`","prompt":"hi","max_tokens":2}`, "k1")
		if resp.StatusCode != 200 {
			t.Fatalf("model %s via x: %d %s", m, resp.StatusCode, b)
		}
		if by := resp.Header.Get("X-Shoal-Served-By"); (m == "y") != (by != "") {
			t.Fatalf("model %s served by %q", m, by)
		}
		// /tokenize answers from the vocabulary of the node that serves the model.
		resp, b = do("POST", x.url+"/tokenize", `{"model":"`+m+`","prompt":"hi"}`, "k1")
		if resp.StatusCode != 200 || (m == "y") != (resp.Header.Get("X-Shoal-Served-By") != "") {
			t.Fatalf("tokenize for %s via x: %d %s (served by %q)", m, resp.StatusCode, b, resp.Header.Get("X-Shoal-Served-By"))
		}
	}
	if resp, b := do("POST", x.url+"/v1/completions", `{"model":"z","prompt":"hi"}`, "k1"); resp.StatusCode != 404 {
		t.Fatalf("unknown model: %d %s", resp.StatusCode, b)
	}
	if resp, _ := do("GET", x.url+"/cluster", "", ""); resp.StatusCode != 401 {
		t.Fatalf("/cluster without the API key: %d", resp.StatusCode)
	}
	if resp, b := do("GET", x.url+"/cluster", "", "k1"); resp.StatusCode != 200 || !strings.Contains(b, `"members"`) {
		t.Fatalf("/cluster with the API key: %d %s", resp.StatusCode, b)
	}
	if resp, _ := do("GET", y.url+"/v1/models", "", "k1"); resp.StatusCode != 401 {
		t.Fatalf("x's key straight to y: %d", resp.StatusCode)
	}
	// shoal status verifies a TLS node with --tls-ca.
	var out, errb bytes.Buffer
	if code := run([]string{"status", "--addr", strings.TrimPrefix(x.url, "https://"), "--tls-ca", ca, "--api-key", "k1"}, &out, &errb); code != 0 ||
		!strings.Contains(out.String(), "(self)") || strings.Count(out.String(), "alive") != 2 {
		t.Fatalf("shoal status --tls-ca: exit %d\n%s%s", code, out.String(), errb.String())
	}
	// A refusal is reported as its message, not its JSON.
	out.Reset()
	errb.Reset()
	if code := run([]string{"status", "--addr", strings.TrimPrefix(x.url, "https://"), "--tls-ca", ca, "--api-key", "wrong"}, &out, &errb); code == 0 ||
		!strings.Contains(errb.String(), "status 401: ") || strings.Contains(errb.String(), `{"error"`) {
		t.Fatalf("shoal status with a wrong key: exit %d\n%s%s", code, out.String(), errb.String())
	}
	// shoal bench too.
	out.Reset()
	errb.Reset()
	if code := run([]string{"bench", "--url", x.url, "--tls-ca", ca, "--api-key", "k1", "--model", "x", "--num-prompts", "2", "--input-len", "8", "--output-len", "2", "--token-max", "200"}, &out, &errb); code != 0 ||
		!strings.Contains(out.String(), "completed") {
		t.Fatalf("shoal bench --tls-ca: exit %d\n%s%s", code, out.String(), errb.String())
	}
}

// TestKeylessNodeForwards: a node without API keys forwards a request for a
// keyed node's model with the client's key, as Authorization or x-api-key;
// without one, every peer refuses it and the client gets 401, not 502.
func TestKeylessNodeForwards(t *testing.T) {
	gk := "MDEyMzQ1Njc4OWFiY2RlZjAxMjM0NTY3ODlhYmNkZWY="
	g1 := freeAddr(t)
	a := startNode(t, "--model", smallModel(t), "--model-name", "a", "--gossip-addr", g1, "--gossip-key", gk, "--api-key", "k1")
	b := startNode(t, "--model", smallModel(t), "--model-name", "b", "--gossip-addr", freeAddr(t), "--join", g1, "--gossip-key", gk)
	waitFor(t, "b lists a's model", func() bool { return strings.Contains(modelList(b), `"id":"a"`) })
	body := `{"model":"a","prompt":"hi","max_tokens":2}`
	for _, hdr := range [][]string{{"Authorization", "Bearer k1"}, {"X-Api-Key", "k1"}} {
		if resp, out := post(t, b.url+"/v1/completions", body, hdr...); resp.StatusCode != 200 || resp.Header.Get("X-Shoal-Served-By") == "" {
			t.Errorf("key as %s: %d %s", hdr[0], resp.StatusCode, out)
		}
	}
	// Under load b may, for a moment, see a's load as overdue and route to no
	// node (404): only that is waited out; any other answer but 401 fails.
	waitFor(t, "b to answer a keyless request for a's model", func() bool {
		resp, out := post(t, b.url+"/v1/completions", body)
		if resp.StatusCode == 404 && strings.Contains(out, "no node of this cluster serves") {
			return false
		}
		if resp.StatusCode != 401 {
			t.Fatalf("without a key: %d %s, want 401", resp.StatusCode, out)
		}
		return true
	})
	if resp, _ := post(t, a.url+"/v1/completions", body); resp.StatusCode != 401 {
		t.Errorf("a without a key: %d", resp.StatusCode)
	}
}

// TestAdapterRoutedToItsNode: a LoRA adapter served by one node of a cluster
// (--lora-modules) is listed by the others, and a request for it sent to
// another node is answered by the node that has it, as it answers itself.
func TestAdapterRoutedToItsNode(t *testing.T) {
	adapter := genFile(t, "lora.gguf", "--preset", "small", "--lora", "8")
	gk := "MDEyMzQ1Njc4OWFiY2RlZjAxMjM0NTY3ODlhYmNkZWY="
	g1 := freeAddr(t)
	a := startNode(t, "--model", smallModel(t), "--model-name", "base", "--node-name", "a", "--gossip-addr", g1, "--gossip-key", gk, "--lora-modules", "tuned="+adapter)
	b := startNode(t, "--model", smallModel(t), "--model-name", "base", "--node-name", "b", "--gossip-addr", freeAddr(t), "--join", g1, "--gossip-key", gk)
	waitFor(t, "b lists a's adapter", func() bool {
		out := modelList(b)
		return strings.Contains(out, `"id":"tuned"`) && strings.Contains(out, `"parent":"base"`)
	})
	body := `{"model":"tuned","prompt":"Once upon a time","max_tokens":12,"temperature":0}`
	want := completionText(t, a.url, body)
	for range 3 {
		resp, got := post(t, b.url+"/v1/completions", body)
		if resp.StatusCode != 200 || resp.Header.Get("X-Shoal-Served-By") != "a" || !strings.Contains(got, `"model":"tuned"`) {
			t.Fatalf("b, for a's adapter: %d served by %q: %s", resp.StatusCode, resp.Header.Get("X-Shoal-Served-By"), got)
		}
		var r struct {
			Choices []struct {
				Text string `json:"text"`
			} `json:"choices"`
		}
		if json.Unmarshal([]byte(got), &r) != nil || len(r.Choices) != 1 || r.Choices[0].Text != want {
			t.Fatalf("b, for a's adapter: %s, want %q", got, want)
		}
	}
	// Ollama's API too: b lists the adapter with its parent, and forwards a
	// streamed request for it (by Ollama's name for it) to a, line by line.
	if tags := getBody(b.url + "/api/tags"); !strings.Contains(tags, `"name":"tuned"`) || !strings.Contains(tags, `"parent_model":"base"`) {
		t.Fatalf("b's /api/tags: %s", tags)
	}
	if resp, show := post(t, b.url+"/api/show", `{"model":"tuned"}`); resp.StatusCode != 200 || resp.Header.Get("X-Shoal-Served-By") != "a" ||
		!strings.Contains(show, `"parent_model":"base"`) || !strings.Contains(show, `"llama.context_length"`) {
		t.Fatalf("b's /api/show of a's adapter: %d %s", resp.StatusCode, show)
	}
	resp, got := post(t, b.url+"/api/generate", `{"model":"tuned:latest","prompt":"Once upon a time","raw":true,"options":{"num_predict":12,"temperature":0}}`)
	var text strings.Builder
	lines := strings.Split(strings.TrimSpace(got), "\n")
	for _, l := range lines {
		var r struct {
			Response string `json:"response"`
			Done     bool   `json:"done"`
		}
		if err := json.Unmarshal([]byte(l), &r); err != nil {
			t.Fatalf("line %q: %v", l, err)
		}
		text.WriteString(r.Response)
	}
	if resp.StatusCode != 200 || resp.Header.Get("X-Shoal-Served-By") != "a" || len(lines) < 3 || text.String() != want {
		t.Fatalf("b, /api/generate for a's adapter: %d served by %q: %q, want %q", resp.StatusCode, resp.Header.Get("X-Shoal-Served-By"), text.String(), want)
	}
	// The request's id (b's, given to the client) names it in both nodes'
	// logs: on b, which forwarded it, and on a, which ran it.
	id := resp.Header.Get("X-Request-Id")
	logged := func(n *node, want ...string) bool {
		for _, l := range strings.Split(n.log(), "\n") {
			if id != "" && strings.Contains(l, "msg=request id="+id+" ") && !slices.ContainsFunc(want, func(w string) bool { return !strings.Contains(l, w) }) {
				return true
			}
		}
		return false
	}
	waitFor(t, "both nodes log the request under the client's id", func() bool {
		return logged(b, "path=/api/generate", "status=200", "model=tuned", "served_by=a") &&
			logged(a, "path=/api/generate", "status=200", "forwarded_by=b", "model=tuned", "completion_tokens=12")
	})
}

// modelList is n's GET /v1/models body, "" when it does not answer.
func modelList(n *node) string { return getBody(n.url + "/v1/models") }

// getBody is url's GET body, "" when it does not answer.
func getBody(url string) string {
	resp, err := http.Get(url)
	if err != nil {
		return ""
	}
	defer resp.Body.Close()
	out, _ := io.ReadAll(resp.Body)
	return string(out)
}

// TestRerankerInCluster: a reranker node in a cluster of generation nodes; a
// rerank request for it sent to another node is answered by the reranker, with
// the scores it gives itself.
func TestRerankerInCluster(t *testing.T) {
	model := genFile(t, "rr.gguf", "--preset", "tiny", "--reranker")
	gk := "MDEyMzQ1Njc4OWFiY2RlZjAxMjM0NTY3ODlhYmNkZWY="
	g1 := freeAddr(t)
	rr := startNode(t, "--model", model, "--reranking", "--gossip-addr", g1, "--gossip-key", gk)
	gen := startNode(t, "--model", smallModel(t), "--model-name", "gen", "--gossip-addr", freeAddr(t), "--join", g1, "--gossip-key", gk)
	waitFor(t, "gen lists the reranker", func() bool { return strings.Contains(modelList(gen), `"id":"rr"`) })
	body := `{"model":"rr","query":"what is it","documents":["a cat","a dog","a boat"]}`
	resp, there := post(t, gen.url+"/v1/rerank", body)
	if resp.StatusCode != 200 || resp.Header.Get("X-Shoal-Served-By") == "" {
		t.Fatalf("rerank via gen: %d %s", resp.StatusCode, there)
	}
	_, here := post(t, rr.url+"/v1/rerank", body)
	var a, b api.RerankResponse
	if json.Unmarshal([]byte(there), &a) != nil || json.Unmarshal([]byte(here), &b) != nil || len(a.Results) != 3 {
		t.Fatalf("answers: %s / %s", there, here)
	}
	for i := range a.Results {
		if a.Results[i].Index != b.Results[i].Index || math.Abs(a.Results[i].RelevanceScore-b.Results[i].RelevanceScore) > 1e-5 {
			t.Fatalf("forwarded %+v, direct %+v", a.Results, b.Results)
		}
	}
	if resp, out := post(t, gen.url+"/v1/score", `{"model":"gen","text_1":"a","text_2":"b"}`); resp.StatusCode != 400 || !strings.Contains(out, "--reranking") {
		t.Fatalf("score on the generation model: %d %s", resp.StatusCode, out)
	}
	// No model named: the cluster's reranker answers, as the node alone would.
	if resp, out := post(t, gen.url+"/v1/rerank", `{"query":"what is it","documents":["a cat","a dog","a boat"]}`); resp.StatusCode != 200 || resp.Header.Get("X-Shoal-Served-By") == "" {
		t.Fatalf("rerank without a model via gen: %d %s", resp.StatusCode, out)
	}
	if resp, out := post(t, rr.url+"/v1/completions", `{"prompt":"Once upon","max_tokens":2}`); resp.StatusCode != 200 || resp.Header.Get("X-Shoal-Served-By") == "" {
		t.Fatalf("completions without a model via the reranker: %d %s", resp.StatusCode, out)
	}
}

// TestRerankersSpread: rerank requests sent to one of two nodes serving the same
// reranker are spread over both, as generation is: adding a node adds capacity.
func TestRerankersSpread(t *testing.T) {
	model := genFile(t, "rr.gguf", "--preset", "small", "--reranker")
	key := "MDEyMzQ1Njc4OWFiY2RlZjAxMjM0NTY3ODlhYmNkZWY="
	g1 := freeAddr(t)
	common := []string{"--model", model, "--reranking", "--gossip-key", key, "--threads", "1"}
	a := startNode(t, append([]string{"--gossip-addr", g1, "--node-name", "a"}, common...)...)
	startNode(t, append([]string{"--gossip-addr", freeAddr(t), "--node-name", "b", "--join", g1}, common...)...)
	waitAlive(t, a, 2)
	docs := make([]string, 16)
	for i := range docs {
		docs[i] = fmt.Sprintf("document %d: %s", i, strings.Repeat("some words of text ", 8))
	}
	var bodies []string
	for i, w := range []string{"apple", "river", "stone", "cloud", "tiger", "maple", "ocean", "ember"} {
		body, _ := json.Marshal(map[string]any{"query": strings.Repeat(fmt.Sprintf("%s %d? ", w, i), 20), "documents": docs})
		bodies = append(bodies, string(body))
	}
	served := servedBy(t, a.url+"/v1/rerank", "a", bodies, `"relevance_score"`)
	if len(served) < 2 {
		t.Fatalf("8 concurrent rerank requests all served by one node: %v", served)
	}
}

// TestTasksRouteToTheirNodes: one model file served to generate on one node and
// to embed on another advertises one id twice; each request goes to a node of
// its task, whichever node it is sent to.
func TestTasksRouteToTheirNodes(t *testing.T) {
	key := "MDEyMzQ1Njc4OWFiY2RlZjAxMjM0NTY3ODlhYmNkZWY="
	g1 := freeAddr(t)
	common := []string{"--model", smallModel(t), "--gossip-key", key, "--threads", "1"}
	gen := startNode(t, append([]string{"--gossip-addr", g1, "--node-name", "gen"}, common...)...)
	emb := startNode(t, append([]string{"--gossip-addr", freeAddr(t), "--node-name", "emb", "--join", g1, "--embeddings", "--pooling", "mean"}, common...)...)
	waitAlive(t, gen, 2)
	for i := range 6 {
		for _, n := range []*node{gen, emb} {
			resp, text := post(t, n.url+"/v1/embeddings", fmt.Sprintf(`{"model":"small","input":"text number %d"}`, i))
			if resp.StatusCode != 200 || !strings.Contains(text, `"embedding"`) {
				t.Fatalf("embeddings sent to %s: %d %s", n.url, resp.StatusCode, text)
			}
			resp, text = post(t, n.url+"/v1/completions", fmt.Sprintf(`{"model":"small","prompt":"story %d","max_tokens":2}`, i))
			if resp.StatusCode != 200 || !strings.Contains(text, `"text_completion"`) {
				t.Fatalf("completion sent to %s: %d %s", n.url, resp.StatusCode, text)
			}
		}
	}
	if resp, text := post(t, emb.url+"/tokenize", `{"model":"small","prompt":"hi"}`); resp.StatusCode != 200 || resp.Header.Get("X-Shoal-Served-By") != "" {
		t.Fatalf("tokenize at the embedding node: %d %s (served by %q)", resp.StatusCode, text, resp.Header.Get("X-Shoal-Served-By"))
	}
	// shoal status marks the embedding node's model.
	var out, errb bytes.Buffer
	if code := run([]string{"status", "--addr", strings.TrimPrefix(gen.url, "http://")}, &out, &errb); code != 0 || !strings.Contains(out.String(), "small (embed)") || strings.Count(out.String(), "small") != 2 {
		t.Fatalf("shoal status: exit %d\n%s%s", code, out.String(), errb.String())
	}
}

// TestUnlikeNodesRouteByLimits: in a cluster of nodes with different limits
// (--max-model-len, --max-tokens-cap, --max-waiting) a request goes to a node
// it fits, wherever it is sent; one that fits no node is refused under the
// cluster's highest limit, which /v1/models gives at every node. A model
// served for another task is named as such, not unknown.
func TestUnlikeNodesRouteByLimits(t *testing.T) {
	key := "MDEyMzQ1Njc4OWFiY2RlZjAxMjM0NTY3ODlhYmNkZWY="
	g1 := freeAddr(t)
	common := []string{"--model", smallModel(t), "--gossip-key", key}
	wide := startNode(t, append([]string{"--gossip-addr", g1, "--node-name", "wide", "--max-model-len", "512"}, common...)...)
	narrow := startNode(t, append([]string{"--gossip-addr", freeAddr(t), "--node-name", "narrow", "--join", g1,
		"--max-model-len", "64", "--max-tokens-cap", "10", "--max-waiting", "2"}, common...)...)
	emb := startNode(t, append([]string{"--gossip-addr", freeAddr(t), "--node-name", "emb", "--join", g1,
		"--model-name", "vectors", "--embeddings", "--pooling", "mean"}, common...)...)
	waitAlive(t, narrow, 3)
	long := strings.Repeat("the cat sat on the mat. ", 20) // about 150 tokens
	for _, n := range []*node{wide, narrow} {
		for _, body := range []string{
			`{"model":"small","prompt":"` + long + `","max_tokens":2}`,
			`{"model":"small","prompt":"hi","max_tokens":40}`,
			`{"model":"small","prompt":"hi","max_tokens":2,"n":4}`,
		} {
			resp, text := post(t, n.url+"/v1/completions", body)
			if resp.StatusCode != 200 || cmp.Or(resp.Header.Get("X-Shoal-Served-By"), n.url) == narrow.url {
				t.Fatalf("sent to %s, it fits only wide: %d %s (served by %q)", n.url, resp.StatusCode, text, resp.Header.Get("X-Shoal-Served-By"))
			}
		}
		resp, text := post(t, n.url+"/v1/completions", `{"model":"small","prompt":"`+strings.Repeat(long, 4)+`","max_tokens":2}`)
		if resp.StatusCode != 400 || !strings.Contains(text, "maximum context length is 512 tokens") {
			t.Fatalf("too long for every node, sent to %s: %d %s", n.url, resp.StatusCode, text)
		}
		if m := modelList(n); !strings.Contains(m, `"id":"small","object":"model","created"`) || !strings.Contains(m, `"max_model_len":512`) || strings.Contains(m, `"max_model_len":64`) {
			t.Fatalf("/v1/models at %s: %s", n.url, m)
		}
		resp, text = post(t, n.url+"/v1/completions", `{"model":"vectors","prompt":"hi"}`)
		if resp.StatusCode != 400 || !strings.Contains(text, "embedding model") {
			t.Fatalf("an embedding model asked to generate at %s: %d %s", n.url, resp.StatusCode, text)
		}
	}
	if resp, text := post(t, emb.url+"/v1/embeddings", `{"model":"small","input":"hi"}`); resp.StatusCode != 400 || !strings.Contains(text, "generation model") {
		t.Fatalf("a generation model asked for embeddings: %d %s", resp.StatusCode, text)
	}
	// A node that does not serve the model routes by max_tokens and n.
	for _, c := range [][2]string{
		{"/v1/completions", `{"model":"small","prompt":"hi","max_tokens":40}`},
		{"/v1/completions", `{"model":"small","prompt":"hi","max_tokens":2,"n":4}`},
		{"/v1/chat/completions", `{"model":"small","messages":[{"role":"user","content":"hi"}],"max_completion_tokens":40}`},
		{"/v1/responses", `{"model":"small","input":"hi","max_output_tokens":40}`},
		{"/v1/messages", `{"model":"small","messages":[{"role":"user","content":"hi"}],"max_tokens":40}`},
	} {
		path, body := c[0], c[1]
		for range 3 {
			if resp, text := post(t, emb.url+path, body); resp.StatusCode != 200 || resp.Header.Get("X-Shoal-Served-By") != "wide" {
				t.Fatalf("sent to the embedding node, it fits only wide: %d %s (served by %q)", resp.StatusCode, text, resp.Header.Get("X-Shoal-Served-By"))
			}
		}
	}
}

// waitAlive waits until n sees count members alive with a load report.
func waitAlive(t *testing.T, n *node, count int) {
	t.Helper()
	waitFor(t, fmt.Sprintf("%d members alive at %s", count, n.url), func() bool {
		alive := 0
		for _, m := range clusterMembers(t, n) {
			if m.State == "alive" && m.Load.Seq > 0 {
				alive++
			}
		}
		return alive == count
	})
}

// servedBy posts bodies to url at once and counts the nodes that answered them
// (self, the node at url, when no other did); each answer must be a 200 that
// holds want.
func servedBy(t *testing.T, url, self string, bodies []string, want string) map[string]int {
	t.Helper()
	var mu sync.Mutex
	served := map[string]int{}
	var wg sync.WaitGroup
	for _, body := range bodies {
		wg.Go(func() {
			resp, text := post(t, url, body)
			if resp.StatusCode != 200 || !strings.Contains(text, want) {
				t.Errorf("%d %s", resp.StatusCode, text)
				return
			}
			mu.Lock()
			served[cmp.Or(resp.Header.Get("X-Shoal-Served-By"), self)]++
			mu.Unlock()
		})
	}
	wg.Wait()
	t.Logf("served by: %v", served)
	return served
}
