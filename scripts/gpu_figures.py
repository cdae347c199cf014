"""The figures scripts/gpu_check.sh collects on a GPU host that the CLI's benchmarks do not give, each
printed and written as JSON: `invariance CKPT` (bf16: 8 prompts alone vs in a crowd of 32, by equality),
`hf CKPT` (float32 greedy vs transformers on the GPU), `gemm` (the invariant Triton GEMM against cuBLAS at
the 1.2B Llama's shapes) and `summary DIR` (one figures.json from the stages' JSON files).
Usage: python3 scripts/gpu_figures.py STAGE [ARG] --out FILE.json"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

PROMPTS = ["Hello", "The capital of France is", "def fibonacci(n):", "Once upon a time, in a land far away,",
           "List three colours:", "import numpy as np\n", "Translate to French: the cat sleeps.",
           "The quick brown fox jumps over the lazy dog. " * 12]
CROWD = [f"Tell me about the {a} and the {b}. " * r for r, (a, b) in
         enumerate([("sea", "moon"), ("fox", "hen"), ("king", "coin"), ("lamp", "road")] * 6, 1)]


def _greedy(max_tokens: int):
    from minivllm import SamplingParams

    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=3)


def invariance(ckpt: str) -> dict:
    from minivllm import LLM

    llm = LLM(ckpt, device="cuda", dtype="bfloat16", enable_prefix_caching=False, kv_cache_memory="4GiB")
    runs = lambda outs: [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs]  # noqa: E731
    alone = [runs(llm.generate([p], _greedy(32), use_tqdm=False))[0] for p in PROMPTS]
    crowd = runs(llm.generate(CROWD + PROMPTS, [_greedy(16 + i) for i in range(len(CROWD))] + [_greedy(32)] * 8,
                              use_tqdm=False))[len(CROWD):]
    same_tokens = sum(a[0] == c[0] for a, c in zip(alone, crowd))
    same_logprobs = sum(a == c for a, c in zip(alone, crowd))
    return {"model": ckpt, "batch_invariant_flag": llm.engine.runner.batch_invariant,
            "equal_tokens": f"{same_tokens}/{len(PROMPTS)}",
            "equal_tokens_and_logprobs": f"{same_logprobs}/{len(PROMPTS)}"}


def hf(ckpt: str) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    from minivllm import LLM

    llm = LLM(ckpt, device="cuda", dtype="float32", kv_cache_memory="4GiB")
    outs = llm.generate(PROMPTS, _greedy(16), use_tqdm=False)
    llm.engine.close()
    del llm
    torch.cuda.empty_cache()
    model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).cuda().eval()
    equal = 0
    for o in outs:
        ids = torch.tensor([o.prompt_token_ids], device="cuda")
        ref = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=16,
                             min_new_tokens=16, pad_token_id=0)[0, ids.shape[1]:].tolist()
        equal += ref == o.outputs[0].token_ids
    return {"model": ckpt, "float32_equal_to_transformers": f"{equal}/{len(outs)}"}


def gemm() -> dict:
    import torch
    import triton

    from minivllm.model import triton_kernels

    shapes = {"qkv": (3072, 2048), "o": (2048, 2048), "gate_up": (16384, 2048), "down": (2048, 8192),
              "lm_head": (49152, 2048)}
    rows = {}
    for m in (1, 64, 2048):
        for name, (n, k) in shapes.items():
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
            ours = triton.testing.do_bench(lambda: triton_kernels.gemm(x, w, None))
            cublas = triton.testing.do_bench(lambda: torch.matmul(x, w.T))
            rows[f"M={m} {name} N={n} K={k}"] = {"triton_us": round(ours * 1e3, 1), "cublas_us": round(cublas * 1e3, 1),
                                                 "ratio": round(ours / cublas, 2),
                                                 "split": triton_kernels.gemm_split(n, k)}
            print(f"M={m:5d} {name:8s} N={n:6d} K={k:5d}: triton {ours * 1e3:8.1f} us, cuBLAS {cublas * 1e3:8.1f} us, "
                  f"x{ours / cublas:.2f}", flush=True)
    return rows


def summary(directory: str) -> dict:
    """Every stage's JSON in `directory`, and the headline figures pulled out of the benchmarks'."""
    out: dict = {"date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())}
    for f in sorted(Path(directory).glob("*.json")):
        if f.name == "figures.json":
            continue
        try:
            data = json.loads(f.read_text())
        except ValueError:
            out[f.stem] = "unreadable"
            continue
        result = data.get("result", data) if isinstance(data, dict) else data
        if f.stem.startswith("latency"):
            out[f.stem] = {k: result.get(k) for k in ("decode_tokens_per_s", "batch_output_tokens_per_s",
                                                      "prefill_tokens_per_s", "decode_step_ms") if k in result}
        elif f.stem.startswith("throughput"):
            out[f.stem] = {k: v for k, v in result.items() if not isinstance(v, (list, dict))}
        else:
            out[f.stem] = data
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("stage", choices=("invariance", "hf", "gemm", "summary"))
    parser.add_argument("arg", nargs="?")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    stages = {"invariance": lambda: invariance(args.arg), "hf": lambda: hf(args.arg), "gemm": gemm,
              "summary": lambda: summary(args.arg)}
    result = stages[args.stage]()
    text = json.dumps(result, indent=1, default=str)
    Path(args.out).write_text(text)
    print(text if args.stage != "summary" else f"wrote {args.out}", file=sys.stdout, flush=True)


if __name__ == "__main__":
    main()
