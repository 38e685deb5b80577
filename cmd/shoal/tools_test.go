package main

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/openai/openai-go/v3"
	"github.com/openai/openai-go/v3/option"
	"github.com/openai/openai-go/v3/shared"

	"github.com/shoal-ai/shoal/models"
)

// TestToolCalling: with the real engine and a model that knows nothing of tools,
// the tool protocol's grammar still makes every call well-formed (an offered
// tool, arguments matching its schema), whole or streamed, and a history holding
// the call and its result is rendered for the next turn, counted by /tokenize as
// chat counts it.
func TestToolCalling(t *testing.T) {
	n := startNode(t, "--model", smallModel(t))
	c := n.client("")
	ctx := context.Background()
	weather, clock, params := toolRequest("small")
	checkCalls := func(what string, cc openai.ChatCompletionChoice, names ...string) {
		t.Helper()
		checkToolCalls(t, what, cc, names...)
	}
	chat := callRequiredNamedStreamed(t, c, params, checkCalls)

	// Cut short by max_tokens, the calls made so far come back as calls, never
	// as the protocol's JSON in content.
	cut, err := c.Chat.Completions.New(ctx, openai.ChatCompletionNewParams{
		Model: "small", Messages: params.Messages, MaxTokens: openai.Int(40), Seed: openai.Int(1),
		Tools: []openai.ChatCompletionToolUnionParam{weather, clock}, ToolChoice: openai.ChatCompletionToolChoiceOptionUnionParam{OfAuto: openai.String("required")},
	})
	if err != nil {
		t.Fatal(err)
	}
	if cc := cut.Choices[0]; cc.FinishReason != "length" || cc.Message.Content != "" {
		t.Fatalf("cut short: finish %q, content %q", cc.FinishReason, cc.Message.Content)
	}

	// With an output constraint, an answer without calls follows it (as OpenAI
	// takes tools with response_format); whichever the model picks is well-formed.
	schema := map[string]any{"type": "object", "properties": map[string]any{"ok": map[string]any{"type": "boolean"}}, "required": []string{"ok"}, "additionalProperties": false}
	answered := 0
	for seed := range 6 {
		r, err := c.Chat.Completions.New(ctx, openai.ChatCompletionNewParams{
			Model: "small", Messages: params.Messages[:2], MaxTokens: openai.Int(120), Seed: openai.Int(int64(seed)), ParallelToolCalls: openai.Bool(false),
			Tools: []openai.ChatCompletionToolUnionParam{weather, clock},
			ResponseFormat: openai.ChatCompletionNewParamsResponseFormatUnion{OfJSONSchema: &openai.ResponseFormatJSONSchemaParam{
				JSONSchema: openai.ResponseFormatJSONSchemaJSONSchemaParam{Name: "verdict", Schema: schema}}},
		})
		if err != nil {
			t.Fatal(err)
		}
		switch cc := r.Choices[0]; cc.FinishReason {
		case "tool_calls":
			checkCalls("tools with response_format", cc, "get_weather", "get_time")
		case "stop":
			answered++
			var v struct {
				OK *bool `json:"ok"`
			}
			if err := json.Unmarshal([]byte(cc.Message.Content), &v); err != nil || v.OK == nil {
				t.Fatalf("an answer under response_format: %q: %v", cc.Message.Content, err)
			}
		}
	}
	t.Logf("tools with response_format: %d of 6 seeds answered, the rest called tools or were cut", answered)

	// A stop string in an answer ends it, and its generation: the JSON around
	// the answer is not generated on to its end. (The one answer the constraint
	// allows makes the cut's place known; seeds that call a tool say nothing.)
	// A string under a JSON schema is its JSON, quoted, as without tools.
	fixed := openai.ChatCompletionNewParamsResponseFormatUnion{OfJSONSchema: &openai.ResponseFormatJSONSchemaParam{
		JSONSchema: openai.ResponseFormatJSONSchemaJSONSchemaParam{Name: "fixed", Schema: map[string]any{
			"type": "string", "enum": []string{"one two three four five six seven eight nine ten"}}}}}
	stopped := 0
	for seed := range 8 {
		p := openai.ChatCompletionNewParams{
			Model: "small", Messages: params.Messages[:2], MaxTokens: openai.Int(150), Seed: openai.Int(int64(seed)), ParallelToolCalls: openai.Bool(false),
			Tools: []openai.ChatCompletionToolUnionParam{weather, clock}, ResponseFormat: fixed,
		}
		whole, err := c.Chat.Completions.New(ctx, p)
		if err != nil {
			t.Fatal(err)
		}
		if whole.Choices[0].FinishReason != "stop" {
			continue
		}
		p.Stop = openai.ChatCompletionNewParamsStopUnion{OfStringArray: []string{"three"}}
		cut, err := c.Chat.Completions.New(ctx, p)
		if err != nil {
			t.Fatal(err)
		}
		if cc := cut.Choices[0]; cc.FinishReason != "stop" || cc.Message.Content != `"one two ` {
			t.Fatalf("seed %d, stop at three: finish %q, content %q", seed, cc.FinishReason, cc.Message.Content)
		}
		// The rest of the answer and its JSON are dozens of tokens; the choice
		// ends within a step or two of the stop string.
		if cut.Usage.CompletionTokens > whole.Usage.CompletionTokens-15 {
			t.Fatalf("seed %d: %d tokens generated with the stop string, %d without", seed, cut.Usage.CompletionTokens, whole.Usage.CompletionTokens)
		}
		stream := c.Chat.Completions.NewStreaming(ctx, p, option.WithJSONSet("stream_options", map[string]any{"include_usage": true}))
		var acc openai.ChatCompletionAccumulator
		for stream.Next() {
			acc.AddChunk(stream.Current())
		}
		if err := stream.Err(); err != nil {
			t.Fatal(err)
		}
		if acc.Choices[0].Message.Content != `"one two ` || acc.Usage.CompletionTokens > whole.Usage.CompletionTokens-15 {
			t.Fatalf("seed %d streamed: content %q after %d tokens, %d without the stop string", seed, acc.Choices[0].Message.Content, acc.Usage.CompletionTokens, whole.Usage.CompletionTokens)
		}
		t.Logf("seed %d: stop string under tools: %d tokens, %d without it", seed, cut.Usage.CompletionTokens, whole.Usage.CompletionTokens)
		stopped++
	}
	if stopped == 0 {
		t.Fatal("no seed of 8 answered rather than called a tool: the stop string was not tried")
	}

	// Parameters as Pydantic writes nested models: references into their $defs.
	address := openai.ChatCompletionFunctionTool(shared.FunctionDefinitionParam{
		Name: "ship",
		Parameters: shared.FunctionParameters{
			"$defs": map[string]any{"Address": map[string]any{
				"type": "object", "properties": map[string]any{"zip": map[string]any{"type": "integer", "minimum": 1000, "maximum": 9999}},
				"required": []string{"zip"}, "additionalProperties": false}},
			"type": "object", "properties": map[string]any{"to": map[string]any{"$ref": "#/$defs/Address"}},
			"required": []string{"to"}, "additionalProperties": false,
		},
	})
	shipped, err := c.Chat.Completions.New(ctx, openai.ChatCompletionNewParams{
		Model: "small", Messages: params.Messages, MaxTokens: openai.Int(200), Seed: openai.Int(1), ParallelToolCalls: openai.Bool(false),
		Tools:      []openai.ChatCompletionToolUnionParam{weather, address},
		ToolChoice: openai.ToolChoiceOptionFunctionToolChoice(openai.ChatCompletionNamedToolChoiceFunctionParam{Name: "ship"}),
	})
	if err != nil {
		t.Fatal(err)
	}
	checkCalls("$ref", shipped.Choices[0], "ship")
	var args struct {
		To struct {
			Zip *int `json:"zip"`
		} `json:"to"`
	}
	if err := json.Unmarshal([]byte(shipped.Choices[0].Message.ToolCalls[0].Function.Arguments), &args); err != nil || args.To.Zip == nil || *args.To.Zip < 1000 || *args.To.Zip > 9999 {
		t.Fatalf("ship arguments %s: %v", shipped.Choices[0].Message.ToolCalls[0].Function.Arguments, err)
	}

	// The next turn: the call and its result in the history, the model free to
	// answer or call again.
	nextTurn(t, n, params, chat)
}

