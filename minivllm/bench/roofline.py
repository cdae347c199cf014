"""`minivllm bench roofline`: this machine's ceilings for the model, measured rather than quoted.

It times F.linear at the model's own [tokens x in] x [in x out] shapes (read off the model code) in
bfloat16 and float32, and the memory read bandwidth, and derives:
  - prefill tokens/s if compute-bound: the decoder layers' GEMMs only (one sampled token per
    prompt makes the lm_head negligible);
  - large-batch decode tokens/s if compute-bound: the layers plus the lm_head for every token;
  - batch-1 decode tokens/s if memory-bound: every weight is read once per token.
Attention's own FLOPs (QK^T, PV) and element-wise work are left out: GEMMs dominate at these
lengths, so these are ceilings. Measured in the same run as a throughput figure, they turn it
into a ratio that does not depend on how busy or fast the machine was that day.
"""
from __future__ import annotations

import math
import re
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from minivllm.model.kernels import amx_peak, read_stream
from minivllm.model.decoder import CausalLM
from minivllm.model.model_config import ModelConfig

DTYPES = ("bfloat16", "float32")


@dataclass
class GemmShape:
    name: str  # the layer's module name, e.g. qkv_proj
    in_features: int
    out_features: int
    count: int  # how many such layers the model has

    def flops(self, tokens: int) -> int:
        return 2 * tokens * self.in_features * self.out_features * self.count


@dataclass
class GemmTiming:
    shape: GemmShape
    seconds: float  # one call at the measured number of tokens

    def gflops(self, tokens: int) -> float:
        return self.shape.flops(tokens) / self.shape.count / self.seconds / 1e9


@dataclass
class DtypeRoofline:
    dtype: str
    tokens: int
    body: list[GemmTiming]  # the decoder layers' GEMMs
    lm_head: GemmTiming
    weight_bytes: int

    @property
    def body_seconds(self) -> float:
        return sum(t.seconds * t.shape.count for t in self.body)

    @property
    def gemm_gflops(self) -> float:
        """The rate of a whole forward's GEMMs (lm_head included) at this many tokens."""
        timings = [*self.body, self.lm_head]
        flops = sum(t.shape.flops(self.tokens) for t in timings)
        return flops / (self.body_seconds + self.lm_head.seconds) / 1e9

    @property
    def prefill_tokens_per_s(self) -> float:
        return self.tokens / self.body_seconds

    @property
    def decode_tokens_per_s(self) -> float:
        return self.tokens / (self.body_seconds + self.lm_head.seconds)


@dataclass
class Roofline:
    device: str
    threads: int
    tokens: int
    read_bandwidth: float  # bytes/s
    per_dtype: dict[str, DtypeRoofline]
    # The AMX tiles' peaks from registers (csrc/bandwidth.c), FLOP/s in bf16 and OP/s in int8; None without AMX
    tile_bf16_flops: float | None = None
    tile_int8_ops: float | None = None

    def batch1_decode_tokens_per_s(self, dtype: str) -> float:
        return self.read_bandwidth / self.per_dtype[dtype].weight_bytes

    def throughput_fraction(self, dtype: str, input_tokens: int, output_tokens: int, seconds: float) -> float:
        """Share of the compute roofline a run achieved: the time its prompt tokens (at the prefill
        ceiling) and output tokens (at the decode ceiling) need at least, over the time it took."""
        r = self.per_dtype[dtype]
        return (input_tokens / r.prefill_tokens_per_s + output_tokens / r.decode_tokens_per_s) / seconds


def model_gemms(config: ModelConfig) -> tuple[list[GemmShape], GemmShape]:
    """(the decoder layers' linear shapes with their counts, the lm_head), from the model code itself."""
    with torch.device("meta"):
        model = CausalLM(config)
    counts: Counter[tuple[str, int, int]] = Counter()
    for name, module in model.layers.named_modules():
        if isinstance(module, torch.nn.Linear):
            counts[(name.rsplit(".", 1)[-1], module.in_features, module.out_features)] += 1
    body = [GemmShape(name, i, o, n) for (name, i, o), n in counts.items()]
    head = model.lm_head
    return body, GemmShape("lm_head", head.in_features, head.out_features, 1)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def best_time(fn: Callable[[], object], device: torch.device, rounds: int = 5, min_round_s: float = 0.05) -> float:
    """Seconds per call: the best round's mean. The best, because a shared machine only ever makes
    a round slower than the hardware allows."""
    fn()  # warm-up: kernel selection, first-touch of memory
    _sync(device)
    best = float("inf")
    for _ in range(rounds):
        calls, start = 0, time.perf_counter()
        while True:
            fn()
            calls += 1
            _sync(device)
            elapsed = time.perf_counter() - start
            if elapsed >= min_round_s:
                break
        best = min(best, elapsed / calls)
    return best


def time_gemm(shape: GemmShape, tokens: int, dtype: torch.dtype, device: torch.device) -> GemmTiming:
    x = torch.randn(tokens, shape.in_features, dtype=dtype, device=device)
    w = torch.randn(shape.out_features, shape.in_features, dtype=dtype, device=device)
    with torch.inference_mode():
        return GemmTiming(shape, best_time(lambda: F.linear(x, w), device))


