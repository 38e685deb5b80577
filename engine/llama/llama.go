// Package llama implements engine.Engine over llama.cpp's C API (llama.h). It is the
// only cgo in shoal.
//
// The llama.cpp library itself is compiled by the cgo packages of the pinned
// github.com/ollama/ollama/llama module, which this package imports for the build,
// for BackendInit (which loads GPU backend libraries from <exe>/../lib/ollama) and for
// SchemaToGrammar. Its Go wrapper is not used for inference because it cannot create a
// unified KV pool (kv_unified), abort a decode, free a context, detokenize or apply a
// chat template; this package calls llama.h directly for all of that.
//
// Rules kept here: every C object has a Close that is safe twice; no view of C memory
// outlives the call that produced it (Logits hands a view to a callback); every
// llama.cpp failure becomes a Go error, and inputs that would make llama.cpp abort the
// process (out-of-range ids, partial copies between streams) are rejected before the
// call.
package llama

/*
#cgo LDFLAGS: -lm
#cgo pkg-config: shoal-ggml-cpu
#include <stdlib.h>
#include <stdint.h>
#include "llama.h"
#include "ggml-cpu.h"
#include "ggml-backend.h"

extern bool shoalProgress(float progress, void *user_data);

static bool shoal_progress_trampoline(float progress, void *user_data) {
	return shoalProgress(progress, user_data);
}

static void shoal_set_progress(struct llama_model_params *p, void *user_data) {
	p->progress_callback = shoal_progress_trampoline;
	p->progress_callback_user_data = user_data;
}

// The abort flag lives in C memory and is polled by ggml between graph nodes without
// calling into Go.
static bool shoal_abort_poll(void *flag) {
	return __atomic_load_n((int32_t *)flag, __ATOMIC_RELAXED) != 0;
}
static void shoal_abort_store(int32_t *flag, int32_t v) {
	__atomic_store_n(flag, v, __ATOMIC_RELAXED);
}
static void shoal_set_abort(struct llama_context *ctx, int32_t *flag) {
	llama_set_abort_callback(ctx, shoal_abort_poll, flag);
}

static void shoal_batch_set(struct llama_batch *b, int i, llama_token t, llama_pos p, llama_seq_id s, int8_t out) {
	b->token[i] = t;
	b->pos[i] = p;
	b->n_seq_id[i] = 1;
	b->seq_id[i][0] = s;
	b->logits[i] = out;
}

// A row read from an embedding (the caller copies it into b->embd).
static void shoal_batch_set_embd(struct llama_batch *b, int i, llama_pos p, llama_seq_id s, int8_t out) {
	b->pos[i] = p;
	b->n_seq_id[i] = 1;
	b->seq_id[i][0] = s;
	b->logits[i] = out;
}
*/
import "C"

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"maps"
	"math"
	"os"
	"path/filepath"
	"runtime"
	"runtime/cgo"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"unsafe"

	ollamallama "github.com/ollama/ollama/llama"

	"github.com/shoal-ai/shoal/engine"
)

// FlashAttention modes accepted by Config.FlashAttention.
const (
	FlashAuto = "auto"
	FlashOn   = "on"
	FlashOff  = "off"
)

// Defaults, each chosen for a CPU node serving many short-to-medium requests.
const (
	// DefaultContextCells is the KV pool size in tokens, shared by all sequences.
	DefaultContextCells = 8192
	// DefaultMaxSeqs allows 64 concurrent sequences plus cached-prefix holders; the
	// unified pool lets this go up to llama.cpp's limit (256) at no memory cost.
	DefaultMaxSeqs = 128
	// DefaultBatchTokens bounds one forward pass (n_batch); the scheduler's token budget
	// must not exceed it.
	DefaultBatchTokens = 2048
	// DefaultMicroBatchTokens is the physical batch (n_ubatch) llama.cpp computes at once.
	DefaultMicroBatchTokens = 512
	// AutoSplitCells caps the cells per stream AutoUnified asks for before it
	// splits the pool: the trained context, up to this many tokens.
	AutoSplitCells = 8192
	// DefaultKVType keeps the cache in f16, llama.cpp's default and lossless for serving.
	DefaultKVType = "f16"
	// DefaultProjectorCache keeps 256 MiB of recent images' embeddings: 27
	// of LLaVA 1.5 7B's (576 tokens of 4096 values).
	DefaultProjectorCache = 256 << 20
)

// Config configures Open. Only cmd fills it from flags.
type Config struct {
	ModelPath string
	// GPULayers is the number of layers to offload when a GPU backend library is loaded
	// (-1: all). MainGPU and TensorSplit pass through to llama.cpp.
	GPULayers   int
	MainGPU     int
	TensorSplit []float32
	UseMmap     bool
	// KVMemory sizes the KV pool instead of ContextCells: a fraction (0,1] of the free
	// memory where the cache lives once the weights are loaded (the GPUs when layers
	// are offloaded, else the host), or a number of bytes (> 1). 0 uses ContextCells;
	// negative (the default) means DefaultKVFraction on a GPU, ContextCells on a CPU.
	KVMemory float64

	ContextCells     int  // n_ctx
	MaxSeqs          int  // n_seq_max, 1..256
	BatchTokens      int  // n_batch
	MicroBatchTokens int  // n_ubatch
	Threads          int  // decode threads; 0 = DefaultThreads()
	BatchThreads     int  // prompt threads; 0 = Threads
	Unified          bool // kv_unified: one cell pool for all sequences
	// AutoUnified lets Open choose Unified: one stream per sequence (split) when the
	// pool is sized from a GPU's memory and every stream gets at least
	// min(trained context, AutoSplitCells) cells, else Unified as set. In a unified
	// pool every token attends over all used cells of all sequences, cached prefixes
	// included, which on an H200 made decoding at 64 concurrent requests 4.1× slower
	// than split streams; where memory is that plentiful, split serves every prompt
	// the model can take.
	AutoUnified    bool
	FlashAttention string
	// KVTypeK and KVTypeV are the cache's types for keys and for values, by
	// llama-server's names (KVTypes). A quantized V needs flash attention.
	KVTypeK, KVTypeV string
	// Embeddings creates a context that returns pooled embeddings instead of logits
	// (an embedding node). Pooling is "" (the model's own), mean, cls, last or rank
	// (a reranker's scores: ModelInfo.Rerank).
	Embeddings bool
	Pooling    string
	// ChatTemplate overrides the model's chat template: a built-in format's name
	// (ChatTemplateNames: llama3, chatml, mistral-v7, ...) or a template text that
	// llama.cpp recognises. "" uses the model's, or ChatML when it has none.
	ChatTemplate string
	// LoRA adapters are applied to every sequence, each at its scale, as
	// llama-server's --lora and Ollama's ADAPTER apply them.
	LoRA []LoRA
	// Adapters are LoRA adapters a batch selects (engine.Batch.Adapter i
	// applies Adapters[i-1], besides LoRA's).
	Adapters []LoRA
	// Projector is a multimodal projector file (llama-server's --mmproj) for
	// the model: the engine then reads images (Engine.Projector).
	// ProjectorCache bounds the bytes of recent images' embeddings it keeps
	// (0: none), so that a chat's later turns do not encode them again.
	Projector      string
	ProjectorCache int

	// Progress, if set, is called with load progress in [0,1] from the loading goroutine.
	Progress func(float32)
}

