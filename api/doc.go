// Package api will own the HTTP surface: gin handlers for the OpenAI-compatible
// endpoints, wire types, SSE streaming, the mapping of errors to HTTP status, auth,
// and /metrics. It imports scheduler, cluster, models and engine, never engine/llama.
package api
