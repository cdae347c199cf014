"""The model's fast paths on the CPU: native kernels, each batch-invariant.

The native kernels (csrc/*.c) are plain C with OpenMP, no torch headers: compiled at first use with
the system's C compiler into one library for this CPU (-march=native) and loaded with ctypes, so
there is no build step at install time. MINIVLLM_CPU_ARCH=<a -march value> (x86-64-v3, znver4,
armv8.2-a+dotprod, ...) builds for exactly that target instead, so that one machine builds and tests
the kernels of a smaller one; the GEMMs have a section per target (csrc/simd.h), and what a target
lacks runs as torch (`report` says which). When no compiler is present (or the build fails) every
getter here returns None and the model runs its torch twins: attention gathers the blocks for
scaled_dot_product_attention, linear layers call F.linear, the layer ops run as torch ops.
`minivllm bench kernels` measures each path against its twin.

Batch invariance (issue 12): every native kernel computes a row (a token) in one fixed order that
depends on nothing but that row: the linear sums each output k by k whatever the row count, attention
treats a query the same in a prefill, a chunk or a decode, the layer ops work row by row. So with the
native kernels a request's logits are the same bits alone or in any batch. The torch twins promise no
such thing (oneDNN/MKL block by row count, scaled_dot_product_attention differs between prefill and
decode): `batch_invariant()` says which case holds.

On CUDA the same getters answer from cuda_kernels.py (Triton kernels, batch-invariant the same way).
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import warnings
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from minivllm.config import cache_dir
from minivllm.model import cuda_kernels
from minivllm.model.kv_cache import KVCache, KVFormat, kv_format
from minivllm.model.model_config import ACTIVATIONS
from minivllm.model.quant import QuantizedWeight, Segment

CSRC = Path(__file__).parent / "csrc"
SOURCES = sorted(CSRC.glob("*.c"))
ARCH_ENV = "MINIVLLM_CPU_ARCH"
# Linked without -ffast-math: GCC 12 would otherwise add crtfastmath, which flushes denormals to zero
# for the whole process (torch included) as soon as the library loads.
LINK_FLAGS = ["-shared", "-fopenmp"]
_I64 = ctypes.c_int64
_PTR = ctypes.c_void_p
_DTYPE_SUFFIX = {torch.bfloat16: "bf16", torch.float32: "f32"}
_QUANTIZED_KV = ("int8", "fp8_e4m3", "fp8_e5m2")  # kv_cache.py's quantized formats: a kernel each


def _compiler() -> str | None:
    return shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")


def cpu_arch() -> str:
    """The -march value the library is built for: MINIVLLM_CPU_ARCH, else this CPU's."""
    return os.environ.get(ARCH_ENV) or "native"


def compile_flags(arch: str, machine: str = platform.machine()) -> list[str]:
    """The C compiler's flags for -march=`arch` on `machine` (another one's: a cross build, tests/arm_kernels.py)."""
    # 512-bit vectors where the target has AVX-512 (GCC would otherwise prefer 256); x86 compilers only.
    wide = ["-mprefer-vector-width=512"] if machine in ("x86_64", "AMD64") else []
    return ["-O3", f"-march={arch}", *wide, "-ffast-math", "-fopenmp", "-fPIC", "-std=c11"]


def library_key(arch: str | None = None) -> str:
    """A hash of what the native library for `arch` (default: cpu_arch(), read now) is built from: its
    sources, the compiler, the flags with the target, and this CPU (-march=native makes it valid for
    this CPU model only). It names the library, and what depends on the kernels' rounding (the KV
    tier's disk entries)."""
    return _library_key(arch or cpu_arch())


@functools.lru_cache(maxsize=None)
def _library_key(arch: str) -> str:
    code = b"".join(f.read_bytes() for f in sorted([*SOURCES, *CSRC.glob("*.h")]))
    key = code + " ".join([_compiler() or "", *compile_flags(arch), *LINK_FLAGS, _cpu()]).encode()
    return hashlib.sha256(key).hexdigest()[:16]