// LoRA is a LoRA adapter file (GGUF, as llama.cpp's convert_lora_to_gguf.py
// writes it, for the model's architecture and shapes) and the scale it is
// applied at (1: as trained; 0: not at all).
type LoRA struct {
	Path  string
	Scale float32
}

// DefaultConfig returns a Config for path with every default filled in.
func DefaultConfig(path string) Config {
	return Config{
		ModelPath:        path,
		GPULayers:        -1,
		UseMmap:          true,
		KVMemory:         -1,
		ContextCells:     DefaultContextCells,
		MaxSeqs:          DefaultMaxSeqs,
		BatchTokens:      DefaultBatchTokens,
		MicroBatchTokens: DefaultMicroBatchTokens,
		Unified:          true,
		FlashAttention:   FlashAuto,
		KVTypeK:          DefaultKVType,
		KVTypeV:          DefaultKVType,
		ProjectorCache:   DefaultProjectorCache,
	}
}

// MaxParallel is the most sequences one context holds (Config.MaxSeqs).
func MaxParallel() int { return int(C.llama_max_parallel_sequences()) }

// Validate rejects configurations llama.cpp would refuse or silently change.
func (c Config) Validate() error {
	maxSeq := MaxParallel()
	switch {
	case c.ModelPath == "":
		return errors.New("model path is empty")
	case c.ContextCells < 16:
		return fmt.Errorf("context cells %d: need at least 16", c.ContextCells)
	case c.MaxSeqs < 1 || c.MaxSeqs > maxSeq:
		return fmt.Errorf("max sequences %d: must be 1..%d", c.MaxSeqs, maxSeq)
	case !c.Unified && c.ContextCells/c.MaxSeqs < 16:
		return fmt.Errorf("split KV: %d cells for %d sequences leaves fewer than 16 per sequence", c.ContextCells, c.MaxSeqs)
	case c.BatchTokens < 1 || c.MicroBatchTokens < 1:
		return errors.New("batch and micro-batch tokens must be positive")
	case c.MicroBatchTokens > c.BatchTokens:
		return fmt.Errorf("micro-batch %d exceeds batch %d", c.MicroBatchTokens, c.BatchTokens)
	case c.Threads < 0 || c.BatchThreads < 0:
		return errors.New("threads must not be negative")
	case c.ProjectorCache < 0:
		return fmt.Errorf("projector cache %d bytes: must not be negative", c.ProjectorCache)
	case c.Projector != "" && c.Embeddings:
		return fmt.Errorf("a projector (--mmproj) reads images for generation, not for embeddings: %w", engine.ErrUnsupported)
	case c.KVMemory != c.KVMemory || c.KVMemory > 1 && c.KVMemory < 1<<20:
		return fmt.Errorf("KV memory %v: want a fraction in (0,1] or at least 1 MiB of bytes", c.KVMemory)
	}
	for _, l := range append(slices.Clip(c.LoRA), c.Adapters...) {
		if l.Path == "" || math.IsNaN(float64(l.Scale)) || math.IsInf(float64(l.Scale), 0) {
			return fmt.Errorf("LoRA adapter %q at scale %v: want a file and a finite scale", l.Path, l.Scale)
		}
	}
	if _, err := flashType(c.FlashAttention); err != nil {
		return err
	}
	if _, err := kvType(c.KVTypeK); err != nil {
		return fmt.Errorf("keys: %w", err)
	}
	if vt, err := kvType(c.KVTypeV); err != nil {
		return fmt.Errorf("values: %w", err)
	} else if C.ggml_is_quantized(vt) && c.FlashAttention == FlashOff {
		return fmt.Errorf("KV values in %s need flash attention, which is off: quantize only the keys, or turn it on", c.KVTypeV)
	}
	if _, err := poolingType(c.Pooling); err != nil {
		return err
	}
	if c.ChatTemplate != "" {
		ct := C.CString(c.ChatTemplate)
		defer C.free(unsafe.Pointer(ct))
		if !chatTemplateWorks(ct) {
			return fmt.Errorf("chat template %q: not a built-in format (%s) nor a template llama.cpp recognises",
				c.ChatTemplate, strings.Join(ChatTemplateNames(), ", "))
		}
	}
	return nil
}

func poolingType(s string) (C.enum_llama_pooling_type, error) {
	switch s {
	case "":
		return C.LLAMA_POOLING_TYPE_UNSPECIFIED, nil
	case "mean":
		return C.LLAMA_POOLING_TYPE_MEAN, nil
	case "cls":
		return C.LLAMA_POOLING_TYPE_CLS, nil
	case "last":
		return C.LLAMA_POOLING_TYPE_LAST, nil
	case "rank":
		return C.LLAMA_POOLING_TYPE_RANK, nil
	}
	return 0, fmt.Errorf("pooling %q: want mean, cls, last or rank (or empty for the model's)", s)
}

func flashType(s string) (C.enum_llama_flash_attn_type, error) {
	switch s {
	case FlashAuto:
		return C.LLAMA_FLASH_ATTN_TYPE_AUTO, nil
	case FlashOn:
		return C.LLAMA_FLASH_ATTN_TYPE_ENABLED, nil
	case FlashOff:
		return C.LLAMA_FLASH_ATTN_TYPE_DISABLED, nil
	}
	return 0, fmt.Errorf("flash attention %q: want auto, on or off", s)
}

