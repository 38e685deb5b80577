package engine

import (
	"strings"
	"testing"
	"unicode/utf8"
)

func TestDetokenizerSplitsRunes(t *testing.T) {
	text := "héllo, wörld ✓ 🐟 end"
	b := []byte(text)
	// Feed one byte at a time: every output must be valid and the concatenation exact.
	var d Detokenizer
	var sb strings.Builder
	for i := range b {
		out := d.Add(b[i : i+1])
		if !utf8.ValidString(out) {
			t.Fatalf("invalid UTF-8 after byte %d: %q", i, out)
		}
		sb.WriteString(out)
	}
	sb.WriteString(d.Flush())
	if sb.String() != text {
		t.Fatalf("got %q, want %q", sb.String(), text)
	}
}

func TestDetokenizerInvalidBytes(t *testing.T) {
	cases := []struct {
		name   string
		pieces [][]byte
		want   string
	}{
		{"lone continuation", [][]byte{{0x80}, []byte("a")}, "\uFFFDa"},
		{"truncated then ascii", [][]byte{{0xE2, 0x9C}, []byte("x")}, "\uFFFDx"},
		{"truncated at end", [][]byte{[]byte("a"), {0xF0, 0x9F}}, "a\uFFFD"},
		{"bad lead", [][]byte{{0xFF}, []byte("b")}, "\uFFFDb"},
		{"emoji in two", [][]byte{{0xF0, 0x9F}, {0x90, 0x9F}}, "🐟"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			var d Detokenizer
			var sb strings.Builder
			for _, p := range c.pieces {
				out := d.Add(p)
				if !utf8.ValidString(out) {
					t.Fatalf("invalid output %q", out)
				}
				sb.WriteString(out)
			}
			sb.WriteString(d.Flush())
			if sb.String() != c.want {
				t.Fatalf("got %q, want %q", sb.String(), c.want)
			}
		})
	}
}

func FuzzDetokenizer(f *testing.F) {
	f.Add([]byte("héllo ✓ 🐟"), uint8(3))
	f.Add([]byte{0xF0, 0x9F, 0x90}, uint8(1))
	f.Fuzz(func(t *testing.T, b []byte, step uint8) {
		n := int(step%5) + 1
		var d Detokenizer
		var sb strings.Builder
		for i := 0; i < len(b); i += n {
			out := d.Add(b[i:min(i+n, len(b))])
			if !utf8.ValidString(out) {
				t.Fatalf("invalid UTF-8 %q", out)
			}
			sb.WriteString(out)
		}
		sb.WriteString(d.Flush())
		if utf8.Valid(b) && sb.String() != string(b) {
			t.Fatalf("valid input changed: %q -> %q", b, sb.String())
		}
	})
}
