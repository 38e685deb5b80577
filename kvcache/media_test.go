package kvcache

import (
	"errors"
	"fmt"
	"math/rand/v2"
	"slices"
	"testing"
)

// cutSim wraps an engine sim: it keeps the tokens of the sequence whose cells
// each id holds and fails any op whose range ends strictly within an image of
// that layout (Config.UncutMedia): within a run of negative tokens, not at
// the first row of an image (mediaPrompt's -1000(k+1)) that follows another
// at once (a prefix that ends with the first of two adjacent images at a
// block's edge).
type cutSim struct {
	engineSim
	layout map[SeqID][]int32
}

// cutsImage reports whether position p falls strictly within an image of
// layout l (see cutSim).
func cutsImage(l []int32, p int32) bool {
	return p > 0 && int(p) < len(l) && l[p-1] < 0 && l[p] < 0 && l[p]%1000 != 0
}

func (c *cutSim) place(id SeqID, toks []int32) { c.layout[id] = toks }

func (c *cutSim) apply(t *testing.T, ops []Op) {
	t.Helper()
	for _, o := range ops {
		id := o.Seq
		if o.Kind == OpCopy {
			id = o.Src
		}
		for _, p := range []int32{o.P0, o.P1} {
			if cutsImage(c.layout[id], p) {
				t.Fatalf("%v cuts an image of %d's layout at %d", o, id, p)
			}
		}
	}
	c.engineSim.apply(t, ops)
}

// mediaSeq is a running sequence of the workload.
type mediaSeq struct {
	seq    *Seq
	tokens []int32 // prompt, then generated
	plen   int
}

// mediaPrompt is a random prompt of text and images (six pictures of 1 to 20
// tokens).
func mediaPrompt(rng *rand.Rand, step int) []int32 {
	var p []int32
	img := func(k int) {
		n := []int{1, 3, 6, 9, 13, 20}[k%6]
		for i := range n {
			p = append(p, -int32(1000*(k+1)+i)) // image k
		}
	}
	text := func(seed, n int) {
		for i := range n {
			p = append(p, int32(seed*100+i))
		}
	}
	text(rng.IntN(3), 1+rng.IntN(10))
	for range rng.IntN(3) {
		if rng.IntN(3) > 0 {
			text(3+rng.IntN(3), rng.IntN(6)+1)
		}
		img(rng.IntN(6))
	}
	if rng.IntN(3) == 0 {
		text(50000+step, 1+rng.IntN(8))
	} else {
		text(9, 1+rng.IntN(4))
	}
	return p
}

// TestMediaWorkloads: random workloads of prompts with images (runs of
// negative tokens) under Config.UncutMedia, in both pools (chunked prefill,
// releases within an image, forks, suspensions resumed or abandoned,
// proposals turned down, evictions): no op's range ends within an image of
// the layout its sequence id holds, and accounting and cells agree.
func TestMediaWorkloads(t *testing.T) {
	for seed := range 300 {
		for _, split := range []bool{false, true} {
			t.Run(fmt.Sprintf("%d-split%v", seed, split), func(t *testing.T) { mediaWorkload(t, uint64(seed), split) })
		}
	}
}