// nextTurn asks for the turn after chat's first call, with the call and its
// result ({"temperature_c": 3}) in the history, the model free to answer or
// call again. /tokenize must count the prompt chat builds; it returns those
// tokens.
func nextTurn(t *testing.T, n *node, params openai.ChatCompletionNewParams, chat *openai.ChatCompletion) []int32 {
	t.Helper()
	call := chat.Choices[0].Message.ToolCalls[0]
	params.Messages = append(params.Messages, chat.Choices[0].Message.ToParam(), openai.ToolMessage(`{"temperature_c": 3}`, call.ID))
	params.ToolChoice = openai.ChatCompletionToolChoiceOptionUnionParam{OfAuto: openai.String("auto")}
	params.MaxTokens = openai.Int(30)
	c := n.client("")
	next, err := c.Chat.Completions.New(context.Background(), params)
	if err != nil {
		t.Fatal(err)
	}
	if f := next.Choices[0].FinishReason; f != "stop" && f != "length" && f != "tool_calls" {
		t.Fatalf("next turn: finish %q", f)
	}
	body, _ := json.Marshal(params)
	resp, b := post(t, n.url+"/tokenize", string(body))
	var tok struct {
		Count  int     `json:"count"`
		Tokens []int32 `json:"tokens"`
	}
	if resp.StatusCode != 200 || json.Unmarshal([]byte(b), &tok) != nil || tok.Count != int(next.Usage.PromptTokens) {
		t.Fatalf("/tokenize counted %s for a chat prompt of %d tokens", b, next.Usage.PromptTokens)
	}
	return tok.Tokens
}

