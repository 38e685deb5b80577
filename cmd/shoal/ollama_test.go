package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"net/http"
	"net/url"
	"regexp"
	"slices"
	"strings"
	"testing"

	ollama "github.com/ollama/ollama/api"
	"github.com/openai/openai-go/v3"

	"github.com/shoal-ai/shoal/models"
)

func ollamaClient(t *testing.T, n *node) *ollama.Client {
	t.Helper()
	u, err := url.Parse(n.url)
	if err != nil {
		t.Fatal(err)
	}
	return ollama.NewClient(u, http.DefaultClient)
}

// ollamaChat runs req whole (stream false) and streamed, and returns the whole
// answer after checking that the streamed one says the same.
func ollamaChat(t *testing.T, c *ollama.Client, req ollama.ChatRequest) ollama.ChatResponse {
	t.Helper()
	ctx := context.Background()
	var whole ollama.ChatResponse
	no := false
	req.Stream = &no
	if err := c.Chat(ctx, &req, func(r ollama.ChatResponse) error { whole = r; return nil }); err != nil {
		t.Fatalf("chat: %v", err)
	}
	req.Stream = nil // Ollama's default: streamed
	var content, thinking strings.Builder
	var calls []ollama.ToolCall
	var last ollama.ChatResponse
	chunks := 0
	if err := c.Chat(ctx, &req, func(r ollama.ChatResponse) error {
		content.WriteString(r.Message.Content)
		thinking.WriteString(r.Message.Thinking)
		calls = append(calls, r.Message.ToolCalls...)
		last, chunks = r, chunks+1
		return nil
	}); err != nil {
		t.Fatalf("streamed chat: %v", err)
	}
	if !whole.Done || !last.Done || content.String() != whole.Message.Content || thinking.String() != whole.Message.Thinking ||
		len(calls) != len(whole.Message.ToolCalls) || last.DoneReason != whole.DoneReason || last.EvalCount != whole.EvalCount {
		t.Fatalf("streamed (%d objects) %q/%q, %d calls, done %v %q, %d tokens; whole %+v", chunks, content.String(), thinking.String(), len(calls),
			last.Done, last.DoneReason, last.EvalCount, whole)
	}
	if whole.EvalCount > 1 && chunks < 3 {
		t.Fatalf("%d tokens came in %d objects: not streamed", whole.EvalCount, chunks)
	}
	return whole
}

