// What ggml_amx.cpp and ggml_amx_mmq.cpp include before ggml's AMX sources.
#ifndef SHOAL_GGML_AMX_H
#define SHOAL_GGML_AMX_H

#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#ifndef NDEBUG
#define NDEBUG // as the ollama package compiles ggml
#endif

#if defined(__AMX_INT8__) && defined(__AVX512VNNI__)
#define SHOAL_AMX 1

// ggml's list of the weight types with AMX kernels, read under another name:
#define qtype_has_amx_kernels ggml_qtype_has_amx_kernels
#include "amx/common.h"
#undef qtype_has_amx_kernels

// The AMX sources then ask this one, which leaves out q4_0 and q4_1: their
// products through AMX's tiles are wrong in the pinned llama.cpp (measured:
// logits off by up to 0.9 once a step has many rows, while a single row,
// through the VNNI kernels, is right; known upstream and mended after this
// commit). Their weights stay with ggml's x86 repacking, as without AMX.
static inline bool shoal_qtype_has_amx_kernels(enum ggml_type type) {
	return type != GGML_TYPE_Q4_0 && type != GGML_TYPE_Q4_1 && ggml_qtype_has_amx_kernels(type);
}
#define qtype_has_amx_kernels shoal_qtype_has_amx_kernels
#else
#define SHOAL_AMX 0
#endif

#endif
