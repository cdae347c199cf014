#!/usr/bin/env bash
# Model families benchmark (issue 28), for the lead to run on a quiet machine (~15-20 min).
# Per family: a random ~0.5B checkpoint made by transformers from the family's own config class (the
# Llama shape's sizes, the family's switches on), saved, converted to GGUF bf16 by llama.cpp's converter
# and quantized to Q4_K_M by llama-quantize; then batch-1 latency and 16-request throughput in bf16
# (GGUF bf16 file) and Q4_K_M, next to the Llama shape of the same size. Report: tokens/s x non-embedding
# parameters, relative to the Llama shape's (target: within 15 %). The 16 requests are the fixed workload's first 16.
# Gemma 2's converter needs a SentencePiece tokenizer.model: a small one is trained (tests/helpers.py); the
# converter pads it to the checkpoint's vocabulary, and the workload's lengths are in tokens, so the runs compare.
set -euo pipefail
WT=${WT:-$(cd "$(dirname "$0")/../.." && pwd)}
PY=${PY:-$WT/.venv/bin/python}
OUT=${OUT:-$PWD/runs/families_bench_out}
QUANTIZE=${QUANTIZE:-$HOME/.cache/minivllm-peers/llama.cpp/build/bin/llama-quantize}
FAMILIES=${FAMILIES:-"llama qwen3 gemma2 gemma3 phi3 smollm3 granite"}
mkdir -p "$OUT"
cd "$WT"
export PYTHONPATH=$WT

echo "== checkpoints"
"$PY" - "$OUT" $FAMILIES <<'PYEOF'
import json, sys
from pathlib import Path
import torch
import transformers as t
from minivllm.model.loader import default_model_path
from minivllm.model.tokenizer import get_tokenizer
from minivllm.model.loader import load_checkpoint
import shutil
from tests.helpers import sentencepiece_tokenizer
from tests.llama_cpp import convert_hf

out, families = Path(sys.argv[1]), sys.argv[2:]
tok_dir = out / "tokenizer"
if not tok_dir.exists():
    path = Path(default_model_path())
    get_tokenizer(path, load_checkpoint(path)[0]).hf.save_pretrained(tok_dir)
# ~0.5B: hidden 1024, 24 layers, MLP 4096 (~0.4B non-embedding) + a 49152-token vocabulary (tied).
base = dict(vocab_size=49152, hidden_size=1024, intermediate_size=4096, num_hidden_layers=24,
            num_attention_heads=16, num_key_value_heads=4, max_position_embeddings=4096,
            tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=0)
configs = {
    "llama": lambda: t.LlamaConfig(**base),
    "qwen3": lambda: t.Qwen3Config(**base, head_dim=64),
    "gemma2": lambda: t.Gemma2Config(**base, head_dim=64, query_pre_attn_scalar=64, sliding_window=512),
    "gemma3": lambda: t.Gemma3TextConfig(**base, head_dim=64, query_pre_attn_scalar=64, sliding_window=512),
    "phi3": lambda: t.Phi3Config(**{**base, "tie_word_embeddings": False}, sliding_window=None,
                                 rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0,
                                                  "partial_rotary_factor": 0.75, "short_factor": [1.0] * 24,
                                                  "long_factor": [4.0] * 24},
                                 original_max_position_embeddings=2048),
    "smollm3": lambda: t.SmolLM3Config(**base),
    "granite": lambda: t.GraniteConfig(**base, embedding_multiplier=12.0, attention_multiplier=0.0078125,
                                       residual_multiplier=0.22, logits_scaling=8.0),
}
sizes = {}
for kind in families:
    d = out / kind
    if not (d / "config.json").exists():
        torch.manual_seed(0)
        model = t.AutoModelForCausalLM.from_config(configs[kind](), dtype=torch.bfloat16)
        model.save_pretrained(d)
        if kind == "gemma2":  # its converter reads a SentencePiece tokenizer.model (padded to the vocabulary)
            sentencepiece_tokenizer(d)
        else:
            shutil.copytree(tok_dir, d, dirs_exist_ok=True)
        if kind == "phi3":  # GPT-2's tokenizer, as Phi-4-mini's: what llama.cpp's converter takes from the class
            cfg = json.loads((d / "tokenizer_config.json").read_text())
            (d / "tokenizer_config.json").write_text(json.dumps({**cfg, "tokenizer_class": "GPT2Tokenizer"}))
    cfg, weights = load_checkpoint(d)
    total = embed = 0
    for name, w in weights:
        total += w.numel()
        if "embed_tokens" in name or name.startswith("lm_head"):
            embed += w.numel()
    sizes[kind] = {"params": total, "non_embedding": total - embed}
    if not (out / f"{kind}.bf16.gguf").exists():
        convert_hf(d, out / f"{kind}.bf16.gguf", "bf16")
