"""Start-up time, by phase: what `minivllm serve` reports when it is ready."""
from __future__ import annotations

import os
import time
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def timed(phases: dict[str, float], name: str) -> Iterator[None]:
    """Add the seconds the block takes to phases[name]."""
    start = time.perf_counter()
    try:
        yield
    finally:
        phases[name] = phases.get(name, 0.0) + time.perf_counter() - start


def process_age() -> float | None:
    """Seconds since this process started (the interpreter's own start-up included), or None where
    /proc does not say."""
    try:
        with open("/proc/self/stat") as f:
            # The fields after the command name (which may hold spaces); starttime is field 22.
            start_ticks = int(f.read().rpartition(")")[2].split()[19])
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    return max(0.0, uptime - start_ticks / os.sysconf("SC_CLK_TCK"))


def phases_text(phases: dict[str, float]) -> str:
    """'import 0.91 s, weights 0.52 s, ...' in the order the phases ran."""
    return ", ".join(f"{name.replace('_', ' ')} {seconds:.2f} s" for name, seconds in phases.items())
