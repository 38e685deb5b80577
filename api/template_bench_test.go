package api

import (
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"strings"
	"testing"

	"github.com/shoal-ai/shoal/engine/enginetest"
	"github.com/shoal-ai/shoal/models"
)

// benchChat is a 10-turn chat with 3 tools, each turn ~200 bytes.
func benchChat(b *testing.B) ChatRequest {
	var msgs []string
	msgs = append(msgs, `{"role": "system", "content": "You are a helpful assistant."}`)
	for i := range 10 {
		msgs = append(msgs, fmt.Sprintf(`{"role": "user", "content": %q}`, strings.Repeat(fmt.Sprintf("question %d ", i), 16)),
			fmt.Sprintf(`{"role": "assistant", "content": %q}`, strings.Repeat(fmt.Sprintf("answer %d ", i), 20)))
	}
	msgs = append(msgs, `{"role": "user", "content": "And now?"}`)
	var tools []string
	for i := range 3 {
		tools = append(tools, fmt.Sprintf(`{"type": "function", "function": {"name": "tool_%d", "description": "does %d",
			"parameters": {"type": "object", "properties": {"a": {"type": "string"}, "b": {"type": "integer"}}, "required": ["a"]}}}`, i, i))
	}
	var req ChatRequest
	body := `{"messages": [` + strings.Join(msgs, ",") + `], "tools": [` + strings.Join(tools, ",") + `]}`
	if err := json.Unmarshal([]byte(body), &req); err != nil {
		b.Fatal(err)
	}
	return req
}

// BenchmarkChatPrompt: the per-request cost of laying out a chat with the
// model's Jinja template (make bench-template runs it beside llama.cpp's
// built-in formatter, BenchmarkApplyChatTemplate in engine/llama).
func BenchmarkChatPrompt(b *testing.B) {
	req := benchChat(b)
	f := enginetest.New(256, 4, 64)
	s := &Server{log: slog.New(slog.NewTextHandler(io.Discard, nil))}
	for _, c := range []struct {
		name  string
		tools bool
	}{{"jinja", false}, {"jinja-tools", true}} {
		b.Run(c.name, func(b *testing.B) {
			be := &Backend{Vocab: f.Vocab(), Template: models.ToolsTemplate}
			s.compileTemplate(be)
			b.ReportAllocs()
			for b.Loop() {
				var tp *toolPlan
				if c.tools {
					var err error
					if tp, err = toolsOf(&req.ToolFields, nil); err != nil {
						b.Fatal(err)
					}
				}
				if _, err := chatPrompt(be, req.Messages, tp, nil); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}
