package main

import (
	"context"
	"encoding/json"
	"slices"
	"testing"

	"github.com/openai/openai-go/v3"
	"github.com/openai/openai-go/v3/shared"
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
	weather := openai.ChatCompletionFunctionTool(shared.FunctionDefinitionParam{
		Name:        "get_weather",
		Description: openai.String("The weather now in a city"),
		Parameters: shared.FunctionParameters{
			"type":                 "object",
			"properties":           map[string]any{"city": map[string]any{"type": "string", "enum": []string{"Oslo", "Paris"}}},
			"required":             []string{"city"},
			"additionalProperties": false,
		},
	})
	clock := openai.ChatCompletionFunctionTool(shared.FunctionDefinitionParam{Name: "get_time"})
	params := openai.ChatCompletionNewParams{
		Model:      "small",
		Messages:   []openai.ChatCompletionMessageParamUnion{openai.SystemMessage("You help."), openai.UserMessage("What is the weather in Oslo?")},
		Tools:      []openai.ChatCompletionToolUnionParam{weather, clock},
		ToolChoice: openai.ChatCompletionToolChoiceOptionUnionParam{OfAuto: openai.String("required")},
		MaxTokens:  openai.Int(200),
		Seed:       openai.Int(1),
		// A model this small, left to call tools in parallel, calls them until
		// max_tokens; several calls in one answer are checked in the api tests.
		ParallelToolCalls: openai.Bool(false),
	}
	checkCalls := func(what string, cc openai.ChatCompletionChoice, names ...string) {
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
	chat, err := c.Chat.Completions.New(ctx, params)
	if err != nil {
		t.Fatal(err)
	}
	checkCalls("required", chat.Choices[0], "get_weather", "get_time")

	params.ToolChoice = openai.ToolChoiceOptionFunctionToolChoice(openai.ChatCompletionNamedToolChoiceFunctionParam{Name: "get_weather"})
	chat, err = c.Chat.Completions.New(ctx, params)
	if err != nil {
		t.Fatal(err)
	}
	checkCalls("named", chat.Choices[0], "get_weather")
	if len(chat.Choices[0].Message.ToolCalls) != 1 {
		t.Fatalf("parallel_tool_calls false gave %d calls", len(chat.Choices[0].Message.ToolCalls))
	}

	// Streamed, the same seed gives the same call, as the SDK accumulates it.
	stream := c.Chat.Completions.NewStreaming(ctx, params)
	var acc openai.ChatCompletionAccumulator
	for stream.Next() {
		acc.AddChunk(stream.Current())
	}
	if err := stream.Err(); err != nil {
		t.Fatal(err)
	}
	checkCalls("streamed", acc.Choices[0], "get_weather")
	if got, want := acc.Choices[0].Message.ToolCalls[0].Function, chat.Choices[0].Message.ToolCalls[0].Function; got.Name != want.Name || got.Arguments != want.Arguments {
		t.Fatalf("streamed call %+v, whole %+v", got, want)
	}

	// The next turn: the call and its result in the history, the model free to
	// answer or call again.
	call := chat.Choices[0].Message.ToolCalls[0]
	params.Messages = append(params.Messages, chat.Choices[0].Message.ToParam(), openai.ToolMessage(`{"temperature_c": 3}`, call.ID))
	params.ToolChoice = openai.ChatCompletionToolChoiceOptionUnionParam{OfAuto: openai.String("auto")}
	params.MaxTokens = openai.Int(30)
	next, err := c.Chat.Completions.New(ctx, params)
	if err != nil {
		t.Fatal(err)
	}
	if f := next.Choices[0].FinishReason; f != "stop" && f != "length" && f != "tool_calls" {
		t.Fatalf("next turn: finish %q", f)
	}
	body, _ := json.Marshal(params)
	resp, b := post(t, n.url+"/tokenize", string(body))
	var tok struct {
		Count int `json:"count"`
	}
	if resp.StatusCode != 200 || json.Unmarshal([]byte(b), &tok) != nil || tok.Count != int(next.Usage.PromptTokens) {
		t.Fatalf("/tokenize counted %s for a chat prompt of %d tokens", b, next.Usage.PromptTokens)
	}
}
