"""`minivllm bench prefill`: the wait for the first token as the context grows.

One request at a time, of each --input-lens length (random token ids, so the prefix cache serves none):
its time to the first token, which on a CPU is the prefill, and the prefill rate. Each rate is also a
share of this machine's peaks for the model's work (its layers' matrix products plus attention's QK^T
and PV over the causal context), measured in the same run: the AMX tiles' bf16 peak from registers (no
memory; `amx_peak_ops`) where the CPU has them, and torch's own matrix product at 2,048^3 in the
engine's dtype (bf16 on oneDNN, on the tiles where there are any; float32 where the CPU has no bf16
arithmetic, whose bf16 product torch only emulates), the rate a real GEMM reaches. With --llama-bench
PATH, llama.cpp's `llama-bench -p N -n 0` runs on the same file at each length in the same sitting (the
better of flash attention off and on), and --plot draws both engines' rates against the context as a PNG.
"""
from __future__ import annotations

import json
import os
import subprocess
import time
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch

from minivllm.bench.roofline import best_time, model_gemms, tile_peaks
from minivllm.config import EngineConfig
from minivllm.engine.llm_engine import LLMEngine
from minivllm.model.loader import resolve_model_path
from minivllm.model.model_config import ModelConfig
from minivllm.sampling_params import SamplingParams


@dataclass
class PrefillPoint:
    input_len: int
    ttft_s: float  # the best of the runs: a shared machine only ever makes one slower
    tokens_per_s: float
    flops: float  # the model's matrix and attention work for this prompt
    llama_cpp_tokens_per_s: float | None = None


@dataclass
class Peaks:
    tile_bf16_flops: float | None  # the AMX tiles' bf16 rate from registers; None without AMX
    tile_int8_ops: float | None
    torch_matmul_flops: float  # torch's matrix product at 2,048^3 in torch_matmul_dtype
    torch_matmul_dtype: str  # the engine's: bfloat16 or float32


def prompt_flops(config: ModelConfig, n: int) -> float:
    """Multiply-adds x 2 of a prompt of n tokens: the layers' linear layers for every token, and per
    layer, head and query 2 x head_dim for each key it sees in QK^T and again in PV (a sliding window
    caps the keys; the one sampled token's LM head is left out)."""
    body, _ = model_gemms(config)
    matrix = sum(s.flops(n) for s in body)
    keys = 0
    for layer in range(config.num_hidden_layers):
        window = config.layer_window(layer)
        ctx = np.arange(1, n + 1)
        keys += int(np.minimum(ctx, window).sum() if window else ctx.sum())
    return matrix + 4 * config.num_attention_heads * config.head_dim * keys


def measure_peaks(device: torch.device, dtype: torch.dtype) -> Peaks:
    x = torch.randn(2048, 2048, dtype=dtype, device=device)
    torch_rate = 2 * 2048 ** 3 / best_time(lambda: x @ x, device, rounds=3)
    return Peaks(*tile_peaks(device), torch_rate, str(dtype).removeprefix("torch."))


def llama_bench_rate(binary: str, model: Path, n: int, threads: int, flash_attention: str = "0,1") -> float:
    """llama-bench's prefill tokens/s for n tokens: the best of its flash-attention settings (off and on)."""
    out = subprocess.run([binary, "-m", str(model), "-p", str(n), "-n", "0", "-t", str(threads), "-r", "1",
                          "-fa", flash_attention, "-o", "json"], check=True, capture_output=True, text=True).stdout
    return max(float(r["avg_ts"]) for r in json.loads(out))


def run_prefill(config: EngineConfig, lengths: list[int], runs: int = 1, llama_bench: str | None = None,
                flash_attention: str = "0,1", progress=None) -> tuple[list[PrefillPoint], Peaks]:
    config = replace(config, max_model_len=max(config.max_model_len or 0, max(lengths) + 1),
                     enable_prefix_caching=False)
    engine = LLMEngine(config)
    rng = np.random.default_rng(0)
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    vocab = engine.model_config.vocab_size

    def ttft(n: int) -> float:
        engine.add_request(f"prefill-{n}-{time.perf_counter_ns()}", rng.integers(1000, vocab - 1000, n).tolist(), params)
        start = time.perf_counter()
        while engine.has_unfinished_requests():
            engine.step()
        return time.perf_counter() - start

    ttft(min(512, min(lengths)))  # warm-up: first touch of the pool and the kernels
    points = []
    for n in lengths:
        if progress:
            progress(f"{n} tokens")
        best = min(ttft(n) for _ in range(runs))
        points.append(PrefillPoint(n, best, n / best, prompt_flops(engine.model_config, n)))
    engine.close()
    if llama_bench:
        threads = int(os.environ.get("OMP_NUM_THREADS") or torch.get_num_threads())
        model_file = resolve_model_path(config.model)  # the default model's file where none was named
        for p in points:
            if progress:
                progress(f"llama-bench -p {p.input_len}")
            p.llama_cpp_tokens_per_s = llama_bench_rate(llama_bench, model_file, p.input_len, threads, flash_attention)
    return points, measure_peaks(config.torch_device, config.torch_dtype)


def format_prefill(points: list[PrefillPoint], peaks: Peaks, model: str) -> str:
    tile = f"{peaks.tile_bf16_flops / 1e9:,.0f}" if peaks.tile_bf16_flops else "no AMX"
    lines = [f"Prefill of {model}, one request at a time. Peaks measured now: AMX bf16 tiles {tile} GFLOP/s"
             + (f" (int8 {peaks.tile_int8_ops / 1e9:,.0f} GOP/s)" if peaks.tile_int8_ops else "")
             + f", torch {peaks.torch_matmul_dtype} matmul {peaks.torch_matmul_flops / 1e9:,.0f} GFLOP/s",
             f"{'tokens':>7} {'TTFT s':>8} {'tok/s':>8} {'GFLOP/s':>8} {'of tiles':>8} {'of matmul':>9}"
             f" {'llama.cpp':>9} {'ratio':>6}"]
    for p in points:
        rate = p.flops / p.ttft_s
        tiles = f"{rate / peaks.tile_bf16_flops:.1%}" if peaks.tile_bf16_flops else "-"
        peer = (f"{p.llama_cpp_tokens_per_s:9.1f} {p.tokens_per_s / p.llama_cpp_tokens_per_s:5.2f}x"
                if p.llama_cpp_tokens_per_s else f"{'-':>9} {'-':>6}")
        lines.append(f"{p.input_len:7d} {p.ttft_s:8.2f} {p.tokens_per_s:8.1f} {rate / 1e9:8.0f} {tiles:>8} "
                     f"{rate / peaks.torch_matmul_flops:9.1%} {peer}")
    return "\n".join(lines)


def plot_prefill(points: list[PrefillPoint], model: str, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    lengths = [p.input_len for p in points]
    ax.plot(lengths, [p.tokens_per_s for p in points], "o-", label="minivllm")
    if any(p.llama_cpp_tokens_per_s for p in points):
        ax.plot(lengths, [p.llama_cpp_tokens_per_s or float("nan") for p in points], "s--", label="llama.cpp (llama-bench)")
    ax.set(xscale="log", xlabel="prompt tokens", ylabel="prefill tokens/s", title=f"Prefill rate against context: {model}")
    ax.set_xticks(lengths, [f"{n // 1024}k" if n >= 1024 else str(n) for n in lengths])
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