// toolRequest is a chat that asks for the weather with two tools offered,
// get_weather (a city from an enum) and get_time (no parameters), one call
// required.
func toolRequest(model string) (weather, clock openai.ChatCompletionToolUnionParam, params openai.ChatCompletionNewParams) {
	weather = openai.ChatCompletionFunctionTool(shared.FunctionDefinitionParam{
		Name:        "get_weather",
		Description: openai.String("The weather now in a city"),
		Parameters: shared.FunctionParameters{
			"type":                 "object",
			"properties":           map[string]any{"city": map[string]any{"type": "string", "enum": []string{"Oslo", "Paris"}}},
			"required":             []string{"city"},
			"additionalProperties": false,
		},
	})
	clock = openai.ChatCompletionFunctionTool(shared.FunctionDefinitionParam{Name: "get_time"})
	params = openai.ChatCompletionNewParams{
		Model:      model,
		Messages:   []openai.ChatCompletionMessageParamUnion{openai.SystemMessage("You help."), openai.UserMessage("What is the weather in Oslo?")},
		Tools:      []openai.ChatCompletionToolUnionParam{weather, clock},
		ToolChoice: openai.ChatCompletionToolChoiceOptionUnionParam{OfAuto: openai.String("required")},
		MaxTokens:  openai.Int(200),
		Seed:       openai.Int(1),
		// A model this small, left to call tools in parallel, calls them until
		// max_tokens; several calls in one answer are checked in the api tests.
		ParallelToolCalls: openai.Bool(false),
	}
	return weather, clock, params
}

// callRequiredNamedStreamed asks for a call under tool_choice required, then
// for get_weather by name, whole and streamed: the same seed gives the same
// call, as the SDK accumulates it. It returns the named call's completion.
func callRequiredNamedStreamed(t *testing.T, c openai.Client, params openai.ChatCompletionNewParams, check func(string, openai.ChatCompletionChoice, ...string)) *openai.ChatCompletion {
	t.Helper()
	ctx := context.Background()
	chat, err := c.Chat.Completions.New(ctx, params)
	if err != nil {
		t.Fatal(err)
	}
	check("required", chat.Choices[0], "get_weather", "get_time")
	params.ToolChoice = openai.ToolChoiceOptionFunctionToolChoice(openai.ChatCompletionNamedToolChoiceFunctionParam{Name: "get_weather"})
	if chat, err = c.Chat.Completions.New(ctx, params); err != nil {
		t.Fatal(err)
	}
	check("named", chat.Choices[0], "get_weather")
	if len(chat.Choices[0].Message.ToolCalls) != 1 {
		t.Fatalf("parallel_tool_calls false gave %d calls", len(chat.Choices[0].Message.ToolCalls))
	}
	stream := c.Chat.Completions.NewStreaming(ctx, params)
	var acc openai.ChatCompletionAccumulator
	for stream.Next() {
		acc.AddChunk(stream.Current())
	}
	if err := stream.Err(); err != nil {
		t.Fatal(err)
	}
	check("streamed", acc.Choices[0], "get_weather")
	if got, want := acc.Choices[0].Message.ToolCalls[0].Function, chat.Choices[0].Message.ToolCalls[0].Function; got.Name != want.Name || got.Arguments != want.Arguments {
		t.Fatalf("streamed call %+v, whole %+v", got, want)
	}
	return chat
}

