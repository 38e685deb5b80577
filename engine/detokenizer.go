package engine

import (
	"strings"
	"unicode/utf8"
)

// Detokenizer turns the pieces of generated tokens into text incrementally. A token
// may end in the middle of a multi-byte UTF-8 rune; those bytes are held back until
// the rune is complete, so every string it returns is valid UTF-8 and concatenating
// them gives the whole text. Bytes that can never form a rune become U+FFFD.
//
// Concurrency: not safe for concurrent use; one per sequence.
type Detokenizer struct {
	pending []byte
}

// Add appends piece and returns the text that is now complete.
func (d *Detokenizer) Add(piece []byte) string {
	d.pending = append(d.pending, piece...)
	cut := completePrefix(d.pending)
	if cut == 0 {
		return ""
	}
	out := strings.ToValidUTF8(string(d.pending[:cut]), "\uFFFD")
	d.pending = append(d.pending[:0], d.pending[cut:]...)
	return out
}

// Flush returns whatever is held back, with incomplete runes replaced, and resets.
func (d *Detokenizer) Flush() string {
	out := strings.ToValidUTF8(string(d.pending), "\uFFFD")
	d.pending = d.pending[:0]
	return out
}

// Pending reports whether bytes are held back.
func (d *Detokenizer) Pending() bool { return len(d.pending) > 0 }

// completePrefix returns the length of the longest prefix of b that does not end
// inside a rune that could still be completed by more bytes.
func completePrefix(b []byte) int {
	// A rune is at most 4 bytes, so only the last 3 can start an unfinished one.
	for i := len(b) - 1; i >= 0 && i >= len(b)-3; i-- {
		c := b[i]
		if c < utf8.RuneSelf { // ASCII: everything up to here is settled
			return len(b)
		}
		if utf8.RuneStart(c) {
			if !utf8.FullRune(b[i:]) && validStart(b[i:]) {
				return i
			}
			return len(b)
		}
	}
	return len(b)
}

// validStart reports whether b could begin a valid UTF-8 encoding (a lead byte of a
// multi-byte rune followed only by continuation bytes).
func validStart(b []byte) bool {
	c := b[0]
	var n int
	switch {
	case c&0xE0 == 0xC0 && c >= 0xC2:
		n = 2
	case c&0xF0 == 0xE0:
		n = 3
	case c&0xF8 == 0xF0 && c <= 0xF4:
		n = 4
	default:
		return false
	}
	if len(b) >= n {
		return false
	}
	for _, x := range b[1:] {
		if x&0xC0 != 0x80 {
			return false
		}
	}
	return true
}
