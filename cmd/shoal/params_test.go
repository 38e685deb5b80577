package main

import (
	"encoding/json"
	"strings"
	"testing"
)

// TestVLLMStopParams: vLLM's min_tokens, stop_token_ids and
// include_stop_str_in_output on a real engine. logit_bias makes the choice of
// the random model: token 4 is <|im_end|> (EOS), 102 the byte "a".
func TestVLLMStopParams(t *testing.T) {
	n := startNode(t, "--model", smallModel(t))
	cases := []struct {
		name, body, text, finish string
		tokens                   int
		stop                     any // stop_reason, as vLLM's
	}{
		{"EOS", `"logit_bias":{"4":100}`, "", "stop", 1, nil},
		{"EOS after min_tokens", `"logit_bias":{"4":100},"min_tokens":5`, "?", "stop", 6, nil}, // "?": the model's text
		{"stop token", `"logit_bias":{"102":100},"stop_token_ids":[102]`, "", "stop", 1, 102.0},
		{"stop token kept", `"logit_bias":{"102":100},"stop_token_ids":[102],"include_stop_str_in_output":true`, "a", "stop", 1, 102.0},
		{"stop token after min_tokens", `"logit_bias":{"102":100,"103":90},"stop_token_ids":[102],"min_tokens":3`, "bbb", "stop", 4, 102.0},
		{"stop string", `"logit_bias":{"102":100},"stop":["aa"]`, "", "stop", 2, "aa"},
		{"stop string kept", `"logit_bias":{"102":100},"stop":["aa"],"include_stop_str_in_output":true`, "aa", "stop", 2, "aa"},
		{"stop string after min_tokens", `"logit_bias":{"102":100},"stop":["aa"],"min_tokens":4,"include_stop_str_in_output":true`, "aaaaa", "stop", 5, "aa"},
		{"length", `"logit_bias":{"102":100},"max_tokens":3`, "aaa", "length", 3, nil},
	}
	for _, c := range cases {
		resp, b := post(t, n.url+"/v1/completions", `{"prompt":"x","temperature":0,"max_tokens":10,`+c.body+`}`) // a later max_tokens wins
		var r struct {
			Choices []struct {
				Text         string `json:"text"`
				FinishReason string `json:"finish_reason"`
				StopReason   any    `json:"stop_reason"`
			} `json:"choices"`
			Usage struct {
				CompletionTokens int `json:"completion_tokens"`
			} `json:"usage"`
		}
		if resp.StatusCode != 200 || json.Unmarshal([]byte(b), &r) != nil || len(r.Choices) != 1 {
			t.Errorf("%s: %d %s", c.name, resp.StatusCode, b)
			continue
		}
		if ch := r.Choices[0]; ch.Text != c.text && c.text != "?" || ch.FinishReason != c.finish || r.Usage.CompletionTokens != c.tokens || ch.StopReason != c.stop {
			t.Errorf("%s: text %q finish %s (%v) after %d tokens, want %q %s (%v) after %d", c.name, ch.Text, ch.FinishReason, ch.StopReason, r.Usage.CompletionTokens, c.text, c.finish, c.stop, c.tokens)
		}
	}
	// Streamed chat keeps the stop string too.
	resp, b := post(t, n.url+"/v1/chat/completions", `{"messages":[{"role":"user","content":"x"}],"stream":true,"logit_bias":{"102":100},"stop":["aaa"],"include_stop_str_in_output":true}`)
	var text strings.Builder
	for line := range strings.SplitSeq(b, "\n") {
		var ev struct {
			Choices []struct {
				Delta struct {
					Content string `json:"content"`
				} `json:"delta"`
			} `json:"choices"`
		}
		if data, ok := strings.CutPrefix(line, "data: "); ok && json.Unmarshal([]byte(data), &ev) == nil && len(ev.Choices) > 0 {
			text.WriteString(ev.Choices[0].Delta.Content)
		}
	}
	if resp.StatusCode != 200 || text.String() != "aaa" {
		t.Errorf("streamed: %d content %q, want \"aaa\": %s", resp.StatusCode, text.String(), b)
	}
	for _, body := range []string{
		`{"prompt":"x","max_tokens":4,"min_tokens":5}`,
		`{"prompt":"x","min_tokens":17}`, // /v1/completions' default max_tokens is 16
		`{"prompt":"x","min_tokens":-1}`,
		`{"prompt":"x","stop_token_ids":[1000000]}`,
		`{"prompt":"x","stop_token_ids":"a"}`,
	} {
		if resp, b := post(t, n.url+"/v1/completions", body); resp.StatusCode != 400 || !strings.Contains(b, `"param"`) {
			t.Errorf("%s: %d %s, want 400 naming the field", body, resp.StatusCode, b)
		}
	}
}

