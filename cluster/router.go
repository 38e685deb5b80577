package cluster

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"hash/fnv"
	"log/slog"
	"math"
	"math/rand/v2"
	"slices"
	"strings"
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

// Need is what a request asks of the node that runs it: in a cluster of
// unlike nodes (--max-model-len, --max-tokens-cap, --max-waiting), only nodes
// that can give it are candidates. The zero Need fits every node.
type Need struct {
	// Length is the request's longest sequence, its prompt plus the output it
	// asks for (0: unknown).
	Length int
	// Seqs is how many sequences it queues together (prompts × n).
	Seqs int
	// MaxTokens is the output it asks for (max_tokens; 0: none given).
	MaxTokens int
}

// misfit counts the limits of m and l that need exceeds, and how far: 0 when
// it fits.
func (need Need) misfit(m *Meta, l *Load) (limits, over int) {
	for _, c := range [][2]int{{need.Length, m.MaxModelLen}, {need.MaxTokens, m.MaxTokensCap}, {need.Seqs, l.MaxWaiting}} {
		if c[1] > 0 && c[0] > c[1] {
			limits, over = limits+1, over+c[0]-c[1]
		}
	}
	return limits, over
}

// ErrDraining means the nodes that serve the model are all draining (a rolling
// restart): the model is served again soon, answer 503.
var ErrDraining = errors.New("cluster: every node serving the model is draining")

// ErrUnavailable means no alive node serves the model, but a member that did
// has left or died and is still listed (a restart, a failure): answer 503.
var ErrUnavailable = errors.New("cluster: no node serving the model is up")

// Target is a routing candidate.
type Target struct {
	Name  string
	HTTP  string
	TLS   bool
	Local bool
	// EstimateMS is the estimated time to first token there (prefix-aware), for logs.
	EstimateMS float64
	Cached     int // prompt tokens its summary says it holds

	hashes  []kvcache.Hash // the prompt's block hashes (prefix policies), for Sent
	compute int            // prompt tokens not in its summary: the prefill it costs there
	more    int            // sequences the request runs besides its routed prompt's
	moreTok int            // their prompt tokens, all to compute
}

// With returns t for a request that runs seqs sequences besides the prompt it
// was routed by, with tokens prompt tokens among them to compute (the other
// inputs of a batch, the other prompts of a completion request): Sent counts
// them all against t until its load shows them.
func (t Target) With(seqs, tokens int) Target {
	t.more, t.moreTok = max(seqs, 0), max(tokens, 0)
	return t
}

// minPrefillTPS keeps the estimate finite for a node that has not prefilled yet.
const minPrefillTPS = 100

// Route picks nodes for a request: the best first, then the next best for retries.
// tokens may be nil when this node cannot tokenize for the model (served elsewhere
// only); then routing is by load. An urgent request (priority < 0: lower runs first,
// as in vLLM) may go to a saturated node.
func (n *Node) Route(model string, tokens []int32, priority int) ([]Target, error) {
	return n.route(TaskGenerate, model, tokens, Need{}, priority, true)
}

// RouteTask is Route (reuse) or RouteUncached (!reuse) for a request of task
// that needs need: only nodes that serve model for it (Meta.Task) and whose
// limits it fits are candidates. When it fits none (and none draining), the
// one target is the node it misses least by (fewest limits, then least over
// them), whose own refusal names its limits.
func (n *Node) RouteTask(task, model string, tokens []int32, need Need, priority int, reuse bool) ([]Target, error) {
	return n.route(task, model, tokens, need, priority, reuse)
}

// RouteUncached is Route for a request that computes its whole prompt wherever
// it runs (one whose prompt is scored reads nothing from the prefix cache):
// nodes are compared by load and the whole prompt's prefill, not by what they
// hold of it.
func (n *Node) RouteUncached(model string, tokens []int32, priority int) ([]Target, error) {
	return n.route(TaskGenerate, model, tokens, Need{}, priority, false)
}

