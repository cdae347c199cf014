#!/bin/bash
# Ray's sitting (docs/ray.md), alone on the machine: OUT=runs/ray bash scripts/bench/ray_bench.sh
# PARTS=13 runs parts 1 and 3 only.
#  1. TP=2 on the 0.5B, dequantized (its Q6_K/Q4_K MLP rows, 4864 / 2, do not split at 256-blocks): decode step with --distributed-executor-backend ray against mp (alternated), and the CPU an
#     idle TP=2 server over Ray uses in 10 s;
#  2. DP=2 on the default model, the agent workload (conversations in rotation, prefixes larger than one replica's
#     cache holds): minivllm router (mp) against Ray Serve with the prefix-aware router and with Serve's own
#     power-of-two, on a local Ray cluster of two one-CPU nodes; and the CPU the front spent;
#  3. the calibrated simulator at 2 and 64 replicas, the same trace shape.
OUT=${OUT:-runs/ray}
source "$(dirname "$0")/servers.sh"
export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0
cpu_of() {  # PATTERN: CPU seconds (user + system) of the processes whose command line matches
  local p total=0
  for p in $(pgrep -f -- "$1"); do
    total=$(awk -v t="$total" '{print t + ($14 + $15) / 100}' /proc/$p/stat 2>/dev/null || echo "$total")
  done
  echo "$total"
}

PARTS=${PARTS:-123}
if [[ $PARTS == *1* ]]; then
log "1. TP=2 decode step, mp vs ray"
[ -f "$M05" ] || $MV fetch qwen2.5-coder-0.5b-instruct-q4_k_m
for run in mp-1 ray-1 mp-2 ray-2; do
  $MV bench latency --model "$M05" --quantization none --tensor-parallel-size 2 --distributed-executor-backend "${run%-*}" \
    --batch-size 1 --input-len 128 --output-len 64 --num-iters-warmup 1 --num-iters 5 \
    --output-json "$OUT/tp-$run.json" > "$OUT/tp-$run.log" 2>&1
  log "tp $run: $(grep -i 'decode step' "$OUT/tp-$run.log" | head -1)"
done
$MV serve "$M05" --quantization none --tensor-parallel-size 2 --distributed-executor-backend ray --port 8090 > "$OUT/tp-idle.log" 2>&1 &
pid=$!
wait_healthy http://127.0.0.1:8090 tp-idle && sleep 5
busy() { awk '/^cpu /{print ($2 + $3 + $4 + $7 + $8) / 100}' /proc/stat; }  # the machine's busy CPU seconds
daemons='raylet|gcs_server|dashboard|log_monitor|monitor.py|ray::IDLE|runtime_env'
a=$(busy); r0=$(cpu_of "$daemons"); w0=$(cpu_of TensorParallelRank); sleep 10
b=$(busy); r1=$(cpu_of "$daemons"); w1=$(cpu_of TensorParallelRank)
pct() { awk -v a="$1" -v b="$2" 'BEGIN{printf "%.2f", (b - a) / 10 * 100}'; }
log "idle TP=2 over Ray, 10 s, % of one core: the whole machine $(pct "$a" "$b"), Ray's daemons $(pct "$r0" "$r1"), the worker actor $(pct "$w0" "$w1")"
stop_server; "$REPO/.venv/bin/ray" stop --force > /dev/null 2>&1
fi

if [[ $PARTS == *2* ]]; then
log "2. DP=2, agent workload"
ENGINE=(--num-kv-blocks 320 --max-model-len 2048)
WORK=(--dataset agent --num-prefixes 8 --input-len-range 384:768 --turn-len 64 --output-len 16 --num-prompts 96
      --max-concurrency 4)
bench() {  # name url front-pattern
  local before after
  before=$(cpu_of "$3")
  $MV bench serve --base-url "$2" "${WORK[@]}" --output-json "$OUT/dp-$1.json" > "$OUT/dp-$1.bench.log" 2>&1
  after=$(cpu_of "$3")
  log "dp $1: $(grep -E 'Output token throughput|Prefix cache hit rate|Mean TTFT' "$OUT/dp-$1.bench.log" | tr -s ' ' | paste -sd';'); front CPU $(awk -v a="$before" -v b="$after" 'BEGIN{printf "%.1f", b-a}') s"
}
OMP_NUM_THREADS=1 $MV serve --data-parallel-size 2 --port 8100 "${ENGINE[@]}" > "$OUT/dp-router.log" 2>&1 &
pid=$!
wait_healthy http://127.0.0.1:8100 dp-router && bench router http://127.0.0.1:8100 "minivllm.cli serve --data-parallel-size 2 --port 8100"
stop_server
$PY scripts/bench/ray_cluster.py 2 1 > "$OUT/cluster.log" 2>&1 &
cluster=$!
for i in $(seq 60); do grep -q ':' "$OUT/cluster.log" 2>/dev/null && break; sleep 1; done
address=$(tail -1 "$OUT/cluster.log")
for policy in prefix-aware power-of-two; do
  OMP_NUM_THREADS=1 $MV serve --data-parallel-size 2 --data-parallel-backend ray --ray-address "$address" \
    --routing-policy $policy --port 8101 "${ENGINE[@]}" > "$OUT/dp-serve-$policy.log" 2>&1 &
  pid=$!
  wait_healthy http://127.0.0.1:8101 "dp-serve-$policy" && bench "serve-$policy" http://127.0.0.1:8101 "ProxyActor|Ingress"
  stop_server
done
kill $cluster; wait $cluster
fi

if [[ $PARTS == *3* ]]; then
log "3. simulated: 2 and 64 replicas, the same trace shape"
OMP_NUM_THREADS=1 $MV bench calibrate --num-kv-blocks 320 --max-model-len 2048 \
  --output-json "$OUT/profile.json" > "$OUT/calibrate.log" 2>&1
for n in 2 64; do
  for policy in prefix-aware least-outstanding-tokens; do  # (round-robin keeps a rotation's conversation on one replica)
    $MV bench simulate --profile "$OUT/profile.json" --scheduler continuous --workload agent --num-replicas $n \
      --routing-policy $policy --num-conversations $((4 * n)) --context-len 384:768 --turn-len 64 \
      --short-output-len 16:16 --num-prompts $((48 * n)) --request-rate "$(awk -v r="${RATE_PER_REPLICA:-1.5}" -v n=$n 'BEGIN{print r * n}')" \
      --num-kv-blocks 320 --max-model-len 2048 --disable-tqdm > "$OUT/sim-$n-$policy.log" 2>&1
    log "sim $n $policy: $(grep '^router' "$OUT/sim-$n-$policy.log")"
  done
done
fi
