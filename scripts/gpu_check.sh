#!/bin/bash
# The CUDA path's checks and figures on a GPU host (issue 53), in one run of under six minutes.
# From the checkout's root, with .gpu-kit/ beside it (../shared/gpu/prepare.sh):
#     OUT=/some/dir scripts/gpu_check.sh        (OUT defaults to ./gpu-out)
# Writes $OUT/gpu_check.log (everything), stage_results.tgz (one JSON per stage), and $OUT/figures.json (the headline
# figures). Each stage runs under its own timeout and a shared deadline, so one failing or slow stage
# does not stop the ones after it; the log says which stage failed and why. STAGES="name ..." runs only
# those stages (after setup); GPU_CHECK_SECONDS moves the deadline (default 340).
set +e
START=$SECONDS
DEADLINE=${GPU_CHECK_SECONDS:-340}
OUT=${OUT:-$PWD/gpu-out}
# The device tool brings back at most 8 files: each stage's JSON goes to $RES, packed into one archive at the end.
RES=${GPU_CHECK_RESULTS:-/tmp/gpu-check}
mkdir -p "$OUT" "$RES"
LOG=$OUT/gpu_check.log
exec > >(tee -a "$LOG") 2>&1

export PYTHONPATH=$PWD/.site:$PWD TQDM_DISABLE=1 PYTHONUNBUFFERED=1 MINIVLLM_TOKENIZER_DIR=$PWD/.gpu-kit/tok
MODEL=ckpt/llama_1b
COMMON=(--device cuda --dtype bfloat16 --kv-cache-memory 16GiB)

# stage NAME SECONDS COMMAND...: runs COMMAND under min(SECONDS, what is left of the deadline)
stage() {
    local name=$1 limit=$2; shift 2
    if [ -n "$STAGES" ] && [ "$name" != setup ] && [[ " $STAGES " != *" $name "* ]]; then return; fi
    local left=$((DEADLINE - (SECONDS - START)))
    if [ "$left" -lt 20 ]; then echo "=== $name: SKIPPED (deadline)"; echo "$name skipped" >> "$RES/stages.txt"; return; fi
    [ "$limit" -gt "$left" ] && limit=$left
    echo "=== $name (limit ${limit}s, at $((SECONDS - START))s): $*"
    local t0=$SECONDS
    timeout "$limit" "$@"
    local rc=$?
    echo "=== $name: rc=$rc in $((SECONDS - t0))s"
    echo "$name rc=$rc seconds=$((SECONDS - t0))" >> "$RES/stages.txt"
}

stage setup 90 bash -c '
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
    python3 -c "import torch, triton, transformers; print(\"torch\", torch.__version__, \"triton\", triton.__version__, \"transformers\", transformers.__version__)"
    python3 -m pip install -q --no-index --no-deps --target .site .gpu-kit/whl/*.whl
    python3 .gpu-kit/make_checkpoints.py ckpt .gpu-kit/tok'

# Correctness first: the kernels (bf16 too) and the engine on tiny random checkpoints.
stage pytest 120 python3 -m pytest -q -rs -p no:cacheprovider tests/test_cuda.py
stage invariance_smol135m 60 python3 scripts/gpu_figures.py invariance ckpt/smol135m --out "$RES/invariance_smol135m.json"
stage invariance_qwen2_05b 60 python3 scripts/gpu_figures.py invariance ckpt/qwen2_05b --out "$RES/invariance_qwen2_05b.json"

# Speed on the 1.2B Llama shape: batch-1 decode with graphs and eager, batch 64, then throughput.
stage latency_b1_graphs 60 python3 -m minivllm.cli bench latency --model $MODEL "${COMMON[@]}" --batch-size 1 \
    --input-len 128 --output-len 256 --max-num-seqs 64 --output-json "$RES/latency_b1_graphs.json"
stage latency_b1_eager 60 python3 -m minivllm.cli bench latency --model $MODEL "${COMMON[@]}" --batch-size 1 \
    --input-len 128 --output-len 256 --max-num-seqs 64 --enforce-eager --output-json "$RES/latency_b1_eager.json"
stage latency_b64_graphs 60 python3 -m minivllm.cli bench latency --model $MODEL "${COMMON[@]}" --batch-size 64 \
    --input-len 128 --output-len 256 --max-num-seqs 64 --num-iters 2 --output-json "$RES/latency_b64_graphs.json"
stage throughput_1000x512x256 110 python3 -m minivllm.cli bench throughput --model $MODEL "${COMMON[@]}" \
    --num-prompts 1000 --input-len 512 --output-len 256 --disable-tqdm --output-json "$RES/throughput_1000x512x256.json"
stage gemm_vs_cublas 45 python3 scripts/gpu_figures.py gemm --out "$RES/gemm_vs_cublas.json"
stage float32_vs_transformers 60 python3 scripts/gpu_figures.py hf ckpt/smol135m --out "$RES/float32_vs_transformers.json"

python3 scripts/gpu_figures.py summary "$RES" --out "$OUT/figures.json"
tar czf "$OUT/stage_results.tgz" -C "$RES" .
cp "$RES/stages.txt" "$OUT/"; cat "$OUT/stages.txt"
echo "total $((SECONDS - START))s"
