package cluster

import (
	"cmp"
	"errors"
	"fmt"
	"io"
	"log"
	"log/slog"
	"net"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	metrics "github.com/hashicorp/go-metrics"
	"github.com/hashicorp/go-multierror"
	"github.com/hashicorp/memberlist"

	"github.com/shoal-ai/shoal/kvcache"
)

// Defaults for a LAN cluster.
const (
	// DefaultLoadInterval: load goes out a few times a second, so routing decisions
	// see queues that are at most a few hundred milliseconds old.
	DefaultLoadInterval = 250 * time.Millisecond
	// DefaultFanOut is how many peers a node sends its load and cache deltas to,
	// directly, every load interval. In a cluster of up to DefaultFanOut+1 nodes that
	// is every peer; beyond it a rotating subset, which bounds what a node sends (a
	// peer then hears its load every few intervals, and deltas it misses come with
	// push/pull).
	DefaultFanOut = 32
	// DefaultHopCost is the estimated cost of forwarding a request to a peer.
	DefaultHopCost = 2 * time.Millisecond
	// DefaultPushPull exchanges full prefix summaries this often (memberlist's LAN
	// default is 30s; summaries change faster than membership).
	DefaultPushPull = 5 * time.Second
	// DefaultReconnect is how often a node tries again to join what it lost: its
	// --join addresses while none answered, and members that failed (Serf
	// reconnects the same way).
	DefaultReconnect = 5 * time.Second
	// prefixChunk hashes per delta message keeps each under ~1 KB (UDP-safe).
	prefixChunk = 120
)

// Config configures a Node. Only cmd fills it.
type Config struct {
	Name      string   // unique node name; default: the advertised gossip address
	Bind      string   // gossip listen host:port
	Advertise string   // gossip host:port others reach (default: Bind)
	Join      []string // gossip addresses of nodes to join
	// GossipKey encrypts gossip (16, 24 or 32 bytes); a node with another key never joins.
	GossipKey []byte
	// Secret authenticates forwarded requests (HMAC). Required.
	Secret []byte
	Meta   Meta

	Policy       Policy
	LoadInterval time.Duration
	FanOut       int // peers sent load and deltas per interval (see DefaultFanOut)
	PushPull     time.Duration
	Reconnect    time.Duration // see DefaultReconnect
	HopCost      time.Duration
	// MaxQueueWait marks a node saturated when its estimated queue wait exceeds it.
	MaxQueueWait time.Duration
	// BlockTokens and HashSeed must equal the serving nodes' kvcache settings so that
	// prompts hash here exactly as there.
	BlockTokens int
	HashSeed    uint64

	// ProbeInterval, ProbeTimeout, SuspicionMult override memberlist's LAN defaults
	// (zero keeps them); tests shorten them.
	ProbeInterval time.Duration
	ProbeTimeout  time.Duration
	GossipNodes   int

	// metricLabels tags memberlist's own metrics (benchmarks count bytes per node).
	metricLabels map[string]string
}

// DefaultConfig returns the defaults: prefix-aware routing over memberlist's LAN profile.
func DefaultConfig() Config {
	return Config{
		Policy: PrefixAware, LoadInterval: DefaultLoadInterval, PushPull: DefaultPushPull, Reconnect: DefaultReconnect, FanOut: DefaultFanOut,
		HopCost: DefaultHopCost, MaxQueueWait: 30 * time.Second, BlockTokens: kvcache.DefaultBlockTokens,
	}
}

// Validate rejects unusable settings.
func (c Config) Validate() error {
	switch {
	case c.Bind == "":
		return errors.New("cluster: gossip address is empty")
	case c.Meta.HTTP == "":
		return errors.New("cluster: HTTP address to advertise is empty")
	case len(c.Secret) == 0:
		return errors.New("cluster: a cluster secret is required to authenticate forwarded requests (--cluster-secret, or --gossip-key)")
	case len(c.GossipKey) != 0 && len(c.GossipKey) != 16 && len(c.GossipKey) != 24 && len(c.GossipKey) != 32:
		return fmt.Errorf("cluster: gossip key of %d bytes: want 16, 24 or 32", len(c.GossipKey))
	case c.LoadInterval <= 0 || c.PushPull <= 0 || c.Reconnect <= 0:
		return errors.New("cluster: load, push/pull and reconnect intervals must be positive")
	case c.FanOut < 1:
		return errors.New("cluster: fan-out must be at least 1")
	case c.BlockTokens < 1:
		return errors.New("cluster: block tokens must be positive")
	}
	_, err := ParsePolicy(string(c.Policy))
	return err
}

// LocalState supplies this node's own load and prefix summary. Both are called from
// the cluster's goroutines and must be safe for concurrent use (the scheduler's
// snapshots are).
type LocalState interface {
	Load() Load
	Summary() *kvcache.Summary
}