// kvTypes are the KV cache types llama-server's --cache-type-k and -v take.
var kvTypes = map[string]C.enum_ggml_type{
	"f32": C.GGML_TYPE_F32, "f16": C.GGML_TYPE_F16, "bf16": C.GGML_TYPE_BF16,
	"q8_0": C.GGML_TYPE_Q8_0, "q4_0": C.GGML_TYPE_Q4_0, "q4_1": C.GGML_TYPE_Q4_1,
	"iq4_nl": C.GGML_TYPE_IQ4_NL, "q5_0": C.GGML_TYPE_Q5_0, "q5_1": C.GGML_TYPE_Q5_1,
}

// KVTypes lists the names Config.KVTypeK and KVTypeV take.
func KVTypes() []string { return slices.Sorted(maps.Keys(kvTypes)) }

func kvType(s string) (C.enum_ggml_type, error) {
	if t, ok := kvTypes[s]; ok {
		return t, nil
	}
	return 0, fmt.Errorf("KV type %q: want one of %s", s, strings.Join(KVTypes(), ", "))
}

var backendOnce sync.Once

// initBackend loads GPU backend libraries (if any are installed beside the binary) and
// initialises llama.cpp, once per process.
func initBackend() {
	backendOnce.Do(ollamallama.BackendInit)
}

// Engine is a loaded model and one context. See engine.Engine for the concurrency rules.
type Engine struct {
	model *C.struct_llama_model
	ctx   *C.struct_llama_context
	mem   C.llama_memory_t
	batch C.struct_llama_batch
	abort *C.int32_t // C memory polled by ggml
	vocab *Vocab
	// lora are the loaded adapters, applied to the context at cfg.LoRA's
	// scales; adapters are cfg.Adapters, which batches select, and active
	// the one applied now (1-based, 0: none). Close frees them (the pinned
	// llama.cpp's model does not).
	lora, adapters []*C.struct_llama_adapter_lora
	scales         []float32 // cfg.Adapters' scales
	active         int
	// proj reads images (nil without a projector); ebatch carries the rows of
	// a pass that reads embeddings, and rowMap, after a Decode of such rows,
	// maps each batch row to its row in the last pass (-1: another pass).
	proj   *Projector
	ebatch C.struct_llama_batch
	// mpos holds, with M-RoPE, an embedding pass's positions: four per row
	// (time, height, width, unused), as llama.cpp reads them.
	mpos   *C.llama_pos
	rowMap []int32
	rows   []int32 // 0, 1, 2, ...: the rows of a batch of tokens only

	info   engine.ModelInfo
	cap    engine.Capacity
	closed atomic.Bool
	mu     sync.Mutex // serialises Close with Abort
}

var _ engine.Engine = (*Engine)(nil)

