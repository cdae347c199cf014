"""The offline facade, shaped like vLLM's `LLM`: generate() and chat() over a batch of prompts."""
from __future__ import annotations

import time
import weakref
from collections.abc import Sequence as Seq
from dataclasses import replace
from typing import Any

from tqdm import tqdm

from minivllm.engine.llm_engine import LLMEngine, PromptType
from minivllm.lora.request import LoRARequest
from minivllm.outputs import CompletionOutput, RequestOutput
from minivllm.sampling_params import RequestOutputKind, SamplingParams
from minivllm.structured_output.extension import StructuredOutputs


class LLM:
    def __init__(self, model: str | None = None, **engine_args: Any) -> None:
        self.engine = LLMEngine(model=model, **engine_args)
        weakref.finalize(self, self.engine.close)  # the trace's last lines, when the LLM goes or at exit

    def get_tokenizer(self):
        return self.engine.tokenizer.hf

    def generate(self, prompts: PromptType | Seq[PromptType],
                 sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
                 use_tqdm: bool = True, priority: Seq[int] | None = None,
                 tenant: Seq[str] | None = None,
                 lora_request: LoRARequest | Seq[LoRARequest | None] | None = None) -> list[RequestOutput]:
        """One RequestOutput per prompt, in input order. All prompts are validated before any runs.
        `lora_request`: the LoRA adapter of every prompt, or one per prompt (None: the base model)."""
        if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        params = _per_prompt(sampling_params or SamplingParams(), len(prompts), "sampling_params")
        priorities = _per_prompt(priority if priority is not None else 0, len(prompts), "priority")
        tenants = _per_prompt(tenant if tenant is not None else "default", len(prompts), "tenant")
        loras = _per_prompt(lora_request, len(prompts), "lora_request")
        request_ids: list[list[str]] = []
        try:
            for i, (prompt, p) in enumerate(zip(prompts, params)):
                request_ids.append(self._add(prompt, p, priorities[i], tenants[i], loras[i]))
        except ValueError as e:
            for ids in request_ids:
                for rid in ids:
                    self.engine.abort_request(rid)
            self._drain()
            raise ValueError(f"prompt {len(request_ids)}: {e}") from e
        return self._run(request_ids, use_tqdm)

    def chat(self, messages: list[dict] | list[list[dict]], sampling_params: SamplingParams | None = None,
             use_tqdm: bool = True, add_generation_prompt: bool = True) -> list[RequestOutput]:
        """Apply the model's chat template to one conversation (or a list of them) and generate."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        tok = self.engine.tokenizer
        prompts = [tok.apply_chat_template(c, add_generation_prompt) for c in conversations]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def _add(self, prompt: PromptType, params: SamplingParams, priority: int, tenant: str,
             lora_request: LoRARequest | None = None) -> list[str]:
        """Fan a request with n > 1 out into n engine requests (seeds kept distinct). Only the finished
        outputs are read (as vLLM's LLM does, FINAL_ONLY)."""
        if params.structured_outputs is not None:  # a grammar the library rejects is a ValueError here
            self.engine.extension(StructuredOutputs).compile(params.structured_outputs).result()
        base = f"offline-{time.perf_counter_ns()}"
        return [self.engine.add_request(f"{base}-{k}", prompt, child, priority=priority, tenant=tenant,
                                        lora_request=lora_request)
                for k, child in enumerate(replace(c, output_kind=RequestOutputKind.FINAL_ONLY)
                                          for c in params.fan_out())]

    def _run(self, request_ids: list[list[str]], use_tqdm: bool) -> list[RequestOutput]:
        finished: dict[str, RequestOutput] = {}
        total = sum(len(ids) for ids in request_ids)
        bar = tqdm(total=total, desc="Processed prompts", disable=not use_tqdm, dynamic_ncols=True)
        start, in_toks, out_toks = time.perf_counter(), 0, 0
        while len(finished) < total:
            for out in self.engine.step():
                if out.finished:
                    finished[out.request_id] = out
                    in_toks += len(out.prompt_token_ids)
                    out_toks += len(out.outputs[0].token_ids)
                    elapsed = time.perf_counter() - start
                    bar.set_postfix_str(f"input: {in_toks / elapsed:.1f} toks/s, output: {out_toks / elapsed:.1f} toks/s")
                    bar.update(1)
        bar.close()
        self.engine.flush_trace()
        return [_merge([finished[rid] for rid in ids]) for ids in request_ids]

    def _drain(self) -> None:
        while self.engine.has_unfinished_requests():
            self.engine.step()


def _per_prompt(value: Any, n: int, name: str) -> list:
    if isinstance(value, (list, tuple)):
        if len(value) != n:
            raise ValueError(f"{name} has {len(value)} entries for {n} prompts")
        return list(value)
    return [value] * n


def _merge(outs: list[RequestOutput]) -> RequestOutput:
    """Children of an n > 1 request become one RequestOutput with n completions."""
    first = outs[0]
    if len(outs) == 1:
        return first
    completions = [CompletionOutput(i, o.outputs[0].text, o.outputs[0].token_ids, o.outputs[0].finish_reason,
                                    o.outputs[0].stop_reason, o.outputs[0].logprobs, o.outputs[0].cumulative_logprob)
                   for i, o in enumerate(outs)]
    return RequestOutput(first.request_id.rsplit("-", 1)[0], first.prompt, first.prompt_token_ids, completions,
                         True, first.metrics, first.prompt_logprobs)
