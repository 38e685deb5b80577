// Package kvcache will own paged accounting of the engine's KV cells: fixed-size
// blocks, hash chains that identify full prompt blocks, reference counts, the prefix
// index, LRU eviction of cached blocks by trimming holder sequences, and the compact
// summary of resident prefixes that nodes gossip. It imports nothing of shoal's.
package kvcache