// TestOllamaAPI: Ollama's own API through Ollama's own Go client, on a real
// engine: chat (whole and streamed, the same answer as /v1/chat/completions),
// options, tool calls and their next turn, format, logprobs, generate (with a
// system prompt, raw, context), the model listings, and errors in Ollama's
// format.
func TestOllamaAPI(t *testing.T) {
	path := templateModel(t, "tools", models.ToolsTemplate)
	n := startNode(t, "--model", path)
	c := ollamaClient(t, n)
	ctx := context.Background()
	if err := c.Heartbeat(ctx); err != nil {
		t.Fatal(err)
	}
	if v, err := c.Version(ctx); err != nil || v == "" {
		t.Fatalf("version %q: %v", v, err)
	}

	// The listings.
	list, err := c.List(ctx)
	if err != nil || len(list.Models) != 1 || list.Models[0].Name != "tools" || len(list.Models[0].Digest) != 64 ||
		list.Models[0].Details.Format != "gguf" || list.Models[0].Details.Family != "llama" || list.Models[0].Size == 0 {
		t.Fatalf("tags: %+v %v", list, err)
	}
	ps, err := c.ListRunning(ctx)
	if err != nil || len(ps.Models) != 1 || ps.Models[0].ContextLength == 0 || ps.Models[0].Digest != list.Models[0].Digest {
		t.Fatalf("ps: %+v %v", ps, err)
	}
	show, err := c.Show(ctx, &ollama.ShowRequest{Model: "tools:latest"})
	if err != nil || !slices.Contains(show.Capabilities, "completion") || !slices.Contains(show.Capabilities, "tools") ||
		slices.Contains(show.Capabilities, "thinking") || show.ModelInfo["llama.context_length"] == nil || !strings.Contains(show.Template, "tool_call") {
		t.Fatalf("show: %+v %v", show, err)
	}

	// A chat: whole and streamed alike, and as /v1/chat/completions answers it.
	msgs := []ollama.Message{{Role: "system", Content: "You help."}, {Role: "user", Content: "Tell me a story."}}
	req := ollama.ChatRequest{Model: "tools", Messages: msgs, Options: map[string]any{"temperature": 0, "num_predict": 12, "num_ctx": 4096}}
	r := ollamaChat(t, c, req)
	if r.Model != "tools" || r.Message.Role != "assistant" || r.Message.Content == "" || r.DoneReason != "length" || r.EvalCount != 12 ||
		r.PromptEvalCount == 0 || r.TotalDuration <= 0 || r.EvalDuration <= 0 || r.CreatedAt.IsZero() {
		t.Fatalf("chat: %+v", r)
	}
	cl := n.client("")
	oc, err := cl.Chat.Completions.New(ctx, openai.ChatCompletionNewParams{Model: "tools", MaxTokens: openai.Int(12), Temperature: openai.Float(0),
		Messages: []openai.ChatCompletionMessageParamUnion{openai.SystemMessage("You help."), openai.UserMessage("Tell me a story.")}})
	if err != nil || oc.Choices[0].Message.Content != r.Message.Content || int(oc.Usage.PromptTokens) != r.PromptEvalCount {
		t.Fatalf("/v1/chat/completions said %+v (%v); /api/chat %q, %d prompt tokens", oc, err, r.Message.Content, r.PromptEvalCount)
	}
	// A stop string ends the answer before it.
	stop := strings.TrimSpace(r.Message.Content[len(r.Message.Content)/2:])[:2]
	sr := req
	sr.Options = map[string]any{"temperature": 0, "num_predict": 12, "stop": []string{stop}}
	if s := ollamaChat(t, c, sr); s.DoneReason != "stop" || strings.Contains(s.Message.Content, stop) {
		t.Fatalf("stop %q: %+v", stop, s)
	}

	// Logprobs: one per token, with the alternatives asked for.
	lr := req
	lr.Logprobs, lr.TopLogprobs = true, 2
	if l := ollamaChat(t, c, lr).Logprobs; len(l) != 12 || len(l[0].TopLogprobs) != 2 || l[0].Logprob > 0 || l[0].Token == "" || len(l[0].Bytes) == 0 {
		t.Fatalf("logprobs: %+v", l)
	}

	// format: the content is JSON of the schema.
	fr := req
	fr.Options = map[string]any{"temperature": 0, "num_predict": 100}
	fr.Format = json.RawMessage(`{"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"], "additionalProperties": false}`)
	var out struct{ OK *bool }
	if f := ollamaChat(t, c, fr); json.Unmarshal([]byte(f.Message.Content), &out) != nil || out.OK == nil {
		t.Fatalf("format: %+v", f)
	}

	// Tools: a call, whole with its arguments as an object, and the next turn
	// laid out as /v1/chat/completions lays it out.
	props := ollama.NewToolPropertiesMap()
	props.Set("city", ollama.ToolProperty{Type: ollama.PropertyType{"string"}, Enum: []any{"Oslo", "Paris"}})
	tools := ollama.Tools{{Type: "function", Function: ollama.ToolFunction{Name: "get_weather", Description: "The weather now in a city",
		Parameters: ollama.ToolFunctionParameters{Type: "object", Required: []string{"city"}, Properties: props}}}}
	// A model of random weights does not choose to call: tool_choice (shoal's
	// extension, OpenAI's) requires it, in a request Ollama's client cannot
	// send.
	toolsJSON, _ := json.Marshal(tools)
	body := `{"model": "tools", "messages": [{"role": "user", "content": "What is the weather in Oslo?"}], "tools": ` + string(toolsJSON) +
		`, "tool_choice": "required", "options": {"seed": 1, "num_predict": 200}`
	var tc ollama.ChatResponse
	resp, b := post(t, n.url+"/api/chat", body+`, "stream": false}`)
	if resp.StatusCode != 200 || json.Unmarshal([]byte(b), &tc) != nil || len(tc.Message.ToolCalls) == 0 || tc.Message.Content != "" {
		t.Fatalf("a required call: %d %s", resp.StatusCode, b)
	}
	call := &tc.Message.ToolCalls[0]
	if city, _ := call.Function.Arguments.Get("city"); call.Function.Name != "get_weather" || (city != "Oslo" && city != "Paris") {
		t.Fatalf("call %+v", call)
	}
	// Streamed, the call comes whole in one object, as Ollama sends it.
	resp, b = post(t, n.url+"/api/chat", body+`}`)
	lines := strings.Split(strings.TrimSpace(b), "\n")
	var calls []ollama.ToolCall
	for _, l := range lines {
		var r ollama.ChatResponse
		if err := json.Unmarshal([]byte(l), &r); err != nil {
			t.Fatalf("line %q: %v", l, err)
		}
		calls = append(calls, r.Message.ToolCalls...)
	}
	if resp.Header.Get("Content-Type") != "application/x-ndjson" || len(calls) != len(tc.Message.ToolCalls) || calls[0].Function.Arguments.String() != call.Function.Arguments.String() {
		t.Fatalf("streamed call: %s", b)
	}
	next := []ollama.Message{{Role: "user", Content: "What is the weather in Oslo?"}, {Role: "assistant", ToolCalls: []ollama.ToolCall{*call}},
		{Role: "tool", ToolName: "get_weather", Content: `{"temperature_c": 3}`}}
	nr := ollamaChat(t, c, ollama.ChatRequest{Model: "tools", Messages: next, Tools: tools, Options: map[string]any{"num_predict": 1, "temperature": 0}})
	args, _ := json.Marshal(call.Function.Arguments)
	oc, err = cl.Chat.Completions.New(ctx, openai.ChatCompletionNewParams{Model: "tools", MaxTokens: openai.Int(1),
		Tools: []openai.ChatCompletionToolUnionParam{openai.ChatCompletionFunctionTool(openai.FunctionDefinitionParam{Name: "get_weather",
			Description: openai.String("The weather now in a city"), Parameters: openai.FunctionParameters{"type": "object", "required": []string{"city"},
				"properties": map[string]any{"city": map[string]any{"type": "string", "enum": []string{"Oslo", "Paris"}}}}})},
		Messages: []openai.ChatCompletionMessageParamUnion{openai.UserMessage("What is the weather in Oslo?"),
			{OfAssistant: &openai.ChatCompletionAssistantMessageParam{ToolCalls: []openai.ChatCompletionMessageToolCallUnionParam{{OfFunction: &openai.ChatCompletionMessageFunctionToolCallParam{
				ID: call.ID, Function: openai.ChatCompletionMessageFunctionToolCallFunctionParam{Name: "get_weather", Arguments: string(args)}}}}}},
			openai.ToolMessage(`{"temperature_c": 3}`, call.ID)}})
	if err != nil || int(oc.Usage.PromptTokens) != nr.PromptEvalCount {
		t.Fatalf("the next turn: /api/chat %d prompt tokens, /v1/chat/completions %+v (%v)", nr.PromptEvalCount, oc.Usage, err)
	}

	// Generate: the prompt as a chat's user turn (with a system prompt), or raw;
	// context goes on from an answer.
	gen := func(req ollama.GenerateRequest) ollama.GenerateResponse {
		t.Helper()
		var whole, last ollama.GenerateResponse
		var text strings.Builder
		no := false
		req.Stream = &no
		if err := c.Generate(ctx, &req, func(r ollama.GenerateResponse) error { whole = r; return nil }); err != nil {
			t.Fatalf("generate: %v", err)
		}
		req.Stream = nil
		if err := c.Generate(ctx, &req, func(r ollama.GenerateResponse) error { text.WriteString(r.Response); last = r; return nil }); err != nil {
			t.Fatalf("streamed generate: %v", err)
		}
		if !whole.Done || text.String() != whole.Response || !slices.Equal(last.Context, whole.Context) {
			t.Fatalf("streamed %q, context %v; whole %+v", text.String(), last.Context, whole)
		}
		return whole
	}
	g := gen(ollama.GenerateRequest{Model: "tools", System: "You help.", Prompt: "Tell me a story.", Options: map[string]any{"temperature": 0, "num_predict": 12}})
	if g.Response != r.Message.Content || g.PromptEvalCount != r.PromptEvalCount || len(g.Context) != g.PromptEvalCount+g.EvalCount {
		t.Fatalf("generate %+v; chat said %q in %d prompt tokens", g, r.Message.Content, r.PromptEvalCount)
	}
	raw := gen(ollama.GenerateRequest{Model: "tools", Raw: true, Prompt: "Once upon a time", Options: map[string]any{"temperature": 0, "num_predict": 8}})
	cc, err := cl.Completions.New(ctx, openai.CompletionNewParams{Model: "tools", Prompt: openai.CompletionNewParamsPromptUnion{OfString: openai.String("Once upon a time")},
		MaxTokens: openai.Int(8), Temperature: openai.Float(0)})
	if err != nil || raw.Response != cc.Choices[0].Text || raw.EvalCount != 8 {
		t.Fatalf("raw %+v; /v1/completions %+v (%v)", raw, cc, err)
	}
	more := gen(ollama.GenerateRequest{Model: "tools", Prompt: "And then?", Context: g.Context, Options: map[string]any{"temperature": 0, "num_predict": 4}})
	if more.PromptEvalCount <= len(g.Context) || !slices.Equal(more.Context[:len(g.Context)], g.Context) {
		t.Fatalf("context: %d prompt tokens from %d of context; %v", more.PromptEvalCount, len(g.Context), more.Context)
	}

	// A chat longer than the context loses its oldest turns after the system
	// message, as Ollama truncates it; with truncate false it is refused.
	long := []ollama.Message{{Role: "system", Content: "You help."}}
	for i := range 40 {
		long = append(long, ollama.Message{Role: "user", Content: fmt.Sprintf("question %d: %s", i, strings.Repeat("tell me more ", 30))},
			ollama.Message{Role: "assistant", Content: strings.Repeat("more words here ", 20)})
	}
	long = slices.Insert(long, 11, ollama.Message{Role: "system", Content: "Answer briefly."}) // kept, as Ollama keeps it
	long = append(long, ollama.Message{Role: "user", Content: "And the last question?"})
	tr := ollamaChat(t, c, ollama.ChatRequest{Model: "tools", Messages: long, Options: map[string]any{"temperature": 0, "num_predict": 8}})
	if show.ModelInfo["llama.context_length"] == nil || tr.PromptEvalCount >= 4096-8 || tr.PromptEvalCount < 2048 || tr.EvalCount != 8 {
		t.Fatalf("a long chat truncated: %d prompt tokens, %d generated", tr.PromptEvalCount, tr.EvalCount)
	}
	// An agent's chat that ends in a tool result is cut where a user turn
	// begins, so that the call and its result stay together.
	agent := append(slices.Clone(long[:len(long)-1]), ollama.Message{Role: "user", Content: "What is the weather in Oslo?"},
		ollama.Message{Role: "assistant", ToolCalls: []ollama.ToolCall{*call}}, ollama.Message{Role: "tool", ToolName: "get_weather", Content: `{"temperature_c": 3}`})
	ar := ollamaChat(t, c, ollama.ChatRequest{Model: "tools", Messages: agent, Tools: tools, Options: map[string]any{"temperature": 0, "num_predict": 8}})
	if ar.PromptEvalCount >= 4096-8 || ar.PromptEvalCount < 1024 {
		t.Fatalf("an agent's chat truncated: %d prompt tokens", ar.PromptEvalCount)
	}
	off := false
	var se ollama.StatusError
	if err := c.Chat(ctx, &ollama.ChatRequest{Model: "tools", Messages: long, Truncate: &off}, func(ollama.ChatResponse) error { return nil }); !errors.As(err, &se) || se.StatusCode != 400 {
		t.Fatalf("truncate false: %v", err)
	}

	// Loading: a request without messages or a prompt.
	var loaded ollama.ChatResponse
	if err := c.Chat(ctx, &ollama.ChatRequest{Model: "tools"}, func(r ollama.ChatResponse) error { loaded = r; return nil }); err != nil || !loaded.Done || loaded.DoneReason != "load" {
		t.Fatalf("load: %+v %v", loaded, err)
	}

	// Errors, in Ollama's format, which its client reads.
	for _, tc := range []struct {
		what   string
		do     func() error
		status int
		says   string
	}{
		{"unknown model", func() error {
			return c.Chat(ctx, &ollama.ChatRequest{Model: "nope", Messages: msgs}, func(ollama.ChatResponse) error { return nil })
		}, 404, `"nope" does not exist`},
		{"bad option", func() error {
			return c.Chat(ctx, &ollama.ChatRequest{Model: "tools", Messages: msgs, Options: map[string]any{"temperature": "hot"}}, func(ollama.ChatResponse) error { return nil })
		}, 400, "options.temperature"},
		{"think on a model that does not", func() error {
			return c.Chat(ctx, &ollama.ChatRequest{Model: "tools", Messages: msgs, Think: &ollama.ThinkValue{Value: true}}, func(ollama.ChatResponse) error { return nil })
		}, 400, "does not think"},
		{"images", func() error {
			m := slices.Clone(msgs)
			m[1].Images = []ollama.ImageData{[]byte("png")}
			return c.Chat(ctx, &ollama.ChatRequest{Model: "tools", Messages: m}, func(ollama.ChatResponse) error { return nil })
		}, 400, "images"},
		{"pull", func() error {
			return c.Pull(ctx, &ollama.PullRequest{Model: "llama3"}, func(ollama.ProgressResponse) error { return nil })
		}, 501, "serves the model it was started with"},
		{"a prompt past the context", func() error {
			return c.Generate(ctx, &ollama.GenerateRequest{Model: "tools", Prompt: strings.Repeat("story ", 5000)}, func(ollama.GenerateResponse) error { return nil })
		}, 400, "maximum context length"},
	} {
		var se ollama.StatusError
		if err := tc.do(); !errors.As(err, &se) || se.StatusCode != tc.status || !strings.Contains(se.ErrorMessage, tc.says) {
			t.Errorf("%s: %v (%+v), want %d saying %q", tc.what, err, se, tc.status, tc.says)
		}
	}
}