// Open loads the model and creates its context.
func Open(cfg Config) (*Engine, error) {
	if err := cfg.Validate(); err != nil {
		return nil, fmt.Errorf("open engine: %w", err)
	}
	facts, err := checkGGUF(cfg.ModelPath)
	if err != nil {
		return nil, fmt.Errorf("open engine: %w", err)
	}
	devs := Devices()
	if err := checkFits(cfg, devs); err != nil {
		return nil, fmt.Errorf("open engine: %w", err)
	}

	mp := C.llama_model_default_params()
	mp.n_gpu_layers = C.int32_t(cfg.GPULayers)
	if cfg.GPULayers < 0 {
		mp.n_gpu_layers = C.int32_t(999)
	}
	mp.main_gpu = C.int32_t(cfg.MainGPU)
	mp.use_mmap = C.bool(cfg.UseMmap)
	var pin runtime.Pinner
	defer pin.Unpin()
	if len(cfg.TensorSplit) > 0 {
		n := int(C.llama_max_devices())
		if len(cfg.TensorSplit) > n {
			return nil, fmt.Errorf("open engine: tensor split has %d entries, llama.cpp supports %d devices", len(cfg.TensorSplit), n)
		}
		split := (*C.float)(C.calloc(C.size_t(n), C.sizeof_float))
		defer C.free(unsafe.Pointer(split))
		s := unsafe.Slice(split, n)
		for i, v := range cfg.TensorSplit {
			s[i] = C.float(v)
		}
		mp.tensor_split = split
	}
	if cfg.Progress != nil {
		h := cgo.NewHandle(cfg.Progress)
		defer h.Delete()
		hp := (*cgo.Handle)(C.malloc(C.size_t(unsafe.Sizeof(h))))
		defer C.free(unsafe.Pointer(hp))
		*hp = h
		C.shoal_set_progress(&mp, unsafe.Pointer(hp))
	}

	cpath := C.CString(cfg.ModelPath)
	defer C.free(unsafe.Pointer(cpath))
	var model *C.struct_llama_model
	var failed string
	weights := loadReporting(func() { failed = llamaErrors(func() { model = C.llama_model_load_from_file(cpath, mp) }) })
	if model == nil {
		return nil, fmt.Errorf("open engine: llama.cpp could not load %s: %s", cfg.ModelPath,
			cmp.Or(failed, "not a GGUF model it supports, or truncated/corrupt"))
	}

	e := &Engine{model: model}
	for i, l := range append(slices.Clip(cfg.LoRA), cfg.Adapters...) {
		a, err := loadLoRA(model, l.Path)
		if err != nil {
			e.freeLoRA()
			C.llama_model_free(model)
			return nil, fmt.Errorf("open engine: %w", err)
		}
		if i < len(cfg.LoRA) {
			e.lora = append(e.lora, a)
		} else {
			e.adapters, e.scales = append(e.adapters, a), append(e.scales, l.Scale)
		}
	}
	offloaded := offloadedLayers(cfg, int(C.llama_model_n_layer(model)), devs)
	if cfg.Projector != "" {
		// Before the KV pool is sized from the free memory: the projector's
		// weights and buffers are on the GPU too.
		err = e.openProjector(cfg.Projector, cmp.Or(cfg.BatchThreads, cfg.Threads), cfg.ProjectorCache, offloaded > 0)
	}
	var cells int
	if err == nil {
		cells, err = e.kvCells(cfg, offloaded > 0)
	}
	if err == nil && cfg.AutoUnified && cfg.Unified && offloaded > 0 {
		split := cfg
		split.Unified = false
		if n, err := e.kvCells(split, true); err == nil && autoSplit(cfg, n, int(C.llama_model_n_ctx_train(model))) {
			cfg, cells = split, n
		}
	}
	if err == nil {
		cfg.ContextCells = cells
		err = e.newContext(cfg)
	}
	if err != nil {
		if e.proj != nil {
			e.proj.close()
		}
		e.freeLoRA()
		C.llama_model_free(model)
		return nil, fmt.Errorf("open engine: %w", err)
	}
	e.vocab = newVocab(model, cfg.ChatTemplate)
	if e.proj != nil {
		e.proj.vocab = e.vocab
		e.ebatch = C.llama_batch_init(C.int32_t(e.cap.BatchTokens), C.int32_t(e.proj.width), 1)
		e.cap.WholeMedia, e.cap.MRoPE = e.proj.nonCausal, e.proj.mrope
		if w := e.proj.width; w != int(C.llama_model_n_embd(model)) {
			e.cap.MediaWidth = w
		}
		if e.proj.mrope {
			e.mpos = (*C.llama_pos)(C.malloc(C.size_t(4 * e.cap.BatchTokens * C.sizeof_llama_pos)))
		}
		arch := metaString(model, "general.architecture")
		e.proj.causal = metaString(model, arch+".attention.causal") != "false" // what wholePass restores
		if e.cap.WholeMedia && e.cap.PrefixReuse {
			// Its images could be taken from the cache in part; only
			// Gemma 3's projector attends both ways, and Gemma 3's sliding
			// window keeps its prompts from the cache anyway.
			e.Close()
			return nil, fmt.Errorf("open engine: this projector's image tokens attend both ways, which shoal computes only for models without cross-request prefix reuse (Gemma 3's sliding window): %w", engine.ErrUnsupported)
		}
	}
	if e.vocab.unsupported {
		logger.Load().Debug("llama.cpp's built-in formats do not recognise this model's chat template: Vocab.ApplyChatTemplate refuses chats (the API renders them with the template as Jinja unless --jinja=false; --chat-template chooses a built-in format)",
			"formats", strings.Join(ChatTemplateNames(), ","))
	}
	e.info = e.readInfo(cfg.ModelPath)
	e.info.Devices, e.info.GPULayers, e.info.Weights = devs, offloaded, weights
	if !cfg.Embeddings {
		// The context pools nothing: it computes logits (a decoder embedding model or
		// reranker served without --embeddings generates, as it does in llama-server).
		e.info.Pooling, e.info.Rerank = false, nil
	}
	switch {
	case e.info.Rerank != nil && !facts.RankHead && !facts.Split:
		e.Close()
		return nil, fmt.Errorf("open engine: rank pooling (--reranking) needs a reranker, and this model has no classification head (cls.weight or cls.output.weight): its scores would mean nothing: %w", engine.ErrUnsupported)
	case e.info.Rerank != nil && e.mem != nil && !ranksByLast(e.info.Architecture):
		e.Close()
		return nil, fmt.Errorf("open engine: llama.cpp ranks a causal model of architecture %s by its first token, which sees nothing of the query or document (it ranks Qwen 3's by the last): %w", e.info.Architecture, engine.ErrUnsupported)
	case cfg.Embeddings && !e.info.Pooling && e.info.Rerank == nil:
		e.Close()
		return nil, fmt.Errorf("open engine: this model pools no embedding (no pooling: give --pooling mean, cls or last, or rank for a reranker): %w", engine.ErrUnsupported)
	case !cfg.Embeddings && e.mem == nil:
		// An encoder (BERT and the like) keeps no KV cache and computes a
		// sequence in one micro-batch; it embeds, it does not generate.
		e.Close()
		return nil, fmt.Errorf("open engine: this model keeps no KV cache (an encoder): serve it as an embedding model (--embeddings): %w", engine.ErrUnsupported)
	}
	return e, nil
}

// freeLoRA frees the loaded adapters, once no context applies them.
func (e *Engine) freeLoRA() {
	for _, a := range append(e.lora, e.adapters...) {
		C.llama_adapter_lora_free(a)
	}
	e.lora, e.adapters, e.active = nil, nil, 0
}

// reuseEnv serialises setting LLAMA_GRAPH_REUSE_DISABLE around a context's
// constructor, which reads it, against another engine opening at once.
var reuseEnv sync.Mutex

// loadLoRA loads the LoRA adapter at path for model.
func loadLoRA(model *C.struct_llama_model, path string) (*C.struct_llama_adapter_lora, error) {
	if _, err := checkGGUF(path); err != nil {
		return nil, fmt.Errorf("LoRA adapter: %w", err)
	}
	cp := C.CString(path)
	defer C.free(unsafe.Pointer(cp))
	var a *C.struct_llama_adapter_lora
	failed := llamaErrors(func() { a = C.llama_adapter_lora_init(model, cp) })
	if a == nil {
		return nil, fmt.Errorf("LoRA adapter %s: %s", path,
			cmp.Or(failed, "llama.cpp could not load it (a LoRA GGUF for this model's architecture and shapes expected)"))
	}
	return a, nil
}

// useAdapter applies selectable adapter i (1-based; 0: none) in place of the
// one applied now.
func (e *Engine) useAdapter(i int) error {
	if i == e.active {
		return nil
	}
	if e.active > 0 {
		C.llama_rm_adapter_lora(e.ctx, e.adapters[e.active-1])
		e.active = 0
	}
	if i > 0 {
		if C.llama_set_adapter_lora(e.ctx, e.adapters[i-1], C.float(e.scales[i-1])) != 0 {
			return fmt.Errorf("apply adapter %d: llama.cpp refused it", i)
		}
		e.active = i
	}
	return nil
}

// autoSplit reports whether AutoUnified splits a pool on a GPU: when it is sized from
// memory (not a cell count) and splitCells, split among cfg.MaxSeqs streams, gives
// each the trained context up to AutoSplitCells.
func autoSplit(cfg Config, splitCells, trained int) bool {
	return cfg.AutoUnified && cfg.Unified && cfg.KVMemory != 0 &&
		splitCells/max(cfg.MaxSeqs, 1) >= min(max(trained, 1), AutoSplitCells)
}

