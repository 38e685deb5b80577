package kvcache

import (
	"container/list"
	"errors"
	"fmt"
	"slices"
	"testing"
)

// simCells models llama.cpp's unified cell pool: each cell holds one position for a
// set of sequences. Applying the pool's ops to it checks that accounting and cells
// never disagree.
type simCells struct {
	max   int
	cells map[int]*simCell
	next  int
}

type simCell struct {
	pos  int32
	seqs map[SeqID]bool
}

func newSim(max int) *simCells { return &simCells{max: max, cells: map[int]*simCell{}} }

func (c *simCells) apply(t *testing.T, ops []Op) {
	t.Helper()
	for _, o := range ops {
		p1 := o.P1
		if p1 < 0 {
			p1 = 1 << 30
		}
		for id, cell := range c.cells {
			if cell.pos < o.P0 || cell.pos >= p1 {
				continue
			}
			switch o.Kind {
			case OpRemove:
				delete(cell.seqs, o.Seq)
				if len(cell.seqs) == 0 {
					delete(c.cells, id)
				}
			case OpCopy:
				if cell.seqs[o.Src] {
					cell.seqs[o.Seq] = true
				}
			}
		}
	}
}

// decode writes positions [from, to) of s into new cells.
func (c *simCells) decode(t *testing.T, s SeqID, from, to int) {
	t.Helper()
	for p := from; p < to; p++ {
		c.cells[c.next] = &simCell{pos: int32(p), seqs: map[SeqID]bool{s: true}}
		c.next++
	}
	if len(c.cells) > c.max {
		t.Fatalf("engine over-committed: %d cells used of %d", len(c.cells), c.max)
	}
}

func (c *simCells) positions(s SeqID) map[int32]int {
	out := map[int32]int{}
	for _, cell := range c.cells {
		if cell.seqs[s] {
			out[cell.pos]++
		}
	}
	return out
}

type running struct {
	seq    *Seq
	model  string
	tokens []int32
}

// checkInvariants verifies the pool's bookkeeping against itself and the sim.
func checkInvariants(t *testing.T, p *Pool, sim *simCells, live []*running) {
	t.Helper()
	free, used, cached := len(p.free), 0, 0
	refs := map[*block]int32{}
	for _, r := range live {
		for _, b := range r.seq.blocks {
			refs[b]++
		}
		for _, b := range r.seq.pins {
			refs[b]++
		}
	}
	for i := range p.blocks {
		b := &p.blocks[i]
		if b.ref < 0 {
			t.Fatalf("block %d: negative refcount %d", b.id, b.ref)
		}
		if b.ref != refs[b] {
			t.Fatalf("block %d: refcount %d, referenced by %d sequences", b.id, b.ref, refs[b])
		}
		switch {
		case b.state == stateFree:
		case b.ref > 0:
			used++
			if b.suspended {
				t.Fatalf("block %d: referenced but marked suspended", b.id)
			}
		default:
			cached++
			if b.state != stateIndexed || b.lru == nil {
				t.Fatalf("block %d: unreferenced but not cached (state %d)", b.id, b.state)
			}
		}
	}
	if free+used+cached != len(p.blocks) {
		t.Fatalf("free %d + used %d + cached %d != total %d", free, used, cached, len(p.blocks))
	}
	if cached != p.EvictableBlocks() {
		t.Fatalf("cached %d but the LRU lists hold %d", cached, p.EvictableBlocks())
	}
	for _, l := range []*list.List{p.probation, p.protected, p.suspended} {
		for e := l.Front(); e != nil; e = e.Next() {
			if b := e.Value.(*block); p.lruOf(b) != l || b.lru != e {
				t.Fatalf("block %d (reused %v) in the wrong LRU list", b.id, b.reused)
			}
		}
	}
	if p.budgeted() > p.budget || p.budget < p.floor || p.budget > len(p.blocks) {
		t.Fatalf("%d blocks cached (and %d suspended), budget %d (floor %d, pool %d)", p.budgeted(), p.suspended.Len(), p.budget, p.floor, len(p.blocks))
	}
	children := map[*block]int32{}
	for h, b := range p.index {
		if b.state != stateIndexed || b.hash != h {
			t.Fatalf("index entry %x not resident (state %d)", h, b.state)
		}
		if b.holder < 0 || int(b.holder) >= p.cfg.MaxSeqs {
			t.Fatalf("holder %d outside the engine's %d sequences", b.holder, p.cfg.MaxSeqs)
		}
		if p.seqs[b.holder] == seqFree {
			t.Fatalf("block held by free sequence %d", b.holder)
		}
		if b.parent != nil {
			children[b.parent]++
			if b.parent.state != stateIndexed {
				t.Fatalf("indexed block %d has a non-resident parent", b.id)
			}
		}
		// The holder physically keeps every position of the block.
		pos := sim.positions(b.holder)
		for q := b.index * int32(p.cfg.BlockTokens); q < (b.index+1)*int32(p.cfg.BlockTokens); q++ {
			if pos[q] != 1 {
				t.Fatalf("holder %d lacks position %d of block %d", b.holder, q, b.id)
			}
		}
	}
	for _, b := range p.index {
		if children[b] != b.children {
			t.Fatalf("block %d: %d children counted, %d found", b.id, b.children, children[b])
		}
		// Evictable with its image: an unreferenced block glued to its
		// parent leaves it unreferenced too (else the LRU lists could hold
		// blocks and no leaf to evict).
		if b.glued && b.parent.glue != b {
			t.Fatalf("block %d: glued to block %d, which names another as its glued child", b.id, b.parent.id)
		}
		if c := b.glue; c != nil && (c.parent != b || !c.glued || c.state != stateIndexed) {
			t.Fatalf("block %d names block %d as its glued child: its parent %p, glued %v, state %d", b.id, c.id, c.parent, c.glued, c.state)
		}
		if b.glued && b.ref == 0 && b.parent.ref > 0 {
			t.Fatalf("block %d: unreferenced, glued to block %d referenced %d times", b.id, b.parent.id, b.parent.ref)
		}
	}
	// Every running sequence sees exactly positions [0, len) once each.
	for _, r := range live {
		pos := sim.positions(r.seq.ID)
		if len(pos) != r.seq.len {
			t.Fatalf("seq %d: engine holds %d positions, pool accounts %d", r.seq.ID, len(pos), r.seq.len)
		}
		for q, n := range pos {
			if int(q) >= r.seq.len || n != 1 {
				t.Fatalf("seq %d: position %d held %d times (len %d)", r.seq.ID, q, n, r.seq.len)
			}
		}
	}
	// Holders that are not running keep only the positions of their blocks.
	for id, st := range p.seqs {
		if st == seqHolder {
			n := len(sim.positions(SeqID(id)))
			if n != p.holders[SeqID(id)]*p.cfg.BlockTokens {
				t.Fatalf("holder %d keeps %d positions for %d blocks", id, n, p.holders[SeqID(id)])
			}
		}
	}
}