def read_bandwidth(device: torch.device, nbytes: int = 512 * 2**20) -> float:
    """Bytes/s of a streaming read of every byte once over a buffer far larger than any cache, which is
    what batch-1 decode does to the weights: the native all-thread vector read where the kernels run
    (a torch matrix-vector product reads at half the rate here), else a matrix-vector product."""
    stream = read_stream(device)
    if stream is not None:
        buffer = torch.ones(nbytes // 8, dtype=torch.int64)
        return nbytes / best_time(lambda: stream(buffer.data_ptr(), buffer.numel()), device)
    columns = 4096
    matrix = torch.ones(nbytes // 4 // columns, columns, dtype=torch.float32, device=device)
    vector = torch.ones(columns, dtype=torch.float32, device=device)
    return matrix.numel() * 4 / best_time(lambda: torch.mv(matrix, vector), device)


def tile_peaks(device: torch.device) -> tuple[float | None, float | None]:
    """The AMX tiles' bf16 FLOP/s and int8 OP/s: four independent tile products per round on every thread,
    from registers, so no memory bounds them; (None, None) where the CPU or the library has no tiles."""
    peak = amx_peak(device)
    if peak is None:
        return None, None
    iters = 200_000
    return tuple(peak(bf16, iters) / best_time(lambda b=bf16: peak(b, iters), device, rounds=3) for bf16 in (1, 0))


def measure(config: ModelConfig, device: torch.device, tokens: int = 512, dtypes: tuple[str, ...] = DTYPES,
            progress: Callable[[str], None] | None = None) -> Roofline:
    body, head = model_gemms(config)
    per_dtype = {}
    for name in dtypes:
        dtype = getattr(torch, name)
        if progress:
            progress(f"GEMMs in {name}")
        weights = sum(s.in_features * s.out_features * s.count for s in [*body, head])
        per_dtype[name] = DtypeRoofline(name, tokens, [time_gemm(s, tokens, dtype, device) for s in body],
                                        time_gemm(head, tokens, dtype, device),
                                        weights * torch.empty((), dtype=dtype).element_size())
    if progress:
        progress("memory read bandwidth and tile peaks")
    return Roofline(str(device), torch.get_num_threads(), tokens, read_bandwidth(device), per_dtype, *tile_peaks(device))


# An expert's tensor: GGUF's stacked ffn_*_exps, HF's per-expert `experts.N` or Granite's stacked input/output_linear.
_EXPERT_TENSOR = re.compile(r"_exps\.|\.experts\.|\.(?:input|output)_linear\.")


def file_bytes_per_token(path: Path, config: ModelConfig) -> int:
    """The checkpoint's tensor bytes a batch-1 decode step reads: every tensor but the token embedding
    (a lookup of one row), unless it is also the LM head (tied); of a mixture of experts' expert
    tensors, the share of the k experts a token runs (num_experts_per_tok / num_experts)."""
    if path.is_dir():
        from safetensors import safe_open

        sizes = {}
        for file in sorted(path.glob("*.safetensors")):
            with safe_open(str(file), framework="pt") as f:
                for name in f.keys():
                    sizes[name] = f.get_slice(name).get_shape(), f.get_slice(name).get_dtype()
        nbytes = {n: math.prod(shape) * _SAFETENSORS_BYTES[dtype] for n, (shape, dtype) in sizes.items()}
        embedding, head = "model.embed_tokens.weight", "lm_head.weight"
    else:
        from minivllm.model.gguf_file import GGUFFile

        nbytes = {t.name: t.nbytes for t in GGUFFile(path).tensors}
        embedding, head = "token_embd.weight", "output.weight"
    tied = head not in nbytes
    active = config.num_experts_per_tok / config.num_experts if config.num_experts else 1.0
    return round(sum(size * (active if _EXPERT_TENSOR.search(name) else 1.0)
                     for name, size in nbytes.items() if name != embedding or tied))


_SAFETENSORS_BYTES = {"F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I8": 1, "U8": 1, "BOOL": 1}


def format_roofline(r: Roofline, model_name: str) -> str:
    lines = [f"Roofline of {model_name} on {r.device} ({r.threads} threads), GEMMs at {r.tokens} tokens",
             f"{'dtype':<10}{'GEMM GFLOP/s':>14}{'prefill tok/s':>15}{'decode tok/s':>14}{'batch-1 tok/s':>15}"]
    for name, d in r.per_dtype.items():
        lines.append(f"{name:<10}{d.gemm_gflops:>14.1f}{d.prefill_tokens_per_s:>15.0f}{d.decode_tokens_per_s:>14.0f}"
                     f"{r.batch1_decode_tokens_per_s(name):>15.1f}")
    lines.append(f"memory read bandwidth: {r.read_bandwidth / 1e9:.1f} GB/s; weights read per token: "
                 + ", ".join(f"{d.weight_bytes / 1e6:.0f} MB ({n})" for n, d in r.per_dtype.items()))
    if r.tile_bf16_flops:
        lines.append(f"AMX tiles from registers: bf16 {r.tile_bf16_flops / 1e9:,.0f} GFLOP/s, "
                     f"int8 {r.tile_int8_ops / 1e9:,.0f} GOP/s")
    lines.append("prefill: decoder-layer GEMMs (compute-bound); decode: layers + lm_head at a large batch "
                 "(compute-bound); batch-1: weight bytes / read bandwidth (memory-bound)")
    lines.append(f"{'GEMM shape':<42}" + "".join(f"{n + ' GFLOP/s':>18}" for n in r.per_dtype))
    first = next(iter(r.per_dtype.values()))
    for i, t in enumerate([*first.body, first.lm_head]):
        s = t.shape
        label = f"{s.name} [{r.tokens}x{s.in_features}]x[{s.in_features}x{s.out_features}] x{s.count}"
        rates = [([*d.body, d.lm_head][i]).gflops(r.tokens) for d in r.per_dtype.values()]
        lines.append(f"{label:<42}" + "".join(f"{g:>18.1f}" for g in rates))
    return "\n".join(lines)
