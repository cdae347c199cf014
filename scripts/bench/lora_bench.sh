#!/bin/bash
# Issue 32 (many LoRA adapters batched): the benchmarks, to run ALONE on the machine.
#   bash scripts/bench/lora_bench.sh         # REPO: this checkout by default; OUT: ./runs/lora_bench_out
# On the 0.5B file (Qwen2.5-Coder-0.5B-Instruct Q4_K_M), 8 random adapters of rank 16 on all seven
# projections (PEFT layout, and converted to llama.cpp's LoRA GGUF by its own converter):
#   (a) 16 concurrent requests round-robin over the 8 adapters vs the same 16 requests on the base,
#       same `minivllm serve` (target: with adapters >= 80 % of without)
#   (b) the same 16 adapter requests against llama-server with the 8 GGUF adapters (--lora-init-without-apply,
#       per-request "lora": [{"id", "scale"}]) (target: minivllm >= 3x llama-server's total throughput)
#   (c) an adapter loaded at runtime (POST /v1/load_lora_adapter): the load's time, and the TTFT of its first
#       request vs a request to an adapter already loaded
#   SKIP_LLAMA=1 runs minivllm alone ((a) and (c)), without converting the adapters for llama.cpp.
# Results: $OUT (bench JSONs, server logs, summary.md). Ports 8451-8459.
set -u
HERE=$(cd "$(dirname "$0")" && pwd)  # before the cd below: servers.sh lies beside this script
OUT=${OUT:-$PWD/runs/lora_bench_out}
source "$HERE/servers.sh"  # REPO (cd there), PY, MV, M05; log, wait_healthy, stop_server
LLAMA_SERVER=$HOME/.cache/minivllm-peers/llama.cpp/build-noamx/bin/llama-server
[ -x "$LLAMA_SERVER" ] || LLAMA_SERVER=$HOME/.cache/minivllm-peers/llama.cpp/build/bin/llama-server
ADAPTERS=$OUT/adapters
WORKLOAD="--dataset random --input-len 256 --output-len 128 --num-prompts 16 --max-concurrency 16 --seed 0"
NAMES="a0 a1 a2 a3 a4 a5 a6 a7"
pid=""


bench() {  # name port extra-args...
  local name=$1 port=$2; shift 2
  log "bench $name"
  $MV bench serve --base-url "http://127.0.0.1:$port" --model "$M05" $WORKLOAD --disable-tqdm \
    --output-json "$OUT/$name.json" "$@" > "$OUT/$name.txt" 2>&1 || log "bench $name failed; see $OUT/$name.txt"
}

# -- the adapters: 9 of rank 16 for Qwen2.5-0.5B's shapes (a8: loaded at runtime in (c)) -----------------
if [ -z "${ONLY_LLAMA:-}" ]; then
log "making adapters in $ADAPTERS"
$PY - "$ADAPTERS" <<'EOF'
import json, sys
from pathlib import Path
import torch
from safetensors.torch import save_file

root = Path(sys.argv[1])
hidden, heads, kv_heads, head_dim, inter, layers, rank = 896, 14, 2, 64, 4864, 24, 16
shapes = {"q_proj": (heads * head_dim, hidden), "k_proj": (kv_heads * head_dim, hidden),
          "v_proj": (kv_heads * head_dim, hidden), "o_proj": (hidden, heads * head_dim),
          "gate_proj": (inter, hidden), "up_proj": (inter, hidden), "down_proj": (hidden, inter)}
base = root / "base"  # what convert_lora_to_gguf.py reads of the base: its config
base.mkdir(parents=True, exist_ok=True)
(base / "config.json").write_text(json.dumps({
    "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": hidden,
    "num_attention_heads": heads, "num_key_value_heads": kv_heads, "intermediate_size": inter,
    "num_hidden_layers": layers, "vocab_size": 151936, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
    "max_position_embeddings": 32768, "tie_word_embeddings": True, "hidden_act": "silu",
    "torch_dtype": "bfloat16"}))
for i in range(9):
    g = torch.Generator().manual_seed(i)
    tensors = {}
    for layer in range(layers):
        for m, (out, inp) in shapes.items():
            part = "mlp" if m in ("gate_proj", "up_proj", "down_proj") else "self_attn"
            prefix = f"base_model.model.model.layers.{layer}.{part}.{m}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, inp, generator=g) * 0.01
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(out, rank, generator=g) * 0.01
    path = root / f"a{i}"
    path.mkdir(exist_ok=True)
    save_file(tensors, str(path / "adapter_model.safetensors"))
    (path / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": 2 * rank,
        "target_modules": list(shapes), "lora_dropout": 0.0, "bias": "none", "use_rslora": False,
        "base_model_name_or_path": None}))
print("adapters written")
EOF
for i in 0 1 2 3 4 5 6 7; do
  [ -n "${SKIP_LLAMA:-}" ] || [ -f "$ADAPTERS/a$i.gguf" ] || $PY -c "