// Node is one member of the cluster.
type Node struct {
	cfg   Config
	local LocalState
	log   *slog.Logger
	ml    *memberlist.Memberlist

	mu    sync.Mutex
	meta  Meta
	peers map[string]*peer

	sentGen    uint64
	sentSet    map[kvcache.Hash]uint64   // also this node's own summary.at
	fanOutNext int                       // owned by loop: where the next rotating fan-out starts
	routed     atomic.Uint64             // Route calls, for routeRate
	routedLast uint64                    // owned by loop: routed at the last publish
	routeRate  float64                   // smoothed Route calls per second (under mu)
	reuse      float64                   // smoothed share of routed prompts some node holds part of (under mu)
	reuseAt    time.Time                 // when reuse was last updated (under mu)
	recent     map[string]*recentPrompts // per model: the last prompts routed (under mu)
	joined     chan string               // members to send the full summary to
	joinAddrs  []string                  // cfg.Join less this node's own address
	joinFailed atomic.Bool               // no joinAddrs answered yet (reconnect tries them again)
	nameTaken  atomic.Pointer[string]    // the address of another live member under this node's name
	loadSeq    atomic.Uint64
	boot       uint64 // this process's Load.Boot
	turns      int    // prompts routed by turn-taking policies, for the next turn (under mu)
	stop       chan struct{}
	stopOnce   sync.Once
	wg         sync.WaitGroup
}

// peer is what this node knows of another (or of itself).
type peer struct {
	name      string
	gossip    string
	state     string    // from memberlist's events: alive, dead or left (see status)
	aliveAt   time.Time // when it (re)joined
	changedAt time.Time // when its state last changed (or, a placeholder, was created)
	failedAt  time.Time // when a forward to it last could not connect
	meta      Meta
	metaOK    bool
	unlike    bool // its blocks were logged as hashed otherwise (Meta.Blocks)
	mixed     bool // logged as simulated where this node is not, or the reverse, under one model id
	named     bool // logged as another model answering to one of this node's ids
	load      Load
	loadAt    time.Time
	summary   summary
	flights   []*flight                  // requests this node routed there that have not finished
	sent      map[kvcache.Hash]time.Time // prefix blocks sent there, until when they count as held
	sentOrder []sentEntry                // the same in the order sent (a hash may repeat)
}

// flight is a request this node routed to a peer, until it ends.
type flight struct {
	cost int    // uncached prompt tokens: prefill it costs the peer
	seqs int    // sequences it runs there (a batch's inputs, n choices)
	seq  uint64 // the peer's load sequence number when it was sent
}

// unreflected counts the sequences of p's flights that its gossiped load cannot
// show yet, and their prefill tokens. A load update shows a request once it was published after the
// request arrived; the second update after sending is (updates go out every
// LoadInterval, and gossip delivers within about one). Counting every flight until it
// ends would count each twice once the peer's load shows it. Caller holds n.mu.
func (p *peer) unreflected() (reqs, tokens int) {
	for _, f := range p.flights {
		if p.load.Seq < f.seq+2 {
			reqs += f.seqs
			tokens += f.cost
		}
	}
	return reqs, tokens
}

// New creates a node; Start joins the cluster.
func New(cfg Config, local LocalState, logger *slog.Logger) (*Node, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	if logger == nil {
		logger = slog.Default()
	}
	if cfg.Advertise == "" {
		cfg.Advertise = cfg.Bind
	}
	if cfg.Name == "" {
		cfg.Name = cfg.Advertise
	}
	if len(cfg.Name) > 200 {
		return nil, errors.New("cluster: node name longer than 200 bytes")
	}
	cfg.Meta.Blocks = blockPrint(cfg.HashSeed, cfg.BlockTokens)
	// As it will be at its largest: a draining node about to leave.
	last := cfg.Meta
	last.Draining, last.Leaving = true, true
	if _, err := encodeMeta(last); err != nil {
		return nil, err
	}
	n := &Node{cfg: cfg, local: local, log: logger, meta: cfg.Meta, peers: map[string]*peer{},
		sentSet: map[kvcache.Hash]uint64{}, stop: make(chan struct{}),
		joined: make(chan string, 256), reuse: reuseStart, boot: uint64(time.Now().UnixNano())}
	return n, nil
}

// Name is this node's name.
func (n *Node) Name() string { return n.cfg.Name }