// engineSim is a model of llama.cpp's KV memory that the pool's ops are applied to.
type engineSim interface {
	apply(t *testing.T, ops []Op)
	decode(t *testing.T, s SeqID, from, to int)
}

// drive runs a pseudo-random workload described by data and checks invariants.
func drive(t *testing.T, data []byte, cfg Config) {
	p, err := New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	sim := newSim(cfg.Cells)
	driveWith(t, data, cfg, p, sim, func(live []*running) { checkInvariants(t, p, sim, live) })
}

func driveWith(t *testing.T, data []byte, cfg Config, p Allocator, sim engineSim, check func([]*running)) {
	var live []*running
	next := func() byte {
		if len(data) == 0 {
			return 0
		}
		b := data[0]
		data = data[1:]
		return b
	}
	prefixes := [4][]int32{}
	for g := range prefixes {
		for i := range 80 {
			prefixes[g] = append(prefixes[g], int32(g*1000+i))
		}
	}
	// compute starts a sequence for prompt (Start or Resume) and computes the rest
	// of it, as the scheduler does; it is dropped when there is no room.
	compute := func(start func(string, []int32) (*Seq, []Op, error), model string, prompt []int32) {
		s, ops, err := start(model, prompt)
		if errors.Is(err, ErrNoSeq) {
			return
		}
		if err != nil {
			t.Fatal(err)
		}
		sim.apply(t, ops)
		if s.Len()%cfg.BlockTokens != 0 || s.Len() >= len(prompt) {
			t.Fatalf("cached %d of %d", s.Len(), len(prompt))
		}
		from := s.Len()
		ops, err = p.Grow(s, prompt[from:])
		if errors.Is(err, ErrNoSpace) {
			sim.apply(t, p.Release(s))
			return
		}
		if err != nil {
			t.Fatal(err)
		}
		sim.apply(t, ops)
		sim.decode(t, s.ID, from, s.Len())
		sim.apply(t, p.Commit(s))
		live = append(live, &running{seq: s, model: model, tokens: prompt})
	}
	for step := 0; len(data) > 0 && step < 400; step++ {
		switch op := next() % 6; op {
		case 0, 1: // start a sequence: a shared prefix of some length plus a private suffix
			g := next() % 4
			pl := int(next()) % 80
			sl := int(next())%24 + 1
			prompt := append([]int32(nil), prefixes[g][:pl]...)
			for i := range sl {
				prompt = append(prompt, int32(10000+step*100+i))
			}
			maxNew := int(next() % 32)
			model := []string{"", "", "lora"}[next()%3] // a LoRA adapter's KV is cached apart
			if !p.Fits(model, prompt, maxNew) {
				continue
			}
			compute(p.Start, model, prompt)
		case 2: // generate tokens, and drafts after them that are turned down
			if len(live) == 0 {
				continue
			}
			r := live[int(next())%len(live)]
			n := int(next())%20 + 1
			drafts := int(next()) % 8
			var toks []int32
			for i := range n + drafts {
				toks = append(toks, int32(50000+i))
			}
			from := r.seq.Len()
			ops, err := p.Grow(r.seq, toks)
			if errors.Is(err, ErrNoSpace) {
				continue
			}
			if err != nil {
				t.Fatal(err)
			}
			sim.apply(t, ops)
			sim.decode(t, r.seq.ID, from, r.seq.Len())
			ops, err = p.Trim(r.seq, from+n)
			if err != nil {
				t.Fatal(err)
			}
			sim.apply(t, ops)
			if r.seq.Len() != from+n {
				t.Fatalf("trimmed to %d, want %d", r.seq.Len(), from+n)
			}
			sim.apply(t, p.Commit(r.seq))
		case 3: // finish
			if len(live) == 0 {
				continue
			}
			i := int(next()) % len(live)
			sim.apply(t, p.Release(live[i].seq))
			live = append(live[:i], live[i+1:]...)
			if next()%8 == 0 { // and now and then drop the whole cache, as reset_prefix_cache
				check(live)
				_, ops := p.DropCached()
				sim.apply(t, ops)
				if n, ops := p.DropCached(); n != 0 || len(ops) != 0 {
					t.Fatalf("a second DropCached dropped %d blocks more", n)
				}
			}
		case 4: // fork
			if len(live) == 0 {
				continue
			}
			r := live[int(next())%len(live)]
			f, ops, err := p.Fork(r.seq)
			if errors.Is(err, ErrNoSpace) || errors.Is(err, ErrNoSeq) {
				continue
			}
			if err != nil {
				t.Fatal(err)
			}
			sim.apply(t, ops)
			live = append(live, &running{seq: f, model: r.model, tokens: r.tokens})
		case 5: // preempt and resume (its prompt again, from what is still cached), or end while preempted
			if len(live) == 0 {
				continue
			}
			i := int(next()) % len(live)
			r := live[i]
			sim.apply(t, p.Suspend(r.seq))
			live = append(live[:i], live[i+1:]...)
			check(live)
			if next()%4 == 0 {
				sim.apply(t, p.Abandon(r.model, r.tokens))
			} else {
				compute(p.Resume, r.model, r.tokens)
			}
		}
		check(live)
	}
	for _, r := range live {
		sim.apply(t, p.Release(r.seq))
	}
	check(nil)
	p.Publish()
	if st := p.Stats(); st.Used != 0 || st.Running != 0 || st.Free+st.Cached != st.Blocks {
		t.Fatalf("after releasing everything: %+v", st)
	}
}

