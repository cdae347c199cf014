"""The OpenAI-compatible server, as a real `minivllm serve` process on a free loopback port, with the
default model, driven by the official `openai` client (and httpx for what a client should not send)."""
from __future__ import annotations

import asyncio
import itertools
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

MAX_MODEL_LEN = 1024
# float32: the same numbers on every CPU; a small KV pool and context keep start-up and long prompts cheap.
ENGINE_ARGS = ["--dtype", "float32", "--num-kv-blocks", "512", "--max-model-len", str(MAX_MODEL_LEN)]
STARTUP_TIMEOUT_S = 300


@dataclass
class ServerProcess:
    proc: subprocess.Popen
    url: str
    log: Path

    def stop(self) -> int:
        """SIGTERM, as a process manager would; returns the exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout=60)


def start_server(log: Path, *args: str) -> ServerProcess:
    """Start `minivllm serve --port 0` and wait for the address it prints once it is ready."""
    env = {k: v for k, v in os.environ.items() if k != "MINIVLLM_API_KEY"}  # a stray key would gate every test
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "minivllm.cli", "serve", "--port", "0", *ENGINE_ARGS, *args],
                                stdout=out, stderr=subprocess.STDOUT, env=env)
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:
        ready = [line for line in log.read_text().splitlines() if line.startswith("minivllm: serving ")]
        if ready:
            return ServerProcess(proc, ready[0].rsplit(" on ", 1)[1], log)
        if proc.poll() is not None:
            pytest.fail(f"server exited with {proc.returncode}:\n{log.read_text()}")
        time.sleep(0.2)
    proc.kill()
    pytest.fail(f"server not ready after {STARTUP_TIMEOUT_S} s:\n{log.read_text()}")


def engine_pid(server: ServerProcess) -> int:
    """The engine-core process of a server (the default: the engine in its own process)."""
    line = next(x for x in server.log.read_text().splitlines() if x.startswith("minivllm: the engine core runs in "))
    return int(line.rsplit(" ", 1)[1])


def server_fixture(*args: str):
    @pytest.fixture(scope="module")
    def fixture(tmp_path_factory: pytest.TempPathFactory):
        server = start_server(tmp_path_factory.mktemp("server") / "server.log", *args)
        yield server
        assert server.stop() == 0, server.log.read_text()
    return fixture


server = server_fixture()
API_KEY = "sekret-key"
gated_server = server_fixture("--api-key", API_KEY, "--max-num-seqs", "1", "--max-waiting-requests", "1")


@pytest.fixture(scope="module")
def model_name(server: ServerProcess) -> str:
    return httpx.get(f"{server.url}/v1/models").json()["data"][0]["id"]


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)


def scrape(url: str) -> dict[str, float]:
    """/metrics samples by name; labels other than model_name are kept in the key."""
    samples = {}
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics").text):
        for s in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()) if k != "model_name")
            samples[s.name + (f"{{{labels}}}" if labels else "")] = s.value
    return samples


def wait_idle(url: str, timeout: float = 30) -> dict[str, float]:
    """Metrics once nothing runs or waits (the engine reports each step's end state)."""
    deadline = time.monotonic() + timeout
    while True:
        m = scrape(url)
        idle = m["minivllm:num_requests_running"] == 0 and m["minivllm:num_requests_waiting"] == 0
        if idle or time.monotonic() > deadline:
            return m
        time.sleep(0.05)


ABORTED = "minivllm:request_success_total{finished_reason=abort}"


# -- the happy paths ---------------------------------------------------------------------------------------
def test_health_models_and_metrics(server: ServerProcess, client: openai.OpenAI, model_name: str) -> None:
    assert httpx.get(f"{server.url}/health").status_code == 200
    models = client.models.list().data
    assert [m.id for m in models] == [model_name] == ["SmolLM2-135M-Instruct.Q4_1"]
    metrics = scrape(server.url)
    for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "prompt_tokens_total",
                 "generation_tokens_total", "num_preemptions_total", "prefix_cache_queries_total",
                 "prefix_cache_hits_total", "time_to_first_token_seconds_count",
                 "time_per_output_token_seconds_count", "e2e_request_latency_seconds_count",
                 "request_queue_time_seconds_count"):
        assert f"minivllm:{name}" in metrics, name