// Start creates the memberlist, joins the given nodes and starts gossiping load.
func (n *Node) Start() error {
	mc := memberlist.DefaultLANConfig()
	mc.Name = n.cfg.Name
	host, port, err := splitHostPort(n.cfg.Bind)
	if err != nil {
		return fmt.Errorf("cluster: gossip address: %w", err)
	}
	mc.BindAddr, mc.BindPort = host, port
	ahost, aport, err := splitHostPort(n.cfg.Advertise)
	if err != nil {
		return fmt.Errorf("cluster: advertise address: %w", err)
	}
	mc.AdvertiseAddr, mc.AdvertisePort = ahost, aport
	mc.SecretKey = n.cfg.GossipKey
	mc.PushPullInterval = n.cfg.PushPull
	if n.cfg.ProbeInterval > 0 {
		mc.ProbeInterval = n.cfg.ProbeInterval
	}
	if n.cfg.ProbeTimeout > 0 {
		mc.ProbeTimeout = n.cfg.ProbeTimeout
	}
	if n.cfg.GossipNodes > 0 {
		mc.GossipNodes = n.cfg.GossipNodes
	}
	mc.GossipInterval = 100 * time.Millisecond
	mc.Delegate = &delegate{n: n}
	mc.Events = &events{n: n}
	mc.Conflict = &events{n: n}
	mc.Logger = log.New(&slogWriter{n.log}, "", 0)
	for k, v := range n.cfg.metricLabels {
		mc.MetricLabels = append(mc.MetricLabels, metrics.Label{Name: k, Value: v})
	}
	ml, err := memberlist.Create(mc)
	if err != nil {
		return fmt.Errorf("cluster: start gossip on %s: %w", n.cfg.Bind, err)
	}
	n.ml = ml
	n.mu.Lock()
	n.peers[n.cfg.Name] = &peer{name: n.cfg.Name, gossip: n.cfg.Advertise, state: "alive", meta: n.meta, metaOK: true}
	n.mu.Unlock()
	for _, a := range n.cfg.Join {
		if a != n.cfg.Advertise && a != n.cfg.Bind {
			n.joinAddrs = append(n.joinAddrs, a)
		}
	}
	if len(n.joinAddrs) > 0 {
		_, err := ml.Join(n.joinAddrs)
		if err != nil && !unreachableOnly(err) {
			// One answered and refused (another gossip key): misconfigured.
			ml.Shutdown()
			if strings.Contains(err.Error(), "no installed keys could decrypt") {
				return fmt.Errorf("cluster: join %v: a node there gossips with another --gossip-key (every node of a cluster needs the same one): %s", n.joinAddrs, oneLine(err))
			}
			return fmt.Errorf("cluster: join %v: %s", n.joinAddrs, oneLine(err))
		}
		if other := n.nameTaken.Load(); other != nil {
			// The members would take this node's load and summaries for the
			// other's (and memberlist keeps the first): it must not join.
			ml.Shutdown()
			return fmt.Errorf("cluster: the node name %q is taken by the live member at %s: give each node its own --node-name", n.cfg.Name, *other)
		}
		if ml.NumMembers() < 2 {
			// None is up yet (every node may be given the others' addresses and
			// start in any order; an address of its own, under another name,
			// joins only itself): this node starts alone and keeps trying.
			n.joinFailed.Store(true)
			n.log.Warn("could not join any of the given nodes; serving alone and trying again", "join", n.joinAddrs, "every", n.cfg.Reconnect, "err", err)
		}
	}
	n.wg.Add(1)
	go n.loop()
	go n.reconnect() // not waited for, as summaries: memberlist's shutdown ends a join in progress
	go n.summaries()
	return nil
}

// oneLine is err's message on one line: memberlist lists a join's errors one
// per line, with blank lines around them.
func oneLine(err error) string {
	return strings.Join(strings.Fields(err.Error()), " ")
}

// reconnect joins again, every Reconnect interval, what this node lost: the
// --join addresses while none has answered (though others joined this node:
// a node that joined it through its own address alone would make a cluster
// apart), and members that failed or left
// while they are listed (goneLimit). A member that restarts without --join,
// such as a cluster's first node, is found so by the others, instead of
// forming a cluster of its own. One address at a time, each bounded by
// memberlist's TCP timeout, stopping when the node stops.
func (n *Node) reconnect() {
	t := time.NewTicker(n.cfg.Reconnect)
	defer t.Stop()
	for {
		select {
		case <-n.stop:
			return
		case <-t.C:
		}
		var addrs []string
		n.mu.Lock()
		for _, p := range n.peers {
			if p.name != n.cfg.Name && (p.state == "dead" || p.state == "left") && p.gossip != "" && len(addrs) < maxReconnects {
				addrs = append(addrs, p.gossip)
			}
		}
		n.mu.Unlock()
		lost := len(addrs) // members to rejoin; then the --join addresses
		if n.joinFailed.Load() {
			addrs = append(addrs, n.joinAddrs...)
		}
		for i, a := range addrs {
			select {
			case <-n.stop:
				return
			default:
			}
			if _, err := n.ml.Join([]string{a}); err == nil && i >= lost && n.ml.NumMembers() > 1 && n.joinFailed.Swap(false) {
				n.log.Info("joined the cluster", "through", a)
			}
		}
	}
}

// unreachableOnly reports whether err, memberlist's Join error, says only that
// no address could be reached or resolved (nothing listens there yet), not
// that one answered and refused this node (another gossip key).
func unreachableOnly(err error) bool {
	errs := []error{err}
	var me *multierror.Error
	if errors.As(err, &me) {
		errs = me.Errors
	}
	for _, e := range errs {
		if s := e.Error(); !strings.Contains(s, "dial ") && !strings.HasPrefix(s, "failed to resolve") {
			return false
		}
	}
	return len(errs) > 0
}

// maxReconnects bounds the failed members one reconnect round tries (each may
// wait for a connection timeout).
const maxReconnects = 16

