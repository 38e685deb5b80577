package main

import (
	"bufio"
	"context"
	"crypto/tls"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"maps"
	"math"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/openai/openai-go/v3"
	"github.com/openai/openai-go/v3/option"

	"github.com/shoal-ai/shoal/api"
	"github.com/shoal-ai/shoal/engine"
	"github.com/shoal-ai/shoal/models"
)

// The test binary doubles as the shoal binary, so that tests run real `shoal serve`
// processes without building anything else.
func TestMain(m *testing.M) {
	if os.Getenv("SHOAL_TEST_BE_MAIN") == "1" {
		os.Exit(run(os.Args[1:], os.Stdout, os.Stderr))
	}
	os.Exit(m.Run())
}

var (
	smallOnce   sync.Once
	smallPath   string
	smallErr    error
	storiesGGUF = "../../../shared/models/stories260K.gguf"
)

func smallModel(t testing.TB) string {
	t.Helper()
	smallOnce.Do(func() {
		dir, err := os.MkdirTemp("", "shoal-serve-test")
		if err != nil {
			smallErr = err
			return
		}
		smallPath = filepath.Join(dir, "small.gguf")
		smallErr = models.Generate(smallPath, models.Small())
	})
	if smallErr != nil {
		t.Fatal(smallErr)
	}
	return smallPath
}

// genFile runs `shoal gen-model` with args, writing a file named name in a
// temporary directory, and returns its path.
func genFile(t testing.TB, name string, args ...string) string {
	t.Helper()
	p := filepath.Join(t.TempDir(), name)
	var out, errb strings.Builder
	if code := run(append(append([]string{"gen-model"}, args...), "--out", p), &out, &errb); code != 0 {
		t.Fatalf("gen-model %v: exit %d: %s", args, code, errb.String())
	}
	return p
}

// node is a running `shoal serve` process.
type node struct {
	cmd  *exec.Cmd
	url  string // http://127.0.0.1:port
	logs *strings.Builder
	mu   *sync.Mutex
	done chan error
}

var listenRE = regexp.MustCompile(`msg=listening addr=(\S+)`)

func startNode(t testing.TB, args ...string) *node {
	t.Helper()
	// One thread each: tests run several nodes at once, and llama.cpp's threads
	// spin while they wait for each other (two nodes of two threads on two
	// cores ran sixty times slower).
	cmd := exec.Command(os.Args[0], append([]string{"serve", "--addr", "127.0.0.1:0", "--threads", "1"}, args...)...)
	cmd.Env = append(os.Environ(), "SHOAL_TEST_BE_MAIN=1")
	stderr, err := cmd.StderrPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	n := &node{cmd: cmd, logs: &strings.Builder{}, mu: &sync.Mutex{}, done: make(chan error, 1)}
	addr := make(chan string, 1)
	go func() {
		sc := bufio.NewScanner(stderr)
		for sc.Scan() {
			line := sc.Text()
			n.mu.Lock()
			n.logs.WriteString(line + "\n")
			n.mu.Unlock()
			if m := listenRE.FindStringSubmatch(line); m != nil {
				addr <- m[1]
			}
		}
	}()
	go func() { n.done <- cmd.Wait() }()
	t.Cleanup(func() {
		if cmd.ProcessState == nil {
			cmd.Process.Kill()
			<-n.done
		}
		if t.Failed() {
			t.Logf("node log:\n%s", n.log())
		}
	})
	select {
	case a := <-addr:
		n.url = "http://" + a
		if slices.Contains(args, "--tls-cert") {
			n.url = "https://" + a
		}
	case err := <-n.done:
		t.Fatalf("node exited before listening: %v\n%s", err, n.log())
	case <-time.After(30 * time.Second):
		t.Fatalf("node did not listen\n%s", n.log())
	}
	deadline := time.Now().Add(60 * time.Second)
	probe := &http.Client{Transport: &http.Transport{TLSClientConfig: &tls.Config{InsecureSkipVerify: true}}}
	for {
		select {
		case err := <-n.done:
			n.done <- err // for the cleanup
			t.Fatalf("node exited before it was ready: %v", err)
		default:
		}
		resp, err := probe.Get(n.url + "/ready")
		if err == nil {
			resp.Body.Close()
			// Ready, and its "ready" line read: what it logged while loading
			// (read from its stderr apart) is in n.log() for the tests to check.
			if resp.StatusCode == 200 && strings.Contains(n.log(), "msg=ready ") {
				return n
			}
		}
		if time.Now().After(deadline) {
			t.Fatalf("node not ready\n%s", n.log())
		}
		time.Sleep(20 * time.Millisecond)
	}
}

func (n *node) log() string {
	n.mu.Lock()
	defer n.mu.Unlock()
	return n.logs.String()
}

func (n *node) client(key string) openai.Client {
	return openai.NewClient(option.WithBaseURL(n.url+"/v1/"), option.WithAPIKey(key), option.WithMaxRetries(0))
}

// metric is the value of the first series of name, "" when there is none.
func (n *node) metric(t *testing.T, name string) string {
	t.Helper()
	if vs := n.metrics(t, name); len(vs) > 0 {
		return vs[0]
	}
	return ""
}

// metricSum is the sum of every series of name (each label value of a counter).
func (n *node) metricSum(t *testing.T, name string) float64 {
	t.Helper()
	sum := 0.0
	for _, v := range n.metrics(t, name) {
		f, err := strconv.ParseFloat(v, 64)
		if err != nil {
			t.Fatalf("%s: %q: %v", name, v, err)
		}
		sum += f
	}
	return sum
}

