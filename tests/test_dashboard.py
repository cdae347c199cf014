"""The dashboard: the request events the engine publishes, the bounded ring, the event stream of a
real `minivllm serve` (with 5 readers that never read), trace replay, and the page in a real
headless Chromium."""
from __future__ import annotations

import json
import os
import socket
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from minivllm.tracing.live import LiveFeed
from minivllm.tracing.trace import COLUMNS, StepRow
from tests.browser import Browser, find_chromium
from tests.fake_engine import FakeEngine
from tests.test_server import ServerProcess, start_server

API_KEY = "dash-key"
BUDGET = 64  # tokens per step: the long prompt below is prefilled in chunks
AUTH = {"Authorization": f"Bearer {API_KEY}"}
STORY = "Once upon a time, in a village by the sea, there lived an old fisherman and his cat. " * 4


# -- the events, on the real scheduler with a fake model ---------------------------------------------------
def drive(eng: FakeEngine, *feeds: LiveFeed) -> None:
    """Run `eng` to the end, telling `feeds` what LLMEngine tells its observers."""
    for seq in eng.seqs.values():
        for feed in feeds:
            feed.on_request(seq, seq.metrics.arrival_time)
    step = 0
    while eng.sched.has_unfinished():
        t, done = eng.now, len(eng.finished)
        out = eng.step()
        step += 1
        row = StepRow(step, t, eng.now, out.num_scheduled_tokens, out.num_prefill_tokens, out.num_decode_tokens, 0,
                      eng.sched.num_running, eng.sched.num_waiting, eng.bm.num_used_blocks, eng.bm.num_blocks,
                      len(out.preempted), len(eng.finished) - done)
        for feed in feeds:
            feed.record(row, out, eng.finished[done:])


def preempting_engine() -> FakeEngine:
    eng = FakeEngine(num_blocks=12, block_size=4, max_num_batched_tokens=6, watermark=0.0,
                     enable_prefix_caching=False)
    eng.add("old", 8, 40)
    eng.now += 1
    eng.add("new", 8, 40)
    return eng


def states(records: list[dict[str, Any]], rid: str) -> list[dict[str, Any]]:
    return [r for r in records if r["kind"] == "request" and r["request_id"] == rid]


def collapse(events: list[dict[str, Any]]) -> list[str]:
    """The states a request went through, repeats (prefill chunks) merged."""
    return [e["state"] for i, e in enumerate(events) if i == 0 or events[i - 1]["state"] != e["state"]]


def test_request_events_show_chunks_preemption_and_finish() -> None:
    eng = preempting_engine()
    feed = LiveFeed(0.0, {"kind": "run"})
    drive(eng, feed)
    records = feed.since(0).records
    assert [r["seq"] for r in records] == list(range(len(records)))
    new = states(records, "new")
    assert collapse(new) == ["waiting", "prefill", "decode", "preempted", "prefill", "decode", "finished"]
    cut = next(i for i, e in enumerate(new) if e["state"] == "preempted")
    first, again = new[1:cut], new[cut + 1:]
    chunks = [e["num_computed_tokens"] for e in first if e["state"] == "prefill"]
    assert len(chunks) == 2 and chunks[-1] == 8, "the 8-token prompt in two chunks: the budget is 6"
    preempted = new[cut]
    assert preempted["num_computed_tokens"] == 0 and preempted["num_output_tokens"] > 0
    recompute = [e for e in again if e["state"] == "prefill"]
    assert all(e["prefill_len"] == 8 + preempted["num_output_tokens"] for e in recompute), \
        "after a preemption the prefill recomputes the prompt and the output so far"
    assert recompute[-1]["num_computed_tokens"] == recompute[-1]["prefill_len"]
    assert new[-1]["finish_reason"] == "length" and new[-1]["num_output_tokens"] == 40
    assert collapse(states(records, "old")) == ["waiting", "prefill", "decode", "finished"]
    steps = [r for r in records if r["kind"] == "step"]
    assert [s["step"] for s in steps] == list(range(1, len(steps) + 1))
    assert sum(s["num_preempted"] for s in steps) == eng.sched.num_preemptions >= 1


