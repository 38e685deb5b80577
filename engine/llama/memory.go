package llama

/*
#include "llama.h"
*/
import "C"

import (
	"fmt"

	"github.com/shoal-ai/shoal/engine"
)

func (e *Engine) checkSeq(s engine.SeqID) error {
	if s < 0 || int(s) >= e.cap.MaxSeqs {
		return fmt.Errorf("sequence %d outside [0,%d): %w", s, e.cap.MaxSeqs, engine.ErrInvalidInput)
	}
	return nil
}

func (e *Engine) memOK() error {
	if e.closed.Load() {
		return engine.ErrClosed
	}
	if e.mem == nil {
		return fmt.Errorf("model has no KV memory: %w", engine.ErrUnsupported)
	}
	return nil
}

// SeqRemove drops positions [p0, p1) of s (all sequences when s < 0).
func (e *Engine) SeqRemove(s engine.SeqID, p0, p1 engine.Pos) error {
	if err := e.memOK(); err != nil {
		return fmt.Errorf("seq remove: %w", err)
	}
	if s >= 0 {
		if err := e.checkSeq(s); err != nil {
			return fmt.Errorf("seq remove: %w", err)
		}
	} else {
		s = -1 // "all": llama.cpp asserts on any other negative id
	}
	if !C.llama_memory_seq_rm(e.mem, C.llama_seq_id(s), C.llama_pos(p0), C.llama_pos(p1)) {
		// Only recurrent memory refuses, when asked to cut a sequence in the middle.
		return fmt.Errorf("seq remove %d [%d,%d): partial removal: %w", s, p0, p1, engine.ErrUnsupported)
	}
	return nil
}

// SeqCopy makes [p0, p1) of src visible to dst. In a unified pool this shares cells.
// Without one, llama.cpp can only copy a whole stream and aborts the process on a
// partial range, so that is refused here.
func (e *Engine) SeqCopy(src, dst engine.SeqID, p0, p1 engine.Pos) error {
	if err := e.memOK(); err != nil {
		return fmt.Errorf("seq copy: %w", err)
	}
	if err := e.checkSeq(src); err != nil {
		return fmt.Errorf("seq copy: %w", err)
	}
	if err := e.checkSeq(dst); err != nil {
		return fmt.Errorf("seq copy: %w", err)
	}
	if !e.cap.Unified && (p0 > 0 || p1 >= 0) {
		return fmt.Errorf("seq copy %d->%d [%d,%d): split KV streams copy only whole sequences: %w", src, dst, p0, p1, engine.ErrUnsupported)
	}
	C.llama_memory_seq_cp(e.mem, C.llama_seq_id(src), C.llama_seq_id(dst), C.llama_pos(p0), C.llama_pos(p1))
	return nil
}

// SeqKeep removes every sequence but s.
func (e *Engine) SeqKeep(s engine.SeqID) error {
	if err := e.memOK(); err != nil {
		return fmt.Errorf("seq keep: %w", err)
	}
	if err := e.checkSeq(s); err != nil {
		return fmt.Errorf("seq keep: %w", err)
	}
	C.llama_memory_seq_keep(e.mem, C.llama_seq_id(s))
	return nil
}

// SeqShift adds delta to the positions [p0, p1) of s.
func (e *Engine) SeqShift(s engine.SeqID, p0, p1, delta engine.Pos) error {
	if err := e.memOK(); err != nil {
		return fmt.Errorf("seq shift: %w", err)
	}
	if err := e.checkSeq(s); err != nil {
		return fmt.Errorf("seq shift: %w", err)
	}
	if !C.llama_memory_can_shift(e.mem) {
		return fmt.Errorf("seq shift: %w", engine.ErrUnsupported)
	}
	// Multi-axis RoPE (vision-language models) positions cannot be shifted:
	// llama.cpp asserts instead of refusing.
	if rt := C.llama_model_rope_type(e.model); rt == C.LLAMA_ROPE_TYPE_MROPE || rt == C.LLAMA_ROPE_TYPE_IMROPE {
		return fmt.Errorf("seq shift: multi-axis RoPE: %w", engine.ErrUnsupported)
	}
	C.llama_memory_seq_add(e.mem, C.llama_seq_id(s), C.llama_pos(p0), C.llama_pos(p1), C.llama_pos(delta))
	return nil
}

// SeqPosRange returns the smallest and largest position held by s.
func (e *Engine) SeqPosRange(s engine.SeqID) (lo, hi engine.Pos, ok bool) {
	if e.memOK() != nil || e.checkSeq(s) != nil {
		return 0, 0, false
	}
	lo = engine.Pos(C.llama_memory_seq_pos_min(e.mem, C.llama_seq_id(s)))
	hi = engine.Pos(C.llama_memory_seq_pos_max(e.mem, C.llama_seq_id(s)))
	return lo, hi, lo >= 0
}

// ClearMemory empties the KV memory.
func (e *Engine) ClearMemory() error {
	if err := e.memOK(); err != nil {
		return fmt.Errorf("clear memory: %w", err)
	}
	C.llama_memory_clear(e.mem, true)
	return nil
}
