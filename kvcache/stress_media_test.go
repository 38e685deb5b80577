package kvcache

import (
	"errors"
	"fmt"
	"math/rand/v2"
	"slices"
	"testing"
)

// stressEngine wraps an engine sim: it checks the cut rule (cutSim's) and
// keeps, per sequence id, the token each position holds, so that copied
// prefixes are checked to be the prompt's own tokens.
type stressEngine struct {
	inner  engineSim
	split  bool
	layout map[SeqID][]int32
	view   map[SeqID]map[int32]int32
	fail   func(format string, args ...any)
}

func (e *stressEngine) apply(t *testing.T, ops []Op) {
	t.Helper()
	for _, o := range ops {
		id := o.Seq
		if o.Kind == OpCopy {
			id = o.Src
		}
		l := e.layout[id]
		for _, p := range []int32{o.P0, o.P1} {
			if cutsImage(l, p) {
				e.fail("CUT: %v cuts an image of %d's layout at %d (layout %v)", o, id, p, l)
			}
		}
		p1 := o.P1
		if p1 < 0 {
			p1 = 1 << 30
		}
		switch o.Kind {
		case OpRemove:
			for q := range e.view[o.Seq] {
				if q >= o.P0 && q < p1 {
					delete(e.view[o.Seq], q)
				}
			}
		case OpCopy:
			if e.split {
				e.view[o.Seq] = map[int32]int32{}
			}
			if e.view[o.Seq] == nil {
				e.view[o.Seq] = map[int32]int32{}
			}
			for q, v := range e.view[o.Src] {
				if q >= o.P0 && q < p1 {
					e.view[o.Seq][q] = v
				}
			}
		}
	}
	e.inner.apply(t, ops)
}

func (e *stressEngine) decode(t *testing.T, s SeqID, toks []int32, from, to int) {
	t.Helper()
	if e.view[s] == nil {
		e.view[s] = map[int32]int32{}
	}
	for q := from; q < to; q++ {
		e.view[s][int32(q)] = toks[q]
	}
	e.inner.decode(t, s, from, to)
}

type stressSeq struct {
	seq    *Seq
	tokens []int32 // prompt, then generated (committed)
	plen   int
	maxNew int
	pre    int // prefill target: the prompt, or what a resume starts from
	limit  int // the length it generates up to
	budget int // positions Fits promised room for (0: not admitted by Fits)
	model  string
	alone  bool
}

type stressSusp struct {
	model        string
	tokens       []int32
	plen, maxNew int
}

type segment struct {
	kind int // 0 shared text, 1 image, 2 unique text
	k, n int
}

// stressWorkload drives a pool as the scheduler does, in a small pool with
// prompts that share text and pictures (adjacent pictures, pictures ending
// at block edges, the same picture followed by other text).
func stressWorkload(t *testing.T, seed uint64, split bool, steps int) {
	stressProbe(t, seed, split, steps, -1)
}

var errProbeDone = errors.New("probe done")

