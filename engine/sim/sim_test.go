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
	if err := e.Decode(ctx, &b); !errors.Is(err, engine.ErrAborted) {
		t.Fatalf("cancelled decode: %v", err)
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
