// Package cluster makes shoal nodes one service: membership and failure detection
// with hashicorp/memberlist, gossip of each node's metadata (HTTP address, models,
// capacity, draining), load (queue, running, KV use, token rates, queue-wait
// estimate) and prefix-cache summaries (kvcache block hashes), and routing: filter
// (serves the model, alive, not draining, not saturated) → score → pick, with
// one-hop forwarding authenticated by an HMAC of a cluster secret.
//
// Concurrency: memberlist calls the delegates from its own goroutines; all shared
// state is behind Node's mutex or in atomic snapshots, and every exported method is
// safe for concurrent use.
//
// It imports kvcache (hash and summary types) and nothing else of shoal's.
package cluster
