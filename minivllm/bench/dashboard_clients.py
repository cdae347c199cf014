"""Does the dashboard slow the engine? The step time of `minivllm serve` with and without dashboard
readers that connect to /dashboard/stream and never read (the worst reader: its stream backs up).

    python -m minivllm.bench.dashboard_clients --clients 5 --num-prompts 16 --output-len 64

Runs alternate (none, stalled, none, stalled, ...) on one server in this process; the step times
are the engine's own (the step records of the live feed), so HTTP time is not counted in them.
"""
from __future__ import annotations

import argparse
import socket
import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import uvicorn

from minivllm.config import EngineConfig
from minivllm.engine.llm_engine import LLMEngine
from minivllm.frontend.async_engine import AsyncEngine
from minivllm.server.api import ServerOptions, build_app


def stalled_readers(host: str, port: int, n: int) -> list[socket.socket]:
    """`n` stream readers that never read; a tiny receive window makes the server's sends back up."""
    readers = []
    for _ in range(n):
        s = socket.socket()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 2048)
        s.connect((host, port))
        s.sendall(f"GET /dashboard/stream HTTP/1.1\r\nHost: {host}\r\n\r\n".encode())
        readers.append(s)
    return readers


def one_run(url: str, feed, num_prompts: int, input_len: int, output_len: int) -> list[float]:
    """Step durations (seconds) of one batch of requests sent at once."""
    first = feed.oldest_seq + len(feed)
    body = {"prompt": [7] * input_len, "max_tokens": output_len, "ignore_eos": True}
    with ThreadPoolExecutor(num_prompts) as pool:
        list(pool.map(lambda _: httpx.post(f"{url}/v1/completions", json=body, timeout=3600).raise_for_status(),
                      range(num_prompts)))
    batch = feed.since(first, limit=feed.capacity)
    assert not batch.missed, "raise the feed's capacity: the run's steps left the ring"
    return [r["t_end"] - r["t_start"] for r in batch.records if r["kind"] == "step"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", type=int, default=5, help="stalled dashboard readers in the 'with' runs")
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--input-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3, help="runs of each kind, alternating")
    EngineConfig.add_cli_args(parser)
    args = parser.parse_args()
    engine = LLMEngine(EngineConfig.from_cli_args(args))
    app = build_app(AsyncEngine(engine), ServerOptions("bench"))
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"))
    thread = threading.Thread(target=server.run)
    thread.start()
    while not server.started:
        time.sleep(0.05)
    host, port = server.servers[0].sockets[0].getsockname()[:2]
    url, feed = f"http://{host}:{port}", app.state.dashboard.feed
    try:
        one_run(url, feed, 2, args.input_len, 4)  # warm-up
        times: dict[int, list[float]] = {0: [], args.clients: []}
        for _ in range(args.repeats):
            for n in times:
                readers = stalled_readers(host, port, n)
                times[n] += one_run(url, feed, args.num_prompts, args.input_len, args.output_len)
                for s in readers:
                    s.close()
        print(f"{args.num_prompts} requests x {args.input_len} prompt + {args.output_len} output tokens, "
              f"{args.repeats} runs each, device {engine.device_name}")
        print("stalled readers | steps | mean step ms | median step ms")
        for n, ts in times.items():
            print(f"{n:>15} | {len(ts):>5} | {statistics.mean(ts) * 1e3:>12.2f} | {statistics.median(ts) * 1e3:>14.2f}")
    finally:
        server.should_exit = True
        thread.join()


if __name__ == "__main__":
    main()
