// Package scheduler is shoal's continuous-batching loop.
//
// One goroutine (Run) owns the engine, the kvcache pool and every sequence. HTTP
// handlers call Submit, which validates the request, puts it in a bounded inbox and
// returns a Stream; they never touch engine state. Each step the loop
//
//  1. takes new requests into the waiting queue (lower priority value first, as
//     vLLM orders them; FIFO within a priority) and drops cancelled or expired ones, waiting or running, freeing
//     their KV blocks at once;
//  2. builds one batch within the token budget: a decode row for every running
//     sequence, then chunks of pending prefills, then newly admitted requests (which
//     take their cached prefix first and must fit prompt + max_tokens in free and
//     evictable KV blocks, or prompt + 256 tokens when no max_tokens limits them,
//     growing from there; one whose prompt starts with a prefix a running sequence
//     is still computing waits until it is cached, so a burst with one new prefix
//     computes it once);
//  3. decodes, samples each output row with that request's parameters, applies stop
//     conditions, detokenizes incrementally and appends events to each Stream, which
//     buffers without limit so a slow reader never blocks the loop;
//  4. when KV blocks run out, preempts the lowest-priority, most recent sequence by
//     recompute: its blocks go back to the cache, kept past the cache budget
//     (kvcache Suspend), and it waits to resume from what is still cached of them;
//  5. publishes an immutable Load snapshot (atomic pointer) for metrics and gossip.
//
// It imports engine, engine/sample and kvcache.
package scheduler