def test_ready_line_splits_start_up_and_the_warm_up_leaves_no_trace(server: ServerProcess) -> None:
    line = next(x for x in server.log.read_text().splitlines() if x.startswith("minivllm: ready in "))
    total = float(re.match(r"minivllm: ready in ([0-9.]+) s", line).group(1))
    phases = {name: float(s) for name, s in re.findall(r"([a-z][a-z ]*?) ([0-9.]+) s", line.split("(", 1)[1])}
    assert set(phases) == {"import", "kernels", "weights", "tokenizer", "kv pool", "warm up", "chat template",
                           "server"}
    assert sum(phases.values()) == pytest.approx(total, abs=0.05)
    metrics = scrape(server.url)  # runs before any request of this module: the warm-up's token is not counted
    assert metrics["minivllm:prompt_tokens_total"] == metrics["minivllm:generation_tokens_total"] == 0


def test_completion_stream_equals_non_stream(client: openai.OpenAI, model_name: str) -> None:
    kwargs = dict(model=model_name, prompt="The capital of France is", max_tokens=8, temperature=0)
    whole = client.completions.create(**kwargs)
    assert whole.usage.completion_tokens == 8 and whole.usage.prompt_tokens > 0
    assert whole.choices[0].finish_reason == "length" and whole.choices[0].text

    chunks = list(client.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}))
    pieces = [c.choices[0].text for c in chunks if c.choices]
    assert len(pieces) == 8  # one event per generated token (per engine step)
    assert "".join(pieces) == whole.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.model_dump() == whole.usage.model_dump()