func mediaWorkload(t *testing.T, seed uint64, split bool) {
	rng := rand.New(rand.NewPCG(seed, 1))
	cfg := DefaultConfig()
	cfg.UncutMedia = true
	cfg.BlockTokens = []int{2, 4, 8}[rng.IntN(3)]
	cfg.Cells = cfg.BlockTokens * (10 + rng.IntN(30))
	cfg.MaxSeqs = 2 + rng.IntN(6)
	cfg.CacheFloor = floors[rng.IntN(3)]
	p, _, inner, checkSeqs := poolUnderTest(t, cfg, split, 64)
	sim := &cutSim{inner, map[SeqID][]int32{}}
	check := func(live []*mediaSeq) {
		var r []*Seq
		for _, l := range live {
			r = append(r, l.seq)
		}
		checkSeqs(r)
	}
	var live []*mediaSeq
	// advance computes up to n more tokens of l (its prompt, then generated).
	advance := func(l *mediaSeq, n int) bool {
		from := l.seq.Len()
		if from >= len(l.tokens) {
			for i := range n {
				l.tokens = append(l.tokens, int32(70000+i+from))
			}
		}
		to := min(len(l.tokens), from+n)
		ops, err := p.Grow(l.seq, l.tokens[from:to])
		if errors.Is(err, ErrNoSpace) {
			return false
		}
		if err != nil {
			t.Fatal(err)
		}
		sim.apply(t, ops)
		sim.decode(t, l.seq.ID, from, to)
		sim.apply(t, p.Commit(l.seq))
		return true
	}
	start := func(f func(string, []int32) (*Seq, []Op, error), toks []int32, plen int) {
		s, ops, err := f("", toks)
		if errors.Is(err, ErrNoSeq) {
			return
		}
		if err != nil {
			t.Fatal(err)
		}
		sim.place(s.ID, toks)
		sim.apply(t, ops)
		l := &mediaSeq{seq: s, tokens: slices.Clone(toks), plen: plen}
		sim.layout[s.ID] = l.tokens
		live = append(live, l)
	}
	for step := range 300 {
		switch rng.IntN(7) {
		case 0:
			pr := mediaPrompt(rng, step)
			if !p.Fits("", pr, 4) {
				continue
			}
			start(p.Start, pr, len(pr))
		case 1, 2: // a chunk
			if len(live) == 0 {
				continue
			}
			l := live[rng.IntN(len(live))]
			advance(l, 1+rng.IntN(12))
		case 3: // release
			if len(live) == 0 {
				continue
			}
			i := rng.IntN(len(live))
			sim.apply(t, p.Release(live[i].seq))
			live = slices.Delete(live, i, i+1)
		case 4: // fork, prompt computed
			if len(live) == 0 {
				continue
			}
			l := live[rng.IntN(len(live))]
			if l.seq.Len() < l.plen {
				continue
			}
			f, ops, err := p.Fork(l.seq)
			if errors.Is(err, ErrNoSpace) || errors.Is(err, ErrNoSeq) {
				continue
			}
			if err != nil {
				t.Fatal(err)
			}
			toks := slices.Clone(l.tokens[:l.seq.Len()])
			sim.place(f.ID, toks)
			sim.apply(t, ops)
			live = append(live, &mediaSeq{seq: f, tokens: toks, plen: l.plen})
		case 5: // suspend, then resume or abandon
			if len(live) == 0 {
				continue
			}
			i := rng.IntN(len(live))
			l := live[i]
			sim.apply(t, p.Suspend(l.seq))
			live = slices.Delete(live, i, i+1)
			check(live)
			toks := l.tokens[:max(l.seq.Len(), l.plen)]
			if rng.IntN(4) == 0 {
				sim.apply(t, p.Abandon("", toks))
			} else if p.Fits("", toks, 1) {
				start(p.Resume, toks, l.plen)
			}
		case 6: // drafts turned down after a generated token
			if len(live) == 0 {
				continue
			}
			l := live[rng.IntN(len(live))]
			if l.seq.Len() < l.plen {
				continue
			}
			from := l.seq.Len()
			var toks []int32
			for i := range 1 + rng.IntN(6) {
				toks = append(toks, int32(80000+i))
			}
			ops, err := p.Grow(l.seq, toks)
			if errors.Is(err, ErrNoSpace) {
				continue
			}
			if err != nil {
				t.Fatal(err)
			}
			sim.apply(t, ops)
			sim.decode(t, l.seq.ID, from, l.seq.Len())
			ops, err = p.Trim(l.seq, from+1)
			if err != nil {
				t.Fatal(err)
			}
			sim.apply(t, ops)
			l.tokens = append(l.tokens[:from], toks[0])
			sim.apply(t, p.Commit(l.seq))
		}
		check(live)
	}
	for _, l := range live {
		sim.apply(t, p.Release(l.seq))
	}
	check(nil)
}

