#!/usr/bin/env bash
# gpu-check.sh [DIR]: the GPU check, one command, for a machine with an NVIDIA GPU,
# nvcc and CMake but no Go toolchain and no network. DIR holds what
# scripts/gpu-check-prepare.sh packed (`make gpu-check-inputs`; default: this script's
# directory when it holds them, else ./gpu-check). It
#   1. builds ggml's CUDA backend there for this GPU's architecture only,
#   2. runs the engine tests that matter on the GPU (batched == sequential greedy,
#      shared prefix == recomputed, both again on q8_0 and q4_k_m weights, the same
#      through the scheduler, stories260K, LoRA adapters switched per batch, regex
#      grammars on the sampler),
#   3. measures the raw decode ceiling at batch 1/8/32/64/128 (generated 100M model),
#   4. serves that model with serve's defaults and runs shoal bench at concurrency
#      1/8/32/64 (greedy) and 64 (temperature 1, top-p 0.95), then at 64 with one
#      unified pool at the default size, with its cache budget and keeping every
#      cached block (--prefix-cache-floor 1), and at 1 and 64 on a q4_k_m copy of
#      the model (shoal quantize, there),
# and prints one table. Device time is scarce and a run cut off at its limit returns
# only what it had written, so every step gets a share of one budget
# (GPU_CHECK_BUDGET seconds, default 480: 8 minutes) and the table is printed, and
# written with the logs to $OUT (gpu-check.md, gpu-check-logs.tar.xz) when $OUT is
# set, whatever step fails or runs out of time. GPU_CHECK_CPU=1 rehearses everything
# but the CUDA build on a machine without a GPU (the same tests and table, on the CPU).
set -euo pipefail
cpu=${GPU_CHECK_CPU:-}
here=$(cd "$(dirname "$0")" && pwd)
dir=${1:-}
if [ -z "$dir" ]; then
	if [ -f "$here/shoal.xz" ]; then dir=$here; else dir=gpu-check; fi
fi
dir=$(cd "$dir" && pwd)
work=${WORK:-$dir/work}
out=${OUT:-$work}
mkdir -p "$work/bin" "$work/lib/ollama" "$work/src" "$out"
t0=$(date +%s)
deadline=$((t0 + ${GPU_CHECK_BUDGET:-480}))
log() { echo "gpu-check [$(($(date +%s) - t0))s] $*" >&2; }
# budget CAP RESERVE: seconds for the next step, at most CAP, leaving RESERVE for the
# steps after it (at least 5, so a step out of time fails at once rather than never).
budget() { local s=$((deadline - $(date +%s) - $2)); s=$((s < $1 ? s : $1)); echo $((s > 5 ? s : 5)); }
get() { # get URL: its body on stdout; curl where the machine has it, else python3
	if command -v curl >/dev/null; then curl -sf --max-time 10 "$1"; else
		python3 -c 'import sys, urllib.request; sys.stdout.write(urllib.request.urlopen(sys.argv[1], timeout=10).read().decode())' "$1"
	fi
}
# unxz FILE: its decompressed bytes on stdout (python3's lzma where xz is missing).
unxz() {
	if command -v xz >/dev/null; then xz -dc "$1"; else
		python3 -c 'import lzma, shutil, sys; shutil.copyfileobj(lzma.open(sys.argv[1]), sys.stdout.buffer)' "$1"
	fi
}
# stop_serve: SIGTERM to the running shoal serve, 15 s to exit, then SIGKILL; its exit
# status goes to exit-NAME.txt (so a crash on shutdown shows).
stop_serve() {
	local st
	[ -n "$serve" ] || return 0
	kill "$serve" 2>/dev/null || true
	for _ in $(seq 1 75); do
		kill -0 "$serve" 2>/dev/null || break
		sleep 0.2
	done
	if kill -0 "$serve" 2>/dev/null; then
		kill -9 "$serve" 2>/dev/null || true
		log "serve $serve_name did not stop within 15 s of SIGTERM: killed"
	fi
	wait "$serve" && st=0 || st=$?
	echo "$st" >"$work/exit-$serve_name.txt"
	serve=
}
build_s=- serve= serve_name= gpu=unknown watchdog=
tests='TestBatchedGreedyEqualsSequential|TestSharedPrefixEqualsRecomputed|TestQuantizedModels|TestSchedulerConcurrentEqualsSolo|TestSchedulerCachedPrefixEqualsUncached|TestStories260K|TestDevicesAndKVMemory|TestSelectedAdapters|TestRegexGrammarMatches|TestImages|TestGemma3Images'

