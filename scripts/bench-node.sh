#!/usr/bin/env bash
# bench-node.sh: a `shoal bench` concurrency sweep against one local `shoal serve` on
# the generated ~110M model (docs/benchmarks.md). Usage: scripts/bench-node.sh [OUTDIR] [serve flags...]
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-docs/bench/node}
shift || true
mkdir -p "$out"
model=${MODEL:-$(mktemp -d)/shoal-100m.gguf}
[ -f "$model" ] || bin/shoal gen-model --preset 100m --out "$model"
port=${PORT:-18080}
bin/shoal serve --model "$model" --addr 127.0.0.1:$port --ctx-size 16384 --parallel 128 --max-running 64 \
	--max-batch-tokens 512 --log-level warn "$@" &
pid=$!
trap 'kill $pid 2>/dev/null; wait $pid 2>/dev/null || true' EXIT
for _ in $(seq 1 600); do
	curl -sf "http://127.0.0.1:$port/ready" >/dev/null && break
	sleep 0.1
done
for c in 1 8 32 64; do
	n=$((c * 2 > 8 ? c * 2 : 8))
	echo "== concurrency $c ($n requests)"
	bin/shoal bench --url "http://127.0.0.1:$port/v1" --dataset random --num-prompts $n --input-len 128 \
		--output-len 64 --concurrency $c --seed $c --token-min 100 --token-max 16000 --json "$out/c$c.json"
done
