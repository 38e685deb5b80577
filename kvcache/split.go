package kvcache

import (
	"container/list"
	"fmt"
	"slices"
)

// SplitPool accounts KV memory laid out as one stream of StreamTokens cells per
// sequence id (llama.cpp with kv_unified=false). Attention then runs over each
// sequence's own cells only, which is faster at large batches (docs/benchmarks.md),
// but cells cannot be shared between streams: a cached prefix is reused by copying
// the stream that holds it (a whole-stream copy, which llama.cpp performs on the
// device) and trimming the copy, or by adopting an idle holder stream outright.
//
// A finished sequence's stream keeps its full blocks as a cache (a holder) until the
// stream is needed; holders are recycled least recently used first.
type SplitPool struct {
	cfg       Config
	hasher    Hasher
	perStream int // blocks per stream
	streams   []stream
	index     map[Hash]map[SeqID]struct{} // block hash -> streams holding it
	lru       *list.List                  // holder streams, least recently used first

	queries, hits, evictions uint64
	generation               uint64

	snapshots
}

type stream struct {
	state seqState
	chain []Hash  // hashes of the stream's committed full blocks, from position 0
	toks  []int32 // their tokens, under Config.UncutMedia (across checks them)
	seq   *Seq    // running sequence
	lru   *list.Element
	// glued: the chain ends within an image (a prefix taken to the image's
	// end, Config.UncutMedia) until the block that ends it is committed;
	// only its first safe blocks, before the image, are tracked and kept.
	glued bool
	safe  int
}

// NewSplit returns a SplitPool of cfg.MaxSeqs streams of streamTokens cells each.
func NewSplit(cfg Config, streamTokens int) (*SplitPool, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	if streamTokens < cfg.BlockTokens {
		return nil, fmt.Errorf("kvcache: stream of %d tokens holds no block of %d", streamTokens, cfg.BlockTokens)
	}
	p := &SplitPool{
		cfg:        cfg,
		hasher:     NewHasher(cfg.Seed, cfg.Model),
		perStream:  streamTokens / cfg.BlockTokens,
		streams:    make([]stream, cfg.MaxSeqs),
		index:      map[Hash]map[SeqID]struct{}{},
		lru:        list.New(),
		generation: 1,
	}
	p.Publish()
	return p, nil
}

// BlockTokens is the block size.
func (p *SplitPool) BlockTokens() int { return p.cfg.BlockTokens }

// TotalBlocks counts the blocks of all streams.
func (p *SplitPool) TotalBlocks() int { return p.perStream * len(p.streams) }

// StreamTokens is the capacity of one stream.
func (p *SplitPool) StreamTokens() int { return p.perStream * p.cfg.BlockTokens }

// match returns the number of leading blocks of prompt held by some stream (leaving
// at least one token to compute) and the streams holding the deepest of them.
func (p *SplitPool) match(h Hasher, prompt []int32) (int, map[SeqID]struct{}) {
	n, holders, _ := p.matchAcross(h, prompt)
	return p.uncut(h, prompt, n, holders)
}

// matchAcross is match, which may end within an image that ends in the next
// block (across): then end is where it ends, else 0.
func (p *SplitPool) matchAcross(h Hasher, prompt []int32) (n int, holders map[SeqID]struct{}, end int) {
	if !p.cfg.Caching || len(prompt) == 0 {
		return 0, nil, 0
	}
	B := p.cfg.BlockTokens
	var parent Hash
	for i := range (len(prompt) - 1) / B {
		hb := h.Block(parent, prompt[i*B:(i+1)*B])
		hs, ok := p.index[hb]
		if !ok {
			break
		}
		parent, holders, n = hb, hs, i+1
	}
	end = across(p.cfg, prompt, n)
	if end == 0 {
		return n, holders, 0
	}
	// The holders whose rows of the image are the prompt's, the image ending
	// there where it ends in the prompt (not another picture right after).
	off := n * B
	var same map[SeqID]struct{}
	for id := range holders {
		t := p.streams[id].toks
		if len(t) > end && slices.Equal(t[off:end], prompt[off:end]) && t[end] >= 0 {
			if same == nil {
				same = map[SeqID]struct{}{}
			}
			same[id] = struct{}{}
		}
	}
	if same == nil {
		return n, holders, 0
	}
	return n, same, end
}