def test_ring_stays_bounded_and_a_late_reader_learns_what_it_missed() -> None:
    full, ring = LiveFeed(0.0, {"kind": "run"}), LiveFeed(0.0, {"kind": "run"}, capacity=16)
    drive(preempting_engine(), full, ring)
    total = len(full.since(0).records)
    assert total > 16 and len(ring) == 16
    late = ring.since(0)
    assert late.missed == total - 16 and late.records == full.since(total - 16).records
    assert ring.since(late.next_seq).records == [], "nothing new"
    assert ring.since(total - 4).records == full.since(total - 4).records and ring.since(total - 4).missed == 0


# -- trace files: the same records, replayed by `minivllm view` ----------------------------------------------
@pytest.fixture(scope="module")
def trace_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Step traces of two engines, continuous and static batching, on the same few requests."""
    from minivllm import LLM, SamplingParams

    out = tmp_path_factory.mktemp("traces")
    prompts = ["Hi", STORY, "Name a color.", "Why?"]
    for scheduler in ("continuous", "static"):
        llm = LLM(dtype="float32", num_kv_blocks=64, max_num_batched_tokens=BUDGET, scheduler=scheduler,
                  static_batch_size=2, trace_file=str(out / f"{scheduler}.csv"))
        feed = LiveFeed(llm.engine.start_time, {})
        llm.engine.observers.append(feed)
        llm.generate(prompts, [SamplingParams(max_tokens=n, ignore_eos=True) for n in (6, 4, 8, 3)], use_tqdm=False)
        llm.engine.close()
        (out / f"{scheduler}.live.json").write_text(json.dumps(feed.since(0).records))
    return out


def test_trace_file_holds_what_the_live_feed_streams(trace_dir: Path) -> None:
    from minivllm.server.dashboard import load_trace

    for name in ("continuous", "static"):
        trace = load_trace(trace_dir / f"{name}.csv")
        live = [{k: v for k, v in r.items() if k != "seq"} for r in json.loads((trace_dir / f"{name}.live.json").read_text())]
        assert trace.records[0]["kind"] == "run" and trace.records[0]["scheduler"] == name
        assert trace.records[1:] == live
        finished = [r for r in live if r["kind"] == "request" and r["state"] == "finished"]
        assert len(finished) == 4 and all(r["finish_reason"] == "length" for r in finished)


def test_view_serves_the_traces_side_by_side(trace_dir: Path) -> None:
    from fastapi.testclient import TestClient

    from minivllm.server.dashboard import build_view_app

    (trace_dir / "csv-only.csv").write_text((trace_dir / "static.csv").read_text())
    app = build_view_app([str(trace_dir / "continuous.csv"), str(trace_dir / "static.json"),
                          str(trace_dir / "csv-only.csv")])
    with TestClient(app) as http:
        info = http.get("/dashboard/info").json()
        assert info["mode"] == "replay" and info["traces"] == ["continuous", "static", "csv-only"]
        traces = http.get("/dashboard/traces").json()
        assert [t["records"][0]["kind"] for t in traces] == ["run", "run", "step"], "a CSV alone: steps only"
        assert http.get("/dashboard/stream").status_code == 404
        assert "<canvas" in http.get("/").text
    with pytest.raises(ValueError, match="no trace there"):
        build_view_app([str(trace_dir / "missing.csv")])


# -- a real server ------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    proc = start_server(tmp_path_factory.mktemp("dashboard") / "server.log", "--api-key", API_KEY,
                        "--max-num-batched-tokens", str(BUDGET), "--max-num-seqs", "4", "--num-kv-blocks", "64")
    yield proc
    assert proc.stop() == 0, proc.log.read_text()


def complete(url: str, prompt: str, max_tokens: int) -> dict[str, Any]:
    body = {"prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True}
    r = httpx.post(f"{url}/v1/completions", json=body, headers=AUTH, timeout=300)
    assert r.status_code == 200, r.text
    return r.json()


def run_load(url: str, jobs: list[tuple[str, int]]) -> list[dict[str, Any]]:
    with ThreadPoolExecutor(len(jobs)) as pool:
        return list(pool.map(lambda job: complete(url, *job), jobs))


JOBS = [(STORY, 12), ("Hello", 6), ("Name three rivers.", 20)]


def test_dashboard_needs_the_key_while_health_and_metrics_stay_open(server: ServerProcess) -> None:
    url = server.url
    for path in ("/dashboard", "/dashboard/info", "/dashboard/stream", "/dashboard/static/dashboard.js"):
        assert httpx.get(url + path).status_code == 401, path
    assert "api_key" in httpx.get(url + "/dashboard").text, "the page asks for the key"
    assert httpx.get(url + "/dashboard/info", params={"api_key": "wrong"}).status_code == 401
    assert httpx.get(url + "/dashboard/info", headers=AUTH).json()["mode"] == "live"
    login = httpx.post(url + "/dashboard/login", data={"api_key": API_KEY})
    assert login.status_code == 303 and "minivllm_dashboard" in login.cookies
    assert API_KEY not in login.headers["set-cookie"], "the cookie holds a hash of the key, not the key"
    page = httpx.get(url + "/", cookies=login.cookies, follow_redirects=True)
    assert page.status_code == 200 and "/dashboard/static/dashboard.js" in page.text
    assert httpx.post(url + "/dashboard/login", data={"api_key": "wrong"}).status_code == 401
    assert httpx.get(url + "/health").status_code == 200 and httpx.get(url + "/metrics").status_code == 200


def read_stream(url: str, until: Any, records: list[dict[str, Any]], timeout: float = 300) -> None:
    """Append the stream's records to `records` until `until(records)` holds."""
    deadline = time.monotonic() + timeout
    with httpx.stream("GET", f"{url}/dashboard/stream", params={"api_key": API_KEY}, timeout=60) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():  # data lines, and a keep-alive comment when idle
            if line.startswith("data: "):
                batch = json.loads(line.removeprefix("data: "))
                assert batch["missed"] == 0
                records.extend(batch["records"])
            if records and until(records):
                return
            assert time.monotonic() < deadline, "the stream did not show it in time"


