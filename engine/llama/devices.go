package llama

/*
#include "llama.h"
#include "ggml-backend.h"
*/
import "C"

import (
	"fmt"
	"math"
	"os"

	"github.com/shoal-ai/shoal/engine"
)

// Devices lists the compute devices llama.cpp can use, loading GPU backend libraries
// from <dir of the executable>/../lib/ollama first (once per process). Without such a
// library the list is the CPU alone.
func Devices() []engine.Device {
	initBackend()
	n := int(C.ggml_backend_dev_count())
	out := make([]engine.Device, 0, n)
	for i := range n {
		d := C.ggml_backend_dev_get(C.size_t(i))
		var free, total C.size_t
		C.ggml_backend_dev_memory(d, &free, &total)
		out = append(out, engine.Device{
			Name:        C.GoString(C.ggml_backend_dev_name(d)),
			Description: C.GoString(C.ggml_backend_dev_description(d)),
			Kind:        deviceKind(C.ggml_backend_dev_type(d)),
			MemoryTotal: uint64(total),
			MemoryFree:  uint64(free),
		})
	}
	return out
}

func deviceKind(t C.enum_ggml_backend_dev_type) string {
	switch t {
	case C.GGML_BACKEND_DEVICE_TYPE_CPU:
		return "cpu"
	case C.GGML_BACKEND_DEVICE_TYPE_GPU:
		return "gpu"
	case C.GGML_BACKEND_DEVICE_TYPE_IGPU:
		return "igpu"
	}
	return "accel"
}

// gpus returns the devices with memory of their own.
func gpus(devs []engine.Device) []engine.Device {
	var out []engine.Device
	for _, d := range devs {
		if d.GPU() {
			out = append(out, d)
		}
	}
	return out
}

// DefaultKVFraction is the share of the GPUs' free memory (after the weights are
// loaded) that the KV pool takes when the model is offloaded and no size is given;
// the rest is left for llama.cpp's compute buffers and the CUDA runtime.
const DefaultKVFraction = 0.80

// kvReserve is memory left for compute buffers beside the KV pool on a GPU.
const kvReserve = 512 << 20

// checkFits refuses, before llama.cpp tries, a model whose weights cannot fit in the
// GPUs' free memory when every layer is to be offloaded.
func checkFits(cfg Config, devs []engine.Device) error {
	g := gpus(devs)
	if len(g) == 0 || !offloadsAll(cfg) {
		return nil
	}
	st, err := os.Stat(cfg.ModelPath)
	if err != nil {
		return fmt.Errorf("model file: %w", err)
	}
	var free uint64
	for _, d := range g {
		free += d.MemoryFree
	}
	need := uint64(st.Size()) + kvReserve
	if need > free {
		return fmt.Errorf("model %s needs about %s of GPU memory for its weights and buffers; the GPUs (%s) have %s free: "+
			"offload fewer layers (--n-gpu-layers), use a smaller quantisation, or free the GPU",
			cfg.ModelPath, engine.FormatBytes(need), describe(g), engine.FormatBytes(free))
	}
	return nil
}

// offloadsAll: -1 (or a count at least llama.cpp's "all") offloads every layer.
func offloadsAll(cfg Config) bool { return cfg.GPULayers < 0 || cfg.GPULayers >= 999 }

func describe(ds []engine.Device) string {
	s := ""
	for i, d := range ds {
		if i > 0 {
			s += ", "
		}
		s += d.Name + " " + d.Description
	}
	return s
}

// maskCells is the most KV cells a context of cfg's shape can have. llama.cpp sizes
// its compute buffers with a worst-case micro-batch of cfg.MicroBatchTokens rounded up
// to a multiple of cfg.MaxSeqs tokens, whose attention mask holds cells × tokens f32
// values (per stream when the KV is split, one stream per sequence), and ggml's CUDA
// copy, which casts the mask to f16 for flash attention, aborts the process above
// INT_MAX bytes. Seen on an H200: 1Mi cells for 128 sequences (512 tokens), and
// 1,048,320 for 160 (640 tokens), both aborted while the context was created.
func maskCells(cfg Config) int {
	seqs := max(cfg.MaxSeqs, 1)
	tokens := (max(cfg.MicroBatchTokens, 1) + seqs - 1) / seqs * seqs
	stream := math.MaxInt32 / (4 * tokens)
	stream -= stream % 256
	if cfg.Unified {
		return stream
	}
	return stream * seqs
}

