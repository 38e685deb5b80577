// Package api is shoal's HTTP surface: gin handlers for the OpenAI-compatible
// endpoints (/v1/chat/completions, /v1/completions, /v1/models, /v1/embeddings),
// /tokenize, /detokenize, /health, /ready and /metrics; OpenAI wire types; SSE
// streaming; API keys; and the one function that maps errors to HTTP status codes.
//
// Handlers never touch engine state: they tokenize through engine.Vocab (safe for
// concurrent use), submit to the scheduler and read its Stream, which never blocks
// the scheduler. A client that goes away cancels its request through the request
// context. It imports scheduler, engine and engine/sample, never engine/llama.
package api
