package main

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"path/filepath"
	"strings"
	"sync"
	"testing"

	"github.com/openai/openai-go/v3"
)

// TestInfill: a model generated with Qwen2.5-Coder's FIM tokens (gen-model
// --fim) serves llama-server's /infill, whole and streamed, and the OpenAI
// SDK's suffix, laid out with those tokens; the plain model refuses both.
func TestInfill(t *testing.T) {
	path := genFile(t, "fim.gguf", "--preset", "small", "--fim")
	n := startNode(t, "--model", path)
	const body = `{"input_prefix":"def add(a, b):\n","input_suffix":"\n\nprint(add(1, 2))\n","input_extra":[{"filename":"util.py","text":"import math\n"}],"n_predict":8,"temperature":0,"seed":1`
	var whole struct {
		Content         string `json:"content"`
		Stop            bool   `json:"stop"`
		StopType        string `json:"stop_type"`
		TokensPredicted int    `json:"tokens_predicted"`
		TokensEvaluated int    `json:"tokens_evaluated"`
		Timings         struct {
			PromptN    int     `json:"prompt_n"`
			PredictedN int     `json:"predicted_n"`
			PromptMS   float64 `json:"prompt_ms"`
		} `json:"timings"`
	}
	resp, b := post(t, n.url+"/infill", body+`}`)
	if resp.StatusCode != 200 || json.Unmarshal([]byte(b), &whole) != nil || !whole.Stop || whole.TokensPredicted == 0 || whole.Timings.PromptN == 0 {
		t.Fatalf("%d %s", resp.StatusCode, b)
	}
	// The prompt holds the FIM tokens as control tokens, each one token.
	resp, b = post(t, n.url+"/tokenize", `{"prompt":"<|fim_prefix|><|fim_suffix|><|fim_middle|><|repo_name|><|file_sep|>","add_special_tokens":false}`)
	if resp.StatusCode != 200 || !strings.Contains(b, `"count":5`) {
		t.Fatalf("FIM tokens: %s", b)
	}
	resp, b = post(t, n.url+"/infill", body+`,"stream":true}`)
	var streamed strings.Builder
	for _, line := range strings.Split(b, "\n") {
		data, ok := strings.CutPrefix(line, "data: ")
		if !ok {
			continue
		}
		var ev struct {
			Content string `json:"content"`
		}
		if err := json.Unmarshal([]byte(data), &ev); err != nil {
			t.Fatalf("%v: %s", err, data)
		}
		streamed.WriteString(ev.Content)
	}
	if resp.StatusCode != 200 || streamed.String() != whole.Content {
		t.Fatalf("streamed %q, whole %q", streamed.String(), whole.Content)
	}

	c := n.client("")
	r, err := c.Completions.New(context.Background(), openai.CompletionNewParams{
		Model:     "fim",
		Prompt:    openai.CompletionNewParamsPromptUnion{OfString: openai.String("def add(a, b):\n")},
		Suffix:    openai.String("\n\nprint(add(1, 2))\n"),
		MaxTokens: openai.Int(4),
	})
	if err != nil {
		t.Fatal(err)
	}
	// BOS, FIM_PRE, the prefix, FIM_SUF, the suffix, FIM_MID: more than the prefix alone.
	resp, b = post(t, n.url+"/tokenize", `{"prompt":"def add(a, b):\n"}`)
	var tok struct {
		Count int `json:"count"`
	}
	if json.Unmarshal([]byte(b), &tok) != nil || int(r.Usage.PromptTokens) < tok.Count+4 {
		t.Fatalf("suffix: %d prompt tokens, the prefix alone %d", r.Usage.PromptTokens, tok.Count)
	}

	plain := startNode(t, "--model", smallModel(t))
	for path, body := range map[string]string{"/infill": `{"input_prefix":"a"}`, "/v1/completions": `{"prompt":"a","suffix":"b"}`} {
		if resp, b := post(t, plain.url+path, body); resp.StatusCode != 400 || !strings.Contains(b, "fill-in-the-middle") {
			t.Errorf("%s on a model without FIM tokens: %d %s", path, resp.StatusCode, b)
		}
	}
}

