// ggml's AMX backend (Intel Xeon from its 4th generation: matrix tiles for
// 8-bit products), which the pinned ollama package does not compile although
// its ggml-cpu.cpp asks for it (ggml_backend_amx_buffer_type) whenever the
// compiler targets AMX. With it llama.cpp repacks the q8_0 and k-quant
// weights of matrices it takes into AMX's layout and multiplies them on the
// tiles (f16 ones are copied and multiplied by its AVX-512 kernels). The
// include directories come from pkg-config (scripts/cgo-env.sh). Without AMX
// in the target this file is empty.
#include "ggml_amx.h"
#if SHOAL_AMX
#include "amx/amx.cpp"
#endif