func splitHostPort(s string) (string, int, error) {
	h, p, err := net.SplitHostPort(s)
	if err != nil {
		return "", 0, err
	}
	port, err := strconv.Atoi(p)
	if err != nil {
		return "", 0, err
	}
	return h, port, nil
}

// GossipAddr is the bound gossip address (useful with port 0).
func (n *Node) GossipAddr() string {
	ln := n.ml.LocalNode()
	return net.JoinHostPort(ln.Addr.String(), strconv.Itoa(int(ln.Port)))
}

// loop broadcasts load and prefix deltas until Shutdown.
func (n *Node) loop() {
	defer n.wg.Done()
	t := time.NewTicker(n.cfg.LoadInterval)
	defer t.Stop()
	for {
		n.publishLocal()
		select {
		case <-n.stop:
			return
		case <-t.C:
		}
	}
}

// summaries sends this node's full summary to each newcomer, apart from the load
// loop: a TCP send to a member that vanished waits for memberlist's TCP timeout
// (10 s on a LAN), and meanwhile the load must keep going out, or every peer would
// mark this node suspect. Leave does not wait for it: memberlist's shutdown ends a
// send in progress.
func (n *Node) summaries() {
	for {
		select {
		case <-n.stop:
			return
		case name := <-n.joined:
			n.sendSummary(name)
		}
	}
}

// sendSummary sends this node's full summary to one member over TCP.
func (n *Node) sendSummary(name string) {
	sum := n.local.Summary()
	if sum == nil || len(sum.Hashes) == 0 {
		return
	}
	n.mu.Lock()
	p := n.peers[name]
	var to *memberlist.Node
	if p != nil {
		to = p.node()
	}
	n.mu.Unlock()
	if to == nil {
		return
	}
	hs := sum.Hashes
	if len(hs) > maxSummary {
		hs = hs[:maxSummary]
	}
	if err := n.ml.SendReliable(to, encodeHashes(msgPrefix, n.cfg.Name, sum.Generation, hs)); err != nil {
		n.log.Debug("send summary", "peer", name, "err", err)
	}
}

// node is the address memberlist sends p's messages to, from this node's own record
// (the nodes memberlist's Members returns are its live state, which its goroutines
// update while others read them); nil when p has none. Caller holds n.mu.
func (p *peer) node() *memberlist.Node {
	host, port, err := splitHostPort(p.gossip)
	ip := net.ParseIP(host)
	if err != nil || ip == nil {
		return nil
	}
	return &memberlist.Node{Name: p.name, Addr: ip, Port: uint16(port)}
}

// publishLocal refreshes this node's own entry and queues its load and new hashes.
func (n *Node) publishLocal() {
	l := n.local.Load()
	l.Seq, l.Boot = n.loadSeq.Add(1), n.boot
	sum := n.local.Summary()
	routed := n.routed.Load()
	n.mu.Lock()
	// Requests this node routed per second, smoothed over a few intervals.
	inst := float64(routed-n.routedLast) / n.cfg.LoadInterval.Seconds()
	n.routedLast = routed
	n.routeRate += routeRateWeight * (inst - n.routeRate)
	self := n.peers[n.cfg.Name]
	self.load, self.loadAt = l, time.Now()
	n.prune(self.loadAt)
	var added, evicted []kvcache.Hash
	if sum != nil && sum.Generation != n.sentGen {
		now := make(map[kvcache.Hash]uint64, len(sum.Hashes))
		for _, h := range sum.Hashes {
			now[h] = sum.Generation
			if _, ok := n.sentSet[h]; !ok {
				added = append(added, h)
			}
		}
		for h := range n.sentSet {
			if _, ok := now[h]; !ok {
				evicted = append(evicted, h)
			}
		}
		// The full state at sum.Generation, sharing the map (nothing else writes
		// this node's own summary).
		n.sentSet, n.sentGen = now, sum.Generation
		self.summary = summary{at: now, floor: sum.Generation}
	}
	gen := n.sentGen
	n.mu.Unlock()
	msgs := [][]byte{encodeLoad(n.cfg.Name, l)}
	// Evictions go out too: a peer that still believed in evicted blocks would send
	// requests here for a prefix that must be computed again.
	for len(evicted) > 0 {
		k := min(len(evicted), prefixChunk)
		msgs = append(msgs, encodeHashes(msgEvict, n.cfg.Name, gen, evicted[:k]))
		evicted = evicted[k:]
	}
	for len(added) > 0 {
		k := min(len(added), prefixChunk)
		msgs = append(msgs, encodeHashes(msgPrefix, n.cfg.Name, gen, added[:k]))
		added = added[k:]
	}
	// Straight to the peers, not through memberlist's gossip queue: user messages
	// are not relayed by those who receive them, and the queue sends each one only
	// a few times (3·log10 n), so in a cluster of 8 a delta reached at most 3 of
	// the 7 peers and the rest routed on a summary that lacked it until push/pull
	// paired them — for ~17 s on average.
	for _, m := range n.fanOutTargets() {
		for _, b := range msgs {
			if err := n.ml.SendBestEffort(m, b); err != nil {
				n.log.Debug("send load", "peer", m.Name, "err", err)
			}
		}
	}
}