// TestLoRA: gen-model --lora writes an adapter for a preset's model; serve
// --lora applies it (another greedy answer), at scale 0 not at all, and an
// adapter that does not fit the model stops the start with its reason.
func TestLoRA(t *testing.T) {
	var out, errb bytes.Buffer
	adapter := filepath.Join(t.TempDir(), "lora.gguf")
	if code := run([]string{"gen-model", "--preset", "small", "--lora", "8", "--out", adapter}, &out, &errb); code != 0 {
		t.Fatalf("gen-model --lora: %d %s", code, errb.String())
	}
	// Not for a preset of another architecture: llama.cpp would not load it.
	errb.Reset()
	if code := run([]string{"gen-model", "--preset", "gemma3-tiny", "--lora", "4", "--out", filepath.Join(t.TempDir(), "g.gguf")}, &out, &errb); code == 0 || !strings.Contains(errb.String(), "llama-architecture") {
		t.Fatalf("gen-model --preset gemma3-tiny --lora: %d %s", code, errb.String())
	}
	const body = `{"prompt":"Once upon a time","max_tokens":12,"temperature":0}`
	answer := func(args ...string) string {
		n := startNode(t, append([]string{"--model", smallModel(t)}, args...)...)
		text := completionText(t, n.url, body)
		if len(args) > 0 && !strings.Contains(n.log(), "LoRA adapter applied") {
			t.Errorf("%v: the log does not name the adapter", args)
		}
		return text
	}
	plain, on, off := answer(), answer("--lora", adapter), answer("--lora", adapter+":0")
	if on == plain {
		t.Errorf("with the adapter the answer is the model's own: %q", on)
	}
	if off != plain {
		t.Errorf("at scale 0: %q, the model's own: %q", off, plain)
	}

	// Served as a model of its own (--lora-modules), beside the model: each
	// request runs under the adapter it names, also when they run together.
	n := startNode(t, "--model", smallModel(t), "--model-name", "base", "--lora-modules", "tuned="+adapter)
	ask := func(model string) string {
		resp, b := post(t, n.url+"/v1/completions", `{"model":"`+model+`",`+body[1:])
		var r struct {
			Model   string `json:"model"`
			Choices []struct {
				Text string `json:"text"`
			} `json:"choices"`
		}
		if resp.StatusCode != 200 || json.Unmarshal([]byte(b), &r) != nil || len(r.Choices) != 1 || r.Model != model {
			t.Errorf("%s: %d %s", model, resp.StatusCode, b)
			return ""
		}
		return r.Choices[0].Text
	}
	var wg sync.WaitGroup
	for i := range 6 {
		wg.Go(func() {
			model, want := "base", plain
			if i%2 == 0 {
				model, want = "tuned", on
			}
			if got := ask(model); got != want {
				t.Errorf("%s: %q, want %q", model, got, want)
			}
		})
	}
	wg.Wait()
	if models := modelList(n); !strings.Contains(models, `"id":"tuned"`) || !strings.Contains(models, `"parent":"base"`) {
		t.Errorf("/v1/models: %s", models)
	}
	if resp, b := post(t, n.url+"/v1/completions", `{"model":"other",`+body[1:]); resp.StatusCode != 404 {
		t.Errorf("an unknown model: %d %s", resp.StatusCode, b)
	}

	other := filepath.Join(t.TempDir(), "tiny-lora.gguf")
	if code := run([]string{"gen-model", "--preset", "tiny", "--lora", "4", "--out", other}, &out, &errb); code != 0 {
		t.Fatalf("gen-model --lora: %d %s", code, errb.String())
	}
	errb.Reset()
	if code := run([]string{"serve", "--model", smallModel(t), "--addr", "127.0.0.1:0", "--lora", other}, &out, &errb); code == 0 || !strings.Contains(errb.String(), "incorrect shape") {
		t.Errorf("an adapter for another model: exit %d, %s", code, errb.String())
	}
}

