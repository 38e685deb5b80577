// The matrix products of ggml's AMX kernels (see ggml_amx.cpp), in a file of
// their own, as ggml compiles them: both sources define static helpers.
#include "ggml_amx.h"
#if SHOAL_AMX
#include "amx/mmq.cpp"
#endif