// uncut is n blocks matched of prompt and their holders, cut back so that
// they do not end within an image (Config.UncutMedia).
func (p *SplitPool) uncut(h Hasher, prompt []int32, n int, holders map[SeqID]struct{}) (int, map[SeqID]struct{}) {
	m := uncut(p.cfg, prompt, n)
	if m == n {
		return n, holders
	}
	// Its holders are those of the shorter prefix.
	B := p.cfg.BlockTokens
	var parent Hash
	holders = nil
	for i := range m {
		parent = h.Block(parent, prompt[i*B:(i+1)*B])
		holders = p.index[parent]
	}
	return m, holders
}

// CachedPrefix is how many leading tokens of prompt are cached.
func (p *SplitPool) CachedPrefix(model string, prompt []int32) int {
	h := p.hasher.For(model)
	n, holders, end := p.matchAcross(h, prompt)
	if end > 0 {
		return end
	}
	n, _ = p.uncut(h, prompt, n, holders)
	return n * p.cfg.BlockTokens
}

// Fits reports whether prompt + maxNew fits a stream and a stream can be had.
func (p *SplitPool) Fits(_ string, prompt []int32, maxNew int) bool {
	if len(prompt)+maxNew > p.StreamTokens() {
		return false
	}
	for _, st := range p.streams {
		if st.state != seqRunning {
			return true
		}
	}
	return false
}

// Start takes a stream for prompt with its longest cached prefix: a copy of a
// stream holding it when a free stream exists (keeping that holder's cache), else
// adopting an idle holder of it, else a free or recycled stream with nothing cached.
func (p *SplitPool) Start(model string, prompt []int32) (*Seq, []Op, error) {
	s, ops, err := p.Resume(model, prompt)
	if err == nil {
		p.queries += uint64(len(prompt))
		p.hits += uint64(s.cached)
	}
	return s, ops, err
}

// Resume is Start for a preempted sequence, not counted as a cache lookup.
func (p *SplitPool) Resume(model string, prompt []int32) (*Seq, []Op, error) {
	h := p.hasher.For(model)
	n, holders, end := p.matchAcross(h, prompt)
	if end == 0 {
		n, holders = p.uncut(h, prompt, n, holders)
	}
	B := int32(p.cfg.BlockTokens)
	keep := int32(n) * B // the prefix's positions a stream keeps
	if end > 0 {
		// And the rows of the image it ends within, to its end: the
		// prefix's holders hold them (an image's blocks are chained together).
		keep = int32(end)
	}
	var ops []Op
	id, free := p.freeStream()
	var src SeqID = -1
	if n > 0 {
		// Deterministic choice: the lowest-numbered holder.
		for h := range holders {
			if src < 0 || h < src {
				src = h
			}
		}
	}
	if a := p.adoptable(holders); n > 0 && !free && a >= 0 {
		// No free stream: take over an idle holder of the prefix, trimmed to it.
		id = a
		p.untrack(id)
		p.lru.Remove(p.streams[id].lru)
		p.streams[id].lru = nil
		p.streams[id].chain = p.streams[id].chain[:n]
		p.streams[id].toks = p.streams[id].toks[:min(len(p.streams[id].toks), n*int(B))]
		ops = append(ops, Op{Kind: OpRemove, Seq: id, P0: keep, P1: -1})
	} else {
		if !free {
			v, ok := p.victim()
			if !ok {
				return nil, nil, ErrNoSeq
			}
			id = v
			ops = p.evict(id, ops) // not a holder of the prefix: those are all running
		}
		p.streams[id].chain, p.streams[id].toks = nil, nil
		if n > 0 {
			ops = append(ops, Op{Kind: OpCopy, Src: src, Seq: id, P0: -1, P1: -1}, Op{Kind: OpRemove, Seq: id, P0: keep, P1: -1})
			p.streams[id].chain = slices.Clone(p.streams[src].chain[:n])
			t := p.streams[src].toks
			p.streams[id].toks = slices.Clone(t[:min(len(t), n*int(B))])
		}
	}
	st := &p.streams[id]
	st.glued, st.safe = end > 0, len(st.chain)
	if st.glued {
		st.safe = uncut(p.cfg, prompt, n)
	}
	for _, h := range st.chain[:st.safe] {
		p.track(h, id)
	}
	s := &Seq{ID: id, len: int(keep), sealed: n, cached: int(keep), hasher: h, tail: slices.Clone(prompt[int(B)*n : keep])}
	if n > 0 {
		s.parent = st.chain[n-1]
	}
	st.state, st.seq = seqRunning, s
	return s, ops, nil
}