def test_chat_stream_equals_non_stream(client: openai.OpenAI, model_name: str) -> None:
    kwargs = dict(model=model_name, messages=[{"role": "system", "content": "You are terse."},
                                              {"role": "user", "content": "Name a colour."}],
                  max_completion_tokens=6, temperature=0)
    whole = client.chat.completions.create(**kwargs)
    message = whole.choices[0].message
    assert message.role == "assistant" and message.content
    assert whole.usage.completion_tokens <= 6

    chunks = list(client.chat.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == whole.choices[0].finish_reason
    assert chunks[-1].usage.model_dump() == whole.usage.model_dump()


def test_n_choices_prompt_lists_and_seeds(client: openai.OpenAI, model_name: str) -> None:
    prompts = ["Once upon a time", "The weather today"]
    lengths = [client.completions.create(model=model_name, prompt=p, max_tokens=1).usage.prompt_tokens for p in prompts]
    kwargs = dict(model=model_name, prompt=prompts, n=2, max_tokens=4, temperature=1.0, seed=7, user="tenant-a",
                  extra_body={"ignore_eos": True, "priority": 1})
    first = client.completions.create(**kwargs)
    assert sorted(c.index for c in first.choices) == [0, 1, 2, 3]
    assert first.usage.completion_tokens == 4 * 4
    assert first.usage.prompt_tokens == sum(lengths)  # each prompt counted once, not once per choice
    again = client.completions.create(**kwargs)
    by_index = lambda r: [c.text for c in sorted(r.choices, key=lambda c: c.index)]  # noqa: E731
    assert by_index(first) == by_index(again)  # seeded sampling is reproducible

    token_prompt = client.completions.create(model=model_name, prompt=[1, 2, 3, 4], n=3, max_tokens=2, temperature=0,
                                             extra_body={"ignore_eos": True})
    assert token_prompt.usage.prompt_tokens == 4 and token_prompt.usage.completion_tokens == 6
    assert len({c.text for c in token_prompt.choices}) == 1  # greedy: every choice alike


def test_logprobs(client: openai.OpenAI, model_name: str) -> None:
    out = client.completions.create(model=model_name, prompt="One, two, three,", max_tokens=3, temperature=0,
                                    logprobs=2, extra_body={"ignore_eos": True})
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 3
    assert "".join(lp.tokens) == out.choices[0].text
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert len(top) == 2 and logprob <= 0
        assert top[token] == pytest.approx(max(top.values()))  # greedy picks the likeliest

    chat = client.chat.completions.create(model=model_name, messages=[{"role": "user", "content": "Hi"}], max_tokens=3,
                                          temperature=0, logprobs=True, top_logprobs=2)
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens
    assert all(len(t.top_logprobs) == 2 and t.logprob == pytest.approx(t.top_logprobs[0].logprob) for t in content)


def test_stop_string_cuts_stream_and_whole_alike(client: openai.OpenAI, model_name: str) -> None:
    kwargs = dict(model=model_name, prompt="The capital of France is", max_tokens=12, temperature=0)
    reference = client.completions.create(**kwargs).choices[0].text
    words = reference.split()
    assert len(words) >= 2, reference
    stop = words[1]
    expected = reference[: reference.index(stop)]
    whole = client.completions.create(**kwargs, stop=[stop]).choices[0]
    assert (whole.text, whole.finish_reason) == (expected, "stop")
    streamed = "".join(c.choices[0].text for c in client.completions.create(**kwargs, stop=[stop], stream=True))
    assert streamed == expected  # the held-back start of the stop string never reaches the client


def test_concurrent_streams_interleave(server: ServerProcess, model_name: str) -> None:
    num_streams, max_tokens = 32, 5

    async def one(client: openai.AsyncOpenAI, i: int) -> tuple[list[tuple[float, int]], int]:
        stream = await client.completions.create(
            model=model_name, prompt=f"Story number {i}:", max_tokens=max_tokens, temperature=0, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
        times, usage = [], None
        async for chunk in stream:
            if chunk.choices:
                times.append((time.monotonic(), i))
            usage = chunk.usage or usage
        return times, usage.completion_tokens

    async def main() -> list[tuple[list[tuple[float, int]], int]]:
        async with openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0,
                                      timeout=300) as client:
            return await asyncio.gather(*(one(client, i) for i in range(num_streams)))

    results = asyncio.run(main())
    assert [len(times) for times, _ in results] == [max_tokens] * num_streams
    assert [tokens for _, tokens in results] == [max_tokens] * num_streams
    # Interleaved: served one after another, the streams' tokens would switch streams 31 times in all.
    arrivals = [stream for _, stream in sorted(event for times, _ in results for event in times)]
    switches = sum(a != b for a, b in itertools.pairwise(arrivals))
    assert switches > 3 * num_streams, arrivals
    assert wait_idle(server.url)["minivllm:kv_cache_usage_perc"] == 0


# -- malformed requests ---------------------------------------------------------------------------------------
CMPL, CHAT = "/v1/completions", "/v1/chat/completions"
USER_HI = [{"role": "user", "content": "hi"}]
MALFORMED = [
    # (id, method, path, JSON body or raw bytes, status, a fragment the message must contain)
    ("bad_json", "POST", CMPL, b'{"prompt": "hi",', 400, "Invalid JSON"),
    ("body_not_object", "POST", CMPL, b"[1, 2]", 400, "object"),
    ("missing_prompt", "POST", CMPL, {"max_tokens": 2}, 400, "prompt: Field required"),
    ("prompt_wrong_type", "POST", CMPL, {"prompt": 5}, 400, "prompt: must be a string"),
    ("prompt_empty", "POST", CMPL, {"prompt": ""}, 400, "prompt is empty"),
    ("prompt_empty_list", "POST", CMPL, {"prompt": []}, 400, "prompt must not be empty"),
    ("token_id_out_of_vocab", "POST", CMPL, {"prompt": [10**9]}, 400, "prompt_token_ids"),
    ("prompt_too_long", "POST", CMPL, {"prompt": "hello " * (MAX_MODEL_LEN + 50)}, 400, "max_model_len"),
    ("max_tokens_string", "POST", CMPL, {"prompt": "hi", "max_tokens": "ten"}, 400, "max_tokens"),
    ("max_tokens_float", "POST", CMPL, {"prompt": "hi", "max_tokens": 2.5}, 400, "max_tokens"),
    ("max_tokens_negative", "POST", CMPL, {"prompt": "hi", "max_tokens": -1}, 400, "max_tokens must be"),
    ("temperature_negative", "POST", CMPL, {"prompt": "hi", "temperature": -1}, 400, "temperature must be >= 0"),
    ("top_p_zero", "POST", CMPL, {"prompt": "hi", "top_p": 0}, 400, "top_p must be in (0, 1]"),
    ("top_p_above_one", "POST", CMPL, {"prompt": "hi", "top_p": 1.5}, 400, "top_p"),
    ("top_k_negative", "POST", CMPL, {"prompt": "hi", "top_k": -5}, 400, "top_k"),
    ("n_zero", "POST", CMPL, {"prompt": "hi", "n": 0}, 400, "n must be"),
    ("n_huge", "POST", CMPL, {"prompt": "hi", "n": 10**6}, 400, "n must be <="),
    ("logprobs_too_many", "POST", CMPL, {"prompt": "hi", "logprobs": 100}, 400, "logprobs"),
    ("stop_wrong_type", "POST", CMPL, {"prompt": "hi", "stop": [1, 2]}, 400, "stop: must be"),
    ("stop_token_ids_negative", "POST", CMPL, {"prompt": "hi", "stop_token_ids": [-1]}, 400, "stop_token_ids"),
    ("min_tokens_above_max", "POST", CMPL, {"prompt": "hi", "max_tokens": 2, "min_tokens": 5}, 400, "min_tokens"),
    ("seed_string", "POST", CMPL, {"prompt": "hi", "seed": "x"}, 400, "seed"),
    ("seed_beyond_64_bits", "POST", CMPL, {"prompt": "hi", "seed": 2**64}, 400, "seed"),
    ("top_k_beyond_64_bits", "POST", CMPL, {"prompt": "hi", "top_k": 2**70}, 400, "top_k"),
    ("temperature_infinite", "POST", CMPL, b'{"prompt": "hi", "temperature": 1e999}', 400, "temperature"),
    ("stop_token_id_out_of_vocab", "POST", CMPL, {"prompt": "hi", "min_tokens": 1, "stop_token_ids": [10**6]}, 400,
     "stop_token_ids"),
    ("priority_float", "POST", CMPL, {"prompt": "hi", "priority": 1.5}, 400, "priority"),
    ("stream_string", "POST", CMPL, {"prompt": "hi", "stream": "yes"}, 400, "stream: Input should be a valid boolean"),
    ("stream_options_ill_typed", "POST", CMPL, {"prompt": "hi", "stream": True,
                                                "stream_options": {"include_usage": "yes"}},
     400, "stream_options.include_usage"),
    ("stream_options_without_stream", "POST", CMPL, {"prompt": "hi", "stream_options": {"include_usage": True}},
     400, "stream_options"),
    ("unknown_field_ill_typed_known_one", "POST", CMPL, {"prompt": "hi", "best_of_luck": 3, "min_p": "x"}, 400,
     "min_p"),
    ("penalty_out_of_range", "POST", CMPL, {"prompt": "hi", "presence_penalty": 2.5}, 400, "presence_penalty"),
    ("wrong_model", "POST", CMPL, {"model": "gpt-4", "prompt": "hi"}, 404, "gpt-4"),
    ("oversized_body", "POST", CMPL, {"prompt": "x" * (5 * 2**20)}, 413, "too large"),
    ("chat_missing_messages", "POST", CHAT, {"max_tokens": 2}, 400, "messages: Field required"),
    ("chat_empty_messages", "POST", CHAT, {"messages": []}, 400, "messages"),
    ("chat_unknown_role", "POST", CHAT, {"messages": [{"role": "wizard", "content": "hi"}]}, 400, "messages.0.role"),
    ("chat_content_wrong_type", "POST", CHAT, {"messages": [{"role": "user", "content": 5}]}, 400, "content"),
    ("chat_message_not_object", "POST", CHAT, {"messages": ["hi"]}, 400, "messages.0"),
    ("chat_max_completion_tokens_negative", "POST", CHAT, {"messages": USER_HI, "max_completion_tokens": -3},
     400, "max_completion_tokens"),
    ("chat_top_logprobs_without_logprobs", "POST", CHAT, {"messages": USER_HI, "top_logprobs": 2}, 400,
     "top_logprobs"),
    ("chat_top_logprobs_too_many", "POST", CHAT, {"messages": USER_HI, "logprobs": True, "top_logprobs": 50}, 400,
     "top_logprobs"),
    ("chat_wrong_model", "POST", CHAT, {"model": "nope", "messages": USER_HI}, 404, "nope"),
    ("chat_prompt_too_long", "POST", CHAT, {"messages": [{"role": "user", "content": "hello " * MAX_MODEL_LEN}]},
     400, "max_model_len"),
    ("max_tokens_beyond_context", "POST", CMPL, {"prompt": "hi", "max_tokens": 100_000_000}, 400,
     f"max_model_len is {MAX_MODEL_LEN}"),
    ("chat_max_tokens_beyond_context", "POST", CHAT, {"messages": USER_HI, "max_tokens": 100_000_000}, 400,
     "max_tokens is 100000000"),
    ("chat_user_without_content", "POST", CHAT, {"messages": [{"role": "user"}]}, 400,
     "messages.0: content is required for a user message"),
    ("chat_system_without_content", "POST", CHAT, {"messages": [{"role": "system", "content": None}, *USER_HI]}, 400,
     "content is required for a system message"),
    ("unknown_path", "GET", "/v1/nothing", None, 404, "Not Found"),
    ("wrong_method", "GET", CMPL, None, 405, "Method Not Allowed"),
]


@pytest.mark.parametrize("method,path,body,status,fragment", [c[1:] for c in MALFORMED],
                         ids=[c[0] for c in MALFORMED])
def test_malformed_request(server: ServerProcess, method: str, path: str, body: dict | bytes | None, status: int,
                           fragment: str) -> None:
    content = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
    r = httpx.request(method, server.url + path, content=content, headers={"content-type": "application/json"},
                      timeout=60)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error"
    assert fragment in error["message"]


def test_server_unharmed_by_malformed_requests(server: ServerProcess, client: openai.OpenAI, model_name: str) -> None:
    assert client.completions.create(model=model_name, prompt="Hello", max_tokens=2).usage.completion_tokens >= 1
    assert wait_idle(server.url)["minivllm:kv_cache_usage_perc"] == 0


# -- clients that hang up ---------------------------------------------------------------------------------------
def test_dropped_stream_is_aborted_and_frees_blocks(server: ServerProcess, model_name: str) -> None:
    before = wait_idle(server.url)
    body = {"model": model_name, "prompt": "Tell me a long story.", "max_tokens": 1000, "ignore_eos": True,
            "stream": True}
    with httpx.Client(timeout=60) as http, http.stream("POST", f"{server.url}/v1/completions", json=body) as r:
        events = 0
        for line in r.iter_lines():
            events += line.startswith("data: ")
            if events == 3:
                assert scrape(server.url)["minivllm:kv_cache_usage_perc"] > 0  # it holds blocks while running
                break
    after = wait_idle(server.url)
    assert after.get(ABORTED, 0) == before.get(ABORTED, 0) + 1
    assert after["minivllm:kv_cache_usage_perc"] == 0
    assert after["minivllm:generation_tokens_total"] - before["minivllm:generation_tokens_total"] < 1000


def test_dropped_non_streamed_request_is_aborted(server: ServerProcess, model_name: str) -> None:
    """The client hangs up while its request runs (a client-side timeout, as users have): the server notices
    and aborts it. The hang-up waits until the request runs, so that a slow machine cannot make it early."""
    before = wait_idle(server.url)
    body = json.dumps({"model": model_name, "prompt": "Tell me a long story.", "max_tokens": 1000,
                       "ignore_eos": True}).encode()
    host, port = httpx.URL(server.url).host, httpx.URL(server.url).port
    with socket.create_connection((host, port)) as conn:
        conn.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
        deadline = time.monotonic() + 60
        while scrape(server.url)["minivllm:num_requests_running"] == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
    after = wait_idle(server.url)
    assert after.get(ABORTED, 0) == before.get(ABORTED, 0) + 1
    assert after["minivllm:kv_cache_usage_perc"] == 0


# -- the gated server: API key, waiting-queue limit, shutdown ------------------------------------------------------
def test_api_key_gate(gated_server: ServerProcess) -> None:
    url = gated_server.url
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}):
        r = httpx.get(f"{url}/v1/models", headers=headers)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        assert "API key" in r.json()["error"]["message"]
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{url}/v1", api_key="wrong", max_retries=0).completions.create(
            model="any", prompt="hi", max_tokens=1)
    client = openai.OpenAI(base_url=f"{url}/v1", api_key=API_KEY, max_retries=0, timeout=120)
    name = client.models.list().data[0].id
    assert client.completions.create(model=name, prompt="Hi", max_tokens=2).choices[0].text is not None
    # Probes and scrapes stay open, as in vLLM.
    assert httpx.get(f"{url}/health").status_code == 200
    assert httpx.get(f"{url}/metrics").status_code == 200