// TestImpossibleSchemas: a schema whose bounds no value meets is a 400 naming
// the field, at once, on the real converter and grammar parser: minLength above
// maxLength once made llama.cpp's parser allocate until memory ran out, and an
// integer range with its minimum above its maximum failed sampling with a 500.
func TestImpossibleSchemas(t *testing.T) {
	n := startNode(t, "--model", smallModel(t))
	chat := func(extra string) string {
		return `{"messages":[{"role":"user","content":"x"}],"max_tokens":8,` + extra + `}`
	}
	format := func(schema string) string {
		return chat(`"response_format":{"type":"json_schema","json_schema":{"name":"x","schema":` + schema + `}}`)
	}
	for body, param := range map[string]string{
		format(`{"type":"string","minLength":3,"maxLength":1}`):                                   "response_format",
		format(`{"type":"string","pattern":"^a{5,3}$"}`):                                          "response_format",
		format(`{"type":"integer","minimum":5,"maximum":3}`):                                      "response_format",
		format(`{"type":"number","exclusiveMinimum":3,"exclusiveMaximum":3}`):                     "response_format",
		format(`{"type":"object","properties":{"a":{"type":"array","minItems":2,"maxItems":1}}}`): "response_format",
		chat(`"tools":[{"type":"function","function":{"name":"f","parameters":{"type":"object","properties":{"s":{"type":"string","minLength":9,"maxLength":2}}}}}],"tool_choice":"required"`): "tools[0]",
		// What llama.cpp's converter recursed on until the process died.
		chat(`"guided_json":{"$ref":"#/$defs/a","$defs":{"a":{"$ref":"#/$defs/a"}}}`):                                 "guided_json",
		format(`{"type":"object","properties":{"` + strings.Repeat("!", 30000) + `":{"type":"string"}}}`):             "response_format",
		format(`{"type":"string","pattern":"^` + strings.Repeat("(", 5000) + "a" + strings.Repeat(")", 5000) + `$"}`): "response_format",
		chat(`"presence_penalty":3`):    "presence_penalty",
		chat(`"logit_bias":{"5":1000}`): "logit_bias",
	} {
		resp, b := post(t, n.url+"/v1/chat/completions", body)
		var e struct {
			Error struct {
				Param string `json:"param"`
			} `json:"error"`
		}
		if resp.StatusCode != 400 || json.Unmarshal([]byte(b), &e) != nil || e.Error.Param != param {
			t.Errorf("%s: %d %s, want 400 naming %s", body, resp.StatusCode, b, param)
		}
	}
	if resp, b := post(t, n.url+"/v1/chat/completions", chat(`"temperature":0`)); resp.StatusCode != 200 {
		t.Fatalf("after them: %d %s", resp.StatusCode, b)
	}
}

// TestSchemaPatterns: a schema's pattern goes through GrammarPattern before
// llama.cpp's converter, which crashed the process on (?:...)+: a pattern the
// grammar can express is served, one it cannot is refused in an output
// constraint and left out of tools' parameters.
func TestSchemaPatterns(t *testing.T) {
	n := startNode(t, "--model", smallModel(t))
	tool := func(pattern string) string {
		p, _ := json.Marshal(pattern)
		return `{"messages":[{"role":"user","content":"x"}],"max_tokens":8,"tool_choice":"required","tools":[{"type":"function","function":{"name":"f","parameters":{"type":"object","properties":{"v":{"type":"string","pattern":` + string(p) + `}},"required":["v"]}}}]}`
	}
	format := func(pattern string) string {
		p, _ := json.Marshal(pattern)
		return `{"messages":[{"role":"user","content":"x"},{"role":"assistant","content":"x"}],"continue_final_message":true,"max_tokens":8,"response_format":{"type":"json_schema","json_schema":{"name":"x","schema":{"type":"string","pattern":` + string(p) + `}}}}`
	}
	for body, status := range map[string]int{
		tool("^(?:ab)+$"): 200, tool("^(?=.*[a-z]).+$"): 200, tool(`^\d{3}-\w+$`): 200, tool("abc"): 200, tool(`^\p{L}+$`): 200,
		format("^(?:ab)+$"): 200, format("abc"): 200, format(`^\d{3}$`): 200,
		format("^(?=.*[a-z]).+$"): 400, format(`^\p{L}+$`): 400,
	} {
		if resp, b := post(t, n.url+"/v1/chat/completions", body); resp.StatusCode != status {
			t.Errorf("%s: %d %s, want %d", body, resp.StatusCode, b, status)
		}
	}
	if resp, b := post(t, n.url+"/v1/completions", `{"prompt":"x","max_tokens":2}`); resp.StatusCode != 200 {
		t.Fatalf("after them: %d %s", resp.StatusCode, b)
	}
}