func (n *Node) route(task, model string, tokens []int32, need Need, priority int, reuse bool) ([]Target, error) {
	// The prompt's blocks as a node holds them: hashed under its model's own
	// id, so under the first of its models where model is its alias
	// (Meta.Aliases). Under model itself before the lock (the common case).
	placeable := reuse && tokens != nil && (n.cfg.Policy == PrefixAware || n.cfg.Policy == PrefixOnly)
	byID := map[string][]kvcache.Hash{}
	if placeable {
		byID[model] = kvcache.NewHasher(n.cfg.HashSeed, model).Chain(tokens, n.cfg.BlockTokens)
	}
	hashesAt := func(p *peer) []kvcache.Hash {
		id := model
		if !slices.Contains(p.meta.Models, model) && len(p.meta.Models) > 0 {
			id = p.meta.Models[0]
		}
		h, ok := byID[id]
		if !ok && placeable {
			h = kvcache.NewHasher(n.cfg.HashSeed, id).Chain(tokens, n.cfg.BlockTokens)
			byID[id] = h
		}
		return h
	}
	n.routed.Add(1)
	n.mu.Lock()
	defer n.mu.Unlock()
	var cands []candidate
	anyServes := false
	rate := n.clusterPrefillRate(model)
	others := n.othersPerOwn()
	now, overdue := time.Now(), n.loadOverdue()
	// Members that serve the model but are suspect (a load report late, a
	// recent failed hop) are candidates only when no other serves it: one whose
	// load is late because its machine is busy still answers, and a request
	// tried there gets its answer or a 502, not a 404 saying nobody serves it.
	// gone: a member that served it has left or died and is still listed (a
	// restart, a failure): the model is not unknown, only unavailable now;
	// goneFits: one whose limits the request fits.
	suspects, draining, gone, goneFits := false, false, false, false
	var closest *peer // of the nodes that serve the model, the one need misses least by
	closestBy := [2]int{math.MaxInt, math.MaxInt}
	for pass := 0; pass < 2 && (pass == 0 || suspects && !anyServes); pass++ {
		for _, p := range n.peers {
			self := p.name == n.cfg.Name
			if !p.metaOK || !p.meta.serves(model) || !p.meta.does(task) {
				continue
			}
			if !self && p.state != "alive" {
				limits, _ := need.misfit(&p.meta, &p.load)
				gone, goneFits = true, goneFits || limits == 0
				continue
			}
			if suspect := !self && n.status(p, now, overdue) != "alive"; suspect != (pass == 1) {
				suspects = suspects || suspect
				continue
			}
			limits, over := need.misfit(&p.meta, &p.load)
			if p.meta.Draining {
				draining = draining || limits == 0 // served again soon, if it fits
				continue
			}
			if limits > 0 {
				if by := [2]int{limits, over}; slices.Compare(by[:], closestBy[:]) < 0 || by == closestBy && p.name < closest.name {
					closest, closestBy = p, by
				}
				continue
			}
			anyServes = true
			reqs, reqTokens := p.unreflected()
			if n.saturated(p, reqs) && priority >= 0 {
				continue
			}
			c := candidate{p: p, hashes: hashesAt(p)}
			// What this router sent that the node's load does not show yet, and as much
			// again from each router like it: the others send there too, unseen here.
			reqs, reqTokens = int(float64(reqs)*others+0.5), int(float64(reqTokens)*others+0.5)
			capacity := max(p.meta.Capacity, 1)
			c.active = p.load.Running + p.load.Waiting + reqs
			c.load = float64(c.active) / float64(capacity)
			// Blocks its summary shows, then blocks this router just sent there with
			// another request: those count as cached for the choice (the next request
			// of a burst should follow the first), but not for the work this request
			// adds there (arriving before they are computed, it computes them too).
			held, matched := 0, 0
			for _, h := range c.hashes {
				ok := p.summary.has(h)
				if !ok && !p.sending(h, now) {
					break
				}
				if ok && held == matched {
					held++
				}
				matched++
			}
			c.cached = matched * n.cfg.BlockTokens
			c.compute = max(len(tokens)-held*n.cfg.BlockTokens, 0)
			c.uncached = max(len(tokens)-c.cached, 0)
			// Time to first token there: the wait before it starts — the prefill work
			// ahead of it (what the node still has to prefill, and what this router sent
			// it that its load does not show yet) or, when its running slots are all
			// taken, the finishes that must free one, whichever is longer — then this
			// request's own uncached tokens, at the cluster's prefill rate (nodes of one
			// model are alike; one node's own smoothed rate is too noisy to compare
			// nodes by); plus one step of its running batch, which the request's prefill
			// shares; plus the hop. Without the slot term a node that holds a hot prefix
			// looks cheap however long its queue: its queued requests are cache hits.
			c.est = float64(p.load.PendingTokens+reqTokens) / rate * 1000
			if need := c.active + 1 - capacity; need > 0 && p.load.FinishPS > 0 {
				c.est = max(c.est, float64(need)/p.load.FinishPS*1000)
			}
			c.idle = c.est == 0 && c.active < capacity
			c.est += float64(c.uncached) / rate * 1000
			if p.load.DecodeTPS > 0 {
				c.est += float64(p.load.Running+reqs) / p.load.DecodeTPS * 1000
			}
			if !self {
				c.est += float64(n.cfg.HopCost.Milliseconds())
			}
			cands = append(cands, c)
		}
	}
	if len(cands) == 0 {
		switch {
		case anyServes:
			return nil, ErrSaturated
		case draining:
			return nil, ErrDraining
		case goneFits:
			return nil, ErrUnavailable // back soon, and it fits there
		case closest != nil:
			// Too long, too many sequences or too much output for every node:
			// the closest says so, under its limits.
			return []Target{{Name: closest.name, HTTP: closest.meta.HTTP, TLS: closest.meta.TLS, Local: closest.name == n.cfg.Name}}, nil
		case gone:
			return nil, ErrUnavailable
		}
		return nil, ErrNoNode
	}
	slices.SortFunc(cands, byName)
	// What the policies below place the prompt by: its blocks under model,
	// else (served only under an alias) as the first candidate by name holds
	// them, which every router with the same view picks alike.
	hashes := cands[0].hashes
	if i := slices.IndexFunc(cands, func(c candidate) bool { return slices.Contains(c.p.meta.Models, model) }); i >= 0 {
		hashes = cands[i].hashes
	}
	how, headLog := string(n.cfg.Policy), 0 // for the debug log
	switch n.cfg.Policy {
	case Random:
		rand.Shuffle(len(cands), func(i, j int) { cands[i], cands[j] = cands[j], cands[i] })
	case RoundRobin:
		k := n.nextTurn() % len(cands)
		cands = append(cands[k:], cands[:k]...)
	case LeastLoaded:
		// Power of two choices: two random candidates, the less loaded first; the
		// rest by load for retries.
		rand.Shuffle(len(cands), func(i, j int) { cands[i], cands[j] = cands[j], cands[i] })
		if len(cands) >= 2 && cands[1].load < cands[0].load {
			cands[0], cands[1] = cands[1], cands[0]
		}
		if len(cands) > 2 {
			slices.SortStableFunc(cands[1:], func(a, b candidate) int { return cmp.Compare(a.load, b.load) })
		}
	case PrefixAware:
		// Whose turn it is (cands is by name here), for the rules that take turns;
		// every prompt takes a turn, whichever rule places it.
		turn := cands[n.nextTurn()%len(cands)].p
		missCost(cands, rate)
		slices.SortStableFunc(cands, func(a, b candidate) int { return cmp.Or(cmp.Compare(a.score, b.score), cmp.Compare(a.load, b.load)) })
		if len(hashes) == 0 {
			// Nothing to place by (a prompt shorter than a block, or a request
			// for a model served elsewhere): in turn among the best scored, or
			// every router with the same view would pick the same node.
			how = "no-blocks"
			rotate(cands, turn)
			break
		}
		// What every candidate holds alike, or most prompts here start with (a
		// chat template, a common system prompt, a hot document), says nothing
		// about where this prompt belongs: the choice is made on what lies beyond
		// it, and so does a difference in holding it (a node that has evicted
		// the system prompt makes the others hold more of every prompt, and a hot
		// document placed on some nodes and not yet on others would draw its
		// whole traffic to them). A prompt that is mostly such a head is a hot
		// prefix: spread it in turn, as round robin does, unless some node holds
		// more than the head (a conversation on the hot document) or a node that
		// holds more of it than others can start it at once (nothing to balance
		// yet: a cache hit, answered soonest).
		held := commonHead(cands)
		learned, known := n.recentPrompts(model).head(hashes)
		head := max(held, learned*n.cfg.BlockTokens)
		beyond := slices.ContainsFunc(cands, func(c candidate) bool { return c.cached > head })
		hot := head > 0 && 2*head >= len(tokens)
		// How often the prompts this router routes share something beyond the
		// head with what the cluster holds: the base rate for whether a prompt
		// nobody holds yet will be shared by the ones after it. A prompt counts
		// for less the sooner it follows the one before: a router learns where
		// the others sent a new prefix only from the node's cache summary, a
		// prefill and a load interval later, so a burst of new prompts (a cold
		// cluster's first second) says nothing yet about whether they are shared.
		w := min(now.Sub(n.reuseAt).Seconds()/n.cfg.LoadInterval.Seconds(), 1) / reuseWindow
		n.reuse += w * (b2f(beyond || hot) - n.reuse)
		n.reuseAt = now
		// The affinity key names the prompt's first blocks beyond the head: the
		// document behind a shared system prompt, not the system prompt.
		depth := head/n.cfg.BlockTokens + affinityBlocks
		key := hashes[min(len(hashes), depth)-1]
		switch {
		case beyond:
			how = "held"
			preferAffine(cands, key)
		case hot && slices.ContainsFunc(cands, func(c candidate) bool { return c.idle && c.cached > held }):
			how = "hot-idle"
			preferAffine(cands, key)
		case hot:
			how = "hot"
			rotate(cands, turn)
		case n.reuse >= reuseRotateBelow && known:
			// (A router's first prompt goes in turn: it cannot tell yet whether a
			// system prompt or a hot document leads its prompts.)
			how = "new-affine"
			preferAffine(cands, key)
		default:
			// Held nowhere beyond the common head, and prompts here rarely share
			// more: nothing to keep together, so spread in turn (affinity would
			// spread by a hash of the prompt, i.e. at random, and random
			// placement queues more).
			how = "new-turn"
			rotate(cands, turn)
		}
		headLog = head
	case PrefixOnly:
		rand.Shuffle(len(cands), func(i, j int) { cands[i], cands[j] = cands[j], cands[i] })
		slices.SortStableFunc(cands, func(a, b candidate) int { return cmp.Compare(b.cached, a.cached) })
	}
	if n.log.Enabled(context.Background(), slog.LevelDebug) {
		n.logRoute(cands, len(tokens), rate, others, how, headLog)
	}
	out := make([]Target, len(cands))
	for i, c := range cands {
		out[i] = Target{Name: c.p.name, HTTP: c.p.meta.HTTP, TLS: c.p.meta.TLS, Local: c.p.name == n.cfg.Name, EstimateMS: c.est, Cached: c.cached, hashes: c.hashes, compute: c.compute}
	}
	return out, nil
}