@functools.lru_cache(maxsize=None)
def library(arch: str) -> ctypes.CDLL | None:
    """The native library built for -march=`arch` (compiled on first use), or None (MINIVLLM_NO_KERNELS,
    no compiler, or a failed build). Tests load several targets' side by side; the model uses cpu_arch()'s."""
    if os.environ.get("MINIVLLM_NO_KERNELS"):
        return None
    compiler = _compiler()
    if compiler is None:
        return None
    cache = cache_dir()
    lib_path = cache / f"kernels-{library_key(arch)}.so"
    try:
        if not lib_path.exists():
            print(f"minivllm: compiling the native CPU kernels once for {arch} into {cache} ...",
                  file=sys.stderr, flush=True)
            cache.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory(dir=cache) as tmp:  # build aside, then move: atomic
                objects = [Path(tmp) / f"{s.stem}.o" for s in SOURCES]
                with ThreadPoolExecutor(os.cpu_count()) as pool:  # one compiler process per core
                    list(pool.map(lambda source, obj: subprocess.run(
                        [compiler, *compile_flags(arch), "-c", str(source), "-o", str(obj)],
                        check=True, capture_output=True, text=True), SOURCES, objects))
                built = Path(tmp) / lib_path.name
                subprocess.run([compiler, *LINK_FLAGS, *map(str, objects), "-o", str(built), "-lm"],
                               check=True, capture_output=True, text=True)
                built.replace(lib_path)
        lib = ctypes.CDLL(str(lib_path))
    except (OSError, subprocess.CalledProcessError) as e:
        detail = getattr(e, "stderr", "") or str(e)
        warnings.warn(f"minivllm: native kernels unavailable, using torch ({detail.strip()[:200]})")
        return None
    for suffix in _DTYPE_SUFFIX.values():
        for kv in ("", *(f"_{name}" for name in _QUANTIZED_KV)):
            getattr(lib, f"paged_attention_{suffix}{kv}").argtypes = [
                _PTR, _I64, _PTR, _PTR, _PTR, _PTR, _PTR, _I64, _PTR, _PTR, _PTR, _I64, _I64, _I64, _I64, _I64,
                ctypes.c_float, _I64, ctypes.c_float, _PTR, _PTR]
        for kv in _QUANTIZED_KV:
            getattr(lib, f"write_kv_{suffix}_{kv}").argtypes = [_PTR, _I64, _PTR, _I64, _PTR, _PTR, _I64, _I64, _I64,
                                                                _I64, _PTR, _PTR, _PTR, _PTR, ctypes.c_float,
                                                                ctypes.c_float]
        if hasattr(lib, f"gemm_{suffix}"):  # where simd.h has a section for the target
            getattr(lib, f"gemm_{suffix}").argtypes = [_PTR, _I64, _PTR, _PTR, _PTR, _I64, _I64, _I64, _I64]
        getattr(lib, f"add_rms_norm_{suffix}").argtypes = [_PTR, _PTR, _PTR, _PTR, _I64, _I64, ctypes.c_float]
        getattr(lib, f"rotary_{suffix}").argtypes = [_PTR, _I64, _PTR, _I64, _PTR, _PTR, _I64, _I64, _I64, _I64, _I64]
        getattr(lib, f"head_rms_norm_{suffix}").argtypes = [_PTR, _I64, _I64, _I64, _I64, _PTR, ctypes.c_float]
        getattr(lib, f"write_kv_{suffix}").argtypes = [_PTR, _I64, _PTR, _I64, _PTR, _PTR, _I64, _I64, _I64,
                                                       _I64, _PTR, _PTR]
        for act in ACTIVATIONS:
            getattr(lib, f"{act}_and_mul_{suffix}").argtypes = [_PTR, _PTR, _I64, _I64]
    if hasattr(lib, "pack_panels"):
        lib.pack_panels.argtypes = [_PTR, _PTR, _I64, _I64]
    lib.read_stream.argtypes, lib.read_stream.restype = [_PTR, _I64], ctypes.c_uint64
    lib.amx_peak_ops.argtypes, lib.amx_peak_ops.restype = [ctypes.c_int, _I64], ctypes.c_double
    for suffix in _DTYPE_SUFFIX.values():
        if hasattr(lib, f"qgemm_{suffix}"):
            getattr(lib, f"qgemm_{suffix}").argtypes = [_PTR, _I64, _PTR, ctypes.c_int, _PTR, _PTR, _I64, _I64, _I64,
                                                        _I64]
            getattr(lib, f"qrows_{suffix}").argtypes = [_PTR, ctypes.c_int, _I64, _PTR, _I64, _PTR]
        if hasattr(lib, f"forward_layers_{suffix}"):
            getattr(lib, f"forward_layers_{suffix}").argtypes = [_PTR, _PTR, _PTR, _PTR]
            getattr(lib, f"moe_{suffix}").argtypes = [_PTR, _PTR, _PTR, _I64, _I64]
        getattr(lib, f"lora_{suffix}").argtypes = [_PTR, _I64, _PTR, _I64, _I64, _I64, _I64, _I64, _PTR, _PTR, _PTR]
    lib.simd_target.restype = ctypes.c_char_p
    lib.use_amx_tiles.argtypes = [ctypes.c_int]
    return lib


