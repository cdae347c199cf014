"""Data parallel behind the router: `minivllm serve --data-parallel-size 2` (two engine processes,
each a real `minivllm serve`, behind the router in the front process), driven as the server tests
drive one server, and the prefix-aware policy's key per LoRA adapter. The last two tests kill one replica
mid-load and stop the other."""
from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import time

import httpx
import pytest

from minivllm.router.policies import Router
from minivllm.router.server import BYTES_PER_BLOCK, MAX_BLOCKS, RoutingKey
from tests.test_server import (  # noqa: F401 (fixtures and the core cases, run here through the router)
    ServerProcess, client, model_name, scrape, start_server, test_chat_stream_equals_non_stream,
    test_completion_stream_equals_non_stream, test_logprobs, test_malformed_request,
    test_n_choices_prompt_lists_and_seeds, test_stop_string_cuts_stream_and_whole_alike)

SYSTEM = ("You are the support assistant of a bicycle shop. Answer in one short sentence, politely, and never "
          "invent prices. The shop opens at nine, closes at six, and repairs brakes, gears and wheels. ") * 2


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    server = start_server(tmp_path_factory.mktemp("router") / "server.log", "--data-parallel-size", "2",
                          "--routing-policy", "prefix-aware", "--health-check-timeout", "3")
    yield server
    assert server.stop() == 0, server.log.read_text()
    assert "minivllm: replica" in server.log.read_text()


def replicas(server: ServerProcess) -> dict[str, int]:
    """Each replica's URL -> its process id, as the front prints them."""
    return {url: int(pid) for pid, url in
            re.findall(r"^minivllm: replica \d+ \(pid (\d+)\) on (\S+)$", server.log.read_text(), re.M)}


def per_replica(server: ServerProcess, name: str) -> dict[str, float]:
    metrics = scrape(server.url)
    return {url: metrics.get(f"minivllm:{name}{{replica={url}}}", 0.0) for url in replicas(server)}


def test_health_and_metrics_per_replica(server: ServerProcess) -> None:
    urls = replicas(server)
    assert len(urls) == 2
    health = httpx.get(f"{server.url}/health").json()["replicas"]
    assert [(r["url"], r["healthy"]) for r in health] == [(url, True) for url in urls]
    for name in ("num_requests_running", "kv_cache_usage_perc", "prefix_cache_hits_total",
                 "time_to_first_token_seconds_count"):
        assert set(per_replica(server, name)) == set(urls)
    assert all(v == 1 for v in per_replica(server, "router_replica_up").values())


def test_prefix_aware_keeps_a_shared_system_prompt_on_one_replica(server: ServerProcess, model_name: str) -> None:
    tokens_before, hits_before = per_replica(server, "prompt_tokens_total"), per_replica(server, "prefix_cache_hits_total")

    def body(question: str) -> dict:
        return {"model": model_name, "max_tokens": 2, "temperature": 0,
                "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]}

    async def main() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=server.url, timeout=120) as http:
            first = await http.post("/v1/chat/completions", json=body("When do you open?"))
            # Together, these would be spread over both replicas by load alone.
            rest = await asyncio.gather(*(http.post("/v1/chat/completions", json=body(q)) for q in
                                          ("Do you fix gears?", "Can I buy a helmet?", "Where are you?")))
            return [first, *rest]

    answers = asyncio.run(main())
    assert all(r.status_code == 200 for r in answers)
    assert len({r.headers["x-minivllm-replica"] for r in answers}) == 1
    served = answers[0].headers["x-minivllm-replica"]
    tokens, hits = per_replica(server, "prompt_tokens_total"), per_replica(server, "prefix_cache_hits_total")
    assert {url for url in tokens if tokens[url] > tokens_before[url]} == {served}
    assert hits[served] - hits_before[served] >= 3 * 32  # the three later ones found the system prompt cached


def test_prefix_affinity_is_per_adapter() -> None:
    """The same prompt under two adapters shares no KV in an engine (its blocks are keyed by adapter), so
    the router keys it apart too; under one adapter twice it keys it the same and keeps it together."""
    def key(model: str | None) -> RoutingKey:
        return RoutingKey.of("/v1/completions", json.dumps({"model": model, "prompt": SYSTEM}).encode())

    router = Router.create("prefix-aware", ["r0", "r1"], block_size=BYTES_PER_BLOCK, max_blocks=MAX_BLOCKS)
    hashes = {model: router.policy.hashes(key(model).units, key(model).salt) for model in ("sql", "poem", None)}
    assert len(hashes["sql"]) > 1  # several whole blocks of the prompt
    assert hashes["sql"] == router.policy.hashes(key("sql").units, key("sql").salt)
    assert not set(hashes["sql"]) & set(hashes["poem"]) and not set(hashes["sql"]) & set(hashes[None])

    def route(request_id: str, model: str | None) -> int:
        k = key(model)
        return router.route(request_id, k.units, k.max_tokens, k.prompt_tokens + k.max_tokens, k.salt)

    first = route("a", "sql")
    assert route("b", "poem") != first  # no affinity: the least loaded replica
    assert route("c", "sql") == first  # its own blocks: back where they were sent