// floors are the cache floors the workloads run with: none, the default, and the
// whole pool.
var floors = []float64{0, DefaultCacheFloor, 1}

func fuzzConfig(small bool, floor byte) Config {
	cfg := DefaultConfig()
	cfg.Cells, cfg.MaxSeqs, cfg.Model = 512, 12, "m"
	if small {
		cfg.Cells, cfg.MaxSeqs, cfg.BlockTokens = 96, 5, 8
	}
	cfg.CacheFloor = floors[int(floor)%len(floors)]
	return cfg
}

func FuzzPool(f *testing.F) {
	f.Add([]byte{0, 1, 40, 3, 5, 2, 0, 7, 0, 1, 40, 3, 5, 3, 0, 0, 1, 40, 3, 5, 4, 0}, false, byte(1))
	f.Add([]byte("a fairly long seed that drives many starts and forks and releases"), true, byte(2))
	f.Fuzz(func(t *testing.T, data []byte, small bool, floor byte) {
		drive(t, data, fuzzConfig(small, floor))
	})
}

func TestPoolRandomWorkloads(t *testing.T) {
	for seed := range 120 {
		data := make([]byte, 600)
		x := uint32(seed*2654435761 + 1)
		for i := range data {
			x ^= x << 13
			x ^= x >> 17
			x ^= x << 5
			data[i] = byte(x)
		}
		t.Run(fmt.Sprint(seed), func(t *testing.T) { drive(t, data, fuzzConfig(seed%2 == 0, byte(seed/2))) })
	}
}

// computeSeq starts a sequence for prompt on p and computes the uncached rest.
func computeSeq(t *testing.T, p *Pool, sim *simCells, prompt []int32) *Seq {
	t.Helper()
	s, ops, err := p.Start("", prompt)
	if err != nil {
		t.Fatal(err)
	}
	sim.apply(t, ops)
	from := s.Len()
	ops, err = p.Grow(s, prompt[from:])
	if err != nil {
		t.Fatal(err)
	}
	sim.apply(t, ops)
	sim.decode(t, s.ID, from, s.Len())
	sim.apply(t, p.Commit(s))
	return s
}

// seqPrompt is n tokens counting up from first.
func seqPrompt(first, n int) []int32 {
	out := make([]int32, n)
	for i := range out {
		out[i] = int32(first + i)
	}
	return out
}