// checkToolCalls: cc ended in calls, without text, each to one of names with
// JSON arguments (a city from the enum for get_weather).
func checkToolCalls(t *testing.T, what string, cc openai.ChatCompletionChoice, names ...string) {
	t.Helper()
	if cc.FinishReason != "tool_calls" || len(cc.Message.ToolCalls) == 0 || cc.Message.Content != "" {
		t.Fatalf("%s: finish %q, message %+v", what, cc.FinishReason, cc.Message)
	}
	for _, call := range cc.Message.ToolCalls {
		var args map[string]any
		if err := json.Unmarshal([]byte(call.Function.Arguments), &args); err != nil || call.ID == "" || call.Type != "function" {
			t.Fatalf("%s: call %+v: %v", what, call, err)
		}
		if !slices.Contains(names, call.Function.Name) {
			t.Fatalf("%s: called %q, want one of %v", what, call.Function.Name, names)
		}
		if city := args["city"]; call.Function.Name == "get_weather" && city != "Oslo" && city != "Paris" {
			t.Fatalf("%s: get_weather arguments %s", what, call.Function.Arguments)
		}
	}
}

// TestModelSamplingDefaults: a request that gives no temperature samples at the
// model's recommended one (general.sampling.temp), unless --temp overrides it;
// a recommendation out of range is ignored with a warning.
func TestModelSamplingDefaults(t *testing.T) {
	dir := t.TempDir()
	gen := func(name string, meta map[string]any) string {
		spec := models.Tiny()
		spec.Meta = meta
		path := filepath.Join(dir, name+".gguf")
		if err := models.Generate(path, spec); err != nil {
			t.Fatal(err)
		}
		return path
	}
	greedy := gen("greedy", map[string]any{"general.sampling.temp": float32(0), "general.sampling.top_k": int32(40)})
	outputs := func(n *node) []string {
		var out []string
		for seed := range 4 {
			resp, b := post(t, n.url+"/v1/completions", fmt.Sprintf(`{"prompt":"Once upon a time","max_tokens":24,"seed":%d}`, seed))
			var r struct {
				Choices []struct {
					Text string `json:"text"`
				} `json:"choices"`
			}
			if resp.StatusCode != 200 || json.Unmarshal([]byte(b), &r) != nil || len(r.Choices) != 1 {
				t.Fatalf("%d %s", resp.StatusCode, b)
			}
			out = append(out, r.Choices[0].Text)
		}
		return out
	}
	n := startNode(t, "--model", greedy)
	if out := outputs(n); len(slices.Compact(slices.Clone(out))) != 1 {
		t.Errorf("the model recommends temperature 0, but seeds gave different outputs: %q", out)
	}
	if l := n.log(); !strings.Contains(l, `temperature="0 (model)"`) || !strings.Contains(l, `top_k="40 (model)"`) {
		t.Errorf("defaults not logged:\n%s", l)
	}
	n = startNode(t, "--model", greedy, "--temp", "2")
	if out := outputs(n); len(slices.Compact(slices.Clone(out))) == 1 {
		t.Errorf("--temp 2 over the model's 0: every seed gave %q", out[0])
	}
	if l := n.log(); !strings.Contains(l, `temperature="2 (flag)"`) {
		t.Errorf("flag default not logged:\n%s", l)
	}
	n = startNode(t, "--model", gen("hot", map[string]any{"general.sampling.temp": float32(7)}))
	if l := n.log(); !strings.Contains(l, "ignoring the model's recommended sampling parameters") {
		t.Errorf("out-of-range recommendation not warned about:\n%s", l)
	}
	if err := runServe([]string{"--addr", "127.0.0.1:0", "--model", greedy, "--top-p", "0"}, io.Discard, io.Discard); err == nil || !strings.Contains(err.Error(), "top_p") {
		t.Errorf("--top-p 0: %v", err)
	}
}

