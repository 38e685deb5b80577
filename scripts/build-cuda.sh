#!/usr/bin/env bash
# build-cuda.sh [SRC] [DEST]: builds ggml's CUDA backend library with CMake from the
# sources of the pinned github.com/ollama/ollama module (SRC: its directory; default:
# the module in Go's module cache) and installs it, with the ggml-base library it
# links to, into DEST (default lib/ollama beside bin/), where llama.BackendInit loads
# GPU backends from (<dir of the executable>/../lib/ollama). The shoal binary itself
# is unchanged: without the library it runs on the CPU.
#
# CUDA_ARCHS: CMake CUDA architectures, e.g. "90" or "80;86;89;90". Default: the
# compute capability of the GPU present (nvidia-smi), else 75;80;86;89;90 (T4,
# A100/A30, A10/RTX 30, L4/RTX 40, H100/H200).
# BUILD_DIR (default build/cuda) keeps CMake's objects for quick rebuilds.
set -euo pipefail
cd "$(dirname "$0")/.."
src=${1:-}
dest=${2:-lib/ollama}
build=${BUILD_DIR:-build/cuda}

need() { echo "build-cuda: $1" >&2; exit 1; }

if ! command -v cmake >/dev/null; then
	need "CMake is not installed: install CMake 3.24 or later (Debian/Ubuntu: apt-get install cmake)"
fi
cmv=$(cmake --version | awk 'NR==1 {print $3}')
if [ "$(printf '%s\n3.21\n' "$cmv" | sort -V | head -1)" != 3.21 ]; then
	need "CMake $cmv is too old: the pinned sources need 3.21 or later (3.24 for CUDA_ARCHS=native)"
fi
nvcc=$(command -v nvcc || true)
for d in "${CUDA_HOME:-}" "${CUDA_PATH:-}" /usr/local/cuda; do
	if [ -z "$nvcc" ] && [ -n "$d" ] && [ -x "$d/bin/nvcc" ]; then
		nvcc=$d/bin/nvcc
	fi
done
if [ -z "$nvcc" ]; then
	need "nvcc (the CUDA compiler) is not installed or not on PATH: install the CUDA toolkit 11.8 or later (NVIDIA's cuda-toolkit-12-x package, or Debian/Ubuntu's nvidia-cuda-toolkit), or set CUDA_HOME"
fi
if [ -z "$src" ]; then
	command -v go >/dev/null || need "no Go toolchain to find the ollama module: pass its source directory as the first argument"
	src=$(go list -m -f '{{.Dir}}' github.com/ollama/ollama)
fi
[ -f "$src/CMakeLists.txt" ] && [ -d "$src/ml/backend/ggml/ggml/src/ggml-cuda" ] ||
	need "$src does not hold the ollama sources (CMakeLists.txt, ml/backend/ggml/ggml/src/ggml-cuda)"

archs=${CUDA_ARCHS:-}
if [ -z "$archs" ] && command -v nvidia-smi >/dev/null; then
	archs=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null | tr -d ' .' | sort -u | paste -sd';' || true)
fi
archs=${archs:-75;80;86;89;90}
jobs=$(nproc 2>/dev/null || echo 4)
echo "build-cuda: ggml CUDA backend for architectures $archs with $nvcc ($("$nvcc" --version | grep -o 'release [0-9.]*'))," \
	"$jobs jobs, from $src" >&2