func TestPrefixReuseAndEviction(t *testing.T) {
	cfg := DefaultConfig()
	cfg.Cells, cfg.MaxSeqs, cfg.BlockTokens, cfg.CacheFloor = 64, 4, 4, 1
	p, _ := New(cfg)
	sim := newSim(cfg.Cells)
	prompt := seqPrompt(1, 18) // 4 full blocks + 2
	run := func(prompt []int32) *Seq { return computeSeq(t, p, sim, prompt) }
	a := run(prompt)
	if a.Cached() != 0 {
		t.Fatalf("cold start cached %d", a.Cached())
	}
	sim.apply(t, p.Release(a))
	b := run(prompt)
	if b.Cached() != 16 {
		t.Fatalf("warm start cached %d, want 16", b.Cached())
	}
	// A prompt of exactly 4 blocks reuses only 3: the last token is always computed.
	if got := p.CachedPrefix("", prompt[:16]); got != 12 {
		t.Fatalf("cached prefix of a block-aligned prompt: %d, want 12", got)
	}
	sim.apply(t, p.Release(b))
	p.Publish()
	st := p.Stats()
	if st.HitTokens != 16 || st.Queries != 36 || st.Cached != 4 {
		t.Fatalf("stats %+v", st)
	}
	if len(p.Summary().Hashes) != 4 {
		t.Fatalf("summary %+v", p.Summary())
	}
	// Fill the pool with other prompts: the cached chain is evicted leaf first.
	c := run(seqPrompt(1000, 60))
	checkInvariants(t, p, sim, []*running{{seq: c}})
	p.Publish()
	st = p.Stats()
	if st.Free != 0 || st.Used != 15 || st.Cached != 1 {
		t.Fatalf("expected a full pool: %+v", st)
	}
	// 15 blocks needed, 12 free: the three deepest blocks of the chain went, its root stays.
	if got := p.CachedPrefix("", prompt); got != 4 || st.Evictions != 3 {
		t.Fatalf("after evicting 3 leaves: prefix %d, evictions %d", got, st.Evictions)
	}
	if _, err := p.Grow(c, make([]int32, 8)); !errors.Is(err, ErrNoSpace) {
		t.Fatalf("grow past capacity: %v", err)
	}
}

// TestRecomputedBlockJoinsTheChain: a prompt cached whole computes its last
// block again (its last token's logits); that block is swapped for the cached
// one, so what the sequence generates after it is cached too, and the pool
// holds the block once.
func TestRecomputedBlockJoinsTheChain(t *testing.T) {
	cfg := DefaultConfig()
	cfg.Cells, cfg.MaxSeqs, cfg.BlockTokens, cfg.CacheFloor = 64, 4, 4, 1
	p, _ := New(cfg)
	sim := newSim(cfg.Cells)
	prompt := seqPrompt(1, 16) // 4 full blocks
	sim.apply(t, p.Release(computeSeq(t, p, sim, prompt)))
	s := computeSeq(t, p, sim, prompt)
	if s.Cached() != 12 {
		t.Fatalf("a block-aligned prompt cached %d, want 12", s.Cached())
	}
	p.Publish()
	if st := p.Stats(); st.Used != 4 || st.Cached != 0 {
		t.Fatalf("the last block computed again is held once: %+v", st)
	}
	// Its answer, 6 tokens (one full block), one at a time.
	for tok := int32(100); tok < 106; tok++ {
		ops, err := p.Grow(s, []int32{tok})
		if err != nil {
			t.Fatal(err)
		}
		sim.apply(t, ops)
		sim.decode(t, s.ID, s.Len()-1, s.Len())
		sim.apply(t, p.Commit(s))
		checkInvariants(t, p, sim, []*running{{seq: s}})
	}
	sim.apply(t, p.Release(s))
	next := append(slices.Clone(prompt), 100, 101, 102, 103, 104, 105, 7)
	if got := p.CachedPrefix("", next); got != 20 {
		t.Fatalf("the next turn finds %d tokens cached, want 20 (the prompt and the answer's full block)", got)
	}
	checkInvariants(t, p, sim, nil)
}

// TestSuspendAndResume: a preempted sequence keeps its blocks past the cache
// budget until it resumes, and taking back its own blocks is neither a cache hit
// nor reuse that raises the budget (each preemption would otherwise ratchet it up).
func TestSuspendAndResume(t *testing.T) {
	cfg := DefaultConfig()
	cfg.Cells, cfg.MaxSeqs, cfg.BlockTokens, cfg.CacheFloor = 128, 8, 4, 0.125 // 32 blocks, floor 4
	p, _ := New(cfg)
	sim := newSim(cfg.Cells)
	a := seqPrompt(1, 42) // 10 full blocks
	sim.apply(t, p.Suspend(computeSeq(t, p, sim, a)))
	checkInvariants(t, p, sim, nil)
	if n := p.CachedPrefix("", a); n != 40 {
		t.Fatalf("suspended: %d tokens cached, want all 40 of its full blocks", n)
	}
	p.Publish()
	before, budget := p.Stats(), p.budget
	s, ops, err := p.Resume("", a)
	if err != nil {
		t.Fatal(err)
	}
	sim.apply(t, ops)
	p.Publish()
	if after := p.Stats(); s.Len() != 40 || p.budget != budget || after.Queries != before.Queries || after.HitTokens != before.HitTokens {
		t.Fatalf("resumed from %d tokens; budget %d -> %d, queries %d -> %d, hits %d -> %d", s.Len(), budget, p.budget, before.Queries, after.Queries, before.HitTokens, after.HitTokens)
	}
	sim.apply(t, p.Release(s))
	checkInvariants(t, p, sim, nil)
	if n := p.CachedPrefix("", a); n != 16 {
		t.Fatalf("released: %d tokens cached, want the budget's 16", n)
	}
	// A suspended sequence that will not resume: what was kept for it is cache
	// again, the least recently used, and the budget applies.
	b := seqPrompt(500, 42)
	sim.apply(t, p.Suspend(computeSeq(t, p, sim, b)))
	if n := p.CachedPrefix("", b); n != 40 {
		t.Fatalf("suspended: %d tokens of b cached, want 40", n)
	}
	sim.apply(t, p.Abandon("", b))
	checkInvariants(t, p, sim, nil)
	if nb, na := p.CachedPrefix("", b), p.CachedPrefix("", a); nb != 0 || na != 16 {
		t.Fatalf("abandoned: %d tokens of b and %d of a cached, want 0 and 16", nb, na)
	}
	p.Publish()
	if st := p.Stats(); st.Cached != 4 {
		t.Fatalf("abandoned: %d cached blocks, want the budget's 4", st.Cached)
	}
}

