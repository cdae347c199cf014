"""`minivllm serve --data-parallel-size N`: N `minivllm serve` processes on loopback ports, each an
engine of its own, behind the router in this process.

Each replica gets an equal share of the CPU cores as its torch threads (OMP_NUM_THREADS, unless set),
dies with this process (PR_SET_PDEATHSIG), and is stopped with SIGTERM when the front stops.
"""
from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from minivllm.router.server import RouterOptions, print_line, run_router

STARTUP_TIMEOUT_S = 600
STOP_TIMEOUT_S = 60
_PR_SET_PDEATHSIG = 1


@dataclass
class ReplicaProcess:
    index: int
    proc: subprocess.Popen
    url: str | None = None
    ready: threading.Event = field(default_factory=threading.Event)

    def relay(self) -> None:
        """Print the replica's output, prefixed, and catch the address it serves on."""
        for line in self.proc.stdout:
            if line.startswith("minivllm: serving ") and self.url is None:
                self.url = line.rsplit(" on ", 1)[1].strip()
                self.ready.set()
            if '"GET /health HTTP' not in line:  # the router's health checks, every second
                print_line(f"[replica {self.index}] " + line.removesuffix("\n"))
        self.ready.set()  # it exited


def _die_with_parent() -> None:
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


def start_replicas(serve_argv: list[str], n: int, host: str = "127.0.0.1") -> list[ReplicaProcess]:
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // n)))
    # Later flags win in argparse: each replica is a plain one-engine server on a free port of `host`.
    argv = [sys.executable, "-m", "minivllm.cli", "serve", *serve_argv,
            "--host", host, "--port", "0", "--data-parallel-size", "1", "--data-parallel-backend", "mp"]
    replicas = []
    for i in range(n):
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                                preexec_fn=_die_with_parent if sys.platform == "linux" else None)
        replicas.append(ReplicaProcess(i, proc))
        threading.Thread(target=replicas[-1].relay, daemon=True).start()
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    for r in replicas:
        if not r.ready.wait(max(0.0, deadline - time.monotonic())) or r.url is None:
            stop_replicas(replicas)
            raise RuntimeError(f"data-parallel replica {r.index} did not start (exit code {r.proc.poll()}); "
                               "its output is above")
    return replicas


def stop_replicas(replicas: list[ReplicaProcess]) -> None:
    for r in replicas:
        if r.proc.poll() is None:
            r.proc.send_signal(signal.SIGTERM)
    for r in replicas:
        try:
            r.proc.wait(timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            r.proc.kill()
            r.proc.wait()


def serve_data_parallel(serve_argv: list[str], n: int, host: str, port: int, **router_options: Any) -> None:
    replicas = start_replicas(serve_argv, n)
    for r in replicas:
        print_line(f"minivllm: replica {r.index} (pid {r.proc.pid}) on {r.url}")
    try:
        run_router(RouterOptions([r.url for r in replicas], **router_options), host, port)
    finally:
        stop_replicas(replicas)
