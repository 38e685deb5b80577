package llama

import (
	"bufio"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"os"
)

// checkGGUF walks the header and metadata of a GGUF file before llama.cpp sees it.
// llama.cpp's reader rejects most malformed files with an error but aborts the
// process on a few (an empty metadata key is an assertion), so those are refused here
// first. It is plain Go and is fuzzed on its own and together with the real loader.
// It also returns what the engine needs to know of the file that llama.h does not say.
func checkGGUF(path string) (ggufFacts, error) {
	f, err := os.Open(path)
	if err != nil {
		return ggufFacts{}, fmt.Errorf("model file: %w", err)
	}
	defer f.Close()
	st, err := f.Stat()
	if err != nil {
		return ggufFacts{}, fmt.Errorf("model file: %w", err)
	}
	if st.IsDir() {
		return ggufFacts{}, fmt.Errorf("model file %s is a directory", path)
	}
	facts, err := checkGGUFReader(bufio.NewReaderSize(f, 1<<16), st.Size())
	if err != nil {
		return facts, fmt.Errorf("model file %s: %w", path, err)
	}
	return facts, nil
}

// ggufFacts is what the tensor list of a GGUF says.
type ggufFacts struct {
	// RankHead: the model has a classification head (cls.weight or
	// cls.output.weight), which rank pooling turns into a reranker's scores.
	RankHead bool
	// Split: the file is the first of several (gguf-split's split.count above
	// 1), whose tensors it does not all list.
	Split bool
}

// ggmlMaxDims is GGML_MAX_DIMS: a tensor info holds at most this many sizes.
const ggmlMaxDims = 4

// scanTensors reads the tensor infos that follow the metadata, as far as they
// are well formed (llama.cpp reports the rest).
func scanTensors(cr *countingReader, n int64) ggufFacts {
	var facts ggufFacts
	for range n {
		name, err := cr.str()
		var dims uint32
		if err != nil || cr.read(&dims) != nil || dims > ggmlMaxDims || cr.skip(int64(dims)*8+4+8) != nil {
			break // sizes, then the type and the offset
		}
		if name == "cls.weight" || name == "cls.output.weight" {
			facts.RankHead = true
		}
	}
	return facts
}

// GGUF value types.
const (
	ggufUint8 = iota
	ggufInt8
	ggufUint16
	ggufInt16
	ggufUint32
	ggufInt32
	ggufFloat32
	ggufBool
	ggufString
	ggufArray
	ggufUint64
	ggufInt64
	ggufFloat64
)

var ggufSize = map[uint32]int64{
	ggufUint8: 1, ggufInt8: 1, ggufBool: 1, ggufUint16: 2, ggufInt16: 2,
	ggufUint32: 4, ggufInt32: 4, ggufFloat32: 4, ggufUint64: 8, ggufInt64: 8, ggufFloat64: 8,
}

var errNotGGUF = errors.New("not a GGUF file (bad magic)")

func checkGGUFReader(r io.Reader, size int64) (ggufFacts, error) {
	var none ggufFacts
	cr := &countingReader{r: r, left: size}
	var magic [4]byte
	if _, err := io.ReadFull(cr, magic[:]); err != nil || string(magic[:]) != "GGUF" {
		return none, errNotGGUF
	}
	var version uint32
	var nTensors, nKV int64
	if err := cr.read(&version, &nTensors, &nKV); err != nil {
		return none, fmt.Errorf("header: %w", err)
	}
	if version < 2 || version > 3 {
		return none, fmt.Errorf("GGUF version %d (llama.cpp reads 2 and 3)", version)
	}
	if nTensors < 0 || nKV < 0 || nKV > size || nTensors > size {
		return none, fmt.Errorf("header claims %d tensors and %d metadata keys in %d bytes", nTensors, nKV, size)
	}
	kinds := map[string]ggufKind{}
	strs := map[string]string{}
	u32 := map[string]uint32{}
	for i := range nKV {
		key, err := cr.str()
		if err != nil {
			return none, fmt.Errorf("metadata key %d: %w", i, err)
		}
		if key == "" {
			return none, fmt.Errorf("metadata key %d is empty", i)
		}
		var typ uint32
		if err := cr.read(&typ); err != nil {
			return none, fmt.Errorf("metadata %q: %w", key, err)
		}
		n := uint64(1)
		array := typ == ggufArray
		if array {
			if err := cr.read(&typ, &n); err != nil {
				return none, fmt.Errorf("metadata %q: %w", key, err)
			}
		}
		kinds[key] = ggufKind{typ: typ, array: array, n: n}

		if typ == ggufString {
			// llama.cpp maps token texts to ids and asserts that none repeats
			// (an empty one is named "[EMPTY_<id>]").
			var seen map[string]uint64
			if array && key == "tokenizer.ggml.tokens" {
				seen = map[string]uint64{}
			}
			for j := uint64(0); j < n; j++ {
				v, err := cr.str()
				if err != nil {
					return none, fmt.Errorf("metadata %q element %d: %w", key, j, err)
				}
				if !array {
					strs[key] = v
				}
				if seen != nil {
					if v == "" {
						v = fmt.Sprintf("[EMPTY_%d]", j)
					}
					if k, dup := seen[v]; dup {
						return none, fmt.Errorf("token %d's text %q is token %d's too (llama.cpp aborts on it)", j, v, k)
					}
					seen[v] = j
				}
			}
			continue
		}
		if key == "split.count" && typ == ggufUint16 && !array { // gguf-split writes it so
			var v uint16
			if err := cr.read(&v); err != nil {
				return none, fmt.Errorf("metadata %q: %w", key, err)
			}
			u32[key] = uint32(v)
			continue
		}
		if typ == ggufUint32 && !array {
			var v uint32
			if err := cr.read(&v); err != nil {
				return none, fmt.Errorf("metadata %q: %w", key, err)
			}
			u32[key] = v
			continue
		}
		sz, ok := ggufSize[typ]
		if !ok {
			return none, fmt.Errorf("metadata %q has unknown type %d", key, typ)
		}
		if n > uint64(cr.left)/uint64(sz) {
			return none, fmt.Errorf("metadata %q: %d values do not fit the file", key, n)
		}
		if err := cr.skip(int64(n) * sz); err != nil {
			return none, fmt.Errorf("metadata %q: %w", key, err)
		}
	}
	if err := checkKinds(kinds); err != nil {
		return none, err
	}
	// ggml's buffers need tensor data aligned to 32 bytes and assert it.
	if a, ok := u32["general.alignment"]; ok && (a == 0 || a%32 != 0 || a&(a-1) != 0) {
		return none, fmt.Errorf("alignment %d is not a power of two multiple of 32", a)
	}
	if err := checkHeads(strs["general.architecture"], u32); err != nil {
		return none, err
	}
	facts := scanTensors(cr, nTensors)
	facts.Split = u32["split.count"] > 1
	return facts, nil
}