// logRoute writes one routing decision with each candidate's terms, best first (at
// debug level: for finding out why the router chose what it chose).
func (n *Node) logRoute(cands []candidate, tokens int, rate, others float64, how string, head int) {
	var b strings.Builder
	for _, c := range cands {
		fmt.Fprintf(&b, "%s:est=%.0f,score=%.0f,cached=%d,active=%d,run=%d,wait=%d,pend=%d,fps=%.1f,seq=%d ",
			c.p.name, c.est, c.score, c.cached, c.active, c.p.load.Running, c.p.load.Waiting, c.p.load.PendingTokens, c.p.load.FinishPS, c.p.load.Seq)
	}
	n.log.Debug("route", "how", how, "tokens", tokens, "head", head, "rate", int(rate), "others", others, "reuse", n.reuse, "cands", b.String())
}

// byName orders candidates by node name.
func byName(a, b candidate) int { return cmp.Compare(a.p.name, b.p.name) }

// candidate is a node that may take a request, with what routing knows of it.
type candidate struct {
	p        *peer
	est      float64 // estimated time to first token there, ms
	score    float64 // est plus the cost of a miss to others (prefix-aware)
	load     float64
	active   int // requests running or waiting there, counting ours it cannot show yet
	compute  int // prompt tokens it may compute there: all its summary does not show
	uncached int
	cached   int
	idle     bool           // it can start the request at once: a free slot and no prefill ahead
	hashes   []kvcache.Hash // the prompt's blocks as it holds them (under its model's id)
}

