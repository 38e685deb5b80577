#!/usr/bin/env bash
# gpu-check-prepare.sh [DIR]: packs what scripts/gpu-check.sh needs on a GPU machine
# that has nvcc and CMake but no Go toolchain and no network, into DIR (default
# gpu-check/, ignored by git; under 64 MiB): the shoal binary and the engine's test
# binary (xz), the sources of the pinned ollama module that build ggml's CUDA backend,
# stories260K when ../shared has it, and the two scripts. The ~100M model is not
# copied (220 MB): the shoal binary generates the same model there (seeded).
# Both binaries are built PORTABLE=1 (x86-64-v3 CPU kernels, not this machine's
# -march=native): the GPU machine's CPU is unknown, and an instruction it lacks would
# end the run with SIGILL. The first pack compiles llama.cpp once more for that target.
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-gpu-check}
version=$(git describe --tags --always --dirty 2>/dev/null || echo dev)
eval "$(PORTABLE=1 bash scripts/cgo-env.sh)"
rm -rf "$out"
mkdir -p "$out"
# A module of its own, so that the Go sources a CPU rehearsal unpacks under
# $out/work are not packages of shoal's (go list ./..., TestImportDirections).
printf 'module gpucheck\n' >"$out/go.mod"
echo "gpu-check-prepare: building for $CGO_CFLAGS (the first time compiles llama.cpp: 10-15 minutes on 2 cores)" >&2
go build -ldflags "-X main.version=$version" -o "$out/shoal" ./cmd/shoal
go test -c -o "$out/llama.test" ./engine/llama
xz -T0 -6 "$out/shoal"
xz -T0 -6 "$out/llama.test"
src=$(go list -m -f '{{.Dir}}' github.com/ollama/ollama)
# The root CMakeLists and ggml; Metal and Vulkan sources are not needed for CUDA.
tar -C "$src" --exclude='ggml-metal' --exclude='ggml-vulkan' -cJf "$out/ollama-src.tar.xz" \
	CMakeLists.txt CMakePresets.json ml/backend/ggml/ggml
if [ -f ../shared/models/stories260K.gguf ]; then
	cp ../shared/models/stories260K.gguf "$out/"
else
	echo "gpu-check-prepare: ../shared/models/stories260K.gguf not present; the GPU run will skip it" >&2
fi
cp scripts/gpu-check.sh scripts/build-cuda.sh "$out/"
# What the binaries were built from: gpu-check prints it, so a stale pack shows.
echo "$version" >"$out/VERSION"
du -ch "$out"/* | tail -1 | awk '{print "gpu-check-prepare: " $1 " in '"$out"'/"}'