def _cpu_library(device: torch.device, dtype: torch.dtype) -> ctypes.CDLL | None:
    """The kernels' library where they apply (the CPU, bf16 or float32 activations), else None."""
    return library(cpu_arch()) if device.type == "cpu" and dtype in _DTYPE_SUFFIX else None


# The groups of native kernels, each named by one function that exists when it does (the torch twins otherwise).
KERNEL_GROUPS = {"quantized GEMM": "qgemm", "GEMM": "gemm", "layer loop": "forward_layers", "experts": "moe",
                 "paged attention": "paged_attention", "layer ops": "add_rms_norm", "LoRA": "lora"}


def report(device: torch.device, dtype: torch.dtype) -> str:
    """One line for the start of the engine and `bench roofline`: the target (and simd.h's section),
    the kernel groups that run natively, and those that fall back to torch."""
    if device.type == "cuda":  # the CUDA entries of the table (cuda_kernels.py)
        return cuda_kernels.report(dtype)
    lib = _cpu_library(device, dtype)
    native = [name for name, fn in KERNEL_GROUPS.items()
              if lib is not None and hasattr(lib, f"{fn}_{_DTYPE_SUFFIX[dtype]}")]
    fallback = [name for name in KERNEL_GROUPS if name not in native]
    target = f"{cpu_arch()} ({section(lib)})" if lib is not None else cpu_arch()
    if device.type != "cpu":
        target = device.type
    return (f"minivllm: kernels for {target}: {', '.join(native) or 'nothing'}; "
            f"torch for: {', '.join(fallback) or 'nothing'}")


def section(lib: ctypes.CDLL) -> str:
    """simd.h's section the library was built with, and "+amx" where the AMX tile paths run."""
    return lib.simd_target().decode() + ("+amx" if lib.amx_tiles_ready() else "")


def _cpu() -> str:
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor()
    return next((line for line in info.splitlines() if line.startswith(("flags", "Features"))), "")


MAX_HEAD_DIM, MAX_GROUP, MAX_BLOCK_SIZE, CHAINS = 256, 16, 64, 4  # the C file's buffers and unrolling


def _kv_suffix(fmt: KVFormat) -> str:
    return f"_{fmt.name}" if fmt.quantized else ""


def attention_kernel(device: torch.device, dtype: torch.dtype, head_dim: int, group: int, block_size: int,
                     kv_cache_dtype: str = "auto"):
    """The native paged-attention function (every query of a step) for this device, dtype, KV cache
    format and shapes, or None."""
    if device.type == "cuda":
        return cuda_kernels.attention_kernel(dtype, kv_cache_dtype)
    if head_dim > MAX_HEAD_DIM or head_dim % CHAINS or group > MAX_GROUP or block_size > MAX_BLOCK_SIZE:
        return None
    lib = _cpu_library(device, dtype)
    if lib is None:
        return None
    return getattr(lib, f"paged_attention_{_DTYPE_SUFFIX[dtype]}{_kv_suffix(kv_format(kv_cache_dtype))}")


