// Package models owns model files: locating and opening GGUF files, reading their
// metadata, chat templates, and generating llama-architecture test models with seeded
// random weights. It imports nothing of shoal's and never links llama.cpp.
package models
