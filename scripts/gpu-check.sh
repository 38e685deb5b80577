#!/usr/bin/env bash
# gpu-check.sh [DIR]: the GPU check, one command, for a machine with an NVIDIA GPU,
# nvcc and CMake but no Go toolchain and no network. DIR holds what
# scripts/gpu-check-prepare.sh packed (`make gpu-check-inputs`; default: this script's
# directory when it holds them, else ./gpu-check). It
#   1. builds ggml's CUDA backend there for this GPU's architecture only,
#   2. runs the engine tests that matter on the GPU (batched == sequential greedy,
#      shared prefix == recomputed, the same through the scheduler, stories260K),
#   3. measures the raw decode ceiling at batch 1/8/32/64/128 (generated 100M model),
#   4. serves that model and runs shoal bench at concurrency 1/8/32/64,
# and prints one table (also written to $OUT/gpu-check.md when $OUT is set). Meant to
# finish within 8 minutes on 16 cores. GPU_CHECK_CPU=1 rehearses everything but the
# CUDA build on a machine without a GPU (the same tests and table, on the CPU).
set -euo pipefail
cpu=${GPU_CHECK_CPU:-}
here=$(cd "$(dirname "$0")" && pwd)
dir=${1:-}
if [ -z "$dir" ]; then
	if [ -f "$here/shoal.xz" ]; then dir=$here; else dir=gpu-check; fi
fi
dir=$(cd "$dir" && pwd)
work=${WORK:-$dir/work}
report=${OUT:-$work}/gpu-check.md
mkdir -p "$work/bin" "$work/lib/ollama" "$work/src" "$(dirname "$report")"
t0=$(date +%s)
log() { echo "gpu-check [$(($(date +%s) - t0))s] $*" >&2; }

if [ -n "$cpu" ]; then
	echo "none (CPU rehearsal)" >"$work/gpu.txt"
else
	nvidia-smi --query-gpu=name,memory.total,compute_cap,driver_version --format=csv,noheader >"$work/gpu.txt"
fi
gpu=$(head -1 "$work/gpu.txt")
log "GPU: $gpu"
xz -dc "$dir/shoal.xz" >"$work/bin/shoal"
xz -dc "$dir/llama.test.xz" >"$work/bin/llama.test"
chmod +x "$work/bin/shoal" "$work/bin/llama.test"
tar -C "$work/src" -xJf "$dir/ollama-src.tar.xz"

# 1. The CUDA backend for this GPU only.
tb=$(date +%s)
[ -n "$cpu" ] || BUILD_DIR=$work/build bash "$dir/build-cuda.sh" "$work/src" "$work/lib/ollama"
build_s=$(($(date +%s) - tb))
"$work/bin/shoal" version | tee "$work/version.txt" >&2
[ -n "$cpu" ] || grep -q '^device CUDA' "$work/version.txt" || { log "FAIL: shoal sees no CUDA device with the library in $work/lib/ollama"; exit 1; }

# 2. Engine tests on the GPU.
tests='TestBatchedGreedyEqualsSequential|TestSharedPrefixEqualsRecomputed|TestSchedulerConcurrentEqualsSolo|TestSchedulerCachedPrefixEqualsUncached|TestStories260K|TestDevicesAndKVMemory'
export SHOAL_STORIES=$dir/stories260K.gguf
(cd "$work" && timeout 180 bin/llama.test -test.run "$tests" -test.v -test.count 1) >"$work/tests.txt" 2>&1 || true
log "tests: $(grep -c -- '^--- PASS' "$work/tests.txt") passed, $(grep -c -- '^--- FAIL' "$work/tests.txt") failed, $(grep -c -- '^--- SKIP' "$work/tests.txt") skipped"

# 3. The raw decode ceiling.
(cd "$work" && timeout 180 bin/llama.test -test.run '^$' -test.bench 'BenchmarkDecodeCeiling' -test.benchtime 3x) >"$work/ceiling.txt" 2>&1 || true

# 4. shoal serve + shoal bench.
model=$work/m100.gguf
[ -f "$model" ] || "$work/bin/shoal" gen-model --preset 100m --out "$model" >&2
# --kv-memory 0.05: the pool sized from the GPU's free memory (5%: room for 100k+
# cells of this model on any data-centre GPU without a huge attention span).
"$work/bin/shoal" serve --model "$model" --model-name m100 --addr 127.0.0.1:18080 --parallel 160 --max-running 64 --kv-memory 0.05 \
	--log-level info >"$work/serve.log" 2>&1 &
serve=$!
trap 'kill $serve 2>/dev/null || true' EXIT
for _ in $(seq 1 300); do
	curl -sf http://127.0.0.1:18080/ready >/dev/null 2>&1 && break
	sleep 0.2
done
for c in 1 8 32 64; do
	n=$((c * 4 > 32 ? c * 4 : 32))
	timeout 120 "$work/bin/shoal" bench --url http://127.0.0.1:18080/v1 --dataset random --num-prompts "$n" --input-len 256 \
		--output-len 128 --concurrency "$c" --token-max 16000 --json "$work/bench-$c.json" >/dev/null 2>&1 || true
done
curl -sf http://127.0.0.1:18080/metrics | grep -E '^shoal_(device|gpu_layers)' >"$work/device-metrics.txt" || true
kill $serve 2>/dev/null || true
wait $serve 2>/dev/null || true

{
	echo "## GPU check: $gpu"
	echo
	echo "$(grep '^shoal\|^llama.cpp' "$work/version.txt" | paste -sd';' | sed 's/;/; /g'); CUDA library built in ${build_s} s; $(grep -o 'device=[^ ]*\|gpu_layers=[0-9]*\|context=[0-9]*' "$work/serve.log" | head -3 | paste -sd' ')"
	echo
	echo "| check | result |"
	echo "|---|---|"
	grep -E -- '^--- (PASS|FAIL|SKIP)' "$work/tests.txt" | sed -E 's/^--- (PASS|FAIL|SKIP): ([A-Za-z0-9_]+) \(([0-9.]+s)\)/| \2 | \1 (\3) |/'
	grep -E '^Benchmark' "$work/ceiling.txt" | sed -E 's/.*batch=([0-9]+)-?[0-9]*\s.*\s([0-9.]+) tok\/s.*/| decode ceiling, batch \1 | \2 tok\/s |/'
	for c in 1 8 32 64; do
		f=$work/bench-$c.json
		if [ -f "$f" ]; then
			python3 - "$f" "$c" <<'PY' 2>/dev/null || echo "| shoal bench, concurrency $c | (no result) |"
import json, sys
r = json.load(open(sys.argv[1]))
print(f"| shoal bench, concurrency {sys.argv[2]} | {r['output_tokens_per_s']:.0f} output tok/s, TTFT p50 {r['ttft_ms']['p50']:.1f} ms / p99 {r['ttft_ms']['p99']:.1f} ms, TPOT p50 {r['tpot_ms']['p50']:.2f} ms, {r['completed']}/{r['requests']} ok |")
PY
		else
			echo "| shoal bench, concurrency $c | (no result) |"
		fi
	done
	echo
	echo "Device metrics: $(paste -sd' ' "$work/device-metrics.txt")"
	echo "Total: $(($(date +%s) - t0)) s"
} | tee "$report"
grep -q -- '^--- FAIL' "$work/tests.txt" && { log "some engine tests failed on the GPU: $work/tests.txt"; exit 1; }
exit 0
