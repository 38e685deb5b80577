// Package scheduler will own the continuous-batching loop: one goroutine that owns
// the engine, the kvcache pool and every sequence, admits waiting requests within a
// token budget, builds one batch per step (a decode row per running sequence plus
// chunked prefill), samples, applies stop conditions, detokenizes and streams events
// to requests without ever blocking on a slow reader. It imports engine and kvcache.
package scheduler