// missCost adds to each candidate's estimate what sending the request there costs the
// other requests: prefill that the best-cached candidate would not need (its extra
// uncached tokens) runs in the same steps as every request in progress there, and
// delays each of them (running and queued alike) by its duration. On an idle node the
// term is nothing and time to first token alone decides; on a busy one a miss weighs
// as many times as the requests it holds up, which keeps prefixes where they are
// cached once the cluster is loaded and prefill is what limits throughput. A hot
// prefix still spreads: an idle node takes a miss for free, and from then on both are
// equally cached.
func missCost(cands []candidate, rate float64) {
	minUncached := math.MaxInt
	for _, c := range cands {
		minUncached = min(minUncached, c.uncached)
	}
	for i := range cands {
		c := &cands[i]
		c.score = c.est + float64(c.active)*float64(c.uncached-minUncached)/rate*1000
	}
}

// affinityBlocks is how much of a prompt (in blocks) names its affinity key: enough
// to tell documents and system prompts apart, little enough that the requests of a
// group share it.
const affinityBlocks = 4

// affinitySlack is how much longer (relative, plus a constant) an estimate may be
// than the best one and still be taken for the sake of affinity.
const (
	affinitySlackRel = 0.1
	affinitySlackMS  = 10
)

// preferAffine moves to the front, among the candidates whose score is within the
// slack of the best and that hold the most of the prompt among those, the one that
// rendezvous hashing of key ranks highest (a prefix that went elsewhere than its key
// points, in turn or for load, stays where it is while that costs little). Every
// router ranks alike, so a prefix that nobody holds yet goes to the same node from
// every router (no copies from a burst of first requests), and a prefix held in
// several places concentrates on one while it can take the load, so its other
// copies age out and free their KV for other prefixes. Load still wins beyond the
// slack: that is bounded-load consistent hashing, with time to first token as the
// load. cands is sorted by score.
func preferAffine(cands []candidate, key kvcache.Hash) {
	limit := cands[0].score*(1+affinitySlackRel) + affinitySlackMS
	most := 0 // within the slack, the most of the prompt one holds: ties go among those
	for _, c := range cands {
		if c.score > limit {
			break
		}
		most = max(most, c.cached)
	}
	best, bestW := -1, uint64(0)
	for i, c := range cands {
		if c.score > limit {
			break
		}
		if c.cached < most {
			continue
		}
		if w := rendezvous(key, c.p.name); best < 0 || w > bestW {
			best, bestW = i, w
		}
	}
	if best > 0 {
		c := cands[best]
		copy(cands[1:best+1], cands[:best])
		cands[0] = c
	}
}

