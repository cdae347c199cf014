"""`make test-arm`: the native kernels built for AArch64 (simd.h's NEON section) and run under qemu-user.

There is no ARM machine here, so the kernels are cross-compiled (gcc-aarch64-linux-gnu) into a small C
driver (arm_driver.c) that is run by qemu-aarch64. This script writes the driver's cases: fixed inputs,
the reference outputs of the torch twins (the quantized linear's twin, float32 matmul, SDPA, the model's
RMSNorm and SiLU, lora_twin), each with the bound the driver checks, and the x86 build's own outputs.
The driver checks, per case, the ARM result against the reference within that bound, batch invariance
(every row computed alone gives the same bits), and for the GEMMs and LoRA the same bits as the x86
build (simd.h: the same integer sums and float steps on every target; lora.c: every lane its own sum). It is built twice, armv8.2-a+dotprod (sdot) and
armv8.2-a+dotprod+i8mm (usdot), with kernels.compile_flags' flags.

    python -m tests.arm_kernels [--keep DIR]
"""
from __future__ import annotations

import argparse
import os
import shutil
import struct
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F

from minivllm.lora.adapter import AdapterWeights, LoRAFactors
from minivllm.lora.layers import lora_twin, padded_columns
from minivllm.lora.manager import Target, TargetWeights, target_layout
from minivllm.model import gguf_quants, kernels, quant
from minivllm.model.attention import kv_cache_shapes
from minivllm.model.kernels import CSRC, SOURCES, compile_flags
from minivllm.model.kv_cache import KVCache, kv_format
from minivllm.model.decoder import RMSNorm
from tests.test_kernels import _attend, reference
from tests.test_quant import ROWS, _k, _tensor

TARGETS = ["armv8.2-a+dotprod", "armv8.2-a+dotprod+i8mm"]
CC = "aarch64-linux-gnu-gcc"
DRIVER = Path(__file__).with_name("arm_driver.c")
QGEMM, GEMM, ATTENTION, RMS_NORM, SILU, LORA = 1, 2, 3, 4, 5, 6  # arm_driver.c's case kinds
DTYPES = {torch.float32: 0, torch.bfloat16: 1}
# The LoRA cases' layer: a fused gate/up of two projections, 150 columns (not whole chunks of LORA_CHUNK)
LORA_TARGET = Target(0, torch.nn.Linear(200, 150, bias=False), {"gate_proj": (0, 70), "up_proj": (70, 80)})


def _bytes(t: torch.Tensor) -> bytes:
    t = t.contiguous()
    return t.view(torch.uint8).numpy().tobytes() if t.numel() else b""


def _case(name: str, kind: int, dtype: torch.dtype, ints: list[int], floats: list[float],
          arrays: list[torch.Tensor]) -> bytes:
    """One record: name[48], kind, dtype, 8 int64 parameters, 4 float32 (atol, rtol, and per kind), then
    the arrays, each as its byte count and bytes."""
    head = struct.pack("<48sii8q4fi", name.encode(), kind, DTYPES[dtype], *(ints + [0] * (8 - len(ints))),
                       *(floats + [0.0] * (4 - len(floats))), len(arrays))
    return head + b"".join(struct.pack("<q", len(b)) + b for b in map(_bytes, arrays))


def cases() -> bytes:
    """Every case, with the x86 build's outputs from the native library of this machine."""
    lib = kernels.library("native")
    if lib is None or not hasattr(lib, "qgemm_f32"):
        sys.exit("test-arm needs this machine's native kernels (a compiler and a simd.h section) for reference")
    gen = torch.Generator().manual_seed(0)
    out = []
    for dtype in DTYPES:
        for qtype, fmt in gguf_quants.BLOCK_FORMATS.items():  # the quantized GEMM: every format, as test_quant.py
            n, k, rows = 100, _k(fmt.name), ROWS
            t, _ = _tensor(fmt.name, n, k, seed=1)
            weight = quant.QuantizedWeight.of(t)
            x, bias = torch.randn(rows, k, generator=gen).to(dtype), torch.randn(n, generator=gen)
            twin = weight.linear(x, bias).float()
            weight.use_kernel(kernels.QuantGemm(lib, dtype), dtype)
            scale = twin.abs().max().item()  # test_quant's bounds: float32 sums in another order, bf16 an ulp
            atol, rtol = (1e-6 * scale, 1e-4) if dtype == torch.float32 else (2 ** -7 * scale, 2 ** -7)
            out.append(_case(f"qgemm {fmt.name} {dtype}", QGEMM, dtype, [qtype, rows, n, k], [atol, rtol],
                             [x, weight.segments[0].packed, bias, twin, weight.linear(x, bias)]))
        n, k, rows = 100, 576, 13  # the float GEMM: a partial panel, a bias, 1 to 13 rows
        w, b = torch.randn(n, k, generator=gen).to(dtype), torch.randn(n, generator=gen).to(dtype)
        x = torch.randn(rows, k, generator=gen).to(dtype)
        native = kernels.Gemm(lib, dtype)
        packed, padded = native.pack(w, b)
        ref = x.float() @ w.float().T + b.float()
        atol, rtol = (1e-4, 1e-4) if dtype == torch.float32 else (0.1, 1e-2)  # test_kernels.py's bounds
        out.append(_case(f"gemm {dtype}", GEMM, dtype, [rows, n, k], [atol, rtol],
                         [x, packed, padded, ref, native.forward(x, packed, padded, n)]))
        out.append(_attention_case(lib, dtype, gen))
        out.extend(_layer_op_cases(lib, dtype, gen))
        out.append(_lora_case(lib, dtype, gen))
    return b"".join(out)