// acrossPool is a one-pool allocator of blocks of 4 under UncutMedia that
// keeps what nobody reused, with run and release on its engine sim.
func acrossPool(t *testing.T, cells int) (p *Pool, run func([]int32) *Seq, release func(*Seq)) {
	t.Helper()
	cfg := DefaultConfig()
	cfg.Cells, cfg.MaxSeqs, cfg.BlockTokens, cfg.CacheFloor, cfg.UncutMedia = cells, 4, 4, 1, true
	p, err := New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	sim := newSim(cells)
	run = func(prompt []int32) *Seq {
		t.Helper()
		s := computeSeq(t, p, sim, prompt)
		checkInvariants(t, p, sim, []*running{{seq: s}})
		return s
	}
	release = func(s *Seq) { sim.apply(t, p.Release(s)) }
	return p, run, release
}

// TestAcrossImageChain: the holder's block that ends the picture a prompt
// takes to its end also starts another picture, which goes on into the next
// block: the whole chain is pinned, so the LRU lists never count a block
// that cannot be evicted, and a pool that is full says ErrNoSpace.
func TestAcrossImageChain(t *testing.T) {
	// Text, picture A into block 1, text, picture B from block 1 into block 2.
	holder := []int32{1, 2, -101, -102, -103, -104, 50, -201, -202, -203, 60, 61, 62, 63}
	other := append(slices.Clone(holder[:6]), 70, 71, 72, 73, 74, 75)
	p, run, release := acrossPool(t, 64)
	release(run(holder))
	if s := run(other); s.Cached() != 6 || len(s.pins) != 2 {
		t.Errorf("cached %d with %d blocks pinned, want 6 (through A) and 2 (the blocks of B)", s.Cached(), len(s.pins))
	}
	p, run, release = acrossPool(t, 16) // 4 blocks
	release(run(holder))
	s, _, err := p.Start("", other)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := p.Grow(s, other[s.Len():]); err != nil && !errors.Is(err, ErrNoSpace) {
		t.Errorf("grow in a full pool: %v, want ErrNoSpace", err)
	}
}

// TestAcrossAbandon: a suspended sequence that took a picture to its end
// gives back, when abandoned, the picture's blocks and the holder's pinned
// ones too, not only those before the picture.
func TestAcrossAbandon(t *testing.T) {
	holder := []int32{1, 2, -101, -102, -103, -104, 50, 51, 52, 53, 54, 55, 56}
	other := append(slices.Clone(holder[:6]), 80, 81, 82, 83, 84, 85)
	p, run, release := acrossPool(t, 64)
	release(run(holder))
	s := run(other)
	if s.Cached() != 6 {
		t.Fatalf("cached %d, want 6", s.Cached())
	}
	p.Suspend(s)
	p.Abandon("", other)
	if n := p.suspended.Len(); n != 0 {
		t.Errorf("abandoned: %d blocks still kept past the budget", n)
	}
}

// TestAcrossAdjacentImages: the holder has picture A then picture B at once,
// the prompt A then C: the prompt's run of placeholders ends where C ends,
// but B's cells are not C's: only the blocks before the pictures are taken,
// in both pools.
func TestAcrossAdjacentImages(t *testing.T) {
	holder := []int32{1, 2, 3, -1000, -1001, -1002, -1003, -1004, -1005, -2000, -2001, 60, 61, 62, 63, 64}
	other := slices.Clone(holder)
	other[9], other[10] = -3000, -3001
	_, run, release := acrossPool(t, 64)
	release(run(holder))
	if s := run(other); s.Cached() != 0 {
		t.Errorf("one pool: %d cached, want 0 (C's rows are not B's)", s.Cached())
	}
	cfg := DefaultConfig()
	cfg.Cells, cfg.MaxSeqs, cfg.BlockTokens, cfg.CacheFloor, cfg.UncutMedia = 64, 4, 4, 1, true
	sp, err := NewSplit(cfg, 64)
	if err != nil {
		t.Fatal(err)
	}
	srun := func(prompt []int32) *Seq {
		s, _, err := sp.Start("", prompt)
		if err != nil {
			t.Fatal(err)
		}
		if _, err := sp.Grow(s, prompt[s.Len():]); err != nil {
			t.Fatal(err)
		}
		sp.Commit(s)
		return s
	}
	sp.Release(srun(holder))
	if s := srun(other); s.Cached() != 0 {
		t.Errorf("streams: %d cached, want 0", s.Cached())
	}
}