// stressProbe is stressWorkload; with probe >= 0, right after the probe'th
// admission the admitted sequence grows by all Fits promised, every other
// sequence frozen, and the run ends. It returns how many admissions it made.
func stressProbe(t *testing.T, seed uint64, split bool, steps int, probe int) (admissions int) {
	rng := rand.New(rand.NewPCG(seed, 77))
	cfg := DefaultConfig()
	cfg.UncutMedia = true
	B := 2 + rng.IntN(7)
	N := 4 + rng.IntN(9)
	small := seed%4 == 3 // tiny pools, few sequence ids: full most of the time
	if small {
		N = 4 + rng.IntN(3)
	}
	cfg.BlockTokens = B
	cfg.Cells = N * B
	cfg.MaxSeqs = 2 + rng.IntN(7)
	if small {
		cfg.MaxSeqs = 2 + rng.IntN(2)
	}
	cfg.CacheFloor = []float64{0, DefaultCacheFloor, 0.5, 1}[rng.IntN(4)]
	if rng.IntN(10) == 0 {
		cfg.Caching = false
	}
	defer func() {
		if r := recover(); r != nil && r != errProbeDone {
			panic(r)
		}
	}()
	fail := func(format string, args ...any) {
		t.Helper()
		t.Fatalf("seed %d split %v (B=%d N=%d seqs=%d floor=%v): "+format, append([]any{seed, split, B, N, cfg.MaxSeqs, cfg.CacheFloor}, args...)...)
	}
	p, pp, inner, checkSeqs := poolUnderTest(t, cfg, split, N*B)
	eng := &stressEngine{inner: inner, split: split, layout: map[SeqID][]int32{}, view: map[SeqID]map[int32]int32{}, fail: fail}
	check := func(live []*stressSeq) {
		var r []*Seq
		for _, l := range live {
			r = append(r, l.seq)
		}
		checkSeqs(r)
	}
	// Pictures and shared texts of this run.
	sizes := []int{1, 2, B - 1, B, B + 1, 2*B - 1, 2 * B, 3, 3*B + 1, B - 2}
	var imgLen, txtLen []int
	for range 6 {
		imgLen = append(imgLen, max(1, sizes[rng.IntN(len(sizes))]))
		txtLen = append(txtLen, max(1, sizes[rng.IntN(len(sizes))]))
	}
	uniq := 0
	render := func(segs []segment) []int32 {
		var out []int32
		for _, s := range segs {
			switch s.kind {
			case 0:
				for i := range txtLen[s.k] {
					out = append(out, int32(100*(s.k+1)+i))
				}
			case 1:
				for i := range imgLen[s.k] {
					out = append(out, -int32(1000*(s.k+1)+i))
				}
			case 2:
				for i := range s.n {
					out = append(out, int32(100000+1000*s.k+i))
				}
			}
		}
		return out
	}
	randSeg := func() segment {
		switch r := rng.IntN(10); {
		case r < 4:
			return segment{kind: 1, k: rng.IntN(6)}
		case r < 8:
			return segment{kind: 0, k: rng.IntN(6)}
		default:
			uniq++
			return segment{kind: 2, k: uniq, n: 1 + rng.IntN(2*B)}
		}
	}
	var history [][]segment
	var done [][]int32 // finished sequences' tokens: a chat goes on from them
	newPrompt := func() []int32 {
		for range 50 {
			if len(done) > 0 && rng.IntN(5) == 0 {
				pr := slices.Clone(done[rng.IntN(len(done))])
				var segs []segment
				for range 1 + rng.IntN(3) {
					segs = append(segs, randSeg())
				}
				if segs[len(segs)-1].kind == 1 {
					segs = append(segs, segment{kind: 0, k: rng.IntN(6)})
				}
				pr = append(pr, render(segs)...)
				if len(pr) < N*B {
					return pr
				}
				continue
			}
			var segs []segment
			if len(history) > 0 && rng.IntN(10) < 7 {
				h := history[rng.IntN(len(history))]
				segs = slices.Clone(h[:1+rng.IntN(len(h))])
				var imgs []int
				for i, sg := range h {
					if sg.kind == 1 {
						imgs = append(imgs, i)
					}
				}
				if len(imgs) > 0 && rng.IntN(2) == 0 {
					// The same picture, then other text (or another picture).
					segs = slices.Clone(h[:imgs[rng.IntN(len(imgs))]+1])
					if rng.IntN(4) == 0 {
						segs = append(segs, segment{kind: 1, k: rng.IntN(6)})
					}
					uniq++
					segs = append(segs, segment{kind: 2, k: uniq, n: 1 + rng.IntN(2*B)})
				}
				for range rng.IntN(4) {
					segs = append(segs, randSeg())
				}
			} else {
				if rng.IntN(10) > 0 {
					segs = append(segs, segment{kind: 0, k: rng.IntN(6)})
				}
				for range 1 + rng.IntN(5) {
					segs = append(segs, randSeg())
				}
			}
			if segs[len(segs)-1].kind == 1 && rng.IntN(10) > 0 {
				if rng.IntN(2) == 0 {
					segs = append(segs, segment{kind: 0, k: rng.IntN(6)})
				} else {
					uniq++
					segs = append(segs, segment{kind: 2, k: uniq, n: 1 + rng.IntN(B)})
				}
			}
			pr := render(segs)
			if len(pr) >= 2 && len(pr) < N*B {
				history = append(history, segs)
				return pr
			}
		}
		return []int32{1, 2}
	}
	gen := 0
	lora := rng.IntN(3) == 0
	pickModel := func() string {
		if lora && rng.IntN(3) == 0 {
			return "lora"
		}
		return ""
	}
	nextTok := func() int32 { gen++; return int32(5000000 + gen) }
	// nextChunk is what l computes next: a chunk of its prompt, or a token.
	nextChunk := func(l *stressSeq) []int32 {
		if at := l.seq.Len(); at < l.pre {
			return l.tokens[at:min(l.pre, at+1+rng.IntN(2*B+1))]
		}
		return []int32{nextTok()}
	}

	var live []*stressSeq
	var susp []*stressSusp
	place := func(l *stressSeq) { eng.layout[l.seq.ID] = l.tokens }
	checkTokens := func() {
		for _, l := range live {
			v := eng.view[l.seq.ID]
			for q := 0; q < l.seq.Len() && q < len(l.tokens); q++ {
				if got, ok := v[int32(q)]; !ok || got != l.tokens[q] {
					fail("TOKENS: seq %d position %d holds %d (present %v), want %d; tokens %v", l.seq.ID, q, got, ok, l.tokens[q], l.tokens)
				}
			}
		}
	}
	removeLive := func(l *stressSeq) {
		i := slices.Index(live, l)
		live = slices.Delete(live, i, i+1)
	}
	suspend := func(l *stressSeq) {
		eng.apply(t, p.Suspend(l.seq))
		removeLive(l)
		check(live)
		toks := l.tokens[:max(l.seq.Len(), l.pre)]
		susp = append(susp, &stressSusp{model: l.model, tokens: slices.Clone(toks), plen: l.plen, maxNew: max(0, l.limit-len(toks))})
	}
	// admit: Fits, then Start or Resume, as the scheduler does.
	admit := func(model string, resume bool, toks []int32, plen, maxNew int) bool {
		wasAlone := len(live) == 0
		fits := p.Fits(model, toks, maxNew)
		if !split && wasAlone && (len(toks)+maxNew+B-1)/B <= N && !fits {
			fail("FITS-ALONE: nothing running, %d positions fit %d blocks of %d, Fits false (resume %v) for %v maxNew %d", len(toks)+maxNew, N, B, resume, toks, maxNew)
		}
		if !fits {
			return false
		}
		f := p.Start
		if resume {
			f = p.Resume
		}
		s, ops, err := f(model, toks)
		if errors.Is(err, ErrNoSeq) {
			if wasAlone {
				fail("NOSEQ-ALONE: nothing running, start: %v", err)
			}
			return false
		}
		if err != nil {
			fail("START: %v", err)
		}
		l := &stressSeq{seq: s, tokens: slices.Clone(toks), plen: plen, maxNew: maxNew, budget: len(toks) + maxNew, alone: wasAlone, model: model}
		l.pre, l.limit = len(toks), len(toks)+maxNew
		place(l)
		eng.apply(t, ops)
		if s.Len() >= len(toks) {
			fail("START: %d cached of %d", s.Len(), len(toks))
		}
		live = append(live, l)
		checkTokens()
		if admissions++; admissions-1 == probe {
			for l.seq.Len() < l.budget {
				toks := nextChunk(l)
				from := l.seq.Len()
				ops, err := p.Grow(l.seq, toks)
				if err != nil {
					fail("PROBE: Fits(%v, %d) said true with %d others running; seq %d (cached %d, pins %d) grows %d..%d: %v", toks, maxNew, len(live)-1, s.ID, s.Cached(), len(s.pins), from, from+len(toks), err)
				}
				if from >= l.pre {
					l.tokens = append(l.tokens[:from], toks...)
					place(l)
				}
				eng.apply(t, ops)
				eng.decode(t, l.seq.ID, l.tokens, from, l.seq.Len())
				eng.apply(t, p.Commit(l.seq))
				check(live)
				checkTokens()
			}
			panic(errProbeDone)
		}
		return true
	}
	// grow grows l by toks (its next tokens), returning false on ErrNoSpace
	// (the scheduler then preempts).
	grow := func(l *stressSeq, toks []int32, commit bool) bool {
		from := l.seq.Len()
		ops, err := p.Grow(l.seq, toks)
		if errors.Is(err, ErrNoSpace) {
			if len(live) == 1 && l.budget > 0 && from+len(toks) <= l.budget {
				fail("NOSPACE-ALONE: seq %d alone, admitted with room for %d positions, grow %d..%d: ErrNoSpace (cached %d, pins %d, tokens %v)", l.seq.ID, l.budget, from, from+len(toks), l.seq.Cached(), len(l.seq.pins), l.tokens)
			}
			return false
		}
		if err != nil {
			fail("GROW: seq %d alone=%v, grow %d..%d: %v", l.seq.ID, len(live) == 1, from, from+len(toks), err)
		}
		if from >= l.pre {
			if from != len(l.tokens) {
				fail("driver: generated at %d of %d tokens", from, len(l.tokens))
			}
			l.tokens = append(l.tokens[:from], toks...)
			place(l)
		}
		eng.apply(t, ops)
		eng.decode(t, l.seq.ID, l.tokens, from, l.seq.Len())
		if commit {
			eng.apply(t, p.Commit(l.seq))
		}
		return true
	}
	for step := range steps {
		r := rng.IntN(20)
		switch {
		case r < 4: // a new request
			pr := newPrompt()
			admit(pickModel(), false, pr, len(pr), rng.IntN(3*B))
		case r < 6: // resume the oldest suspended
			if len(susp) == 0 {
				continue
			}
			i := 0
			if rng.IntN(3) == 0 {
				i = rng.IntN(len(susp))
			}
			s := susp[i]
			if admit(s.model, true, s.tokens, s.plen, s.maxNew) {
				susp = slices.Delete(susp, i, i+1)
			}
		case r < 7: // a suspended request cancelled
			if len(susp) == 0 {
				continue
			}
			i := rng.IntN(len(susp))
			eng.apply(t, p.Abandon(susp[i].model, susp[i].tokens))
			susp = slices.Delete(susp, i, i+1)
		case r < 13: // a step of a running sequence
			if len(live) == 0 {
				continue
			}
			l := live[rng.IntN(len(live))]
			at := l.seq.Len()
			var toks []int32
			if at < l.pre {
				toks = l.tokens[at:min(l.pre, at+1+rng.IntN(2*B+1))]
			} else if at < l.limit {
				toks = []int32{nextTok()}
			} else {
				done = append(done, slices.Clone(l.tokens[:l.seq.Len()]))
				eng.apply(t, p.Release(l.seq))
				removeLive(l)
				break
			}
			if !grow(l, toks, true) {
				// Preempt the newest running sequence (maybe l).
				suspend(live[len(live)-1])
			}
		case r < 15: // drafts
			if len(live) == 0 {
				continue
			}
			l := live[rng.IntN(len(live))]
			at := l.seq.Len()
			if at < l.pre || at >= l.limit {
				continue
			}
			n := 1 + rng.IntN(B+2)
			if !p.Spare(l.seq, n) {
				continue
			}
			var toks []int32
			for range n {
				toks = append(toks, nextTok())
			}
			ops, err := p.Grow(l.seq, toks)
			if err != nil {
				fail("DRAFT: Spare said %d positions fit, Grow: %v", n, err)
			}
			if len(ops) != 0 {
				fail("DRAFT: Spare said %d positions fit from free blocks, Grow evicted: %v", n, ops)
			}
			l.tokens = append(l.tokens[:at], toks...)
			place(l)
			eng.apply(t, ops)
			eng.decode(t, l.seq.ID, l.tokens, at, l.seq.Len())
			keep := min(rng.IntN(n+1), l.limit-at)
			ops, err = p.Trim(l.seq, at+keep)
			if err != nil {
				fail("TRIM: %v", err)
			}
			eng.apply(t, ops)
			l.tokens = l.tokens[:at+keep]
			place(l)
			eng.apply(t, p.Commit(l.seq))
		case r < 16: // fork after the prompt
			if len(live) == 0 {
				continue
			}
			l := live[rng.IntN(len(live))]
			if l.seq.Len() < l.pre {
				continue
			}
			f, ops, err := p.Fork(l.seq)
			if errors.Is(err, ErrNoSpace) || errors.Is(err, ErrNoSeq) {
				continue
			}
			if err != nil {
				fail("FORK: %v", err)
			}
			c := &stressSeq{seq: f, tokens: slices.Clone(l.tokens[:l.seq.Len()]), plen: l.plen, maxNew: l.maxNew, model: l.model, pre: l.pre, limit: l.limit}
			place(c)
			eng.apply(t, ops)
			live = append(live, c)
		case r < 17: // cancelled while running
			if len(live) == 0 {
				continue
			}
			l := live[rng.IntN(len(live))]
			eng.apply(t, p.Release(l.seq))
			removeLive(l)
		case r < 18: // preempted
			if len(live) == 0 {
				continue
			}
			suspend(live[rng.IntN(len(live))])
		default: // a lone request run to its end: the alone checks bite
			if len(live) != 0 {
				continue
			}
			pr := newPrompt()
			if !admit(pickModel(), false, pr, len(pr), rng.IntN(3*B)) {
				continue
			}
			l := live[0]
			for l.seq.Len() < l.budget {
				if toks := nextChunk(l); !grow(l, toks, true) {
					fail("unreachable")
				}
				check(live)
				checkTokens()
			}
			if rng.IntN(3) == 0 {
				suspend(l)
			} else {
				done = append(done, slices.Clone(l.tokens[:l.seq.Len()]))
				eng.apply(t, p.Release(l.seq))
				removeLive(l)
			}
		}
		check(live)
		checkTokens()
		_ = step
	}
	for _, l := range live {
		eng.apply(t, p.Release(l.seq))
	}
	live = nil
	for _, s := range susp {
		eng.apply(t, p.Abandon(s.model, s.tokens))
	}
	check(nil)
	p.Publish()
	if st := p.Stats(); st.Used != 0 || st.Running != 0 || st.Free+st.Cached != st.Blocks {
		fail("after releasing everything: %+v", st)
	}
	if pp != nil && pp.suspended.Len() != 0 {
		fail("after abandoning everything: %d blocks still suspended", pp.suspended.Len())
	}
	return admissions
}

// TestStressMedia: stressWorkload over many seeds, in both pools (13,000
// seeds of 400 steps each passed once; raise seeds to look further).
func TestStressMedia(t *testing.T) {
	const seeds, steps = 300, 400
	for seed := range seeds {
		for _, split := range []bool{false, true} {
			t.Run(fmt.Sprintf("%d-split%v", seed, split), func(t *testing.T) { stressWorkload(t, uint64(seed), split, steps) })
		}
	}
}

// TestStressFitsProbe: right after each admission of a workload, the
// admitted sequence grows by all Fits promised, the others frozen.
func TestStressFitsProbe(t *testing.T) {
	const seeds, steps = 40, 200
	for seed := range seeds {
		for _, split := range []bool{false, true} {
			t.Run(fmt.Sprintf("%d-split%v", seed, split), func(t *testing.T) {
				n := stressProbe(t, uint64(seed), split, steps, -1)
				for k := range n {
					stressProbe(t, uint64(seed), split, steps, k)
				}
			})
		}
	}
}
