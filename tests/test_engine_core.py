"""The engine core in its own process (`minivllm serve`'s default; test_server.py's tests all run through
it too): the same answers as the in-process engine, the frontend's own endpoints, an idle engine that
sleeps, aborts that free the pool, and an engine process that dies mid-stream."""
from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import httpx

from tests.test_server import (ServerProcess, engine_pid, model_name, scrape, server_fixture,  # noqa: F401 (fixtures)
                               wait_idle)

DEATH_TIMEOUT_S = 10  # every open stream has its error object and [DONE] within this long of the kill

server = server_fixture()  # the engine core in its own process
in_process_server = server_fixture("--disable-frontend-multiprocessing")


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far (/proc/PID/stat, fields 14 and 15)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


REQUESTS = [  # greedy and seeded sampling; logprobs; a stop string; n > 1; a chat with a stop token
    ("/v1/completions", {"prompt": "The capital of France is", "max_tokens": 12, "temperature": 0, "logprobs": 2}),
    ("/v1/completions", {"prompt": "Once upon a time", "max_tokens": 12, "temperature": 0.8, "seed": 7, "n": 2}),
    ("/v1/completions", {"prompt": "List three colors:", "max_tokens": 40, "temperature": 0, "stop": ["\n\n", "3."]}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Name a fruit."}], "max_tokens": 16,
                              "temperature": 0, "stop_token_ids": [30]}),
]


def _answer(url: str, path: str, body: dict) -> list[dict]:
    r = httpx.post(url + path, json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["choices"]


def test_outputs_identical_to_the_in_process_engine(server: ServerProcess, in_process_server: ServerProcess) -> None:
    answers = []
    for path, body in REQUESTS:
        answers.append(_answer(server.url, path, body))
        assert answers[-1] == _answer(in_process_server.url, path, body), (path, body)
    # The stop string ended its request in the frontend, the stop token in the engine.
    assert answers[2][0]["stop_reason"] in ("\n\n", "3.") and answers[3][0]["stop_reason"] == 30


def test_time_breakdown_per_request(server: ServerProcess) -> None:
    r = httpx.post(f"{server.url}/v1/completions", json={"prompt": "Hi", "max_tokens": 4, "ignore_eos": True},
                   timeout=60).json()
    times = r["time_breakdown_ms"]
    assert set(times) == {"frontend_queue", "engine_queue", "prefill", "decode", "detokenize_stream"}
    assert all(v is not None and v >= 0 for v in times.values()), times


def test_tokenize_and_detokenize(server: ServerProcess) -> None:
    r = httpx.post(f"{server.url}/tokenize", json={"prompt": "Hello world", "return_token_strs": True}).json()
    assert r["count"] == len(r["tokens"]) == len(r["token_strs"]) >= 2 and r["max_model_len"] == 1024
    assert "".join(r["token_strs"]).replace("Ġ", " ").endswith("Hello world")
    back = httpx.post(f"{server.url}/detokenize", json={"tokens": r["tokens"]}).json()
    assert back == {"prompt": "Hello world"}
    chat = httpx.post(f"{server.url}/tokenize",
                      json={"messages": [{"role": "user", "content": "Hello world"}]}).json()
    assert chat["count"] == len(chat["tokens"]) > r["count"]
    assert "Hello world" in httpx.post(f"{server.url}/detokenize", json={"tokens": chat["tokens"]}).json()["prompt"]
    bad = httpx.post(f"{server.url}/detokenize", json={"tokens": [10**9]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"
    both = httpx.post(f"{server.url}/tokenize", json={"prompt": "a", "messages": [{"role": "user", "content": "b"}]})
    assert both.status_code == 400


def test_idle_engine_process_uses_no_cpu(server: ServerProcess) -> None:
    wait_idle(server.url)
    pids = [server.proc.pid, engine_pid(server)]
    before = [cpu_seconds(p) for p in pids]
    time.sleep(3)
    used = [cpu_seconds(p) - b for p, b in zip(pids, before)]
    assert used[1] < 0.15, f"the idle engine process used {used[1]:.2f} s of CPU in 3 s"
    assert used[0] < 0.3, f"the idle frontend used {used[0]:.2f} s of CPU in 3 s"


def test_dropped_streams_free_every_block(server: ServerProcess, model_name: str) -> None:
    body = {"model": model_name, "prompt": "Tell me a long story.", "max_tokens": 500, "ignore_eos": True,
            "stream": True}
    with httpx.Client(timeout=60) as http:
        streams = [http.stream("POST", f"{server.url}/v1/completions", json=body) for _ in range(4)]
        lines = [s.__enter__().iter_lines() for s in streams]  # kept: a dropped iterator hangs up
        for stream_lines in lines:
            next(line for line in stream_lines if line.startswith("data: "))
        assert scrape(server.url)["minivllm:kv_cache_usage_perc"] > 0
        for s in streams:
            s.__exit__(None, None, None)
    assert wait_idle(server.url)["minivllm:kv_cache_usage_perc"] == 0


def test_engine_death_ends_every_stream_with_an_error(server: ServerProcess, model_name: str) -> None:
    """Runs last in this module: it kills the module server's engine."""
    body = {"model": model_name, "prompt": "Tell me a long story.", "max_tokens": 900, "ignore_eos": True,
            "stream": True}
    started, ends = threading.Barrier(4), {}

    def one(i: int) -> None:
        with httpx.Client(timeout=DEATH_TIMEOUT_S * 3) as http, \
                http.stream("POST", f"{server.url}/v1/completions", json=body) as r:
            events = []
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append(line.removeprefix("data: "))
                    if len(events) == 1:
                        started.wait()
            ends[i] = (events[-2:], time.monotonic())

    threads = [threading.Thread(target=one, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    started.wait(timeout=60)
    os.kill(engine_pid(server), signal.SIGKILL)
    killed = time.monotonic()
    health = None
    while time.monotonic() - killed < 1.0:
        health = httpx.get(f"{server.url}/health", timeout=1).status_code
        if health == 503:
            break
        time.sleep(0.05)
    assert health == 503
    for t in threads:
        t.join(timeout=DEATH_TIMEOUT_S)
        assert not t.is_alive(), "a stream still hangs after the engine died"
    for (error, done), at in ends.values():
        assert '"engine_dead"' in error and done == "[DONE]", (error, done)
        assert at - killed < DEATH_TIMEOUT_S
    r = httpx.post(f"{server.url}/v1/completions", json={"prompt": "Hi", "max_tokens": 2})
    assert r.status_code == 503 and r.json()["error"]["code"] == "engine_dead"
    assert server.stop() == 0  # SIGTERM: the frontend still shuts down cleanly
