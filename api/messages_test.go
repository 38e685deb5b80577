package api

import "testing"

// TestSpaceHold: Anthropic's stream holds back whitespace-only text before a
// text block opens, and passes it on with the text that follows.
func TestSpaceHold(t *testing.T) {
	var h spaceHold
	if h.add("\n", false) != "" || h.add(" ", false) != "" || h.add("Hi", false) != "\n Hi" || h.add(" ", true) != " " {
		t.Fatal("whitespace before text")
	}
	if h.add("\n\n", false) != "" || h.drop() != "\n\n" || h.drop() != "" {
		t.Fatal("whitespace before a call is dropped, or kept for an answer of only it")
	}
}