def test_waiting_queue_limit(gated_server: ServerProcess) -> None:
    """max_num_seqs 1, max_waiting_requests 1: one runs, one waits, the next is refused."""
    url, auth = gated_server.url, {"Authorization": f"Bearer {API_KEY}"}
    body = {"prompt": "Count to a thousand:", "max_tokens": 500, "ignore_eos": True, "stream": True}
    with httpx.Client(timeout=60, headers=auth) as http:
        with http.stream("POST", f"{url}/v1/completions", json=body) as running:
            lines = running.iter_lines()  # kept: a dropped iterator closes the connection, which aborts
            next(line for line in lines if line.startswith("data: "))  # it has a token: it runs
            with http.stream("POST", f"{url}/v1/completions", json=body) as waiting:
                assert waiting.status_code == 200  # accepted, queued behind the running one
                refused = http.post(f"{url}/v1/completions", json={"prompt": "Hi", "max_tokens": 1})
                assert refused.status_code == 503, refused.text
                error = refused.json()["error"]
                assert error["code"] == "queue_full" and "waiting" in error["message"]
    m = wait_idle(url)  # both hung up: aborted, and the queue is free again
    assert m["minivllm:kv_cache_usage_perc"] == 0
    assert httpx.post(f"{url}/v1/completions", json={"prompt": "Hi", "max_tokens": 1}, headers=auth).status_code == 200


