#!/bin/bash
# Issue 49 (mixtures of experts): minivllm against llama.cpp on a MoE GGUF, to run ALONE on the machine.
#   bash scripts/bench/moe_bench.sh MODEL.gguf      # OUT: ./runs/moe_bench_out; LLAMA: llama.cpp's bin directory
# The model: a random-weight checkpoint of the family's real shape that transformers builds from its config
# class (scripts/bench/make_moe.py), converted by llama.cpp's convert_hf_to_gguf.py to f16, then
# `llama-quantize ... Q4_K_M`. Batch-1 decode and prefill of 512 and 4,096 tokens against llama-bench; 16 requests
# of 256 prompt / 128 output tokens against llama-batched-bench; the batch-1 bound from `bench roofline`
# (the active experts' bytes and the dense weights per token against the measured read bandwidth).
set -eu
M=$1
OUT=${OUT:-$PWD/runs/moe_bench_out}; mkdir -p "$OUT"
LLAMA=${LLAMA:-$HOME/.cache/minivllm-peers/llama.cpp/build/bin}
MV=${MV:-.venv/bin/minivllm}
name=$(basename "$M" .gguf)
run() { echo "+ $*" | tee -a "$OUT/$name.log"; "$@" 2>&1 | tee -a "$OUT/$name.log"; }
run $MV bench roofline --model "$M" --dtypes bfloat16
for i in 1 2; do
  run $MV bench latency --model "$M" --batch-size 1 --input-len 512 --output-len 128 --num-iters 2 \
    --output-json "$OUT/$name-b1-512-$i.json"
  run "$LLAMA/llama-bench" -m "$M" -t 2 -p 512 -n 128 -r 2
done
run "$LLAMA/llama-bench" -m "$M" -t 2 -p 0 -n 128 -d 512 -r 2  # decode at minivllm's depth
run $MV bench latency --model "$M" --batch-size 1 --input-len 4095 --output-len 1 --num-iters 1 \
  --num-iters-warmup 1 --output-json "$OUT/$name-prefill-4095.json"
run "$LLAMA/llama-bench" -m "$M" -t 2 -p 4096 -n 0 -r 1
run $MV bench throughput --model "$M" --dataset random --input-len-range 256:256 --output-len-range 128:128 \
  --num-prompts 16 --output-json "$OUT/$name-16x256-128.json"
run "$LLAMA/llama-batched-bench" -m "$M" -t 2 -c 8192 -b 2048 -ub 512 -npp 256 -ntg 128 -npl 16