// TestCacheBudget: cached blocks beyond the floor go as their sequences end, never
// reused ones first; the first reuse of a cached block and a prompt that misses
// blocks evicted a while ago raise the budget, and it falls back as blocks nobody
// reused are evicted.
func TestCacheBudget(t *testing.T) {
	cfg := DefaultConfig()
	cfg.Cells, cfg.MaxSeqs, cfg.BlockTokens, cfg.CacheFloor = 128, 8, 4, 0.125 // 32 blocks, floor 4
	p, _ := New(cfg)
	sim := newSim(cfg.Cells)
	run := func(prompt []int32) *Seq { return computeSeq(t, p, sim, prompt) }
	release := func(s *Seq) {
		sim.apply(t, p.Release(s))
		checkInvariants(t, p, sim, nil)
	}
	a, b, c := seqPrompt(1, 18), seqPrompt(100, 18), seqPrompt(200, 18) // 4 full blocks each
	release(run(a))
	s := run(a)
	if s.Cached() != 16 || p.budget != 8 {
		t.Fatalf("a again: cached %d, budget %d; want 16 and 4 + 4 first reuses", s.Cached(), p.budget)
	}
	release(s)
	release(run(b))
	release(run(c)) // over the budget: b's never-reused blocks go first
	if p.CachedPrefix("", a) != 16 || p.CachedPrefix("", b) != 0 {
		t.Fatalf("after c: a %d and b %d tokens cached, want 16 and 0", p.CachedPrefix("", a), p.CachedPrefix("", b))
	}
	// b again misses 4 blocks evicted a few evictions ago: the budget grows to twice
	// what would have kept them, and b stays this time.
	before := p.budget
	if s := run(b); s.Cached() != 0 || p.budget < 2*(p.EvictableBlocks()+4) || p.budget <= before {
		t.Fatalf("b again: cached %d, budget %d (was %d, %d cached)", s.Cached(), p.budget, before, p.EvictableBlocks())
	} else {
		release(s)
	}
	if p.CachedPrefix("", a) != 16 || p.CachedPrefix("", b) != 16 {
		t.Fatalf("budget %d: a %d and b %d tokens cached, want both 16", p.budget, p.CachedPrefix("", a), p.CachedPrefix("", b))
	}
	// 24 prompts nobody reuses cache 96 blocks: the budget falls back to the floor,
	// and the reused blocks are the ones that stay.
	for i := range 24 {
		release(run(seqPrompt(1000+100*i, 18)))
	}
	if p.budget != p.floor || p.CachedPrefix("", a) != 16 || p.CachedPrefix("", b) != 0 {
		t.Fatalf("after 24 unique prompts: budget %d (floor %d), a %d and b %d tokens cached", p.budget, p.floor, p.CachedPrefix("", a), p.CachedPrefix("", b))
	}

	// Floor 0: a block nobody reused goes with its sequence, cells and all.
	cfg.CacheFloor = 0
	p, _ = New(cfg)
	sim = newSim(cfg.Cells)
	sim.apply(t, p.Release(computeSeq(t, p, sim, a)))
	checkInvariants(t, p, sim, nil)
	if n := len(sim.cells); n != 0 || p.CachedPrefix("", a) != 0 {
		t.Fatalf("floor 0: %d cells and %d tokens cached after release", n, p.CachedPrefix("", a))
	}
}

// TestCacheFloorFollowsTheWeights: in a pool much larger than the model, the floor
// is a share of the cells whose KV is as large as the weights.
func TestCacheFloorFollowsTheWeights(t *testing.T) {
	cfg := DefaultConfig()
	cfg.Cells, cfg.MaxSeqs, cfg.CacheFloor = 1<<16, 8, 0.5 // 4,096 blocks
	for _, c := range []struct {
		weightCells, floor int
	}{{0, 2048}, {1 << 12, 128}, {1 << 20, 2048}} {
		cfg.WeightCells = c.weightCells
		if p, _ := New(cfg); p.floor != c.floor || p.Stats().CacheBudget != c.floor {
			t.Errorf("weight cells %d: floor %d, published budget %d; want %d", c.weightCells, p.floor, p.Stats().CacheBudget, c.floor)
		}
	}
	cfg.CacheFloor, cfg.WeightCells = 1, 1<<12
	if p, _ := New(cfg); p.floor != p.TotalBlocks() {
		t.Errorf("floor 1: %d blocks always kept of %d", p.floor, p.TotalBlocks())
	}
}