func (e *Engine) newContext(cfg Config) error {
	cp := C.llama_context_default_params()
	cp.n_ctx = C.uint32_t(cfg.ContextCells)
	cp.n_batch = C.uint32_t(cfg.BatchTokens)
	cp.n_ubatch = C.uint32_t(cfg.MicroBatchTokens)
	cp.n_seq_max = C.uint32_t(cfg.MaxSeqs)
	threads := cfg.Threads
	if threads == 0 {
		threads = DefaultThreads()
	}
	bthreads := cfg.BatchThreads
	if bthreads == 0 {
		bthreads = threads
	}
	cp.n_threads = C.int32_t(threads)
	cp.n_threads_batch = C.int32_t(bthreads)
	cp.kv_unified = C.bool(cfg.Unified)
	cp.flash_attn_type, _ = flashType(cfg.FlashAttention)
	cp.type_k, _ = kvType(cfg.KVTypeK)
	cp.type_v, _ = kvType(cfg.KVTypeV)
	cp.embeddings = C.bool(cfg.Embeddings)
	if cfg.Embeddings {
		cp.pooling_type, _ = poolingType(cfg.Pooling)
		// A pooled sequence must be computed in one micro-batch.
		cp.n_ubatch = cp.n_batch
	}
	cp.no_perf = C.bool(true)
	// Keep all of a sliding-window model's cells so that partial sequence copies stay valid.
	cp.swa_full = C.bool(true)

	e.abort = (*C.int32_t)(C.calloc(1, C.size_t(unsafe.Sizeof(C.int32_t(0)))))
	if len(cfg.Adapters) > 0 {
		// llama.cpp reuses a step's graph for the next of the same shape,
		// comparing the adapters applied by the address of their set, which
		// does not change when another is applied: the second adapter's batch
		// would run the first's graph. A context whose batches select
		// adapters builds every step's graph (the variable is read once, by
		// the context's constructor).
		reuseEnv.Lock()
		prev, had := os.LookupEnv("LLAMA_GRAPH_REUSE_DISABLE")
		os.Setenv("LLAMA_GRAPH_REUSE_DISABLE", "1")
		defer func() {
			if had {
				os.Setenv("LLAMA_GRAPH_REUSE_DISABLE", prev)
			} else {
				os.Unsetenv("LLAMA_GRAPH_REUSE_DISABLE")
			}
			reuseEnv.Unlock()
		}()
	}
	var ctx *C.struct_llama_context
	failed := llamaErrors(func() { ctx = C.llama_init_from_model(e.model, cp) })
	if ctx == nil {
		C.free(unsafe.Pointer(e.abort))
		e.abort = nil
		return fmt.Errorf("create context (n_ctx %d, n_seq_max %d, kv %s/%s, flash %s): %s",
			cfg.ContextCells, cfg.MaxSeqs, cfg.KVTypeK, cfg.KVTypeV, cfg.FlashAttention,
			cmp.Or(failed, "llama.cpp refused it (a quantized V cache needs flash attention; memory may be short)"))
	}
	for i, a := range e.lora {
		if C.llama_set_adapter_lora(ctx, a, C.float(cfg.LoRA[i].Scale)) != 0 {
			C.llama_free(ctx)
			C.free(unsafe.Pointer(e.abort))
			e.abort = nil
			return fmt.Errorf("apply LoRA adapter %s: llama.cpp refused it", cfg.LoRA[i].Path)
		}
	}
	e.ctx = ctx
	e.mem = C.llama_get_memory(ctx)
	C.shoal_set_abort(ctx, e.abort)
	e.batch = C.llama_batch_init(C.int32_t(cfg.BatchTokens), 0, 1)

	recurrent := bool(C.llama_model_is_recurrent(e.model)) || bool(C.llama_model_is_hybrid(e.model))
	swa := C.llama_model_n_swa(e.model) > 0
	nctx := int(C.llama_n_ctx(ctx))
	e.cap = engine.Capacity{
		Cells:            nctx,
		CellsPerSeq:      int(C.llama_n_ctx_seq(ctx)),
		MaxSeqs:          int(C.llama_n_seq_max(ctx)),
		BatchTokens:      int(C.llama_n_batch(ctx)),
		Unified:          cfg.Unified,
		PrefixReuse:      !recurrent && !swa && e.mem != nil,
		MicroBatchTokens: int(C.llama_n_ubatch(ctx)),
		PrefixSharing:    cfg.Unified && !recurrent && !swa && e.mem != nil,
	}
	e.cap.PoolsLast = e.cap.PrefixReuse && cfg.Embeddings && e.poolsLast()
	if per, err := e.kvBytesPerCell(cfg); err == nil {
		e.cap.CellBytes = per
	}
	return nil
}

func (e *Engine) readInfo(path string) engine.ModelInfo {
	m := e.model
	info := engine.ModelInfo{
		Name:            metaString(m, "general.name"),
		Architecture:    metaString(m, "general.architecture"),
		Params:          uint64(C.llama_model_n_params(m)),
		SizeBytes:       uint64(C.llama_model_size(m)),
		TrainedContext:  int(C.llama_model_n_ctx_train(m)),
		VocabSize:       e.vocab.Size(),
		EmbeddingSize:   int(C.llama_model_n_embd(m)),
		Layers:          int(C.llama_model_n_layer(m)),
		HasChatTemplate: C.llama_model_chat_template(m, nil) != nil,
		ChatTemplate:    e.vocab.ChatTemplate(),
		Template:        e.vocab.template(),
		Pooling:         embeddingPooling(C.llama_pooling_type(e.ctx)),
		Rerank:          e.rerankLayout(),
		Sampling:        samplingDefaults(m),
	}
	var buf [256]C.char
	if n := C.llama_model_desc(m, &buf[0], C.size_t(len(buf))); n > 0 {
		info.Description = C.GoString(&buf[0])
	}
	if info.Name == "" {
		info.Name = filepath.Base(path)
	}
	return info
}

// embeddingPooling reports whether a context pools one embedding of n_embd floats
// per sequence. Rank pooling (rerankers) gives a score per class instead.
func embeddingPooling(t C.enum_llama_pooling_type) bool {
	switch t {
	case C.LLAMA_POOLING_TYPE_MEAN, C.LLAMA_POOLING_TYPE_CLS, C.LLAMA_POOLING_TYPE_LAST:
		return true
	}
	return false
}

