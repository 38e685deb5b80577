// Package shoal is the root of the shoal module: one binary (cmd/shoal) that serves
// GGUF language models on every machine it is started on and routes each request to
// the node where it will be answered soonest. This package holds only repository-wide
// tests, such as the check that packages import each other only as DESIGN allows.
package shoal
