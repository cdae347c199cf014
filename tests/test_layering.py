"""Imports point down (request -> scheduler -> runner -> sampler -> outputs): the model package, runner
and sampler included, takes plain inputs (model/batch.py) and imports nothing from the engine or the
server, which build on it."""
from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import minivllm.model

MODEL_DIR = Path(minivllm.model.__file__).parent
ABOVE = ("minivllm.engine", "minivllm.server")  # what builds on the model package


def imported_modules(path: Path) -> list[tuple[int, str]]:
    """(line, module) of every import in a file, at any depth (inside functions too), relative ones
    resolved; `from a import b` gives both a and a.b (b may be a module)."""
    package = ["minivllm", "model", *path.relative_to(MODEL_DIR).parent.parts]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # from ..x import y: relative to this file's package
                base = ".".join(package[:len(package) - node.level + 1] + ([base] if base else []))
            found += [(node.lineno, base)] + [(node.lineno, f"{base}.{alias.name}") for alias in node.names]
    return found


def test_nothing_in_the_model_package_imports_the_engine_or_the_server() -> None:
    files = sorted(MODEL_DIR.rglob("*.py"))
    assert MODEL_DIR / "runner.py" in files and MODEL_DIR / "sampler.py" in files
    offending = [f"{path.relative_to(MODEL_DIR.parent.parent)}:{line}: {module}"
                 for path in files for line, module in imported_modules(path)
                 if module in ABOVE or module.startswith(tuple(f"{a}." for a in ABOVE))]
    assert offending == []


def test_importing_every_model_module_loads_no_engine_or_server_module() -> None:
    """The same rule at run time, through whatever the model package imports (config, sampling_params)."""
    script = ("import importlib, pkgutil, sys, minivllm.model as m\n"
              "for info in pkgutil.walk_packages(m.__path__, 'minivllm.model.'):\n"
              "    importlib.import_module(info.name)\n"
              "print('\\n'.join(n for n in sys.modules if n.startswith(('minivllm.engine', 'minivllm.server'))))")
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert run.stdout.split() == []
