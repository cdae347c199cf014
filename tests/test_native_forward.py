"""The layer loop in one native call (native_forward.py) gives the same bits as llama.py's Python loop
over the same native kernels: logprobs and tokens, with decodes, prefill chunks and padding in one step."""
from __future__ import annotations

import pytest
import torch

from minivllm import LLM
from minivllm.model.kernels import report
from tests.helpers import cpu_targets, layer_loop_outputs


@pytest.mark.parametrize("dtype,engine_args", [
    ("bfloat16", dict(max_num_batched_tokens=48)),  # prefill chunks beside decodes
    ("float32", dict(scheduler="static", static_batch_size=3)),  # padding rows
    ("bfloat16", dict(max_num_batched_tokens=48, kv_cache_dtype="fp8")),  # a quantized KV pool
], ids=["bf16-chunked", "fp32-static", "bf16-fp8-kv"])
def test_native_layer_loop_equals_python_loop(dtype: str, engine_args: dict) -> None:
    llm = LLM(dtype=dtype, num_kv_blocks=128, enable_prefix_caching=False, **engine_args)
    if llm.engine.runner.model.native_forward is None:
        pytest.skip("no native layer loop here (no compiler, no simd.h section for the CPU, or MINIVLLM_NO_KERNELS)")
    assert layer_loop_outputs(llm, native=True) == layer_loop_outputs(llm, native=False)


@pytest.mark.parametrize("target", cpu_targets()[1:])
def test_smaller_targets_run_the_layer_loop_natively(target: str, monkeypatch: pytest.MonkeyPatch,
                                                     capfd: pytest.CaptureFixture) -> None:
    """MINIVLLM_CPU_ARCH=x86-64-v3 on a larger CPU: the engine says at start that every kernel family runs
    natively for that target, and its layer loop gives the Python loop's bits there too."""
    monkeypatch.setenv("MINIVLLM_CPU_ARCH", target)
    capfd.readouterr()
    llm = LLM(dtype="bfloat16", num_kv_blocks=128, enable_prefix_caching=False, max_num_batched_tokens=48)
    line = report(torch.device("cpu"), torch.bfloat16)
    assert line.startswith(f"minivllm: kernels for {target} (avx2") and line.endswith("; torch for: nothing")
    assert capfd.readouterr().err.splitlines().count(line) == 1
    assert llm.engine.runner.model.native_forward is not None
    assert layer_loop_outputs(llm, native=True) == layer_loop_outputs(llm, native=False)


def _c_structs() -> dict[str, list[tuple[str, str]]]:
    """forward.c's and layer_desc.h's typedef'd structs: name -> [(field, kind)], kind one of ptr, i64, f32, [n]ptr, or a
    struct's name (or that name with [n] for an array of them)."""
    import re
    from pathlib import Path

    from minivllm.model import kernels

    source = "".join((Path(kernels.CSRC) / name).read_text() for name in ("layer_desc.h", "forward.c"))
    source = re.sub(r"/\*.*?\*/", "", source, flags=re.S)
    constants = {name: int(value) for name, value in re.findall(r"#define (\w+) (\d+)", source)}
    structs = {}
    for body, name in re.findall(r"typedef struct \{(.*?)\} (\w+);", source, flags=re.S):
        fields = []
        for declaration in filter(None, (d.strip() for d in body.split(";"))):
            base = declaration.split()[0] if not declaration.startswith("const") else declaration.split()[1]
            names = declaration[declaration.index(base) + len(base):].split(",")
            for raw in names:
                raw = raw.strip().replace("const", "").strip()
                pointer = raw.startswith("*")
                field, _, count = raw.lstrip("* ").partition("[")
                kind = "ptr" if pointer else {"int64_t": "i64", "float": "f32"}.get(base, base)
                if count:
                    kind = f"[{constants[count.rstrip(']')]}]{kind}"
                fields.append((field.strip(), kind))
        structs[name] = fields
    return structs


def _ctypes_kind(ctype) -> str:
    import ctypes

    if issubclass(ctype, ctypes.Array):
        return f"[{ctype._length_}]{_ctypes_kind(ctype._type_)}"
    if ctype in (ctypes.c_void_p,) or issubclass(ctype, ctypes._Pointer):
        return "ptr"
    return {ctypes.c_int64: "i64", ctypes.c_float: "f32"}.get(ctype) or _C_NAMES[ctype.__name__]


_C_NAMES = {"_Segment": "SegmentDesc", "_Linear": "LinearDesc", "_Expert": "ExpertDesc", "_MoE": "MoEDesc",
            "_Layer": "LayerDesc", "_Model": "ModelDesc", "_Step": "StepDesc"}


def test_c_structs_agree_with_the_python_description() -> None:
    """native_forward.py's ctypes structs are forward.c's and layer_desc.h's, field for field (name, order and kind): the
    layer description has one source of truth, and this test holds the other to it."""
    from minivllm.model import native_forward

    c = _c_structs()
    for py_name, c_name in _C_NAMES.items():
        py = [(name, _ctypes_kind(ctype)) for name, ctype in getattr(native_forward, py_name)._fields_]
        assert py == c[c_name], f"{py_name} != forward.c's {c_name}"
