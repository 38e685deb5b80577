package llama

/*
#include "ggml-cpu.h"
extern const char *LLAMA_COMMIT;
*/
import "C"

import "strings"

// LlamaCommit is the llama.cpp commit the pinned ollama module vendors.
func LlamaCommit() string { return C.GoString(C.LLAMA_COMMIT) }

// CPUFeatures lists the x86/ARM features ggml's CPU kernels were compiled for.
func CPUFeatures() string {
	var fs []string
	add := func(name string, on C.int) {
		if on != 0 {
			fs = append(fs, name)
		}
	}
	add("SSE3", C.ggml_cpu_has_sse3())
	add("SSSE3", C.ggml_cpu_has_ssse3())
	add("AVX", C.ggml_cpu_has_avx())
	add("AVX2", C.ggml_cpu_has_avx2())
	add("F16C", C.ggml_cpu_has_f16c())
	add("FMA", C.ggml_cpu_has_fma())
	add("BMI2", C.ggml_cpu_has_bmi2())
	add("AVX_VNNI", C.ggml_cpu_has_avx_vnni())
	add("AVX512", C.ggml_cpu_has_avx512())
	add("AVX512_VBMI", C.ggml_cpu_has_avx512_vbmi())
	add("AVX512_VNNI", C.ggml_cpu_has_avx512_vnni())
	add("AVX512_BF16", C.ggml_cpu_has_avx512_bf16())
	add("AMX_INT8", C.ggml_cpu_has_amx_int8())
	add("NEON", C.ggml_cpu_has_neon())
	add("ARM_FMA", C.ggml_cpu_has_arm_fma())
	add("DOTPROD", C.ggml_cpu_has_dotprod())
	add("SVE", C.ggml_cpu_has_sve())
	add("LLAMAFILE", C.ggml_cpu_has_llamafile())
	if len(fs) == 0 {
		return "scalar"
	}
	return strings.Join(fs, " ")
}