// maxLayers is llama.cpp's LLAMA_MAX_LAYERS.
const maxLayers = 512

// recurrentArchs are the architectures without attention layers, whose GGUFs
// carry attention.head_count = 0.
var recurrentArchs = map[string]bool{"mamba": true, "mamba2": true, "rwkv6": true, "rwkv6qwen2": true, "rwkv7": true, "arwkv7": true}

// checkHeads rejects attention shapes that ggml's graph code asserts on instead of
// reporting: heads must divide the embedding, and KV heads the heads.
func checkHeads(arch string, u32 map[string]uint32) error {
	e, hasE := u32[arch+".embedding_length"]
	h, hasH := u32[arch+".attention.head_count"]
	kv, hasKV := u32[arch+".attention.head_count_kv"]
	_, hasKeyLen := u32[arch+".attention.key_length"] // explicit head size: no divisibility rule
	if n, ok := u32[arch+".block_count"]; ok && (n == 0 || n > maxLayers) {
		return fmt.Errorf("block count %d outside [1, %d]", n, maxLayers)
	}
	switch {
	case !hasE || !hasH || hasKeyLen:
		return nil
	case h == 0 && recurrentArchs[arch]:
		return nil // no attention: Mamba and RWKV write a head count of 0
	case h == 0 || e%h != 0:
		return fmt.Errorf("%d attention heads do not divide the embedding of %d", h, e)
	case hasKV && (kv == 0 || h%kv != 0):
		return fmt.Errorf("%d KV heads do not divide %d attention heads", kv, h)
	}
	return nil
}

type ggufKind struct {
	typ   uint32
	array bool
	n     uint64
}

// checkKinds enforces the types of the keys that llama.cpp reads with asserting or
// unchecked accessors (it reads other keys through type-checked getters).
func checkKinds(k map[string]ggufKind) error {
	scalar := map[string]uint32{"general.alignment": ggufUint32, "split.no": ggufUint16}
	for key, typ := range scalar {
		if v, ok := k[key]; ok && (v.array || v.typ != typ) {
			return fmt.Errorf("metadata %q has the wrong type", key)
		}
	}
	tokens, ok := k["tokenizer.ggml.tokens"]
	if ok && (!tokens.array || tokens.typ != ggufString) {
		return errors.New(`metadata "tokenizer.ggml.tokens" must be an array of strings`)
	}
	// Scores and token types are read as raw float/int arrays indexed by token id.
	for key, typ := range map[string]uint32{"tokenizer.ggml.scores": ggufFloat32, "tokenizer.ggml.token_type": ggufInt32} {
		if v, has := k[key]; has && (!v.array || v.typ != typ || v.n < tokens.n) {
			return fmt.Errorf("metadata %q must be an array of %d values of type %d", key, tokens.n, typ)
		}
	}
	if v, has := k["tokenizer.ggml.merges"]; has && (!v.array || v.typ != ggufString) {
		return errors.New(`metadata "tokenizer.ggml.merges" must be an array of strings`)
	}
	if v, has := k["tokenizer.ggml.precompiled_charsmap"]; has && (!v.array || v.typ == ggufString) {
		return errors.New(`metadata "tokenizer.ggml.precompiled_charsmap" must be a byte array`)
	}
	return nil
}

type countingReader struct {
	r    io.Reader
	left int64
}

var errTruncated = errors.New("truncated")

func (c *countingReader) Read(p []byte) (int, error) {
	if int64(len(p)) > c.left {
		p = p[:c.left]
	}
	if len(p) == 0 {
		return 0, io.EOF
	}
	n, err := c.r.Read(p)
	c.left -= int64(n)
	return n, err
}

func (c *countingReader) read(vs ...any) error {
	for _, v := range vs {
		if err := binary.Read(c, binary.LittleEndian, v); err != nil {
			return errTruncated
		}
	}
	return nil
}

func (c *countingReader) skip(n int64) error {
	if n > c.left {
		return errTruncated
	}
	if _, err := io.CopyN(io.Discard, c, n); err != nil {
		return errTruncated
	}
	return nil
}

func (c *countingReader) str() (string, error) {
	var n uint64
	if err := c.read(&n); err != nil {
		return "", err
	}
	if n > uint64(c.left) {
		return "", fmt.Errorf("string of %d bytes: %w", n, errTruncated)
	}
	if n > 1<<16 { // values may be long (chat templates); skip without keeping
		return "\x00long", c.skip(int64(n))
	}
	b := make([]byte, n)
	if _, err := io.ReadFull(c, b); err != nil {
		return "", errTruncated
	}
	return string(b), nil
}
