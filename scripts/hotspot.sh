#!/usr/bin/env bash
# hotspot.sh PROFILE POLICY [OUT.json]: three simulated nodes on 127.0.0.1 timed by
# PROFILE (shoal calibrate); every request goes to node a, routed with POLICY; one hot
# 1,024-token prefix for all requests (issue 5: a hot prefix must not be served slower
# than round robin would serve it).
set -euo pipefail
cd "$(dirname "$0")/.."
profile=$1 policy=$2 out=${3:-/dev/null}
key=$(printf '0123456789abcdef0123456789abcdef' | base64)
pids=()
trap 'kill "${pids[@]}" 2>/dev/null; wait 2>/dev/null || true' EXIT
common=(--sim "$profile" --gossip-key "$key" --ctx-size 65536 --parallel 64 --max-running 32 --log-level warn)
bin/shoal serve "${common[@]}" --addr 127.0.0.1:19101 --gossip-addr 127.0.0.1:19201 --node-name a --route "$policy" & pids+=($!)
sleep 0.5
for i in 2 3; do
	bin/shoal serve "${common[@]}" --addr 127.0.0.1:1910$i --gossip-addr 127.0.0.1:1920$i --node-name n$i --join 127.0.0.1:19201 & pids+=($!)
done
for _ in $(seq 1 100); do
	n=$(curl -sf http://127.0.0.1:19101/cluster | grep -o '"state":"alive"' | wc -l || true)
	[ "$n" = 3 ] && break
	sleep 0.2
done
bin/shoal bench --url http://127.0.0.1:19101/v1 --dataset shared-prefix --groups 1 --prompts-per-group 384 \
	--prefix-len 1024 --question-len 32 --output-len 32 --concurrency 24 --token-min 100 --token-max 250 --json "$out"
for i in 1 2 3; do
	printf 'node %s generated %s tokens\n' $i "$(curl -sf http://127.0.0.1:1910$i/metrics | grep '^vllm:generation_tokens_total' | awk '{print $2}')"
done