// rotate moves turn, the node whose turn it is among the candidates by name, to the
// front: round robin among the candidates (saturated nodes are already filtered
// out). For a prompt where nothing is to be gained from one node over another (a
// prefix every node holds, or one none does and none will want) that beats taking
// the best-scored node: routers that all act on the same load, gossiped up to an
// interval ago, send their requests in bursts to whichever node looked best, and
// near capacity the queues those bursts leave do not drain; round robin's even
// spacing forms none. Passing over nodes that stand out does not help either: every
// router sees the same node's estimate jump (a whole prompt's prefill, or a slot
// queue) in the same gossip and passes it over at once, which idles it while the
// rest take its share. Measured at round robin's saturation: no-reuse 0.90× round
// robin's throughput passing over nodes above twice the median score (+100 ms),
// 0.97× above 4× (+500 ms), 0.98× passing over none; hot-prefix TTFT p99 1.3-2×
// round robin's passing over nodes above twice the median, 1.17× at 1.0× (the
// ranges of repeated runs overlap) and 0.90× at 1.2× passing over none.
func rotate(cands []candidate, turn *peer) {
	i := slices.IndexFunc(cands, func(x candidate) bool { return x.p == turn })
	c := cands[i]
	copy(cands[1:i+1], cands[:i])
	cands[0] = c
}

// nextTurn returns this router's turn for the prompt it routes: its own place among
// the members by name plus the prompts it has routed. Routers fed in turn (a load
// balancer, a client that spreads its requests over the nodes) then interleave into
// one round robin over the nodes, where counters that start anywhere collide: two
// routers whose turns coincide send consecutive requests to one node, forever.
// Measured on no-reuse at round robin's saturation rate: 0.92-0.93× its throughput
// with turns from a hash of the name, 0.98-1.00× from the place. Caller holds n.mu.
func (n *Node) nextTurn() int {
	own := 0
	for name, p := range n.peers {
		if p.state == "alive" && name < n.cfg.Name {
			own++
		}
	}
	n.turns++
	return own + n.turns - 1
}