func TestGhostsForgetTheOldest(t *testing.T) {
	g := newGhosts(3)
	g.add(1, 1)
	g.add(2, 2)
	g.add(1, 3) // evicted again: the newer record counts
	g.add(4, 4) // overwrites 1's first record, not its newer one
	if at, ok := g.at(1); !ok || at != 3 {
		t.Fatalf("1: %d %v, want 3", at, ok)
	}
	g.add(5, 5) // overwrites 2
	if _, ok := g.at(2); ok {
		t.Fatal("2 outlived the ring")
	}
	g.forget(4)
	if _, ok := g.at(4); ok {
		t.Fatal("4 forgotten but remembered")
	}
	if at, ok := g.at(5); !ok || at != 5 {
		t.Fatalf("5: %d %v, want 5", at, ok)
	}
}

func TestHashChain(t *testing.T) {
	h := NewHasher(1, "m")
	a := h.Chain([]int32{1, 2, 3, 4, 5, 6, 7, 8, 9}, 4)
	b := h.Chain([]int32{1, 2, 3, 4, 5, 6, 7, 8}, 4)
	if len(a) != 2 || a[0] != b[0] || a[1] != b[1] {
		t.Fatal("equal prefixes hash differently")
	}
	c := h.Chain([]int32{0, 2, 3, 4, 5, 6, 7, 8}, 4)
	if c[1] == a[1] {
		t.Fatal("a different first block must change every later hash")
	}
	if NewHasher(2, "m").Chain([]int32{1, 2, 3, 4}, 4)[0] == a[0] || NewHasher(1, "n").Chain([]int32{1, 2, 3, 4}, 4)[0] == a[0] {
		t.Fatal("seed and model must change hashes")
	}
}

func TestConfigValidate(t *testing.T) {
	for _, c := range []Config{{}, {Cells: 8, BlockTokens: 16, MaxSeqs: 1}, {Cells: 64, BlockTokens: 16},
		{Cells: 64, BlockTokens: 16, MaxSeqs: 1, CacheFloor: 1.5}, {Cells: 64, BlockTokens: 16, MaxSeqs: 1, CacheFloor: -0.1}} {
		if _, err := New(c); err == nil {
			t.Errorf("%+v: want error", c)
		}
	}
}

// TestTrim: Trim takes back uncommitted positions only, frees the blocks they
// alone used, and removes their cells.
func TestTrim(t *testing.T) {
	cfg := DefaultConfig()
	cfg.Cells, cfg.MaxSeqs, cfg.BlockTokens = 64, 4, 4
	p, err := New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	sim := newSim(cfg.Cells)
	s := computeSeq(t, p, sim, seqPrompt(1, 10)) // 2 sealed blocks, 2 positions in the third
	free := len(p.free)
	ops, err := p.Grow(s, seqPrompt(100, 7)) // to 17: blocks 3 and 4 too
	if err != nil {
		t.Fatal(err)
	}
	sim.apply(t, ops)
	sim.decode(t, s.ID, 10, 17)
	if len(p.free) != free-2 {
		t.Fatalf("free %d after growing into two blocks, want %d", len(p.free), free-2)
	}
	ops, err = p.Trim(s, 11)
	if err != nil || len(ops) != 1 || ops[0] != (Op{Kind: OpRemove, Seq: s.ID, P0: 11, P1: -1}) {
		t.Fatalf("trim ops %v %v", ops, err)
	}
	sim.apply(t, ops)
	if s.Len() != 11 || len(s.blocks) != 3 || len(p.free) != free || len(sim.positions(s.ID)) != 11 {
		t.Fatalf("after trimming to 11: len %d, %d blocks, free %d (want %d), %d cells", s.Len(), len(s.blocks), len(p.free), free, len(sim.positions(s.ID)))
	}
	checkInvariants(t, p, sim, []*running{{seq: s}})
	for _, n := range []int{12, 7} { // more than it has; into a sealed block
		if _, err := p.Trim(s, n); err == nil {
			t.Fatalf("trim to %d of 11 (8 sealed) accepted", n)
		}
	}
	if ops, err := p.Trim(s, 8); err != nil || len(ops) != 1 {
		t.Fatalf("trim to the sealed boundary: %v %v", ops, err)
	}
}

