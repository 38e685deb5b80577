package kvcache

import (
	"crypto/sha256"
	"encoding/binary"
)

// Hash identifies a full block together with everything before it.
type Hash uint64

// Hasher computes block hash chains. Every node of a cluster that uses the same seed
// and model id computes the same hashes for the same tokens.
type Hasher struct {
	seed  uint64
	model string
}

// NewHasher returns a Hasher for one model.
func NewHasher(seed uint64, model string) Hasher { return Hasher{seed: seed, model: model} }

// For is the hasher of another model's blocks, under the same seed: "" is
// h's own; another id names a LoRA adapter, whose blocks hold other KV and
// hash apart, as a cluster's router hashes requests for it.
func (h Hasher) For(model string) Hasher {
	if model == "" {
		return h
	}
	return NewHasher(h.seed, model)
}

// Block returns the hash of a block of tokens whose predecessor hashed to parent
// (0 for the first block).
func (h Hasher) Block(parent Hash, tokens []int32) Hash {
	d := sha256.New()
	var buf [8]byte
	binary.LittleEndian.PutUint64(buf[:], h.seed)
	d.Write(buf[:])
	binary.LittleEndian.PutUint64(buf[:], uint64(len(h.model)))
	d.Write(buf[:])
	d.Write([]byte(h.model))
	binary.LittleEndian.PutUint64(buf[:], uint64(parent))
	d.Write(buf[:])
	for _, t := range tokens {
		binary.LittleEndian.PutUint32(buf[:4], uint32(t))
		d.Write(buf[:4])
	}
	var sum [sha256.Size]byte
	return Hash(binary.LittleEndian.Uint64(d.Sum(sum[:0])))
}

// Chain returns the hashes of every full block of tokens.
func (h Hasher) Chain(tokens []int32, blockTokens int) []Hash {
	n := len(tokens) / blockTokens
	out := make([]Hash, n)
	var parent Hash
	for i := range n {
		parent = h.Block(parent, tokens[i*blockTokens:(i+1)*blockTokens])
		out[i] = parent
	}
	return out
}