// reuseWindow is about how many routed prompts (or load intervals, when prompts
// come faster) the reuse rate remembers, and reuseRotateBelow the rate under which
// prompts that nobody holds are spread in turn rather than by affinity. Affinity
// sends a new prefix to the same node from every router at once (rotating every new
// prompt instead left a copy of each new shared prefix on several nodes: measured,
// a fifth less capacity on shared prefixes); rotation spaces prompts that will not
// be shared evenly. A fresh router starts between the two (reuseStart): a few
// prompts that share nothing, a load interval or more apart, tip it to rotation.
const (
	reuseWindow      = 4
	reuseRotateBelow = 0.25
	reuseStart       = 0.5
)

func b2f(b bool) float64 {
	if b {
		return 1
	}
	return 0
}

// recentPrompts returns the prompts recently routed for model. Caller holds n.mu.
func (n *Node) recentPrompts(model string) *recentPrompts {
	if n.recent == nil {
		n.recent = map[string]*recentPrompts{}
	}
	r := n.recent[model]
	if r == nil {
		r = &recentPrompts{}
		n.recent[model] = r
	}
	return r
}

// recentPrompts keeps the first blocks of the last prompts a router routed, to learn
// the head that most of them share (a system prompt, a hot document) from the
// traffic itself: at a cold start no node holds it yet, and a head counted as the
// prompt's own prefix would send every prompt behind it to the one node it points to.
type recentPrompts struct {
	ring [recentPromptsN][]kvcache.Hash
	next int
	full bool
}

// recentPromptsN is how many prompts the head is learned from, headBlocks how much
// of each is kept, and headQuorum the fewest prompts, this one included, that make a
// shared start a head (besides half of those kept). Two suffice: a hot document's
// second request at a fresh router already goes in turn; a router's first prompts
// of a workload with many shared documents may pair by chance (one copy).
const (
	recentPromptsN = 32
	headBlocks     = 512
	headQuorum     = 2
)

// head is how many of hs's blocks at least half of the recent prompts (and with hs
// at least headQuorum) share; then it records hs. Hashes are chained, so prompts
// that agree on block i agree on every block before it.
func (r *recentPrompts) head(hs []kvcache.Hash) (blocks int, known bool) {
	hs = hs[:min(len(hs), headBlocks)]
	kept := r.next
	if r.full {
		kept = recentPromptsN
	}
	need := max(headQuorum-1, (kept+1)/2) // of those kept; hs is one more
	var common [recentPromptsN]int
	for i := range kept {
		o := r.ring[i]
		k := 0
		for k < min(len(o), len(hs)) && o[k] == hs[k] {
			k++
		}
		common[i] = k
	}
	head := 0
	if kept >= need {
		c := common[:kept]
		slices.Sort(c)
		head = c[kept-need] // need of them share at least this many blocks
	}
	r.ring[r.next] = append(r.ring[r.next][:0], hs...)
	r.next = (r.next + 1) % recentPromptsN
	r.full = r.full || r.next == 0
	return head, kept >= headQuorum-1
}

// commonHead is how many prompt tokens every candidate holds.
func commonHead(cands []candidate) int {
	head := cands[0].cached
	for _, c := range cands[1:] {
		head = min(head, c.cached)
	}
	return head
}

// rendezvous is the weight of node for key in highest-random-weight hashing.
func rendezvous(key kvcache.Hash, node string) uint64 {
	h := fnv.New64a()
	h.Write([]byte(node))
	x := h.Sum64() ^ uint64(key)
	// splitmix64's finaliser spreads the bits.
	x ^= x >> 30
	x *= 0xbf58476d1ce4e5b9
	x ^= x >> 27
	x *= 0x94d049bb133111eb
	return x ^ x>>31
}

// othersPerOwn is how many requests the cluster takes for each one this router
// routes: its nodes' finish rates summed over this router's own routing rate,
// between 1 (the only entry point) and the number of nodes (every node an equal
// entry point, as behind a load balancer). While either is unknown (the first
// second of a burst), the number of nodes: a burst that meets a cluster whose
// gossip has not seen any traffic yet should spread, not pile onto whichever node
// every router ranks first. Caller holds n.mu.
func (n *Node) othersPerOwn() float64 {
	total, nodes := 0.0, 0
	for _, p := range n.peers {
		if p.state == "alive" {
			total += p.load.FinishPS
			nodes++
		}
	}
	if n.routeRate <= 0 || total <= 0 {
		return float64(nodes)
	}
	return min(max(total/n.routeRate, 1), float64(nodes))
}

