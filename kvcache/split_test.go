package kvcache

import (
	"fmt"
	"testing"
)

// splitSim models llama.cpp's memory with one stream per sequence: a copy replaces
// the destination stream with the source's, a removal trims.
type splitSim struct {
	perStream int
	pos       map[SeqID]map[int32]bool
}

func newSplitSim(perStream int) *splitSim {
	return &splitSim{perStream: perStream, pos: map[SeqID]map[int32]bool{}}
}

func (c *splitSim) apply(t *testing.T, ops []Op) {
	t.Helper()
	for _, o := range ops {
		switch o.Kind {
		case OpCopy:
			if o.P0 >= 0 && o.P0 != 0 || o.P1 >= 0 {
				t.Fatalf("partial copy between streams: %v", o)
			}
			m := map[int32]bool{}
			for q := range c.pos[o.Src] {
				m[q] = true
			}
			c.pos[o.Seq] = m
		case OpRemove:
			p1 := o.P1
			if p1 < 0 {
				p1 = 1 << 30
			}
			for q := range c.pos[o.Seq] {
				if q >= o.P0 && q < p1 {
					delete(c.pos[o.Seq], q)
				}
			}
		}
	}
}

func (c *splitSim) decode(t *testing.T, s SeqID, from, to int) {
	t.Helper()
	if c.pos[s] == nil {
		c.pos[s] = map[int32]bool{}
	}
	for q := from; q < to; q++ {
		if c.pos[s][int32(q)] {
			t.Fatalf("stream %d: position %d written twice", s, q)
		}
		c.pos[s][int32(q)] = true
	}
	if len(c.pos[s]) > c.perStream {
		t.Fatalf("stream %d holds %d cells, capacity %d", s, len(c.pos[s]), c.perStream)
	}
}

func checkSplit(t *testing.T, p *SplitPool, sim *splitSim, live []*running) {
	t.Helper()
	B := p.cfg.BlockTokens
	running := map[SeqID]bool{}
	for _, r := range live {
		id := r.seq.ID
		if running[id] {
			t.Fatalf("stream %d runs twice", id)
		}
		running[id] = true
		if p.streams[id].state != seqRunning {
			t.Fatalf("live sequence on stream %d in state %d", id, p.streams[id].state)
		}
		if n := len(sim.pos[id]); n != r.seq.len {
			t.Fatalf("stream %d: engine holds %d positions, pool accounts %d", id, n, r.seq.len)
		}
		for q := range r.seq.len {
			if !sim.pos[id][int32(q)] {
				t.Fatalf("stream %d lacks position %d", id, q)
			}
		}
	}
	for i, st := range p.streams {
		id := SeqID(i)
		if p.cfg.UncutMedia && len(st.toks) != len(st.chain)*B {
			t.Fatalf("stream %d: %d tokens for %d blocks", id, len(st.toks), len(st.chain))
		}
		switch st.state {
		case seqRunning:
			if !running[id] {
				t.Fatalf("stream %d running without a live sequence", id)
			}
		case seqHolder:
			if len(sim.pos[id]) != len(st.chain)*B || len(st.chain) == 0 {
				t.Fatalf("holder %d keeps %d positions for %d blocks", id, len(sim.pos[id]), len(st.chain))
			}
		case seqFree:
			if len(sim.pos[id]) != 0 {
				t.Fatalf("free stream %d holds %d positions", id, len(sim.pos[id]))
			}
		}
	}
	for h, ids := range p.index {
		for id := range ids {
			found := false
			for i, x := range p.streams[id].chain {
				if x == h {
					found = true
					for q := i * B; q < (i+1)*B; q++ {
						if !sim.pos[id][int32(q)] {
							t.Fatalf("stream %d indexed for block %d lacks position %d", id, i, q)
						}
					}
				}
			}
			if !found {
				t.Fatalf("index names stream %d for a hash it does not hold", id)
			}
		}
	}
	p.Publish()
	st := p.Stats()
	if st.Free < 0 || st.Free+st.Used+st.Cached != st.Blocks {
		t.Fatalf("split stats %+v", st)
	}
}

func driveSplit(t *testing.T, data []byte, small bool) {
	cfg := fuzzConfig(small, 0)
	perStream := 160
	if small {
		perStream = 48
	}
	p, err := NewSplit(cfg, perStream)
	if err != nil {
		t.Fatal(err)
	}
	sim := newSplitSim(perStream)
	driveWith(t, data, cfg, p, sim, func(live []*running) { checkSplit(t, p, sim, live) })
}

func FuzzSplitPool(f *testing.F) {
	f.Add([]byte{0, 1, 40, 3, 5, 2, 0, 7, 0, 1, 40, 3, 5, 3, 0, 0, 1, 40, 3, 5, 4, 0}, false)
	f.Add([]byte("a fairly long seed that drives many starts and forks and releases"), true)
	f.Fuzz(func(t *testing.T, data []byte, small bool) { driveSplit(t, data, small) })
}

func TestSplitRandomWorkloads(t *testing.T) {
	for seed := range 120 {
		data := make([]byte, 600)
		x := uint32(seed*2654435761 + 7)
		for i := range data {
			x ^= x << 13
			x ^= x >> 17
			x ^= x << 5
			data[i] = byte(x)
		}
		t.Run(fmt.Sprint(seed), func(t *testing.T) { driveSplit(t, data, seed%2 == 0) })
	}
}

func TestSplitReuseByCopyAndAdoption(t *testing.T) {
	cfg := DefaultConfig()
	cfg.Cells, cfg.MaxSeqs, cfg.BlockTokens = 1, 2, 4 // Cells unused in split mode beyond validation
	cfg.Cells = 4
	p, err := NewSplit(cfg, 32)
	if err != nil {
		t.Fatal(err)
	}
	sim := newSplitSim(32)
	prompt := make([]int32, 18)
	for i := range prompt {
		prompt[i] = int32(i + 1)
	}
	start := func(pr []int32) (*Seq, []Op) {
		s, ops, err := p.Start("", pr)
		if err != nil {
			t.Fatal(err)
		}
		sim.apply(t, ops)
		from := s.Len()
		gops, err := p.Grow(s, pr[from:])
		if err != nil {
			t.Fatal(err)
		}
		sim.apply(t, gops)
		sim.decode(t, s.ID, from, s.Len())
		sim.apply(t, p.Commit(s))
		return s, ops
	}
	a, _ := start(prompt)
	sim.apply(t, p.Release(a))
	// A free stream exists: the prefix is copied, the holder keeps its cache.
	b, ops := start(prompt)
	if b.Cached() != 16 || len(ops) != 2 || ops[0].Kind != OpCopy || b.ID == a.ID {
		t.Fatalf("copy reuse: cached %d ops %v", b.Cached(), ops)
	}
	sim.apply(t, p.Release(b))
	// Both streams are holders now: the next start adopts one.
	c, ops := start(prompt)
	if c.Cached() != 16 || len(ops) != 1 || ops[0].Kind != OpRemove {
		t.Fatalf("adoption: cached %d ops %v", c.Cached(), ops)
	}
	checkSplit(t, p, sim, []*running{{seq: c}})
}