// TestLlamaServerCompletion: llama-server's own /completion on the real engine
// answers a prompt as /v1/completions does (the same greedy text, the same
// prompt tokens), and /props gives the context /v1/models gives.
func TestLlamaServerCompletion(t *testing.T) {
	n := startNode(t, "--model", smallModel(t))
	resp, body := post(t, n.url+"/completion", `{"prompt":"The cat sat on the","n_predict":8,"temperature":0}`)
	var native struct {
		Content         string
		TokensPredicted int `json:"tokens_predicted"`
		TokensEvaluated int `json:"tokens_evaluated"`
	}
	if err := json.Unmarshal([]byte(body), &native); err != nil || resp.StatusCode != 200 || native.TokensPredicted != 8 {
		t.Fatalf("/completion: %d %s", resp.StatusCode, body)
	}
	client := n.client("")
	c, err := client.Completions.New(context.Background(), openai.CompletionNewParams{Model: "small",
		Prompt: openai.CompletionNewParamsPromptUnion{OfString: openai.String("The cat sat on the")}, MaxTokens: openai.Int(8), Temperature: openai.Float(0)})
	if err != nil || c.Choices[0].Text != native.Content || int(c.Usage.PromptTokens) != native.TokensEvaluated {
		t.Fatalf("/v1/completions %+v (%v), /completion %+v", c, err, native)
	}
	// Several prompts in one request, computed together: each answered as alone.
	resp, body = post(t, n.url+"/completion", `{"prompt":["Once upon a time",[1,"The cat sat on the"]],"n_predict":8,"temperature":0}`)
	var several []struct {
		Index   int
		Content string
	}
	_, once := post(t, n.url+"/completion", `{"prompt":"Once upon a time","n_predict":8,"temperature":0}`)
	if err := json.Unmarshal([]byte(body), &several); err != nil || resp.StatusCode != 200 || len(several) != 2 ||
		several[1].Index != 1 || several[1].Content != native.Content || !strings.Contains(once, fmt.Sprintf(`"content":%q`, several[0].Content)) {
		t.Fatalf("/completion with two prompts: %d %s; alone: %s and %q", resp.StatusCode, body, once, native.Content)
	}
	// n_probs on the real engine: greedy picks the likeliest of the alternatives.
	resp, body = post(t, n.url+"/completion", `{"prompt":"The cat sat on the","n_predict":4,"temperature":0,"n_probs":3}`)
	var withProbs struct {
		Probs []struct {
			ID      int
			Logprob float64
			Top     []struct {
				ID      int
				Logprob float64
			} `json:"top_logprobs"`
		} `json:"completion_probabilities"`
	}
	if err := json.Unmarshal([]byte(body), &withProbs); err != nil || resp.StatusCode != 200 || len(withProbs.Probs) != 4 {
		t.Fatalf("n_probs: %d %s", resp.StatusCode, body)
	}
	for _, p := range withProbs.Probs {
		if len(p.Top) != 3 || p.Top[0].ID != p.ID || p.Logprob > 0 || p.Top[1].Logprob > p.Top[0].Logprob {
			t.Fatalf("n_probs token %+v", p)
		}
	}
	// /tokenize in llama-server's shape gives vLLM's shape's tokens.
	_, llama := post(t, n.url+"/tokenize", `{"content":"The cat sat"}`)
	_, vllm := post(t, n.url+"/tokenize", `{"prompt":"The cat sat","add_special_tokens":false}`)
	var a, v struct{ Tokens []int }
	if json.Unmarshal([]byte(llama), &a) != nil || json.Unmarshal([]byte(vllm), &v) != nil || len(a.Tokens) == 0 || fmt.Sprint(a.Tokens) != fmt.Sprint(v.Tokens) {
		t.Fatalf("/tokenize content %s, prompt %s", llama, vllm)
	}
	var props struct {
		Settings struct {
			NCtx int `json:"n_ctx"`
		} `json:"default_generation_settings"`
	}
	if err := json.Unmarshal([]byte(getBody(n.url+"/props")), &props); err != nil || !strings.Contains(modelList(n), fmt.Sprintf(`"max_model_len":%d`, props.Settings.NCtx)) {
		t.Fatalf("/props n_ctx %d, /v1/models %s (%v)", props.Settings.NCtx, modelList(n), err)
	}
}