def test_stream_carries_the_step_trace_and_request_events(server: ServerProcess) -> None:
    records: list[dict[str, Any]] = []
    ids: list[str] = []

    def all_finished(rs: list[dict[str, Any]]) -> bool:
        done = {r["request_id"] for r in rs if r["kind"] == "request" and r["state"] == "finished"}
        return len(ids) == len(JOBS) and set(ids) <= done

    reader = threading.Thread(target=read_stream, args=(server.url, all_finished, records))
    reader.start()
    while not records:  # connected: the run record has come
        time.sleep(0.05)
    responses = run_load(server.url, JOBS)
    ids.extend(f"{r['id']}-0" for r in responses)  # one choice: the engine's request is the id's first
    reader.join()

    assert records[0]["kind"] == "run" and records[0]["max_num_batched_tokens"] == BUDGET
    steps = [r for r in records if r["kind"] == "step"]
    assert steps and all(set(s) == {"kind", "seq", *COLUMNS} for s in steps)
    assert [s["step"] for s in steps] == sorted({s["step"] for s in steps}), "steps rise, none twice"
    for s in steps:
        assert s["num_scheduled_tokens"] == s["num_prefill_tokens"] + s["num_decode_tokens"] + s["num_padding_tokens"]
        assert 0 < s["num_scheduled_tokens"] <= BUDGET and s["num_running"] <= 4
        assert s["num_kv_blocks_used"] <= s["num_kv_blocks_total"] == 64
    numbers = [r["seq"] for r in records[1:]]
    assert numbers == list(range(numbers[0], numbers[0] + len(numbers))), "no record lost"
    for rid, response, (prompt, max_tokens) in zip(ids, responses, JOBS):
        events = states(records, rid)
        assert [e["state"] for e in events][0] == "waiting" and events[-1]["state"] == "finished"
        assert {e["state"] for e in events} == {"waiting", "prefill", "decode", "finished"}
        prefills = [e for e in events if e["state"] == "prefill"]
        n = response["usage"]["prompt_tokens"]
        assert [e["prefill_len"] for e in prefills] == [n] * len(prefills)
        assert prefills[-1]["num_computed_tokens"] == n
        if n > BUDGET:
            assert len(prefills) >= n // BUDGET, "a prompt longer than the budget is prefilled in chunks"
        last = events[-1]
        assert last["finish_reason"] == response["choices"][0]["finish_reason"] == "length"
        assert last["num_output_tokens"] == max_tokens and last["ttft"] > 0 and last["tpot"] > 0