// TestNativeToolCalls: a model whose template shows tools in the Hermes/Qwen
// format gets the tools in its template and calls them in <tool_call> tags,
// held by the grammar to the offered tools (from the first token when a call is
// required, lazily under auto); the calls come back as OpenAI tool_calls, whole
// or streamed, and the next turn renders them as the template lays them out.
// --jinja=false falls back to the tool protocol.
// templateModel writes the small test model with a chat template, as
// dir/name.gguf, and returns its path.
func templateModel(t *testing.T, name, template string) string {
	t.Helper()
	spec := models.Small()
	spec.ChatTemplate = template
	path := filepath.Join(t.TempDir(), name+".gguf")
	if err := models.Generate(path, spec); err != nil {
		t.Fatal(err)
	}
	return path
}

func TestNativeToolCalls(t *testing.T) {
	spec := models.Small()
	spec.ChatTemplate = models.ToolsTemplate
	path := filepath.Join(t.TempDir(), "tools.gguf")
	if err := models.Generate(path, spec); err != nil {
		t.Fatal(err)
	}
	n := startNode(t, "--model", path)
	if l := n.log(); !strings.Contains(l, "renderer=jinja") || !strings.Contains(l, "tool_calls=hermes") {
		t.Fatalf("the template's call format was not recognised:\n%s", l)
	}
	c := n.client("")
	ctx := context.Background()
	_, _, params := toolRequest("tools")
	check := func(what string, cc openai.ChatCompletionChoice, names ...string) {
		t.Helper()
		if checkToolCalls(t, what, cc, names...); len(cc.Message.ToolCalls) != 1 {
			t.Fatalf("%s: %d calls with parallel_tool_calls false", what, len(cc.Message.ToolCalls))
		}
	}
	chat := callRequiredNamedStreamed(t, c, params, check)

	// Under auto the model writes text unless it opens a call; the tags never
	// reach the content.
	for seed := range 4 {
		p := params
		p.ToolChoice = openai.ChatCompletionToolChoiceOptionUnionParam{OfAuto: openai.String("auto")}
		p.Seed, p.MaxTokens = openai.Int(int64(seed)), openai.Int(40)
		r, err := c.Chat.Completions.New(ctx, p)
		if err != nil {
			t.Fatal(err)
		}
		switch cc := r.Choices[0]; cc.FinishReason {
		case "tool_calls":
			check("auto", cc, "get_weather", "get_time")
		default:
			if cc.Message.Content == "" || strings.Contains(cc.Message.Content, "<tool_call>") || len(cc.Message.ToolCalls) > 0 {
				t.Fatalf("auto, seed %d: finish %q, message %+v", seed, cc.FinishReason, cc.Message)
			}
		}
	}

	// The next turn: the call and its result rendered by the template.
	call := chat.Choices[0].Message.ToolCalls[0]
	detok, _ := json.Marshal(map[string]any{"model": "tools", "tokens": nextTurn(t, n, params, chat)})
	resp, b := post(t, n.url+"/detokenize", string(detok))
	var prompt struct {
		Prompt string `json:"prompt"`
	}
	wantCall := fmt.Sprintf("<tool_call>\n{\"name\": \"get_weather\", \"arguments\": %s}\n</tool_call>", strings.ReplaceAll(call.Function.Arguments, `":`, `": `))
	if resp.StatusCode != 200 || json.Unmarshal([]byte(b), &prompt) != nil || !strings.Contains(prompt.Prompt, wantCall) ||
		!strings.Contains(prompt.Prompt, "<tool_response>\n{\"temperature_c\": 3}\n</tool_response>") {
		t.Fatalf("the next turn's prompt lacks the call %q or its result:\n%s", wantCall, b)
	}

	// Llama 3's format, one bare JSON call ({"name": ..., "parameters": ...}),
	// Qwen 3.5's XML calls, each parameter in its own tag, and GLM's, each a
	// key and a value tag; the next turn lays out the call.
	for format, tmpl := range map[string]string{"llama3": models.Llama3ToolsTemplate, "qwen3-coder": models.QwenXMLToolsTemplate, "glm": models.GLMToolsTemplate} {
		spec.ChatTemplate = tmpl
		path := filepath.Join(t.TempDir(), format+".gguf")
		if err := models.Generate(path, spec); err != nil {
			t.Fatal(err)
		}
		n := startNode(t, "--model", path)
		if !strings.Contains(n.log(), "tool_calls="+format) {
			t.Fatalf("%s's call format was not recognised:\n%s", format, n.log())
		}
		p := params
		p.Model, p.Messages = format, params.Messages[:2]
		p.ToolChoice = openai.ChatCompletionToolChoiceOptionUnionParam{OfAuto: openai.String("required")}
		p.MaxTokens = openai.Int(200)
		chat := callRequiredNamedStreamed(t, n.client(""), p, check)
		nextTurn(t, n, p, chat)
	}
	// References inside referenced definitions resolve in the XML format too.
	addr := openai.ChatCompletionFunctionTool(shared.FunctionDefinitionParam{Name: "mk", Parameters: shared.FunctionParameters{
		"$defs": map[string]any{
			"Kind": map[string]any{"type": "string", "enum": []string{"home", "work"}},
			"Addr": map[string]any{"type": "object", "properties": map[string]any{"zip": map[string]any{"type": "integer", "minimum": 1, "maximum": 99}, "kind": map[string]any{"$ref": "#/$defs/Kind"}},
				"required": []string{"zip", "kind"}, "additionalProperties": false}},
		"type": "object", "properties": map[string]any{"addr": map[string]any{"$ref": "#/$defs/Addr"}}, "required": []string{"addr"}}})
	xml := models.Small()
	xml.ChatTemplate = models.QwenXMLToolsTemplate
	xmlPath := filepath.Join(t.TempDir(), "xml.gguf")
	if err := models.Generate(xmlPath, xml); err != nil {
		t.Fatal(err)
	}
	n = startNode(t, "--model", xmlPath)
	c = n.client("")
	for seed := range 3 {
		r, err := c.Chat.Completions.New(ctx, openai.ChatCompletionNewParams{Model: "xml", Messages: params.Messages[:2],
			Tools: []openai.ChatCompletionToolUnionParam{addr}, ToolChoice: openai.ChatCompletionToolChoiceOptionUnionParam{OfAuto: openai.String("required")},
			MaxTokens: openai.Int(300), Seed: openai.Int(int64(seed)), ParallelToolCalls: openai.Bool(false)})
		if err != nil {
			t.Fatal(err)
		}
		var args struct {
			Addr struct {
				Zip  int    `json:"zip"`
				Kind string `json:"kind"`
			} `json:"addr"`
		}
		cc := r.Choices[0]
		if cc.FinishReason != "tool_calls" || json.Unmarshal([]byte(cc.Message.ToolCalls[0].Function.Arguments), &args) != nil ||
			(args.Addr.Kind != "home" && args.Addr.Kind != "work") || args.Addr.Zip < 1 || args.Addr.Zip > 99 {
			t.Fatalf("seed %d: finish %q, calls %+v", seed, cc.FinishReason, cc.Message.ToolCalls)
		}
	}

	// A string parameter in the XML format is free text up to its closing tag.
	note := openai.ChatCompletionFunctionTool(shared.FunctionDefinitionParam{Name: "note", Parameters: shared.FunctionParameters{
		"type": "object", "properties": map[string]any{"text": map[string]any{"type": "string"}, "n": map[string]any{"type": "integer"}}, "required": []string{"text", "n"}}})
	for seed := range 3 {
		r, err := c.Chat.Completions.New(ctx, openai.ChatCompletionNewParams{Model: "xml", Messages: params.Messages[:2],
			Tools: []openai.ChatCompletionToolUnionParam{note}, ToolChoice: openai.ChatCompletionToolChoiceOptionUnionParam{OfAuto: openai.String("required")},
			MaxTokens: openai.Int(120), Seed: openai.Int(int64(seed)), ParallelToolCalls: openai.Bool(false)})
		if err != nil {
			t.Fatal(err)
		}
		cc := r.Choices[0]
		if len(cc.Message.ToolCalls) > 1 || cc.Message.Content != "" || (cc.FinishReason != "tool_calls" && cc.FinishReason != "length") {
			t.Fatalf("seed %d: finish %q, message %+v", seed, cc.FinishReason, cc.Message)
		}
		for _, call := range cc.Message.ToolCalls {
			var args struct {
				Text *string `json:"text"`
				N    *int    `json:"n"`
			}
			if err := json.Unmarshal([]byte(call.Function.Arguments), &args); err != nil || call.Function.Name != "note" ||
				(cc.FinishReason == "tool_calls" && (args.Text == nil || args.N == nil)) {
				t.Fatalf("seed %d: finish %q, call %+v: %v", seed, cc.FinishReason, call.Function, err)
			}
		}
		t.Logf("seed %d: %s after %d tokens", seed, cc.FinishReason, r.Usage.CompletionTokens)
	}

	// --jinja=false: llama.cpp's ChatML, tools described in the system message.
	n = startNode(t, "--model", path, "--jinja=false")
	if strings.Contains(n.log(), "renderer=jinja") {
		t.Fatal("--jinja=false rendered with Jinja")
	}
	params.Messages = params.Messages[:2]
	params.ToolChoice = openai.ChatCompletionToolChoiceOptionUnionParam{OfAuto: openai.String("required")}
	params.MaxTokens = openai.Int(200)
	c = n.client("")
	chat, err := c.Chat.Completions.New(ctx, params)
	if err != nil {
		t.Fatal(err)
	}
	check("--jinja=false", chat.Choices[0], "get_weather", "get_time")
}