def paged_attention_native(kernel, q: torch.Tensor, cache: KVCache, block_tables: torch.Tensor,
                           span_starts: torch.Tensor, span_lens: torch.Tensor, span_ctx0: torch.Tensor,
                           scale: float, out: torch.Tensor, window: int | None = None,
                           softcap: float | None = None, sinks: torch.Tensor | None = None) -> None:
    """Attention for every query row that a span covers, written into `out` ([T, heads, head_dim],
    contiguous); other rows are left as they are. q: [T, heads, head_dim], each row's heads contiguous (a
    view into the fused qkv output is fine); `cache` in the format the kernel was chosen for; block_tables [spans,
    max_blocks] int64; span i covers rows span_starts[i] .. + span_lens[i], whose first query sees
    span_ctx0[i] tokens (itself included) and each next one a token more; with a `window`, only its last
    `window` of them; with a `softcap`, scores capped as cap * tanh(score / cap); with `sinks` (float32
    [heads]), each head's sink logit in its softmax's denominator."""
    if q.stride(2) != 1 or q.stride(1) != q.shape[2]:
        q = q.contiguous()
    num_heads, head_dim = q.shape[1], q.shape[2]
    k_scale, v_scale = (None, None) if cache.k_scale is None else (cache.k_scale.data_ptr(), cache.v_scale.data_ptr())
    kernel(q.data_ptr(), q.stride(0), cache.k.data_ptr(), cache.v.data_ptr(), k_scale, v_scale, block_tables.data_ptr(),
           block_tables.shape[1], span_starts.data_ptr(), span_lens.data_ptr(), span_ctx0.data_ptr(),
           span_starts.shape[0], num_heads, cache.k.shape[1], head_dim, cache.k.shape[3], scale, window or 0,
           softcap or 0.0, None if sinks is None else sinks.data_ptr(), out.data_ptr())


PANEL = 32  # csrc/gemm.c: output columns per packed panel


