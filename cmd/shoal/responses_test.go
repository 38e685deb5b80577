package main

import (
	"context"
	"encoding/json"
	"errors"
	"slices"
	"strings"
	"testing"

	"github.com/openai/openai-go/v3"
	"github.com/openai/openai-go/v3/responses"

	"github.com/shoal-ai/shoal/models"
)

// responseBody is what the tests read of a response.
type responseBody struct {
	Status            string `json:"status"`
	IncompleteDetails *struct {
		Reason string `json:"reason"`
	} `json:"incomplete_details"`
	Output []struct {
		Type    string `json:"type"`
		Content []struct {
			Type string `json:"type"`
			Text string `json:"text"`
		} `json:"content"`
		CallID    string `json:"call_id"`
		Name      string `json:"name"`
		Arguments string `json:"arguments"`
	} `json:"output"`
	Usage struct {
		InputTokens  int `json:"input_tokens"`
		OutputTokens int `json:"output_tokens"`
	} `json:"usage"`
}

func (r responseBody) text() string {
	var b strings.Builder
	for _, o := range r.Output {
		for _, c := range o.Content {
			if c.Type == "output_text" {
				b.WriteString(c.Text)
			}
		}
	}
	return b.String()
}

func readResponse(t *testing.T, raw string) responseBody {
	t.Helper()
	var r responseBody
	if err := json.Unmarshal([]byte(raw), &r); err != nil {
		t.Fatalf("response %s: %v", raw, err)
	}
	return r
}

// streamResponse streams params and returns the final response and the text
// of its output_text deltas, checking the events' order.
func streamResponse(t *testing.T, c openai.Client, params responses.ResponseNewParams) (responseBody, string) {
	t.Helper()
	stream := c.Responses.NewStreaming(context.Background(), params)
	var deltas strings.Builder
	var final string
	var types []string
	args := map[string]string{} // a call's arguments (a custom call's input) as streamed
	for n := int64(0); stream.Next(); n++ {
		ev := stream.Current()
		if ev.SequenceNumber != n {
			t.Fatalf("event %d (%s) has sequence_number %d", n, ev.Type, ev.SequenceNumber)
		}
		types = append(types, ev.Type)
		switch ev.Type {
		case "response.output_text.delta":
			deltas.WriteString(ev.Delta)
		case "response.function_call_arguments.delta", "response.custom_tool_call_input.delta":
			args[ev.ItemID] += ev.Delta
		case "response.function_call_arguments.done", "response.custom_tool_call_input.done":
			if whole := ev.Arguments + ev.Input; args[ev.ItemID] != whole {
				t.Fatalf("%s: the deltas join up to %q, not %q", ev.Type, args[ev.ItemID], whole)
			}
		case "response.completed", "response.incomplete":
			final = ev.Response.RawJSON()
		}
	}
	if err := stream.Err(); err != nil {
		t.Fatalf("stream: %v", err)
	}
	if len(types) < 3 || types[0] != "response.created" || types[1] != "response.in_progress" || final == "" || !strings.HasPrefix(types[len(types)-1], "response.") {
		t.Fatalf("events %v", types)
	}
	if strings.Count(strings.Join(types, " "), "output_item.added") != strings.Count(strings.Join(types, " "), "output_item.done") {
		t.Fatalf("items added and done do not pair: %v", types)
	}
	return readResponse(t, final), deltas.String()
}