// TestOllamaThinkingAndEmbeddings: a reasoning model's thoughts come back as
// message.thinking, and an embedding node answers /api/embed and
// /api/embeddings with /v1/embeddings' vectors.
func TestOllamaThinkingAndEmbeddings(t *testing.T) {
	n := startNode(t, "--model", templateModel(t, "think", thinkingTemplate))
	c := ollamaClient(t, n)
	ctx := context.Background()
	show, err := c.Show(ctx, &ollama.ShowRequest{Model: "think"})
	if err != nil || !slices.Contains(show.Capabilities, "thinking") {
		t.Fatalf("show: %+v %v", show, err)
	}
	// A model this small does not write </think> in 24 tokens: all is thought.
	r := ollamaChat(t, c, ollama.ChatRequest{Model: "think", Messages: []ollama.Message{{Role: "user", Content: "What is 2+2?"}},
		Think: &ollama.ThinkValue{Value: true}, Options: map[string]any{"seed": 3, "num_predict": 24}})
	if r.Message.Thinking == "" || r.Message.Content != "" {
		t.Fatalf("the thoughts did not come apart: %+v", r)
	}

	e := startNode(t, "--model", smallModel(t), "--embeddings", "--pooling", "mean", "--max-batch-tokens", "64")
	ec := ollamaClient(t, e)
	emb, err := ec.Embed(ctx, &ollama.EmbedRequest{Model: "small", Input: []string{"hello there", "general kenobi"}})
	if err != nil || len(emb.Embeddings) != 2 || emb.PromptEvalCount == 0 {
		t.Fatalf("embed: %+v %v", emb, err)
	}
	old, err := ec.Embeddings(ctx, &ollama.EmbeddingRequest{Model: "small", Prompt: "hello there"})
	if err != nil || len(old.Embedding) != len(emb.Embeddings[0]) {
		t.Fatalf("embeddings: %d values (%v), embed %d", len(old.Embedding), err, len(emb.Embeddings[0]))
	}
	ecl := e.client("")
	v1, err := ecl.Embeddings.New(ctx, openai.EmbeddingNewParams{Model: "small", Input: openai.EmbeddingNewParamsInputUnion{OfArrayOfStrings: []string{"hello there", "general kenobi"}}})
	if err != nil {
		t.Fatal(err)
	}
	// /api/embed's vectors are /v1/embeddings' (unit length); the older
	// /api/embeddings answers the model's own, as Ollama's does: the same
	// direction.
	var norm float64
	for _, x := range old.Embedding {
		norm += x * x
	}
	norm = math.Sqrt(norm)
	for i, d := range v1.Data {
		for j, x := range d.Embedding {
			if math.Abs(x-float64(emb.Embeddings[i][j])) > 1e-5 || (i == 0 && math.Abs(old.Embedding[j]/norm-x) > 1e-5) {
				t.Fatalf("input %d, value %d: /v1/embeddings %v, /api/embed %v, /api/embeddings %v (of %v)", i, j, x, emb.Embeddings[i][j], old.Embedding[j], norm)
			}
		}
	}
	// dimensions cuts the vectors, at unit length again; no input, no vectors.
	cut, err := ec.Embed(ctx, &ollama.EmbedRequest{Model: "small", Input: "hello there", Dimensions: 16})
	var sum float64
	for _, x := range cut.Embeddings[0] {
		sum += float64(x) * float64(x)
	}
	if err != nil || len(cut.Embeddings[0]) != 16 || math.Abs(sum-1) > 1e-4 {
		t.Fatalf("dimensions 16: %v (%v), squares sum to %v", cut.Embeddings, err, sum)
	}
	if none, err := ec.Embed(ctx, &ollama.EmbedRequest{Model: "small", Input: []string{}}); err != nil || len(none.Embeddings) != 0 {
		t.Fatalf("no input: %+v %v", none, err)
	}
	// vLLM's normalize: false answers the model's own vector (the older
	// /api/embeddings'); truncate_prompt_tokens keeps an input's last tokens.
	resp, body := post(t, e.url+"/v1/embeddings", `{"input":"hello there","normalize":false}`)
	var raw EmbeddingsBody
	if resp.StatusCode != 200 || json.Unmarshal([]byte(body), &raw) != nil || len(raw.Data) != 1 {
		t.Fatalf("normalize false: %d %s", resp.StatusCode, body)
	}
	for j, x := range raw.Data[0].Embedding {
		if math.Abs(x-old.Embedding[j]) > 1e-4*max(1, math.Abs(x)) {
			t.Fatalf("normalize false, value %d: %v, /api/embeddings %v", j, x, old.Embedding[j])
		}
	}
	resp, body = post(t, e.url+"/v1/embeddings", `{"input":"`+strings.Repeat("a ", 200)+`","truncate_prompt_tokens":8}`)
	if resp.StatusCode != 200 || json.Unmarshal([]byte(body), &raw) != nil || raw.Usage.PromptTokens != 8 {
		t.Fatalf("truncate_prompt_tokens 8: %d %s", resp.StatusCode, body)
	}
	// Each input counts as a request, as vLLM counts pooling requests.
	for _, name := range []string{`vllm:request_success_total{finished_reason="stop",model_name="small"}`, `vllm:e2e_request_latency_seconds_count{model_name="small"}`} {
		if m := regexp.MustCompile(regexp.QuoteMeta(name) + ` (\d+)`).FindStringSubmatch(getBody(e.url + "/metrics")); m == nil || m[1] == "0" {
			t.Errorf("an embedding node's metrics: %s is %v", name, m)
		}
	}
	// truncate (by default) cuts an input to what the node computes in one
	// pass: here its step budget, smaller than the context.
	long, err := ec.Embed(ctx, &ollama.EmbedRequest{Model: "small", Input: strings.Repeat("a ", 200)})
	if err != nil || len(long.Embeddings) != 1 || long.PromptEvalCount != 64 {
		t.Fatalf("an input longer than a step, truncated: %d prompt tokens (%v)", long.PromptEvalCount, err)
	}
}

// EmbeddingsBody is a /v1/embeddings answer as a test reads it.
type EmbeddingsBody struct {
	Data []struct {
		Embedding []float64 `json:"embedding"`
	} `json:"data"`
	Usage struct {
		PromptTokens int `json:"prompt_tokens"`
	} `json:"usage"`
}