// routeRateWeight is the weight of each load interval's routing rate in its
// smoothed value (with 250 ms intervals, about a second of memory).
const routeRateWeight = 0.25

// fanOutTargets is the peers to send this interval's load and deltas to: all alive
// members but this one, or, beyond FanOut of them, the next FanOut in turn.
func (n *Node) fanOutTargets() []*memberlist.Node {
	n.mu.Lock()
	var peers []*memberlist.Node
	for _, p := range n.peers {
		if p.name == n.cfg.Name || p.state != "alive" {
			continue
		}
		if m := p.node(); m != nil {
			peers = append(peers, m)
		}
	}
	n.mu.Unlock()
	if len(peers) <= n.cfg.FanOut {
		return peers
	}
	slices.SortFunc(peers, func(a, b *memberlist.Node) int { return cmp.Compare(a.Name, b.Name) })
	start := n.fanOutNext % len(peers)
	n.fanOutNext += n.cfg.FanOut
	return append(peers[start:], peers[:start]...)[:n.cfg.FanOut]
}

// SetDraining marks this node draining in its metadata: peers stop routing to it.
func (n *Node) SetDraining(d bool) error {
	n.mu.Lock()
	n.meta.Draining = d
	if self := n.peers[n.cfg.Name]; self != nil {
		self.meta = n.meta
	}
	n.mu.Unlock()
	if n.ml == nil {
		return nil
	}
	return n.ml.UpdateNode(5 * time.Second)
}

// Leave announces departure and stops gossip. Safe to call twice.
func (n *Node) Leave(timeout time.Duration) error {
	var err error
	n.stopOnce.Do(func() {
		close(n.stop)
		n.wg.Wait()
		if n.ml == nil {
			return
		}
		n.mu.Lock()
		n.meta.Leaving, n.meta.Draining = true, true
		n.mu.Unlock()
		_ = n.ml.UpdateNode(timeout / 2)
		err = n.ml.Leave(timeout)
		if serr := n.ml.Shutdown(); err == nil {
			err = serr
		}
	})
	return err
}

// delegate adapts Node to memberlist.Delegate. Methods run on memberlist's goroutines.
type delegate struct{ n *Node }

func (d *delegate) NodeMeta(limit int) []byte {
	d.n.mu.Lock()
	m := d.n.meta
	d.n.mu.Unlock()
	b, err := encodeMeta(m)
	if err != nil || len(b) > limit {
		d.n.log.Error("node metadata too large", "err", err, "limit", limit)
		return nil
	}
	return b
}

func (d *delegate) NotifyMsg(b []byte) {
	if len(b) < 2 || b[0] != wireVersion {
		return
	}
	n := d.n
	switch b[1] {
	case msgLoad:
		name, l, err := decodeLoad(b)
		if err != nil || name == n.cfg.Name {
			return
		}
		n.mu.Lock()
		if p := n.peerLocked(name); p != nil {
			p.takeLoad(l, time.Now())
		}
		n.mu.Unlock()
	case msgPrefix, msgEvict:
		name, gen, hs, err := decodeHashes(b[1], b)
		if err != nil || name == n.cfg.Name {
			return
		}
		n.mu.Lock()
		p := n.peerLocked(name)
		if p == nil {
			n.mu.Unlock()
			return
		}
		if b[1] == msgEvict {
			p.summary.evict(gen, hs)
		} else {
			p.summary.add(gen, hs)
		}
		n.mu.Unlock()
	}
}

func (d *delegate) GetBroadcasts(overhead, limit int) [][]byte {
	return nil // load and deltas go to peers directly (publishLocal)
}

// LocalState sends this node's full summary (bounded by maxSummary).
func (d *delegate) LocalState(bool) []byte {
	n := d.n
	sum := n.local.Summary()
	if sum == nil {
		return nil
	}
	hs := sum.Hashes
	if len(hs) > maxSummary {
		hs = hs[:maxSummary]
	}
	return encodeHashes(stateFull, n.cfg.Name, sum.Generation, hs)
}

// MergeRemoteState replaces a peer's summary with its full state, keeping what
// deltas of a later generation said (push/pull is a TCP exchange that deltas over
// UDP can overtake).
func (d *delegate) MergeRemoteState(b []byte, _ bool) {
	name, gen, hs, err := decodeHashes(stateFull, b)
	n := d.n
	if err != nil || name == n.cfg.Name {
		return
	}
	n.mu.Lock()
	if p := n.peerLocked(name); p != nil {
		p.summary.replace(gen, hs)
	}
	n.mu.Unlock()
}

