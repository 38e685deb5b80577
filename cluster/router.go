package cluster

import (
	"cmp"
	"errors"
	"fmt"
	"math/rand/v2"
	"slices"
	"time"

	"github.com/shoal-ai/shoal/kvcache"
)

// Policy names a routing policy.
type Policy string

// Policies, from plain load balancing to inference-aware routing.
const (
	Random      Policy = "random"
	RoundRobin  Policy = "round-robin"
	LeastLoaded Policy = "least-loaded" // power of two choices on queue + running + in flight
	PrefixAware Policy = "prefix-aware" // estimated time to first token: queue, uncached prefill, hop
	PrefixOnly  Policy = "prefix-only"  // longest cached prefix, no load term (for comparison)
)

// ParsePolicy validates a policy name.
func ParsePolicy(s string) (Policy, error) {
	switch p := Policy(s); p {
	case Random, RoundRobin, LeastLoaded, PrefixAware, PrefixOnly:
		return p, nil
	}
	return "", fmt.Errorf("cluster: route policy %q: want random, round-robin, least-loaded, prefix-aware or prefix-only", s)
}

// ErrSaturated means every node that serves the model is saturated: answer 429.
var ErrSaturated = errors.New("cluster: every node serving the model is saturated")

// ErrNoNode means no alive node serves the model.
var ErrNoNode = errors.New("cluster: no node serves the model")

// Target is a routing candidate.
type Target struct {
	Name  string
	HTTP  string
	TLS   bool
	Local bool
	// EstimateMS is the estimated time to first token there (prefix-aware), for logs.
	EstimateMS float64
	Cached     int // prompt tokens its summary says it holds
}

// minPrefillTPS keeps the estimate finite for a node that has not prefilled yet.
const minPrefillTPS = 100

// Route picks nodes for a request: the best first, then the next best for retries.
// tokens may be nil when this node cannot tokenize for the model (served elsewhere
// only); then routing is by load. priority > 0 may go to a saturated node.
func (n *Node) Route(model string, tokens []int32, priority int) ([]Target, error) {
	var hashes []kvcache.Hash
	if tokens != nil && (n.cfg.Policy == PrefixAware || n.cfg.Policy == PrefixOnly) {
		hashes = kvcache.NewHasher(n.cfg.HashSeed, model).Chain(tokens, n.cfg.BlockTokens)
	}
	states := n.liveStates()
	n.mu.Lock()
	defer n.mu.Unlock()
	type cand struct {
		p      *peer
		est    float64
		load   float64
		cached int
	}
	var cands []cand
	anyServes := false
	rate := n.clusterPrefillRate(model)
	for _, p := range n.peers {
		self := p.name == n.cfg.Name
		if !p.metaOK || !slices.Contains(p.meta.Models, model) {
			continue
		}
		st := p.state
		if s, ok := states[p.name]; ok {
			st = s // memberlist's view refines ours (suspect)
		}
		if !self && st != "alive" {
			continue
		}
		if p.meta.Draining {
			continue
		}
		anyServes = true
		if n.saturated(p) && priority <= 0 {
			continue
		}
		c := cand{p: p}
		capacity := max(p.meta.Capacity, 1)
		c.load = float64(p.load.Waiting+p.load.Running+p.inflight) / float64(capacity)
		matched := 0
		for _, h := range hashes {
			if _, ok := p.summary[h]; !ok {
				break
			}
			matched++
		}
		c.cached = matched * n.cfg.BlockTokens
		// Time to first token there, in prefill work ahead of this request: what it
		// still has to prefill, what this router just sent it, and this request's own
		// uncached tokens, at the cluster's prefill rate (nodes of one model are alike;
		// one node's own smoothed rate is too noisy to compare nodes by).
		work := p.load.PendingTokens + p.inflightTokens + len(tokens) - c.cached
		c.est = float64(work) / rate * 1000
		if !self {
			c.est += float64(n.cfg.HopCost.Milliseconds())
		}
		cands = append(cands, c)
	}
	if len(cands) == 0 {
		if anyServes {
			return nil, ErrSaturated
		}
		return nil, ErrNoNode
	}
	byName := func(a, b cand) int { return cmp.Compare(a.p.name, b.p.name) }
	slices.SortFunc(cands, byName)
	switch n.cfg.Policy {
	case Random:
		rand.Shuffle(len(cands), func(i, j int) { cands[i], cands[j] = cands[j], cands[i] })
	case RoundRobin:
		k := int(n.rr.Add(1)-1) % len(cands)
		cands = append(cands[k:], cands[:k]...)
	case LeastLoaded:
		// Power of two choices: two random candidates, the less loaded first; the
		// rest by load for retries.
		rand.Shuffle(len(cands), func(i, j int) { cands[i], cands[j] = cands[j], cands[i] })
		if len(cands) >= 2 && cands[1].load < cands[0].load {
			cands[0], cands[1] = cands[1], cands[0]
		}
		if len(cands) > 2 {
			slices.SortStableFunc(cands[1:], func(a, b cand) int { return cmp.Compare(a.load, b.load) })
		}
	case PrefixAware:
		slices.SortStableFunc(cands, func(a, b cand) int { return cmp.Or(cmp.Compare(a.est, b.est), cmp.Compare(a.load, b.load)) })
	case PrefixOnly:
		rand.Shuffle(len(cands), func(i, j int) { cands[i], cands[j] = cands[j], cands[i] })
		slices.SortStableFunc(cands, func(a, b cand) int { return cmp.Compare(b.cached, a.cached) })
	}
	out := make([]Target, len(cands))
	for i, c := range cands {
		out[i] = Target{Name: c.p.name, HTTP: c.p.meta.HTTP, TLS: c.p.meta.TLS, Local: c.p.name == n.cfg.Name, EstimateMS: c.est, Cached: c.cached}
	}
	return out, nil
}

