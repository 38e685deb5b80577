package kvcache

import (
	"container/list"
	"errors"
	"fmt"
	"slices"
)

// SeqID is an engine sequence id (llama_seq_id).
type SeqID = int32

// DefaultBlockTokens is vLLM's and llama.cpp-server's granularity: small enough that
// little of a prompt is lost to a partial block, large enough to keep the index small.
const DefaultBlockTokens = 16

// Errors callers branch on.
var (
	// ErrNoSpace: not enough free or evictable blocks; nothing was changed.
	ErrNoSpace = errors.New("kvcache: no free KV blocks")
	// ErrNoSeq: every sequence id is running or holds referenced blocks.
	ErrNoSeq = errors.New("kvcache: no free sequence id")
)

// Config sizes a Pool.
type Config struct {
	Cells       int    // the engine's KV cells (its unified pool)
	BlockTokens int    // positions per block
	MaxSeqs     int    // the engine's sequence ids, 0..MaxSeqs-1
	Seed        uint64 // hash seed; equal on every node of a cluster
	Model       string // model identity mixed into every hash
	// Caching keeps finished sequences' full blocks for reuse. Off, every block is
	// private and freed when its sequence ends.
	Caching bool
	// CacheFloor is the share of the pool, or of WeightCells when they are fewer,
	// that cached blocks no running sequence uses may always keep. In one pool
	// every decoded token attends over every cell up to the highest in use, so
	// blocks kept for a reuse that never comes slow every step. Beyond the floor
	// they are kept only as far as lookups show it pays: a prompt whose prefix was
	// evicted a while ago raises the budget to twice what would have kept it, each
	// cached block a later sequence takes for the first time raises it by one, and
	// it falls back by one block for every four blocks evicted that nobody reused.
	// 1 keeps every block until the pool is full.
	CacheFloor float64
	// WeightCells is how many cells hold as many bytes of KV as the model has
	// weights (0: unknown). A decode step reads the weights once and the cells in
	// use, so the floor's cells cost at most CacheFloor of that traffic however
	// large the pool.
	WeightCells int
	// UncutMedia never cuts a run of negative tokens (an image's
	// placeholders) at a block's edge: an M-RoPE model's image shares one
	// position over all its cells, which the engine can only remove or copy
	// together (engine.Capacity.MRoPE). The blocks an image spans are
	// indexed together, once the last of them is full, by one holder; and
	// they are evicted together. A cached prefix ends before an image, or
	// after it: one that matches into an image's blocks takes the rest of
	// the image too, from that holder, when a block is free for it. So a run
	// of placeholders must name its image: equal first rows, the same image
	// to its end (engine.Placeholder hashes the image's content and grid).
	UncutMedia bool
}

// DefaultCacheFloor is measured in docs/benchmarks.md ("A one-pool node's cache").
const DefaultCacheFloor = 0.125

// DefaultConfig returns a Config with caching on and 16-token blocks; Cells and
// MaxSeqs come from the engine.
func DefaultConfig() Config {
	return Config{BlockTokens: DefaultBlockTokens, Caching: true, CacheFloor: DefaultCacheFloor}
}

// Validate rejects impossible sizes.
func (c Config) Validate() error {
	if err := c.ValidatePolicy(); err != nil {
		return err
	}
	switch {
	case c.Cells < c.BlockTokens:
		return fmt.Errorf("kvcache: %d cells hold no block of %d tokens", c.Cells, c.BlockTokens)
	case c.MaxSeqs < 1:
		return fmt.Errorf("kvcache: max sequences %d must be positive", c.MaxSeqs)
	}
	return nil
}

// ValidatePolicy checks what does not depend on the engine's sizes (Cells and
// MaxSeqs), so that a bad setting is refused before a model loads.
func (c Config) ValidatePolicy() error {
	switch {
	case c.BlockTokens < 1:
		return fmt.Errorf("kvcache: block tokens %d must be positive", c.BlockTokens)
	case !(c.CacheFloor >= 0 && c.CacheFloor <= 1):
		return fmt.Errorf("kvcache: prefix cache floor %v must be a fraction of the pool in [0, 1]", c.CacheFloor)
	}
	return nil
}

// OpKind says what an Op does to the engine's memory.
type OpKind uint8

const (
	// OpRemove removes positions [P0, P1) of Seq (P1 < 0: to the end).
	OpRemove OpKind = iota
	// OpCopy makes positions [P0, P1) of Src visible to Seq (a cell share).
	OpCopy
)

// Op is one engine memory operation the caller must apply, in order.
type Op struct {
	Kind   OpKind
	Seq    SeqID
	Src    SeqID // OpCopy only
	P0, P1 int32
}

func (o Op) String() string {
	if o.Kind == OpCopy {
		return fmt.Sprintf("copy %d->%d [%d,%d)", o.Src, o.Seq, o.P0, o.P1)
	}
	return fmt.Sprintf("remove %d [%d,%d)", o.Seq, o.P0, o.P1)
}

type blockState uint8

const (
	stateFree    blockState = iota
	statePrivate            // used by exactly one running sequence, not in the index
	stateIndexed            // in the index: shareable, cached when unreferenced
)