// TestResponsesAPI: OpenAI's Responses API through the OpenAI Go SDK: text
// whole and streamed, function calls in the model's own format and the next
// turn with their output, structured text, and what a stateless server refuses.
func TestResponsesAPI(t *testing.T) {
	path := templateModel(t, "tools", models.ToolsTemplate)
	n := startNode(t, "--model", path)
	c := n.client("")
	ctx := context.Background()
	params := responses.ResponseNewParams{Model: "tools", Instructions: openai.String("You help."), MaxOutputTokens: openai.Int(12), Temperature: openai.Float(0),
		Input: responses.ResponseNewParamsInputUnion{OfString: openai.String("Tell me a story.")}}
	whole, err := c.Responses.New(ctx, params)
	if err != nil {
		t.Fatal(err)
	}
	w := readResponse(t, whole.RawJSON())
	if w.Status != "incomplete" || w.IncompleteDetails == nil || w.IncompleteDetails.Reason != "max_output_tokens" || len(w.Output) != 1 ||
		w.Output[0].Type != "message" || w.text() == "" || w.Usage.OutputTokens != 12 {
		t.Fatalf("whole: %s", whole.RawJSON())
	}
	s, deltas := streamResponse(t, c, params)
	if s.text() != w.text() || deltas != w.text() || s.Status != "incomplete" {
		t.Fatalf("streamed %q (deltas %q), whole %q", s.text(), deltas, w.text())
	}

	// A call required: a function_call item, whole and streamed alike.
	tp := params
	tp.MaxOutputTokens = openai.Int(200)
	tp.Input = responses.ResponseNewParamsInputUnion{OfString: openai.String("What is the weather in Oslo?")}
	tp.Tools = []responses.ToolUnionParam{responses.ToolParamOfFunction("get_weather", map[string]any{"type": "object",
		"properties": map[string]any{"city": map[string]any{"type": "string", "enum": []string{"Oslo", "Paris"}}}, "required": []string{"city"}, "additionalProperties": false}, true)}
	tp.ToolChoice = responses.ResponseNewParamsToolChoiceUnion{OfToolChoiceMode: openai.Opt(responses.ToolChoiceOptionsRequired)}
	tp.ParallelToolCalls = openai.Bool(false)
	call := func(what string, r responseBody) (callID, args string) {
		t.Helper()
		var in struct{ City string }
		last := r.Output[len(r.Output)-1]
		if r.Status != "completed" || last.Type != "function_call" || last.Name != "get_weather" || last.CallID == "" ||
			json.Unmarshal([]byte(last.Arguments), &in) != nil || in.City != "Oslo" && in.City != "Paris" {
			t.Fatalf("%s: %+v", what, r)
		}
		return last.CallID, last.Arguments
	}
	tw, err := c.Responses.New(ctx, tp)
	if err != nil {
		t.Fatal(err)
	}
	id, args := call("function call", readResponse(t, tw.RawJSON()))
	ts, _ := streamResponse(t, c, tp)
	if _, sargs := call("streamed function call", ts); sargs != args {
		t.Fatalf("streamed arguments %s, whole %s", sargs, args)
	}
	// The next turn: the call and its output as input items.
	next := params
	next.Tools = tp.Tools
	next.Input = responses.ResponseNewParamsInputUnion{OfInputItemList: responses.ResponseInputParam{
		responses.ResponseInputItemParamOfMessage("What is the weather in Oslo?", responses.EasyInputMessageRoleUser),
		responses.ResponseInputItemParamOfFunctionCall(args, id, "get_weather"),
		responses.ResponseInputItemParamOfFunctionCallOutput(`{"temperature_c": 3}`),
	}}
	next.Input.OfInputItemList[2].OfFunctionCallOutput.CallID = openai.String(id)
	if r, err := c.Responses.New(ctx, next); err != nil || readResponse(t, r.RawJSON()).Output[0].Type != "message" {
		t.Fatalf("next turn: %v", err)
	}

	// Structured text: JSON of the schema.
	sp := params
	sp.MaxOutputTokens = openai.Int(100)
	sp.Text = responses.ResponseTextConfigParam{Format: responses.ResponseFormatTextConfigParamOfJSONSchema("answer", map[string]any{"type": "object",
		"properties": map[string]any{"ok": map[string]any{"type": "boolean"}}, "required": []string{"ok"}, "additionalProperties": false})}
	var out struct{ OK *bool }
	if r, err := c.Responses.New(ctx, sp); err != nil || json.Unmarshal([]byte(readResponse(t, r.RawJSON()).text()), &out) != nil || out.OK == nil {
		t.Fatalf("text.format json_schema: %v %v", err, r)
	}

	// Stateless: a previous response cannot be referred to.
	pp := params
	pp.PreviousResponseID = openai.String(whole.ID)
	var apiErr *openai.Error
	if _, err := c.Responses.New(ctx, pp); !errors.As(err, &apiErr) || apiErr.StatusCode != 400 || apiErr.Param != "previous_response_id" {
		t.Fatalf("previous_response_id: %v", err)
	}
}

