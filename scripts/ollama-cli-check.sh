#!/usr/bin/env bash
# ollama-cli-check.sh runs Ollama's own CLI against a shoal node: `ollama list`, `ps`,
# `show`, `run` with a prompt (and its --verbose counts), a piped prompt, a prompt
# naming a picture (the node reads images: --mmproj), and a model the node does not
# serve. The CLI is built from the ollama module shoal pins
# (the same version as the API shoal follows) into ~/.cache/shoal/ollama-cli; with a
# warm build cache that takes a minute or two, since it shares shoal's compiled
# llama.cpp. Needs bin/shoal (make build) and the Go module proxy the first time.
set -euo pipefail
cd "$(dirname "$0")/.."

log() { echo "ollama-cli-check: $*" >&2; }
fail() { log "FAIL: $*"; exit 1; }

version=$(go list -m -f '{{.Version}}' github.com/ollama/ollama)
dir="${XDG_CACHE_HOME:-$HOME/.cache}/shoal/ollama-cli/$version"
cli="$dir/ollama"
if [ ! -x "$cli" ]; then
	log "building Ollama's CLI $version into $dir"
	mkdir -p "$dir"
	printf 'module ollamacli\n\ngo %s\n\nrequire github.com/ollama/ollama %s\n' "$(go list -m -f '{{.GoVersion}}')" "$version" >"$dir/go.mod"
	eval "$(bash scripts/cgo-env.sh)"
	(cd "$dir" && GOFLAGS=-mod=mod GOWORK=off timeout 1800 go build -o ollama github.com/ollama/ollama)
fi

work=$(mktemp -d)
pid=""
cleanup() {
	if [ -n "$pid" ]; then kill "$pid" 2>/dev/null || true; wait "$pid" 2>/dev/null || true; fi
	rm -rf "$work"
}
trap cleanup EXIT
bin/shoal gen-model --preset small --tools hermes --out "$work/tiny.gguf" >/dev/null
bin/shoal gen-model --preset small --mmproj --out "$work/mmproj.gguf" >/dev/null
# A 2×2 PNG (red, green, blue, white).
base64 -d >"$work/dot.png" <<<'iVBORw0KGgoAAAANSUhEUgAAAAIAAAACCAIAAAD91JpzAAAAEklEQVR4nGP4z8DAAMIM/4EAAB/uBfsL2WiLAAAAAElFTkSuQmCC'
bin/shoal serve --model "$work/tiny.gguf" --mmproj "$work/mmproj.gguf" --addr 127.0.0.1:0 --threads 2 --default-max-tokens 24 2>"$work/serve.log" &
pid=$!
addr=""
for _ in $(seq 1 100); do
	addr=$(sed -n 's/.*msg=ready url=http:\/\/\([^/]*\)\/v1.*/\1/p' "$work/serve.log" | head -1)
	[ -n "$addr" ] && break
	sleep 0.1
done
[ -n "$addr" ] || fail "the node did not start: $(cat "$work/serve.log")"
export OLLAMA_HOST="$addr"
log "node at $addr; $("$cli" --version 2>&1 | head -1)"

out=$("$cli" list) || fail "list: $out"
grep -Eq '^tiny +[0-9a-f]{12} +[0-9.]+ MB' <<<"$out" || fail "list: $out"
out=$("$cli" ps) || fail "ps: $out"
grep -Eq '^tiny .*100% CPU +4096 +Forever' <<<"$out" || fail "ps: $out"
out=$("$cli" show tiny) || fail "show: $out"
for want in "architecture +llama" "context length +4096" "quantization +F32" "completion" "tools" "vision"; do
	grep -Eq "$want" <<<"$out" || fail "show lacks /$want/: $out"
done
out=$(timeout 120 "$cli" run tiny "Tell me a story." --verbose 2>&1) || fail "run: $out"
grep -Eq '^eval count: +(1?[0-9]|2[0-4]) token' <<<"$out" || fail "run --verbose (at most 24 tokens, --default-max-tokens): $out"
grep -Eq 'prompt eval count: +[1-9][0-9]* token' <<<"$out" || fail "run --verbose: $out"
out=$(echo "Hello there" | timeout 120 "$cli" run tiny 2>&1) || fail "run, piped: $out"
out=$(timeout 120 "$cli" run tiny "What is in $work/dot.png ?" --verbose 2>&1) || fail "run with a picture: $out"
grep -q "Added image '$work/dot.png'" <<<"$out" || fail "run with a picture: the CLI sent no image: $out"
grep -q ' images=1 ' "$work/serve.log" || fail "run with a picture: the node read no image: $(tail -3 "$work/serve.log")"
out=$(timeout 60 "$cli" run nope "hi" 2>&1) && fail "run of a model not served succeeded: $out"
grep -q 'serves "tiny"' <<<"$out" || fail "run nope: $out"
log "PASS: list, ps, show, run (with counts), a piped prompt, a picture, and a model not served"