def _attention_case(lib, dtype: torch.dtype, gen: torch.Generator) -> bytes:
    """test_kernels.py's mixed step: three decodes, a prompt, a chunk after a cached prefix; against SDPA."""
    heads, kv_heads, head_dim, block_size, num_blocks = 9, 3, 64, 16, 80
    k_shape, v_shape = kv_cache_shapes(num_blocks, block_size, kv_heads, head_dim)
    cache = KVCache(torch.randn(k_shape, generator=gen).to(dtype), torch.randn(v_shape, generator=gen).to(dtype),
                    kv_format("auto"))
    spans = [(0, 1, 1), (1, 1, block_size + 1), (2, 1, 150), (3, 21, 1), (24, 13, 38)]
    max_blocks = -(-200 // block_size)
    tables = torch.randperm(num_blocks, generator=gen)[: len(spans) * max_blocks].view(len(spans), max_blocks)
    q = torch.randn(37, heads, head_dim, generator=gen).to(dtype)
    scale = head_dim ** -0.5
    ref = torch.zeros(37, heads, head_dim)
    for s, (first, rows, ctx0) in enumerate(spans):
        for i in range(rows):
            ref[first + i] = reference(q[first + i], cache.k, cache.v, tables[s], ctx0 + i, scale)
    x86 = _attend(getattr(lib, f"paged_attention_{kernels._DTYPE_SUFFIX[dtype]}"), q, cache, tables, spans, scale)
    starts, lens, ctx0 = (torch.tensor(c, dtype=torch.long) for c in zip(*spans))
    tol = 1e-5 if dtype == torch.float32 else 2e-2  # test_kernels.py's bounds
    return _case(f"attention {dtype}", ATTENTION, dtype,
                 [heads, kv_heads, head_dim, block_size, max_blocks, len(spans), 37], [tol, tol, scale],
                 [q, cache.k, cache.v, tables, starts, lens, ctx0, ref, x86])


def _layer_op_cases(lib, dtype: torch.dtype, gen: torch.Generator) -> list[bytes]:
    """add_rms_norm and silu_and_mul against the model's torch code (test_kernels.py's bounds)."""
    ops = kernels.LayerOps(lib, dtype)
    tokens, hidden, inter = 5, 576, 1536
    norm = RMSNorm(hidden, 1e-5).to(dtype)
    norm.weight.data = torch.randn(hidden, generator=gen).to(dtype)
    delta, residual = (torch.randn(tokens, hidden, generator=gen).to(dtype) for _ in range(2))
    ref = norm(None, (residual + delta).clone()).float()
    x86_residual = residual.clone()
    x86 = ops.add_rms_norm(delta, x86_residual, norm.weight, norm.eps)
    close = (1e-5, 1e-5) if dtype == torch.float32 else (2e-2, 2e-2)
    gate_up = torch.randn(tokens, 2 * inter, generator=gen).to(dtype)
    gate, up = gate_up.chunk(2, dim=-1)
    silu_ref = (F.silu(gate) * up).float()
    silu_tol = (1e-6, 1e-6) if dtype == torch.float32 else (2 ** -8, 2 ** -7)  # bf16: an output rounding
    return [_case(f"add_rms_norm {dtype}", RMS_NORM, dtype, [tokens, hidden], [*close, norm.eps],
                  [delta, residual, norm.weight.detach(), ref, x86]),
            _case(f"silu_and_mul {dtype}", SILU, dtype, [tokens, inter], list(silu_tol),
                  [gate_up, silu_ref, ops.act_and_mul(gate_up)])]


def _lora_adapter(k: int, n_pad: int, ranks: dict[str, int], dtype: torch.dtype,
                  gen: torch.Generator) -> TargetWeights:
    """An adapter of the given rank per projection on LORA_TARGET, in the layout the engine loads
    (lora/manager.py's target_layout); factors of unit scale so that B A x is as large as the base output."""
    factors = {(0, p): LoRAFactors(torch.randn(r, k, generator=gen) / k ** 0.5,
                                   torch.randn(LORA_TARGET.slices[p][1], r, generator=gen) / r ** 0.5)
               for p, r in ranks.items()}
    return target_layout(AdapterWeights(factors, b""), LORA_TARGET, n_pad, torch.device("cpu"), dtype)


def _lora_case(lib, dtype: torch.dtype, gen: torch.Generator) -> bytes:
    """csrc/lora.c on a segmented step of a fused layer (two projections, n not whole chunks): segments of
    three adapters (one fills a single projection, one a padded rank), one adapter twice, a segment whose
    adapter leaves the layer alone and rows of no adapter; against lora_twin per segment."""
    k, n = LORA_TARGET.linear.in_features, LORA_TARGET.linear.out_features
    n_pad = padded_columns(n)
    adapters = [_lora_adapter(k, n_pad, ranks, dtype, gen) for ranks in
                ({"gate_proj": 8, "up_proj": 8}, {"gate_proj": 10, "up_proj": 10}, {"up_proj": 4})]
    # (first row, rows, adapter; -1: one that leaves this layer alone); rows 5 and 14 are in no segment
    segments = [(0, 5, 0), (6, 3, 1), (9, 1, -1), (10, 4, 2), (15, 2, 0)]
    rows = 17
    x, base = torch.randn(rows, k, generator=gen).to(dtype), torch.randn(rows, n, generator=gen).to(dtype)
    twin = base.clone()
    for first, count, a in segments:
        if a >= 0:
            span = slice(first, first + count)
            twin[span] = lora_twin(x[span], base[span], adapters[a].at, adapters[a].bt)
    x86 = base.clone()
    starts, lens = (torch.tensor(c, dtype=torch.int64) for c in list(zip(*segments))[:2])
    weights = torch.tensor([adapters[a].address() if a >= 0 else [0, 0, 0, 0] for _, _, a in segments],
                           dtype=torch.int64)
    getattr(lib, f"lora_{kernels._DTYPE_SUFFIX[dtype]}")(x.data_ptr(), k, x86.data_ptr(), n, k, n, n_pad,
                                                         len(segments), starts.data_ptr(), lens.data_ptr(),
                                                         weights.data_ptr())
    scale = twin.abs().max().item()  # float32 sums in another order; bf16 an ulp of the one rounding
    atol, rtol = (1e-6 * scale, 1e-4) if dtype == torch.float32 else (2 ** -7 * scale, 2 ** -7)
    return _case(f"lora {dtype}", LORA, dtype, [rows, k, n, n_pad, len(segments)], [atol, rtol],
                 [x, base, torch.tensor(segments, dtype=torch.int64),
                  torch.tensor([w.at.shape[1] for w in adapters], dtype=torch.int64),
                  torch.cat([w.at.flatten() for w in adapters]), torch.cat([w.bt.flatten() for w in adapters]),
                  torch.stack([w.bands for w in adapters]), twin.float(), x86])


def build(target: str, out: Path) -> None:
    """The kernels' sources and the driver, statically linked for AArch64 at -march=`target`."""
    flags = [f for f in compile_flags(target, "aarch64") if f != "-fPIC"]
    subprocess.run([CC, *flags, "-static", f"-I{CSRC}", *map(str, SOURCES), str(DRIVER), "-o", str(out), "-lm"],
                   check=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--keep", type=Path, help="write the cases and drivers here (default: a temporary directory)")
    args = parser.parse_args()
    missing = [tool for tool in (CC, "qemu-aarch64") if shutil.which(tool) is None]
    if missing:
        sys.exit(f"test-arm needs {' and '.join(missing)} (apt-get install gcc-aarch64-linux-gnu qemu-user)")
    with tempfile.TemporaryDirectory() as tmp:
        work = args.keep or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        (work / "cases.bin").write_bytes(cases())
        failed = []
        for target in TARGETS:
            driver = work / f"driver-{target}"
            build(target, driver)
            print(f"== {target} (qemu-aarch64)", flush=True)
            env = {**os.environ, "OMP_NUM_THREADS": "2"}  # a row split across threads, as on a real machine
            run = subprocess.run(["qemu-aarch64", "-cpu", "max", str(driver), str(work / "cases.bin")], env=env)
            if run.returncode:
                failed.append(target)
    if failed:
        sys.exit(f"ARM kernel tests failed for {', '.join(failed)}")
    print(f"ARM kernel tests passed for {', '.join(TARGETS)}")


if __name__ == "__main__":
    main()
