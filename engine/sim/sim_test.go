package sim

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/shoal-ai/shoal/engine"
)

func TestFitRecoversCoefficients(t *testing.T) {
	truth := Profile{BaseUS: 800, PerTokenUS: 120, PerAttendUS: 3}
	p := Profile{Model: "m"}
	for _, tokens := range []int{1, 8, 32, 64, 512} {
		for _, ctx := range []int64{0, 100, 1000} {
			pos := int64(tokens) * ctx
			p.Samples = append(p.Samples, Sample{Tokens: tokens, PosSum: pos, Seconds: truth.Step(tokens, pos).Seconds()})
		}
	}
	if err := p.Fit(); err != nil {
		t.Fatal(err)
	}
	for _, c := range [][2]float64{{p.BaseUS, 800}, {p.PerTokenUS, 120}, {p.PerAttendUS, 3}} {
		if d := c[0] - c[1]; d > 0.5 || d < -0.5 {
			t.Fatalf("fitted %+v", p)
		}
	}
	if err := (&Profile{Samples: p.Samples[:2]}).Fit(); err == nil {
		t.Fatal("fit with 2 samples")
	}
	// Noisy samples whose best fit makes attention negative (as a busy 2-core
	// machine measured them): no term comes out negative, and the fit without
	// it is taken.
	noisy := Profile{Samples: []Sample{{128, 8128, 0.296}, {512, 130816, 0.059}, {1, 64, 0.065}, {8, 512, 0.07},
		{32, 2048, 0.5}, {1, 256, 0.06}, {8, 2048, 0.061}, {32, 8192, 0.44}}}
	if err := noisy.Fit(); err != nil {
		t.Fatal(err)
	}
	if min(noisy.BaseUS, noisy.PerTokenUS, noisy.PerAttendUS) < 0 {
		t.Fatalf("a negative term: %+v", noisy)
	}
}

func TestDecodeTakesModelledTime(t *testing.T) {
	e, err := New(Profile{Model: "m", BaseUS: 20000}, Config{Cells: 1024, MaxSeqs: 4, BatchTokens: 64, Unified: true})
	if err != nil {
		t.Fatal(err)
	}
	var b engine.Batch
	b.Add(5, 0, 0, true)
	start := time.Now()
	if err := e.Decode(context.Background(), &b); err != nil {
		t.Fatal(err)
	}
	if d := time.Since(start); d < 20*time.Millisecond {
		t.Fatalf("decode took %v, model says 20ms", d)
	}
	var tok engine.Token
	e.Logits(0, func(l []float32) {
		for i, x := range l {
			if x > l[tok] {
				tok = engine.Token(i)
			}
		}
	})
	if p, _ := e.Vocab().Piece(tok, false); len(p) != 1 || p[0] < 'a' || p[0] > 'z' {
		t.Fatalf("next token %d piece %q", tok, p)
	}
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	b.Reset()
	b.Add(5, 1, 0, true)
	if err := e.Decode(ctx, &b); !errors.Is(err, engine.ErrAborted) {
		t.Fatalf("cancelled decode: %v", err)
	}
	// What llama.cpp refuses, the sim refuses: a position that does not follow
	// the sequence's, and a sequence id beyond the engine's.
	for _, row := range []struct {
		pos engine.Pos
		seq engine.SeqID
	}{{0, 0}, {5, 0}, {-1, 2}, {0, 4}} {
		b.Reset()
		b.Add(5, row.pos, row.seq, true)
		if err := e.Decode(context.Background(), &b); !errors.Is(err, engine.ErrInvalidInput) {
			t.Fatalf("sequence %d at position %d: %v", row.seq, row.pos, err)
		}
	}
	if err := e.SeqCopy(0, 1, 0, -1); err != nil {
		t.Fatal(err)
	}
	if lo, hi, ok := e.SeqPosRange(1); !ok || lo != 0 || hi != 0 {
		t.Fatalf("copy: %d %d %v", lo, hi, ok)
	}
	e.SeqRemove(1, 0, -1)
	if _, _, ok := e.SeqPosRange(1); ok {
		t.Fatal("removed sequence still has positions")
	}
}

// TestSplitLikeLlama: with one stream per sequence the sim sizes streams as llama.cpp
// does (whole 256-cell units) and copies only whole streams.
func TestSplitLikeLlama(t *testing.T) {
	e, err := New(Profile{Model: "m"}, Config{Cells: 8192, MaxSeqs: 128, BatchTokens: 64})
	if err != nil {
		t.Fatal(err)
	}
	if c := e.Capacity(); c.CellsPerSeq != 256 || c.Cells != 128*256 {
		t.Fatalf("8192 cells for 128 streams: %d cells, %d a stream; llama.cpp makes 128 × 256", c.Cells, c.CellsPerSeq)
	}
	var b engine.Batch
	for i := range 20 {
		b.Add(5, engine.Pos(i), 0, i == 19)
	}
	if err := e.Decode(context.Background(), &b); err != nil {
		t.Fatal(err)
	}
	if err := e.SeqCopy(0, 1, 0, 16); !errors.Is(err, engine.ErrUnsupported) {
		t.Fatalf("partial copy between streams: %v", err)
	}
	if err := e.SeqCopy(0, 1, -1, -1); err != nil {
		t.Fatal(err)
	}
	if _, hi, ok := e.SeqPosRange(1); !ok || hi != 19 {
		t.Fatalf("whole-stream copy: %d %v", hi, ok)
	}
}