import sys; sys.path.insert(0, '$REPO')
from pathlib import Path
from tests.llama_cpp import convert_lora
convert_lora(Path('$ADAPTERS/a$i'), Path('$ADAPTERS/base'), Path('$ADAPTERS/a$i.gguf'), 'f16')" \
    >> "$OUT/convert.log" 2>&1 || log "convert a$i failed; see $OUT/convert.log"
done

# -- (a) and (c): minivllm serve with the 8 adapters -------------------------------------------------------
MODULES=""
for n in $NAMES; do MODULES="$MODULES $n=$ADAPTERS/$n"; done
log "minivllm serve with 8 adapters"
# No prefix caching: the runs share their prompts, and the base's would hit its own earlier run.
$MV serve "$M05" --port 8451 --enable-lora --max-loras 8 --max-cpu-loras 9 --max-lora-rank 16 \
  --no-enable-prefix-caching --lora-modules $MODULES > "$OUT/minivllm.log" 2>&1 &
pid=$!
if wait_healthy http://127.0.0.1:8451 minivllm; then
  bench minivllm_base 8451
  bench minivllm_lora 8451 --lora-modules $NAMES
  bench minivllm_base_again 8451
  log "runtime load of a8, and TTFT of its first request"
  ADAPTERS="$ADAPTERS" $PY - <<'EOF' > "$OUT/runtime_load.txt" 2>&1
import json, os, time
import httpx

url = "http://127.0.0.1:8451"
def ttft(model: str) -> float:
    body = {"model": model, "prompt": "def quicksort(items):", "max_tokens": 8, "temperature": 0, "stream": True}
    start = time.perf_counter()
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=None) as r:
        for line in r.iter_lines():
            if line.startswith("data:") and '"choices"' in line:
                return time.perf_counter() - start
    raise RuntimeError("no token")
warm = [ttft("a0") for _ in range(3)]
start = time.perf_counter()
r = httpx.post(f"{url}/v1/load_lora_adapter", json={"lora_name": "a8", "lora_path": os.environ["ADAPTERS"] + "/a8"},
               timeout=None)
load_s = time.perf_counter() - start
first = ttft("a8")
again = ttft("a8")
print(json.dumps({"load_status": r.status_code, "load_s": load_s, "ttft_first_request_s": first,
                  "load_plus_ttft_s": load_s + first, "ttft_second_request_s": again,
                  "ttft_loaded_adapter_s": sorted(warm)[1]}, indent=1))
EOF
  cat "$OUT/runtime_load.txt" | tee -a "$OUT/run.log"
  stop_server
fi

fi
# -- (b) llama-server with the 8 GGUF adapters --------------------------------------------------------------
if [ -n "${SKIP_LLAMA:-}" ]; then
  log "SKIP_LLAMA: no llama-server run"
elif [ -x "$LLAMA_SERVER" ]; then
  LORAS=""
  for n in $NAMES; do LORAS="$LORAS --lora $ADAPTERS/$n.gguf"; done
  log "llama-server ($LLAMA_SERVER) with 8 adapters"
  "$LLAMA_SERVER" -m "$M05" -t 2 -c 8192 -np 16 --port 8452 $LORAS --lora-init-without-apply \
    > "$OUT/llama_server.log" 2>&1 &
  pid=$!
  if wait_healthy http://127.0.0.1:8452 llama_server; then
    bench llama_server_base 8452 --served-model-name base
    bench llama_server_lora 8452 --served-model-name base --lora-field lora --lora-modules 0 1 2 3 4 5 6 7
    stop_server
  fi
else
  log "no llama-server binary found; skipping (b)"
fi

# -- summary ---------------------------------------------------------------------------------------------------
$PY - "$OUT" <<'EOF' | tee "$OUT/summary.md"
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
def tput(name):
    p = out / f"{name}.json"
    if not p.exists():
        return None
    m = json.loads(p.read_text())
    m = m.get("metrics", m)
    return m.get("total_token_throughput") or m.get("output_throughput")
rows = {n: tput(n) for n in ("minivllm_base", "minivllm_base_again", "minivllm_lora", "llama_server_base",
                             "llama_server_lora")}
print("| run | total tok/s |\n|---|---|")
for n, v in rows.items():
    print(f"| {n} | {v if v is None else round(v, 1)} |")
base = [v for v in (rows["minivllm_base"], rows["minivllm_base_again"]) if v]
if base and rows["minivllm_lora"]:
    print(f"\nminivllm with 8 adapters / without: {rows['minivllm_lora'] / max(base):.2f} (target >= 0.80)")
if rows["minivllm_lora"] and rows["llama_server_lora"]:
    print(f"minivllm / llama-server, both with adapters: {rows['minivllm_lora'] / rows['llama_server_lora']:.2f}x "
          "(target >= 3x)")
p = out / "runtime_load.txt"
if p.exists():
    print("\nruntime load of an adapter:\n```\n" + p.read_text() + "```")
EOF
log "done; summary in $OUT/summary.md"