def padded_bias(bias: torch.Tensor | None, n: int, panel: int) -> torch.Tensor | None:
    """The float GEMM's bias: float32, zero-padded to whole panels."""
    if bias is None:
        return None
    out = torch.zeros(-(-n // panel) * panel, dtype=torch.float32)
    out[:n] = bias.float()
    return out


class Gemm:
    """The batch-invariant linear of csrc/gemm.c for one dtype: out = x @ W^T + bias with each output
    summed in one fixed order (k by k, float32) whatever the row count, so a row's result never
    depends on the other rows of the call. Weights are packed once into column panels."""

    def __init__(self, lib: ctypes.CDLL, dtype: torch.dtype) -> None:
        suffix = _DTYPE_SUFFIX[dtype]
        self._gemm, self._pack = getattr(lib, f"gemm_{suffix}"), lib.pack_panels
        self.dtype = dtype

    def pack(self, weight: torch.Tensor, bias: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(packed weight, float32 bias padded to whole panels or None) for `forward`."""
        n, k = weight.shape
        padded = -(-n // PANEL) * PANEL
        words = weight.contiguous().view(torch.int32)  # bf16: pairs of k in one 32-bit word, for vdpbf16ps
        packed = torch.empty(padded * words.shape[1], dtype=torch.int32)
        self._pack(words.data_ptr(), packed.data_ptr(), n, words.shape[1])
        return packed, padded_bias(bias, n, PANEL)

    def forward(self, x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, n: int) -> torch.Tensor:
        if x.stride(-1) != 1:
            x = x.contiguous()
        out = torch.empty(x.shape[0], n, dtype=x.dtype)
        self._gemm(x.data_ptr(), x.stride(0), packed.data_ptr(), None if bias is None else bias.data_ptr(),
                   out.data_ptr(), n, x.shape[0], n, x.shape[1])
        return out


def gemm(device: torch.device, dtype: torch.dtype, in_features: int) -> Gemm | cuda_kernels.TritonGemm | None:
    """The native batch-invariant linear for this device, dtype and input width, or None (the torch path)."""
    if device.type == "cuda":
        return cuda_kernels.gemm(dtype)
    lib = None if in_features % 2 else _cpu_library(device, dtype)
    return Gemm(lib, dtype) if lib is not None and hasattr(lib, f"gemm_{_DTYPE_SUFFIX[dtype]}") else None


class QuantGemm:
    """The batch-invariant linear of csrc/quant_gemm.c on quantized weights (quant.py) for one activation
    dtype: rows quantized to int8 per 32 k, integer dot products per group, float32 sums in k order."""

    def __init__(self, lib: ctypes.CDLL, dtype: torch.dtype) -> None:
        suffix = _DTYPE_SUFFIX[dtype]
        self._gemm, self._rows = getattr(lib, f"qgemm_{suffix}"), getattr(lib, f"qrows_{suffix}")
        self.dtype = dtype

    def forward(self, x: torch.Tensor, weight: QuantizedWeight, bias: torch.Tensor | None) -> torch.Tensor:
        """x [rows, k] @ W^T (+ float32 bias): each segment of W into its columns of one output."""
        if x.stride(-1) != 1:
            x = x.contiguous()
        n = weight.n
        out = torch.empty(x.shape[0], n, dtype=x.dtype)
        for segment, offset in zip(weight.segments, weight.offsets):
            self._gemm(x.data_ptr(), x.stride(0), segment.packed.data_ptr(), segment.qtype,
                       None if bias is None else bias[offset:].data_ptr(), out[:, offset:].data_ptr(), n,
                       x.shape[0], segment.n, x.shape[1])
        return out

    def rows(self, segment: Segment, k: int, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` of the weight, dequantized: an embedding lookup in a quantized table."""
        ids = ids.to(torch.int64).contiguous()
        out = torch.empty(ids.shape[0], k, dtype=self.dtype)
        self._rows(segment.packed.data_ptr(), segment.qtype, k, ids.data_ptr(), ids.shape[0], out.data_ptr())
        return out


def quant_gemm(device: torch.device, dtype: torch.dtype) -> QuantGemm | None:
    """The native quantized linear for this device and activation dtype, or None (the torch twin)."""
    lib = _cpu_library(device, dtype)
    return QuantGemm(lib, dtype) if lib is not None and hasattr(lib, f"qgemm_{_DTYPE_SUFFIX[dtype]}") else None


def read_stream(device: torch.device):
    """csrc/bandwidth.c's streaming read (buffer, 8-byte words) for this device, or None."""
    lib = _cpu_library(device, torch.float32)
    return None if lib is None else lib.read_stream


def amx_peak(device: torch.device):
    """csrc/bandwidth.c's tile-peak loop (bf16, iterations) -> operations done, or None (no tiles here)."""
    lib = _cpu_library(device, torch.float32)
    return lib.amx_peak_ops if lib is not None and lib.amx_tiles_ready() else None


def forward_layers(device: torch.device, dtype: torch.dtype):
    """csrc/forward.c's layer loop for this device and dtype (native_forward.py drives it), or None."""
    lib = _cpu_library(device, dtype)
    return None if lib is None else getattr(lib, f"forward_layers_{_DTYPE_SUFFIX[dtype]}", None)


def moe_kernel(device: torch.device, dtype: torch.dtype):
    """csrc/moe.c's mixture-of-experts MLP for this device and dtype (native_forward.NativeMoE drives it), or None."""
    lib = _cpu_library(device, dtype)
    return None if lib is None else getattr(lib, f"moe_{_DTYPE_SUFFIX[dtype]}", None)


LORA_LANES, LORA_CHUNK = 16, 64  # csrc/lora.h: rank and column padding
MAX_LORA_RANK = 512  # per projection: a fused q/k/v's three fill csrc/lora.c's buffer of 1536


def lora_kernel(device: torch.device, dtype: torch.dtype):
    """csrc/lora.c's segmented shrink-and-expand for this device and dtype (lora/layers.py drives it), or None."""
    lib = _cpu_library(device, dtype)
    return None if lib is None else getattr(lib, f"lora_{_DTYPE_SUFFIX[dtype]}")


class LayerOps:
    """The fused per-layer ops of csrc/layer_ops.c for one dtype; each matches a torch fallback in
    decoder.py or attention.py. Rows must be contiguous along the last dimension."""

    def __init__(self, lib: ctypes.CDLL, dtype: torch.dtype) -> None:
        suffix = _DTYPE_SUFFIX[dtype]
        self._lib, self._suffix = lib, suffix
        self._add_rms_norm = getattr(lib, f"add_rms_norm_{suffix}")
        self._rotary = getattr(lib, f"rotary_{suffix}")
        self._head_rms_norm = getattr(lib, f"head_rms_norm_{suffix}")
        self._write_kv = getattr(lib, f"write_kv_{suffix}")
        self._act_and_mul = {act: getattr(lib, f"{act}_and_mul_{suffix}") for act in ACTIVATIONS}

    def add_rms_norm(self, delta: torch.Tensor | None, residual: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> torch.Tensor:
        """residual += delta (in place, if given); returns RMSNorm(residual) * weight."""
        out = torch.empty_like(residual)
        self._add_rms_norm(None if delta is None else delta.data_ptr(), residual.data_ptr(), weight.data_ptr(),
                           out.data_ptr(), residual.shape[0], residual.shape[1], eps)
        return out

    def head_rms_norm_(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> None:
        """RMSNorm of each head of x [T, heads, head_dim] in place (a view into the fused qkv output is fine)."""
        self._head_rms_norm(x.data_ptr(), x.stride(0), x.shape[0], x.shape[1], x.shape[2], weight.data_ptr(), eps)

    def rotary_(self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
        """Rotate q [T, heads, head_dim] and k [T, kv_heads, head_dim] in place (views into the fused
        qkv output are fine). cos, sin: float32 [T, rotary_dim / 2] (rotary_dim < head_dim: partial rotary)."""
        self._rotary(q.data_ptr(), q.stride(0), k.data_ptr(), k.stride(0), cos.data_ptr(), sin.data_ptr(),
                     q.shape[0], q.shape[1], k.shape[1], q.shape[2], 2 * cos.shape[1])

    def write_kv(self, k: torch.Tensor, v: torch.Tensor, blocks: torch.Tensor, offsets: torch.Tensor,
                 cache: KVCache) -> None:
        """Store the first len(blocks) tokens' K and V ([T, kv_heads, head_dim]) in their pool slots,
        quantized with their scales when the pool's format is (as kv_cache.quantize does)."""
        blocks, offsets = blocks.contiguous(), offsets.contiguous()
        args = [k.data_ptr(), k.stride(0), v.data_ptr(), v.stride(0), blocks.data_ptr(), offsets.data_ptr(),
                blocks.shape[0], k.shape[1], k.shape[2], cache.k.shape[3], cache.k.data_ptr(), cache.v.data_ptr()]
        fmt = cache.fmt
        if not fmt.quantized:
            self._write_kv(*args)
            return
        self.quantized_write_kv(fmt)(*args, cache.k_scale.data_ptr(), cache.v_scale.data_ptr(), fmt.inv_qmax,
                                     fmt.qmax)

    def quantized_write_kv(self, fmt: KVFormat):
        """csrc/layer_ops.c's write_kv into a pool of this quantized format."""
        return getattr(self._lib, f"write_kv_{self._suffix}_{fmt.name}")

    def act_and_mul(self, gate_up: torch.Tensor, act: str = "silu") -> torch.Tensor:
        """act(gate) * up from the fused gate_up output; act one of model_config.ACTIVATIONS."""
        out = torch.empty(gate_up.shape[0], gate_up.shape[1] // 2, dtype=gate_up.dtype)
        self._act_and_mul[act](gate_up.data_ptr(), out.data_ptr(), out.shape[0], out.shape[1])
        return out


def layer_ops(device: torch.device, dtype: torch.dtype) -> LayerOps | cuda_kernels.TritonLayerOps | None:
    if device.type == "cuda":
        return cuda_kernels.layer_ops(dtype)
    lib = _cpu_library(device, dtype)
    return None if lib is None else LayerOps(lib, dtype)
