# shoal's build. `make build` compiles llama.cpp through the pinned ollama module the
# first time (10-15 minutes on 2 cores; Go's build cache makes later builds quick).
SHELL := bash
.SHELLFLAGS := -eu -o pipefail -c
GO ?= go
VERSION ?= $(shell git describe --tags --always --dirty 2>/dev/null || echo dev)
LDFLAGS := -X main.version=$(VERSION)
# Packages that never link llama.cpp: tested under -race without compiling it.
PURE_PKGS := . ./engine ./engine/sample ./engine/enginetest ./engine/sim ./kvcache ./scheduler ./cluster ./api ./models
CGO_PKGS := ./engine/llama ./cmd/...
CGO_ENV = eval "$$(bash scripts/cgo-env.sh)"
STAMP_DIR := $(HOME)/.cache/shoal
MODEL ?=
# GPU=cuda also builds ggml's CUDA backend into lib/ollama (scripts/build-cuda.sh;
# CUDA_ARCHS picks the architectures). The binary is the same either way.
GPU ?=
BENCHTIME ?= 1x
COUNT ?= 3

.PHONY: all build test test-pure test-engine bench-engine bench-quant bench-scheduler bench-cache bench-template bench-stream bench-score bench-sample bench-spec bench-lora bench-tokenize bench-rerank bench-vision run lint fmt clean gpu-check-inputs ollama-cli-check

all: build

build:
	@$(CGO_ENV); stamp="$(STAMP_DIR)/llama-built-$$(echo "$$CGO_CFLAGS $$CGO_CPPFLAGS $$($(GO) env GOVERSION)" | cksum | cut -d' ' -f1)"; \
	if [ ! -f "$$stamp" ]; then echo "shoal: compiling llama.cpp for $${CGO_CFLAGS} (first build: about 10-15 minutes on 2 cores; later builds reuse Go's build cache)"; fi; \
	$(GO) build -ldflags '$(LDFLAGS)' -o bin/shoal ./cmd/shoal; \
	mkdir -p "$(STAMP_DIR)"; touch "$$stamp"
	@echo "built bin/shoal"
ifeq ($(GPU),cuda)
	@bash scripts/build-cuda.sh
else ifneq ($(GPU),)
	@echo "GPU=$(GPU): only GPU=cuda is supported" >&2; exit 2
endif

# Everything scripts/gpu-check.sh needs on a GPU machine without Go or network, in
# gpu-check/ (under 64 MiB), built for x86-64-v3 rather than this machine's CPU.
gpu-check-inputs:
	@bash scripts/gpu-check-prepare.sh

test: test-pure lint test-engine

test-pure:
	@bash scripts/test-deps.sh
	CGO_ENABLED=1 $(GO) test -race -count=1 $(PURE_PKGS)

# -p 1: llama.cpp's compute threads spin-wait; two packages decoding at once on a
# small machine oversubscribe the cores and slow both by orders of magnitude.
test-engine: build
	@$(CGO_ENV); $(GO) test -p 1 -count=1 -timeout 30m $(CGO_PKGS)

# Raw decode/prefill ceiling of the engine (see docs/benchmarks.md).
bench-engine: build
	@$(CGO_ENV); $(GO) test -run '^$$' -bench 'Benchmark(Decode|Prefill)' -benchtime $(BENCHTIME) -count $(COUNT) -timeout 60m ./engine/llama | tee bench-engine.txt

# The 100M model's weight types side by side: f16, q8_0, q4_k_m (docs/benchmarks.md).
bench-quant: build
	@$(CGO_ENV); $(GO) test -run '^$$' -bench 'BenchmarkQuantized' -benchtime $(BENCHTIME) -count $(COUNT) -timeout 60m ./engine/llama | tee bench-quant.txt

# Scheduler throughput vs. the ceiling, and the shared-prefix workload (docs/benchmarks.md).
bench-scheduler: build
	@$(CGO_ENV); $(GO) test -run '^$$' -bench 'BenchmarkScheduler(Decode|Sampling|SharedPrefix)' -benchtime $(BENCHTIME) -count $(COUNT) -timeout 120m ./engine/llama | tee bench-scheduler.txt

# Laying out a chat: the model's Jinja template beside llama.cpp's built-in formatter, and checking a grammar (docs/benchmarks.md).
bench-template: build
	@$(CGO_ENV); { $(GO) test -run '^$$' -bench 'BenchmarkChatPrompt' -benchtime $(BENCHTIME) -count $(COUNT) ./api; \
		$(GO) test -run '^$$' -bench 'Benchmark(ApplyChatTemplate|CheckGrammar)' -benchtime $(BENCHTIME) -count $(COUNT) ./engine/llama; } | tee bench-template.txt