// TestPinsFit: a prompt that would fit only without the holder's blocks it
// would pin (the rest of a picture, or a picture right after its cached
// prefix's last one) is admitted by Fits and takes only the blocks before
// the picture: it then grows, alone in a full pool, without ErrNoSpace.
func TestPinsFit(t *testing.T) {
	for _, c := range []struct {
		name           string
		holder, prompt []int32
	}{
		{"across", []int32{1, 2, -101, -102, -103, -104, 50, -201, -202, -203, 60, 61, 62, 63}, []int32{1, 2, -101, -102, -103, -104, 70, 71, 72, 73, 74, 75}},
		{"a picture right after, at a block's edge", []int32{1, 2, -101, -102, -201, -202, 50, 51, 52}, []int32{1, 2, -101, -102, 60, 61, 62, 63, 64, 65, 66, 67, 68}},
	} {
		p, run, release := acrossPool(t, 16) // 4 blocks
		release(run(c.holder))
		if !p.Fits("", c.prompt, 0) {
			t.Errorf("%s: does not fit", c.name)
			continue
		}
		s, _, err := p.Start("", c.prompt)
		if err != nil {
			t.Fatal(err)
		}
		if _, err := p.Grow(s, c.prompt[s.Len():]); err != nil {
			t.Errorf("%s: %d cached, %d pinned, grow: %v", c.name, s.Cached(), len(s.pins), err)
		}
	}
	// With room, the picture right after is pinned, and the invariants hold
	// (run checks them).
	_, run, release := acrossPool(t, 64)
	release(run([]int32{1, 2, -101, -102, -201, -202, 50, 51, 52}))
	if s := run([]int32{1, 2, -101, -102, 60, 61, 62, 63, 64, 65, 66, 67, 68}); s.Cached() != 4 || len(s.pins) != 1 {
		t.Errorf("%d cached with %d pinned, want 4 and 1", s.Cached(), len(s.pins))
	}
}

// TestAcrossResumeFallback: a sequence that took a picture to its end,
// suspended, resumes when no block is free for the picture's last rows: it
// takes the blocks before the picture, and what Suspend kept of the picture
// goes back to the budget, trimmed to it.
func TestAcrossResumeFallback(t *testing.T) {
	cfg := DefaultConfig()
	cfg.Cells, cfg.MaxSeqs, cfg.BlockTokens, cfg.CacheFloor, cfg.UncutMedia = 32, 4, 4, 0.25, true
	p, err := New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	sim := newSim(cfg.Cells)
	run := func(prompt []int32) *Seq { return computeSeq(t, p, sim, prompt) }
	sim.apply(t, p.Release(run([]int32{1, 2, -101, -102, -103, -104, 50, 51, 52})))
	other := []int32{1, 2, -101, -102, -103, -104, 70, 71, 72}
	s := run(other)
	if s.Cached() != 6 {
		t.Fatalf("cached %d, want 6", s.Cached())
	}
	sim.apply(t, p.Suspend(s))
	sim.apply(t, p.Release(run([]int32{5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17})))
	u := run([]int32{20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30, 31})
	if p.FreeBlocks() != 0 {
		t.Fatalf("%d blocks free, want none", p.FreeBlocks())
	}
	r, ops, err := p.Resume("", other)
	if err != nil {
		t.Fatal(err)
	}
	sim.apply(t, ops)
	if r.Cached() >= 6 {
		t.Errorf("resumed with %d cached, want the blocks before the picture (no block free for its rows)", r.Cached())
	}
	checkInvariants(t, p, sim, []*running{{seq: u}, {seq: r}})
}

// Picture A ends at block 0's edge and picture B starts block 1 (glued to
// block 0) in the holder's prompt; edgeAsk has A, then text.
var (
	edgeHolder = []int32{1, 2, -101, -102, -201, -202, 50, 51, 52}
	edgeAsk    = []int32{1, 2, -101, -102, 60, 61, 62, 63, 64}
)

