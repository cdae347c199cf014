"""The model's fast paths on the CPU: native kernels, and bf16 weights packed for oneDNN.

The native kernels (csrc/*.c) are plain C with OpenMP, no torch headers: compiled at first use with
the system's C compiler into one library for this CPU (-march=native) and loaded with ctypes, so
there is no build step at install time. When no compiler is present (or the build fails) every
getter here returns None and the model runs its torch twins: attention gathers the blocks for
scaled_dot_product_attention, linear layers call F.linear, the layer ops run as torch ops.
`minivllm bench kernels` measures each path against its twin.
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import warnings
from pathlib import Path

import torch

CSRC = Path(__file__).parent / "csrc"
SOURCES = sorted(CSRC.glob("*.c"))
COMPILE_FLAGS = ["-O3", "-march=native", "-mprefer-vector-width=512", "-ffast-math", "-fopenmp", "-fPIC", "-std=c11"]
# Linked without -ffast-math: GCC 12 would otherwise add crtfastmath, which flushes denormals to zero
# for the whole process (torch included) as soon as the library loads.
LINK_FLAGS = ["-shared", "-fopenmp"]
_I64 = ctypes.c_int64
_PTR = ctypes.c_void_p
_DTYPE_SUFFIX = {torch.bfloat16: "bf16", torch.float32: "f32"}


@functools.lru_cache(maxsize=1)
def _library() -> ctypes.CDLL | None:
    if os.environ.get("MINIVLLM_NO_KERNELS"):
        return None
    compiler = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    if compiler is None:
        return None
    # -march=native: the library is only valid for this CPU model, so its name says which.
    code = b"".join(f.read_bytes() for f in sorted([*SOURCES, *CSRC.glob("*.h")]))
    key = code + " ".join([compiler, *COMPILE_FLAGS, *LINK_FLAGS, _cpu()]).encode()
    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "minivllm"
    lib_path = cache / f"kernels-{hashlib.sha256(key).hexdigest()[:16]}.so"
    try:
        if not lib_path.exists():
            cache.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory(dir=cache) as tmp:  # build aside, then move: atomic
                objects = [Path(tmp) / f"{s.stem}.o" for s in SOURCES]
                for source, obj in zip(SOURCES, objects):
                    subprocess.run([compiler, *COMPILE_FLAGS, "-c", str(source), "-o", str(obj)],
                                   check=True, capture_output=True, text=True)
                built = Path(tmp) / lib_path.name
                subprocess.run([compiler, *LINK_FLAGS, *map(str, objects), "-o", str(built), "-lm"],
                               check=True, capture_output=True, text=True)
                built.replace(lib_path)
        lib = ctypes.CDLL(str(lib_path))
    except (OSError, subprocess.CalledProcessError) as e:
        detail = getattr(e, "stderr", "") or str(e)
        warnings.warn(f"minivllm: native kernels unavailable, using torch ({detail.strip()[:200]})")
        return None
    for name in ("paged_decode_attention_bf16", "paged_decode_attention_f32"):
        getattr(lib, name).argtypes = [_PTR, _I64, _PTR, _PTR, _PTR, _I64, _PTR, _I64, _I64, _I64, _I64, _I64,
                                       ctypes.c_float, _PTR]
    if hasattr(lib, "linear_bf16"):
        lib.linear_bf16.argtypes = [_PTR, _PTR, _PTR, _I64, _I64, _I64]
    for suffix in _DTYPE_SUFFIX.values():
        getattr(lib, f"add_rms_norm_{suffix}").argtypes = [_PTR, _PTR, _PTR, _PTR, _I64, _I64, ctypes.c_float]
        getattr(lib, f"rotary_{suffix}").argtypes = [_PTR, _I64, _PTR, _I64, _PTR, _PTR, _I64, _I64, _I64, _I64]
        getattr(lib, f"write_kv_{suffix}").argtypes = [_PTR, _I64, _PTR, _I64, _PTR, _PTR, _I64, _I64, _I64,
                                                       _I64, _PTR, _PTR]
        getattr(lib, f"silu_and_mul_{suffix}").argtypes = [_PTR, _PTR, _I64, _I64]
    return lib


def _cpu() -> str:
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor()
    return next((line for line in info.splitlines() if line.startswith(("flags", "Features"))), "")


MAX_HEAD_DIM, MAX_GROUP, MAX_BLOCK_SIZE, CHAINS = 256, 16, 64, 4  # the C file's buffers and unrolling


def decode_attention_kernel(device: torch.device, dtype: torch.dtype, head_dim: int, group: int, block_size: int):
    """The native decode-attention function for this device, dtype and shapes, or None."""
    if (device.type != "cpu" or dtype not in _DTYPE_SUFFIX or head_dim > MAX_HEAD_DIM or head_dim % CHAINS
            or group > MAX_GROUP or block_size > MAX_BLOCK_SIZE):
        return None
    lib = _library()
    return None if lib is None else getattr(lib, f"paged_decode_attention_{_DTYPE_SUFFIX[dtype]}")


def paged_decode_attention(kernel, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float,
                           out: torch.Tensor | None = None) -> torch.Tensor:
    """q: [seqs, heads, head_dim], each sequence's heads contiguous (a view into the fused qkv output is
    fine); k_cache: [blocks, kv_heads, head_dim, block_size]; v_cache: [blocks, kv_heads, block_size,
    head_dim]; block_tables: [seqs, max_blocks] int64; context_lens: [seqs] int64. Writes into `out`
    (contiguous, q's shape) when given."""
    if q.stride(2) != 1 or q.stride(1) != q.shape[2]:
        q = q.contiguous()
    out = torch.empty(q.shape, dtype=q.dtype) if out is None else out
    num_seqs, num_heads, head_dim = q.shape
    kernel(q.data_ptr(), q.stride(0), k_cache.data_ptr(), v_cache.data_ptr(), block_tables.data_ptr(),
           block_tables.shape[1], context_lens.data_ptr(), num_seqs, num_heads, k_cache.shape[1], head_dim,
           k_cache.shape[3], scale, out.data_ptr())
    return out


SMALL_LINEAR_ROWS = 8  # up to here the native kernel beats packed oneDNN (`minivllm bench kernels`)


def small_linear_kernel(device: torch.device, dtype: torch.dtype):
    """The native bf16 linear for few rows (decode steps of small batches), or None."""
    if device.type != "cpu" or dtype != torch.bfloat16:
        return None
    lib = _library()
    return getattr(lib, "linear_bf16", None) if lib is not None else None


def small_linear(kernel, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [M, K] @ weight [N, K]^T with the native kernel; K must be a multiple of 32."""
    x = x.contiguous()
    out = torch.empty(x.shape[0], weight.shape[0], dtype=x.dtype)
    kernel(x.data_ptr(), weight.data_ptr(), out.data_ptr(), x.shape[0], weight.shape[0], weight.shape[1])
    return out


PACK_FOR_ROWS = 64  # the row count oneDNN tunes packed weights for; they serve every count (bench: 64 to 2048)


def onednn_packed_weight(weight: torch.Tensor) -> torch.Tensor | None:
    """A bf16 linear weight reordered once into oneDNN's blocked layout, or None where that path is
    missing. F.linear leaves the weight as it is and oneDNN reorders it on every call: packing once
    makes bf16 GEMMs of 16 to 2,048 rows 1.2-1.7x faster, with bit-identical results."""
    if weight.device.type != "cpu" or weight.dtype != torch.bfloat16 or not torch.backends.mkldnn.is_available():
        return None
    try:
        return torch.ops.mkldnn._reorder_linear_weight(weight, PACK_FOR_ROWS)
    except (AttributeError, RuntimeError):  # a torch build without this private op
        return None


def onednn_linear(x: torch.Tensor, packed_weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed_weight, bias, "none", [], "")


class LayerOps:
    """The fused per-layer ops of csrc/layer_ops.c for one dtype; each matches a torch fallback in
    llama.py or attention.py. Rows must be contiguous along the last dimension."""

    def __init__(self, lib: ctypes.CDLL, dtype: torch.dtype) -> None:
        suffix = _DTYPE_SUFFIX[dtype]
        self._add_rms_norm = getattr(lib, f"add_rms_norm_{suffix}")
        self._rotary = getattr(lib, f"rotary_{suffix}")
        self._write_kv = getattr(lib, f"write_kv_{suffix}")
        self._silu_and_mul = getattr(lib, f"silu_and_mul_{suffix}")

    def add_rms_norm(self, delta: torch.Tensor | None, residual: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> torch.Tensor:
        """residual += delta (in place, if given); returns RMSNorm(residual) * weight."""
        out = torch.empty_like(residual)
        self._add_rms_norm(None if delta is None else delta.data_ptr(), residual.data_ptr(), weight.data_ptr(),
                           out.data_ptr(), residual.shape[0], residual.shape[1], eps)
        return out

    def rotary_(self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
        """Rotate q [T, heads, head_dim] and k [T, kv_heads, head_dim] in place (views into the fused
        qkv output are fine). cos, sin: float32 [T, head_dim / 2]."""
        self._rotary(q.data_ptr(), q.stride(0), k.data_ptr(), k.stride(0), cos.data_ptr(), sin.data_ptr(),
                     q.shape[0], q.shape[1], k.shape[1], q.shape[2])

    def write_kv(self, k: torch.Tensor, v: torch.Tensor, blocks: torch.Tensor, offsets: torch.Tensor,
                 k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
        """Store the first len(blocks) tokens' K and V ([T, kv_heads, head_dim]) in their pool slots."""
        blocks, offsets = blocks.contiguous(), offsets.contiguous()
        self._write_kv(k.data_ptr(), k.stride(0), v.data_ptr(), v.stride(0), blocks.data_ptr(), offsets.data_ptr(),
                       blocks.shape[0], k.shape[1], k.shape[2], k_cache.shape[3], k_cache.data_ptr(),
                       v_cache.data_ptr())

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        out = torch.empty(gate_up.shape[0], gate_up.shape[1] // 2, dtype=gate_up.dtype)
        self._silu_and_mul(gate_up.data_ptr(), out.data_ptr(), out.shape[0], out.shape[1])
        return out


def layer_ops(device: torch.device, dtype: torch.dtype) -> LayerOps | None:
    if device.type != "cpu" or dtype not in _DTYPE_SUFFIX:
        return None
    lib = _library()
    return None if lib is None else LayerOps(lib, dtype)