// poolsLast reports whether the context pools each sequence's last token over
// causal attention: last pooling, or rank pooling on Qwen 3, which llama.cpp
// reads from the last token (build_inp_cls), on a model whose attention is
// causal (an embedding model converted from a decoder may attend both ways:
// <arch>.attention.causal false).
func (e *Engine) poolsLast() bool {
	if C.llama_model_has_encoder(e.model) {
		return false // T5's encoder keeps a KV cache its attention does not read
	}
	arch := metaString(e.model, "general.architecture")
	switch C.llama_pooling_type(e.ctx) {
	case C.LLAMA_POOLING_TYPE_LAST:
	case C.LLAMA_POOLING_TYPE_RANK:
		if !ranksByLast(arch) {
			return false
		}
	default:
		return false
	}
	return metaString(e.model, arch+".attention.causal") != "false"
}

// ranksByLast reports whether llama.cpp's rank pooling reads a model of arch by
// its last token (Qwen 3's rerankers); it reads others by their first.
func ranksByLast(arch string) bool { return arch == "qwen3" }

// rerankLayout is how the model reads a query and a document, when its context
// ranks them (rank pooling); nil otherwise.
func (e *Engine) rerankLayout() *engine.RerankLayout {
	if C.llama_pooling_type(e.ctx) != C.LLAMA_POOLING_TYPE_RANK {
		return nil
	}
	name := C.CString("rerank")
	defer C.free(unsafe.Pointer(name))
	l := &engine.RerankLayout{BOS: engine.NoToken, EOS: engine.NoToken, SEP: engine.NoToken,
		Scores: int(C.llama_model_n_cls_out(e.model))}
	if t := C.llama_model_chat_template(e.model, name); t != nil {
		l.Template = C.GoString(t)
		return l
	}
	v := e.vocab.v
	if C.llama_vocab_get_add_bos(v) {
		l.BOS = engine.Token(C.llama_vocab_bos(v))
	}
	if C.llama_vocab_get_add_eos(v) {
		// llama-server ends each text with SEP where the model has no EOS.
		l.EOS = engine.Token(C.llama_vocab_eos(v))
		if l.EOS == engine.NoToken {
			l.EOS = engine.Token(C.llama_vocab_sep(v))
		}
	}
	if C.llama_vocab_get_add_sep(v) {
		l.SEP = engine.Token(C.llama_vocab_sep(v))
	}
	return l
}

// samplingDefaults reads the sampling parameters the model file recommends.
// A value that does not parse is left unset.
func samplingDefaults(m *C.struct_llama_model) engine.SamplingDefaults {
	float := func(key string) *float64 {
		v, err := strconv.ParseFloat(metaString(m, key), 64)
		if err != nil {
			return nil
		}
		return &v
	}
	var d engine.SamplingDefaults
	d.Temperature = float("general.sampling.temp")
	d.TopP = float("general.sampling.top_p")
	d.MinP = float("general.sampling.min_p")
	d.RepeatPenalty = float("general.sampling.penalty_repeat")
	if k := float("general.sampling.top_k"); k != nil {
		d.TopK = new(int)
		*d.TopK = int(*k)
	}
	return d
}

func metaString(m *C.struct_llama_model, key string) string {
	ck := C.CString(key)
	defer C.free(unsafe.Pointer(ck))
	n := C.llama_model_meta_val_str(m, ck, nil, 0)
	if n < 0 {
		return ""
	}
	buf := make([]byte, int(n)+1)
	C.llama_model_meta_val_str(m, ck, (*C.char)(unsafe.Pointer(&buf[0])), C.size_t(len(buf)))
	return string(buf[:n])
}

//export shoalProgress
func shoalProgress(progress C.float, userData unsafe.Pointer) C.bool {
	h := *(*cgo.Handle)(userData)
	h.Value().(func(float32))(float32(progress))
	return true
}

// Info returns the model's metadata.
func (e *Engine) Info() engine.ModelInfo { return e.info }

// Capacity returns the context's limits.
func (e *Engine) Capacity() engine.Capacity { return e.cap }

// Vocab returns the tokenizer; it stays valid until Close.
func (e *Engine) Vocab() engine.Vocab { return e.vocab }

// Decode runs one forward pass over b. It is atomic: on any error the KV memory is as
// it was before the call.
func (e *Engine) Decode(ctx context.Context, b *engine.Batch) error {
	if e.closed.Load() {
		return engine.ErrClosed
	}
	if err := e.checkBatch(b); err != nil {
		return fmt.Errorf("decode: %w", err)
	}
	if err := ctx.Err(); err != nil {
		return fmt.Errorf("decode: %w", err)
	}
	if err := e.useAdapter(b.Adapter); err != nil {
		return fmt.Errorf("decode: %w", err)
	}
	e.rowMap = e.rowMap[:0]
	if len(b.Embd) > 0 {
		return e.decodeEmbedded(ctx, b)
	}
	for len(e.rows) < b.Len() {
		e.rows = append(e.rows, int32(len(e.rows)))
	}
	return e.pass(ctx, b, e.rows[:b.Len()], false, true, true)
}

