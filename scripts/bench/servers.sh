# Shared by the benchmark scripts beside it (sourced): the checkout they run (REPO, default the one holding
# these scripts, made the
# working directory), its Python and CLI, the 0.5B file; a log line with the time, a server's start and
# stop. The caller sets OUT (the results folder) first, and pid (the server being waited for or stopped).
REPO=${REPO:-$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)}
cd "$REPO" || exit 1
PY=$REPO/.venv/bin/python
export PYTHONPATH=$REPO
MV="$PY -m minivllm.cli"
mkdir -p "$OUT"
M05=$HOME/.cache/minivllm/models/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf
PEERS=$HOME/.cache/minivllm-peers
VLLM_PY=$PEERS/vllm/bin/python  # ../shared/peers/setup_vllm_cpu.sh
VLLM_ENV="OMP_NUM_THREADS=2 VLLM_CPU_OMP_THREADS_BIND=0-1 VLLM_CPU_KVCACHE_SPACE=2"

log() { echo "[$(date -u +%H:%M:%S)] $*" | tee -a "$OUT/run.log"; }

wait_healthy() {  # url name: up to 15 min (a cold start compiles kernels, packs weights)
  local i
  for i in $(seq 900); do
    if curl -sf -o /dev/null "$1/health"; then return 0; fi
    if ! kill -0 "$pid" 2>/dev/null; then log "$2 exited while starting; see $OUT/$2.log"; return 1; fi
    sleep 1
  done
  log "$2 not healthy after 900 s"; return 1
}

stop_server() {
  kill "$pid"; wait "$pid"
  log "stopped (exit code $?)"
}

start_vllm() {  # name port checkpoint [api_server args...]
  local name=$1 port=$2 ckpt=$3; shift 3
  env $VLLM_ENV "$VLLM_PY" -m vllm.entrypoints.openai.api_server --model "$ckpt" --dtype bfloat16 \
    --max-model-len 8192 --port "$port" "$@" > "$OUT/$name.log" 2>&1 &
  pid=$!
  wait_healthy "http://127.0.0.1:$port" "$name"
}

hf_checkpoint_05b() {  # the 0.5B GGUF's weights as an HF checkpoint vLLM loads (dequantized, like setup_vllm_cpu.sh)
  local ckpt=$PEERS/qwen2.5-coder-0.5b-hf
  if [ ! -f "$ckpt/model.safetensors" ]; then
    "$VLLM_PY" - "$M05" "$ckpt" >&2 <<'PY'
import os, sys, torch
from transformers import AutoModelForCausalLM, AutoTokenizer
path, out = sys.argv[1], sys.argv[2]
d, name = os.path.dirname(path), os.path.basename(path)
tok = AutoTokenizer.from_pretrained(d, gguf_file=name)
model = AutoModelForCausalLM.from_pretrained(d, gguf_file=name, dtype=torch.float32)
model.hf_quantizer = None
if hasattr(model.config, "quantization_config"):
    del model.config.quantization_config
model.save_pretrained(out, safe_serialization=True)
tok.save_pretrained(out)
PY
  fi
  echo "$ckpt"
}
