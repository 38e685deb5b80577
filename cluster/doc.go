// Package cluster will own membership (hashicorp/memberlist), gossip of node
// metadata, load and prefix-cache summaries, routing (filter, score, pick) and
// one-hop forwarding between nodes. It imports kvcache for hash and summary types.
package cluster