type block struct {
	id       int32
	state    blockState
	hash     Hash
	index    int32  // position of the block in its chain: positions [index*B, (index+1)*B)
	parent   *block // indexed parent (nil for the first block)
	children int32  // indexed blocks whose parent this is
	holder   SeqID  // indexed: the sequence that physically keeps it
	// glued: it goes on with an image its parent holds (Config.UncutMedia):
	// the two have one holder and are evicted together. toks are its tokens
	// then: a prompt that takes the image's rows in it checks them (across).
	glued  bool
	toks   []int32
	glue   *block // the indexed block glued to this one, if any (one at most: both have one holder, whose sequence has one block after this)
	ref    int32  // running sequences using it
	reused bool   // taken by a sequence other than the one that computed it
	// suspended: unreferenced since its sequence was preempted (Suspend); kept
	// past the budget until taken again or its space is needed.
	suspended bool
	lastUse   uint64 // pool clock when last referenced or released
	lru       *list.Element
}

// Seq is a running sequence's view of its blocks. It belongs to the Pool's owner.
type Seq struct {
	ID     SeqID
	blocks []*block // covering positions [0, Len)
	len    int
	tail   []int32 // tokens of the blocks not sealed yet (from block index sealed on)
	sealed int     // blocks hashed so far (Commit)
	parent Hash    // hash of the last sealed block
	cached int
	hasher Hasher // its model's: the adapter's, under a LoRA adapter
	// resumed: started by Resume; its own blocks taken back are not reuse.
	resumed bool
	// lastNeg: the last token of its sealed blocks is an image's placeholder
	// (Config.UncutMedia).
	lastNeg bool
	// pins: the blocks of another holder that go on with the image s's
	// blocks end within (across, the glued chain below them), referenced
	// while s runs so that none is evicted apart from the image's blocks.
	pins []*block
}

// sealable is how many of the n full blocks at the start of tail may be
// sealed now: under Config.UncutMedia, not those of an image that goes on
// past them (into the rest of tail, or beyond it, unknown yet).
func sealable(c Config, tail []int32, n int) int {
	B := c.BlockTokens
	for c.UncutMedia && n > 0 && tail[n*B-1] < 0 && (n*B == len(tail) || tail[n*B] < 0) {
		n--
	}
	return n
}

// uncut is n blocks of prefix cut back, under Config.UncutMedia, so that they
// do not end within an image of tokens.
func uncut(c Config, tokens []int32, n int) int {
	B := c.BlockTokens
	for c.UncutMedia && n > 0 && n*B < len(tokens) && tokens[n*B-1] < 0 && tokens[n*B] < 0 {
		n--
	}
	return n
}

// Len is the number of positions accounted to the sequence.
func (s *Seq) Len() int { return s.len }

// Cached is the number of prompt tokens taken from the cache when it started.
func (s *Seq) Cached() int { return s.cached }

// Stats are the pool's counters and occupancy.
type Stats struct {
	Blocks      int    // total
	Free        int    // never used or evicted
	Used        int    // referenced by running sequences
	Cached      int    // resident, unreferenced, evictable
	CacheBudget int    // most Cached blocks kept now (see Config.CacheFloor)
	Queries     uint64 // prompt tokens looked up
	HitTokens   uint64 // of which found in the cache
	Evictions   uint64 // blocks evicted
	Holders     int    // sequence ids kept only to hold cached blocks
	Running     int    // sequence ids of running sequences
	BlockTokens int
	Generation  uint64 // of the resident set; changes whenever Summary would
}

// Summary is the set of resident block hashes, for gossip.
type Summary struct {
	Generation uint64
	Hashes     []Hash // sorted
}

// Pool is the block allocator. See the package doc for the concurrency rule.
type Pool struct {
	cfg    Config
	hasher Hasher
	blocks []block
	free   []int32 // free block ids (stack)
	index  map[Hash]*block
	// Indexed blocks with ref 0, least recently used first: never reused
	// (probation), reused at least once (protected), and those of preempted
	// sequences waiting to resume (suspended: not counted against the budget).
	// Eviction takes probation first, then suspended, then protected.
	probation, protected, suspended *list.List
	// budget is how many of them may stay (see Config.CacheFloor); decay counts
	// evictions of never-reused blocks since it last fell. ghosts remember recently
	// evicted blocks.
	budget, floor, decay int
	ghosts               ghosts
	seqs                 []seqState
	holders              map[SeqID]int // indexed blocks held per sequence id
	running              int
	// chose: what Fits chose for the next Start of its prompt (see plan).
	chose struct {
		prompt []int32
		mode   planMode
	}

	queries, hits, evictions uint64
	generation               uint64
	clock                    uint64 // orders block uses for holder recency

	snapshots
}

type seqState uint8

const (
	seqFree seqState = iota
	seqRunning
	seqHolder
)

// New returns an empty pool.
func New(cfg Config) (*Pool, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	n := cfg.Cells / cfg.BlockTokens
	p := &Pool{
		cfg:       cfg,
		hasher:    NewHasher(cfg.Seed, cfg.Model),
		blocks:    make([]block, n),
		free:      make([]int32, 0, n),
		index:     map[Hash]*block{},
		probation: list.New(),
		protected: list.New(),
		suspended: list.New(),
		seqs:      make([]seqState, cfg.MaxSeqs),
		holders:   map[SeqID]int{},
	}
	p.floor = n
	if cfg.CacheFloor < 1 {
		base := n
		if cfg.WeightCells > 0 {
			base = min(n, cfg.WeightCells/cfg.BlockTokens)
		}
		p.floor = int(cfg.CacheFloor * float64(base))
	}
	p.budget = p.floor
	p.ghosts = newGhosts(n)
	for i := n - 1; i >= 0; i-- {
		p.blocks[i].id = int32(i)
		p.free = append(p.free, int32(i))
	}
	p.generation = 1
	p.Publish()
	return p, nil
}