def test_killed_replica_leaves_rotation_waiting_requests_move_streams_end_with_an_error(
        server: ServerProcess, model_name: str) -> None:
    """Runs last: it kills one replica. Streams already streaming from it end with an OpenAI error
    object; every other request (non-streamed ones on it included) completes on the survivor."""
    urls = replicas(server)
    max_tokens, n = 96, 6
    victim_started = asyncio.Event()
    streams: list[dict] = []

    async def stream(http: httpx.AsyncClient, i: int) -> None:
        record = {"events": []}
        streams.append(record)
        body = {"model": model_name, "prompt": f"Story {i}: once", "max_tokens": max_tokens, "ignore_eos": True,
                "stream": True}
        async with http.stream("POST", "/v1/completions", json=body) as r:
            record["replica"] = r.headers["x-minivllm-replica"]
            async for line in r.aiter_lines():
                if line.startswith("data: "):
                    record["events"].append(line.removeprefix("data: "))
                    if record["replica"] == victim:
                        victim_started.set()

    async def whole(http: httpx.AsyncClient, i: int) -> httpx.Response:
        return await http.post("/v1/completions", json={"model": model_name, "prompt": f"Poem {i}: the",
                                                         "max_tokens": max_tokens, "ignore_eos": True})

    async def main() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=server.url, timeout=180) as http:
            work = asyncio.gather(*(stream(http, i) for i in range(n)), *(whole(http, i) for i in range(n)))
            await asyncio.wait_for(victim_started.wait(), 120)
            os.kill(urls[victim], signal.SIGKILL)
            return [r for r in await work if r is not None]

    victim = list(urls)[0]
    retries_before = scrape(server.url)["minivllm:router_retries"]
    wholes = asyncio.run(main())
    survivor = list(urls)[1]

    for r in wholes:  # not yet streaming when the replica died: moved to the survivor, complete
        assert r.status_code == 200, r.text
        assert r.headers["x-minivllm-replica"] == survivor
        assert r.json()["usage"]["completion_tokens"] == max_tokens
    assert scrape(server.url)["minivllm:router_retries"] > retries_before
    on_victim = [s for s in streams if s["replica"] == victim]
    assert on_victim
    for s in streams:
        assert s["events"][-1] == "[DONE]"
        if s["replica"] == victim:  # it was streaming: an error object, then [DONE]
            error = json.loads(s["events"][-2])["error"]
            assert error["code"] == "replica_failed" and victim in error["message"]
            assert 1 <= len(s["events"]) - 2 < max_tokens
        else:
            assert len(s["events"]) == max_tokens + 1
    health = {r["url"]: r["healthy"] for r in httpx.get(f"{server.url}/health").json()["replicas"]}
    assert health == {victim: False, survivor: True}
    after = httpx.post(f"{server.url}/v1/completions", json={"prompt": "Hello", "max_tokens": 2}, timeout=60)
    assert after.status_code == 200 and after.headers["x-minivllm-replica"] == survivor


def test_a_replica_that_stops_answering_leaves_rotation_nothing_hangs_and_it_rejoins(server: ServerProcess) -> None:
    """After the kill above, one replica is left: stopped (SIGSTOP), it accepts connections but
    answers nothing. Its health check times out (3 s here), the request waiting on it is cut and,
    with no replica left, answered 503; resumed, it rejoins."""
    urls = replicas(server)
    survivor = next(r["url"] for r in httpx.get(f"{server.url}/health").json()["replicas"] if r["healthy"])
    os.kill(urls[survivor], signal.SIGSTOP)
    try:
        r = httpx.post(f"{server.url}/v1/completions", json={"prompt": "Hello", "max_tokens": 2}, timeout=60)
        assert r.status_code == 503 and r.json()["error"]["code"] == "no_replica", r.text
        assert "health check failed" in r.json()["error"]["message"]
    finally:
        os.kill(urls[survivor], signal.SIGCONT)
    deadline = time.monotonic() + 30
    while not httpx.get(f"{server.url}/health").status_code == 200:
        assert time.monotonic() < deadline, "the resumed replica did not rejoin"
        time.sleep(0.5)
    assert httpx.post(f"{server.url}/v1/completions", json={"prompt": "Hello", "max_tokens": 2},
                      timeout=60).status_code == 200


def test_agent_apis_are_keyed_by_their_prompt_and_prompt_cache_key() -> None:
    """A Responses conversation's turns (Codex CLI sends its thread id as prompt_cache_key) go where the
    first went, even when little of the prompt is shared; a Messages request is keyed by its system
    prompt, tools and messages."""
    router = Router.create("prefix-aware", ["r0", "r1"], block_size=BYTES_PER_BLOCK, max_blocks=MAX_BLOCKS)

    def route(request_id: str, path: str, body: dict) -> int:
        k = RoutingKey.of(path, json.dumps(body).encode())
        return router.route(request_id, k.units, k.max_tokens, k.prompt_tokens + k.max_tokens, k.salt)

    thread = {"prompt_cache_key": "thread-1", "max_output_tokens": 64}
    first = route("a", "/v1/responses", {**thread, "input": "short"})
    assert route("b", "/v1/responses", {"input": "short too", "max_output_tokens": 64}) != first  # least loaded
    assert route("c", "/v1/responses", {**thread, "input": "another short turn"}) == first
    claude = {"system": SYSTEM, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 32}
    there = route("d", "/v1/messages", claude)
    assert route("e", "/v1/messages", {**claude, "messages": [
        {"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}) == there
    assert RoutingKey.of("/v1/messages", json.dumps(claude).encode()).max_tokens == 32