(out / "sizes.json").write_text(json.dumps(sizes, indent=1))
print(json.dumps(sizes, indent=1))
PYEOF

for kind in $FAMILIES; do
  if [ ! -f "$OUT/$kind.Q4_K_M.gguf" ]; then
    "$QUANTIZE" "$OUT/$kind.bf16.gguf" "$OUT/$kind.Q4_K_M.gguf" Q4_K_M > "$OUT/$kind.quantize.log" 2>&1
  fi
done

run() {  # family, variant, model path, extra args
  local kind=$1 variant=$2 model=$3; shift 3
  echo "== $kind $variant"
  "$PY" -m minivllm.cli bench latency --model "$model" --dtype bfloat16 --batch-size 1 --input-len 128 \
      --output-len 32 --num-iters-warmup 1 --num-iters 3 --output-json "$OUT/$kind.$variant.latency.json" "$@" \
      > "$OUT/$kind.$variant.latency.log" 2>&1 || echo "   latency failed: $OUT/$kind.$variant.latency.log"
  "$PY" -m minivllm.cli bench throughput --model "$model" --dtype bfloat16 --num-prompts 16 --dataset fixed \
      --disable-tqdm --output-json "$OUT/$kind.$variant.throughput.json" "$@" \
      > "$OUT/$kind.$variant.throughput.log" 2>&1 || echo "   throughput failed: $OUT/$kind.$variant.throughput.log"
}

for kind in $FAMILIES; do
  run "$kind" bf16 "$OUT/$kind.bf16.gguf"
  run "$kind" Q4_K_M "$OUT/$kind.Q4_K_M.gguf" --quantization gguf
done

echo "== summary (tokens/s x non-embedding params, relative to the Llama shape; target within 15 %)"
"$PY" - "$OUT" $FAMILIES <<'PYEOF' | tee "$OUT/summary.txt"
import json, sys
from pathlib import Path
out, families = Path(sys.argv[1]), sys.argv[2:]
sizes = json.loads((out / "sizes.json").read_text())

def rates(kind, variant):
    lat, thr = out / f"{kind}.{variant}.latency.json", out / f"{kind}.{variant}.throughput.json"
    b1 = 1000 / json.loads(lat.read_text())["result"]["decode_step_ms"] if lat.exists() else None
    t = json.loads(thr.read_text())["result"] if thr.exists() else None
    return b1, (t["total_output_tokens"] / t["elapsed"] if t else None)

print(f"{'family':9} {'variant':7} {'non-emb M':>9} {'b1 tok/s':>9} {'x16 tok/s':>9} {'b1 rel':>7} {'x16 rel':>7}")
for variant in ("bf16", "Q4_K_M"):
    ref = rates("llama", variant)
    for kind in families:
        b1, x16 = rates(kind, variant)
        if b1 is None and x16 is None:
            continue
        n = sizes[kind]["non_embedding"] / sizes["llama"]["non_embedding"]
        rel = [f"{r * n / base:7.2f}" if r and base else "      -" for r, base in ((b1, ref[0]), (x16, ref[1]))]
        print(f"{kind:9} {variant:7} {sizes[kind]['non_embedding'] / 1e6:9.0f} {b1 or 0:9.1f} {x16 or 0:9.1f} "
              + " ".join(rel))
PYEOF