// BlockTokens is the block size.
func (p *Pool) BlockTokens() int { return p.cfg.BlockTokens }

// TotalBlocks is the pool size in blocks.
func (p *Pool) TotalBlocks() int { return len(p.blocks) }

// FreeBlocks counts blocks available without eviction.
func (p *Pool) FreeBlocks() int { return len(p.free) }

// EvictableBlocks counts unreferenced cached blocks.
func (p *Pool) EvictableBlocks() int { return p.budgeted() + p.suspended.Len() }

// budgeted counts the unreferenced cached blocks the budget bounds: all but
// those kept for preempted sequences.
func (p *Pool) budgeted() int { return p.probation.Len() + p.protected.Len() }

func (p *Pool) blocksFor(tokens int) int {
	return (tokens + p.cfg.BlockTokens - 1) / p.cfg.BlockTokens
}

// matchBlocks returns the indexed blocks of the longest cached prefix of tokens,
// leaving at least one token to compute (its logits start generation). It may
// end within an image (see plan).
func (p *Pool) matchBlocks(h Hasher, tokens []int32) []*block {
	if len(tokens) == 0 {
		return nil
	}
	return p.matchUpTo(h, tokens, (len(tokens)-1)/p.cfg.BlockTokens)
}

// matchUpTo is matchBlocks up to limit blocks: every full block of tokens
// for what Suspend kept of them, which may end with the last token.
func (p *Pool) matchUpTo(h Hasher, tokens []int32, limit int) []*block {
	if !p.cfg.Caching {
		return nil
	}
	B := p.cfg.BlockTokens
	var out []*block
	var parent Hash
	for i := range limit {
		hb := h.Block(parent, tokens[i*B:(i+1)*B])
		b, ok := p.index[hb]
		if !ok {
			break
		}
		out = append(out, b)
		parent = hb
	}
	return out
}

// across is, under Config.UncutMedia, where the image ends within which n
// matched blocks of tokens end, when it ends within the next block, before
// tokens' last: the holder of the image's blocks holds its rows up to there
// (an image's blocks are cached together), so a prefix may take them, in
// part of a block, rather than end before the image. 0 otherwise.
func across(c Config, tokens []int32, n int) int {
	B := c.BlockTokens
	if !c.UncutMedia || n == 0 || uncut(c, tokens, n) == n {
		return 0
	}
	e := n * B
	for e < len(tokens) && tokens[e] < 0 {
		e++
	}
	if e >= (n+1)*B || e >= len(tokens) {
		return 0
	}
	return e
}

// gluedChain is the glued chain below b: its glued child, that block's, and
// so on (one holder's blocks of the images that go on past b).
func (p *Pool) gluedChain(b *block) []*block {
	var chain []*block
	for c := b.glue; c != nil; c = c.glue {
		chain = append(chain, c)
	}
	return chain
}

// acrossTo is across for matched blocks m of prompt, checked against the
// block of m's holder that goes on with the image: its rows are the
// prompt's, and the image ends there where it ends in the prompt (so that
// another picture right after it is never taken for the prompt's). It
// returns where the image ends and the glued chain below m, or 0 and nil.
func (p *Pool) acrossTo(prompt []int32, m []*block) (int, []*block) {
	n := len(m)
	end := across(p.cfg, prompt, n)
	if end == 0 {
		return 0, nil
	}
	c := m[n-1].glue
	off := end - n*p.cfg.BlockTokens
	if c == nil || !slices.Equal(c.toks[:off], prompt[n*p.cfg.BlockTokens:end]) || c.toks[off] < 0 {
		return 0, nil
	}
	return end, p.gluedChain(m[n-1])
}

// planMode is what a plan may take under Config.UncutMedia.
type planMode uint8

const (
	planAcross planMode = iota // the rest of an image the cached prefix ends within
	planPinned                 // the blocks before it, pinning what another holder's image glues to the last
	planPlain                  // only blocks before any image that goes on past them: no pins
)

// plan is what a sequence for prompt takes of the cache: the blocks m it
// references, where the image they end within ends when it takes the rest
// of that image too (across, planAcross, when a free block is there for
// those rows; 0 otherwise), and the glued chain below m's last block,
// another holder's image going on past it, which it pins (not planPlain).
// (A block with a glued child has no other child, seal: only m's last block
// can have a glued chain m does not take.)
func (p *Pool) plan(h Hasher, prompt []int32, mode planMode) (m []*block, end int, pins []*block) {
	m = p.matchBlocks(h, prompt)
	if mode == planAcross && len(p.free) > 0 {
		if end, pins = p.acrossTo(prompt, m); end > 0 {
			return m, end, pins
		}
	}
	m = m[:uncut(p.cfg, prompt, len(m))]
	for p.cfg.UncutMedia && len(m) > 0 {
		// A picture right after m's last one, at a block's edge.
		if pins = p.gluedChain(m[len(m)-1]); pins == nil || mode != planPlain {
			break
		}
		pins, m = nil, m[:uncut(p.cfg, prompt, len(m)-1)]
	}
	return m, 0, pins
}