def test_readers_that_never_read_do_not_block_the_engine(server: ServerProcess) -> None:
    host, port = server.url.removeprefix("http://").split(":")
    stalled = []
    for _ in range(5):
        s = socket.socket()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 2048)  # a tiny window: the server's sends back up
        s.connect((host, int(port)))
        s.sendall(f"GET /dashboard/stream HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {API_KEY}\r\n\r\n".encode())
        stalled.append(s)
    try:
        responses = run_load(server.url, JOBS + JOBS)
        assert [r["usage"]["completion_tokens"] for r in responses] == [n for _, n in JOBS + JOBS]
        info = httpx.get(server.url + "/dashboard/info", headers=AUTH).json()
        assert 0 < info["records_held"] <= info["records_capacity"]
        records: list[dict[str, Any]] = []
        read_stream(server.url, lambda rs: any(r["kind"] == "step" for r in rs), records)  # a new reader is served
        for s in stalled:  # each still holds an open stream, unread
            s.setblocking(False)
            assert s.recv(64).startswith(b"HTTP/1.1 200")
    finally:
        for s in stalled:
            s.close()


# -- in a real browser ----------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    executable = find_chromium()
    if executable is None:
        pytest.skip("no chromium on PATH: `apt-get install chromium` (.ci/run does it where apt works)")
    b = Browser(executable)
    yield b
    b.close()


def number(browser: Browser, stat: str) -> int:
    return int(browser.evaluate(f"document.querySelector('[data-stat={stat}]').textContent"))


def test_page_shows_the_live_step_loop(server: ServerProcess, browser: Browser, tmp_path: Path) -> None:
    browser.goto(f"{server.url}/dashboard?api_key={API_KEY}")  # the page trades the key for a cookie
    browser.wait_for("document.getElementById('status').textContent === 'live'", 60)
    assert browser.evaluate("location.pathname + location.search") == "/dashboard", "the key left the address"
    before = number(browser, "steps")
    jobs = [(STORY * 2, 24), ("Hello", 8), ("Name three rivers.", 40), (STORY, 16), ("Why?", 30), ("Hi", 12)]
    load = threading.Thread(target=run_load, args=(server.url, jobs))
    load.start()
    try:
        browser.wait_for(f"Number(document.querySelector('[data-stat=steps]').textContent) > {before}", 120)
        rising = number(browser, "steps")
        browser.wait_for("document.querySelector('.request[data-state=prefill], .request[data-state=decode]') !== null", 120)
        browser.wait_for(f"Number(document.querySelector('[data-stat=steps]').textContent) > {rising}", 120)
    finally:
        load.join()
    browser.wait_for(f"document.querySelectorAll('.request[data-state=finished]').length >= {len(jobs)}", 60)
    label = browser.evaluate("document.querySelector('.request[data-state=finished] text').textContent")
    assert "finished (length)" in label
    assert number(browser, "finished") >= len(jobs)
    assert browser.evaluate("document.querySelector('[data-stat=kv]').textContent").endswith("/ 64")
    assert browser.evaluate("document.querySelector('[data-stat=ttft-p50]').textContent").endswith(" ms")
    time.sleep(0.3)  # one more redraw
    shot = Path(os.environ.get("MINIVLLM_DASHBOARD_SCREENSHOT", tmp_path / "dashboard.png"))
    browser.screenshot(str(shot))
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_page_replays_two_traces(trace_dir: Path, browser: Browser) -> None:
    import uvicorn

    from minivllm.server.dashboard import build_view_app

    app = build_view_app([str(trace_dir / "static.csv"), str(trace_dir / "continuous.csv")])
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"))
    thread = threading.Thread(target=server.run)
    thread.start()
    try:
        while not server.started:
            time.sleep(0.05)
        port = server.servers[0].sockets[0].getsockname()[1]
        browser.goto(f"http://127.0.0.1:{port}/dashboard")
        browser.wait_for("document.querySelectorAll('.panel').length === 2", 30)
        browser.evaluate("document.getElementById('speed').value = '20'")
        browser.wait_for("document.querySelectorAll('.panel .request[data-state=finished]').length === 8", 60)
        names = browser.evaluate("[...document.querySelectorAll('.panel .name')].map(e => e.textContent)")
        assert names == ["static", "continuous"]
        steps = browser.evaluate("[...document.querySelectorAll('.panel [data-stat=steps]')].map(e => e.textContent)")
        assert all(int(n) > 0 for n in steps)
    finally:
        server.should_exit = True
        thread.join()
