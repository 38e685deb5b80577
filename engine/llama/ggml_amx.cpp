// ggml's AMX kernels (Intel Xeon from its 4th generation: matrix tiles for
// 8-bit and 16-bit products), which the pinned ollama package does not
// compile although its ggml-cpu.cpp asks for them (ggml_backend_amx_buffer_type)
// whenever the compiler targets AMX. With them llama.cpp keeps the weights
// of the types they take in AMX's layout and multiplies them there. The
// include directories come from pkg-config (scripts/cgo-env.sh). Without AMX
// in the target this file is empty.
#include "ggml_amx.h"
#if SHOAL_AMX
#include "amx/amx.cpp"
#endif
