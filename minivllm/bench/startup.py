"""`minivllm bench startup`: how long a new user waits, and how much memory it takes.

Three cases, each in a fresh process (each process's own wall time and peak RSS, from `wait4`):
- generate: `minivllm generate "The capital of France is" --max-tokens 8`, start to exit;
- llm: `LLM()` constructed in a process that has already imported minivllm (and torch);
- serve: `minivllm serve` from start until GET /health answers 200 (with its own "ready" line).
Warm runs use the caches as they are (one run first fills them); cold runs get an empty cache
directory each (XDG_CACHE_HOME): the tokenizer is converted and the native kernels compiled. The
OS page cache is left alone: the model file itself is read from memory in both.
"""
from __future__ import annotations

import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import asdict, dataclass, field

PROMPT = "The capital of France is"
CASES = ("generate", "llm", "serve")
# The `llm` case's child: imports first, then times the construction alone.
_LLM_CHILD = """
import json, sys, time
from minivllm import LLM
start = time.perf_counter()
llm = LLM(model=sys.argv[1] or None)
print(json.dumps({"seconds": time.perf_counter() - start, "phases": llm.engine.startup_time}))
"""
SERVE_TIMEOUT_S = 300.0


@dataclass
class StartupRun:
    case: str
    cache: str  # warm | cold
    seconds: float  # generate: the whole process; llm: LLM() alone; serve: start to health 200
    peak_rss_mb: float  # of the whole child process
    phases: dict[str, float] = field(default_factory=dict)  # as the engine reports them (llm, serve)


def _cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "minivllm.cli", *args]


def _model_args(model: str | None) -> list[str]:
    return ["--model", model] if model else []


class Child:
    """A child process whose own peak RSS is read when it is reaped (wait4, not RUSAGE_CHILDREN,
    which is the maximum over all children so far). Its stderr goes to a file: a pipe nobody reads
    could fill up and stall it."""

    def __init__(self, cmd: list[str], env: dict[str, str], stdout: int | None = subprocess.DEVNULL) -> None:
        self.stderr = tempfile.TemporaryFile(mode="w+")
        self.proc = subprocess.Popen(cmd, env=env, stdout=stdout, stderr=self.stderr, text=True)

    def reap(self, what: str, check: bool = True) -> float:
        """Wait for the child; its peak RSS in MiB (ru_maxrss is in KiB on Linux)."""
        _, status, usage = os.wait4(self.proc.pid, 0)
        self.proc.returncode = code = os.waitstatus_to_exitcode(status)
        self.stderr.seek(0)
        if check and code != 0:
            raise RuntimeError(f"{what} exited with {code}: {self.stderr.read()[-2000:]}")
        return usage.ru_maxrss / 1024


def run_generate(model: str | None, env: dict[str, str], cache: str) -> StartupRun:
    start = time.perf_counter()
    child = Child(_cli("generate", PROMPT, "--max-tokens", "8", *_model_args(model)), env)
    rss = child.reap("minivllm generate")
    return StartupRun("generate", cache, time.perf_counter() - start, rss)


def run_llm(model: str | None, env: dict[str, str], cache: str) -> StartupRun:
    child = Child([sys.executable, "-c", _LLM_CHILD, model or ""], env, stdout=subprocess.PIPE)
    out = child.proc.stdout.read()
    rss = child.reap("LLM()")
    result = json.loads(out.strip().splitlines()[-1])
    return StartupRun("llm", cache, result["seconds"], rss, result["phases"])


def run_serve(model: str | None, env: dict[str, str], cache: str) -> StartupRun:
    start = time.perf_counter()
    child = Child(_cli("serve", "--port", "0", *_model_args(model)), env, stdout=subprocess.PIPE)
    try:
        ready = _await_ready(child.proc)
        if ready is not None:
            _await_health(ready[0], start)
        seconds = time.perf_counter() - start
    finally:
        child.proc.terminate()
        child.proc.stdout.close()
        rss = child.reap("minivllm serve", check=False)  # stopped by us
    if ready is None:
        raise RuntimeError(f"minivllm serve exited before it was ready: {child.stderr.read()[-2000:]}")
    return StartupRun("serve", cache, seconds, rss, ready[1])


def _await_ready(proc: subprocess.Popen) -> tuple[str, dict[str, float]] | None:
    """The server's address and start-up phases, from the lines it prints; None if it exits first."""
    url = None
    for line in proc.stdout:
        if m := re.search(r"serving .* on (http://\S+)", line):
            url = m.group(1)
        if line.startswith("minivllm: ready in") and url:
            phases = {name.replace(" ", "_"): float(s)
                      for name, s in re.findall(r"([a-z][a-z ]*?) ([0-9.]+) s", line.split("(", 1)[1])}
            return url, phases
    return None


def _await_health(url: str, start: float) -> None:
    """"ready" is printed once the port is bound; what a client sees is /health."""
    while True:
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=5) as response:
                if response.status == 200:
                    return
        except OSError:
            pass
        if time.perf_counter() - start > SERVE_TIMEOUT_S:
            raise RuntimeError(f"minivllm serve: /health did not answer 200 within {SERVE_TIMEOUT_S:.0f} s")
        time.sleep(0.01)


RUNNERS = {"generate": run_generate, "llm": run_llm, "serve": run_serve}


def run_startup(cases: list[str], model: str | None, warm_runs: int, cold_runs: int) -> list[StartupRun]:
    runs: list[StartupRun] = []
    env = dict(os.environ)
    RUNNERS["generate"](model, env, "warm")  # fills the caches; not counted
    for case in cases:
        runs += [RUNNERS[case](model, env, "warm") for _ in range(warm_runs)]
        for _ in range(cold_runs):
            with tempfile.TemporaryDirectory(prefix="minivllm-cold-cache-") as cache:
                runs.append(RUNNERS[case](model, {**env, "XDG_CACHE_HOME": cache}, "cold"))
    return runs


def startup_table(runs: list[StartupRun]) -> str:
    lines = [f"{'case':<10}{'cache':<7}{'runs':>5}{'median s':>10}{'min s':>8}{'peak RSS MiB':>14}  phases (median run)"]
    for case in CASES:
        for cache in ("warm", "cold"):
            group = sorted((r for r in runs if r.case == case and r.cache == cache), key=lambda r: r.seconds)
            if not group:
                continue
            median = group[len(group) // 2]
            phases = ", ".join(f"{k} {v:.2f}" for k, v in median.phases.items())
            lines.append(f"{case:<10}{cache:<7}{len(group):>5}{statistics.median(r.seconds for r in group):>10.2f}"
                         f"{group[0].seconds:>8.2f}{max(r.peak_rss_mb for r in group):>14.0f}  {phases}")
    return "\n".join(lines)


def startup_json(runs: list[StartupRun]) -> dict:
    return {"prompt": PROMPT, "runs": [asdict(r) for r in runs]}
