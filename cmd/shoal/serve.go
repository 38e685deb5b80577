package main

import (
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"maps"
	"math"
	"net"
	"net/http"
	"os"
	"os/signal"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"

	"github.com/shoal-ai/shoal/api"
	"github.com/shoal-ai/shoal/cluster"
	"github.com/shoal-ai/shoal/engine"
	"github.com/shoal-ai/shoal/engine/llama"
	"github.com/shoal-ai/shoal/engine/sim"
	"github.com/shoal-ai/shoal/scheduler"
)

// listFlag is a repeatable string flag.
type listFlag []string

func (l *listFlag) String() string { return strings.Join(*l, ",") }
func (l *listFlag) Set(v string) error {
	for _, x := range strings.Split(v, ",") {
		if x = strings.TrimSpace(x); x != "" {
			*l = append(*l, x)
		}
	}
	return nil
}

// pathFlag is a repeatable flag whose values are not split at commas (file
// paths may hold them).
type pathFlag []string

func (l *pathFlag) String() string     { return strings.Join(*l, " ") }
func (l *pathFlag) Set(v string) error { *l = append(*l, v); return nil }

// breakersFlag is --dry-sequence-breaker, as llama-server's: repeatable, its
// escapes (\n) read, "none" for no breakers at all.
type breakersFlag struct{ p *[]string }

func (b breakersFlag) String() string {
	if b.p == nil {
		return ""
	}
	return strings.Join(*b.p, " ")
}

func (b breakersFlag) Set(v string) error {
	switch {
	case v == "none":
		*b.p = []string{}
		return nil
	case v == "":
		return errors.New("a sequence breaker must not be empty (none: no breakers)")
	}
	if u, err := strconv.Unquote(`"` + strings.ReplaceAll(v, `"`, `\"`) + `"`); err == nil {
		v = u
	}
	*b.p = append(*b.p, v)
	return nil
}

// optional is a number or bool flag that stays nil unless given.
type optional[T int | float64 | bool] struct{ p **T }

func (o optional[T]) String() string {
	if o.p == nil || *o.p == nil {
		return ""
	}
	return fmt.Sprint(**o.p)
}

func (o optional[T]) Set(s string) error {
	v := new(T)
	var err error
	switch x := any(v).(type) {
	case *int:
		*x, err = strconv.Atoi(s)
	case *float64:
		*x, err = strconv.ParseFloat(s, 64)
	case *bool:
		if *x, err = strconv.ParseBool(s); err != nil {
			return fmt.Errorf("not a boolean: %q", s)
		}
	}
	if err != nil {
		return fmt.Errorf("not a number: %q", s)
	}
	*o.p = v
	return nil
}

// IsBoolFlag lets a bool flag be given without a value (--kv-unified).
func (o optional[T]) IsBoolFlag() bool {
	_, ok := any(new(T)).(*bool)
	return ok
}

// modelNames reads --model-name: the id answers give the model (the file's
// base name by default) and the other names it answers to.
func modelNames(flag, file string) (string, []string, error) {
	if flag == "" {
		return strings.TrimSuffix(filepath.Base(file), ".gguf"), nil, nil
	}
	names := strings.Split(flag, ",")
	for i, n := range names {
		if n = strings.TrimSpace(n); n == "" || slices.Contains(names[:i], n) {
			return "", nil, fmt.Errorf("--model-name %q: names must be neither empty nor repeated", flag)
		}
		names[i] = n
	}
	return names[0], names[1:], nil
}

// floatList parses "3,1" into []float32 (tensor split).
func floatList(s string) ([]float32, error) {
	if s == "" {
		return nil, nil
	}
	var out []float32
	for _, x := range strings.Split(s, ",") {
		f, err := strconv.ParseFloat(strings.TrimSpace(x), 32)
		if err != nil {
			return nil, fmt.Errorf("tensor split %q: %w", s, err)
		}
		out = append(out, float32(f))
	}
	return out, nil
}

// loraList reads --lora values, FILE or FILE:SCALE.
func loraList(l []string) ([]llama.LoRA, error) {
	var out []llama.LoRA
	for _, v := range l {
		a := llama.LoRA{Path: v, Scale: 1}
		if i := strings.LastIndexByte(v, ':'); i > 0 {
			if x, err := strconv.ParseFloat(v[i+1:], 32); err == nil {
				a.Path, a.Scale = v[:i], float32(x)
			}
		}
		if math.IsNaN(float64(a.Scale)) || math.IsInf(float64(a.Scale), 0) {
			return nil, fmt.Errorf("%q: the scale must be a finite number", v)
		}
		if !isFile(a.Path) {
			return nil, fmt.Errorf("%q: not a file", a.Path)
		}
		out = append(out, a)
	}
	return out, nil
}

// envPrefix: every flag --some-flag can also be set as SHOAL_SOME_FLAG.
const envPrefix = "SHOAL_"

// notFromEnv are flags applyEnv leaves alone. --host and --port: --addr is
// SHOAL_ADDR, and Kubernetes sets SHOAL_PORT=tcp://IP:PORT for a Service named
// shoal, which must neither stop the server nor move it. --api-key: keys come from
// SHOAL_API_KEYS (and SHOAL_API_KEY, which bench and status read), joined.
var notFromEnv = map[string]bool{"host": true, "port": true, "api-key": true}

// applyEnv sets flags not given on the command line from the environment.
func applyEnv(fs *flag.FlagSet, getenv func(string) string) error {
	given := map[string]bool{}
	fs.Visit(func(f *flag.Flag) { given[f.Name] = true })
	var err error
	fs.VisitAll(func(f *flag.Flag) {
		if given[f.Name] || notFromEnv[f.Name] || err != nil {
			return
		}
		key := envPrefix + strings.ToUpper(strings.ReplaceAll(f.Name, "-", "_"))
		if v := getenv(key); v != "" {
			if e := fs.Set(f.Name, v); e != nil {
				err = fmt.Errorf("%s=%q: %w", key, v, e)
			}
		}
	})
	return err
}

type serveFlags struct {
	model, addr, host, modelName, logLevel, flash, tensorSplit, sim       string
	kvType, kvTypeK, kvTypeV                                              string
	kvMemory, schedulingPolicy, reasoningFormat                           string
	simSpeed, cacheFloor                                                  float64
	embeddings, reranking, jinja, logRequests, allowCacheReset            bool
	pooling, chatTemplate, chatTemplateFile, mmproj                       string
	ctx, seqs, batch, ubatch, threads, threadsBatch, gpuLayers, mainGPU   int
	port, mmprojCacheMiB                                                  int
	mmap, caching                                                         bool
	unified                                                               *bool
	maxBatchTokens, maxRunning, maxWaiting, defaultMaxTokens, blockTokens int
	maxTokensCap, maxModelLen                                             int
	spec                                                                  scheduler.SpecConfig
	specConfig                                                            string
	hashSeed                                                              uint64
	maxBody                                                               int64
	drainTimeout                                                          time.Duration
	apiKeys, allowedOrigins, mediaDomains                                 listFlag
	lora, loraModules                                                     pathFlag
	sampling                                                              engine.SamplingDefaults
	llamaSampling                                                         api.LlamaSamplerFields
	cluster                                                               *clusterFlags
}