// pass decodes rows of b in one llama_decode: from their embeddings when embd,
// else their tokens; outputs keeps the rows' output flags (else none). first
// is the Decode's first pass. On failure the KV memory of b's sequences is as
// before Decode.
func (e *Engine) pass(ctx context.Context, b *engine.Batch, rows []int32, embd, outputs, first bool) error {
	if err := ctx.Err(); err != nil {
		if !first {
			e.undo(b)
		}
		return fmt.Errorf("decode: %w", err)
	}
	// The batches are passed as &e.batch and &e.ebatch, not through a
	// variable: cgo checks a field's address for Go pointers in the field
	// only when the argument is written so.
	for r, i := range rows {
		out := C.int8_t(0)
		if outputs && b.Output[i] {
			out = 1
		}
		if embd {
			C.shoal_batch_set_embd(&e.ebatch, C.int(r), C.llama_pos(b.Pos[i]), C.llama_seq_id(b.Seq[i]), out)
			w := e.proj.width
			copy(unsafe.Slice((*float32)(unsafe.Pointer(e.ebatch.embd)), len(rows)*w)[r*w:(r+1)*w], b.Embd[i])
		} else {
			C.shoal_batch_set(&e.batch, C.int(r), C.llama_token(b.Tokens[i]), C.llama_pos(b.Pos[i]), C.llama_seq_id(b.Seq[i]), out)
		}
	}
	var cb C.struct_llama_batch
	if embd {
		e.ebatch.n_tokens = C.int32_t(len(rows))
		cb = e.ebatch
		if e.mpos != nil {
			// M-RoPE: an image row's time is its position, its height and
			// width its position plus its line and column in the image.
			n := len(rows)
			mp := unsafe.Slice(e.mpos, 4*n)
			for r, i := range rows {
				y, x := b.At(int(i))
				mp[r], mp[n+r], mp[2*n+r], mp[3*n+r] = C.llama_pos(b.Pos[i]), C.llama_pos(b.Pos[i]+y), C.llama_pos(b.Pos[i]+x), 0
			}
			cb.pos = e.mpos
		}
	} else {
		e.batch.n_tokens = C.int32_t(len(rows))
		cb = e.batch
	}

	// A cancelled ctx aborts the pass. If the watcher fired, wait until it has raised the
	// flag so that lowering it below cannot be overtaken by a late store.
	fired := make(chan struct{})
	stop := context.AfterFunc(ctx, func() { e.Abort(); close(fired) })
	rc := C.llama_decode(e.ctx, cb)
	aborted := !stop()
	if aborted {
		<-fired
	}
	C.shoal_abort_store(e.abort, 0)

	if rc == 0 {
		return nil
	}
	// No space (1) and a refusal (-1, e.g. positions that do not follow the
	// sequence's) leave memory untouched, and undo would cut what it holds;
	// unless an earlier pass of a batch with embedding rows wrote cells.
	if !first || rc != 1 && rc != -1 {
		e.undo(b)
	}
	n := len(rows)
	switch {
	case rc == 1:
		return fmt.Errorf("decode %d tokens: %w", n, engine.ErrNoKVSpace)
	case rc == -1:
		return fmt.Errorf("decode: llama.cpp rejected the batch: %w", engine.ErrInvalidInput)
	case rc == 2 && aborted && ctx.Err() != nil:
		return fmt.Errorf("decode: %w: %w", engine.ErrAborted, ctx.Err())
	case rc == 2:
		return fmt.Errorf("decode: %w", engine.ErrAborted)
	}
	return fmt.Errorf("decode %d tokens: llama.cpp failed with status %d", n, int(rc))
}

// wholePass decodes one image's embedding rows in a pass of their own, one
// micro-batch attending both ways (WholeMedia).
func (e *Engine) wholePass(ctx context.Context, b *engine.Batch, rows []int32, first bool) error {
	if len(rows) > e.cap.MicroBatchTokens {
		if !first {
			e.undo(b)
		}
		return fmt.Errorf("decode: an image of %d rows: its tokens attend both ways and must fit a micro-batch of %d (--ubatch-size): %w",
			len(rows), e.cap.MicroBatchTokens, engine.ErrInvalidInput)
	}
	C.llama_set_causal_attn(e.ctx, false)
	defer C.llama_set_causal_attn(e.ctx, C.bool(e.proj.causal))
	return e.pass(ctx, b, rows, true, false, first)
}

// decodeEmbedded decodes a batch with embedding rows. llama.cpp reads a pass
// from tokens or from embeddings, not both, and keeps the logits of its last
// pass only: each sequence's rows up to its last embedding row go first, as
// runs of rows of one kind, in its order; a pass takes the next run of every
// sequence whose next run is of the pass's kind, text and embedding passes
// alternating (so a step admitting several prompts of text, image, text
// takes three passes, not three per prompt). Every other row (decode rows,
// the text after an image, the rows asking for logits) goes in one last
// pass. Rows asking for output before their sequence's last embedding row
// are refused.
func (e *Engine) decodeEmbedded(ctx context.Context, b *engine.Batch) error {
	last := map[engine.SeqID]int{}
	for i := range b.Len() {
		if b.Embedded(i) {
			last[b.Seq[i]] = i
		}
	}
	var early, final []int32
	e.rowMap = slices.Grow(e.rowMap[:0], b.Len())[:b.Len()]
	for i := range b.Len() {
		if j, ok := last[b.Seq[i]]; ok && i <= j {
			if b.Output[i] {
				return fmt.Errorf("decode: row %d asks for output before its sequence's last embedding row %d: %w", i, j, engine.ErrInvalidInput)
			}
			early, e.rowMap[i] = append(early, int32(i)), -1
			continue
		}
		e.rowMap[i] = int32(len(final))
		final = append(final, int32(i))
	}
	type run struct {
		rows []int32
		embd bool
	}
	var order []engine.SeqID
	runs := map[engine.SeqID][]run{}
	for _, i := range early {
		s, embd := b.Seq[i], b.Embedded(int(i))
		rs := runs[s]
		if len(rs) == 0 {
			order = append(order, s)
		}
		if len(rs) == 0 || rs[len(rs)-1].embd != embd {
			rs = append(rs, run{embd: embd})
		}
		rs[len(rs)-1].rows = append(rs[len(rs)-1].rows, i)
		runs[s] = rs
	}
	next := map[engine.SeqID]int{}
	first := true
	// With WholeMedia, a sequence's image rows are one image (the scheduler
	// cuts none, and text surrounds each) computed in a pass of its own,
	// attending both ways within one micro-batch.
	whole := e.cap.WholeMedia
	for left := len(early); left > 0; {
		for _, embd := range []bool{false, true} {
			var rows []int32
			for _, s := range order {
				k := next[s]
				if k >= len(runs[s]) || runs[s][k].embd != embd {
					continue
				}
				next[s]++
				if !embd || !whole {
					rows = append(rows, runs[s][k].rows...)
					continue
				}
				if err := e.wholePass(ctx, b, runs[s][k].rows, first); err != nil {
					return err
				}
				first, left = false, left-len(runs[s][k].rows)
			}
			if len(rows) == 0 {
				continue
			}
			if err := e.pass(ctx, b, rows, embd, false, first); err != nil {
				return err
			}
			first, left = false, left-len(rows)
		}
	}
	if len(final) == 0 {
		return nil
	}
	return e.pass(ctx, b, final, false, true, first)
}

// undo removes what a failed decode may have written for the sequences of b, so that
// the memory is as before the call. llama.cpp already removes the failed micro-batch;
// earlier micro-batches of the same call stay unless removed here.
func (e *Engine) undo(b *engine.Batch) {
	first := map[engine.SeqID]engine.Pos{}
	for i, s := range b.Seq {
		if p, ok := first[s]; !ok || b.Pos[i] < p {
			first[s] = b.Pos[i]
		}
	}
	for s, p := range first {
		C.llama_memory_seq_rm(e.mem, C.llama_seq_id(s), C.llama_pos(p), -1)
	}
}

