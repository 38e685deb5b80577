// Package kvcache is shoal's paged accounting of the engine's KV cells, so that the
// scheduler never over-commits memory and shares the cells of common prompt prefixes.
//
// The engine's cell pool is divided into fixed-size blocks (BlockTokens positions).
// A full block is identified by a hash chain, h_i = H(seed, model, h_{i-1}, tokens of
// block i), so equal hashes mean equal prefixes. Running sequences reference blocks
// (reference counts); when a sequence ends, its full blocks stay cached under its
// sequence id, which becomes a holder. A new sequence takes the longest cached prefix
// by copying block ranges from their holders (llama.cpp's seq_cp, which only shares
// cells in a unified pool) and computes the rest. Unreferenced cached blocks are
// evicted least recently used, leaves first, blocks no later sequence reused before
// those that were, by trimming the holder sequence, so every eviction is a physical
// removal the scheduler applies to the engine.
//
// In one pool every decoded token attends over the cells up to the highest in use, so
// a cached block costs every step something until it is hit. Pool therefore keeps
// unreferenced blocks within a budget: Config.CacheFloor of the pool at least, more
// after a prompt misses blocks evicted recently (the pool remembers the hashes of as
// many evicted blocks as it has blocks) and as cached blocks are reused for the first
// time, less again as blocks nobody reused are evicted. SplitPool has no such cost (a stream attends over its own cells).
//
// Every method that changes the pool returns the engine operations (Ops) that make
// llama.cpp's cells match the accounting; the caller applies them in order before its
// next decode. Accounting is conservative: a partially filled block reserves a whole
// block, so the engine never needs more cells than the pool has handed out.
//
// Concurrency: a Pool is owned by one goroutine (the scheduler) and is not safe for
// concurrent use, except Stats and Summary, which read an immutable snapshot and may
// be called from any goroutine.
//
// It imports nothing of shoal's.
package kvcache
