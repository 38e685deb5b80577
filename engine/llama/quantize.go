package llama

/*
#include <stdlib.h>
#include "llama.h"
*/
import "C"

import (
	"cmp"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"unsafe"
)

// quantTypes are the weight types Quantize writes, by llama-quantize's names.
var quantTypes = map[string]C.enum_llama_ftype{
	"f16":    C.LLAMA_FTYPE_MOSTLY_F16,
	"bf16":   C.LLAMA_FTYPE_MOSTLY_BF16,
	"q8_0":   C.LLAMA_FTYPE_MOSTLY_Q8_0,
	"q6_k":   C.LLAMA_FTYPE_MOSTLY_Q6_K,
	"q5_k_m": C.LLAMA_FTYPE_MOSTLY_Q5_K_M,
	"q5_k_s": C.LLAMA_FTYPE_MOSTLY_Q5_K_S,
	"q5_0":   C.LLAMA_FTYPE_MOSTLY_Q5_0,
	"q5_1":   C.LLAMA_FTYPE_MOSTLY_Q5_1,
	"q4_k_m": C.LLAMA_FTYPE_MOSTLY_Q4_K_M,
	"q4_k_s": C.LLAMA_FTYPE_MOSTLY_Q4_K_S,
	"q4_0":   C.LLAMA_FTYPE_MOSTLY_Q4_0,
	"q4_1":   C.LLAMA_FTYPE_MOSTLY_Q4_1,
	"q3_k_l": C.LLAMA_FTYPE_MOSTLY_Q3_K_L,
	"q3_k_m": C.LLAMA_FTYPE_MOSTLY_Q3_K_M,
	"q3_k_s": C.LLAMA_FTYPE_MOSTLY_Q3_K_S,
	"q2_k":   C.LLAMA_FTYPE_MOSTLY_Q2_K,
}

// QuantTypes lists the names Quantize accepts, sorted.
func QuantTypes() []string {
	names := make([]string, 0, len(quantTypes))
	for n := range quantTypes {
		names = append(names, n)
	}
	slices.Sort(names)
	return names
}

// Quantize writes the GGUF model at in to out with its weight matrices in typ (one of
// QuantTypes, case-insensitive), as llama.cpp's llama-quantize does without an
// importance matrix; norms and other 1-d tensors stay as they are. Matrices whose
// rows do not fit typ's blocks get llama.cpp's fallback type. threads 0 uses every
// core. out is written in place of any file there, once whole; on failure what was
// at out stays.
// It holds no engine and may run beside one.
func Quantize(in, out, typ string, threads int) error {
	ftype, ok := quantTypes[strings.ToLower(typ)]
	if !ok {
		return fmt.Errorf("llama: quantize: unknown type %q (want one of %s)", typ, strings.Join(QuantTypes(), ", "))
	}
	fi, err := os.Stat(in)
	if err != nil {
		return fmt.Errorf("llama: quantize: %w", err)
	}
	// The input is mapped while the output is written: one file under two
	// names (./m.gguf, a link) would be truncated under the mapping.
	fo, outErr := os.Stat(out) // through a link, where it points
	if in == out || outErr == nil && os.SameFile(fi, fo) {
		return errors.New("llama: quantize: the output must be another file than the input")
	}
	// Written beside out (through a link, where it points) and renamed over
	// it once whole: a failure leaves whatever was at out as it was, and an
	// interrupted run its .part, which the next overwrites.
	if real, err := filepath.EvalSymlinks(out); err == nil {
		out = real
	}
	mode := os.FileMode(0o666) // less the umask, as llama-quantize's file
	if outErr == nil {
		mode = fo.Mode().Perm()
	}
	part := out + ".part"
	if fp, err := os.Stat(part); err == nil && os.SameFile(fi, fp) {
		return fmt.Errorf("llama: quantize: %s is written on the way to %s: quantize another file", part, out)
	}
	f, err := os.OpenFile(part, os.O_CREATE|os.O_TRUNC|os.O_WRONLY, mode)
	if err != nil {
		return fmt.Errorf("llama: quantize: %w", err)
	}
	f.Close()
	defer os.Remove(part) // after the rename, nothing there
	initBackend()
	p := C.llama_model_quantize_default_params()
	p.nthread = C.int32_t(threads)
	p.ftype = ftype
	cin, cout := C.CString(in), C.CString(part)
	defer C.free(unsafe.Pointer(cin))
	defer C.free(unsafe.Pointer(cout))
	var rc C.uint32_t
	failed := llamaErrors(func() { rc = C.llama_model_quantize(cin, cout, &p) })
	if rc != 0 {
		return fmt.Errorf("llama: quantize %s to %s: %s", in, typ, cmp.Or(failed, "llama.cpp refused it"))
	}
	if err := os.Rename(part, out); err != nil {
		return fmt.Errorf("llama: quantize: %w", err)
	}
	return nil
}