func (e *Engine) checkBatch(b *engine.Batch) error {
	n := b.Len()
	switch {
	case n == 0:
		return fmt.Errorf("empty batch: %w", engine.ErrInvalidInput)
	case n > e.cap.BatchTokens:
		return fmt.Errorf("batch of %d tokens exceeds n_batch %d: %w", n, e.cap.BatchTokens, engine.ErrInvalidInput)
	case len(b.Pos) != n || len(b.Seq) != n || len(b.Output) != n || len(b.Embd) != 0 && len(b.Embd) != n || len(b.Grid) != 0 && len(b.Grid) != n:
		return fmt.Errorf("batch columns differ in length: %w", engine.ErrInvalidInput)
	case b.Adapter < 0 || b.Adapter > len(e.adapters):
		return fmt.Errorf("adapter %d: this engine has %d: %w", b.Adapter, len(e.adapters), engine.ErrInvalidInput)
	}
	nv := engine.Token(e.vocab.Size())
	for i := range n {
		if b.Embedded(i) {
			if e.proj == nil || len(b.Embd[i]) != e.proj.width {
				return fmt.Errorf("row %d: an embedding of %d values: this engine reads %s: %w", i, len(b.Embd[i]), e.embdWidth(), engine.ErrInvalidInput)
			}
		} else if t := b.Tokens[i]; t < 0 || t >= nv {
			return fmt.Errorf("row %d: token %d outside vocabulary [0,%d): %w", i, t, nv, engine.ErrInvalidInput)
		}
		if s := b.Seq[i]; s < 0 || int(s) >= e.cap.MaxSeqs {
			return fmt.Errorf("row %d: sequence %d outside [0,%d): %w", i, s, e.cap.MaxSeqs, engine.ErrInvalidInput)
		}
		if p := b.Pos[i]; p < 0 || int(p) >= e.cap.CellsPerSeq {
			return fmt.Errorf("row %d: position %d outside the context of %d tokens per sequence: %w", i, p, e.cap.CellsPerSeq, engine.ErrInvalidInput)
		}
		if y, x := b.At(i); y < 0 || x < 0 || (y > 0 || x > 0) && (!e.cap.MRoPE || !b.Embedded(i)) || int(b.Pos[i]+max(y, x)) >= e.cap.CellsPerSeq {
			return fmt.Errorf("row %d: line %d, column %d: only an M-RoPE engine's image rows have them, within the context: %w", i, y, x, engine.ErrInvalidInput)
		}
	}
	return nil
}

// embdWidth says what embedding rows the engine reads.
func (e *Engine) embdWidth() string {
	if e.proj == nil {
		return "tokens only (no projector)"
	}
	return fmt.Sprintf("embeddings of %d values", e.proj.width)
}

// Logits calls fn with a view of the logits of batch row i of the last Decode (the row
// must have had Output set). The view is valid only during fn.
func (e *Engine) Logits(i int, fn func([]float32)) error {
	return engine.ViewLogits(e, i, fn)
}

// LogitsView returns a read-only view of the logits of batch row i of the last
// Decode, valid until the next Decode or Close (engine.LogitsViewer). llama.cpp
// reallocates its output buffer only while decoding, and llama_get_logits_ith first
// waits for the pass to finish, which is why only the owner may call this.
func (e *Engine) LogitsView(i int) ([]float32, error) {
	if e.closed.Load() {
		return nil, engine.ErrClosed
	}
	if len(e.rowMap) > 0 {
		if i < 0 || i >= len(e.rowMap) || e.rowMap[i] < 0 {
			return nil, fmt.Errorf("logits of row %d: not an output row of the last batch: %w", i, engine.ErrInvalidInput)
		}
		i = int(e.rowMap[i])
	}
	if i < 0 || i >= int(e.batch.n_tokens) {
		return nil, fmt.Errorf("logits of row %d: outside the last batch of %d rows: %w", i, int(e.batch.n_tokens), engine.ErrInvalidInput)
	}
	p := C.llama_get_logits_ith(e.ctx, C.int32_t(i))
	if p == nil {
		return nil, fmt.Errorf("logits of row %d: not an output row: %w", i, engine.ErrInvalidInput)
	}
	return unsafe.Slice((*float32)(unsafe.Pointer(p)), e.vocab.Size()), nil
}

// Embeddings returns the pooled embedding of sequence s, or a reranker's scores.
func (e *Engine) Embeddings(s engine.SeqID) ([]float32, error) {
	if e.closed.Load() {
		return nil, engine.ErrClosed
	}
	n := e.info.EmbeddingSize
	switch {
	case e.info.Rerank != nil:
		n = e.info.Rerank.Scores
	case !e.info.Pooling:
		return nil, fmt.Errorf("embeddings: model has no pooling: %w", engine.ErrUnsupported)
	}
	if err := e.checkSeq(s); err != nil {
		return nil, fmt.Errorf("embeddings: %w", err)
	}
	p := C.llama_get_embeddings_seq(e.ctx, C.llama_seq_id(s))
	if p == nil {
		return nil, fmt.Errorf("embeddings of sequence %d: none computed", s)
	}
	return append([]float32(nil), unsafe.Slice((*float32)(unsafe.Pointer(p)), n)...), nil
}

// Abort makes a running (or the next) Decode return ErrAborted. Any goroutine.
func (e *Engine) Abort() {
	e.mu.Lock()
	defer e.mu.Unlock()
	if e.abort != nil {
		C.shoal_abort_store(e.abort, 1)
	}
}

// Close frees the context and the model. Safe to call twice; must not race a Decode.
func (e *Engine) Close() error {
	if e.closed.Swap(true) {
		return nil
	}
	e.mu.Lock()
	defer e.mu.Unlock()
	if e.proj != nil {
		e.proj.close()
		C.llama_batch_free(e.ebatch)
		e.proj = nil
	}
	if e.mpos != nil {
		C.free(unsafe.Pointer(e.mpos))
		e.mpos = nil
	}
	if e.ctx != nil {
		C.llama_batch_free(e.batch)
		C.llama_free(e.ctx)
		e.ctx = nil
	}
	e.freeLoRA()
	if e.abort != nil {
		C.free(unsafe.Pointer(e.abort))
		e.abort = nil
	}
	if e.model != nil {
		C.llama_model_free(e.model)
		e.model = nil
	}
	return nil
}