// unsuspend returns blocks Suspend kept past the budget to the cache, and
// how many.
func (p *Pool) unsuspend(bs ...*block) int {
	n := 0
	for i := len(bs) - 1; i >= 0; i-- { // deepest first
		if b := bs[i]; b.suspended && b.lru != nil {
			p.suspended.Remove(b.lru)
			b.suspended = false
			b.lru = p.lruOf(b).PushFront(b)
			n++
		}
	}
	return n
}

// CachedPrefix returns how many leading tokens of prompt are cached, without counting
// a query.
func (p *Pool) CachedPrefix(model string, prompt []int32) int {
	m, end, _ := p.plan(p.hasher.For(model), prompt, planAcross)
	if end > 0 {
		return end
	}
	return len(m) * p.cfg.BlockTokens
}

// Fits reports whether a sequence with this prompt and up to maxNew generated tokens
// fits into free and evictable blocks, counting its cached prefix as already resident.
//
// Under Config.UncutMedia it also chooses the plan of the Start (or Resume)
// of this prompt that follows (which may find other blocks free, having
// evicted a holder for its sequence id): one that would fit only without
// the blocks of another holder it would pin takes only the blocks before
// the picture they go on with (see plan).
func (p *Pool) Fits(model string, prompt []int32, maxNew int) bool {
	h := p.hasher.For(model)
	total := p.blocksFor(len(prompt) + maxNew)
	fits := func(m, pins []*block) bool {
		taken := 0
		for _, b := range append(m[:len(m):len(m)], pins...) {
			if b.ref == 0 {
				taken++ // resident and evictable now, but would be referenced
			}
		}
		return total-len(m) <= len(p.free)+p.EvictableBlocks()-taken
	}
	p.chose.prompt = nil
	choose := func(mode planMode) bool {
		p.chose.prompt, p.chose.mode = slices.Clone(prompt), mode
		return true
	}
	m, end, pins := p.plan(h, prompt, planAcross)
	switch {
	case fits(m, pins) && end > 0:
		return choose(planAcross)
	case fits(m, pins):
		return choose(planPinned)
	case len(pins) == 0:
		return false
	}
	for _, mode := range []planMode{planPinned, planPlain} {
		if m, _, pins = p.plan(h, prompt, mode); fits(m, pins) {
			return choose(mode)
		}
	}
	return false
}

// Start begins a sequence for prompt: it takes a sequence id and the longest cached
// prefix. The returned ops (copies from holders, and removals for any eviction needed
// to free a sequence id) must be applied before the sequence's first decode. The rest
// of the prompt is accounted by Grow as it is computed.
func (p *Pool) Start(model string, prompt []int32) (*Seq, []Op, error) {
	return p.start(model, prompt, false)
}

// Resume is Start for a sequence that was preempted (Suspend): it takes back what is
// still cached of its own tokens, which is not reuse by another sequence, so it is
// neither counted as a lookup or hit nor raises the cache budget.
func (p *Pool) Resume(model string, tokens []int32) (*Seq, []Op, error) {
	return p.start(model, tokens, true)
}

func (p *Pool) start(model string, prompt []int32, resume bool) (*Seq, []Op, error) {
	var ops []Op
	id, ops, err := p.takeSeqID(ops)
	if err != nil {
		return nil, nil, err
	}
	s := &Seq{ID: id, hasher: p.hasher.For(model), resumed: resume}
	mode := planAcross
	if slices.Equal(prompt, p.chose.prompt) {
		mode = p.chose.mode
	}
	p.chose.prompt = nil
	m, end, pins := p.plan(s.hasher, prompt, mode)
	unsuspended := false
	if resume {
		// What Suspend kept and it does not take now (the last block, which
		// may end with the last token; an image's blocks, and the chains
		// glued below them it pinned) goes back to the budget.
		raw := p.matchUpTo(s.hasher, prompt, len(prompt)/p.cfg.BlockTokens)
		for i, b := range raw {
			if i >= len(m) && p.unsuspend(b) > 0 {
				unsuspended = true
			}
			if !(i == len(m)-1 && len(pins) > 0) && p.unsuspend(p.gluedChain(b)...) > 0 {
				unsuspended = true
			}
		}
	}
	// The glued chain below its last block, held by another sequence, cannot
	// be evicted while s references that block (the chain's image would be
	// cut): s pins it.
	s.pins = pins
	for _, b := range pins {
		p.ref(b)
	}
	for i, b := range m {
		if b.lru != nil && !b.reused && !resume {
			// Kept unused until a later sequence asked for it: keeping paid, and a
			// working set that grows (chats) grows the budget with it.
			p.budget = min(len(p.blocks), p.budget+1)
		}
		p.ref(b)
		b.reused = b.reused || !resume
		s.blocks = append(s.blocks, b)
		// One copy per run of blocks with the same holder.
		p0, p1 := int32(i*p.cfg.BlockTokens), int32((i+1)*p.cfg.BlockTokens)
		if n := len(ops); n > 0 && ops[n-1].Kind == OpCopy && ops[n-1].Src == b.holder && ops[n-1].P1 == p0 && ops[n-1].Seq == id {
			ops[n-1].P1 = p1
		} else {
			ops = append(ops, Op{Kind: OpCopy, Src: b.holder, Seq: id, P0: p0, P1: p1})
		}
	}
	s.len = len(m) * p.cfg.BlockTokens
	s.sealed = len(m)
	s.lastNeg = s.len > 0 && prompt[s.len-1] < 0
	if len(m) > 0 {
		s.parent = m[len(m)-1].hash
	}
	if end > 0 {
		// The image's rows in the next block, from the holder of the
		// image's blocks (the last copy's source): a private block.
		b, _, _ := p.alloc(nil) // a free one: evicts nothing
		b.state, b.ref, b.index = statePrivate, 1, int32(len(m))
		s.blocks = append(s.blocks, b)
		ops[len(ops)-1].P1 = int32(end)
		s.tail = slices.Clone(prompt[s.len:end])
		s.len = end
	}
	s.cached = s.len
	if !resume {
		if p.cfg.Caching {
			p.missedGhosts(s.hasher, prompt, len(m), s.parent)
		}
		p.queries += uint64(len(prompt))
		p.hits += uint64(s.cached)
	}
	p.seqs[id] = seqRunning
	p.running++
	if unsuspended {
		ops = p.trim(ops)
	}
	return s, ops, nil
}