// TestPictureAtEdgeThenText: a prompt with A then text pins B's block while
// it runs; its own text block is not indexed beside B's (a block another
// picture goes on from has no other child), so a later prompt that goes on
// as it did, its own resume, or its abandonment never leave B's block
// unreferenced while block 0 is referenced, nor kept past the budget.
func TestPictureAtEdgeThenText(t *testing.T) {
	longer := append(slices.Clone(edgeAsk), 65, 66, 67, 68)
	p, run, release := acrossPool(t, 64) // run checks the invariants
	release(run(edgeHolder))
	s := run(edgeAsk)
	if s.Cached() != 4 || len(s.pins) != 1 {
		t.Errorf("%d cached with %d pinned, want 4 and 1", s.Cached(), len(s.pins))
	}
	release(s)
	release(run(longer))
	// Its own resume.
	s = run(longer)
	p.Suspend(s)
	r, _, err := p.Resume("", longer)
	if err != nil {
		t.Fatal(err)
	}
	if r.Cached() != 4 || len(r.pins) != 1 {
		t.Errorf("resumed with %d cached and %d pinned, want 4 and 1", r.Cached(), len(r.pins))
	}
	p.Suspend(r)
	p.Abandon("", longer)
	for e := p.suspended.Front(); e != nil; e = e.Next() {
		t.Errorf("abandoned: block %d still kept past the budget", e.Value.(*block).id)
	}
	// In a full pool: Fits, then it grows by what Fits counted.
	p, run, release = acrossPool(t, 16)
	release(run(edgeHolder))
	release(run(edgeAsk))
	if !p.Fits("", longer, 3) {
		t.Fatal("does not fit")
	}
	s, _, err = p.Start("", longer)
	if err != nil {
		t.Fatal(err)
	}
	for i, toks := range [][]int32{longer[s.Len():], {90}, {91}, {92}} {
		if _, err := p.Grow(s, toks); err != nil {
			t.Fatalf("grow %d, alone in the pool: %v", i, err)
		}
		p.Commit(s)
	}
}

// TestFitsChoosesForStart: Fits finds no block free for a picture's last
// rows and chooses the blocks before it; Start, which frees blocks taking a
// sequence id, keeps that choice (a picture to its end, and the holder's
// block it pins, would not leave room for what Fits counted).
func TestFitsChoosesForStart(t *testing.T) {
	cfg := DefaultConfig()
	cfg.Cells, cfg.MaxSeqs, cfg.BlockTokens, cfg.CacheFloor, cfg.UncutMedia = 16, 2, 4, 1, true
	p, err := New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	sim := newSim(cfg.Cells)
	sim.apply(t, p.Release(computeSeq(t, p, sim, []int32{5, 6, 7, 8, 9, 10, 11, 12})))
	sim.apply(t, p.Release(computeSeq(t, p, sim, []int32{1, 2, -101, -102, -103, -104, 50, 51})))
	a := []int32{1, 2, -101, -102, -103, -104, 70, 71, 72, 73, 74, 75, 76}
	if !p.Fits("", a, 3) {
		t.Fatal("does not fit")
	}
	s, _, err := p.Start("", a)
	if err != nil {
		t.Fatal(err)
	}
	for i, toks := range [][]int32{a[s.Len():], {90}, {91}, {92}} {
		if _, err := p.Grow(s, toks); err != nil {
			t.Fatalf("grow %d, alone in the pool (%d cached, %d pinned): %v", i, s.Cached(), len(s.pins), err)
		}
		p.Commit(s)
	}
}

// poolUnderTest is a new pool of cfg, per-stream (of streamTokens each) when
// split, with the engine sim its ops go to and a check of the invariants
// with the live sequences. pp is the one pool, when not split.
func poolUnderTest(t *testing.T, cfg Config, split bool, streamTokens int) (p Allocator, pp *Pool, sim engineSim, check func([]*Seq)) {
	t.Helper()
	live := func(seqs []*Seq) []*running {
		var r []*running
		for _, s := range seqs {
			r = append(r, &running{seq: s})
		}
		return r
	}
	if split {
		sp, err := NewSplit(cfg, streamTokens)
		if err != nil {
			t.Fatal(err)
		}
		ss := newSplitSim(streamTokens)
		return sp, nil, ss, func(seqs []*Seq) { checkSplit(t, sp, ss, live(seqs)) }
	}
	pp, err := New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	us := newSim(cfg.Cells)
	return pp, pp, us, func(seqs []*Seq) { checkInvariants(t, pp, us, live(seqs)) }
}
