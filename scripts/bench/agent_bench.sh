#!/bin/bash
# Issue 51 (the APIs agents speak): the agent workload over Messages and Responses, minivllm against
# llama-server (its prompt cache on, the default), the 0.5B file, to run ALONE on the machine.
#   bash scripts/bench/agent_bench.sh     # OUT: ./runs/agent_bench_out; LLAMA: llama.cpp's bin directory
# Each server starts fresh per API; the same conversations (seed 1) are replayed turn by turn by
# `minivllm bench serve --dataset agent --api A`: per-turn TTFT, TPOT, cached-token share, and the run's rate.
set -u
HERE=$(cd "$(dirname "$0")" && pwd)
OUT=${OUT:-$PWD/runs/agent_bench_out}
source "$HERE/servers.sh"  # REPO (cd there), PY, MV, M05; log, wait_healthy, stop_server
LLAMA=${LLAMA:-$HOME/.cache/minivllm-peers/llama.cpp/build/bin}
AGENT=${AGENT:-"--dataset agent --num-prefixes 2 --input-len-range 3000:4000 --turn-len 128 --output-len-range 48:48 --num-prompts 8 --max-concurrency 2 --seed 1"}
pid=""
for api in messages responses; do
  log "minivllm serve, $api"
  $MV serve "$M05" --port 8451 --enable-auto-tool-choice --tool-call-parser hermes > "$OUT/minivllm-$api.log" 2>&1 & pid=$!
  wait_healthy http://127.0.0.1:8451 "minivllm-$api" && \
    $MV bench serve --base-url http://127.0.0.1:8451 --model "$M05" --api "$api" $AGENT \
      --output-json "$OUT/minivllm-$api.json" 2>&1 | tee -a "$OUT/run.log"
  stop_server
  log "llama-server, $api"
  "$LLAMA/llama-server" -m "$M05" -t 2 -c 16384 -np 2 --jinja --port 8452 > "$OUT/llama-$api.log" 2>&1 & pid=$!
  wait_healthy http://127.0.0.1:8452 "llama-$api" && \
    $MV bench serve --base-url http://127.0.0.1:8452 --model "$M05" --api "$api" $AGENT \
      --output-json "$OUT/llama-$api.json" 2>&1 | tee -a "$OUT/run.log"
  stop_server
done