// takeSeqID finds a free sequence id. When none is free it evicts the holder whose
// eviction loses the fewest cached blocks (its own and their descendants), least
// recently used among equals: a holder of a long shared prefix is worth more than
// one holding a single question's block.
func (p *Pool) takeSeqID(ops []Op) (SeqID, []Op, error) {
	for i, st := range p.seqs {
		if st == seqFree {
			return SeqID(i), ops, nil
		}
	}
	type holderInfo struct {
		cost       int
		referenced bool
		lastUse    uint64
	}
	info := map[SeqID]*holderInfo{}
	get := func(h SeqID) *holderInfo {
		if info[h] == nil {
			info[h] = &holderInfo{}
		}
		return info[h]
	}
	for i := range p.blocks {
		b := &p.blocks[i]
		if b.state != stateIndexed {
			continue
		}
		hi := get(b.holder)
		hi.referenced = hi.referenced || b.ref > 0
		hi.lastUse = max(hi.lastUse, b.lastUse)
		// Evicting a holder also evicts every block below its blocks.
		seen := SeqID(-1)
		for a := b; a != nil; a = a.parent {
			if a.holder != seen {
				get(a.holder).cost++
				seen = a.holder
			}
		}
	}
	best := SeqID(-1)
	for h, hi := range info {
		if p.seqs[h] != seqHolder || hi.referenced {
			continue
		}
		if b := info[best]; best < 0 || hi.cost < b.cost || (hi.cost == b.cost && (hi.lastUse < b.lastUse || hi.lastUse == b.lastUse && h < best)) {
			best = h
		}
	}
	if best < 0 {
		return 0, ops, ErrNoSeq
	}
	ops = p.evictHolder(best, ops)
	return best, ops, nil
}

// evictHolder evicts every block held by h together with their descendants (which
// are unreferenced too: a sequence referencing a descendant references its ancestors).
func (p *Pool) evictHolder(h SeqID, ops []Op) []Op {
	doomed := map[*block]bool{}
	for i := range p.blocks {
		b := &p.blocks[i]
		if b.state == stateIndexed && b.holder == h {
			doomed[b] = true
		}
	}
	// Add descendants; then evict deepest first so every eviction is of a leaf.
	var victims []*block
	for i := range p.blocks {
		b := &p.blocks[i]
		if b.state != stateIndexed {
			continue
		}
		for a := b; a != nil; a = a.parent {
			if doomed[a] {
				victims = append(victims, b)
				break
			}
		}
	}
	slices.SortFunc(victims, func(x, y *block) int { return int(y.index - x.index) })
	for _, b := range victims {
		switch {
		case b.state != stateIndexed: // evicted with a block glued to it
		case b.holder == h:
			p.unindex(b) // all of h's cells go at once, below
		default:
			ops = p.evict(b, ops)
		}
	}
	return append(ops, Op{Kind: OpRemove, Seq: h, P0: 0, P1: -1})
}

// Grow accounts more positions of s whose tokens are toks. It allocates blocks as
// needed, evicting cached blocks (returned ops). On ErrNoSpace nothing changed. The
// new blocks become shareable only after Commit, once the engine has computed them.
func (p *Pool) Grow(s *Seq, toks []int32) ([]Op, error) {
	need := p.blocksFor(s.len+len(toks)) - len(s.blocks)
	if need > len(p.free)+p.EvictableBlocks() {
		return nil, ErrNoSpace
	}
	var ops []Op
	B := p.cfg.BlockTokens
	for _, t := range toks {
		if s.len%B == 0 {
			var b *block
			var err error
			if b, ops, err = p.alloc(ops); err != nil {
				return ops, err
			}
			b.state, b.ref, b.index = statePrivate, 1, int32(len(s.blocks))
			s.blocks = append(s.blocks, b)
		}
		s.tail = append(s.tail, t)
		s.len++
	}
	return ops, nil
}

// Spare reports whether s can grow by n positions from free blocks alone.
func (p *Pool) Spare(s *Seq, n int) bool {
	return p.blocksFor(s.len+n)-len(s.blocks) <= len(p.free)
}

