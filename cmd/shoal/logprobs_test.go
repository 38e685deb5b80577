package main

import (
	"context"
	"encoding/json"
	"fmt"
	"math"
	"strconv"
	"strings"
	"testing"

	"github.com/openai/openai-go/v3"

	"github.com/shoal-ai/shoal/scheduler"
)

// TestPromptLogprobs: on the real engine, a greedy continuation scored as a
// prompt gets back the logprobs it was generated with, the way
// lm-evaluation-harness's loglikelihood asks (token ids, echo with logprobs,
// max_tokens 1), in chunks and whatever the cache holds; vLLM's prompt_logprobs
// say the same.
func TestPromptLogprobs(t *testing.T) {
	n := startNode(t, "--model", smallModel(t), "--max-batch-tokens", "16", "--max-running", "8")
	resp, b := post(t, n.url+"/v1/completions", `{"prompt":"Once upon a time","max_tokens":8,"temperature":0,"logprobs":1,"ignore_eos":true,"return_tokens_as_token_ids":true}`)
	var gen struct {
		Choices []struct {
			Logprobs struct {
				Tokens        []string  `json:"tokens"`
				TokenLogprobs []float64 `json:"token_logprobs"`
			} `json:"logprobs"`
		} `json:"choices"`
	}
	if resp.StatusCode != 200 || json.Unmarshal([]byte(b), &gen) != nil || len(gen.Choices) != 1 || len(gen.Choices[0].Logprobs.Tokens) != 8 {
		t.Fatalf("%d %s", resp.StatusCode, b)
	}
	resp, b = post(t, n.url+"/tokenize", `{"prompt":"Once upon a time"}`)
	var tok struct {
		Tokens []int64 `json:"tokens"`
	}
	if resp.StatusCode != 200 || json.Unmarshal([]byte(b), &tok) != nil {
		t.Fatalf("%d %s", resp.StatusCode, b)
	}
	ids := tok.Tokens
	for _, s := range gen.Choices[0].Logprobs.Tokens {
		id, err := strconv.ParseInt(strings.TrimPrefix(s, "token_id:"), 10, 64)
		if err != nil {
			t.Fatalf("token %q: %v", s, err)
		}
		ids = append(ids, id)
	}
	want := gen.Choices[0].Logprobs.TokenLogprobs
	p := len(tok.Tokens)

	c := n.client("")
	score := func(what string) []float64 {
		t.Helper()
		r, err := c.Completions.New(context.Background(), openai.CompletionNewParams{
			Model:       "small",
			Prompt:      openai.CompletionNewParamsPromptUnion{OfArrayOfTokenArrays: [][]int64{ids}},
			Echo:        openai.Bool(true),
			Logprobs:    openai.Int(1),
			MaxTokens:   openai.Int(1),
			Temperature: openai.Float(0),
		})
		if err != nil {
			t.Fatalf("%s: %v", what, err)
		}
		lp := r.Choices[0].Logprobs
		if len(lp.TokenLogprobs) != len(ids)+1 || len(lp.TopLogprobs) != len(ids)+1 || r.Usage.PromptTokensDetails.CachedTokens != 0 {
			t.Fatalf("%s: %d logprobs (%d top) for %d prompt tokens and 1 generated, %d cached", what, len(lp.TokenLogprobs), len(lp.TopLogprobs), len(ids), r.Usage.PromptTokensDetails.CachedTokens)
		}
		worst := 0.0
		for i := range 8 {
			// Scored in a prefill of many rows against generated one row at a time:
			// the kernels may round differently, not more.
			got := lp.TokenLogprobs[p+i]
			if worst = max(worst, math.Abs(got-want[i])); math.Abs(got-want[i]) > 5e-3 {
				t.Errorf("%s: generated token %d: scored %v, generated with %v", what, i, got, want[i])
			}
		}
		t.Logf("%s: largest difference from the generated logprobs %.2g", what, worst)
		return lp.TokenLogprobs
	}
	first := score("scored")
	// The same again: the prompt is cached now, and is computed again.
	if again := score("again"); fmt.Sprint(again) != fmt.Sprint(first) {
		t.Fatalf("scored again %v, first %v", again, first)
	}

	resp, b = post(t, n.url+"/v1/completions", fmt.Sprintf(`{"prompt":[%s],"max_tokens":1,"prompt_logprobs":2}`, strings.Trim(strings.Join(strings.Fields(fmt.Sprint(ids)), ","), "[]")))
	var vl struct {
		Choices []struct {
			PromptLogprobs []map[string]struct {
				Logprob float64 `json:"logprob"`
				Rank    int     `json:"rank"`
			} `json:"prompt_logprobs"`
		} `json:"choices"`
	}
	if resp.StatusCode != 200 || json.Unmarshal([]byte(b), &vl) != nil || len(vl.Choices) != 1 || len(vl.Choices[0].PromptLogprobs) != len(ids) {
		t.Fatalf("%d %s", resp.StatusCode, b)
	}
	for i, m := range vl.Choices[0].PromptLogprobs[1:] {
		e, ok := m[strconv.FormatInt(ids[i+1], 10)]
		if !ok || math.Abs(e.Logprob-first[i+1]) > 1e-6 || e.Rank < 1 || len(m) > 3 {
			t.Fatalf("prompt token %d (%d): %v; echo said %v", i+1, ids[i+1], m, first[i+1])
		}
		if i+1 >= p && e.Rank != 1 {
			t.Errorf("greedy token %d has rank %d", i+1-p, e.Rank)
		}
	}
}