# layout NAME: the KV pool serve NAME reported (cells, cells per sequence, unified).
layout() { grep -o 'context=[0-9]*\|per_seq=[0-9]*\|unified=[a-z]*' "$work/serve-$1.log" 2>/dev/null | head -3 | paste -sd' '; }
# bench_row FILE LABEL: a table row from shoal bench's JSON.
bench_row() {
	python3 - "$1" "$2" <<'PY' 2>/dev/null || echo "| $2 | (no result) |"
import json, sys
r = json.load(open(sys.argv[1]))
cut = f", cut off at its time share ({r['interrupted']} more planned)" if r.get("interrupted") else ""
print(f"| {sys.argv[2]} | {r['output_tokens_per_s']:.0f} output tok/s, TTFT p50 {r['ttft_ms']['p50']:.1f} ms / p99 {r['ttft_ms']['p99']:.1f} ms, TPOT p50 {r['tpot_ms']['p50']:.2f} ms, {r['completed']}/{r['requests']} ok{cut} |")
PY
}

# report: the table from whatever the steps left in $work, and the logs, into $out.
report() {
	local rc=$?
	set +e
	[ -z "$watchdog" ] || kill "$watchdog" 2>/dev/null
	if [ -f "$work/overtime" ]; then
		rc=143
		log "the watchdog stopped the check at its budget plus 45 s: writing what it has"
	fi
	{
		echo "## GPU check: $gpu"
		echo
		echo "Inputs: $(cat "$dir/VERSION" 2>/dev/null || echo unknown); $(grep '^shoal\|^llama.cpp' "$work/version.txt" 2>/dev/null | paste -sd';' | sed 's/;/; /g'); CUDA library built in ${build_s} s; $(grep -o 'device="[^"]*"\|device=[^ "]*\|gpu_layers=[0-9]*\|weights="[^"]*"' "$work/serve-default.log" 2>/dev/null | head -3 | paste -sd' ')"
		echo
		echo "| check | result |"
		echo "|---|---|"
		# A row for every check, "(no result)" where a step failed or ran out of time.
		for t in ${tests//|/ }; do
			grep -E -- "^--- (PASS|FAIL|SKIP): $t " "$work/tests.txt" 2>/dev/null |
				sed -E 's/^--- (PASS|FAIL|SKIP): ([A-Za-z0-9_]+) \(([0-9.]+s)\)/| \2 | \1 (\3) |/' | grep . || echo "| $t | (no result) |"
		done
		# How far this device's logits move when only batch shapes change: what the
		# exactness tests measure against.
		noise=$(grep -o 'kernel noise: logits move by up to [0-9.e+-]*' "$work/tests.txt" 2>/dev/null | awk '{print $NF}' | sort -g | tail -1)
		echo "| kernel noise (largest logit change from batch shapes alone) | ${noise:-(no result)} |"
		for b in 1 8 32 64 128; do
			grep -E "^Benchmark.*/batch=$b(-[0-9]+)?\s" "$work/ceiling.txt" 2>/dev/null |
				sed -E 's/.*\s([0-9.]+) tok\/s.*/| decode ceiling, batch '"$b"' | \1 tok\/s |/' | grep . || echo "| decode ceiling, batch $b | (no result) |"
		done
		for c in 1 8 32 64; do
			bench_row "$work/bench-default-$c.json" "shoal bench, concurrency $c (defaults: $(layout default))"
		done
		bench_row "$work/bench-default-64-t1.json" "shoal bench, concurrency 64, temperature 1, top-p 0.95 (rows sampled on every core)"
		bench_row "$work/bench-unified-64.json" "shoal bench, concurrency 64, --kv-unified=true ($(layout unified); cache budget)"
		bench_row "$work/bench-unified-keep-64.json" "shoal bench, concurrency 64, --kv-unified=true --prefix-cache-floor 1 (every cached block kept)"
		for c in 1 64; do
			bench_row "$work/bench-q4km-$c.json" "shoal bench, concurrency $c, q4_k_m weights (shoal quantize), defaults: $(layout q4km)"
		done
		echo "| shoal serve's exit status after SIGTERM | defaults: $(cat "$work/exit-default.txt" 2>/dev/null || echo '(none)'), --kv-unified=true: $(cat "$work/exit-unified.txt" 2>/dev/null || echo '(none)'), --prefix-cache-floor 1: $(cat "$work/exit-unified-keep.txt" 2>/dev/null || echo '(none)'), q4_k_m: $(cat "$work/exit-q4km.txt" 2>/dev/null || echo '(none)') |"
		echo
		echo "Device metrics: $(paste -sd' ' "$work/device-metrics.txt" 2>/dev/null)"
		echo "Total: $(($(date +%s) - t0)) s (budget ${GPU_CHECK_BUDGET:-480} s)"
		[ "$rc" != 143 ] || echo "Cut off by the watchdog (steps still running were stopped)."
	} | tee "$out/gpu-check.md"
	stop_serve
	pkill -P $$ 2>/dev/null # a step the watchdog interrupted
	(cd "$work" && tar -cJf "$out/gpu-check-logs.tar.xz" --ignore-failed-read gpu.txt version.txt tests.txt ceiling.txt \
		serve-*.log metrics-*.txt exit-*.txt bench-*.json quantize.txt build.configure.log build.log 2>/dev/null)
	if grep -q -- '^--- FAIL' "$work/tests.txt" 2>/dev/null; then
		log "some engine tests failed on the GPU: $work/tests.txt"
		[ "$rc" != 0 ] || rc=1
	fi
	exit "$rc"
}
trap report EXIT
# Whatever step overruns, the table and logs must reach $out before the device call's
# own limit: 45 s after the budget, the script is stopped and report runs (bash runs
# the EXIT trap on SIGTERM at once, even with a step in the foreground).
(
	trap 'kill "$nap" 2>/dev/null; exit 0' TERM # report stops the watchdog: and its sleep
	sleep $((deadline + 45 - $(date +%s))) &
	nap=$!
	wait "$nap"
	touch "$work/overtime"
	kill -TERM $$ 2>/dev/null
) &
watchdog=$!

if [ -n "$cpu" ]; then
	echo "none (CPU rehearsal)" >"$work/gpu.txt"
else
	nvidia-smi --query-gpu=name,memory.total,compute_cap,driver_version --format=csv,noheader >"$work/gpu.txt" || echo "unknown (nvidia-smi failed)" >"$work/gpu.txt"
fi
gpu=$(head -1 "$work/gpu.txt")
log "GPU: $gpu"
unxz "$dir/shoal.xz" >"$work/bin/shoal"
unxz "$dir/llama.test.xz" >"$work/bin/llama.test"
chmod +x "$work/bin/shoal" "$work/bin/llama.test"
unxz "$dir/ollama-src.tar.xz" | tar -C "$work/src" -x

# 1. The CUDA backend for this GPU only; the rest needs it, so its failure ends the check.
tb=$(date +%s)
if [ -z "$cpu" ]; then
	# This GPU's architecture, known here: build-cuda.sh's own fallback when
	# nvidia-smi fails is five architectures, five times the build.
	archs=$(cut -d, -f3 "$work/gpu.txt" | tr -d ' .' | grep -E '^[0-9]+$' | sort -u | paste -sd';' || true)
	brc=0
	CUDA_ARCHS=${CUDA_ARCHS:-${archs:-90}} BUILD_DIR=$work/build timeout -k 10 "$(budget 360 90)" bash "$dir/build-cuda.sh" "$work/src" "$work/lib/ollama" || brc=$?
	if [ "$brc" != 0 ]; then
		build_s=$(($(date +%s) - tb))
		[ "$brc" != 124 ] || log "the CUDA build ran out of its time ($build_s s)"
		tail -20 "$work/build.log" >&2 2>/dev/null
		log "FAIL: the CUDA build, status $brc (logs: build.configure.log, build.log)"
		exit 1
	fi
fi
build_s=$(($(date +%s) - tb))
timeout -k 5 30 "$work/bin/shoal" version | tee "$work/version.txt" >&2
[ -n "$cpu" ] || grep -q '^device CUDA' "$work/version.txt" || { log "FAIL: shoal sees no CUDA device with the library in $work/lib/ollama"; exit 1; }

# 2. Engine tests on the GPU.
export SHOAL_STORIES=$dir/stories260K.gguf
(cd "$work" && timeout -k 10 "$(budget 180 120)" bin/llama.test -test.run "$tests" -test.v -test.count 1) >"$work/tests.txt" 2>&1 || true
log "tests: $(grep -c -- '^--- PASS' "$work/tests.txt") passed, $(grep -c -- '^--- FAIL' "$work/tests.txt") failed, $(grep -c -- '^--- SKIP' "$work/tests.txt") skipped"

# 3. The raw decode ceiling.
(cd "$work" && timeout -k 10 "$(budget 150 80)" bin/llama.test -test.run '^$' -test.bench 'BenchmarkDecodeCeiling' -test.benchtime 3x) >"$work/ceiling.txt" 2>&1 || true
log "decode ceiling: $(grep -c '^Benchmark' "$work/ceiling.txt") batch sizes"

# 4. shoal serve + shoal bench, with serve's defaults (the KV pool sized from the GPU's
# free memory, its layout chosen for it), then with one unified pool at the default size.
model=$work/m100.gguf
[ -f "$model" ] || timeout -k 5 60 "$work/bin/shoal" gen-model --preset 100m --out "$model" >&2
left=9 # benches still to run, each leaving 20 s for those after it
# serve_bench NAME PORT CONCURRENCIES [FLAGS]: shoal serve with FLAGS, shoal bench at
# each concurrency, the metrics, then SIGTERM and serve's exit status (so a crash on
# shutdown shows).
serve_bench() {
	local name=$1 port=$2 cs=$3 st ready_by
	shift 3
	"$work/bin/shoal" serve --model "$model" --model-name m100 --addr "127.0.0.1:$port" --parallel 160 --max-running 64 \
		--log-level info --drain-timeout 5s "$@" >"$work/serve-$name.log" 2>&1 &
	serve=$! serve_name=$name
	ready_by=$(($(date +%s) + $(budget 60 $((15 + left * 20)))))
	while [ "$(date +%s)" -lt "$ready_by" ]; do
		get "http://127.0.0.1:$port/ready" >/dev/null 2>&1 && break
		kill -0 "$serve" 2>/dev/null || break
		sleep 0.2
	done
	if ! kill -0 "$serve" 2>/dev/null; then # e.g. its port taken: bench nothing else
		wait "$serve" && st=0 || st=$?
		echo "$st (exited before it was ready: $(tail -1 "$work/serve-$name.log"))" >"$work/exit-$name.txt"
		serve=
		for _ in $cs; do left=$((left - 1)); done
		log "serve $name exited before it was ready; its benches are skipped"
		return 0
	fi
	for c in $cs; do # CONCURRENCY, or CONCURRENCY:t1 to sample at temperature 1, top-p 0.95
		left=$((left - 1))
		local n=${c%%:*} sampling=()
		[ "$c" = "${c%:t1}" ] || sampling=(--temperature 1 --top-p 0.95)
		timeout -k 10 "$(budget 120 $((15 + left * 20)))" "$work/bin/shoal" bench --url "http://127.0.0.1:$port/v1" --dataset random \
			--num-prompts $((n * 4 > 32 ? n * 4 : 32)) --input-len 256 --output-len 128 --concurrency "$n" --token-max 16000 \
			"${sampling[@]}" --json "$work/bench-$name-${c/:/-}.json" >/dev/null 2>&1 || true
		log "bench $name at concurrency $c: $([ -f "$work/bench-$name-${c/:/-}.json" ] && echo done || echo 'no result')"
	done
	get "http://127.0.0.1:$port/metrics" >"$work/metrics-$name.txt" 2>/dev/null || true
	stop_serve
}
serve_bench default 18080 "1 8 32 64 64:t1"
serve_bench unified 18081 64 --kv-unified=true
serve_bench unified-keep 18082 64 --kv-unified=true --prefix-cache-floor 1
# The same defaults on a 4-bit copy, as users serve downloaded models.
qmodel=$work/m100-q4_k_m.gguf
timeout -k 5 60 "$work/bin/shoal" quantize --model "$model" --out "$qmodel" --type q4_k_m >"$work/quantize.txt" 2>&1 || log "quantize failed: $(tail -1 "$work/quantize.txt")"
[ ! -f "$qmodel" ] || model=$qmodel serve_bench q4km 18083 "1 64"
grep -E '^shoal_(device|gpu_layers)' "$work/metrics-default.txt" >"$work/device-metrics.txt" || true