# Streaming a tool call as it is written, beside reading it all again per token (docs/benchmarks.md).
bench-stream:
	$(GO) test -run '^$$' -bench 'BenchmarkStreamedCall' -benchtime $(BENCHTIME) -count $(COUNT) ./api | tee bench-stream.txt

# A prompt computed as is beside scored (prompt logprobs), and scoring one token in Go (docs/benchmarks.md).
bench-score: build
	@$(CGO_ENV); { $(GO) test -run '^$$' -bench 'BenchmarkSchedulerPromptScore' -benchtime $(BENCHTIME) -count $(COUNT) -timeout 30m ./engine/llama; \
		$(GO) test -run '^$$' -bench 'BenchmarkScore' -benchtime $(BENCHTIME) -count $(COUNT) ./engine/sample; } | tee bench-score.txt

# The Go sampler: one draw, and llama-server's samplers beside the usual ones (docs/benchmarks.md).
bench-sample:
	$(GO) test -run '^$$' -bench 'BenchmarkSample$$|BenchmarkLlamaSamplers|BenchmarkDRY' -count $(COUNT) ./engine/sample | tee bench-sample.txt

# Speculative decoding by n-gram lookup, off and on, side by side (docs/benchmarks.md).
bench-spec: build
	@$(CGO_ENV); $(GO) test -run '^$$' -bench 'BenchmarkSchedulerSpeculative' -benchtime $(BENCHTIME) -count $(COUNT) -timeout 60m ./engine/llama | tee bench-spec.txt

# LoRA adapters: what a selectable adapter costs a decode step (docs/benchmarks.md).
bench-lora: build
	@$(CGO_ENV); $(GO) test -run '^$$' -bench 'BenchmarkAdapters' -benchtime $(BENCHTIME) -count $(COUNT) -timeout 30m ./engine/llama | tee bench-lora.txt

# Tokenizing a chat of many turns in one llama.cpp call and cut where its partition allows (docs/benchmarks.md).
bench-tokenize: build
	@$(CGO_ENV); $(GO) test -run '^$$' -bench 'BenchmarkTokenizeChat' -benchtime $(BENCHTIME) -count $(COUNT) -timeout 30m ./engine/llama | tee bench-tokenize.txt

# A rerank request's pairs with the query's prefix computed for each and once (docs/benchmarks.md).
bench-rerank: build
	@$(CGO_ENV); $(GO) test -run '^$$' -bench 'BenchmarkSchedulerRerank' -benchtime $(BENCHTIME) -count $(COUNT) -timeout 30m ./engine/llama | tee bench-rerank.txt

# Chats about pictures, turn after turn, with and without the prefix cache (docs/benchmarks.md).
bench-vision: build
	@$(CGO_ENV); $(GO) test -run '^$$' -bench 'BenchmarkSchedulerImages' -benchtime $(BENCHTIME) -count $(COUNT) -timeout 30m ./engine/llama | tee bench-vision.txt

# A one-pool node's cache budget: no reuse (a filling cache) and chats (docs/benchmarks.md).
bench-cache: build
	@$(CGO_ENV); $(GO) test -run '^$$' -bench 'BenchmarkScheduler(CacheFill|Conversations)' -benchtime $(BENCHTIME) -count $(COUNT) -timeout 60m ./engine/llama | tee bench-cache.txt

# Ollama's own CLI (built from the pinned ollama module) against a node: README, "Ollama's API".
ollama-cli-check: build
	bash scripts/ollama-cli-check.sh

run: build
	@if [ -z "$(MODEL)" ]; then \
		echo "make run needs a model: make run MODEL=path/to/model.gguf"; \
		echo "No GGUF at hand? Generate a small test model (random weights, writes nonsense):"; \
		echo "  bin/shoal gen-model --preset small --out /tmp/small.gguf && make run MODEL=/tmp/small.gguf"; \
		exit 2; \
	fi
	bin/shoal serve --model "$(MODEL)" $(ARGS)

lint:
	@# Not tee /dev/stderr: where stderr is a file (a CI log), that reopens and truncates it.
	@unformatted=$$(gofmt -l .); if [ -n "$$unformatted" ]; then echo "$$unformatted" >&2; echo "gofmt: files above need formatting" >&2; exit 1; fi
	@$(CGO_ENV); $(GO) vet ./...

fmt:
	gofmt -w .

clean:
	rm -rf bin lib build gpu-check
