package main

import (
	"encoding/json"
	"flag"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/shoal-ai/shoal/engine/llama"
)

// TestServeArgs: llama-server's and vLLM's command lines become serve's own
// flags; values that look like flags stay values, and the model may be an
// argument anywhere.
func TestServeArgs(t *testing.T) {
	for _, c := range []struct {
		in      string
		want    string
		model   string
		ignored string
	}{
		{in: "-m m.gguf -c 8192 -ngl 99 -fa on -np 4 --port 8080",
			want: "--model=m.gguf --ctx-size=8192 --n-gpu-layers=99 --flash-attn=on --parallel=4 --port 8080"},
		{in: "m.gguf -ngl all -fa -c 4096 --no-mmap -ctk q8_0 -ctv q8_0 -kvu -n -1 --alias tiny --metrics -cb",
			want:  "--n-gpu-layers=-1 --flash-attn=on --ctx-size=4096 --mmap=false --kv-type-k=q8_0 --kv-type-v=q8_0 --kv-unified=true --default-max-tokens=0 --model-name=tiny",
			model: "m.gguf", ignored: "--metrics -cb"},
		{in: "-fa", want: "--flash-attn=on"},
		{in: "-fa m.gguf -fa auto", want: "--flash-attn=on --flash-attn=auto", model: "m.gguf"},
		{in: "--served-model-name qwen m.gguf", want: "--model-name=qwen", model: "m.gguf"},
		{in: "--served-model-name qwen q2 m.gguf --port 1", want: "--model-name=qwen,q2 --port 1", model: "m.gguf"},
		{in: "-fa=off --cache-type-k=f16", want: "--flash-attn=off --kv-type-k=f16"},
		{in: "--served-model-name qwen --max-num-seqs 32 --max-num-batched-tokens 1024 --block-size 32 --no-enable-prefix-caching --disable-log-requests --enable-auto-tool-choice --tool-call-parser hermes --reasoning-parser=qwen3 m.gguf",
			want:    "--model-name=qwen --max-running=32 --max-batch-tokens=1024 --block-tokens=32 --prefix-caching=false --log-requests=false",
			model:   "m.gguf",
			ignored: "--enable-auto-tool-choice --tool-call-parser --reasoning-parser=qwen3"},
		// Values of serve's own flags are never read as aliases or the model.
		{in: "--model-name -c --main-gpu -1 --api-key -m --mmap=false", want: "--model-name -c --main-gpu -1 --api-key -m --mmap=false"},
		{in: "--ssl-keyfile k.pem --ssl-cert-file c.pem", want: "--tls-key=k.pem --tls-cert=c.pem"},
		{in: "-h", want: "-h"},
	} {
		out, model, ignored, err := serveArgs(mustServeFlags(t), strings.Fields(c.in))
		if err != nil {
			t.Errorf("%s: %v", c.in, err)
			continue
		}
		if got := strings.Join(out, " "); got != c.want || model != c.model || strings.Join(ignored, " ") != c.ignored {
			t.Errorf("%s:\n got %s, model %q, ignored %v\nwant %s, model %q, ignored %s", c.in, got, model, ignored, c.want, c.model, c.ignored)
		}
	}
	for in, want := range map[string]string{
		"m.gguf -ctv q8_0 -fa off":            "need flash attention",
		"m.gguf --kv-type q3":                 "want one of bf16, f16",
		"a.gguf b.gguf":                       "unexpected arguments",
		"--mmap false m.gguf":                 "--mmap=false",
		"--no-mmap=true":                      "takes no value",
		"-n many":                             "want a number",
		"-c":                                  "needs an argument",
		"--tool-call-parser":                  "needs an argument",
		"m.gguf --model n.gguf":               "the model twice",
		"m.gguf --model-name a,,b":            "neither empty nor repeated",
		"--served-model-name a b a m.gguf":    "neither empty nor repeated",
		"m.gguf --gpu-memory-utilization 0.9": "flag provided but not defined: --gpu-memory-utilization",
		"m.gguf --max-num-seqs 300":           "llama.cpp runs at most 256 sequences",
		"m.gguf --parallel 300":               "--parallel 300: llama.cpp runs at most 256 sequences",
		"m.gguf --sim-speed 5":                "--sim-speed needs --sim",
		"--sim p.json --sim-speed 0":          "--sim-speed 0: want more than 0",
		"m.gguf --pooling mean":               "--pooling needs --embeddings",
	} {
		err := runServe(strings.Fields(in), io.Discard, io.Discard)
		if err == nil || !strings.Contains(err.Error(), want) {
			t.Errorf("%s: %v, want an error saying %q", in, err, want)
		}
	}
	// A model file without .gguf (an Ollama blob) after --served-model-name's
	// names is the model, not another name.
	blob := filepath.Join(t.TempDir(), "sha256-0123")
	if err := os.WriteFile(blob, []byte("x"), 0o644); err != nil {
		t.Fatal(err)
	}
	if _, model, _, err := serveArgs(mustServeFlags(t), []string{"--served-model-name", "qwen", blob}); err != nil || model != blob {
		t.Errorf("--served-model-name qwen BLOB: model %q, %v", model, err)
	}
	// vLLM's --chat-template also takes a file, read as --chat-template-file.
	file := filepath.Join(t.TempDir(), "t.jinja")
	if err := os.WriteFile(file, []byte("{{ messages }}"), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := runServe([]string{"m.gguf", "--chat-template", file, "--jinja=false"}, io.Discard, io.Discard); err == nil || !strings.Contains(err.Error(), "--chat-template-file with --jinja=false") {
		t.Errorf("--chat-template FILE: %v", err)
	}
	// A template file is told from llama.cpp's format names by its '.' or '/'.
	for _, name := range llama.ChatTemplateNames() {
		if strings.ContainsAny(name, "./") {
			t.Errorf("llama.cpp's format %q would be read as a file where one of its name exists", name)
		}
	}
	// Every alias spells a flag serve has, and the help lists it.
	var help strings.Builder
	fs, _ := serveFlagSet(&help)
	for name, al := range serveAliases {
		if al.flag != "" && fs.Lookup(al.flag) == nil {
			t.Errorf("alias %s spells --%s, which serve lacks", name, al.flag)
		}
		if fs.Lookup(name) != nil {
			t.Errorf("alias %s is also a flag of serve's own", name)
		}
		if !strings.Contains(aliasHelp(), "-"+name+" ") {
			t.Errorf("the help lacks %s", name)
		}
	}
}

func mustServeFlags(t *testing.T) *flag.FlagSet {
	t.Helper()
	fs, _ := serveFlagSet(io.Discard)
	return fs
}

// TestLlamaServerCommandLine: a node started with llama-server's spelling
// (the model as an argument, -c, -np, -fa, -ngl, --alias) serves as the same
// flags of serve's own would.
func TestLlamaServerCommandLine(t *testing.T) {
	n := startNode(t, smallModel(t), "-c", "2048", "-np", "4", "-fa", "-ngl", "all", "--alias", "tiny", "--metrics", "-ctk", "q8_0")
	// vLLM's --max-num-seqs and --max-num-batched-tokens past the engine's
	// defaults (128 sequences, a batch of 2048) grow the engine to them.
	v := startNode(t, "--served-model-name", "qwen", "q2", smallModel(t), "--max-num-seqs", "200", "--max-num-batched-tokens", "4096", "-c", "8192")
	// Both names are served; answers give the first.
	if r, b := post(t, v.url+"/v1/completions", `{"model":"q2","prompt":"Once","max_tokens":2}`); r.StatusCode != 200 || !strings.Contains(b, `"model":"qwen"`) {
		t.Fatalf("vLLM's command line: %d %s", r.StatusCode, b)
	}
	resp, err := http.Get(n.url + "/v1/models")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	var models struct {
		Data []struct {
			ID          string `json:"id"`
			MaxModelLen int    `json:"max_model_len"`
		} `json:"data"`
	}
	if err := json.NewDecoder(resp.Body).Decode(&models); err != nil || len(models.Data) != 1 || models.Data[0].ID != "tiny" || models.Data[0].MaxModelLen > 2048 {
		t.Fatalf("models: %+v %v", models, err)
	}
	if r, b := post(t, n.url+"/v1/completions", `{"model":"tiny","prompt":"Once","max_tokens":2}`); r.StatusCode != 200 {
		t.Fatalf("%d %s", r.StatusCode, b)
	}
	// -np 4: at most 4 sequences run at once, which llama-server's /props calls slots.
	pr, err := http.Get(n.url + "/props")
	if err != nil {
		t.Fatal(err)
	}
	defer pr.Body.Close()
	b, _ := io.ReadAll(pr.Body)
	var props struct {
		TotalSlots int `json:"total_slots"`
	}
	if pr.StatusCode != 200 || json.Unmarshal(b, &props) != nil || props.TotalSlots != 4 {
		t.Fatalf("props: %d %s", pr.StatusCode, b)
	}
	// -ctk quantizes the keys alone, as llama-server's: the values stay f16.
	mr, err := http.Get(n.url + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	defer mr.Body.Close()
	if b, _ := io.ReadAll(mr.Body); !strings.Contains(string(b), `cache_dtype="q8_0/f16"`) {
		t.Errorf("-ctk q8_0: metrics lack cache_dtype q8_0/f16")
	}
	if !strings.Contains(n.log(), "flags of llama-server or vLLM taken without effect") {
		t.Errorf("--metrics was not noted as taken without effect:\n%s", n.log())
	}
}

// TestAliasesInCluster: a node's other names travel in its gossip: another
// member lists them and routes requests naming them to it.
func TestAliasesInCluster(t *testing.T) {
	model := smallModel(t)
	key := "MDEyMzQ1Njc4OWFiY2RlZjAxMjM0NTY3ODlhYmNkZWY="
	g1 := freeAddr(t)
	startNode(t, "--model", model, "--gossip-key", key, "--gossip-addr", g1, "--node-name", "a", "--model-name", "small,tiny", "--ctx-size", "2048")
	b := startNode(t, "--model", model, "--gossip-key", key, "--gossip-addr", freeAddr(t), "--node-name", "b", "--join", g1, "--model-name", "other", "--ctx-size", "2048")
	waitFor(t, "a's names listed at b", func() bool {
		resp, err := http.Get(b.url + "/v1/models")
		if err != nil {
			return false
		}
		defer resp.Body.Close()
		body, _ := io.ReadAll(resp.Body)
		return strings.Contains(string(body), `"id":"tiny"`) && strings.Contains(string(body), `"id":"small"`)
	})
	for range 3 {
		r, out := post(t, b.url+"/v1/completions", `{"model":"tiny","prompt":"Once upon a time","max_tokens":2}`)
		if r.StatusCode != 200 || r.Header.Get("X-Shoal-Served-By") != "a" || !strings.Contains(out, `"model":"small"`) {
			t.Fatalf("tiny at b: %d served by %q: %s", r.StatusCode, r.Header.Get("X-Shoal-Served-By"), out)
		}
	}
	var stdout, stderr strings.Builder
	if code := run([]string{"status", "--addr", b.url}, &stdout, &stderr); code != 0 || !strings.Contains(stdout.String(), "small (alias tiny)") {
		t.Fatalf("status names a's alias: exit %d:\n%s%s", code, stdout.String(), stderr.String())
	}
}
