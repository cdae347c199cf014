"""The Hugging Face transformers peer: the same requests through `generate` in static batches.

A batch is left-padded to its longest prompt and decodes until its longest output is done; a
member whose output is complete keeps its row (its slot is computed for nothing). A streamer
timestamps every step, so each request gets the same timestamps an engine request has.
"""
from __future__ import annotations

import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from minivllm.bench.workloads import BenchRequest
from minivllm.model.gguf_file import GGUFFile
from minivllm.model.loader import model_files_dir, resolve_model_path
from minivllm.model.tokenizer import Tokenizer
from minivllm.outputs import RequestMetrics
from minivllm.tracing.trace import StepRow


def _step_clock():
    from transformers.generation.streamers import BaseStreamer

    class StepClock(BaseStreamer):
        """When each generation step's tokens came out. generate() first puts the prompt: skipped."""

        def __init__(self) -> None:
            self.times: list[float] = []
            self._seen_prompt = False

        def put(self, value: torch.Tensor) -> None:
            if self._seen_prompt:
                self.times.append(time.perf_counter())
            self._seen_prompt = True

        def end(self) -> None:
            pass

    return StepClock()


@dataclass
class BatchRun:
    requests: list[BenchRequest]
    start: float  # perf_counter when generate() was called
    step_times: list[float]  # when each step's tokens were out; step 0 is the prefill

    def metrics(self, arrival_times: list[float]) -> list[RequestMetrics]:
        """Each member's timestamps, as if its tokens were streamed; it ends with its last token."""
        out = []
        for req, arrival in zip(self.requests, arrival_times):
            times = self.step_times[:req.output_len]
            out.append(RequestMetrics(arrival_time=arrival, first_scheduled_time=self.start,
                                      first_token_time=times[0], last_token_time=times[-1],
                                      finished_time=times[-1], token_times=list(times)))
        return out

    def rows(self, t0: float, first_step: int, waiting_arrivals: list[float]) -> list[StepRow]:
        """The batch as step-trace rows (times relative to `t0`), comparable with the engine's;
        `waiting_arrivals`: arrival times of the requests not yet batched."""
        size = len(self.requests)
        longest = max(r.prompt_len for r in self.requests)
        prompt_tokens = sum(r.prompt_len for r in self.requests)
        rows, start = [], self.start
        for k, end in enumerate(self.step_times):
            live = sum(r.output_len > k for r in self.requests)
            done_now = sum(r.output_len == k + 1 for r in self.requests)
            computed = size * longest if k == 0 else size
            useful = prompt_tokens if k == 0 else live
            rows.append(StepRow(first_step + k, start - t0, end - t0, computed, prompt_tokens if k == 0 else 0,
                                0 if k == 0 else live, computed - useful, live - done_now,
                                sum(a <= end for a in waiting_arrivals), 0, 0, 0, done_now))
            start = end
        return rows


def hf_causal_lm(path: Path, dtype: torch.dtype) -> Any:
    """transformers' own model on a checkpoint, in `dtype`. A GGUF file is read through a copy without its
    tokenizer's arrays (GGUFFile.write_without_tokenizer_arrays): the tokens come from minivllm's tokenizer."""
    from transformers import AutoModelForCausalLM

    directory, gguf_file = model_files_dir(path)
    if gguf_file is None:
        return AutoModelForCausalLM.from_pretrained(directory, dtype=dtype).eval()
    with tempfile.TemporaryDirectory() as copy_dir:
        GGUFFile(path).write_without_tokenizer_arrays(Path(copy_dir) / gguf_file)
        return AutoModelForCausalLM.from_pretrained(copy_dir, gguf_file=gguf_file, dtype=dtype).eval()


class HFGenerator:
    def __init__(self, model: str | None, dtype: torch.dtype, device: torch.device, tokenizer: Tokenizer) -> None:
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
        self.model = hf_causal_lm(resolve_model_path(model), dtype).to(device)
        # ignore_eos, as in every benchmark run: each request runs to its own output length.
        self.model.generation_config.eos_token_id = None
        self.device = device
        pad = tokenizer.hf.pad_token_id
        self.pad_token_id = pad if pad is not None else tokenizer.eos_token_ids[0]

    def warm_up(self) -> None:
        """One tiny batch first, so that one-time setup is not billed to the measured requests."""
        self.run_batch([BenchRequest("warm-up", "", [self.pad_token_id] * 4, 2)])

    @torch.inference_mode()
    def run_batch(self, batch: list[BenchRequest]) -> BatchRun:
        longest = max(r.prompt_len for r in batch)
        ids = [[self.pad_token_id] * (longest - r.prompt_len) + r.prompt_token_ids for r in batch]
        mask = [[0] * (longest - r.prompt_len) + [1] * r.prompt_len for r in batch]
        clock = _step_clock()
        start = time.perf_counter()
        self.model.generate(input_ids=torch.tensor(ids, device=self.device),
                            attention_mask=torch.tensor(mask, device=self.device),
                            max_new_tokens=max(r.output_len for r in batch), do_sample=False,
                            pad_token_id=self.pad_token_id, streamer=clock)
        return BatchRun(batch, start, clock.times)