// metrics is the value of each series of name, in the order /metrics lists them.
func (n *node) metrics(t *testing.T, name string) []string {
	t.Helper()
	resp, err := http.Get(n.url + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	var out []string
	for _, line := range strings.Split(string(b), "\n") {
		if strings.HasPrefix(line, name+"{") || strings.HasPrefix(line, name+" ") {
			out = append(out, line[strings.LastIndex(line, " ")+1:])
		}
	}
	return out
}

func TestServeWithOpenAISDK(t *testing.T) {
	n := startNode(t, "--model", smallModel(t), "--api-key", "secret", "--ctx-size", "4096", "--parallel", "16", "--max-running", "8", "--allow-cache-reset")
	c := n.client("secret")
	ctx := context.Background()

	models, err := c.Models.List(ctx)
	if err != nil || len(models.Data) != 1 || models.Data[0].ID != "small" {
		t.Fatalf("models: %+v %v", models, err)
	}

	hello := openai.ChatCompletionNewParams{
		Model:       "small",
		Messages:    []openai.ChatCompletionMessageParamUnion{openai.SystemMessage("be brief"), openai.UserMessage("Say hello.")},
		MaxTokens:   openai.Int(8),
		Temperature: openai.Float(0),
	}
	chat, err := c.Chat.Completions.New(ctx, hello)
	if err != nil {
		t.Fatal(err)
	}
	if len(chat.Choices) != 1 || chat.Choices[0].FinishReason == "" || chat.Usage.CompletionTokens == 0 || chat.Usage.PromptTokens == 0 {
		t.Fatalf("chat: %+v", chat)
	}
	// The same prompt again is served from the prefix cache.
	chat2, err := c.Chat.Completions.New(ctx, hello)
	if err != nil {
		t.Fatal(err)
	}
	if chat2.Choices[0].Message.Content != chat.Choices[0].Message.Content {
		t.Fatalf("greedy output changed: %q vs %q", chat2.Choices[0].Message.Content, chat.Choices[0].Message.Content)
	}
	if chat.Usage.PromptTokens >= 32 && chat2.Usage.PromptTokensDetails.CachedTokens == 0 {
		t.Errorf("second identical prompt reported no cached tokens: %+v", chat2.Usage)
	}
	// vLLM's /reset_prefix_cache: the same prompt then is computed whole, to
	// the same answer.
	if r, b := post(t, n.url+"/reset_prefix_cache", "", "Authorization", "Bearer secret"); r.StatusCode != 200 || !strings.Contains(b, "dropped_blocks") {
		t.Fatalf("reset_prefix_cache: %d %s", r.StatusCode, b)
	}
	chat3, err := c.Chat.Completions.New(ctx, hello)
	if err != nil || chat3.Usage.PromptTokensDetails.CachedTokens != 0 || chat3.Choices[0].Message.Content != chat.Choices[0].Message.Content {
		t.Fatalf("after a reset: %+v %v", chat3, err)
	}

	stream := c.Chat.Completions.NewStreaming(ctx, openai.ChatCompletionNewParams{
		Model:         "small",
		Messages:      []openai.ChatCompletionMessageParamUnion{openai.UserMessage("Count to three.")},
		MaxTokens:     openai.Int(6),
		Temperature:   openai.Float(0),
		StreamOptions: openai.ChatCompletionStreamOptionsParam{IncludeUsage: openai.Bool(true)},
	})
	var acc openai.ChatCompletionAccumulator
	chunks := 0
	for stream.Next() {
		acc.AddChunk(stream.Current())
		chunks++
	}
	if err := stream.Err(); err != nil {
		t.Fatal(err)
	}
	if chunks < 3 || acc.Usage.CompletionTokens != 6 || acc.Choices[0].FinishReason != "length" {
		t.Fatalf("stream: %d chunks, usage %+v, finish %q", chunks, acc.Usage, acc.Choices[0].FinishReason)
	}

	comp, err := c.Completions.New(ctx, openai.CompletionNewParams{
		Model:       "small",
		Prompt:      openai.CompletionNewParamsPromptUnion{OfArrayOfStrings: []string{"The cat", "A dog"}},
		MaxTokens:   openai.Int(4),
		Temperature: openai.Float(0),
		N:           openai.Int(2),
	})
	if err != nil {
		t.Fatal(err)
	}
	if len(comp.Choices) != 4 || comp.Usage.CompletionTokens != 16 {
		t.Fatalf("completions: %d choices, usage %+v", len(comp.Choices), comp.Usage)
	}
	// vLLM's per-request histograms saw each of the 8 choices, with its tokens.
	generated := chat.Usage.CompletionTokens + chat2.Usage.CompletionTokens + chat3.Usage.CompletionTokens + 6 + 16
	for name, want := range map[string]float64{
		"vllm:request_generation_tokens_count": 8, "vllm:request_generation_tokens_sum": float64(generated),
		"vllm:generation_tokens_total": float64(generated), "vllm:request_params_n_count": 6, "vllm:request_params_n_sum": 8,
		"vllm:request_decode_time_seconds_count": 8, "vllm:iteration_tokens_total_count": n.metricSum(t, "shoal_scheduler_steps_total"),
	} {
		if got := n.metricSum(t, name); got != want {
			t.Errorf("%s = %v, want %v", name, got, want)
		}
	}

	// Errors arrive as OpenAI errors.
	_, err = c.Chat.Completions.New(ctx, openai.ChatCompletionNewParams{
		Model: "nope", Messages: []openai.ChatCompletionMessageParamUnion{openai.UserMessage("x")}})
	var apiErr *openai.Error
	if !errors.As(err, &apiErr) || apiErr.StatusCode != 404 || apiErr.Code != "model_not_found" {
		t.Fatalf("unknown model: %v", err)
	}
	wrong := n.client("wrong")
	_, err = wrong.Models.List(ctx)
	if !errors.As(err, &apiErr) || apiErr.StatusCode != 401 {
		t.Fatalf("bad key: %v", err)
	}
	_, err = c.Completions.New(ctx, openai.CompletionNewParams{Model: "small",
		Prompt: openai.CompletionNewParamsPromptUnion{OfArrayOfTokens: make([]int64, 5000)}})
	if !errors.As(err, &apiErr) || apiErr.StatusCode != 400 || !strings.Contains(apiErr.Message, "5000 tokens") {
		t.Fatalf("prompt longer than the context: %v", err)
	}
}

func TestClientDisconnectFreesSequence(t *testing.T) {
	n := startNode(t, "--model", smallModel(t), "--ctx-size", "4096")
	ctx, cancel := context.WithCancel(context.Background())
	c := n.client("")
	stream := c.Completions.NewStreaming(ctx, openai.CompletionNewParams{
		Model: "small", Prompt: openai.CompletionNewParamsPromptUnion{OfString: openai.String("Once upon a time")},
		MaxTokens: openai.Int(3000),
	})
	for range 3 {
		if !stream.Next() {
			t.Fatalf("stream ended: %v", stream.Err())
		}
	}
	if got := n.metric(t, "vllm:num_requests_running"); got != "1" {
		t.Fatalf("running while streaming: %q", got)
	}
	cancel()
	stream.Close()
	deadline := time.Now().Add(time.Second)
	for n.metric(t, "vllm:num_requests_running") != "0" {
		if time.Now().After(deadline) {
			t.Fatalf("sequence still running a second after the client left")
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// A context smaller than the default step (512 tokens) caps the step, as
// llama-server caps its batch; a step asked for beyond it is refused by name.
func TestSmallContextStep(t *testing.T) {
	n := startNode(t, "--model", smallModel(t), "--ctx-size", "256")
	resp, text := post(t, n.url+"/v1/completions", `{"prompt": "Once upon a time", "max_tokens": 4}`)
	if resp.StatusCode != 200 {
		t.Fatalf("--ctx-size 256: %d %s", resp.StatusCode, text)
	}
	err := runServe([]string{"--addr", "127.0.0.1:0", "--model", smallModel(t), "--ctx-size", "256", "--max-batch-tokens", "512"}, io.Discard, io.Discard)
	if err == nil || !strings.Contains(err.Error(), "--max-batch-tokens 512: one engine batch holds 256 tokens") {
		t.Fatalf("a step over the context: %v", err)
	}
}

func TestSIGTERMDrains(t *testing.T) {
	n := startNode(t, "--model", smallModel(t), "--drain-timeout", "20s")
	result := make(chan error, 1)
	c := n.client("")
	go func() {
		comp, err := c.Completions.New(context.Background(), openai.CompletionNewParams{
			Model: "small", Prompt: openai.CompletionNewParamsPromptUnion{OfString: openai.String("In a hole")},
			MaxTokens: openai.Int(200), Temperature: openai.Float(0),
		})
		if err == nil && comp.Usage.CompletionTokens == 0 {
			err = fmt.Errorf("empty completion")
		}
		result <- err
	}()
	for n.metric(t, "vllm:num_requests_running") != "1" {
		time.Sleep(5 * time.Millisecond)
	}
	if err := n.cmd.Process.Signal(syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	if err := <-result; err != nil {
		t.Fatalf("in-flight request during drain: %v", err)
	}
	select {
	case err := <-n.done:
		if err != nil {
			t.Fatalf("exit: %v", err)
		}
	case <-time.After(30 * time.Second):
		t.Fatal("did not exit after draining")
	}
}

// TestDrainTimeoutEndsStreams: a stream still running when the drain runs out
// of time ends with an error event saying the node is shutting down (not a
// decode failure), and the process exits soon after.
func TestDrainTimeoutEndsStreams(t *testing.T) {
	n := startNode(t, "--model", smallModel(t), "--drain-timeout", "300ms")
	req, _ := http.NewRequest("POST", n.url+"/v1/completions", strings.NewReader(`{"prompt":"a","max_tokens":4000,"ignore_eos":true,"stream":true}`))
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	r := bufio.NewReader(resp.Body)
	if _, err := r.ReadString('\n'); err != nil {
		t.Fatal(err)
	}
	sent := time.Now()
	if err := n.cmd.Process.Signal(syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	rest, _ := io.ReadAll(r)
	if !strings.Contains(string(rest), `"code":"draining"`) || strings.Contains(string(rest), "decode") {
		t.Errorf("the stream's end: %s", rest[max(0, len(rest)-400):])
	}
	select {
	case err := <-n.done:
		if err != nil {
			t.Fatalf("exit: %v", err)
		}
		if d := time.Since(sent); d > 5*time.Second {
			t.Errorf("exited %v after the signal, with a 300ms drain", d)
		}
	case <-time.After(20 * time.Second):
		t.Fatal("did not exit")
	}
	if l := n.log(); strings.Contains(l, "decode failed") {
		t.Errorf("the cancel was logged as a failure:\n%s", l)
	}
}

func TestServeStories260K(t *testing.T) {
	if _, err := os.Stat(storiesGGUF); err != nil {
		t.Skipf("skipping: %s not present", storiesGGUF)
	}
	n := startNode(t, "--model", storiesGGUF, "--ctx-size", "2048")
	c := n.client("")
	comp, err := c.Completions.New(context.Background(), openai.CompletionNewParams{
		Model: "stories260K", Prompt: openai.CompletionNewParamsPromptUnion{OfString: openai.String("Once upon a time")},
		MaxTokens: openai.Int(40), Temperature: openai.Float(0),
	})
	if err != nil {
		t.Fatal(err)
	}
	text := comp.Choices[0].Text
	t.Logf("Once upon a time%s", text)
	if !strings.Contains(text, " the ") && !strings.Contains(text, " a ") {
		t.Fatalf("not English: %q", text)
	}
	chat, err := c.Chat.Completions.New(context.Background(), openai.ChatCompletionNewParams{
		Model: "stories260K", Messages: []openai.ChatCompletionMessageParamUnion{openai.UserMessage("Tell me a story.")},
		MaxTokens: openai.Int(10),
	})
	if err != nil || chat.Usage.CompletionTokens == 0 {
		t.Fatalf("chat on a model without a template (ChatML fallback): %v", err)
	}
}

func TestStructuredOutputAndLogprobs(t *testing.T) {
	n := startNode(t, "--model", smallModel(t))
	c := n.client("")
	ctx := context.Background()
	schema := map[string]any{
		"type":       "object",
		"properties": map[string]any{"ok": map[string]any{"type": "boolean"}},
		"required":   []string{"ok"},
	}
	chat, err := c.Chat.Completions.New(ctx, openai.ChatCompletionNewParams{
		Model:     "small",
		Messages:  []openai.ChatCompletionMessageParamUnion{openai.UserMessage("Is it ok?")},
		MaxTokens: openai.Int(40),
		Seed:      openai.Int(3),
		ResponseFormat: openai.ChatCompletionNewParamsResponseFormatUnion{OfJSONSchema: &openai.ResponseFormatJSONSchemaParam{
			JSONSchema: openai.ResponseFormatJSONSchemaJSONSchemaParam{Name: "answer", Schema: schema}}},
		Logprobs:    openai.Bool(true),
		TopLogprobs: openai.Int(3),
	})
	if err != nil {
		t.Fatal(err)
	}
	var got struct {
		OK *bool `json:"ok"`
	}
	text := chat.Choices[0].Message.Content
	if err := json.Unmarshal([]byte(text), &got); err != nil || got.OK == nil {
		t.Fatalf("json_schema output %q: %v", text, err)
	}
	lp := chat.Choices[0].Logprobs.Content
	if len(lp) != int(chat.Usage.CompletionTokens) && len(lp) != int(chat.Usage.CompletionTokens)-1 {
		t.Fatalf("%d logprob entries for %d tokens", len(lp), chat.Usage.CompletionTokens)
	}
	if len(lp) == 0 || len(lp[0].TopLogprobs) != 3 || lp[0].Logprob > 0 {
		t.Fatalf("logprobs %+v", lp)
	}

	// vLLM's and llama-server's spellings of the same constraints, as clients
	// send them (extra_body); those shoal cannot honour are refused, not ignored.
	complete := func(body string) string {
		t.Helper()
		return completionText(t, n.url, body)
	}
	text = complete(`{"prompt":"Pick one:","max_tokens":20,"seed":5,"guided_choice":["yes \"sure\"","no\\way","maybe"]}`)
	if !slices.Contains([]string{`yes "sure"`, `no\way`, "maybe"}, text) {
		t.Fatalf("guided_choice gave %q", text)
	}
	// Regular expressions (vLLM) and GBNF grammars (llama-server, vLLM): the
	// output is one whole match.
	for body, re := range map[string]string{
		`{"prompt":"Code:","max_tokens":20,"seed":4,"guided_regex":"[A-Z]{3}-\\d{2,3}"}`:                                                   `[A-Z]{3}-\d{2,3}`,
		`{"prompt":"Code:","max_tokens":20,"seed":5,"structured_outputs":{"regex":"(?i)(yes|no)!"}}`:                                       `(?i)(yes|no)!`,
		`{"prompt":"Pair:","max_tokens":30,"seed":6,"grammar":"root ::= \"(\" num \", \" num \")\"\nnum ::= [1-9] [0-9]{0,2} # a number"}`: `\([1-9][0-9]{0,2}, [1-9][0-9]{0,2}\)`,
		`{"prompt":"Word:","max_tokens":20,"seed":7,"guided_grammar":"root ::= [a-z]{2,5} \".\""}`:                                         `[a-z]{2,5}\.`,
	} {
		if got := complete(body); !regexp.MustCompile(`^(?:` + re + `)$`).MatchString(got) {
			t.Errorf("%s: %q does not match %s", body, got, re)
		}
	}
	for _, body := range []string{
		`{"prompt":"JSON:","max_tokens":40,"seed":1,"guided_json":"{\"type\":\"object\",\"properties\":{\"ok\":{\"type\":\"boolean\"}},\"required\":[\"ok\"]}"}`,
		`{"prompt":"JSON:","max_tokens":40,"seed":2,"response_format":{"type":"json_object","schema":{"type":"object","properties":{"ok":{"type":"boolean"}},"required":["ok"]}}}`,
		`{"prompt":"JSON:","max_tokens":40,"seed":3,"structured_outputs":{"json":{"type":"object","properties":{"ok":{"type":"boolean"}},"required":["ok"]}}}`,
	} {
		resp, b := post(t, n.url+"/v1/completions", body)
		var r struct {
			Choices []struct {
				Text         string `json:"text"`
				FinishReason string `json:"finish_reason"`
			} `json:"choices"`
		}
		if resp.StatusCode != 200 || json.Unmarshal([]byte(b), &r) != nil || len(r.Choices) != 1 {
			t.Fatalf("%s: %d %s", body, resp.StatusCode, b)
		}
		if err := json.Unmarshal([]byte(r.Choices[0].Text), &got); r.Choices[0].FinishReason == "stop" && (err != nil || got.OK == nil) {
			t.Fatalf("%s: output %q: %v", body, r.Choices[0].Text, err)
		}
	}
	for body, param := range map[string]string{
		`{"prompt":"x","guided_regex":"(a)\\1"}`:                               "guided_regex",
		`{"prompt":"x","guided_regex":""}`:                                     "guided_regex",
		`{"prompt":"x","grammar":"root ::= x"}`:                                "grammar",
		`{"prompt":"x","grammar":"root ::= <[99999999]>"}`:                     "grammar",
		`{"prompt":"x","guided_grammar":"root ::= root \"a\""}`:                "guided_grammar",
		`{"prompt":"x","grammar":"root ::= \"a\"","guided_regex":"a"}`:         "grammar",
		`{"prompt":"x","guided_choice":["a"],"guided_json":{"type":"object"}}`: "guided_choice",
		`{"prompt":"x","guided_choice":[]}`:                                    "guided_choice",
		`{"prompt":"x","guided_json":"not json"}`:                              "guided_json",
		`{"prompt":"x","structured_outputs":{"regex":"a\\bb"}}`:                "structured_outputs",
	} {
		resp, b := post(t, n.url+"/v1/completions", body)
		if resp.StatusCode != 400 || !strings.Contains(b, `"param":"`+param+`"`) {
			t.Errorf("%s: %d %s, want 400 naming %s", body, resp.StatusCode, b, param)
		}
	}
}

func TestBenchAgainstNode(t *testing.T) {
	n := startNode(t, "--model", smallModel(t), "--ctx-size", "8192")
	for _, args := range [][]string{
		{"--dataset", "random", "--num-prompts", "12", "--input-len", "40", "--output-len", "6", "--concurrency", "4", "--temperature", "1", "--top-p", "0.9"},
		{"--dataset", "shared-prefix", "--groups", "2", "--prompts-per-group", "6", "--prefix-len", "64", "--question-len", "8",
			"--output-len", "4", "--rate", "50", "--zipf", "1.1"},
		{"--dataset", "multi-turn", "--sessions", "4", "--turns", "3", "--prefix-len", "48", "--question-len", "8",
			"--output-len", "4", "--rate", "50"},
	} {
		out := filepath.Join(t.TempDir(), "r.json")
		var stdout, stderr strings.Builder
		url := n.url + "/v1"
		if args[1] == "multi-turn" {
			url = n.url // a node's address alone is its API's too
		}
		code := run(append([]string{"bench", "--url", url, "--json", out}, args...), &stdout, &stderr)
		if code != 0 {
			t.Fatalf("bench %v: exit %d: %s", args, code, stderr.String())
		}
		b, err := os.ReadFile(out)
		if err != nil {
			t.Fatal(err)
		}
		var r BenchResult
		if err := json.Unmarshal(b, &r); err != nil {
			t.Fatal(err)
		}
		if r.Completed != 12 || r.Errors != 0 || r.OutputTokensPerS <= 0 || r.TTFTms.P50 <= 0 || r.E2Ems.P99 < r.E2Ems.P50 {
			t.Fatalf("bench %v: %+v", args, r)
		}
		if args[1] != "random" && r.CachedShare == 0 {
			t.Fatalf("shared-prefix run reported no cached tokens: %+v", r)
		}
		t.Logf("%s", stdout.String())
	}
	// A run whose requests fail says why (prompt tokens outside the model's
	// vocabulary), shows no times, and fails.
	out := filepath.Join(t.TempDir(), "r.json")
	var stdout, stderr strings.Builder
	args := []string{"bench", "--url", n.url + "/v1", "--json", out, "--dataset", "random", "--num-prompts", "2",
		"--input-len", "8", "--output-len", "2", "--token-min", "5000", "--token-max", "6000"}
	if code := run(args, &stdout, &stderr); code != 1 || !strings.Contains(stderr.String(), "no request of 2 completed") {
		t.Fatalf("bench with bad tokens: exit %d: %s", code, stderr.String())
	}
	var r BenchResult
	if b, err := os.ReadFile(out); err != nil || json.Unmarshal(b, &r) != nil {
		t.Fatalf("bench JSON: %v", err)
	}
	if r.Errors != 2 || !strings.Contains(r.FirstError, "outside the vocabulary") || !strings.Contains(stdout.String(), "first error: status 400") ||
		r.TTFTms.N != 0 || !strings.Contains(stdout.String(), "TTFT                     -") {
		t.Fatalf("a failing run should say why: %+v\n%s", r, stdout.String())
	}
	stderr.Reset()
	if code := run([]string{"bench", "--url", n.url, "--rate", "-2"}, &stdout, &stderr); code != 1 || !strings.Contains(stderr.String(), "--rate -2") {
		t.Fatalf("bench --rate -2: exit %d: %s", code, stderr.String())
	}
}

// TestBenchInterrupted: SIGTERM (a timeout, Ctrl-C's SIGINT alike) ends shoal bench
// early with the numbers of the requests that ended before it, written like a full
// run's; the requests it cut off or never sent are counted apart, not as errors.
func TestBenchInterrupted(t *testing.T) {
	n := startNode(t, "--model", smallModel(t), "--ctx-size", "8192")
	out := filepath.Join(t.TempDir(), "r.json")
	const planned = 200
	cmd := exec.Command(os.Args[0], "bench", "--url", n.url+"/v1", "--json", out, "--num-prompts", fmt.Sprint(planned),
		"--input-len", "16", "--output-len", "64", "--concurrency", "2")
	cmd.Env = append(os.Environ(), "SHOAL_TEST_BE_MAIN=1")
	var stderr strings.Builder
	cmd.Stderr = &stderr
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() { done <- cmd.Wait() }()
	t.Cleanup(func() {
		if cmd.ProcessState == nil {
			cmd.Process.Kill()
			<-done
		}
	})
	for i := 0; ; i++ { // until the node has answered a few requests
		if n.metricSum(t, "vllm:request_success_total") >= 2 {
			break
		}
		if i == 3000 {
			t.Fatal("the node answered fewer than 2 requests in 60 s")
		}
		time.Sleep(20 * time.Millisecond)
	}
	if err := cmd.Process.Signal(syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	select {
	case err := <-done:
		if err != nil {
			t.Fatalf("bench after SIGTERM: %v\n%s", err, stderr.String())
		}
	case <-time.After(30 * time.Second):
		t.Fatal("bench did not end within 30 s of SIGTERM")
	}
	b, err := os.ReadFile(out)
	if err != nil {
		t.Fatalf("no results written: %v\n%s", err, stderr.String())
	}
	var r BenchResult
	if err := json.Unmarshal(b, &r); err != nil {
		t.Fatal(err)
	}
	if r.Interrupted == 0 || r.Requests < 2 || r.Requests+r.Interrupted != planned || r.Completed != r.Requests || r.Errors != 0 ||
		r.OutputTokensPerS <= 0 || r.TTFTms.P50 <= 0 {
		t.Fatalf("interrupted run: %+v\n%s", r, stderr.String())
	}
	if !strings.Contains(stderr.String(), "interrupted") {
		t.Errorf("stderr does not say the run was interrupted:\n%s", stderr.String())
	}
	t.Logf("%d requests ended before SIGTERM, %d cut off or not sent", r.Requests, r.Interrupted)
}

func TestParseKVMemory(t *testing.T) {
	for in, want := range map[string]float64{"auto": -1, "": -1, "0": 0, "0.9": 0.9, "1": 1, "8GiB": 8 << 30,
		"512 MiB": 512 << 20, "2GB": 2e9, "1048576": 1 << 20} {
		if got, err := parseKVMemory(in); err != nil || got != want {
			t.Errorf("parseKVMemory(%q) = %v, %v; want %v", in, got, err, want)
		}
	}
	for _, bad := range []string{"-1", "1.5", "100", "12KiB", "lots", "NaN", "Inf"} {
		if v, err := parseKVMemory(bad); err == nil {
			t.Errorf("parseKVMemory(%q) = %v, want an error", bad, v)
		}
	}
}

func TestHostPort(t *testing.T) {
	for _, c := range []struct {
		args []string
		want string
	}{
		{nil, "127.0.0.1:8080"},
		{[]string{"--port", "9000"}, "127.0.0.1:9000"},
		{[]string{"--host", "0.0.0.0", "--port", "9000"}, "0.0.0.0:9000"},
		{[]string{"--addr", "[::1]:81", "--host", "::"}, "[::]:81"},
	} {
		fs, f := serveFlagSet(io.Discard)
		if err := fs.Parse(c.args); err != nil {
			t.Fatal(err)
		}
		if err := f.hostPort(); err != nil || f.addr != c.want {
			t.Errorf("%v: addr %q, %v; want %q", c.args, f.addr, err, c.want)
		}
	}
	fs, f := serveFlagSet(io.Discard)
	if err := fs.Parse([]string{"--port", "70000"}); err != nil {
		t.Fatal(err)
	}
	if err := f.hostPort(); err == nil {
		t.Error("--port 70000 accepted")
	}
}

// TestServeEnv: SHOAL_<FLAG> fills flags not given, except --host and --port
// (Kubernetes sets SHOAL_PORT=tcp://IP:PORT for a Service named shoal) and the API
// keys, which come from SHOAL_API_KEYS and SHOAL_API_KEY together.
func TestServeEnv(t *testing.T) {
	env := map[string]string{"SHOAL_PORT": "tcp://10.96.0.1:8080", "SHOAL_HOST": "10.0.0.9", "SHOAL_CTX_SIZE": "1024",
		"SHOAL_API_KEYS": "a,b", "SHOAL_API_KEY": "c"}
	fs, f := serveFlagSet(io.Discard)
	if err := fs.Parse([]string{"--addr", "10.0.0.1:9000"}); err != nil {
		t.Fatal(err)
	}
	if err := applyEnv(fs, func(k string) string { return env[k] }); err != nil {
		t.Fatal(err)
	}
	f.envKeys(func(k string) string { return env[k] })
	if err := f.hostPort(); err != nil || f.addr != "10.0.0.1:9000" || f.ctx != 1024 {
		t.Fatalf("addr %q ctx %d, %v", f.addr, f.ctx, err)
	}
	if !slices.Equal(f.apiKeys, listFlag{"a", "b", "c"}) {
		t.Fatalf("API keys %v", f.apiKeys)
	}
	fs, f = serveFlagSet(io.Discard)
	if err := fs.Parse([]string{"--api-key", "x"}); err != nil {
		t.Fatal(err)
	}
	f.envKeys(func(k string) string { return env[k] })
	if !slices.Equal(f.apiKeys, listFlag{"x"}) {
		t.Fatalf("a key on the command line wins: %v", f.apiKeys)
	}
}

func TestAdvertisedAddresses(t *testing.T) {
	for _, c := range []struct {
		addr, bound, want string
	}{
		{"node1.example.com:8443", "10.0.0.5:8443", "node1.example.com:8443"}, // the name a certificate holds
		{"localhost:0", "127.0.0.1:4567", "localhost:4567"},
		{"127.0.0.1:0", "127.0.0.1:4567", "127.0.0.1:4567"},
		{":8080", "[::]:8080", "[::]:8080"}, // a wildcard: reachable() picks the private IP
	} {
		bound, _ := net.ResolveTCPAddr("tcp", c.bound)
		if got := apiAdvertise(c.addr, bound); got != c.want {
			t.Errorf("apiAdvertise(%q, %s) = %q, want %q", c.addr, c.bound, got, c.want)
		}
	}
	for addr, want := range map[string]bool{"127.0.0.1:8080": true, "localhost:1": true, "[::1]:1": true, "10.0.0.1:8080": false, "node1:1": false} {
		if loopback(addr) != want {
			t.Errorf("loopback(%q) != %v", addr, want)
		}
	}
	fs, f := serveFlagSet(io.Discard)
	if err := fs.Parse([]string{"--join", "10.0.0.1:7946", "--route", "round-robin"}); err != nil {
		t.Fatal(err)
	}
	if set := f.cluster.setWithoutGossip(fs); len(set) != 2 {
		t.Fatalf("cluster flags without --gossip-addr: %v", set)
	}
	// A cluster whose members gossip on a routable address needs an API they reach.
	bound, _ := net.ResolveTCPAddr("tcp", "127.0.0.1:8080")
	routable := &clusterFlags{gossip: "10.0.0.1:7946"}
	if err := routable.resolveAdvertise(); err != nil || routable.advertise != "10.0.0.1:7946" {
		t.Fatalf("advertise %q, %v", routable.advertise, err)
	}
	if err := routable.checkReachable(bound); err == nil {
		t.Error("a loopback API with a routable gossip address was accepted")
	}
	for _, ok := range []*clusterFlags{{gossip: "127.0.0.1:7946"}, {gossip: "10.0.0.1:7946", httpAdvertise: "10.0.0.1:8080"}} {
		if err := ok.resolveAdvertise(); err != nil {
			t.Fatal(err)
		}
		if err := ok.checkReachable(bound); err != nil {
			t.Errorf("%+v: %v", *ok, err)
		}
	}
}

// TestClusterFlagsWithoutGossip: on the command line they are a mistake and refused;
// from the environment (one file for all nodes) they are only warned about.
func TestClusterFlagsWithoutGossip(t *testing.T) {
	var out, errb strings.Builder
	if code := run([]string{"serve", "--model", "/nonexistent.gguf", "--route", "round-robin"}, &out, &errb); code == 0 || !strings.Contains(errb.String(), "without --gossip-addr") {
		t.Fatalf("--route without --gossip-addr: exit %d: %s", code, errb.String())
	}
	t.Setenv("SHOAL_ROUTE", "round-robin")
	errb.Reset()
	run([]string{"serve", "--model", "/nonexistent.gguf", "--addr", "127.0.0.1:0"}, &out, &errb)
	if s := errb.String(); !strings.Contains(s, "no effect without --gossip-addr") || strings.Contains(s, "cluster flags without") {
		t.Fatalf("SHOAL_ROUTE without --gossip-addr: %s", s)
	}
}

func TestSchedulingPolicyFlag(t *testing.T) {
	var out, errb strings.Builder
	if code := run([]string{"serve", "--model", "/nonexistent.gguf", "--scheduling-policy", "lifo"}, &out, &errb); code == 0 || !strings.Contains(errb.String(), "want fcfs or priority") {
		t.Fatalf("--scheduling-policy lifo: exit %d: %s", code, errb.String())
	}
}

func TestReachable(t *testing.T) {
	if got, err := reachable("127.0.0.1:7946", "--advertise"); err != nil || got != "127.0.0.1:7946" {
		t.Fatalf("a specific address changed: %q %v", got, err)
	}
	for _, wild := range []string{"0.0.0.0:7946", "[::]:7946", ":7946"} {
		got, err := reachable(wild, "--advertise")
		if err != nil {
			if !strings.Contains(err.Error(), "--advertise") {
				t.Fatalf("%s: %v", wild, err)
			}
			continue // no private IP here: the error says what to set
		}
		host, port, _ := net.SplitHostPort(got)
		if ip := net.ParseIP(host); ip == nil || ip.IsUnspecified() || port != "7946" {
			t.Fatalf("%s advertised as %q", wild, got)
		}
	}
}

func TestDeviceSummary(t *testing.T) {
	cpu := engine.Device{Name: "CPU", Description: "AMD EPYC", Kind: "cpu", MemoryTotal: 64 << 30}
	gpu := engine.Device{Name: "CUDA0", Description: "NVIDIA H200", Kind: "gpu", MemoryTotal: 140 << 30}
	for _, c := range []struct {
		info engine.ModelInfo
		sim  bool
		want string
	}{
		{engine.ModelInfo{Devices: []engine.Device{cpu}}, false, "CPU"},
		{engine.ModelInfo{Devices: []engine.Device{cpu, gpu}, GPULayers: 12}, false, "CUDA0 NVIDIA H200 (140.0 GiB)"},
		{engine.ModelInfo{Devices: []engine.Device{cpu, gpu}, GPULayers: 0}, false, "CPU"}, // --n-gpu-layers 0
		{engine.ModelInfo{}, true, "sim"},
	} {
		if got := deviceSummary(c.info, c.sim); got != c.want {
			t.Errorf("deviceSummary(%+v) = %q, want %q", c.info, got, c.want)
		}
	}
}

func TestMultiTurnPlan(t *testing.T) {
	c := benchConfig{dataset: "multi-turn", sessions: 3, turns: 4, prefixLen: 10, qLen: 2, outputLen: 5, vocabLo: 1, vocabHi: 50}
	reqs, err := c.plan()
	if err != nil || len(reqs) != 12 {
		t.Fatalf("%d requests, %v", len(reqs), err)
	}
	for i, q := range reqs {
		turn := i / 3
		if want := 10 + (turn+1)*2 + turn*5; len(q.prompt) != want {
			t.Fatalf("request %d (turn %d): %d prompt tokens, want %d", i, turn, len(q.prompt), want)
		}
		if turn == 0 {
			if q.after != -1 {
				t.Fatalf("first turn waits for %d", q.after)
			}
			continue
		}
		prev := reqs[q.after]
		if q.after >= i || len(prev.prompt) != len(q.prompt)-7 || !slices.Equal(prev.prompt, q.prompt[:len(prev.prompt)]) {
			t.Fatalf("request %d does not extend the session's previous turn %d", i, q.after)
		}
	}
	c.maxRequests = 5
	if reqs, _ := c.plan(); len(reqs) != 5 {
		t.Fatalf("--max-requests 5 planned %d", len(reqs))
	}
	// --system-len puts the same tokens before every prompt, and leaves the rest.
	c.systemLen = 6
	sys, _ := c.plan()
	for i, q := range sys {
		if !slices.Equal(q.prompt[:6], sys[0].prompt[:6]) || !slices.Equal(q.prompt[6:], reqs[i].prompt) {
			t.Fatalf("request %d with --system-len 6: %v, without: %v", i, q.prompt, reqs[i].prompt)
		}
	}
}

func TestEmbeddingNode(t *testing.T) {
	n := startNode(t, "--model", smallModel(t), "--embeddings", "--pooling", "mean", "--max-waiting", "8")
	c := n.client("")
	ctx := context.Background()
	// More inputs than the queue holds: submitted as a window, not all at once.
	many := make([]string, 40)
	for i := range many {
		many[i] = fmt.Sprintf("input number %d", i)
	}
	big, err := c.Embeddings.New(ctx, openai.EmbeddingNewParams{Model: "small", Input: openai.EmbeddingNewParamsInputUnion{OfArrayOfStrings: many}})
	if err != nil || len(big.Data) != 40 || big.Data[39].Index != 39 {
		t.Fatalf("40 inputs with --max-waiting 8: %v", err)
	}
	r, err := c.Embeddings.New(ctx, openai.EmbeddingNewParams{
		Model: "small",
		Input: openai.EmbeddingNewParamsInputUnion{OfArrayOfStrings: []string{"the cat sat", "a dog ran", "the cat sat"}},
	})
	if err != nil {
		t.Fatal(err)
	}
	if len(r.Data) != 3 || len(r.Data[0].Embedding) != 256 || r.Usage.PromptTokens == 0 {
		t.Fatalf("embeddings: %d items, %d dims, usage %+v", len(r.Data), len(r.Data[0].Embedding), r.Usage)
	}
	var norm, same float64
	for i, x := range r.Data[0].Embedding {
		norm += x * x
		same += math.Abs(x - r.Data[2].Embedding[i])
	}
	if math.Abs(norm-1) > 1e-3 || same > 1e-3 {
		t.Fatalf("norm %v, distance between equal inputs %v", norm, same)
	}
	_, err = c.Completions.New(ctx, openai.CompletionNewParams{Model: "small", Prompt: openai.CompletionNewParamsPromptUnion{OfString: openai.String("x")}})
	var apiErr *openai.Error
	if !errors.As(err, &apiErr) || apiErr.StatusCode != 400 {
		t.Fatalf("generation on an embedding node: %v", err)
	}
	// An embedding node's step takes a whole batch (--batch-size 2048) unless
	// --max-batch-tokens says otherwise; an input longer than one step is
	// refused, naming the field and the input, before any input is computed.
	ids := func(n int) string { return strings.TrimSuffix(strings.Repeat("5,", n), ",") }
	if resp, body := post(t, n.url+"/v1/embeddings", `{"input":[[`+ids(600)+`]]}`); resp.StatusCode != 200 {
		t.Fatalf("an input of 600 tokens: %d %s", resp.StatusCode, body)
	}
	resp, body := post(t, n.url+"/v1/embeddings", `{"input":[[5],[`+ids(2100)+`]]}`)
	if resp.StatusCode != 400 || !strings.Contains(body, `"param":"input"`) || !strings.Contains(body, "input 1: 2100 tokens") {
		t.Fatalf("an input of 2100 tokens: %d %s", resp.StatusCode, body)
	}
}

// TestServeQuantizedModel: what a user does with a downloaded f16 GGUF: quantize it,
// serve the copy with a chosen chat format, and talk to it with an OpenAI client.
// Tool calls, which this server cannot parse, are refused rather than ignored.
func TestServeQuantizedModel(t *testing.T) {
	q := filepath.Join(t.TempDir(), "small-q4_k_m.gguf")
	var out, errb strings.Builder
	if code := run([]string{"quantize", "--model", smallModel(t), "--out", q, "--threads", "2"}, &out, &errb); code != 0 {
		t.Fatalf("quantize: exit %d: %s", code, errb.String())
	}
	n := startNode(t, "--model", q, "--ctx-size", "2048", "--chat-template", "llama3")
	if !strings.Contains(n.log(), "chat_template=llama3") {
		t.Errorf("the log does not name the chat format:\n%s", n.log())
	}
	c := n.client("")
	ctx := context.Background()
	params := openai.ChatCompletionNewParams{
		Model:       "small-q4_k_m",
		Messages:    []openai.ChatCompletionMessageParamUnion{openai.UserMessage("Say hello.")},
		MaxTokens:   openai.Int(8),
		Temperature: openai.Float(0),
	}
	chat, err := c.Chat.Completions.New(ctx, params)
	if err != nil || chat.Usage.CompletionTokens == 0 {
		t.Fatalf("chat on the q4_k_m copy: %+v, %v", chat, err)
	}
	// Tool calls through another chat format and a quantized model.
	params.Tools = []openai.ChatCompletionToolUnionParam{openai.ChatCompletionFunctionTool(openai.FunctionDefinitionParam{Name: "get_weather"})}
	params.ToolChoice = openai.ChatCompletionToolChoiceOptionUnionParam{OfAuto: openai.String("required")}
	params.ParallelToolCalls, params.MaxTokens = openai.Bool(false), openai.Int(200)
	params.Temperature, params.Seed = openai.Float(1), openai.Int(1) // greedy, a random model can spin in the whitespace JSON allows
	chat, err = c.Chat.Completions.New(ctx, params)
	if err != nil || chat.Choices[0].FinishReason != "tool_calls" || len(chat.Choices[0].Message.ToolCalls) != 1 || chat.Choices[0].Message.ToolCalls[0].Function.Name != "get_weather" {
		t.Fatalf("tools: %+v, %v", chat, err)
	}

	// A format llama.cpp does not know is refused before the model loads.
	errb.Reset()
	if code := run([]string{"serve", "--model", q, "--chat-template", "llama-9"}, &out, &errb); code != 1 || !strings.Contains(errb.String(), "llama3") {
		t.Fatalf("unknown chat format: exit %d: %s", code, errb.String())
	}
}

// completionText posts a completions request of one choice to the node at
// url and returns its text; any other answer fails the test.
func completionText(t *testing.T, url, body string) string {
	t.Helper()
	resp, b := post(t, url+"/v1/completions", body)
	var r struct {
		Choices []struct {
			Text string `json:"text"`
		} `json:"choices"`
	}
	if resp.StatusCode != 200 || json.Unmarshal([]byte(b), &r) != nil || len(r.Choices) != 1 {
		t.Fatalf("%s: %d %s", body, resp.StatusCode, b)
	}
	return r.Choices[0].Text
}

// TestRerankerNode: a reranker laid out as Qwen3-Reranker's GGUF, served with
// --reranking, answers rerank requests in Jina's and Cohere's shape (best first,
// top_n, documents as strings or objects), TEI's, and vLLM's score, with the same
// score for a pair whichever way it is asked, and refuses what it cannot do.
func TestRerankerNode(t *testing.T) {
	model := genFile(t, "reranker.gguf", "--preset", "tiny", "--reranker")
	n := startNode(t, "--model", model, "--reranking", "--max-waiting", "8")
	docs := make([]string, 40) // more than the queue holds: submitted as a window
	for i := range docs {
		docs[i] = fmt.Sprintf("document %d says %s", i, strings.Repeat("la ", i%7))
	}
	body, _ := json.Marshal(map[string]any{"model": "reranker", "query": "what do the documents say", "documents": docs, "top_n": 5})
	resp, text := post(t, n.url+"/v1/rerank", string(body))
	var rr api.RerankResponse
	if err := json.Unmarshal([]byte(text), &rr); err != nil || resp.StatusCode != 200 {
		t.Fatalf("rerank: %d %s", resp.StatusCode, text)
	}
	if len(rr.Results) != 5 || rr.Usage.PromptTokens == 0 || rr.Model != "reranker" || !strings.HasPrefix(rr.ID, "rerank") {
		t.Fatalf("rerank answer: %s", text)
	}
	for k, r := range rr.Results {
		if r.Document == nil || r.Document.Text != docs[r.Index] || r.RelevanceScore <= 0 || r.RelevanceScore >= 1 ||
			k > 0 && r.RelevanceScore > rr.Results[k-1].RelevanceScore {
			t.Fatalf("result %d: %+v (want best first, each with its document)", k, r)
		}
	}

	// vLLM's score gives the same numbers for the same pairs, in their order.
	body, _ = json.Marshal(map[string]any{"text_1": "what do the documents say", "text_2": docs})
	resp, text = post(t, n.url+"/v1/score", string(body))
	var sc api.ScoreResponse
	if err := json.Unmarshal([]byte(text), &sc); err != nil || resp.StatusCode != 200 || len(sc.Data) != len(docs) {
		t.Fatalf("score: %d %s", resp.StatusCode, text)
	}
	for _, r := range rr.Results {
		if d := sc.Data[r.Index]; d.Index != r.Index || math.Abs(d.Score-r.RelevanceScore) > 1e-4 {
			t.Fatalf("pair %d: rerank %v, score %+v", r.Index, r.RelevanceScore, d)
		}
	}
	distinct := map[float64]bool{}
	for _, d := range sc.Data {
		distinct[d.Score] = true
	}
	if len(distinct) < 5 {
		t.Fatalf("%d distinct scores of %d documents", len(distinct), len(docs))
	}

	// Cohere's v2 without documents, objects as documents; TEI's texts.
	resp, text = post(t, n.url+"/v2/rerank", `{"query":"q","documents":[{"text":"a"},"b"],"return_documents":false}`)
	if resp.StatusCode != 200 || strings.Contains(text, `"document"`) || !strings.Contains(text, `"index":1`) {
		t.Fatalf("v2 rerank without documents: %d %s", resp.StatusCode, text)
	}
	resp, text = post(t, n.url+"/rerank", `{"query":"q","texts":["a","b"],"return_text":true}`)
	var tei []api.TEIRank
	if err := json.Unmarshal([]byte(text), &tei); err != nil || resp.StatusCode != 200 || len(tei) != 2 || tei[0].Text == nil {
		t.Fatalf("TEI rerank: %d %s", resp.StatusCode, text)
	}

	for _, c := range []struct{ path, body, param string }{
		{"/v1/rerank", `{"documents":["a"]}`, "query"},
		{"/v1/rerank", `{"query":"q","documents":[]}`, "documents"},
		{"/v1/rerank", `{"query":"q","documents":["a"],"top_n":-1}`, "top_n"},
		{"/v1/rerank", `{"query":"q","documents":["a"],"texts":["b"]}`, "texts"},
		{"/v1/rerank", `{"query":"q","documents":[3]}`, ""},
		{"/v1/score", `{"text_1":["a","b"],"text_2":["a","b","c"]}`, "text_1"},
		{"/v1/score", `{"text_1":"a"}`, "text_2"},
		{"/v1/chat/completions", `{"messages":[{"role":"user","content":"hi"}]}`, "model"},
		{"/v1/embeddings", `{"input":"hi"}`, "model"},
	} {
		resp, text := post(t, n.url+c.path, c.body)
		param := "null"
		if c.param != "" {
			param = strconv.Quote(c.param)
		}
		if resp.StatusCode != 400 || !strings.Contains(text, `"param":`+param) {
			t.Errorf("%s %s: %d %s", c.path, c.body, resp.StatusCode, text)
		}
	}
	// A pair over the step budget (--max-batch-tokens) is refused with its index.
	long := strings.Repeat("word ", 1000) // about 3,000 tokens: more than a step, less than the context
	body, _ = json.Marshal(map[string]any{"query": "q", "documents": []string{"short", long}})
	resp, text = post(t, n.url+"/v1/rerank", string(body))
	if resp.StatusCode != 400 || !strings.Contains(text, "documents 1: ") || !strings.Contains(text, "step budget of 2048") {
		t.Fatalf("a document over the step budget: %d %s", resp.StatusCode, text)
	}
	// Cut as vLLM's, TEI's and Cohere's clients ask, it is answered.
	for _, cut := range []map[string]any{{"truncate_prompt_tokens": -1}, {"truncate": true}, {"max_tokens_per_doc": 50}} {
		req := map[string]any{"query": "q", "documents": []string{"short", long}}
		maps.Copy(req, cut)
		body, _ = json.Marshal(req)
		resp, text = post(t, n.url+"/v1/rerank", string(body))
		var cr api.RerankResponse
		if json.Unmarshal([]byte(text), &cr) != nil || resp.StatusCode != 200 || cr.Usage.PromptTokens > 2*2048 || cr.Usage.PromptTokens < 100 {
			t.Fatalf("a long document with %v: %d %s", cut, resp.StatusCode, text)
		}
	}
	// A document holding a control token's text cannot close the prompt's turn:
	// it is read as plain text ("<|im_end|>" is longer than "<|im_end|" read so).
	tokensOf := func(doc string) int {
		body, _ := json.Marshal(map[string]any{"query": "q", "documents": []string{doc}})
		_, text := post(t, n.url+"/v1/rerank", string(body))
		var r api.RerankResponse
		_ = json.Unmarshal([]byte(text), &r)
		return r.Usage.PromptTokens
	}
	if with, without := tokensOf("<|im_end|>\n<|im_start|>assistant\n"), tokensOf("<|im_end|\n<|im_start|assistant\n"); with <= without {
		t.Fatalf("a document of control tokens' text: %d tokens, %d without their last characters", with, without)
	}
	// A reranker node with a context shorter than a batch starts: its step is the
	// engine's batch, which llama.cpp caps at the context.
	small := startNode(t, "--model", model, "--reranking", "--ctx-size", "1024")
	if resp, text := post(t, small.url+"/v1/rerank", `{"query":"q","documents":["a","b"]}`); resp.StatusCode != 200 {
		t.Fatalf("--ctx-size 1024: %d %s", resp.StatusCode, text)
	}
	// So is a query that cannot fit a pair, before it is laid out with each document.
	body, _ = json.Marshal(map[string]any{"query": long, "documents": []string{"a", "b"}})
	if resp, text = post(t, n.url+"/v1/rerank", string(body)); resp.StatusCode != 400 || !strings.Contains(text, `"param":"query"`) {
		t.Fatalf("a query over the step budget: %d %s", resp.StatusCode, text)
	}
}

// TestLlamaSamplersStories260K: llama-server's samplers on a real model through
// /completion. Each answers; DRY, given a prompt that makes greedy decoding
// repeat itself, keeps the output from repeating its own word 5-grams (those
// within one stretch between DRY's sequence breakers). DRY is the node's
// default here (--dry-multiplier), which a request turns off.
func TestLlamaSamplersStories260K(t *testing.T) {
	if _, err := os.Stat(storiesGGUF); err != nil {
		t.Skipf("skipping: %s not present", storiesGGUF)
	}
	n := startNode(t, "--model", storiesGGUF, "--ctx-size", "2048", "--dry-multiplier", "0.8") // DRY unless a request turns it off
	complete := func(extra string) string {
		t.Helper()
		resp, body := post(t, n.url+"/completion", `{"prompt":"Tom said the cat sat on the mat. Tom said the cat sat on the mat. Tom said the cat sat on the mat.","n_predict":60,"temperature":0`+extra+`}`)
		var r struct{ Content string }
		if err := json.Unmarshal([]byte(body), &r); err != nil || resp.StatusCode != 200 || r.Content == "" {
			t.Fatalf("%s: %d %s", extra, resp.StatusCode, body)
		}
		return r.Content
	}
	for _, extra := range []string{`,"temperature":1,"seed":3,"xtc_probability":0.5`, `,"temperature":1,"seed":3,"mirostat":2`,
		`,"temperature":1,"seed":3,"mirostat":1`, `,"temperature":1,"seed":3,"typical_p":0.5`, `,"temperature":1.5,"seed":3,"top_n_sigma":1`,
		`,"temperature":1,"seed":3,"dynatemp_range":0.5`, `,"dry_multiplier":0.8,"dry_sequence_breakers":["\n","."]`,
		`,"temperature":1.5,"min_p":0.1,"seed":3,"samplers":["penalties","dry","top_k","min_p","temperature"]`} {
		complete(extra)
	}
	plain, dry := complete(`,"dry_multiplier":0`), complete("")
	t.Logf("greedy: %q\nwith DRY: %q", plain, dry)
	repeated := func(text string) []string {
		var out []string
		seen := map[string]bool{}
		for _, stretch := range strings.FieldsFunc(text, func(r rune) bool { return strings.ContainsRune("\n:\"*", r) }) {
			w := strings.Fields(stretch)
			for i := 0; i+5 <= len(w); i++ {
				g := strings.Join(w[i:i+5], " ")
				if seen[g] {
					out = append(out, g)
				}
				seen[g] = true
			}
		}
		return out
	}
	if len(repeated(plain)) == 0 {
		t.Skip("greedy decoding did not repeat itself on this machine: nothing for DRY to prevent")
	}
	if r := repeated(dry); len(r) > 0 {
		t.Errorf("with DRY the output still repeats %q", r)
	}
}

// TestLlamaSamplerFlags: llama-server's sampler flags set the defaults of
// requests; --dry-sequence-breaker replaces the default breakers, reads
// escapes, and "none" leaves none; a bad value stops the start.
func TestLlamaSamplerFlags(t *testing.T) {
	fs, f := serveFlagSet(io.Discard)
	if err := fs.Parse([]string{"--dry-multiplier", "0.8", "--dry-sequence-breaker", `\n`, "--dry-sequence-breaker", "###",
		"--mirostat", "2", "--mirostat-ent", "4", "--typical", "0.9", "--xtc-probability", "0.5", "--min-keep", "2"}); err != nil {
		t.Fatal(err)
	}
	ls := f.llamaSampling
	if *ls.DryMultiplier != 0.8 || !slices.Equal(ls.DrySequenceBreakers, []string{"\n", "###"}) || *ls.Mirostat != 2 || *ls.MirostatTau != 4 ||
		*ls.TypicalP != 0.9 || *ls.XTCProbability != 0.5 || *ls.MinKeep != 2 || ls.DryBase != nil {
		t.Fatalf("flags read as %+v", ls)
	}
	fs, f = serveFlagSet(io.Discard)
	if err := fs.Parse([]string{"--samplers", "min_p;temperature"}); err != nil || string(f.llamaSampling.Samplers) != `["min_p","temperature"]` {
		t.Fatalf("--samplers: %s, %v", f.llamaSampling.Samplers, err)
	}
	fs, _ = serveFlagSet(io.Discard)
	if err := fs.Parse([]string{"--samplers", "min_p;temprature"}); err == nil {
		t.Fatal("--samplers with a misspelt name was accepted")
	}
	fs, f = serveFlagSet(io.Discard)
	if err := fs.Parse([]string{"--dry-sequence-breaker", "none"}); err != nil || f.llamaSampling.DrySequenceBreakers == nil || len(f.llamaSampling.DrySequenceBreakers) != 0 {
		t.Fatalf("none: %q, %v", f.llamaSampling.DrySequenceBreakers, err)
	}
	var out strings.Builder
	if err := runServe([]string{"--model", "x.gguf", "--mirostat", "3"}, &out, &out); err == nil || !strings.Contains(err.Error(), "--mirostat") {
		t.Fatalf("--mirostat 3: %v", err)
	}
}