// Trim takes back s's positions from n on (Allocator.Trim).
func (p *Pool) Trim(s *Seq, n int) ([]Op, error) {
	if err := s.checkTrim(n); err != nil {
		return nil, err
	}
	if n == s.len {
		return nil, nil
	}
	keep := p.blocksFor(n)
	for _, b := range s.blocks[keep:] {
		*b = block{id: b.id} // uncommitted: private to s
		p.free = append(p.free, b.id)
	}
	s.blocks = s.blocks[:keep]
	s.tail = s.tail[:len(s.tail)-(s.len-n)]
	s.len = n
	return []Op{{Kind: OpRemove, Seq: s.ID, P0: int32(n), P1: -1}}, nil
}

// checkTrim refuses a trim of s to n that would take back positions of its
// sealed blocks (hashed, perhaps shared) or add some.
func (s *Seq) checkTrim(n int) error {
	if n > s.len || n < s.len-len(s.tail) {
		return fmt.Errorf("kvcache: trim sequence %d of %d positions (%d in sealed blocks) to %d", s.ID, s.len, s.len-len(s.tail), n)
	}
	return nil
}

// Commit marks every position of s accounted so far as computed by the engine: full
// blocks among them are hashed and indexed, so other sequences may copy them. Call it
// after each successful decode of s's tokens, never before (a copy of cells the engine
// has not written yet would copy nothing).
func (p *Pool) Commit(s *Seq) []Op {
	B := p.cfg.BlockTokens
	var ops []Op
	for range sealable(p.cfg, s.tail, len(s.tail)/B) {
		ops = p.seal(s, s.blocks[s.sealed], s.tail[:B], ops)
		s.sealed++
		s.tail = s.tail[B:]
	}
	s.tail = append(s.tail[:0:0], s.tail...)
	return ops
}

// seal hashes full block b of s and indexes it. When an equal block is already
// indexed (a prompt cached whole computes its last block again, for the logits
// of its last token; sequences that computed the same prompt side by side), s
// takes that one instead and b is freed (the ops swap s's cells for the
// holder's), so that the chain goes on and the blocks s computes after it are
// cached too; one an image goes on past stays private to s, ending the chain.
func (p *Pool) seal(s *Seq, b *block, toks []int32, ops []Op) []Op {
	h := s.hasher.Block(s.parent, toks)
	s.parent = h
	glued := p.cfg.UncutMedia && s.lastNeg && toks[0] < 0
	s.lastNeg = toks[len(toks)-1] < 0
	if !p.cfg.Caching {
		return ops
	}
	if dup, ok := p.index[h]; ok {
		// Neither end of the block in an image: neither is glued to
		// another, nor ever will be.
		if toks[0] >= 0 && toks[len(toks)-1] >= 0 && dup.holder != s.ID && (b.index == 0 || s.blocks[b.index-1] == dup.parent) {
			B := int32(p.cfg.BlockTokens)
			p0, p1 := b.index*B, (b.index+1)*B
			ops = append(ops, Op{Kind: OpRemove, Seq: s.ID, P0: p0, P1: p1}, Op{Kind: OpCopy, Src: dup.holder, Seq: s.ID, P0: p0, P1: p1})
			if dup.lru != nil && !dup.reused && !s.resumed {
				p.budget = min(len(p.blocks), p.budget+1) // as Start credits a first reuse
			}
			p.ref(dup)
			dup.reused = dup.reused || !s.resumed
			s.blocks[b.index] = dup
			*b = block{id: b.id}
			p.free = append(p.free, b.id)
		}
		return ops
	}
	var parent *block
	if b.index > 0 {
		parent = s.blocks[b.index-1]
		if parent.state != stateIndexed || glued && parent.holder != s.ID || !glued && parent.glue != nil {
			// The chain is broken by a private duplicate, or an image would
			// have two holders, or another picture goes on from the parent
			// in its holder's block (the parent is evicted with it, never
			// with another child): keep this one private.
			return ops
		}
	}
	p.ghosts.forget(h)
	b.state, b.hash, b.holder, b.parent, b.glued = stateIndexed, h, s.ID, parent, glued
	if glued {
		b.toks = slices.Clone(toks)
		parent.glue = b // (b.index > 0: s has a parent block)
	}
	if parent != nil {
		parent.children++
	}
	p.index[h] = b
	p.holders[s.ID]++
	p.generation++
	return ops
}

// errNoLeaf cannot happen while the invariants hold: a non-empty LRU always has a
// leaf, since the descendants of an unreferenced block are unreferenced too.
var errNoLeaf = errors.New("kvcache: evictable blocks but no evictable leaf (invariant broken)")

// alloc takes a free block, evicting the least recently used leaf if none is free.
// The caller has checked that one is available.
func (p *Pool) alloc(ops []Op) (*block, []Op, error) {
	if len(p.free) == 0 {
		var ok bool
		if ops, ok = p.evictOne(ops); !ok {
			return nil, ops, errNoLeaf
		}
	}
	id := p.free[len(p.free)-1]
	p.free = p.free[:len(p.free)-1]
	return &p.blocks[id], ops, nil
}

// evictOne evicts a block to make room: never reused first, then those kept for
// preempted sequences, then reused ones.
func (p *Pool) evictOne(ops []Op) ([]Op, bool) {
	return p.evictFrom(ops, p.probation, p.suspended, p.protected)
}

// evictFrom evicts the least recently used leaf of the first of lists that has one.
func (p *Pool) evictFrom(ops []Op, lists ...*list.List) ([]Op, bool) {
	for _, l := range lists {
		if ops, ok := p.evictLeaf(l, ops); ok {
			return ops, true
		}
	}
	return ops, false
}

