package main

import (
	"context"
	"encoding/json"
	"fmt"
	"path/filepath"
	"strings"
	"testing"

	"github.com/openai/openai-go/v3"

	"github.com/shoal-ai/shoal/models"
)

// thinkingTemplate is ChatML whose assistant turn opens with <think>, as
// DeepSeek R1's template does: everything a model generates under it, until it
// writes </think>, is thought.
const thinkingTemplate = `{%- for message in messages %}
    {%- set content = message.content %}
    {%- if message.role == 'assistant' and '</think>' in content %}
        {%- set content = content.split('</think>')[-1] %}
    {%- endif %}
    {{- '<|im_start|>' + message.role + '\n' + content + '<|im_end|>\n' }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n<think>\n' }}
{%- endif %}`

// TestReasoningContent: a reasoning model's thoughts come back as
// reasoning_content, whole and streamed, and not in content; with
// --reasoning-format none they stay in content.
func TestReasoningContent(t *testing.T) {
	spec := models.Small()
	spec.ChatTemplate = thinkingTemplate
	path := filepath.Join(t.TempDir(), "think.gguf")
	if err := models.Generate(path, spec); err != nil {
		t.Fatal(err)
	}
	n := startNode(t, "--model", path)
	const body = `{"messages": [{"role": "user", "content": "What is 2+2?"}], "max_tokens": 24, "seed": 3}`
	var whole struct {
		Choices []struct {
			Message struct {
				Content          *string `json:"content"`
				ReasoningContent *string `json:"reasoning_content"`
			} `json:"message"`
			FinishReason string `json:"finish_reason"`
		} `json:"choices"`
	}
	resp, b := post(t, n.url+"/v1/chat/completions", body)
	if resp.StatusCode != 200 || json.Unmarshal([]byte(b), &whole) != nil || len(whole.Choices) != 1 {
		t.Fatalf("%d %s", resp.StatusCode, b)
	}
	m := whole.Choices[0].Message
	// A model this small does not write </think> in 24 tokens: all is thought.
	if m.ReasoningContent == nil || *m.ReasoningContent == "" || (m.Content != nil && *m.Content != "") {
		t.Fatalf("the thoughts did not come apart: %s", b)
	}

	// Streamed, the reasoning_content deltas add up to the same thoughts.
	c := n.client("")
	stream := c.Chat.Completions.NewStreaming(context.Background(), openai.ChatCompletionNewParams{
		Model: "think", Messages: []openai.ChatCompletionMessageParamUnion{openai.UserMessage("What is 2+2?")},
		MaxTokens: openai.Int(24), Seed: openai.Int(3)})
	var reasoning, content strings.Builder
	for stream.Next() {
		for _, ch := range stream.Current().Choices {
			var d struct {
				ReasoningContent string `json:"reasoning_content"`
			}
			if err := json.Unmarshal([]byte(ch.Delta.RawJSON()), &d); err != nil {
				t.Fatal(err)
			}
			reasoning.WriteString(d.ReasoningContent)
			content.WriteString(ch.Delta.Content)
		}
	}
	if err := stream.Err(); err != nil {
		t.Fatal(err)
	}
	if reasoning.String() != *m.ReasoningContent || content.String() != "" {
		t.Fatalf("streamed thoughts %q and content %q; whole thoughts %q", reasoning.String(), content.String(), *m.ReasoningContent)
	}

	// Under a grammar (here response_format) the thoughts still come first: the
	// grammar lets text up to </think> precede the JSON.
	resp, b = post(t, n.url+"/v1/chat/completions", `{"messages": [{"role": "user", "content": "2+2?"}], "max_tokens": 24, "seed": 3, "response_format": {"type": "json_object"}}`)
	whole.Choices = nil
	if resp.StatusCode != 200 || json.Unmarshal([]byte(b), &whole) != nil || whole.Choices[0].Message.ReasoningContent == nil ||
		*whole.Choices[0].Message.ReasoningContent == "" {
		t.Fatalf("response_format after thoughts: %s", b)
	}

	// A template that lets the model open <think> itself (Qwen 3's): under a
	// grammar the thoughts are optional, and what follows them is the JSON.
	spec.ChatTemplate = strings.Replace(thinkingTemplate, `'<|im_start|>assistant\n<think>\n'`, `'<|im_start|>assistant\n'`, 1)
	optional := filepath.Join(t.TempDir(), "optional.gguf")
	if err := models.Generate(optional, spec); err != nil {
		t.Fatal(err)
	}
	on := startNode(t, "--model", optional)
	for seed := range 4 {
		resp, b = post(t, on.url+"/v1/chat/completions", fmt.Sprintf(`{"messages": [{"role": "user", "content": "2+2?"}], "max_tokens": 60, "seed": %d, "response_format": {"type": "json_object"}}`, seed))
		whole.Choices = nil
		if resp.StatusCode != 200 || json.Unmarshal([]byte(b), &whole) != nil {
			t.Fatalf("%d %s", resp.StatusCode, b)
		}
		c := whole.Choices[0]
		if c.FinishReason == "stop" && (c.Message.Content == nil || !json.Valid([]byte(*c.Message.Content))) {
			t.Fatalf("seed %d: an answer that is not JSON: %s", seed, b)
		}
		t.Logf("seed %d: finish %s, thoughts %v", seed, c.FinishReason, c.Message.ReasoningContent != nil)
	}

	// --reasoning-format none: the same output, all in content.
	n = startNode(t, "--model", path, "--reasoning-format", "none")
	resp, b = post(t, n.url+"/v1/chat/completions", body)
	whole.Choices = nil
	if resp.StatusCode != 200 || json.Unmarshal([]byte(b), &whole) != nil || whole.Choices[0].Message.ReasoningContent != nil ||
		whole.Choices[0].Message.Content == nil || !strings.Contains(*whole.Choices[0].Message.Content, *m.ReasoningContent) {
		t.Fatalf("--reasoning-format none: %s", b)
	}
	if err := runServe([]string{"--addr", "127.0.0.1:0", "--model", path, "--reasoning-format", "deepseek-legacy"}, nil, nil); err == nil || !strings.Contains(err.Error(), "reasoning") {
		t.Fatalf("an unknown reasoning format: %v", err)
	}
}

// TestSkipSpecialTokens: control tokens render as nothing unless a request
// sets skip_special_tokens false, as vLLM's.
func TestSkipSpecialTokens(t *testing.T) {
	n := startNode(t, "--model", smallModel(t))
	for skip, want := range map[string]string{"": "", `,"skip_special_tokens":true`: "", `,"skip_special_tokens":false`: "<|im_start|><|im_start|><|im_start|>"} {
		// The generated vocabulary's token 3 is <|im_start|>, a control token.
		resp, b := post(t, n.url+"/v1/completions", `{"prompt":"a","max_tokens":3,"logit_bias":{"3":100}`+skip+`}`)
		var r struct {
			Choices []struct {
				Text string `json:"text"`
			} `json:"choices"`
		}
		if resp.StatusCode != 200 || json.Unmarshal([]byte(b), &r) != nil || len(r.Choices) != 1 || r.Choices[0].Text != want {
			t.Errorf("%q: %d %s, want text %q", skip, resp.StatusCode, b, want)
		}
	}
}