// TestResponsesCodexShapes: what Codex and the Agents SDK send and expect: a
// reasoning item streamed with its content part, custom (freeform) tools
// answered as custom_tool_call items, hosted tools left out, a call cut short
// sent back, stateful fields refused, errors naming the request's own fields.
func TestResponsesCodexShapes(t *testing.T) {
	n := startNode(t, "--model", templateModel(t, "think", thinkingTemplate))
	tn := startNode(t, "--model", templateModel(t, "tools", models.ToolsTemplate))
	to := func(n *node, body string) (int, string) {
		resp, b := post(t, n.url+"/v1/responses", body)
		return resp.StatusCode, b
	}
	// Streamed thoughts: the item, its part, the deltas, done in order.
	_, b := to(n, `{"model":"think","input":"Why?","max_output_tokens":6,"stream":true}`)
	var types []string
	var final responseBody
	var reasoningTokens int
	for line := range strings.SplitSeq(b, "\n") {
		var ev struct {
			Type     string          `json:"type"`
			Response json.RawMessage `json:"response"`
		}
		if data, ok := strings.CutPrefix(line, "data: "); ok && json.Unmarshal([]byte(data), &ev) == nil {
			types = append(types, ev.Type)
			if ev.Type == "response.incomplete" {
				final = readResponse(t, string(ev.Response))
				var u struct {
					Usage struct {
						OutputTokensDetails struct {
							ReasoningTokens int `json:"reasoning_tokens"`
						} `json:"output_tokens_details"`
					} `json:"usage"`
				}
				_ = json.Unmarshal(ev.Response, &u)
				reasoningTokens = u.Usage.OutputTokensDetails.ReasoningTokens
			}
		}
	}
	want := []string{"response.created", "response.in_progress", "response.output_item.added", "response.content_part.added", "response.reasoning_text.delta"}
	if len(types) < len(want) || !slices.Equal(types[:len(want)], want) || final.Output == nil || final.Output[0].Type != "reasoning" || reasoningTokens != 6 {
		t.Fatalf("streamed thoughts: events %v, reasoning tokens %d, final %+v", types, reasoningTokens, final)
	}
	tools := `"tools":[{"type":"custom","name":"apply_patch","description":"Patch files"},{"type":"web_search"}],"tool_choice":"required","parallel_tool_calls":false`
	for _, stream := range []string{"false", "true"} {
		status, b := to(tn, `{"model":"tools","input":"Fix it.","max_output_tokens":40,"temperature":0,"stream":`+stream+`,`+tools+`}`)
		if status != 200 || !strings.Contains(b, `"type":"custom_tool_call"`) || !strings.Contains(b, `"name":"apply_patch"`) || stream == "true" && !strings.Contains(b, "response.custom_tool_call_input.done") {
			t.Errorf("custom tool (stream %s): %d %s", stream, status, b)
		}
	}
	for body, code := range map[string]int{
		`{"input":[{"role":"user","content":"x"},{"type":"function_call","call_id":"c1","name":"f","arguments":"{\"a\": \"cut"},{"type":"function_call_output","call_id":"c1","output":"r"},{"type":"custom_tool_call","call_id":"c2","name":"apply_patch","input":"*** Begin Patch"},{"type":"custom_tool_call_output","call_id":"c2","output":"done"}],"max_output_tokens":2}`: 200,
		`{"input":"x","conversation":"conv_1"}`:                                         400,
		`{"input":"x","max_output_tokens":0}`:                                           400,
		`{"input":[{"type":"function_call_output","output":"r"}]}`:                      400,
		`{"input":"x","tools":[{"type":"computer_use_preview"}],"max_output_tokens":2}`: 200,
	} {
		status, b := to(n, body)
		if status != code || code == 400 && !strings.Contains(b, `"param":"`) || strings.Contains(body, "max_output_tokens\":0") && !strings.Contains(b, `"param":"max_output_tokens"`) {
			t.Errorf("%s: %d %s, want %d", body, status, b, code)
		}
	}
}