// clusterPrefillRate is the median prefill rate (tokens/s) gossiped by the nodes
// serving model, or a conservative default before any has measured one.
func (n *Node) clusterPrefillRate(model string) float64 {
	var rates []float64
	for _, p := range n.peers {
		if p.state == "alive" && p.metaOK && p.meta.serves(model) && p.load.PrefillTPS > 0 {
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

// saturated: the node's queue, with the reqs this router sent that its load does not
// show yet (those beyond its free running slots, which they take first; none is
// free while some wait: KV space holds them back), is full, or its estimated
// wait too long.
func (n *Node) saturated(p *peer, reqs int) bool {
	l := p.load
	free := 0
	if l.Waiting == 0 {
		free = max(p.meta.Capacity-l.Running, 0)
	}
	queued := max(reqs-free, 0)
	if l.MaxWaiting > 0 && l.Waiting+queued >= l.MaxWaiting {
		return true
	}
	return n.cfg.MaxQueueWait > 0 && time.Duration(l.QueueWaitMS*float64(time.Millisecond)) > n.cfg.MaxQueueWait
}

// Sent records a request routed to target t; call the returned func when it ends
// (calling it again does nothing). Until the node's gossiped load shows the request,
// the router counts it (and the prefill it costs there: the prompt tokens the node's
// summary does not show) against that node, so that gossip that has not seen it yet
// cannot send a herd there, while requests that hit the node's cache weigh little.
func (n *Node) Sent(t Target) func() {
	f := &flight{cost: t.compute + t.moreTok, seqs: 1 + t.more}
	n.mu.Lock()
	if p := n.peers[t.Name]; p != nil {
		f.seq = p.load.Seq
		p.flights = append(p.flights, f)
		p.willHold(t.hashes, time.Now())
	}
	n.mu.Unlock()
	return func() {
		n.mu.Lock()
		defer n.mu.Unlock()
		if p := n.peers[t.Name]; p != nil {
			if i := slices.Index(p.flights, f); i >= 0 {
				p.flights = slices.Delete(p.flights, i, i+1)
			}
		}
	}
}

// Refused records that the request Sent to t was not taken (the peer could not be
// reached, or refused it): t no longer counts as about to hold its prefix, which
// would steer the next request with that prefix to the same peer. Call it before the
// func Sent returned.
func (n *Node) Refused(t Target) {
	n.mu.Lock()
	defer n.mu.Unlock()
	if p := n.peers[t.Name]; p != nil {
		for _, h := range t.hashes {
			delete(p.sent, h) // its sentOrder entry finds nothing to expire
		}
	}
}

// sentTTL is how long a prefix this router sent to a node counts as held there before
// the node's own summary shows it: long enough for its prefill under load and a
// gossip round.
const sentTTL = 3 * time.Second

// willHold records that p is about to compute (or reuse) hs, so that the next request
// with the same prefix follows the first before gossip has a word to say: without
// this, a burst of requests for a new prefix would each see it nowhere and each
// compute it on a different node. Caller holds n.mu.
func (p *peer) willHold(hs []kvcache.Hash, now time.Time) {
	if p.sent == nil && len(hs) > 0 {
		p.sent = map[kvcache.Hash]time.Time{}
	}
	until := now.Add(sentTTL)
	for _, h := range hs {
		p.sent[h] = until
		p.sentOrder = append(p.sentOrder, sentEntry{h, until})
	}
	// Forget what has expired, oldest first; an entry whose hash was sent again
	// since leaves the newer time in place.
	for len(p.sentOrder) > 0 && !p.sentOrder[0].until.After(now) {
		e := p.sentOrder[0]
		if p.sent[e.h].Equal(e.until) {
			delete(p.sent, e.h)
		}
		p.sentOrder = p.sentOrder[1:]
	}
}

// sentEntry is one hash sent to a peer and when it stops counting.
type sentEntry struct {
	h     kvcache.Hash
	until time.Time
}

// sending reports whether this router sent h to p within sentTTL. Caller holds n.mu.
func (p *peer) sending(h kvcache.Hash, now time.Time) bool {
	t, ok := p.sent[h]
	return ok && t.After(now)
}