// evictLeaf evicts the least recently used block of l that no other block
// extends (with the blocks of an image it ends, Config.UncutMedia).
func (p *Pool) evictLeaf(l *list.List, ops []Op) ([]Op, bool) {
	for e := l.Front(); e != nil; e = e.Next() {
		if b := e.Value.(*block); b.children == 0 && evictable(b) {
			return p.evict(b, ops), true
		}
	}
	return ops, false
}

// evictable reports whether the blocks leaf b is glued to are unreferenced
// and extended by nothing else.
func evictable(b *block) bool {
	for ; b.glued; b = b.parent {
		if a := b.parent; a.ref > 0 || a.children != 1 {
			return false
		}
	}
	return true
}

// lruOf is the list that holds b while it is unreferenced.
func (p *Pool) lruOf(b *block) *list.List {
	switch {
	case b.suspended:
		return p.suspended
	case b.reused:
		return p.protected
	}
	return p.probation
}

// trim evicts cached blocks beyond the budget: never reused first, least recently
// used first.
func (p *Pool) trim(ops []Op) []Op {
	for p.budgeted() > p.budget {
		// Suspended blocks last, only when every budgeted block has suspended
		// descendants (a prefix released by another sequence since).
		var ok bool
		if ops, ok = p.evictFrom(ops, p.probation, p.protected, p.suspended); !ok {
			break // cannot happen while the invariants hold (see errNoLeaf)
		}
	}
	return ops
}

// DropCached evicts every unreferenced cached block but those kept for
// preempted sequences (Suspend), which resume from them. The budget is left as
// it was, and the blocks dropped are no misses to raise it by.
func (p *Pool) DropCached() (int, []Op) {
	before, budget, decay := p.budgeted(), p.budget, p.decay
	var ops []Op
	for ok := true; ok; {
		ops, ok = p.evictFrom(ops, p.probation, p.protected)
	}
	p.budget, p.decay = budget, decay
	p.ghosts = newGhosts(len(p.blocks))
	return before - p.budgeted(), ops
}

// wasted notes that a block was evicted that no later sequence used: the budget
// decays towards the floor.
func (p *Pool) wasted() {
	if p.decay++; p.decay == 4 {
		p.decay = 0
		p.budget = max(p.floor, p.budget-1)
	}
}

// missedGhosts raises the budget when the blocks of tokens after its first
// cached blocks were evicted recently: to twice what would have kept them all (a
// working set that grows, such as chats, outgrows just enough at once).
func (p *Pool) missedGhosts(h Hasher, tokens []int32, cached int, parent Hash) {
	if p.budget >= len(p.blocks) {
		return
	}
	B := p.cfg.BlockTokens
	oldest := uint64(0)
	for i := cached; i < (len(tokens)-1)/B; i++ {
		hb := h.Block(parent, tokens[i*B:(i+1)*B])
		at, ok := p.ghosts.at(hb)
		if !ok {
			break
		}
		if oldest == 0 || at < oldest {
			oldest = at
		}
		parent = hb
	}
	if oldest > 0 {
		need := p.budgeted() + int(p.evictions-oldest) + 1
		p.budget = min(len(p.blocks), max(p.budget, 2*need))
	}
}

// evict removes an unreferenced leaf from the index and trims it from its
// holder, with the blocks of an image it is glued to (evictable): one range
// of their holder's, never cut within an image.
func (p *Pool) evict(b *block, ops []Op) []Op {
	B := int32(p.cfg.BlockTokens)
	h, end := b.holder, (b.index+1)*B
	for {
		glued, parent := b.glued, b.parent
		top := b.index * B
		p.unindex(b)
		if glued {
			b = parent
			continue
		}
		if p.seqs[h] == seqFree {
			return append(ops, Op{Kind: OpRemove, Seq: h, P0: 0, P1: -1}) // its last block: nothing is left in it
		}
		return append(ops, Op{Kind: OpRemove, Seq: h, P0: top, P1: end})
	}
}

// unindex takes leaf b out of the index and frees it; the caller removes its
// cells from its holder.
func (p *Pool) unindex(b *block) {
	if b.lru != nil {
		p.lruOf(b).Remove(b.lru)
	}
	b.lru = nil
	delete(p.index, b.hash)
	p.evictions++
	p.ghosts.add(b.hash, p.evictions)
	if !b.reused && !b.suspended {
		p.wasted()
	}
	if b.parent != nil {
		b.parent.children--
		if b.parent.glue == b {
			b.parent.glue = nil
		}
	}
	h := b.holder
	if p.holders[h]--; p.holders[h] == 0 {
		delete(p.holders, h)
		if p.seqs[h] == seqHolder {
			p.seqs[h] = seqFree
		}
	}
	*b = block{id: b.id}
	p.free = append(p.free, b.id)
	p.generation++
}

func (p *Pool) ref(b *block) {
	p.clock++
	b.lastUse = p.clock
	if b.ref == 0 && b.lru != nil {
		p.lruOf(b).Remove(b.lru)
		b.lru = nil
	}
	b.suspended = false
	b.ref++
}

// Release ends s. Its indexed blocks stay cached (unreferenced blocks become
// evictable, most recently used); private blocks are freed. The returned ops remove s
// from every position it does not hold for the cache.
func (p *Pool) Release(s *Seq) []Op { return p.release(s, true) }