func serveFlagSet(stdout io.Writer) (*flag.FlagSet, *serveFlags) {
	fs := newFlags("serve", stdout)
	f := &serveFlags{}
	lc := llama.DefaultConfig("")
	sc := scheduler.DefaultConfig()
	ac := api.DefaultConfig()
	fs.StringVar(&f.model, "model", "", "path to a GGUF model file (required unless --sim)")
	fs.StringVar(&f.sim, "sim", "", "serve a simulated engine timed by this calibration profile (shoal calibrate) instead of a model")
	fs.Float64Var(&f.simSpeed, "sim-speed", 1, "with --sim: run this many times faster than the profile")
	fs.StringVar(&f.addr, "addr", "127.0.0.1:8080", "HTTP listen address HOST:PORT")
	fs.StringVar(&f.host, "host", "", "the HOST of --addr (llama-server's and vLLM's flag), e.g. 0.0.0.0")
	fs.IntVar(&f.port, "port", 0, "the PORT of --addr (llama-server's and vLLM's flag)")
	fs.StringVar(&f.modelName, "model-name", "", "model id clients send as \"model\" (default: the file's base name without .gguf); several, comma-separated, are names it answers to, the first in answers (vLLM's --served-model-name a b)")
	fs.StringVar(&f.logLevel, "log-level", "info", "log level: debug, info, warn or error")
	fs.BoolVar(&f.logRequests, "log-requests", ac.LogRequests, "log a line per API request as it ends: its id (X-Request-Id, carried across a forward), route, status, time, model, tokens, and the node it was forwarded to or from (not /health, /ready, /metrics)")
	fs.IntVar(&f.ctx, "ctx-size", lc.ContextCells, "KV cells (tokens) in the pool; with --kv-unified=false, split evenly among --parallel streams")
	fs.IntVar(&f.seqs, "parallel", lc.MaxSeqs, "engine sequence ids (running sequences plus cached-prefix holders), up to 256")
	fs.IntVar(&f.batch, "batch-size", lc.BatchTokens, "largest forward pass in tokens (llama.cpp n_batch)")
	fs.IntVar(&f.ubatch, "ubatch-size", lc.MicroBatchTokens, "physical micro-batch in tokens (llama.cpp n_ubatch)")
	fs.IntVar(&f.threads, "threads", 0, "decode threads (0: one per physical core, at most the CPU limit, as llama.cpp's default)")
	fs.IntVar(&f.threadsBatch, "threads-batch", 0, "prompt-processing threads (0: same as --threads)")
	fs.Var(optional[bool]{&f.unified}, "kv-unified", "one KV cell pool shared by all sequences (prefix blocks shared in place); false: one stream per sequence (faster attention at large batches, prefixes reused by stream copy); unset: one stream per sequence when the pool is sized from GPU memory and every stream gets min(trained context, 8192) cells, else one pool")
	fs.StringVar(&f.flash, "flash-attn", lc.FlashAttention, "flash attention: auto, on or off")
	fs.StringVar(&f.kvType, "kv-type", lc.KVTypeK, "KV cache type of keys and values: "+strings.Join(llama.KVTypes(), ", ")+" (quantized values need flash attention)")
	fs.StringVar(&f.kvTypeK, "kv-type-k", "", "KV cache type of keys (default: --kv-type; llama-server's -ctk)")
	fs.StringVar(&f.kvTypeV, "kv-type-v", "", "KV cache type of values (default: --kv-type; llama-server's -ctv)")
	fs.IntVar(&f.gpuLayers, "n-gpu-layers", lc.GPULayers, "layers to offload when a GPU backend is installed (-1: all)")
	fs.IntVar(&f.mainGPU, "main-gpu", 0, "GPU for the whole model when not splitting")
	fs.StringVar(&f.tensorSplit, "tensor-split", "", "fraction of the model per GPU, e.g. 3,1")
	fs.StringVar(&f.kvMemory, "kv-memory", "auto", "KV pool size instead of --ctx-size: a fraction of the free memory once the weights are loaded (0.9), or bytes (8GiB, 512MiB); auto: 0.8 of the GPUs' free memory when layers are offloaded, else --ctx-size")
	fs.BoolVar(&f.mmap, "mmap", true, "memory-map the model file")
	fs.BoolVar(&f.allowCacheReset, "allow-cache-reset", false, "serve POST /reset_prefix_cache (vLLM's, in its development mode), which empties this node's prefix cache: for benchmarks that start cold; off, any client could")
	fs.BoolVar(&f.embeddings, "embeddings", false, "serve /v1/embeddings (pooled) instead of generation: an embedding node")
	fs.StringVar(&f.pooling, "pooling", "", "with --embeddings: mean, cls, last or rank (default: the model's own)")
	fs.BoolVar(&f.reranking, "reranking", false, "serve /v1/rerank and /v1/score with a reranker (--embeddings --pooling rank, as llama-server's --reranking)")
	fs.Var(&f.loraModules, "lora-modules", "a LoRA adapter served as a model of its own, as vLLM's --lora-modules: NAME=FILE or NAME=FILE:SCALE; a request whose \"model\" is NAME runs under it (repeatable)")
	fs.StringVar(&f.mmproj, "mmproj", "", "a multimodal projector file (GGUF) for the model, as llama-server's --mmproj: chat requests may then carry images")
	fs.IntVar(&f.mmprojCacheMiB, "mmproj-cache-mib", lc.ProjectorCache>>20, "MiB of recent images' embeddings kept, so that a chat's later turns do not encode its images again (0: none)")
	fs.Var(&f.lora, "lora", "a LoRA adapter (GGUF) applied to every request: FILE, or FILE:SCALE (default scale 1); repeatable, as llama-server's --lora and Ollama's ADAPTER")
	fs.StringVar(&f.chatTemplate, "chat-template", "", "a llama.cpp built-in chat format instead of the model's own template: a name (llama3, chatml, mistral-v7, gemma, ...; an unknown name lists them) or a template text llama.cpp recognises (default: the model's own, run as Jinja; ChatML when it has none)")
	fs.StringVar(&f.chatTemplateFile, "chat-template-file", "", "a Jinja chat template file to render chats with instead of the model's own (as llama-server's)")
	fs.BoolVar(&f.jinja, "jinja", true, "render chats with the model's own Jinja chat template (tools in the model's own call format where it has one); false: llama.cpp's built-in format for it, tools described in the system message")
	fs.IntVar(&f.maxBatchTokens, "max-batch-tokens", sc.MaxBatchTokens, "token budget of one scheduling step (decode rows plus prefill chunks)")
	fs.IntVar(&f.maxRunning, "max-running", sc.MaxRunning, "most sequences decoding at once")
	fs.IntVar(&f.maxWaiting, "max-waiting", sc.MaxWaiting, "most sequences waiting; beyond it requests get 429")
	fs.StringVar(&f.reasoningFormat, "reasoning-format", ac.ReasoningFormat, "auto: a reasoning model's thoughts (<think>...</think>, when its chat template writes </think>) come back as reasoning_content, apart from content, as llama-server's and vLLM's reasoning parsers do; none: left in content")
	fs.StringVar(&f.schedulingPolicy, "scheduling-policy", "fcfs", "fcfs: first come, first served (a request's priority other than 0 is refused); priority: a request's priority orders the queue (lower first) and below 0 is admitted past a saturated cluster, as vLLM's")
	fs.IntVar(&f.defaultMaxTokens, "default-max-tokens", sc.DefaultMaxTokens, "max_tokens when a request gives none; 0: until end-of-generation or a full context, as vLLM")
	fs.IntVar(&f.maxTokensCap, "max-tokens-cap", ac.MaxTokensCap, "reject requests whose max_tokens exceeds this (0: only the context bounds it)")
	fs.IntVar(&f.maxModelLen, "max-model-len", sc.MaxModelLen, "longest sequence (prompt plus output) one request may have, as vLLM's (0: the model's trained context; the KV cells one sequence may use cap it too)")
	fs.IntVar(&f.spec.Tokens, "spec-tokens", 0, "speculative decoding by n-gram lookup: the most tokens a decoding sequence proposes per step from where its last tokens appeared before in its prompt or output, all checked in one pass (0: off); the output is the same, sooner when the model repeats text it has seen")
	fs.IntVar(&f.spec.NgramMax, "spec-ngram-max", sc.Spec.NgramMax, "with --spec-tokens: the longest tail of tokens looked up")
	fs.IntVar(&f.spec.NgramMin, "spec-ngram-min", sc.Spec.NgramMin, "with --spec-tokens: the shortest tail of tokens looked up")
	fs.IntVar(&f.spec.MaxRunning, "spec-max-running", sc.Spec.MaxRunning, "with --spec-tokens: no proposals while more sequences than this decode")
	fs.StringVar(&f.specConfig, "speculative-config", "", `vLLM's form of --spec-tokens: {"method": "ngram", "num_speculative_tokens": N, "prompt_lookup_max": M, "prompt_lookup_min": m}`)
	fs.IntVar(&f.blockTokens, "block-tokens", sc.KV.BlockTokens, "KV block size in tokens (prefix-cache granularity)")
	fs.BoolVar(&f.caching, "prefix-caching", true, "reuse the KV cache of common prompt prefixes")
	fs.Float64Var(&f.cacheFloor, "prefix-cache-floor", sc.KV.CacheFloor, "with one KV pool: share of the pool (or, when fewer, of the cells whose KV is as large as the model's weights) that cached prefixes nobody is using always keep; beyond it they are kept as far as reuse shows it pays: misses on recently evicted prefixes, first hits on cached ones (1: keep until the pool is full)")
	fs.Uint64Var(&f.hashSeed, "hash-seed", 0, "seed of the prefix block hashes (equal on every node of a cluster)")
	fs.Int64Var(&f.maxBody, "max-body-bytes", ac.MaxBodyBytes, "largest request body accepted (413 beyond); default 8 MiB, or 64 MiB on the endpoints that take images where images are read (by the node, --mmproj, or a member of its cluster)")
	fs.DurationVar(&f.drainTimeout, "drain-timeout", 30*time.Second, "on SIGTERM/SIGINT, how long in-flight requests may finish before they are cancelled")
	fs.Var(&f.mediaDomains, "allowed-media-domains", "hosts (images.example.com, or *) whose http(s) image URLs in requests the node fetches, as vLLM's; none by default: images come as data: URLs")
	fs.Var(&f.allowedOrigins, "allowed-origins", "web origins (https://app.example.com, or *) whose pages may call the API from a browser (CORS); none by default")
	fs.Var(optional[float64]{&f.sampling.Temperature}, "temp", "temperature of requests that give none (default: the model's recommendation, else 1)")
	fs.Var(optional[float64]{&f.sampling.TopP}, "top-p", "top_p of requests that give none (default: the model's recommendation, else off)")
	fs.Var(optional[int]{&f.sampling.TopK}, "top-k", "top_k of requests that give none (default: the model's recommendation, else off)")
	fs.Var(optional[float64]{&f.sampling.MinP}, "min-p", "min_p of requests that give none (default: the model's recommendation, else off)")
	fs.Var(optional[float64]{&f.sampling.RepeatPenalty}, "repeat-penalty", "repetition_penalty of requests that give none (default: the model's recommendation, else off)")
	ls := &f.llamaSampling
	fs.Var(optional[float64]{&ls.DryMultiplier}, "dry-multiplier", "dry_multiplier of requests that give none: DRY, as llama-server's flags (default 0: off)")
	fs.Var(optional[float64]{&ls.DryBase}, "dry-base", "dry_base of requests that give none (default 1.75)")
	fs.Var(optional[int]{&ls.DryAllowedLength}, "dry-allowed-length", "dry_allowed_length of requests that give none (default 2)")
	fs.Var(optional[int]{&ls.DryPenaltyLastN}, "dry-penalty-last-n", "dry_penalty_last_n of requests that give none (default -1: the whole sequence)")
	fs.Var(breakersFlag{&ls.DrySequenceBreakers}, "dry-sequence-breaker", "a DRY sequence breaker of requests that give none (repeatable, replacing the defaults \\n : \" *; escapes such as \\n are read; none: no breakers)")
	fs.Var(optional[float64]{&ls.XTCProbability}, "xtc-probability", "xtc_probability of requests that give none (default 0: off)")
	fs.Var(optional[float64]{&ls.XTCThreshold}, "xtc-threshold", "xtc_threshold of requests that give none (default 0.1)")
	fs.Var(optional[float64]{&ls.TypicalP}, "typical", "typical_p of requests that give none (default 1: off)")
	fs.Var(optional[float64]{&ls.TopNSigma}, "top-nsigma", "top_n_sigma of requests that give none (default -1: off)")
	fs.Var(optional[float64]{&ls.DynatempRange}, "dynatemp-range", "dynatemp_range of requests that give none (default 0: off)")
	fs.Var(optional[float64]{&ls.DynatempExponent}, "dynatemp-exp", "dynatemp_exponent of requests that give none (default 1)")
	fs.Var(optional[int]{&ls.Mirostat}, "mirostat", "mirostat of requests that give none (default 0: off; 1 or 2)")
	fs.Var(optional[float64]{&ls.MirostatEta}, "mirostat-lr", "mirostat_eta of requests that give none (default 0.1)")
	fs.Var(optional[float64]{&ls.MirostatTau}, "mirostat-ent", "mirostat_tau of requests that give none (default 5)")
	fs.Var(optional[int]{&ls.MinKeep}, "min-keep", "min_keep of requests that give none: top-p, min-p, typical-p and XTC keep at least this many tokens (default 0)")
	fs.Func("samplers", "the order of samplers of requests that give none, as llama-server's: names separated by ';' (penalties;dry;top_n_sigma;top_k;typ_p;top_p;min_p;xtc;temperature: llama-server's order, temperature last); default: shoal's order (temperature before the truncations, as vLLM)", func(v string) (err error) {
		ls.Samplers, err = api.SamplersFlag(v)
		return err
	})
	fs.Var(&f.apiKeys, "api-key", "key required on every endpoint but /health, /ready, /metrics and / (repeatable; also SHOAL_API_KEYS=a,b)")
	f.cluster = addClusterFlags(fs)
	return fs, f
}