// kvCells sizes the KV pool from cfg.KVMemory once the weights are loaded: a fraction
// of the free memory where the cache lives (the GPUs when layers are offloaded, else
// the host), or a number of bytes. It returns cfg.ContextCells when no size applies.
// Either way the pool stays within maskCells.
func (e *Engine) kvCells(cfg Config, offloaded bool) (int, error) {
	limit := maskCells(cfg)
	mem := cfg.KVMemory
	if mem < 0 && offloaded { // auto
		mem = DefaultKVFraction
	}
	if mem <= 0 {
		if cfg.ContextCells > limit {
			return 0, fmt.Errorf("context of %d cells for %d sequences with %d-token micro-batches: llama.cpp's attention mask must stay under 2 GiB, which allows at most %d cells; use fewer cells, sequences or smaller micro-batches",
				cfg.ContextCells, cfg.MaxSeqs, cfg.MicroBatchTokens, limit)
		}
		return cfg.ContextCells, nil
	}
	perCell, err := e.kvBytesPerCell(cfg)
	if err != nil {
		// Hybrid models (attention and recurrent layers) report no KV heads for
		// their first layer: the pool keeps its cell count.
		logger.Load().Warn("cannot size the KV pool from memory; using the context size", "err", err, "cells", cfg.ContextCells)
		cfg.KVMemory = 0
		return e.kvCells(cfg, offloaded)
	}
	budget := mem
	if mem <= 1 {
		var free uint64
		for _, d := range Devices() {
			if d.GPU() == offloaded {
				free += d.MemoryFree
			}
		}
		if offloaded {
			free = free - min(free, kvReserve)
		}
		budget = mem * float64(free)
	}
	cells := int(budget / perCell)
	// More than every sequence at its trained length is memory nobody can use.
	if most := cfg.MaxSeqs * max(int(C.llama_model_n_ctx_train(e.model)), 1); cells > most {
		cells = most
	}
	cells = min(cells, limit)
	cells -= cells % 256
	if !cfg.Unified {
		// llama.cpp rounds each stream up to a multiple of 256 cells: round down
		// here, or the pool outgrows the memory it was sized for.
		cells = cells / cfg.MaxSeqs / 256 * 256 * cfg.MaxSeqs
	}
	if cells < max(256, 16*cfg.MaxSeqs) {
		return 0, fmt.Errorf("KV memory %s holds only %d cells at %.0f bytes each: give more (--kv-memory) or fewer sequences (--parallel)",
			engine.FormatBytes(uint64(budget)), int(budget/perCell), perCell)
	}
	return cells, nil
}

// kvBytesPerCell is the KV cache's size per token: K and V rows of every layer.
func (e *Engine) kvBytesPerCell(cfg Config) (float64, error) {
	layers := float64(C.llama_model_n_layer(e.model))
	heads := float64(C.llama_model_n_head(e.model))
	headsKV := float64(C.llama_model_n_head_kv(e.model))
	embd := float64(C.llama_model_n_embd(e.model))
	if layers <= 0 || heads <= 0 || headsKV <= 0 {
		return 0, fmt.Errorf("KV size: model reports %v layers, %v heads, %v KV heads", layers, heads, headsKV)
	}
	arch := metaString(e.model, "general.architecture")
	dimK, dimV := embd/heads, embd/heads
	if v := metaUint(e.model, arch+".attention.key_length"); v > 0 {
		dimK = float64(v)
	}
	if v := metaUint(e.model, arch+".attention.value_length"); v > 0 {
		dimV = float64(v)
	}
	kt, err := kvType(cfg.KVTypeK)
	if err != nil {
		return 0, err
	}
	vt, err := kvType(cfg.KVTypeV)
	if err != nil {
		return 0, err
	}
	return layers * headsKV * (dimK*elemBytes(kt) + dimV*elemBytes(vt)), nil
}

// elemBytes is a type's bytes per element, a quantized block's shared by its elements.
func elemBytes(t C.enum_ggml_type) float64 {
	return float64(C.ggml_type_size(t)) / float64(C.ggml_blck_size(t))
}

func metaUint(m *C.struct_llama_model, key string) uint64 {
	s := metaString(m, key)
	var v uint64
	if _, err := fmt.Sscan(s, &v); err != nil {
		return 0
	}
	return v
}

// offloadedLayers is how many of the model's layers sit on a GPU.
func offloadedLayers(cfg Config, layers int, devs []engine.Device) int {
	if len(gpus(devs)) == 0 || !bool(C.llama_supports_gpu_offload()) {
		return 0
	}
	if offloadsAll(cfg) {
		return layers
	}
	return min(cfg.GPULayers, layers)
}
