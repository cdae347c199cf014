"""The messages between the frontend (`minivllm serve`'s HTTP process) and the engine-core process.

    frontend --Add / Abort / UtilityCall--> engine core      (one PUSH/PULL socket each way, ZMQ)
    frontend <--Ready / Reply / OutputBatch-- engine core

Typed msgspec Structs encoded as MessagePack arrays (array_like: no field names on the wire;
omit_defaults: a request without logprobs sends none). SamplingParams, a dataclass, travels as itself
(msgspec encodes dataclasses by field and runs __post_init__ on decode, which validates again).

Measured with `python -m minivllm.frontend.core_messages` (one step's outputs for twelve decoding streams,
one new token each): msgspec encodes and decodes the batch in ~9 us, 642 bytes; pickling the cumulative
RequestOutputs the in-process engine hands over (12 requests, 100 tokens in) takes ~410 us, 6.2 kB.
"""
from __future__ import annotations

from typing import Any

import msgspec

from minivllm.lora.request import LoRARequest
from minivllm.sampling_params import SamplingParams


class _Message(msgspec.Struct, array_like=True, omit_defaults=True, tag=True):
    """A tagged union member: the decoder reads any message and knows which it is."""


# -- frontend -> engine core -------------------------------------------------------------------------------
class AddRequest(msgspec.Struct, array_like=True, omit_defaults=True):
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams  # n = 1 (the frontend fans n > 1 out); structured_outputs: the grammar's source
    arrival_time: float  # the engine's arrival time of it, taken by the frontend: time.perf_counter (on Linux
    # CLOCK_MONOTONIC, one clock for both processes)
    priority: int = 0
    tenant: str = "default"
    lora_request: LoRARequest | None = None  # a dataclass: msgspec encodes it as an array of its fields


class Add(_Message):
    """A group of requests (the choices of one HTTP request), added all or none; answered by a Reply."""

    call_id: int
    requests: list[AddRequest]


class Abort(_Message):
    request_ids: list[str]


class UtilityCall(_Message):
    """Call `EngineCore.<method>(*args)` between steps; answered by a Reply with the same call_id."""

    call_id: int
    method: str
    args: list[Any] = []


# -- engine core -> frontend -------------------------------------------------------------------------------
class Ready(_Message):
    """The engine is built and warmed up: what the frontend needs to know of it."""

    max_model_len: int
    max_num_seqs: int
    vocab_size: int
    num_kv_blocks: int
    batch_invariant: bool
    startup_time: dict[str, float]  # seconds per start-up phase
    start_time: float  # the engine's clock at its start (the dashboard's time zero)
    run: dict[str, Any]  # the dashboard's "run" record (trace.run_record)
    stats: dict[str, Any]  # LLMEngine.get_stats()


class Reply(_Message):
    call_id: int
    result: Any = None
    error: str | None = None
    error_type: str | None = None  # "ValueError", "QueueFullError", ...: what the frontend raises


class Timestamps(msgspec.Struct, array_like=True):
    """A request's life in the engine (its clock), sent with its first and its last output: where its
    time went."""

    arrival: float  # AddRequest.arrival_time
    first_scheduled: float | None
    first_token: float | None
    finished: float | None
    num_preemptions: int
    token_times: list[float]  # when each output token was sampled (TPOT, ITL)


class RequestDelta(msgspec.Struct, array_like=True, omit_defaults=True):
    """What one step added to one request."""

    request_id: str
    new_token_ids: list[int]
    finish_reason: str | None = None  # "stop" (EOS or a stop token), "length", "abort"
    stop_reason: int | None = None  # the stop token id
    new_logprobs: list[dict[int, float]] | None = None
    prompt_logprobs: list[dict[int, float] | None] | None = None  # with the first delta, when asked
    num_cached_tokens: int = 0
    timestamps: Timestamps | None = None  # with the first and the last delta


class OutputBatch(_Message):
    """One engine step's outputs, the engine's stats after it, and the dashboard's new records."""

    outputs: list[RequestDelta]
    stats: dict[str, Any] | None = None
    records: list[dict[str, Any]] = []


Message = Add | Abort | UtilityCall | Ready | Reply | OutputBatch
encoder = msgspec.msgpack.Encoder()
decoder = msgspec.msgpack.Decoder(Message)


def _measure() -> None:
    """The figure in the docstring: one step of twelve decoding streams, msgspec against pickle."""
    import pickle
    import timeit

    from minivllm.outputs import CompletionOutput, RequestMetrics, RequestOutput

    batch = OutputBatch([RequestDelta(f"cmpl-{'0' * 32}-{i}", [1000 + i]) for i in range(12)])
    n = 20000
    t = timeit.timeit(lambda: decoder.decode(encoder.encode(batch)), number=n) / n
    print(f"msgspec: {t * 1e6:.1f} us encode+decode, {len(encoder.encode(batch))} bytes")
    outs = [RequestOutput(f"cmpl-{'0' * 32}-{i}", None, list(range(64)),
                          [CompletionOutput(0, "", list(range(100)))], False, RequestMetrics(0.0))
            for i in range(12)]
    t = timeit.timeit(lambda: pickle.loads(pickle.dumps(outs)), number=n // 10) / (n // 10)
    print(f"pickle of the RequestOutputs: {t * 1e6:.1f} us, {len(pickle.dumps(outs))} bytes")


if __name__ == "__main__":
    _measure()