// takeLoad records l as p's load if it is newer: a later Seq of the same process,
// or the first load of a new process under p's name (a restart: another Boot), whose
// cache and load start afresh. A later Boot is a new process at once; an earlier one
// (a clock set back, or a node of a release that sends no Boot) only once the
// process p knew has gone quiet, so that a late message of the old process cannot
// pass for a restart. Caller holds n.mu.
func (p *peer) takeLoad(l Load, now time.Time) {
	quiet := now.Sub(p.loadAt) > restartQuiet
	switch {
	case l.Boot == p.load.Boot && l.Seq > p.load.Seq: // the same process, later
	case l.Boot > p.load.Boot, quiet && (l.Boot != p.load.Boot || l.Seq < p.load.Seq):
		// A new process (with a Boot-less release, a Seq that went back after
		// the old one fell quiet).
		if p.load.Seq != 0 { // a process was known: its cache is gone
			p.summary = summary{}
			for _, f := range p.flights {
				f.seq = 0 // the new process's sequence numbers start again
			}
		}
	default:
		return
	}
	p.load, p.loadAt = l, now
}

// restartQuiet is how long a process must have sent no load before a load under its
// name with an earlier Boot is taken for a restart.
const restartQuiet = 2 * time.Second

// peerLocked returns the entry for name, creating a placeholder when a message from
// a member arrives before memberlist's join event for it (messages and events travel
// separately). Placeholders are neither listed nor routed to until the join event
// fills in their metadata, at most maxPlaceholders exist at a time, and prune drops
// those no join followed; nil when there is no room for another. n.mu must be held.
func (n *Node) peerLocked(name string) *peer {
	p := n.peers[name]
	if p == nil {
		if n.count("") >= maxPlaceholders { // only when a new name is heard
			return nil
		}
		p = &peer{name: name, changedAt: time.Now()}
		n.peers[name] = p
	}
	return p
}

// Limits on what the peers map keeps of nodes that are not alive members.
const (
	maxPlaceholders  = 64               // names heard from before their join event
	placeholderLimit = 30 * time.Second // how long a placeholder waits for its join
	goneLimit        = 5 * time.Minute  // how long a dead or left member stays listed
)

// prune drops placeholders no join event followed and members dead or gone for
// longer than goneLimit: name churn (address-based names, restarts on new
// addresses) must not grow the map, and routing counts only what is there. Caller
// holds n.mu.
func (n *Node) prune(now time.Time) {
	for name, p := range n.peers {
		switch {
		case p.state == "" && now.Sub(p.changedAt) > placeholderLimit:
			delete(n.peers, name)
		case (p.state == "dead" || p.state == "left") && now.Sub(p.changedAt) > goneLimit:
			delete(n.peers, name)
		}
	}
}

// events tracks membership. memberlist calls it from one goroutine at a time.
type events struct{ n *Node }

// NotifyConflict hears of a member claiming a live member's name from another
// address, which memberlist refuses: this node's own name, when this node is
// the newcomer, stops its start (Start); otherwise it is logged.
func (e *events) NotifyConflict(existing, other *memberlist.Node) {
	if existing.Name == e.n.cfg.Name {
		addr := other.Address()
		e.n.nameTaken.CompareAndSwap(nil, &addr)
		e.n.log.Error("another member has this node's name", "name", existing.Name, "other", addr)
		return
	}
	e.n.log.Error("two members have one name; the first keeps it", "name", existing.Name, "member", existing.Address(), "other", other.Address())
}

// NotifyJoin also queues this node's whole summary for the newcomer, sent directly
// over TCP by the loop, so that it learns every cache at once instead of waiting for
// a push/pull with each node (broadcasts carry only new blocks).
func (e *events) NotifyJoin(m *memberlist.Node) {
	e.n.upsert(m, "alive")
	if m.Name != e.n.cfg.Name {
		select {
		case e.n.joined <- m.Name:
		default: // a burst of joins: push/pull covers the rest
		}
	}
}
func (e *events) NotifyUpdate(m *memberlist.Node) { e.n.upsert(m, "alive") }
func (e *events) NotifyLeave(m *memberlist.Node) {
	state := "dead"
	e.n.mu.Lock()
	if p := e.n.peers[m.Name]; p != nil && p.meta.Leaving {
		state = "left"
	}
	e.n.mu.Unlock()
	e.n.upsert(m, state)
}

