package engine

import (
	"errors"
	"slices"
	"testing"
)

// TestBatchKeep: Keep drops rows from every column, the embeddings' and
// the image grid's included.
func TestBatchKeep(t *testing.T) {
	var b Batch
	e1, e2 := []float32{1}, []float32{2}
	b.Add(7, 0, 0, false)
	b.AddEmbdAt(-1, e1, 1, 0, 1, 0, false)
	b.Add(8, 0, 1, true)
	b.AddEmbdAt(-2, e2, 1, 1, 0, 0, false)
	b.Add(9, 2, 0, true)
	b.Keep(func(i int) bool { return b.Seq[i] == 0 })
	if !slices.Equal(b.Tokens, []Token{7, -1, -2, 9}) || !slices.Equal(b.Pos, []Pos{0, 1, 1, 2}) ||
		!slices.Equal(b.Output, []bool{false, false, false, true}) || len(b.Embd) != 4 || len(b.Grid) != 4 {
		t.Fatalf("kept %+v", b)
	}
	if y, x := b.At(1); y != 0 || x != 1 || b.Embd[1][0] != 1 {
		t.Errorf("row 1: at %d,%d, embedding %v", y, x, b.Embd[1])
	}
	if y, x := b.At(2); y != 1 || x != 0 || b.Embd[2][0] != 2 || b.Embedded(3) || b.Embedded(0) {
		t.Errorf("row 2: at %d,%d, embedding %v; rows 0 and 3 embedded: %v %v", y, x, b.Embd[2], b.Embedded(0), b.Embedded(3))
	}
	if err := b.Check(Capacity{BatchTokens: 8, MaxSeqs: 2, CellsPerSeq: 16, MRoPE: true}, 16, 1, func(SeqID) (Pos, bool) { return 0, false }); err != nil {
		t.Errorf("kept rows: %v", err)
	}
}

// TestCheckMRoPE: with M-RoPE, an image's rows share a position and text
// moves on past it; without, positions follow one another and no row has a
// line or column.
func TestCheckMRoPE(t *testing.T) {
	c := Capacity{BatchTokens: 16, MaxSeqs: 2, CellsPerSeq: 64, MRoPE: true}
	none := func(SeqID) (Pos, bool) { return 0, false }
	held := func(SeqID) (Pos, bool) { return 4, true }
	e := []float32{0}
	for _, tc := range []struct {
		name  string
		build func(*Batch)
		last  func(SeqID) (Pos, bool)
		ok    bool
	}{
		{"text, image at one position, text after its span", func(b *Batch) {
			b.Add(1, 0, 0, false)
			b.AddEmbdAt(-1, e, 1, 0, 0, 0, false)
			b.AddEmbdAt(-2, e, 1, 0, 1, 0, false)
			b.Add(2, 3, 0, true)
		}, none, true},
		{"an image row at the position the sequence holds last", func(b *Batch) { b.AddEmbdAt(-1, e, 4, 1, 1, 0, false) }, held, true},
		{"a text row at the position the sequence holds last", func(b *Batch) { b.Add(1, 4, 0, false) }, held, false},
		{"a row before what the sequence holds", func(b *Batch) { b.AddEmbdAt(-1, e, 3, 0, 0, 0, false) }, held, false},
		{"text repeating a position", func(b *Batch) { b.Add(1, 5, 0, false); b.Add(2, 5, 0, false) }, held, false},
		{"a text row with a line and column", func(b *Batch) {
			b.AddEmbdAt(-1, e, 5, 0, 0, 0, false)
			b.Add(1, 6, 0, false)
			b.Grid[1] = [2]Pos{1, 1}
		}, held, false},
	} {
		var b Batch
		tc.build(&b)
		err := b.Check(c, 16, 1, tc.last)
		if (err == nil) != tc.ok || err != nil && !errors.Is(err, ErrInvalidInput) {
			t.Errorf("%s: %v, want ok %v", tc.name, err, tc.ok)
		}
	}
	// Without M-RoPE: consecutive positions, no lines or columns.
	c.MRoPE = false
	var b Batch
	b.Add(1, 0, 0, false)
	b.AddEmbdAt(-1, e, 1, 0, 1, 0, false)
	if err := b.Check(c, 16, 1, none); !errors.Is(err, ErrInvalidInput) {
		t.Errorf("a line and column without M-RoPE: %v, want refused", err)
	}
	b.Reset()
	b.Add(1, 0, 0, false)
	b.Add(2, 2, 0, false)
	if err := b.Check(c, 16, 1, none); !errors.Is(err, ErrInvalidInput) {
		t.Errorf("a jump without M-RoPE: %v, want refused", err)
	}
}