// Suspend is Release for a preempted sequence that will Resume: its blocks are
// kept past the cache budget until it (or another sequence) takes them again, or
// their space is needed (after never-reused blocks, before reused ones), so that a
// resume recomputes only what was evicted.
func (p *Pool) Suspend(s *Seq) []Op { return p.release(s, false) }

// Abandon returns the blocks Suspend kept for tokens to the cache budget (the
// least recently used among the cached, deepest first) and trims beyond it. A
// prefix another suspended sequence shares goes back too: it is cached, only no
// longer kept past the budget.
func (p *Pool) Abandon(model string, tokens []int32) []Op {
	m := p.matchUpTo(p.hasher.For(model), tokens, len(tokens)/p.cfg.BlockTokens)
	for i := len(m) - 1; i >= 0; i-- {
		p.unsuspend(p.gluedChain(m[i])...) // what it pinned (see plan)
		p.unsuspend(m[i])
	}
	return p.trim(nil)
}

func (p *Pool) release(s *Seq, trim bool) []Op {
	var ops []Op
	B := int32(p.cfg.BlockTokens)
	drop := func(b *block) {
		p0, p1 := b.index*B, (b.index+1)*B
		if int(b.index) == len(s.blocks)-1 {
			p1 = -1 // its last block: nothing of s lies beyond (its tail may end within an image)
		}
		if n := len(ops); n > 0 && ops[n-1].P0 == p1 {
			ops[n-1].P0 = p0 // runs are walked backwards
			return
		}
		ops = append(ops, Op{Kind: OpRemove, Seq: s.ID, P0: p0, P1: p1})
	}
	unref := func(b *block) {
		p.clock++
		b.lastUse = p.clock
		if b.ref--; b.ref == 0 {
			b.suspended = !trim
			b.lru = p.lruOf(b).PushBack(b)
		}
	}
	for i := len(s.pins) - 1; i >= 0; i-- {
		unref(s.pins[i]) // glued to s's last block: kept (or not) with it
	}
	s.pins = nil
	// Walk backwards so that deeper blocks enter the LRU first and leave it first.
	for i := len(s.blocks) - 1; i >= 0; i-- {
		b := s.blocks[i]
		switch b.state {
		case statePrivate:
			drop(b)
			*b = block{id: b.id}
			p.free = append(p.free, b.id)
		case stateIndexed:
			if b.holder != s.ID {
				drop(b)
			}
			unref(b)
		}
	}
	p.running--
	if p.holders[s.ID] > 0 {
		p.seqs[s.ID] = seqHolder
	} else {
		p.seqs[s.ID] = seqFree
		ops = []Op{{Kind: OpRemove, Seq: s.ID, P0: 0, P1: -1}}
	}
	s.blocks, s.tail = nil, nil
	if !trim {
		return ops
	}
	return p.trim(ops)
}

// Fork starts a new sequence that shares everything s has so far (for n > 1). Its
// indexed blocks are shared by reference; s's private blocks are physically shared by
// the copy but reserved again for the fork, so either may end first.
func (p *Pool) Fork(s *Seq) (*Seq, []Op, error) {
	private := 0
	for _, b := range s.blocks {
		if b.state == statePrivate {
			private++
		}
	}
	if private > len(p.free)+p.EvictableBlocks() {
		return nil, nil, ErrNoSpace
	}
	id, ops, err := p.takeSeqID(nil)
	if err != nil {
		return nil, nil, err
	}
	if private > len(p.free)+p.EvictableBlocks() { // taking the id may not free blocks, but check again
		return nil, nil, ErrNoSpace
	}
	f := &Seq{ID: id, len: s.len, tail: slices.Clone(s.tail), sealed: s.sealed, parent: s.parent, cached: s.cached, hasher: s.hasher, lastNeg: s.lastNeg, pins: s.pins}
	for _, b := range f.pins {
		p.ref(b)
	}
	for _, b := range s.blocks {
		if b.state == stateIndexed {
			p.ref(b)
			f.blocks = append(f.blocks, b)
			continue
		}
		nb, nops, err := p.alloc(ops)
		ops = nops
		if err != nil {
			return nil, ops, err
		}
		nb.state, nb.ref, nb.index = statePrivate, 1, b.index
		f.blocks = append(f.blocks, nb)
	}
	ops = append(ops, Op{Kind: OpCopy, Src: s.ID, Seq: id, P0: 0, P1: -1})
	p.seqs[id] = seqRunning
	p.running++
	return f, ops, nil
}

// Publish refreshes the snapshots read by Stats and Summary. The owner calls it once
// per scheduling step; the summary is rebuilt only when the resident set changed.
func (p *Pool) Publish() {
	used, cached := 0, p.EvictableBlocks()
	for i := range p.blocks {
		if b := &p.blocks[i]; b.state != stateFree && b.ref > 0 {
			used++
		}
	}
	holders := 0
	for _, st := range p.seqs {
		if st == seqHolder {
			holders++
		}
	}
	publish(&p.snapshots, Stats{
		Blocks: len(p.blocks), Free: len(p.free), Used: used, Cached: cached, CacheBudget: p.budget,
		Queries: p.queries, HitTokens: p.hits, Evictions: p.evictions,
		Holders: holders, Running: p.running, BlockTokens: p.cfg.BlockTokens, Generation: p.generation,
	}, p.index)
}