func (n *Node) upsert(m *memberlist.Node, state string) {
	meta, err := decodeMeta(m.Meta)
	n.mu.Lock()
	defer n.mu.Unlock()
	if m.Name == n.cfg.Name {
		return
	}
	p := n.peers[m.Name]
	if p == nil {
		p = &peer{name: m.Name}
		n.peers[m.Name] = p
	}
	p.gossip = net.JoinHostPort(m.Addr.String(), strconv.Itoa(int(m.Port)))
	if state == "alive" && p.state != "alive" {
		p.aliveAt = time.Now()
	}
	if state != p.state {
		p.changedAt = time.Now()
	}
	p.state = state
	if err == nil && state == "alive" {
		p.meta, p.metaOK = meta, true
		// Each unlikeness is logged when it begins, not at every update.
		warnOnce := func(was *bool, now bool, msg string, args ...any) {
			if now && !*was {
				n.log.Warn(msg, append([]any{"peer", m.Name}, args...)...)
			}
			*was = now
		}
		warnOnce(&p.unlike, meta.Blocks != 0 && meta.Blocks != n.meta.Blocks,
			"peer hashes prompt blocks otherwise (another --hash-seed or --block-tokens): prefix-aware routing cannot match prompts against its cache, nor its router against this node's; give every node the same")
		shared := slices.ContainsFunc(meta.Models, n.meta.serves) || slices.ContainsFunc(meta.Aliases, n.meta.serves)
		warnOnce(&p.mixed, shared && meta.Simulated != n.meta.Simulated,
			"a simulated node and a real one serve the same model id: requests for it go to either, and a simulated node's answers are not the model's",
			"simulated", meta.Simulated)
		if shared && len(meta.Models) > 0 && len(n.meta.Models) > 0 {
			warnOnce(&p.named, meta.Models[0] != n.meta.Models[0],
				"another model answers to one of this node's model ids (--model-name): requests naming it go to either",
				"its_model", meta.Models[0], "this_model", n.meta.Models[0])
		} else {
			p.named = false
		}
	} else if err != nil && state == "alive" {
		n.log.Warn("peer metadata unreadable", "peer", m.Name, "err", err)
	}
	// A dead or left member's summary is kept: routing passes over it while it is
	// not alive, a member wrongly declared dead (a long pause, lost packets) comes
	// back with its cache, which it would not send again, and a restarted process is
	// told apart by its load's Boot, which drops the old summary (takeLoad).
}

// blockPrint fingerprints the hashes of prompt blocks under seed and
// blockTokens (Meta.Blocks): the first hash of a fixed prompt, never 0.
func blockPrint(seed uint64, blockTokens int) uint32 {
	if blockTokens < 1 {
		return 0
	}
	tokens := make([]int32, blockTokens)
	for i := range tokens {
		tokens[i] = int32(i)
	}
	return uint32(kvcache.NewHasher(seed, "").Chain(tokens, blockTokens)[0]) | 1
}

// status is p's state as routing and GET /cluster see it. memberlist's events say
// alive, dead or left; an alive peer is suspect while its load is overdue (its
// process stalled or gone, which memberlist's probes take seconds more to declare)
// or for a moment after a forward to it could not connect. memberlist's own suspect
// state cannot be read safely: it lives in the node structs Members returns, which
// memberlist writes in place under its lock. overdue is n.loadOverdue(), which
// callers looking at every peer compute once. Caller holds n.mu.
func (n *Node) status(p *peer, now time.Time, overdue time.Duration) string {
	if p.state != "alive" || p.name == n.cfg.Name {
		return p.state
	}
	if !p.failedAt.IsZero() && now.Sub(p.failedAt) < unreachableHold {
		return "suspect"
	}
	heard := p.loadAt
	if heard.Before(p.aliveAt) {
		heard = p.aliveAt
	}
	if !heard.IsZero() && now.Sub(heard) > overdue {
		return "suspect"
	}
	return "alive"
}

// loadOverdue is how long after a peer's last load update it counts as suspect: a
// few of the rounds in which every node sends its load to every other (one
// interval, or more beyond FanOut peers, which take turns). Caller holds n.mu.
func (n *Node) loadOverdue() time.Duration {
	rounds := max((n.count("alive")-1+n.cfg.FanOut-1)/n.cfg.FanOut, 1)
	return time.Duration(overdueRounds*rounds) * n.cfg.LoadInterval
}

// count is how many peers are in state ("alive": members memberlist last reported
// alive, this node included, the only ones that take part in the load rounds and
// routing's sums; "": placeholders, heard from before their join event). Caller
// holds n.mu.
func (n *Node) count(state string) int {
	c := 0
	for _, p := range n.peers {
		if p.state == state {
			c++
		}
	}
	return c
}

// overdueRounds is how many load rounds a peer may miss before it is suspect
// (with 250 ms intervals and up to FanOut+1 nodes, 2 s), and unreachableHold how
// long a peer that refused a forward is passed over.
const (
	overdueRounds   = 8
	unreachableHold = 2 * time.Second
)

// Unreachable records that a forward to the named peer could not connect: routing
// passes it over for a moment, so that the requests after this one do not each
// wait for the same failure before trying the next peer.
func (n *Node) Unreachable(name string) {
	n.mu.Lock()
	defer n.mu.Unlock()
	if p := n.peers[name]; p != nil {
		p.failedAt = time.Now()
	}
}

// Lost reports whether the named member has been declared dead or has left
// (Forwarder.Watch): memberlist's verdict, which its probes reach within
// seconds of a process ceasing to answer.
func (n *Node) Lost(name string) bool {
	n.mu.Lock()
	defer n.mu.Unlock()
	p := n.peers[name]
	return p != nil && (p.state == "dead" || p.state == "left")
}

