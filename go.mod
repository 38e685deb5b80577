module github.com/shoal-ai/shoal

go 1.26.8

require (
	github.com/gen2brain/malgo v0.11.24
	github.com/ollama/ollama v0.24.0
	github.com/x448/float16 v0.8.4
)

require golang.org/x/sync v0.17.0 // indirect