// TestSpeculativeFlags: vLLM's --speculative-config sets n-gram speculation
// (other methods are refused), and a node serving with it counts proposals in
// vLLM's metrics.
func TestSpeculativeFlags(t *testing.T) {
	base := scheduler.DefaultConfig().Spec
	got, err := parseSpeculativeConfig(`{"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 3}`, base)
	if err != nil || got.Tokens != 5 || got.NgramMax != 3 || got.NgramMin != base.NgramMin {
		t.Fatalf("%+v %v", got, err)
	}
	for _, bad := range []string{`{"method": "eagle", "num_speculative_tokens": 3}`, `{"method": "ngram"}`, `{"method": "ngram", "num_speculative_tokens": 2, "model": "x"}`, `not json`} {
		if _, err := parseSpeculativeConfig(bad, base); err == nil {
			t.Errorf("%s: accepted", bad)
		}
	}
	n := startNode(t, "--model", smallModel(t), "--speculative-config", `{"method":"ngram","num_speculative_tokens":4,"prompt_lookup_min":1}`)
	resp, b := post(t, n.url+"/v1/completions", `{"prompt":"a b a b a b a b a b a b","max_tokens":32,"temperature":0,"ignore_eos":true}`)
	if resp.StatusCode != 200 {
		t.Fatalf("%d %s", resp.StatusCode, b)
	}
	if v := n.metric(t, "vllm:spec_decode_num_draft_tokens_total"); v == "" || v == "0" {
		t.Fatalf("draft tokens metric %q after a repetitive prompt", v)
	}
	// vLLM's acceptance by position: one series per proposed position, adding
	// up to the tokens taken.
	at := n.metrics(t, "vllm:spec_decode_num_accepted_tokens_per_pos_total")
	if len(at) != 4 || n.metricSum(t, "vllm:spec_decode_num_accepted_tokens_per_pos_total") != n.metricSum(t, "vllm:spec_decode_num_accepted_tokens_total") ||
		n.metricSum(t, "vllm:spec_decode_num_drafts_total") == 0 {
		t.Fatalf("accepted by position %v, drafts %s", at, n.metric(t, "vllm:spec_decode_num_drafts_total"))
	}
	t.Logf("proposed %s in %s drafts, taken %s (by position %v)", n.metric(t, "vllm:spec_decode_num_draft_tokens_total"),
		n.metric(t, "vllm:spec_decode_num_drafts_total"), n.metric(t, "vllm:spec_decode_num_accepted_tokens_total"), at)
}