// freeStream returns a never-used or released stream, if any.
func (p *SplitPool) freeStream() (SeqID, bool) {
	for i, st := range p.streams {
		if st.state == seqFree {
			return SeqID(i), true
		}
	}
	return 0, false
}

// adoptable returns an idle holder among hs, or -1.
func (p *SplitPool) adoptable(hs map[SeqID]struct{}) SeqID {
	best := SeqID(-1)
	for h := range hs {
		if p.streams[h].state == seqHolder && (best < 0 || h < best) {
			best = h
		}
	}
	return best
}

func (p *SplitPool) track(h Hash, id SeqID) {
	m := p.index[h]
	if m == nil {
		m = map[SeqID]struct{}{}
		p.index[h] = m
		p.generation++
	}
	m[id] = struct{}{}
}

// untrack removes stream id from the index (its chain is about to change).
func (p *SplitPool) untrack(id SeqID) {
	for _, h := range p.streams[id].chain {
		if m := p.index[h]; m != nil {
			delete(m, id)
			if len(m) == 0 {
				delete(p.index, h)
				p.generation++
			}
		}
	}
}

// victim picks the holder stream to recycle: the least recently used one whose first
// block another stream also holds (its loss costs least), else the least recently
// used one.
func (p *SplitPool) victim() (SeqID, bool) {
	for e := p.lru.Front(); e != nil; e = e.Next() {
		id := e.Value.(SeqID)
		if c := p.streams[id].chain; len(c) > 0 && len(p.index[c[0]]) > 1 {
			return id, true
		}
	}
	if e := p.lru.Front(); e != nil {
		return e.Value.(SeqID), true
	}
	return 0, false
}

// evict empties holder stream id.
func (p *SplitPool) evict(id SeqID, ops []Op) []Op {
	st := &p.streams[id]
	p.untrack(id)
	p.evictions += uint64(len(st.chain))
	p.lru.Remove(st.lru)
	*st = stream{}
	return append(ops, Op{Kind: OpRemove, Seq: id, P0: 0, P1: -1})
}

// Grow accounts toks for s; a stream cannot grow past its capacity.
func (p *SplitPool) Grow(s *Seq, toks []int32) ([]Op, error) {
	if s.len+len(toks) > p.StreamTokens() {
		return nil, ErrNoSpace
	}
	s.tail = append(s.tail, toks...)
	s.len += len(toks)
	return nil, nil
}

// Spare reports whether s's stream has room for n more positions (a stream
// evicts nothing to grow).
func (p *SplitPool) Spare(s *Seq, n int) bool { return s.len+n <= p.StreamTokens() }

// Trim takes back s's positions from n on (Allocator.Trim).
func (p *SplitPool) Trim(s *Seq, n int) ([]Op, error) {
	if err := s.checkTrim(n); err != nil {
		return nil, err
	}
	if n == s.len {
		return nil, nil
	}
	s.tail = s.tail[:len(s.tail)-(s.len-n)]
	s.len = n
	return []Op{{Kind: OpRemove, Seq: s.ID, P0: int32(n), P1: -1}}, nil
}

