"""Imports point down and never go round in a circle, in every module of the package.

The layers, from the bottom, follow the data flow (request -> scheduler -> runner -> sampler -> outputs,
and the features plugging into the step from beside it):

    ground       config, sampling_params, outputs, startup: plain values every layer reads
    model        the model package (runner, sampler, kernels, loaders), the LoRA layers and weights
                 beside it, and text.py (stop strings over the tokenizer's detokenizer)
    distributed  tensor parallelism: the runner's ranks
    step state   engine/: the request state, block manager, policies, schedulers, model inputs and the
                 seams (admission gates, step extensions) that features implement
    features     speculative decoding, structured outputs, the KV tier, LoRA's extension, tracing:
                 each implements a seam over the step state
    composition  features.py: which features an engine has, from its config
    loop         the step loop (engine/llm_engine.py) and what it computes with (executor.py: the model build's parts)
    offline      llm.py: the LLM facade
    frontend     the process boundary: async engine, engine-core process, its client and messages
    serving      the HTTP server and the router
    bench        benchmarks and the simulator
    cli          the command line

An import may go to its own layer or any below, never up; the module graph (every import at any depth:
inside functions and under TYPE_CHECKING too, relative ones resolved) has no strongly connected
component of more than one module.
"""
from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import minivllm

PACKAGE_DIR = Path(minivllm.__file__).parent

LAYERS: list[tuple[str, list[str]]] = [
    ("ground", ["minivllm", "minivllm.config", "minivllm.sampling_params", "minivllm.outputs", "minivllm.startup"]),
    ("model", ["minivllm.model", "minivllm.lora", "minivllm.text"]),
    ("distributed", ["minivllm.distributed"]),
    ("step state", ["minivllm.engine"]),
    ("features", ["minivllm.spec_decode", "minivllm.structured_output", "minivllm.kv_tier", "minivllm.lora.extension",
                  "minivllm.tracing"]),
    ("composition", ["minivllm.features"]),
    ("loop", ["minivllm.engine.llm_engine", "minivllm.executor"]),
    ("offline", ["minivllm.llm"]),
    ("frontend", ["minivllm.frontend"]),
    ("serving", ["minivllm.server", "minivllm.router"]),
    ("bench", ["minivllm.bench"]),
    ("cli", ["minivllm.cli"]),
]

def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE_DIR.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)

MODULES = {module_name(p): p for p in sorted(PACKAGE_DIR.rglob("*.py"))}

def imported_modules(name: str) -> list[tuple[int, str]]:
    """(line, module of the package) of every import in module `name`, at any depth, relative ones
    resolved; `from a import b` names a.b when that is a module, else a."""
    path = MODULES[name]
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # from ..x import y: relative to this file's package
                base = ".".join(package[:len(package) - node.level + 1] + ([base] if base else []))
            found += [(node.lineno, f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base)
                      for a in node.names]
    return [(line, module) for line, module in found if module in MODULES and module != name]

GRAPH = {name: imported_modules(name) for name in MODULES}

def layer_of(name: str) -> int:
    """The layer of the longest prefix of `name` that the table names."""
    best, layer = -1, None
    for index, (_, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            if (name == prefix or name.startswith(prefix + ".")) and len(prefix) > best:
                best, layer = len(prefix), index
    assert layer is not None, f"{name} has no layer: add it to LAYERS"
    return layer

def strongly_connected_components(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's algorithm, iterative."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                components.append(sorted(component))
    return components

def test_every_module_has_a_layer() -> None:
    for name in ("minivllm.config", "minivllm.cli", "minivllm.startup", "minivllm.llm",
                 "minivllm.engine.llm_engine", "minivllm.model.runner"):
        assert name in MODULES
    for name in MODULES:
        layer_of(name)

def test_imports_never_go_up_a_layer() -> None:
    upward = [f"{MODULES[name].relative_to(PACKAGE_DIR.parent)}:{line}: {name} ({LAYERS[layer_of(name)][0]}) "
              f"imports {target} ({LAYERS[layer_of(target)][0]})"
              for name, imports in GRAPH.items() for line, target in imports
              if layer_of(target) > layer_of(name)]
    assert not upward, "\n".join(upward)

def test_no_import_circle() -> None:
    graph = {name: {t for _, t in imports} for name, imports in GRAPH.items()}
    circles = []
    for component in strongly_connected_components(graph):
        if len(component) > 1:
            members = set(component)
            arrows = sorted(f"{a} -> {b}" for a in component for b in graph[a] & members)
            circles.append(f"circle of {len(component)} modules: " + "; ".join(arrows))
    assert not circles, "\n".join(circles)

def test_the_checks_see_a_circle_and_an_upward_arrow() -> None:
    """The graph code on a made-up graph: a circle is found, and layer_of ranks the loop above the state."""
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert [c for c in strongly_connected_components(graph) if len(c) > 1] == [["a", "b", "c"]]
    assert layer_of("minivllm.engine.llm_engine") > layer_of("minivllm.spec_decode.extension") > \
        layer_of("minivllm.engine.scheduler") > layer_of("minivllm.model.runner")

def test_importing_every_model_module_loads_no_engine_or_server_module() -> None:
    """The model package at run time, through whatever it imports (config, sampling_params)."""
    script = ("import importlib, pkgutil, sys, minivllm.model as m\n"
              "for info in pkgutil.walk_packages(m.__path__, 'minivllm.model.'):\n"
              "    importlib.import_module(info.name)\n"
              "print('\\n'.join(n for n in sys.modules if n.startswith(('minivllm.engine', 'minivllm.server'))))")
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert run.stdout.split() == []
