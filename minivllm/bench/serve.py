"""`minivllm bench serve`: an online benchmark against any OpenAI-compatible server.

Requests go to /v1/completions with streaming, as `vllm bench serve` sends them: arrivals from a
Poisson (or gamma) process at --request-rate, at most --max-concurrency in flight, greedy,
ignore_eos. Timing is taken on the client, as vLLM takes it: TTFT is send -> first chunk with
choices, ITL the gaps between such chunks, E2E send -> last such chunk; output tokens come from the
final usage chunk (or, when a server sends none, from tokenizing the text). The client is aiohttp, as
vLLM's: its C parser keeps the client's CPU small, which matters when it shares a few cores with the
server it measures (httpx's pure-Python parser took 15 % of a core at twelve streams).
"""
from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import httpx
from tqdm import tqdm

from minivllm.bench.metrics import RequestRecord
from minivllm.bench.workloads import BenchRequest
from minivllm.model.tokenizer import Tokenizer


@dataclass
class ServeTarget:
    base_url: str
    model: str
    api_key: str | None = None
    # LoRA adapters taken in turn, request by request (--lora-modules): named in the request's `model`
    # field (vLLM's and minivllm's way), or with lora_field "lora" as llama-server's adapter ids,
    # `"lora": [{"id": N, "scale": 1.0}]`.
    loras: tuple[str, ...] = ()
    lora_field: str = "model"

    def adapter_fields(self, index: int | None) -> dict:
        """What picks the adapter of the `index`-th request (none for None or without adapters)."""
        if index is None or not self.loras:
            return {}
        lora = self.loras[index % len(self.loras)]
        return {"model": lora} if self.lora_field == "model" else {"lora": [{"id": int(lora), "scale": 1.0}]}

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}


def served_model(base_url: str, api_key: str | None) -> str:
    """The first model the server lists under /v1/models."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        resp = httpx.get(f"{base_url}/v1/models", headers=headers, timeout=30)
        resp.raise_for_status()
        return resp.json()["data"][0]["id"]
    except (httpx.HTTPError, KeyError, IndexError, ValueError) as e:
        raise ValueError(f"cannot list the models of {base_url} ({e}); pass --served-model-name") from None


def counter_totals(base_url: str) -> dict[str, float] | None:
    """Every minivllm counter of /metrics (prefix cache, speculative decoding, ...), by name without the
    prefix, summed over its samples: one server's, or a router's replicas'; None where there is none."""
    from prometheus_client.parser import text_string_to_metric_families

    try:
        resp = httpx.get(f"{base_url}/metrics", timeout=30)
        resp.raise_for_status()
        totals = {family.name.removeprefix("minivllm:"): sum(s.value for s in family.samples
                                                             if s.name.endswith("_total"))
                  for family in text_string_to_metric_families(resp.text)
                  if family.name.startswith("minivllm:") and family.type == "counter"}
    except (httpx.HTTPError, ValueError):  # another server's metrics (llama-server's are off by default)
        return None
    return totals or None


def counter_delta(before: dict | None, after: dict | None, name: str) -> float | None:
    """What the run added to counter `name` (None: no such counter)."""
    if not before or not after or name not in after:
        return None
    return after[name] - before.get(name, 0.0)


def counter_ratio(before: dict | None, after: dict | None, numerator: str, denominator: str) -> float | None:
    """What the run added to `numerator` over what it added to `denominator` (None: no such counters)."""
    added = counter_delta(before, after, denominator)
    num = counter_delta(before, after, numerator)
    return num / added if num is not None and added else None


def _payload(target: ServeTarget, req: BenchRequest, max_tokens: int, index: int | None) -> dict:
    return {"model": target.model, "prompt": req.prompt, "max_tokens": max_tokens, "temperature": 0.0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True},
            **target.adapter_fields(index)}


async def send_request(session: aiohttp.ClientSession, target: ServeTarget, req: BenchRequest,
                       tokenizer: Tokenizer, max_tokens: int | None = None, index: int | None = None) -> RequestRecord:
    """`index`: the request's place in the workload, which picks its adapter (ServeTarget.loras)."""
    payload = _payload(target, req, max_tokens or req.output_len, index)
    record = RequestRecord(req.prompt_len, 0, 0.0, 0.0, success=False)
    text, usage_tokens = "", None
    start = last = time.perf_counter()
    first = True
    try:
        async with session.post(f"{target.base_url}/v1/completions", json=payload, headers=target.headers) as resp:
            if resp.status != 200:
                record.error = f"HTTP {resp.status}: {(await resp.read()).decode(errors='replace')[:200]}"
                return record
            async for line in resp.content:
                if not line.startswith(b"data:"):
                    continue  # blank separators and SSE comments
                data = line[len(b"data:"):].strip()
                if data == b"[DONE]":
                    break
                chunk = json.loads(data)
                if chunk.get("choices"):
                    now = time.perf_counter()
                    if first:
                        record.ttft, first = now - start, False
                    else:
                        record.itl.append(now - last)
                    last = now
                    text += chunk["choices"][0].get("text") or ""
                elif chunk.get("usage"):
                    usage_tokens = chunk["usage"].get("completion_tokens")
                    record.time_breakdown_ms = chunk.get("time_breakdown_ms")  # minivllm's server sends it
    except (aiohttp.ClientError, json.JSONDecodeError) as e:
        record.error = f"{type(e).__name__}: {e}"
        return record
    if first:
        record.error = "the stream ended without a token"
        return record
    record.e2e = last - start
    if usage_tokens is None:
        usage_tokens = len(tokenizer.encode(text, add_special_tokens=False))
    record.output_len = usage_tokens
    record.text = text
    record.success = True
    return record


async def run_benchmark(target: ServeTarget, requests: list[BenchRequest], tokenizer: Tokenizer,
                        max_concurrency: int | None, show_progress: bool = True) -> tuple[list[RequestRecord], float]:
    """Send every request at its arrival offset; (records in request order, duration in seconds)."""
    connector = aiohttp.TCPConnector(limit=max_concurrency or len(requests))
    gate = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    bar = tqdm(total=len(requests), desc="Requests", disable=not show_progress, dynamic_ncols=True)

    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=None)) as client:
        async def one(index: int, req: BenchRequest) -> RequestRecord:
            if gate:
                async with gate:
                    record = await send_request(client, target, req, tokenizer, index=index)
            else:
                record = await send_request(client, target, req, tokenizer, index=index)
            bar.update(1)
            return record

        # A prompt of its own: one of the workload's would be a prefix-cache hit when it runs.
        probe = await send_request(client, target, BenchRequest("probe", "Hello", [], 2), tokenizer)
        if not probe.success:
            raise ValueError(f"the test request to {target.base_url} failed: {probe.error}")
        start = time.perf_counter()
        tasks = []
        for index, req in enumerate(requests):
            delay = start + req.arrival - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(index, req)))
        records = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
    bar.close()
    return list(records), duration


def same_texts(records: list[RequestRecord], reference_json: str) -> bool:
    """Whether every request received the text it received in the run that wrote `reference_json` (bench
    serve --output-json, the same workload): greedy outputs with and without speculative decoding."""
    reference = json.loads(Path(reference_json).read_text())["records"]
    if len(reference) != len(records):
        raise ValueError(f"{reference_json} holds {len(reference)} requests, this run {len(records)}")
    return all(r.success and r.text == ref["text"] for r, ref in zip(records, reference))