// Commit hashes and indexes s's computed full blocks.
func (p *SplitPool) Commit(s *Seq) []Op {
	B := p.cfg.BlockTokens
	st := &p.streams[s.ID]
	for range sealable(p.cfg, s.tail, len(s.tail)/B) {
		h := s.hasher.Block(s.parent, s.tail[:B])
		if p.cfg.UncutMedia {
			st.toks = append(st.toks, s.tail[:B]...)
		}
		s.sealed++
		s.tail = s.tail[B:]
		s.parent = h
		st.chain = append(st.chain, h)
		if st.glued { // past the image now: its blocks are kept too
			st.glued = false
			for _, g := range st.chain[st.safe : len(st.chain)-1] {
				p.track(g, s.ID)
			}
		}
		if p.cfg.Caching {
			p.track(h, s.ID)
		}
	}
	s.tail = append(s.tail[:0:0], s.tail...)
	return nil
}

// Release ends s: its stream keeps its full blocks as a holder, or is freed.
func (p *SplitPool) Release(s *Seq) []Op {
	st := &p.streams[s.ID]
	st.seq = nil
	B := int32(p.cfg.BlockTokens)
	if st.glued { // the chain ends within an image: kept to before it
		st.chain, st.glued = st.chain[:st.safe], false
		st.toks = st.toks[:min(len(st.toks), st.safe*int(B))]
	}
	if !p.cfg.Caching || len(st.chain) == 0 {
		p.untrack(s.ID)
		*st = stream{}
		return []Op{{Kind: OpRemove, Seq: s.ID, P0: 0, P1: -1}}
	}
	st.state = seqHolder
	st.lru = p.lru.PushBack(s.ID)
	return []Op{{Kind: OpRemove, Seq: s.ID, P0: int32(len(st.chain)) * B, P1: -1}}
}

// DropCached empties every holder stream. A preempted sequence's stream is
// one too (Suspend is Release here): it computes its tokens again.
func (p *SplitPool) DropCached() (int, []Op) {
	n := 0
	var ops []Op
	for id := range p.streams {
		if st := &p.streams[id]; st.state == seqHolder {
			n += len(st.chain)
			ops = p.evict(SeqID(id), ops)
		}
	}
	return n, ops
}

// Suspend is Release: a stream keeps its blocks whole until it is taken.
func (p *SplitPool) Suspend(s *Seq) []Op { return p.Release(s) }

// Abandon has nothing to do: Suspend kept nothing past the budget.
func (p *SplitPool) Abandon(string, []int32) []Op { return nil }

// Fork copies s's stream to a new one.
func (p *SplitPool) Fork(s *Seq) (*Seq, []Op, error) {
	var ops []Op
	id, free := p.freeStream()
	if !free {
		v, ok := p.victim()
		if !ok {
			return nil, nil, ErrNoSeq
		}
		id = v
		ops = p.evict(id, ops)
	}
	ops = append(ops, Op{Kind: OpCopy, Src: s.ID, Seq: id, P0: -1, P1: -1})
	st := &p.streams[id]
	st.chain = slices.Clone(p.streams[s.ID].chain)
	st.toks = slices.Clone(p.streams[s.ID].toks)
	st.glued, st.safe = p.streams[s.ID].glued, p.streams[s.ID].safe
	if p.cfg.Caching {
		tracked := st.chain
		if st.glued {
			tracked = st.chain[:st.safe]
		}
		for _, h := range tracked {
			p.track(h, id)
		}
	}
	f := &Seq{ID: id, len: s.len, tail: slices.Clone(s.tail), sealed: s.sealed, parent: s.parent, cached: s.cached, hasher: s.hasher}
	st.state, st.seq = seqRunning, f
	return f, ops, nil
}

// Publish refreshes the snapshots read by Stats and Summary.
func (p *SplitPool) Publish() {
	used, cached, running, holders := 0, 0, 0, 0
	B := p.cfg.BlockTokens
	for _, st := range p.streams {
		switch st.state {
		case seqRunning:
			running++
			used += (st.seq.len + B - 1) / B
		case seqHolder:
			holders++
			cached += len(st.chain)
		}
	}
	total := p.TotalBlocks()
	publish(&p.snapshots, Stats{
		Blocks: total, Free: total - used - cached, Used: used, Cached: cached, CacheBudget: total,
		Queries: p.queries, HitTokens: p.hits, Evictions: p.evictions,
		Holders: holders, Running: running, BlockTokens: B, Generation: p.generation,
	}, p.index)
}