// TestModelsCacheApart: the same tokens under a LoRA adapter and under the
// model itself are different KV; each reuses only its own.
func TestModelsCacheApart(t *testing.T) {
	for _, split := range []bool{false, true} {
		cfg := DefaultConfig()
		cfg.Cells, cfg.MaxSeqs, cfg.Model, cfg.CacheFloor = 256, 4, "base", 1
		var p Allocator
		var err error
		if split {
			p, err = NewSplit(cfg, 64)
		} else {
			p, err = New(cfg)
		}
		if err != nil {
			t.Fatal(err)
		}
		prompt := make([]int32, 40)
		for i := range prompt {
			prompt[i] = int32(100 + i)
		}
		run := func(model string) int {
			s, _, err := p.Start(model, prompt)
			if err != nil {
				t.Fatal(err)
			}
			cached := s.Cached()
			if _, err := p.Grow(s, prompt[s.Len():]); err != nil {
				t.Fatal(err)
			}
			p.Commit(s)
			p.Release(s)
			return cached
		}
		if got := run(""); got != 0 {
			t.Fatalf("split %v: first run cached %d", split, got)
		}
		if got := p.CachedPrefix("lora", prompt); got != 0 {
			t.Errorf("split %v: the adapter finds %d tokens of the model's KV", split, got)
		}
		if got := run("lora"); got != 0 {
			t.Errorf("split %v: the adapter reused %d tokens of the model's KV", split, got)
		}
		if got, want := run("lora"), 32; got != want {
			t.Errorf("split %v: the adapter reused %d tokens of its own, want %d", split, got, want)
		}
		if got, want := run(""), 32; got != want {
			t.Errorf("split %v: the model reused %d tokens of its own, want %d", split, got, want)
		}
		if got, want := p.CachedPrefix("base", prompt), 32; got != want {
			t.Errorf("split %v: by its own id the model finds %d, want %d", split, got, want)
		}
	}
}

// TestUncutMedia: with Config.UncutMedia, a run of negative tokens (an
// image's placeholders) is never cut at a block's edge, in either pool: a
// cached prefix never ends within one, an image's blocks are cached together
// once the last is full, and evicted together; no op's range starts or ends
// within one.
func TestUncutMedia(t *testing.T) {
	image := func(seed int) []int32 {
		p := seqPrompt(seed, 30)
		for i := 9; i < 14; i++ {
			p[i] = -int32(seed*100 + i) // an image at [9, 14): blocks 2 and 3 of 4 tokens
		}
		return p
	}
	prompt := image(1)
	other := slices.Clone(prompt) // the same picture, other text after it
	for i := 14; i < len(other); i++ {
		other[i] = 900 + int32(i)
	}
	cuts := func(ops []Op) {
		t.Helper()
		for _, o := range ops {
			if o.P0 == 12 || o.P1 == 12 {
				t.Errorf("%v cuts the image at [9, 14)", o)
			}
		}
	}
	cfg := DefaultConfig()
	cfg.Cells, cfg.MaxSeqs, cfg.BlockTokens, cfg.CacheFloor, cfg.UncutMedia = 128, 16, 4, 1, true
	p, _ := New(cfg)
	sim := newSim(cfg.Cells)
	run := func(pr []int32) *Seq {
		s, ops, err := p.Start("", pr)
		if err != nil {
			t.Fatal(err)
		}
		cuts(ops)
		sim.apply(t, ops)
		from := s.Len()
		// In steps of 5 tokens: a step ending within the image seals nothing
		// of it.
		for at := from; at < len(pr); at += 5 {
			to := min(at+5, len(pr))
			gops, err := p.Grow(s, pr[at:to])
			if err != nil {
				t.Fatal(err)
			}
			cuts(gops)
			sim.apply(t, gops)
			sim.decode(t, s.ID, at, to)
			sim.apply(t, p.Commit(s))
		}
		return s
	}
	release := func(s *Seq) {
		ops := p.Release(s)
		cuts(ops)
		sim.apply(t, ops)
	}
	// Cancelled within its image (computed to 15): nothing of the image is
	// cached, and its release cuts nothing.
	a, ops, err := p.Start("", prompt)
	if err != nil {
		t.Fatal(err)
	}
	sim.apply(t, ops)
	for _, to := range []int{10, 15} {
		from := a.Len()
		gops, err := p.Grow(a, prompt[from:to])
		if err != nil {
			t.Fatal(err)
		}
		sim.apply(t, gops)
		sim.decode(t, a.ID, from, to)
		sim.apply(t, p.Commit(a))
	}
	release(a)
	if got := p.CachedPrefix("", prompt); got != 8 {
		t.Errorf("one pool, cancelled within the image: %d cached, want 8", got)
	}
	release(run(prompt))
	b := run(prompt)
	if b.Cached() != 28 {
		t.Errorf("one pool: %d cached, want 28, through the image", b.Cached())
	}
	// The same picture with other text after takes the picture's rows in its
	// last block too, from the image's holder: 14 tokens, not the 8 before
	// the image's first block.
	if got := p.CachedPrefix("", other); got != 14 {
		t.Errorf("one pool: the same picture with other text after: %d cached, want 14, to the image's end", got)
	}
	o := run(other)
	if o.Cached() != 14 {
		t.Errorf("one pool: the same picture with other text after started with %d cached, want 14, to the image's end", o.Cached())
	}
	checkInvariants(t, p, sim, []*running{{seq: b}, {seq: o}})
	release(o)
	release(b)
	// Filled with prompts with other pictures, the pool evicts an image's
	// blocks together.
	for k := range 6 {
		release(run(image(10 + k)))
	}
	p.Publish()
	t.Logf("after filling: %d of the prompt cached, %d evictions", p.CachedPrefix("", prompt), p.Stats().Evictions)
	if got := p.CachedPrefix("", prompt); got != 0 && got != 8 && got < 16 {
		t.Errorf("one pool after evictions: %d of the prompt cached: within its image", got)
	}
	checkInvariants(t, p, sim, nil)

	// A sequence id taken from a holder of an image: all its cells at once.
	cfg.MaxSeqs = 2
	p, _ = New(cfg)
	sim = newSim(cfg.Cells)
	release(run(prompt))
	release(run(image(2)))
	c := run(image(3))
	checkInvariants(t, p, sim, []*running{{seq: c}})

	cfg.MaxSeqs = 4
	s, err := NewSplit(cfg, 64)
	if err != nil {
		t.Fatal(err)
	}
	srun := func(pr []int32) *Seq {
		q, ops, err := s.Start("", pr)
		if err != nil {
			t.Fatal(err)
		}
		cuts(ops)
		for at := q.Len(); at < len(pr); at += 5 {
			if _, err := s.Grow(q, pr[at:min(at+5, len(pr))]); err != nil {
				t.Fatal(err)
			}
			s.Commit(q)
		}
		return q
	}
	cuts(s.Release(srun(prompt)))
	if c := srun(prompt); c.Cached() != 28 {
		t.Errorf("streams: %d cached, want 28", c.Cached())
	}
	if got := s.CachedPrefix("", other); got != 14 {
		t.Errorf("streams: the same picture with other text after: %d cached, want 14", got)
	}
	if c := srun(other); c.Cached() != 14 {
		t.Errorf("streams: the same picture with other text after started with %d cached, want 14", c.Cached())
	}
	// Without it, blocks are cut anywhere.
	cfg.UncutMedia = false
	p, _ = New(cfg)
	sim = newSim(cfg.Cells)
	release(run(prompt))
	if got := p.CachedPrefix("", other); got != 12 {
		t.Errorf("without UncutMedia: %d cached, want 12", got)
	}
}