def test_sigterm_finishes_in_flight_then_exits_0(gated_server: ServerProcess) -> None:
    url, max_tokens = gated_server.url, 12
    body = {"prompt": "Once upon a time", "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
    with httpx.Client(timeout=60, headers={"Authorization": f"Bearer {API_KEY}"}) as http:
        with http.stream("POST", f"{url}/v1/completions", json=body) as r:
            events = []
            for line in r.iter_lines():
                if not line.startswith("data: "):
                    continue
                events.append(line.removeprefix("data: "))
                if len(events) == 1:
                    gated_server.proc.send_signal(signal.SIGTERM)
                    time.sleep(0.5)
                    with pytest.raises(httpx.ConnectError):  # no longer accepting
                        httpx.get(f"{url}/health", timeout=5)
    assert events[-1] == "[DONE]"
    assert len(events) == max_tokens + 1  # the in-flight request finished
    assert gated_server.proc.wait(timeout=60) == 0
    assert not Path(f"/proc/{engine_pid(gated_server)}").exists()  # the engine process stopped with it



# -- the same request, the same answer (issue 12) ------------------------------------------------------------
bf16_server = server_fixture("--dtype", "bfloat16")  # the default dtype on CPUs with bf16 instructions


def test_repeated_request_gives_identical_text_amid_other_traffic(bf16_server: ServerProcess) -> None:
    """The report of issue 12: one chat request sent again and again (the repeats hit the prefix cache),
    streamed and not, while other requests come and go, answers the same text every time."""
    messages = [{"role": "user", "content": "Describe the colour blue to someone who has never seen it."}]

    model = httpx.get(f"{bf16_server.url}/v1/models").json()["data"][0]["id"]

    async def same(client: openai.AsyncOpenAI, stream: bool) -> str:
        if not stream:
            r = await client.chat.completions.create(model=model, messages=messages, max_tokens=40, temperature=0)
            return r.choices[0].message.content
        chunks = await client.chat.completions.create(model=model, messages=messages, max_tokens=40,
                                                      temperature=0, stream=True)
        return "".join([c.choices[0].delta.content or "" async for c in chunks if c.choices])

    async def other(client: openai.AsyncOpenAI, i: int) -> None:
        await client.completions.create(model=model, prompt=f"Tell tale number {i} " * (1 + i % 7),
                                        max_tokens=8 + 3 * i, temperature=0.8)

    async def main() -> list[str]:
        async with openai.AsyncOpenAI(base_url=f"{bf16_server.url}/v1", api_key="unused", max_retries=0,
                                      timeout=300) as client:
            texts = []
            for i in range(5):  # each repeat lands among other requests at another point of their lives
                background = [asyncio.create_task(other(client, 3 * i + j)) for j in range(3)]
                texts += await asyncio.gather(same(client, stream=False), same(client, stream=True))
                await asyncio.gather(*background)
            return texts

    texts = asyncio.run(main())
    assert len(set(texts)) == 1, texts
    assert scrape(bf16_server.url)["minivllm:prefix_cache_hits_total"] > 0