// TestChatTemplateFile: --chat-template-file renders chats with a Jinja template
// instead of the model's own; a file that does not parse or cannot lay out a
// short chat, or one given with --chat-template or --jinja=false, stops the
// start.
func TestChatTemplateFile(t *testing.T) {
	dir := t.TempDir()
	good, bad := filepath.Join(dir, "tools.jinja"), filepath.Join(dir, "bad.jinja")
	if err := os.WriteFile(good, []byte(models.ToolsTemplate), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(bad, []byte("{% for m in messages %}"), 0o644); err != nil {
		t.Fatal(err)
	}
	raises := filepath.Join(dir, "raises.jinja")
	if err := os.WriteFile(raises, []byte(`{% if messages|length > 1 %}{{ raise_exception("one message only") }}{% endif %}x`), 0o644); err != nil {
		t.Fatal(err)
	}
	for _, args := range [][]string{
		{"--chat-template-file", bad},
		{"--chat-template-file", raises}, // it must lay out a chat, not fall back
		{"--chat-template-file", filepath.Join(dir, "none.jinja")},
		{"--chat-template-file", good, "--chat-template", "chatml"},
		{"--chat-template-file", good, "--jinja=false"},
	} {
		if err := runServe(append([]string{"--addr", "127.0.0.1:0", "--model", smallModel(t)}, args...), io.Discard, io.Discard); err == nil || !strings.Contains(err.Error(), "chat-template") {
			t.Errorf("%q: %v", args, err)
		}
	}
	n := startNode(t, "--model", smallModel(t), "--chat-template-file", good)
	if !strings.Contains(n.log(), "tool_calls=hermes") {
		t.Fatalf("the file's call format was not recognised:\n%s", n.log())
	}
	resp, b := post(t, n.url+"/tokenize", `{"messages": [{"role": "user", "content": "hi"}],
		"tools": [{"type": "function", "function": {"name": "f"}}]}`)
	var tok struct {
		Tokens []int32 `json:"tokens"`
	}
	if resp.StatusCode != 200 || json.Unmarshal([]byte(b), &tok) != nil {
		t.Fatalf("%d %s", resp.StatusCode, b)
	}
	detok, _ := json.Marshal(map[string]any{"tokens": tok.Tokens})
	if resp, b = post(t, n.url+"/detokenize", string(detok)); resp.StatusCode != 200 || !strings.Contains(b, `{\"name\": \"f\"`) || !strings.Contains(b, "tools") {
		t.Fatalf("the prompt does not show the tools as the file lays them out: %s", b)
	}
}

// TestTemplateFallbacks: a template llama.cpp's formats do not recognise is
// rendered as Jinja (chats were refused before); with --jinja=false, or when it
// runs neither way, the start warns and chats are refused with 400.
func TestTemplateFallbacks(t *testing.T) {
	gen := func(name, tmpl string) string {
		spec := models.Tiny()
		spec.ChatTemplate = tmpl
		path := filepath.Join(t.TempDir(), name+".gguf")
		if err := models.Generate(path, spec); err != nil {
			t.Fatal(err)
		}
		return path
	}
	own := gen("own", `{% for m in messages %}<<{{ m.role }}>>{{ m.content }}{% endfor %}<<assistant>>`)
	broken := gen("broken", `{% for m in messages %}`)
	const chat = `{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}`
	for _, c := range []struct {
		args []string
		code int
		warn bool
	}{
		{[]string{"--model", own}, 200, false},
		{[]string{"--model", own, "--jinja=false"}, 400, true},
		{[]string{"--model", broken}, 400, true},
	} {
		n := startNode(t, c.args...)
		resp, b := post(t, n.url+"/v1/chat/completions", chat)
		warned := strings.Contains(n.log(), "chat requests will be refused")
		if resp.StatusCode != c.code || warned != c.warn {
			t.Errorf("%q: %d %s; warned %v", c.args, resp.StatusCode, b, warned)
		}
	}
}

// TestMistralToolCalls: Mistral's two call formats, whose tags are control
// tokens: calls required, named and streamed; a call the model opens with the
// [TOOL_CALLS] token itself under auto (the lazy grammar reads control tokens
// as text); call ids of 9 letters and digits, and a history with longer ids
// (which the list format's templates refuse) mapped to such.
func TestMistralToolCalls(t *testing.T) {
	ctx := context.Background()
	for format, tmpl := range map[string]string{"mistral": models.MistralToolsTemplate, "mistral-list": models.MistralListToolsTemplate} {
		t.Run(format, func(t *testing.T) {
			spec := models.Small()
			spec.ChatTemplate, spec.ControlTokens = tmpl, models.MistralTokens
			path := filepath.Join(t.TempDir(), format+".gguf")
			if err := models.Generate(path, spec); err != nil {
				t.Fatal(err)
			}
			n := startNode(t, "--model", path)
			if !strings.Contains(n.log(), "tool_calls="+format+" ") {
				t.Fatalf("the call format was not recognised:\n%s", n.log())
			}
			c := n.client("")
			check := func(what string, cc openai.ChatCompletionChoice, names ...string) {
				t.Helper()
				checkToolCalls(t, what, cc, names...)
				for _, call := range cc.Message.ToolCalls {
					if len(call.ID) != 9 || strings.Trim(call.ID, "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789") != "" {
						t.Fatalf("%s: call id %q: want 9 letters and digits", what, call.ID)
					}
				}
			}
			_, _, params := toolRequest(format)
			chat := callRequiredNamedStreamed(t, c, params, check)
			nextTurn(t, n, params, chat)

			// Under auto, the [TOOL_CALLS] control token (pushed by logit_bias)
			// opens a call, which the grammar then holds to the tools.
			tag := spec.Vocab - len(models.MistralTokens) + slices.Index(models.MistralTokens, "[TOOL_CALLS]")
			p := params
			p.ToolChoice = openai.ChatCompletionToolChoiceOptionUnionParam{OfAuto: openai.String("auto")}
			p.LogitBias = map[string]int64{fmt.Sprint(tag): 100}
			r, err := c.Chat.Completions.New(ctx, p)
			if err != nil {
				t.Fatal(err)
			}
			check("auto, opened by the control token", r.Choices[0], "get_weather", "get_time")

			// A history from another server, with OpenAI's long call ids.
			p = params
			p.Messages = append(p.Messages[:2:2],
				openai.ChatCompletionMessageParamUnion{OfAssistant: &openai.ChatCompletionAssistantMessageParam{ToolCalls: []openai.ChatCompletionMessageToolCallUnionParam{{
					OfFunction: &openai.ChatCompletionMessageFunctionToolCallParam{ID: "call_0123456789abcdefghij", Function: openai.ChatCompletionMessageFunctionToolCallFunctionParam{Name: "get_weather", Arguments: `{"city": "Oslo"}`}}}}}},
				openai.ToolMessage(`{"temperature_c": 3}`, "call_0123456789abcdefghij"))
			p.ToolChoice = openai.ChatCompletionToolChoiceOptionUnionParam{OfAuto: openai.String("required")}
			if r, err = c.Chat.Completions.New(ctx, p); err != nil {
				t.Fatalf("a history with long call ids: %v", err)
			}
			check("after a history with long ids", r.Choices[0], "get_weather", "get_time")
		})
	}
}