// clusterPrefillRate is the median prefill rate (tokens/s) gossiped by the nodes
// serving model, or a conservative default before any has measured one.
func (n *Node) clusterPrefillRate(model string) float64 {
	var rates []float64
	for _, p := range n.peers {
		if p.metaOK && slices.Contains(p.meta.Models, model) && p.load.PrefillTPS > 0 {
			rates = append(rates, p.load.PrefillTPS)
		}
	}
	if len(rates) == 0 {
		return defaultPrefillTPS
	}
	slices.Sort(rates)
	return max(rates[len(rates)/2], minPrefillTPS)
}

// defaultPrefillTPS stands in until a node has measured its prefill rate.
const defaultPrefillTPS = 1000

// saturated: the node's queue is nearly full or its estimated wait too long.
func (n *Node) saturated(p *peer) bool {
	l := p.load
	if l.MaxWaiting > 0 && l.Waiting+p.inflight >= l.MaxWaiting {
		return true
	}
	return n.cfg.MaxQueueWait > 0 && time.Duration(l.QueueWaitMS*float64(time.Millisecond)) > n.cfg.MaxQueueWait
}

// Sent records a request routed to target t; call the returned func when it ends.
// Until then the router counts it (and the prefill it will cost there: its uncached
// tokens) against that node, so that gossip that has not yet seen it cannot send a
// herd there, while requests that hit the node's cache weigh little.
func (n *Node) Sent(t Target, promptTokens int) func() {
	cost := max(promptTokens-t.Cached, 0)
	n.mu.Lock()
	if p := n.peers[t.Name]; p != nil {
		p.inflight++
		p.inflightTokens += cost
	}
	n.mu.Unlock()
	return func() {
		n.mu.Lock()
		if p := n.peers[t.Name]; p != nil && p.inflight > 0 {
			p.inflight--
			p.inflightTokens = max(p.inflightTokens-cost, 0)
		}
		n.mu.Unlock()
	}
}
