"""Native CPU kernels, compiled at first use with the system's C compiler and loaded with ctypes.

No build step at install time and no torch headers: the C file is plain C with OpenMP. When no
compiler is present (or the build fails) `decode_attention_kernel()` returns None and attention
falls back to torch's gather + scaled_dot_product_attention.
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
import warnings
from pathlib import Path

import torch

SOURCE = Path(__file__).parent / "csrc" / "paged_attention.c"
COMPILE_FLAGS = ["-O3", "-march=native", "-mprefer-vector-width=512", "-ffast-math", "-fopenmp", "-fPIC", "-std=c11"]
# Linked without -ffast-math: GCC 12 would otherwise add crtfastmath, which flushes denormals to zero
# for the whole process (torch included) as soon as the library loads.
LINK_FLAGS = ["-shared", "-fopenmp"]
_I64 = ctypes.c_int64
_PTR = ctypes.c_void_p


@functools.lru_cache(maxsize=1)
def _library() -> ctypes.CDLL | None:
    if os.environ.get("MINIVLLM_NO_KERNELS"):
        return None
    compiler = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    if compiler is None:
        return None
    source = SOURCE.read_bytes()
    tag = hashlib.sha256(source + " ".join([compiler, *COMPILE_FLAGS, *LINK_FLAGS]).encode()).hexdigest()[:16]
    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "minivllm"
    lib_path = cache / f"paged_attention-{tag}.so"
    try:
        if not lib_path.exists():
            cache.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory(dir=cache) as tmp:  # build aside, then move: atomic
                obj, built = Path(tmp) / "paged_attention.o", Path(tmp) / lib_path.name
                for cmd in ([compiler, *COMPILE_FLAGS, "-c", str(SOURCE), "-o", str(obj)],
                            [compiler, *LINK_FLAGS, str(obj), "-o", str(built), "-lm"]):
                    subprocess.run(cmd, check=True, capture_output=True, text=True)
                built.replace(lib_path)
        lib = ctypes.CDLL(str(lib_path))
    except (OSError, subprocess.CalledProcessError) as e:
        detail = getattr(e, "stderr", "") or str(e)
        warnings.warn(f"minivllm: native attention kernel unavailable, using torch ({detail.strip()[:200]})")
        return None
    for name in ("paged_decode_attention_bf16", "paged_decode_attention_f32"):
        getattr(lib, name).argtypes = [_PTR, _PTR, _PTR, _PTR, _I64, _PTR, _I64, _I64, _I64, _I64, _I64,
                                       ctypes.c_float, _PTR]
    return lib


_DTYPE_SUFFIX = {torch.bfloat16: "bf16", torch.float32: "f32"}
MAX_HEAD_DIM, MAX_GROUP = 256, 16  # the C file's stack buffers


def decode_attention_kernel(device: torch.device, dtype: torch.dtype, head_dim: int, group: int):
    """The native decode-attention function for this device, dtype and head shape, or None."""
    if device.type != "cpu" or dtype not in _DTYPE_SUFFIX or head_dim > MAX_HEAD_DIM or group > MAX_GROUP:
        return None
    lib = _library()
    return None if lib is None else getattr(lib, f"paged_decode_attention_{_DTYPE_SUFFIX[dtype]}")


def paged_decode_attention(kernel, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """q: [seqs, heads, head_dim] (contiguous); caches: [blocks, block_size, kv_heads, head_dim];
    block_tables: [seqs, max_blocks] int64; context_lens: [seqs] int64."""
    out = torch.empty_like(q)
    num_seqs, num_heads, head_dim = q.shape
    kernel(q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), block_tables.data_ptr(), block_tables.shape[1],
           context_lens.data_ptr(), num_seqs, num_heads, k_cache.shape[2], head_dim, k_cache.shape[1], scale,
           out.data_ptr())
    return out