// Member is one row of GET /cluster.
type Member struct {
	Name          string   `json:"name"`
	Addr          string   `json:"addr"`
	Gossip        string   `json:"gossip"`
	State         string   `json:"state"`
	Models        []string `json:"models"`
	Aliases       []string `json:"aliases,omitempty"` // other ids of Models[0]
	Draining      bool     `json:"draining"`
	Load          Load     `json:"load"`
	SummaryBlocks int      `json:"summary_blocks"`
	UpdatedAgoMS  int64    `json:"updated_ago_ms"`
	Inflight      int      `json:"inflight"`
	Simulated     bool     `json:"simulated,omitempty"`
	Device        string   `json:"device,omitempty"`
	MaxModelLen   int      `json:"max_model_len,omitempty"`
	MaxTokensCap  int      `json:"max_tokens_cap,omitempty"`
	Task          string   `json:"task,omitempty"`   // Meta.Task: embed or rerank; omitted: generate
	Vision        bool     `json:"vision,omitempty"` // Meta.Vision: reads images
}

// Serves reports whether a request naming model may go to m: one of its
// models, or an alias of its first (as Meta.serves).
func (m Member) Serves(model string) bool {
	return (&Meta{Models: m.Models, Aliases: m.Aliases}).serves(model)
}

// ChecksKeys reports whether member name is alive and requires API keys of
// its clients (Meta.Keys): a request it forwards was admitted by a key.
func (n *Node) ChecksKeys(name string) bool {
	n.mu.Lock()
	defer n.mu.Unlock()
	p := n.peers[name]
	return p != nil && p.state == "alive" && p.metaOK && p.meta.Keys
}

// Members returns every known node, this one first, then by name.
func (n *Node) Members() []Member {
	n.mu.Lock()
	defer n.mu.Unlock()
	now, overdue := time.Now(), n.loadOverdue()
	var out []Member
	for _, p := range n.peers {
		if p.state == "" {
			continue // heard from, but not yet joined
		}
		st := n.status(p, now, overdue)
		ago := int64(-1)
		if !p.loadAt.IsZero() {
			ago = time.Since(p.loadAt).Milliseconds()
		}
		out = append(out, Member{Name: p.name, Addr: p.meta.HTTP, Gossip: p.gossip, State: st, Models: p.meta.Models, Aliases: p.meta.Aliases,
			Draining: p.meta.Draining, Load: p.load, SummaryBlocks: p.summary.len(), UpdatedAgoMS: ago, Inflight: len(p.flights), Simulated: p.meta.Simulated, Device: p.meta.Device,
			MaxModelLen: p.meta.MaxModelLen, MaxTokensCap: p.meta.MaxTokensCap, Task: p.meta.Task, Vision: p.meta.Vision})
	}
	slices.SortFunc(out, func(a, b Member) int {
		switch {
		case a.Name == n.cfg.Name:
			return -1
		case b.Name == n.cfg.Name:
			return 1
		case a.Name < b.Name:
			return -1
		case a.Name > b.Name:
			return 1
		}
		return 0
	})
	return out
}

// ServedModel is a model some alive member serves.
type ServedModel struct {
	ID string
	// MaxModelLen is the largest that a member serving it to generate gives
	// (else, served only to embed or rerank, any member; 0: none says): a
	// request is routed to a node it fits.
	MaxModelLen int
	// Parent is a LoRA adapter's base model: the first of the models of a
	// member that lists it after it (Meta.Models).
	Parent string
}

// Models lists every model served by an alive member, sorted by id.
func (n *Node) Models() []ServedModel {
	lens, parents := map[string]int{}, map[string]string{}
	genLen := map[string]bool{} // lens[id] is a generation node's
	for _, m := range n.Members() {
		if m.State != "alive" {
			continue
		}
		for i, id := range slices.Concat(m.Models, m.Aliases) {
			if i > 0 && i < len(m.Models) {
				parents[id] = m.Models[0]
			}
			// The longest any node takes (requests are routed to a node they
			// fit), a generation node's before others'.
			gen := cmp.Or(m.Task, TaskGenerate) == TaskGenerate
			switch l, ok := lens[id]; {
			case !ok || gen && !genLen[id]:
				lens[id], genLen[id] = m.MaxModelLen, gen
			case gen == genLen[id]:
				lens[id] = max(l, m.MaxModelLen)
			}
		}
	}
	out := make([]ServedModel, 0, len(lens))
	for id, l := range lens {
		out = append(out, ServedModel{ID: id, MaxModelLen: l, Parent: parents[id]})
	}
	slices.SortFunc(out, func(a, b ServedModel) int { return strings.Compare(a.ID, b.ID) })
	return out
}

// slogWriter routes memberlist's log lines to slog at Debug (warnings at Warn).
type slogWriter struct{ l *slog.Logger }

func (w *slogWriter) Write(p []byte) (int, error) {
	s := string(p)
	switch {
	case len(s) > 6 && (s[:6] == "[WARN]" || s[:7] == "[ERR] m"):
		w.l.Warn(s, "src", "memberlist")
	default:
		w.l.Debug(s, "src", "memberlist")
	}
	return len(p), nil
}

var _ io.Writer = (*slogWriter)(nil)