func runServe(args []string, stdout, stderr io.Writer) error {
	fs, f := serveFlagSet(stdout)
	fs.Usage = func() {
		fmt.Fprintf(stdout, "Usage: shoal serve --model PATH [flags], or shoal serve PATH [flags]\n\nServes the model with an OpenAI-compatible API. Every flag can also be set as SHOAL_<FLAG> (e.g. SHOAL_CTX_SIZE=4096).\n\nFlags:\n")
		fs.PrintDefaults()
		fmt.Fprintf(stdout, "\nllama-server's and vLLM's spellings of these flags are taken too, so that their command lines start shoal:\n%s", aliasHelp())
	}
	args, model, ignored, err := serveArgs(fs, args)
	if err != nil {
		return err
	}
	if err := parse(fs, args); err != nil {
		return err
	}
	if model != "" {
		if f.model != "" {
			return fmt.Errorf("the model twice: %s and --model %s", model, f.model)
		}
		if err := fs.Set("model", model); err != nil {
			return err
		}
	}
	// Cluster flags do nothing without --gossip-addr: on the command line that is
	// a mistake; in the environment (one file for every node) only worth a warning.
	clusterArgs := f.cluster.setWithoutGossip(fs)
	onCommandLine := map[string]bool{}
	fs.Visit(func(fl *flag.Flag) { onCommandLine[fl.Name] = true })
	if err := applyEnv(fs, os.Getenv); err != nil {
		return err
	}
	if err := f.hostPort(); err != nil {
		return err
	}
	if f.schedulingPolicy != "fcfs" && f.schedulingPolicy != "priority" {
		return fmt.Errorf("--scheduling-policy %q: want fcfs or priority", f.schedulingPolicy)
	}
	var clusterEnv []string
	if f.cluster.gossip == "" {
		if len(clusterArgs) > 0 {
			return fmt.Errorf("%s: cluster flags without --gossip-addr, which joins the node to a cluster", strings.Join(clusterArgs, ", "))
		}
		clusterEnv = f.cluster.setWithoutGossip(fs)
	}
	f.envKeys(os.Getenv)
	if f.model == "" && f.sim == "" {
		return errors.New("--model is required (a GGUF file; `shoal gen-model --preset small --out /tmp/small.gguf` makes a test model)")
	}
	if strings.ContainsAny(f.chatTemplate, "./") && f.chatTemplateFile == "" && isFile(f.chatTemplate) {
		// vLLM's --chat-template also takes a file: a Jinja template (a path:
		// llama.cpp's format names have neither '.' nor '/').
		f.chatTemplateFile, f.chatTemplate = f.chatTemplate, ""
	}
	var template string
	if f.chatTemplateFile != "" {
		switch {
		case f.chatTemplate != "":
			return errors.New("--chat-template and --chat-template-file: give one (a llama.cpp built-in format, or a Jinja template)")
		case !f.jinja:
			return errors.New("--chat-template-file with --jinja=false: the file is a Jinja template")
		}
		b, err := os.ReadFile(f.chatTemplateFile)
		if err != nil {
			return fmt.Errorf("--chat-template-file: %w", err)
		}
		if err := api.CheckTemplate(string(b), nil); err != nil {
			return fmt.Errorf("--chat-template-file %s: %w", f.chatTemplateFile, err)
		}
		template = string(b)
	}
	// Flags of another kind of node: a mistake on the command line; in the
	// environment (one file for every node) left to the nodes they are for.
	switch {
	case onCommandLine["sim-speed"] && f.sim == "":
		return errors.New("--sim-speed needs --sim: a model runs at its own speed")
	case f.sim != "" && !(f.simSpeed > 0):
		return fmt.Errorf("--sim-speed %v: want more than 0", f.simSpeed)
	case onCommandLine["pooling"] && !f.embeddings && !f.reranking:
		return errors.New("--pooling needs --embeddings: a generation node pools nothing")
	}
	var profile sim.Profile
	if f.sim != "" {
		if f.chatTemplate != "" || f.chatTemplateFile != "" {
			return errors.New("--chat-template and --chat-template-file have no effect with --sim: simulated nodes render ChatML")
		}
		if f.embeddings || f.reranking {
			return errors.New("--embeddings and --reranking with --sim: simulated nodes generate; they have no pooled embeddings")
		}
		var err error
		if profile, err = sim.Load(f.sim); err != nil {
			return err
		}
		f.model = profile.Model
	}
	log, err := newLogger(stderr, f.logLevel)
	if err != nil {
		return err
	}
	llama.SetLogger(log)
	if len(clusterEnv) > 0 {
		log.Warn("cluster settings from the environment have no effect without --gossip-addr", "flags", strings.Join(clusterEnv, ","))
	}
	if len(ignored) > 0 {
		log.Info("flags of llama-server or vLLM taken without effect: shoal always does what they ask", "flags", strings.Join(ignored, ","))
	}
	split, err := floatList(f.tensorSplit)
	if err != nil {
		return err
	}
	lc := llama.DefaultConfig(f.model)
	if f.sim != "" {
		lc.ModelPath = "(sim)"
	}
	lc.ContextCells, lc.MaxSeqs, lc.BatchTokens, lc.MicroBatchTokens = f.ctx, f.seqs, f.batch, f.ubatch
	lc.Threads, lc.BatchThreads, lc.FlashAttention = cmp.Or(f.threads, llama.DefaultThreads()), f.threadsBatch, f.flash
	lc.KVTypeK, lc.KVTypeV = cmp.Or(f.kvTypeK, f.kvType), cmp.Or(f.kvTypeV, f.kvType)
	if f.unified != nil {
		lc.Unified = *f.unified
	}
	lc.GPULayers, lc.MainGPU, lc.TensorSplit, lc.UseMmap = f.gpuLayers, f.mainGPU, split, f.mmap
	lc.Embeddings, lc.Pooling, lc.ChatTemplate, lc.Projector = f.embeddings, f.pooling, f.chatTemplate, f.mmproj
	lc.ProjectorCache = f.mmprojCacheMiB << 20
	if f.sim != "" && f.mmproj != "" {
		return fmt.Errorf("--mmproj needs a model: a simulated engine (--sim) reads no images")
	}
	if f.mmproj != "" && !isFile(f.mmproj) {
		// Said here, before llama.cpp's own errors of a failed load.
		return fmt.Errorf("--mmproj %s: not a file", f.mmproj)
	}
	if f.reranking {
		if f.pooling != "" && f.pooling != "rank" {
			return fmt.Errorf("--reranking with --pooling %s: a reranker's pooling is rank", f.pooling)
		}
		lc.Embeddings, lc.Pooling = true, "rank"
	}
	if lc.LoRA, err = loraList(f.lora); err != nil {
		return fmt.Errorf("--lora %w", err)
	}
	if f.sim != "" && len(f.lora)+len(f.loraModules) > 0 {
		return fmt.Errorf("--lora and --lora-modules need a model: a simulated engine (--sim) computes nothing an adapter could change")
	}
	var adapterIDs []string
	for _, m := range f.loraModules {
		id, file, ok := strings.Cut(m, "=")
		if !ok || id == "" || file == "" {
			return fmt.Errorf("--lora-modules %q: want NAME=FILE or NAME=FILE:SCALE", m)
		}
		l, err := loraList([]string{file})
		if err != nil {
			return fmt.Errorf("--lora-modules %q: %w", m, err)
		}
		lc.Adapters, adapterIDs = append(lc.Adapters, l...), append(adapterIDs, id)
	}
	setFlags := map[string]bool{} // on the command line or in the environment (applyEnv sets them)
	fs.Visit(func(fl *flag.Flag) { setFlags[fl.Name] = true })
	// Asked for more running sequences or a larger step than the engine's
	// defaults hold (vLLM's --max-num-seqs 256, --max-num-batched-tokens 8192),
	// the engine grows to them unless its own size was given too.
	if setFlags["max-running"] && !setFlags["parallel"] && f.maxRunning > f.seqs {
		if most := llama.MaxParallel(); f.maxRunning > most {
			return fmt.Errorf("--max-running %d: llama.cpp runs at most %d sequences", f.maxRunning, most)
		}
		f.seqs, lc.MaxSeqs = f.maxRunning, f.maxRunning
	}
	if setFlags["max-batch-tokens"] && !setFlags["batch-size"] && f.maxBatchTokens > f.batch {
		f.batch, lc.BatchTokens = f.maxBatchTokens, f.maxBatchTokens
	}
	// Unless asked for either, the engine splits a pool sized from GPU memory when
	// every stream gets the model's context (faster attention, memory to spare).
	lc.AutoUnified = f.unified == nil
	if lc.KVMemory, err = parseKVMemory(f.kvMemory); err != nil {
		return err
	}
	if lc.KVMemory < 0 && (setFlags["ctx-size"] || os.Getenv("SHOAL_CTX_SIZE") != "") {
		lc.KVMemory = 0 // an explicit --ctx-size wins over auto sizing
	}
	// The engine's Validate says the rest, in its own terms.
	if err := atLeast(intFlag{"ctx-size", f.ctx, 16}, intFlag{"parallel", f.seqs, 1}, intFlag{"batch-size", f.batch, 1},
		intFlag{"ubatch-size", f.ubatch, 1}, intFlag{"threads", f.threads, 0}, intFlag{"threads-batch", f.threadsBatch, 0},
		intFlag{"n-gpu-layers", f.gpuLayers, -1}, intFlag{"mmproj-cache-mib", f.mmprojCacheMiB, 0}); err != nil {
		return err
	}
	if most := llama.MaxParallel(); f.seqs > most {
		return fmt.Errorf("--parallel %d: llama.cpp runs at most %d sequences", f.seqs, most)
	}
	if f.drainTimeout < 0 {
		return fmt.Errorf("--drain-timeout %v: must not be negative", f.drainTimeout)
	}
	if err := lc.Validate(); err != nil {
		return err
	}
	name, aliases, err := modelNames(f.modelName, f.model)
	if err != nil {
		return err
	}
	if !setFlags["max-running"] && os.Getenv("SHOAL_MAX_RUNNING") == "" {
		f.maxRunning = min(f.maxRunning, f.seqs) // fewer engine sequences: fewer running
	}
	if err := api.ValidateSampling(f.sampling); err != nil {
		return fmt.Errorf("sampling flags (--temp, --top-p, --top-k, --min-p, --repeat-penalty): %w", err)
	}
	if err := (&api.Backend{LlamaSampling: f.llamaSampling}).CheckLlamaSamplers(); err != nil {
		return fmt.Errorf("sampling flags (--dry-*, --xtc-*, --typical, --top-nsigma, --dynatemp-*, --mirostat*): %w", err)
	}
	sc := scheduler.DefaultConfig()
	sc.MaxBatchTokens, sc.MaxRunning, sc.MaxWaiting, sc.DefaultMaxTokens = f.maxBatchTokens, f.maxRunning, f.maxWaiting, f.defaultMaxTokens
	sc.KV.BlockTokens, sc.KV.Caching, sc.KV.Seed, sc.KV.Model = f.blockTokens, f.caching, f.hashSeed, name
	sc.KV.CacheFloor = f.cacheFloor
	sc.MaxModelLen = f.maxModelLen
	sc.Adapters = adapterIDs
	sc.Spec = f.spec
	if f.specConfig != "" {
		if sc.Spec, err = parseSpeculativeConfig(f.specConfig, sc.Spec); err != nil {
			return err
		}
	}
	if err := sc.Validate(); err != nil {
		return err
	}
	ac := api.DefaultConfig()
	ac.ModelName, ac.APIKeys, ac.MaxBodyBytes, ac.MaxTokensCap = name, f.apiKeys, f.maxBody, f.maxTokensCap
	ac.ModelAliases, ac.AllowCacheReset = aliases, f.allowCacheReset
	ac.AllowedOrigins, ac.AllowedMediaDomains = f.allowedOrigins, f.mediaDomains
	if !setFlags["max-body-bytes"] && os.Getenv("SHOAL_MAX_BODY_BYTES") == "" {
		ac.VisionBodyBytes = visionBodyBytes
	}
	ac.PriorityScheduling = f.schedulingPolicy == "priority"
	ac.ReasoningFormat = f.reasoningFormat
	ac.Adapters = adapterIDs
	ac.LogRequests = f.logRequests
	if f.sim == "" {
		ac.SchemaToGrammar = llama.SchemaToGrammar
	}
	ac.CacheInfo = map[string]string{"block_size": strconv.Itoa(f.blockTokens), "cache_dtype": cacheDtype(lc.KVTypeK, lc.KVTypeV),
		"enable_prefix_caching": strconv.FormatBool(f.caching)}
	reg := prometheus.NewRegistry()
	reg.MustRegister(collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	srv, err := api.New(ac, reg, log)
	if err != nil {
		return err
	}
	serverTLS, clientTLS, err := f.cluster.tlsConfigs()
	if err != nil {
		return err
	}
	ln, err := net.Listen("tcp", f.addr)
	if err != nil {
		return fmt.Errorf("listen: %w", err)
	}
	if f.cluster.gossip != "" {
		// Before the model loads (minutes, for a large one): the key, the secret
		// and the policy must be usable, and peers must reach the API.
		if err := f.cluster.check(); err != nil {
			ln.Close()
			return err
		}
		if err := f.cluster.resolveAdvertise(); err != nil {
			ln.Close()
			return err
		}
		if err := f.cluster.checkReachable(ln.Addr()); err != nil {
			ln.Close()
			return err
		}
	}
	// No ReadTimeout: it would end long streams. A stalled body is bounded by
	// the API (BodyIdleTimeout); a kept-alive connection sending nothing is
	// closed after idleTimeout, longer than cluster forwarders keep theirs.
	hs := &http.Server{Handler: srv.Handler(), ReadHeaderTimeout: 10 * time.Second, IdleTimeout: idleTimeout, TLSConfig: serverTLS}
	httpDone := make(chan error, 1)
	go func() {
		if serverTLS != nil {
			httpDone <- hs.ServeTLS(ln, "", "")
		} else {
			httpDone <- hs.Serve(ln)
		}
	}()
	log.Info("listening", "addr", ln.Addr().String(), "model", name)

	sigs := make(chan os.Signal, 1)
	signal.Notify(sigs, syscall.SIGTERM, syscall.SIGINT)
	defer signal.Stop(sigs)

	// Load the model while /health answers and /ready says 503.
	lastPct := -1
	lc.Progress = func(p float32) {
		if pct := int(p * 100); pct/10 != lastPct/10 {
			lastPct = pct
			log.Info("loading model", "progress", fmt.Sprintf("%d%%", pct))
		}
	}
	loaded := make(chan error, 1)
	var eng engine.Engine
	go func() {
		var err error
		if f.sim != "" {
			eng, err = sim.New(profile, sim.Config{Cells: f.ctx, MaxSeqs: f.seqs, BatchTokens: f.batch, Unified: lc.Unified, Speed: f.simSpeed})
		} else {
			eng, err = llama.Open(lc)
		}
		loaded <- err
	}()
	select {
	case err := <-loaded:
		if err != nil {
			hs.Close()
			return err
		}
	case sig := <-sigs:
		log.Info("signal during model load; exiting once the load returns (a second signal exits now)", "signal", sig.String())
		hs.Close()
		select {
		case err := <-loaded:
			if err == nil {
				eng.Close()
			}
		case sig := <-sigs:
			// llama.cpp's load cannot be interrupted; nothing is served yet.
			log.Warn("second signal during model load: exiting now", "signal", sig.String())
		}
		return nil
	}
	closeEngine := true // not when handlers may still be in it (see the end)
	defer func() {
		if closeEngine {
			eng.Close()
		}
	}()
	info, capacity := eng.Info(), eng.Capacity()
	if f.sim != "" {
		log.Warn("SIMULATED ENGINE: this node sleeps instead of computing and answers with letters, not a model's output",
			"profile", f.sim, "speed", f.simSpeed)
	}
	for _, d := range info.Devices {
		log.Info("device", "name", d.Name, "description", d.Description, "kind", d.Kind,
			"memory_total", engine.FormatBytes(d.MemoryTotal), "memory_free", engine.FormatBytes(d.MemoryFree))
	}
	device := deviceSummary(info, f.sim != "")
	log.Info("model loaded", "name", info.Name, "arch", info.Architecture, "desc", info.Description,
		"params", info.Params, "device", device, "gpu_layers", info.GPULayers, "threads", lc.Threads, "weights", weightsSummary(info.Weights),
		"context", capacity.Cells, "per_seq", capacity.CellsPerSeq,
		"seqs", capacity.MaxSeqs, "unified", capacity.Unified, "prefix_caching", f.caching && capacity.PrefixReuse,
		"chat_template", cmp.Or(f.chatTemplateFile, abbrev(info.ChatTemplate, 40)))
	for _, a := range lc.LoRA {
		log.Info("LoRA adapter applied", "file", a.Path, "scale", a.Scale)
	}
	if f.mmproj != "" {
		log.Info("projector loaded: chat requests may carry images", "file", f.mmproj)
	}
	for i, a := range lc.Adapters {
		log.Info("LoRA adapter served", "model", adapterIDs[i], "file", a.Path, "scale", a.Scale)
	}
	if template != "" {
		// Given by the operator, it must run: no quiet fallback to another format.
		if err := api.CheckTemplate(template, eng.Vocab()); err != nil {
			return fmt.Errorf("--chat-template-file %s: %w", f.chatTemplateFile, err)
		}
	}
	switch stepGiven := setFlags["max-batch-tokens"] || os.Getenv("SHOAL_MAX_BATCH_TOKENS") != ""; {
	case lc.Embeddings && !stepGiven:
		// An embedding or reranker's input is computed in one step: let a step
		// take what one batch holds (n_batch, which llama.cpp caps at the context).
		sc.MaxBatchTokens = capacity.BatchTokens
	case !stepGiven:
		sc.MaxBatchTokens = min(sc.MaxBatchTokens, capacity.BatchTokens) // a context smaller than the default step
	case sc.MaxBatchTokens > capacity.BatchTokens:
		return fmt.Errorf("--max-batch-tokens %d: one engine batch holds %d tokens (--batch-size %d, which llama.cpp caps at the context of %d cells)",
			sc.MaxBatchTokens, capacity.BatchTokens, f.batch, capacity.Cells)
	}
	sched, err := scheduler.New(sc, eng, log)
	if err != nil {
		return err
	}
	if f.maxModelLen > info.TrainedContext && info.TrainedContext > 0 {
		log.Warn("--max-model-len is beyond the model's trained context: output past it is likely garbage", "max_model_len", f.maxModelLen, "trained_context", info.TrainedContext)
	}
	schedCtx, stopSched := context.WithCancel(context.Background())
	schedDone := make(chan struct{})
	go func() { defer close(schedDone); sched.Run(schedCtx) }()
	var node *cluster.Node
	if f.cluster.gossip != "" {
		var secret []byte
		meta := cluster.Meta{Task: api.TaskOf(info), Vision: f.mmproj != "", Device: device, TLS: serverTLS != nil, Simulated: f.sim != "", Keys: len(f.apiKeys) > 0, Aliases: aliases, MaxTokensCap: f.maxTokensCap}
		node, secret, err = startCluster(f.cluster, apiAdvertise(f.addr, ln.Addr()), name, meta, sc, sched, log)
		if err != nil {
			stopSched()
			<-schedDone
			hs.Close()
			return err
		}
		fwd := cluster.NewForwarder(node.Name(), secret, clientTLS)
		fwd.Watch(node.Lost)
		srv.SetCluster(node, fwd, secret)
	}
	// The backend last: a failed join stops the start before any request ran.
	// (Peers that route here in between get 503 not_ready, which they pass on.)
	backend := &api.Backend{Generator: sched, Vocab: eng.Vocab(), Info: info, Capacity: capacity,
		Sampling: samplingDefaults(log, f.sampling, info.Sampling), LlamaSampling: llamaSamplingDefaults(log, f.llamaSampling)}
	if f.jinja {
		backend.Template = cmp.Or(template, info.Template)
	}
	if v, ok := eng.Vocab().(*llama.Vocab); ok {
		backend.CheckGrammar = v.CheckGrammar
	}
	if e, ok := eng.(*llama.Engine); ok && e.Projector() != nil {
		backend.Projector = e.Projector()
	}
	srv.SetBackend(backend)
	scheme := "http"
	if serverTLS != nil {
		scheme = "https"
	}
	log.Info("ready", "url", scheme+"://"+ln.Addr().String()+"/v1", "max_model_len", sched.MaxContext())

	select {
	case sig := <-sigs:
		log.Info("draining", "signal", sig.String(), "timeout", f.drainTimeout)
	case err := <-httpDone:
		stopSched()
		<-schedDone
		return fmt.Errorf("http server: %w", err)
	}
	if node != nil {
		if err := node.SetDraining(true); err != nil {
			log.Warn("announce draining", "err", err)
		}
	}
	srv.Drain()
	deadline := time.Now().Add(f.drainTimeout)
	for time.Now().Before(deadline) {
		// The API's count covers what the scheduler cannot see: requests being
		// forwarded to peers, and those not submitted yet.
		if l := sched.Load(); l.Running == 0 && l.Waiting == 0 && srv.InFlight() == 0 {
			break
		}
		select {
		case sig := <-sigs:
			log.Warn("second signal while draining: stopping now", "signal", sig.String())
			deadline = time.Now()
		case <-time.After(20 * time.Millisecond):
		}
	}
	stopSched() // cancels whatever is still running
	<-schedDone
	srv.StopRelays() // and what it is relaying from peers
	if node != nil {
		// Peers already route around it (draining since the signal): the leave
		// only tells them it left rather than failed, so it does not wait long.
		if err := node.Leave(2 * time.Second); err != nil {
			log.Warn("leave cluster", "err", err)
		}
	}
	shutdownCtx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if err := hs.Shutdown(shutdownCtx); err != nil {
		// Handlers still running may call into the engine (a tokenizer, a
		// template): it is left to the process's exit rather than freed under them.
		hs.Close()
		closeEngine = false
	}
	log.Info("stopped")
	return nil
}

// idleTimeout closes a kept-alive client connection that sends no request for
// this long (Go's default is never, and each holds a descriptor); longer than
// the 90 s for which a cluster member's forwarder keeps its idle connections.
const idleTimeout = 2 * time.Minute

// visionBodyBytes is the largest request body by default where images are
// read, by the node (--mmproj) or a member of its cluster that a request may
// be forwarded to: requests carry pictures in base64, a phone's photo 4-7 MB.
const visionBodyBytes = 64 << 20

// parseKVMemory reads --kv-memory: auto (-1), a fraction in (0,1], 0, or bytes with
// an optional KiB/MiB/GiB/TiB (or KB/MB/GB/TB, as powers of 1000) suffix.
func parseKVMemory(s string) (float64, error) {
	s = strings.TrimSpace(s)
	if s == "" || s == "auto" {
		return -1, nil
	}
	units := []struct {
		suffix string
		mult   float64
	}{{"KiB", 1 << 10}, {"MiB", 1 << 20}, {"GiB", 1 << 30}, {"TiB", 1 << 40}, {"KB", 1e3}, {"MB", 1e6}, {"GB", 1e9}, {"TB", 1e12}, {"B", 1}}
	mult := 0.0
	for _, u := range units {
		if num, ok := strings.CutSuffix(s, u.suffix); ok {
			s, mult = strings.TrimSpace(num), u.mult
			break
		}
	}
	v, err := strconv.ParseFloat(s, 64)
	switch {
	case err != nil || v < 0 || math.IsInf(v, 0) || math.IsNaN(v):
		return 0, fmt.Errorf("--kv-memory %q: want auto, a fraction like 0.9, or a size like 8GiB", s)
	case mult > 0:
		v *= mult
		if v < 1<<20 {
			return 0, fmt.Errorf("--kv-memory %q: less than 1 MiB", s)
		}
	case v > 1 && v < 1<<20:
		return 0, fmt.Errorf("--kv-memory %v: a fraction must be at most 1, and bytes at least 1 MiB", v)
	}
	return v, nil
}

// deviceSummary names where the model runs, for logs, metadata and shoal status.
func deviceSummary(info engine.ModelInfo, simulated bool) string {
	if simulated {
		return "sim"
	}
	var gpus []string
	for _, d := range info.Devices {
		if d.GPU() && info.GPULayers > 0 {
			gpus = append(gpus, fmt.Sprintf("%s %s (%s)", d.Name, d.Description, engine.FormatBytes(d.MemoryTotal)))
		}
	}
	if len(gpus) == 0 {
		return "CPU"
	}
	s := strings.Join(gpus, " + ")
	if len(s) > 120 {
		s = s[:117] + "..."
	}
	return s
}

// weightsSummary says where the weights went ("AMX 41.6 MiB, CPU_Mapped
// 30.8 MiB"): an operator sees that a GPU holds them, or a CPU's AMX kernels
// multiply them.
func weightsSummary(bufs []engine.WeightBuffer) string {
	parts := make([]string, len(bufs))
	for i, b := range bufs {
		parts[i] = b.Name + " " + engine.FormatBytes(b.Bytes)
	}
	return strings.Join(parts, ", ")
}

func newLogger(w io.Writer, level string) (*slog.Logger, error) {
	var l slog.Level
	if err := l.UnmarshalText([]byte(level)); err != nil {
		return nil, fmt.Errorf("--log-level %q: want debug, info, warn or error", level)
	}
	return slog.New(slog.NewTextHandler(w, &slog.HandlerOptions{Level: l})), nil
}

// envKeys takes the API keys from SHOAL_API_KEYS and SHOAL_API_KEY (both, joined)
// when none were given on the command line.
func (f *serveFlags) envKeys(getenv func(string) string) {
	if len(f.apiKeys) > 0 {
		return
	}
	for _, k := range []string{getenv("SHOAL_API_KEYS"), getenv("SHOAL_API_KEY")} {
		_ = f.apiKeys.Set(k) // splits on commas, skips empty entries
	}
}

// apiAdvertise is the API address peers forward to by default: --addr as given when it
// names a host (a certificate may name it, not its IP), with the port the listener
// got; the listener's address otherwise.
func apiAdvertise(addr string, bound net.Addr) string {
	host, _, err := net.SplitHostPort(addr)
	_, port, berr := net.SplitHostPort(bound.String())
	if err != nil || berr != nil || host == "" || net.ParseIP(host) != nil {
		return bound.String()
	}
	return net.JoinHostPort(host, port)
}

// hostPort folds --host and --port into --addr.
func (f *serveFlags) hostPort() error {
	if f.host == "" && f.port == 0 {
		return nil
	}
	host, port, err := net.SplitHostPort(f.addr)
	if err != nil {
		return fmt.Errorf("--addr %q: %w", f.addr, err)
	}
	if f.port < 0 || f.port > 65535 {
		return fmt.Errorf("--port %d: want 0-65535", f.port)
	}
	if f.host != "" {
		host = f.host
	}
	if f.port != 0 {
		port = strconv.Itoa(f.port)
	}
	f.addr = net.JoinHostPort(host, port)
	return nil
}

// abbrev shortens s to at most n bytes for a log line, marking the cut.
func abbrev(s string, n int) string {
	if len(s) <= n {
		return s
	}
	return s[:n] + "..."
}

// samplingDefaults are the flags' sampling parameters over the model's
// recommendations (as vLLM applies a model's generation_config.json), logged
// with where each comes from.
func samplingDefaults(log *slog.Logger, flags, model engine.SamplingDefaults) engine.SamplingDefaults {
	if err := api.ValidateSampling(model); err != nil {
		log.Warn("ignoring the model's recommended sampling parameters", "err", err)
		model = engine.SamplingDefaults{}
	}
	d := flags.Over(model)
	var attrs []any
	attrs = describeDefault(attrs, "temperature", d.Temperature, flags.Temperature)
	attrs = describeDefault(attrs, "top_p", d.TopP, flags.TopP)
	attrs = describeDefault(attrs, "top_k", d.TopK, flags.TopK)
	attrs = describeDefault(attrs, "min_p", d.MinP, flags.MinP)
	attrs = describeDefault(attrs, "repetition_penalty", d.RepeatPenalty, flags.RepeatPenalty)
	if len(attrs) > 0 {
		log.Info("default sampling parameters for requests that give none", attrs...)
	}
	return d
}

// llamaSamplingDefaults are the flags' defaults of llama-server's samplers,
// logged when any is set, under the request fields' names.
func llamaSamplingDefaults(log *slog.Logger, d api.LlamaSamplerFields) api.LlamaSamplerFields {
	var set map[string]any
	if b, err := json.Marshal(d); err == nil {
		_ = json.Unmarshal(b, &set)
	}
	var attrs []any
	for _, name := range slices.Sorted(maps.Keys(set)) {
		if set[name] != nil { // left out
			attrs = append(attrs, name, set[name])
		}
	}
	if len(attrs) > 0 {
		log.Info("default llama-server samplers for requests that give none", attrs...)
	}
	return d
}

// describeDefault adds a default in force, and whether a flag or the model set it.
func describeDefault[T any](attrs []any, name string, v, flag *T) []any {
	if v == nil {
		return attrs
	}
	from := "model"
	if flag != nil {
		from = "flag"
	}
	return append(attrs, name, fmt.Sprintf("%v (%s)", *v, from))
}

// parseSpeculativeConfig reads vLLM's --speculative-config over base: its
// n-gram method only (shoal has no draft models).
func parseSpeculativeConfig(js string, base scheduler.SpecConfig) (scheduler.SpecConfig, error) {
	var c struct {
		Method   string `json:"method"`
		Tokens   *int   `json:"num_speculative_tokens"`
		NgramMax *int   `json:"prompt_lookup_max"`
		NgramMin *int   `json:"prompt_lookup_min"`
	}
	dec := json.NewDecoder(strings.NewReader(js))
	dec.DisallowUnknownFields()
	if err := dec.Decode(&c); err != nil {
		return base, fmt.Errorf("--speculative-config: %w (want {\"method\": \"ngram\", \"num_speculative_tokens\": N, \"prompt_lookup_max\": M, \"prompt_lookup_min\": m})", err)
	}
	if c.Method != "ngram" {
		return base, fmt.Errorf("--speculative-config: method %q: only \"ngram\" (prompt lookup) is served; draft models are not", c.Method)
	}
	if c.Tokens == nil {
		return base, fmt.Errorf("--speculative-config: num_speculative_tokens is required")
	}
	base.Tokens = *c.Tokens
	if c.NgramMax != nil {
		base.NgramMax = *c.NgramMax
	}
	if c.NgramMin != nil {
		base.NgramMin = *c.NgramMin
	}
	return base, nil
}

// cacheDtype is vllm:cache_config_info's cache_dtype: the KV cache's type, or
// the keys' and the values' as K/V where they differ.
func cacheDtype(k, v string) string {
	if k == v {
		return k
	}
	return k + "/" + v
}