start=$(date +%s)
mkdir -p "$(dirname "$build")"
# A copy of the sources CMake needs, patched (the module cache is read-only):
# ollama's patch 0020 makes ggml_backend_sched_free call each backend's reset, and
# llama_context frees its backends before its scheduler, so freeing a context (which
# llama.cpp also does when creating one fails) reads the freed CUDA backend and
# crashes. Ollama's own runner never frees a context; shoal does. The patched
# ggml_backend_cuda_free frees the backend's state but keeps its small handle, with
# no reset, for the scheduler to read.
copy=$build.src
mkdir -p "$copy/ml/backend/ggml"
cp -a -u "$src/CMakeLists.txt" "$src/CMakePresets.json" "$copy/"
cp -a -u "$src/ml/backend/ggml/ggml" "$copy/ml/backend/ggml/"
chmod -R u+w "$copy"
cu=$copy/ml/backend/ggml/ggml/src/ggml-cuda/ggml-cuda.cu
if ! grep -q 'shoal: keep the handle' "$cu"; then
	[ "$(grep -c '^    delete backend;$' "$cu")" = 1 ] ||
		need "$cu: ggml_backend_cuda_free is not as expected (pinned module changed?): review the patch in build-cuda.sh"
	sed -i 's|^    delete backend;$|    // shoal: keep the handle (a few hundred bytes) for ggml_backend_sched_free, which\n    // llama_context runs after freeing its backends and which calls reset on each.\n    backend->context = nullptr;\n    backend->iface.reset = nullptr;|' "$cu"
fi
src=$copy
# The library finds ggml-base and the CUDA runtime beside itself ($ORIGIN). Vulkan and
# HIP are kept out: the root CMakeLists adds their backends whenever it finds an SDK,
# and gpu-check's source archive leaves their sources out.
# Ninja where the machine has it (faster, and "Unix Makefiles" needs make).
gen=()
if command -v ninja >/dev/null; then
	gen=(-G Ninja)
elif ! command -v make >/dev/null; then
	need "neither ninja nor make is installed: CMake needs one of them to build"
fi
cmake "${gen[@]}" -S "$src" -B "$build" -DCMAKE_BUILD_TYPE=Release -DCMAKE_CUDA_COMPILER="$nvcc" \
	-DCMAKE_CUDA_ARCHITECTURES="$archs" -DCMAKE_INSTALL_RPATH='$ORIGIN' -DCMAKE_BUILD_WITH_INSTALL_RPATH=ON \
	-DCMAKE_DISABLE_FIND_PACKAGE_Vulkan=ON -DCMAKE_HIP_COMPILER=OFF >"$build.configure.log" 2>&1 || { tail -30 "$build.configure.log" >&2; need "CMake configure failed (log: $build.configure.log)"; }
cmake --build "$build" --target ggml-cuda -j "$jobs" >"$build.log" 2>&1 || { tail -40 "$build.log" >&2; need "build failed (log: $build.log)"; }
mkdir -p "$dest"
out=$build/lib/ollama
cp -a "$out"/libggml-base.so* "$out"/libggml-cuda.so "$dest"/
# The CUDA runtime libraries the backend needs, when the loader would not find them
# (a toolkit outside the system library path): first where CMake found them to link
# (a toolkit may keep them apart from nvcc, as pip's nvidia-* packages do).
linked=$(sed -n -E 's/^CUDA_(cudart|cublas|cublasLt)_LIBRARY:FILEPATH=(.+)/\2/p' "$build/CMakeCache.txt" | xargs -r -n1 dirname | sort -u)
# A copied library can need more (cuBLAS needs cuBLASLt), which ldd names only once
# the first is found: look again, a few times at most.
for _ in 1 2 3; do
	copied=
	for lib in $(ldd "$dest/libggml-cuda.so" | awk '/not found/ {print $1}'); do
		for d in $linked "$(dirname "$nvcc")/../lib64" "$(dirname "$nvcc")/../lib" /usr/local/cuda/lib64 /usr/lib/x86_64-linux-gnu; do
			if [ -e "$d/$lib" ]; then
				cp -aL "$d/$lib" "$dest/"
				copied=1
				break
			fi
		done
	done
	[ -n "$copied" ] || break
done
missing=$(ldd "$dest/libggml-cuda.so" | awk '/not found/ {print $1}' | grep -v '^libcuda\.so' || true)
[ -z "$missing" ] || echo "build-cuda: warning: $dest/libggml-cuda.so still lacks: $missing" >&2
echo "build-cuda: installed $(cd "$dest" && ls libggml-*.so* | paste -sd' ') into $dest in $(($(date +%s) - start)) s" >&2
