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

func TestJoinUserTurns(t *testing.T) {
	in := []Message{{Role: "user", Content: "a"}, {Role: "user", Content: "b"}, {Role: "assistant", Content: "c"},
		{Role: "user", Content: "d"}, {Role: "user", Content: "e"}, {Role: "user", Content: "f"}, {Role: "tool", Content: "g"}, {Role: "user", Content: "h"}}
	got := joinUserTurns(in)
	want := []Message{{Role: "user", Content: "a\n\nb"}, {Role: "assistant", Content: "c"}, {Role: "user", Content: "d\n\ne\n\nf"},
		{Role: "tool", Content: "g"}, {Role: "user", Content: "h"}}
	if len(got) != len(want) {
		t.Fatalf("%+v", got)
	}
	for i := range want {
		if got[i].Role != want[i].Role || got[i].Content != want[i].Content {
			t.Fatalf("%d: %+v, want %+v", i, got[i], want[i])
		}
	}
}

// TestFold: system text goes to the next user turn, consecutive user turns
// are joined, and system text with no user turn after it joins the last.
func TestFold(t *testing.T) {
	in := []chatTurn{{role: "system", content: "s"}, {role: "user", content: "a"}, {role: "user", content: "b"},
		{role: "assistant", content: "c"}, {role: "user", content: "d"}, {role: "system", content: "t"}}
	got := fold(in, true, true)
	want := []chatTurn{{role: "user", content: "s\n\na\n\nb"}, {role: "assistant", content: "c"}, {role: "user", content: "d\n\nt"}}
	if len(got) != len(want) {
		t.Fatalf("%+v", got)
	}
	for i := range want {
		if got[i].role != want[i].role || got[i].content != want[i].content {
			t.Fatalf("%d: %+v, want %+v", i, got[i], want[i])
		}
	}
	if got := fold([]chatTurn{{role: "assistant", content: "c"}, {role: "system", content: "t"}}, true, false); len(got) != 2 || got[1].content != "t" || got[1].role != "user" {
		t.Fatalf("system text after an assistant turn: %+v", got)
	}
}
