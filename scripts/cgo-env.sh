#!/usr/bin/env bash
# cgo-env.sh prints the environment that compiles llama.cpp (through the pinned
# github.com/ollama/ollama/llama package) and shoal's own binding, as `export` lines
# for `eval` or for make to include. Messages go to stderr, exports to stdout.
#
# It installs what the module zip of ollama leaves out:
#   - nlohmann-json3-dev and libstb-dev, with apt-get, when their headers are missing;
#   - an include directory in which miniaudio/miniaudio.h is the header shipped by the
#     Go module github.com/gen2brain/malgo (pinned in go.mod by tools/tools.go).
#   - pkgconf, with apt-get, when pkg-config is missing, and a .pc file naming the
#     include directories of ggml's CPU sources for engine/llama (its AMX kernels).
#
# The include directory lives at a fixed place outside the checkout so that every
# clone passes identical CGO_CPPFLAGS and Go's build cache reuses the compiled
# llama.cpp (a cold build takes 10-15 minutes on 2 cores).
#
# Environment: PORTABLE=1 builds the CPU kernels for x86-64-v3 instead of this machine.
set -euo pipefail

log() { echo "cgo-env: $*" >&2; }

missing=()
[ -f /usr/include/nlohmann/json.hpp ] || missing+=(nlohmann-json3-dev)
[ -f /usr/include/stb/stb_image.h ] || missing+=(libstb-dev)
command -v pkg-config >/dev/null || missing+=(pkgconf)
if ((${#missing[@]})); then
	log "installing ${missing[*]} with apt-get (what the build needs that the Go module zip omits: headers, pkg-config)"
	sudo=""
	[ "$(id -u)" = 0 ] || sudo="sudo"
	$sudo apt-get update -qq >&2
	DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}" >&2
fi

cd "$(dirname "$0")/.."
mod_dir() {
	local d
	d=$(go list -m -f '{{.Dir}}' "$1")
	if [ -z "$d" ] || [ ! -d "$d" ]; then
		go mod download "$1" >&2
		d=$(go list -m -f '{{.Dir}}' "$1")
	fi
	echo "$d"
}
ollama=$(mod_dir github.com/ollama/ollama)
malgo=$(mod_dir github.com/gen2brain/malgo)

inc="${XDG_CACHE_HOME:-$HOME/.cache}/shoal/cgo-include"
mkdir -p "$inc"
if [ "$(readlink "$inc/miniaudio" 2>/dev/null)" != "$malgo" ]; then
	ln -sfn "$malgo" "$inc/miniaudio"
fi

if [ "${PORTABLE:-0}" = 1 ]; then
	arch="-march=x86-64-v3"
else
	arch="-march=native"
fi

# engine/llama compiles ggml's AMX kernels (ggml-cpu/amx), which the ollama package
# leaves out although ggml-cpu.cpp asks for them when the compiler targets AMX (see
# engine/llama/ggml_amx.cpp). Their include directories are given through pkg-config,
# so that no other package sees them. (Go's build cache does not hash pkg-config's
# output: what the .pc names must not change for a given pinned module.)
ggml_src="$ollama/ml/backend/ggml/ggml/src"
pc="${XDG_CACHE_HOME:-$HOME/.cache}/shoal/pkgconfig"
mkdir -p "$pc"
want="Name: shoal-ggml-cpu
Description: ggml's CPU backend sources in the pinned ollama module (for shoal's engine/llama)
Version: 0
Cflags: -I$ggml_src/ggml-cpu -I$ggml_src"
if [ "$(cat "$pc/shoal-ggml-cpu.pc" 2>/dev/null)" != "$want" ]; then
	echo "$want" >"$pc/shoal-ggml-cpu.pc.$$"
	mv "$pc/shoal-ggml-cpu.pc.$$" "$pc/shoal-ggml-cpu.pc"
fi

echo "export CGO_ENABLED=1"
echo "export PKG_CONFIG_PATH='$pc${PKG_CONFIG_PATH:+:$PKG_CONFIG_PATH}'"
echo "export CGO_CPPFLAGS='-I$inc -I/usr/include/stb -I$ollama/llama/llama.cpp/include -I$ollama/ml/backend/ggml/ggml/include'"
echo "export CGO_CFLAGS='-O3 $arch'"
echo "export CGO_CXXFLAGS='-O3 $arch'"