// TestSuspendedLastBlockGivenBack: tokens a whole number of blocks long,
// suspended, then abandoned or resumed: what Suspend kept goes back to the
// budget, the last block too (which a prefix match, leaving a token to
// compute, never reaches).
func TestSuspendedLastBlockGivenBack(t *testing.T) {
	for _, uncut := range []bool{false, true} {
		cfg := DefaultConfig()
		cfg.Cells, cfg.MaxSeqs, cfg.BlockTokens, cfg.CacheFloor, cfg.UncutMedia = 64, 4, 4, 1, uncut
		p, _ := New(cfg)
		sim := newSim(cfg.Cells)
		toks := []int32{1, 2, 3, 4, 5, 6, 7, 8} // prompt 6 + 2 generated
		s := computeSeq(t, p, sim, toks)
		sim.apply(t, p.Suspend(s))
		sim.apply(t, p.Abandon("", toks))
		if n := p.suspended.Len(); n != 0 {
			t.Errorf("uncut %v: abandoned: %d blocks still kept past the budget (budget %d, cached %d)", uncut, n, p.budget, p.EvictableBlocks())
		}
		// Resume of the same leaves it suspended too.
		p, _ = New(cfg)
		sim = newSim(cfg.Cells)
		s = computeSeq(t, p, sim, toks)
		sim.apply(t, p.Suspend(s))
		r, ops, err := p.Resume("", toks)
		if err != nil {
			t.Fatal(err)
		}
		sim.apply(t, ops)
		if n := p.suspended.Len(); n != 0 {
			t.Errorf("uncut %v: resumed with %d cached: %d blocks still kept past the budget", uncut, r.Cached(), n)
		}
	}
}

// TestDropCached: every cached prefix nobody uses is dropped, one a running
// sequence holds stays shared, and the budget is as it was.
func TestDropCached(t *testing.T) {
	for _, split := range []bool{false, true} {
		cfg := DefaultConfig()
		cfg.Cells, cfg.MaxSeqs, cfg.BlockTokens = 1024, 8, 16
		var p Allocator
		var err error
		if split {
			p, err = NewSplit(cfg, 128)
		} else {
			p, err = New(cfg)
		}
		if err != nil {
			t.Fatal(err)
		}
		start := func(prompt []int32) *Seq {
			s, _, err := p.Start("", prompt)
			if err != nil {
				t.Fatal(err)
			}
			if _, err := p.Grow(s, prompt[s.Len():]); err != nil {
				t.Fatal(err)
			}
			p.Commit(s)
			return s
		}
		held, done := seqPrompt(0, 64), seqPrompt(1000, 64)
		p.Release(start(done))
		running := start(held)
		p.Publish()
		budget := p.Stats().CacheBudget
		n, ops := p.DropCached()
		p.Publish()
		if n != 4 || len(ops) == 0 || p.CachedPrefix("", append(done, 1)) != 0 || p.Stats().Cached != 0 || p.Stats().CacheBudget != budget {
			t.Fatalf("split %v: dropped %d (%d ops); %d of the released prompt still cached, stats %+v (budget was %d)",
				split, n, len(ops), p.CachedPrefix("", append(done, 1)), p.Stats(), budget)
		}
		if !split && p.CachedPrefix("", append(held, 1)) != 64 {
			t.Fatalf("the running sequence's prefix is no longer shared: %d", p.CachedPrefix("", append(held, 1)))
		}
		p.Release(running)
	}
}
