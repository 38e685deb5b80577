package main

import (
	"context"
	"encoding/json"
	"errors"
	"slices"
	"strings"
	"testing"

	"github.com/anthropics/anthropic-sdk-go/v2"
	"github.com/anthropics/anthropic-sdk-go/v2/option"

	"github.com/shoal-ai/shoal/models"
)

func anthropicClient(n *node, key string, opts ...option.RequestOption) anthropic.Client {
	return anthropic.NewClient(append([]option.RequestOption{option.WithBaseURL(n.url + "/"), option.WithAPIKey(key), option.WithMaxRetries(0)}, opts...)...)
}

// accumulate streams params and returns the message Anthropic's SDK builds
// from the events.
func accumulate(t *testing.T, c anthropic.Client, params anthropic.MessageNewParams) anthropic.Message {
	t.Helper()
	stream := c.Messages.NewStreaming(context.Background(), params)
	var m anthropic.Message
	for stream.Next() {
		if err := m.Accumulate(stream.Current()); err != nil {
			t.Fatalf("accumulate: %v", err)
		}
	}
	if err := stream.Err(); err != nil {
		t.Fatalf("stream: %v", err)
	}
	return m
}

// TestAnthropicMessages: Anthropic's Messages API through Anthropic's own Go
// SDK: text, stop sequences, usage and count_tokens, tool use in the model's
// own format (whole, streamed, and the next turn with its result), errors in
// Anthropic's format, x-api-key.
func TestAnthropicMessages(t *testing.T) {
	path := templateModel(t, "tools", models.ToolsTemplate)
	n := startNode(t, "--model", path, "--api-key", "sk-test")
	c := anthropicClient(n, "sk-test", option.WithJSONSet("temperature", 0)) // the SDK no longer sends it itself
	ctx := context.Background()
	params := anthropic.MessageNewParams{
		Model: "tools", MaxTokens: 12,
		System:   []anthropic.TextBlockParam{{Text: "You help."}},
		Messages: []anthropic.MessageParam{anthropic.NewUserMessage(anthropic.NewTextBlock("Tell me a story."))},
	}
	m, err := c.Messages.New(ctx, params)
	if err != nil {
		t.Fatal(err)
	}
	if m.Role != "assistant" || len(m.Content) != 1 || m.Content[0].Type != "text" || m.StopReason != anthropic.StopReasonMaxTokens || m.Usage.OutputTokens != 12 {
		t.Fatalf("whole: %s", m.RawJSON())
	}
	count, err := c.Messages.CountTokens(ctx, anthropic.MessageCountTokensParams{Model: "tools", System: anthropic.MessageCountTokensParamsSystemUnion{OfTextBlockArray: params.System}, Messages: params.Messages})
	if err != nil || count.InputTokens != m.Usage.InputTokens+m.Usage.CacheReadInputTokens {
		t.Fatalf("count_tokens %+v (%v), the message's input %d + cached %d", count, err, m.Usage.InputTokens, m.Usage.CacheReadInputTokens)
	}
	// A final assistant message is continued (prefill): the prompt ends with
	// its text, and the answer is what follows it.
	pre := params
	pre.Messages = append(slices.Clone(params.Messages), anthropic.NewAssistantMessage(anthropic.NewTextBlock("Once upon")))
	pm, err := c.Messages.New(ctx, pre)
	pc, err2 := c.Messages.CountTokens(ctx, anthropic.MessageCountTokensParams{Model: "tools", System: anthropic.MessageCountTokensParamsSystemUnion{OfTextBlockArray: pre.System}, Messages: pre.Messages})
	if err != nil || err2 != nil || pm.Usage.InputTokens+pm.Usage.CacheReadInputTokens != pc.InputTokens || pc.InputTokens <= count.InputTokens {
		t.Fatalf("prefill: %v %v, input %d+%d, counted %d (without it %d)", err, err2, pm.Usage.InputTokens, pm.Usage.CacheReadInputTokens, pc.InputTokens, count.InputTokens)
	}
	text := m.Content[0].Text
	if s := accumulate(t, c, params); len(s.Content) != 1 || s.Content[0].Text != text || s.StopReason != anthropic.StopReasonMaxTokens || s.Usage.OutputTokens != 12 {
		t.Fatalf("streamed: %+v, want the text %q", s, text)
	}
	// A stop sequence ends the text before it.
	stop := strings.TrimSpace(text[len(text)/2:])[:2]
	p := params
	p.StopSequences = []string{stop}
	if s := accumulate(t, c, p); s.StopReason != anthropic.StopReasonStopSequence || s.StopSequence != stop || len(s.Content) > 1 || len(s.Content) == 1 && strings.Contains(s.Content[0].Text, stop) {
		t.Fatalf("stop sequence %q: %+v", stop, s)
	}

	// Structured output: the text is JSON of the schema.
	sp := params
	sp.MaxTokens = 100
	sp.OutputConfig = anthropic.OutputConfigParam{Format: anthropic.JSONOutputFormatParam{Schema: map[string]any{"type": "object",
		"properties": map[string]any{"ok": map[string]any{"type": "boolean"}}, "required": []string{"ok"}, "additionalProperties": false}}}
	var out struct{ OK *bool }
	if m, err := c.Messages.New(ctx, sp); err != nil || len(m.Content) != 1 || json.Unmarshal([]byte(m.Content[0].Text), &out) != nil || out.OK == nil {
		t.Fatalf("output_config: %v %+v", err, m)
	}

	// Tools: the model's own format (Hermes), a call required.
	weather := anthropic.ToolUnionParam{OfTool: &anthropic.ToolParam{Name: "get_weather", Description: anthropic.String("The weather now in a city"),
		InputSchema: anthropic.ToolInputSchemaParam{Properties: map[string]any{"city": map[string]any{"type": "string", "enum": []string{"Oslo", "Paris"}}},
			Required: []string{"city"}, ExtraFields: map[string]any{"additionalProperties": false}}}}
	tp := params
	tp.MaxTokens = 200
	tp.Messages = []anthropic.MessageParam{anthropic.NewUserMessage(anthropic.NewTextBlock("What is the weather in Oslo?"))}
	tp.Tools = []anthropic.ToolUnionParam{weather}
	tp.ToolChoice = anthropic.ToolChoiceUnionParam{OfAny: &anthropic.ToolChoiceAnyParam{DisableParallelToolUse: anthropic.Bool(true)}}
	checkUse := func(what string, m anthropic.Message) anthropic.ContentBlockUnion {
		t.Helper()
		var in struct{ City string }
		last := m.Content[len(m.Content)-1]
		if m.StopReason != anthropic.StopReasonToolUse || last.Type != "tool_use" || last.Name != "get_weather" || last.ID == "" ||
			json.Unmarshal(last.Input, &in) != nil || in.City != "Oslo" && in.City != "Paris" {
			t.Fatalf("%s: %s", what, m.RawJSON())
		}
		return last
	}
	whole, err := c.Messages.New(ctx, tp)
	if err != nil {
		t.Fatal(err)
	}
	use := checkUse("tool use", *whole)
	streamed := accumulate(t, c, tp)
	if s := checkUse("streamed tool use", streamed); string(s.Input) != string(use.Input) {
		t.Fatalf("streamed input %s, whole %s", s.Input, use.Input)
	}
	// The next turn: the call and its result, laid out by the template.
	tp.Messages = append(tp.Messages, whole.ToParam(),
		anthropic.NewUserMessage(anthropic.NewToolResultBlock(use.ID, `{"temperature_c": 3}`, false)))
	tp.ToolChoice = anthropic.ToolChoiceUnionParam{OfNone: &anthropic.ToolChoiceNoneParam{}}
	tp.MaxTokens = 4
	if m, err := c.Messages.New(ctx, tp); err != nil || m.StopReason != anthropic.StopReasonMaxTokens || len(m.Content) != 1 || m.Content[0].Type != "text" {
		t.Fatalf("next turn: %v %+v", err, m)
	}

	// Errors in Anthropic's format; x-api-key or a bearer key.
	for _, c := range []struct {
		body, key string
		status    int
		typ       string
	}{
		{`{"model":"tools","messages":[{"role":"user","content":"x"}]}`, "sk-test", 400, "invalid_request_error"},
		{`{"model":"tools","max_tokens":4,"messages":[{"role":"robot","content":"x"}]}`, "sk-test", 400, "invalid_request_error"},
		{`{"model":"tools","max_tokens":4,"messages":[{"role":"user","content":[{"type":"image","source":{}}]}]}`, "sk-test", 400, "invalid_request_error"},
		{`{"model":"tools","max_tokens":4,"messages":[{"role":"user","content":"x"}],"tools":[{"type":"web_search_20250305","name":"web_search"}]}`, "sk-test", 400, "invalid_request_error"},
		{`{"model":"claude-x","max_tokens":4,"messages":[{"role":"user","content":"x"}]}`, "sk-test", 404, "not_found_error"},
		{`{"model":"tools","max_tokens":4,"messages":[{"role":"user","content":"x"}]}`, "wrong", 401, "authentication_error"},
		{`{"model":"tools","max_tokens":4,"messages":[{"role":"user","content":"x"}]}`, "sk-test", 200, ""},
		// A system reminder within the conversation, an empty final assistant
		// turn, a max_tokens beyond the context, the beta's output_format.
		{`{"model":"tools","max_tokens":4,"messages":[{"role":"user","content":"x"},{"role":"system","content":[{"type":"text","text":"<system-reminder>y</system-reminder>"}]},{"role":"assistant","content":""}]}`, "sk-test", 200, ""},
		{`{"model":"tools","max_tokens":64000,"messages":[{"role":"user","content":"x"}],"output_format":{"type":"json_schema","schema":{"type":"object","properties":{"ok":{"type":"boolean"}},"required":["ok"]}}}`, "sk-test", 200, ""},
	} {
		resp, b := post(t, n.url+"/v1/messages", c.body, "X-Api-Key", c.key)
		var e struct {
			Type  string `json:"type"`
			Error struct {
				Type    string `json:"type"`
				Message string `json:"message"`
			} `json:"error"`
		}
		if resp.StatusCode != c.status || c.status != 200 && (json.Unmarshal([]byte(b), &e) != nil || e.Type != "error" || e.Error.Type != c.typ || e.Error.Message == "") {
			t.Errorf("%s (key %s): %d %s, want %d %s", c.body, c.key, resp.StatusCode, b, c.status, c.typ)
		}
	}
	// max_tokens 0 warms the cache: the prompt is computed, the answer empty.
	for _, stream := range []string{"false", "true"} {
		resp, b := post(t, n.url+"/v1/messages", `{"model":"tools","max_tokens":0,"stream":`+stream+`,"messages":[{"role":"user","content":"x"}]}`, "X-Api-Key", "sk-test")
		if resp.StatusCode != 200 || !strings.Contains(b, `"output_tokens":0`) || !strings.Contains(b, `"stop_reason":"max_tokens"`) || strings.Contains(b, `"text"`) {
			t.Errorf("max_tokens 0 (stream %s): %d %s", stream, resp.StatusCode, b)
		}
	}
	// Either header may carry the key (some clients send both), the scheme in
	// any case; unknown routes and methods answer in Anthropic's format too.
	body := `{"model":"tools","max_tokens":2,"messages":[{"role":"user","content":"x"}]}`
	for _, hdr := range [][]string{{"X-Api-Key", "sk-test", "Authorization", "Bearer wrong"}, {"Authorization", "bearer sk-test"}} {
		if resp, b := post(t, n.url+"/v1/messages", body, hdr...); resp.StatusCode != 200 {
			t.Errorf("headers %v: %d %s", hdr, resp.StatusCode, b)
		}
	}
	if resp, b := post(t, n.url+"/v1/messages/batches", body, "X-Api-Key", "sk-test"); resp.StatusCode != 404 || !strings.Contains(b, `"type":"not_found_error"`) {
		t.Errorf("an unknown Anthropic route: %d %s", resp.StatusCode, b)
	}
	var apiErr *anthropic.Error
	wrong := anthropicClient(n, "wrong")
	if _, err := wrong.Messages.New(ctx, params); !errors.As(err, &apiErr) || apiErr.StatusCode != 401 {
		t.Fatalf("a wrong key through the SDK: %v", err)
	}
}

// TestAnthropicThinking: a reasoning model's thoughts come back as a thinking
// block, whole and streamed.
func TestAnthropicThinking(t *testing.T) {
	path := templateModel(t, "think", thinkingTemplate) // everything the random model writes is thought
	n := startNode(t, "--model", path)
	c := anthropicClient(n, "", option.WithJSONSet("temperature", 0))
	params := anthropic.MessageNewParams{Model: "think", MaxTokens: 10,
		Messages: []anthropic.MessageParam{anthropic.NewUserMessage(anthropic.NewTextBlock("Why?"))},
		Thinking: anthropic.ThinkingConfigParamOfEnabled(1024)}
	m, err := c.Messages.New(context.Background(), params)
	if err != nil || len(m.Content) != 1 || m.Content[0].Type != "thinking" || m.Content[0].Thinking == "" {
		t.Fatalf("whole: %v %+v", err, m)
	}
	if s := accumulate(t, c, params); len(s.Content) != 1 || s.Content[0].Type != "thinking" || s.Content[0].Thinking != m.Content[0].Thinking {
		t.Fatalf("streamed: %+v, want the thoughts %q", s, m.Content[0].Thinking)
	}
}
