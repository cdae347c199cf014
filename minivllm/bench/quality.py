"""`minivllm bench quality`: what an engine setting costs in model quality, measured teacher-forced.

A candidate configuration (e.g. `--kv-cache-dtype int8`) and a reference (the same with some fields
changed, by default `kv_cache_dtype=auto`) each score the same held-out prose through the real engine
path: the text is cut into chunks of `chunk_len` tokens, each chunk is a prompt with
`prompt_logprobs=1`, so every position after a chunk's first gets the logprob of the text's next
token and the model's top-1 prediction. Reported: both perplexities, their relative difference, and
the share of positions where the candidate's top-1 equals the reference's.

The default text (data/heldout_prose.txt) was written for this project, so the model cannot have
seen it in training.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path

from minivllm.config import EngineConfig

DEFAULT_TEXT = Path(__file__).parent / "data" / "heldout_prose.txt"


@dataclass
class Scores:
    """Per scored position: the text's next token's logprob and the model's top-1 token."""
    logprobs: list[float]
    top1: list[int]

    @property
    def perplexity(self) -> float:
        return math.exp(-sum(self.logprobs) / len(self.logprobs))


@dataclass
class QualityResult:
    candidate: dict
    reference: dict
    num_tokens: int  # scored positions
    chunk_len: int
    candidate_ppl: float
    reference_ppl: float
    top1_agreement: float  # share of positions where both predict the same next token
    mean_abs_logprob_diff: float

    @property
    def ppl_rel_diff(self) -> float:
        return self.candidate_ppl / self.reference_ppl - 1

    def text(self) -> str:
        changed = {k: v for k, v in self.candidate.items() if self.reference.get(k) != v}
        base = {k: self.reference[k] for k in changed}
        return "\n".join([
            f"Teacher-forced over {self.num_tokens} tokens (chunks of {self.chunk_len})",
            f"candidate {changed}: perplexity {self.candidate_ppl:.4f}",
            f"reference {base}: perplexity {self.reference_ppl:.4f}",
            f"perplexity relative difference: {self.ppl_rel_diff:+.3%}",
            f"top-1 agreement: {self.top1_agreement:.2%}",
            f"mean |logprob difference| of the text's tokens: {self.mean_abs_logprob_diff:.4f}",
        ])


def parse_overrides(items: list[str]) -> dict:
    """NAME=VALUE pairs of EngineConfig fields (the CLI's names, dashes or underscores), typed as the field."""
    types = {f.name: f.type for f in fields(EngineConfig)}
    choices = {f.name: f.metadata.get("choices") or () for f in fields(EngineConfig)}
    out = {}
    for item in items:
        name, sep, value = item.partition("=")
        name = name.strip().lstrip("-").replace("-", "_")
        if not sep or name not in types:
            raise ValueError(f"reference: expected NAME=VALUE with NAME an engine flag, got {item!r}")
        kind = types[name]
        if "bool" in kind:
            out[name] = value.lower() in ("1", "true", "yes", "on")
        elif "int" in kind and value.lower() != "none":
            out[name] = int(value)
        else:  # "none" is None, unless it is one of the field's choices (--quantization none)
            out[name] = None if value.lower() == "none" and value not in choices[name] else value
    return out


def text_chunks(token_ids: list[int], chunk_len: int, num_tokens: int | None) -> list[list[int]]:
    """Whole chunks of the text, as many as cover `num_tokens` (all the text's by default)."""
    if chunk_len < 2:
        raise ValueError(f"chunk_len must be >= 2, got {chunk_len}")
    wanted = len(token_ids) if num_tokens is None else min(num_tokens, len(token_ids))
    chunks = [token_ids[i:i + chunk_len] for i in range(0, wanted - chunk_len + 1, chunk_len)]
    if not chunks:
        raise ValueError(f"the text has {len(token_ids)} tokens: fewer than one chunk of {chunk_len}")
    return chunks


def score(config: EngineConfig, chunks: list[list[int]]) -> Scores:
    """Teacher-forced scores of every chunk's positions after its first, through a fresh engine."""
    from minivllm.llm import LLM

    llm = LLM(**asdict(config))
    scores = scores_of(llm, chunks)
    llm.engine.close()
    return scores


def scores_of(llm, chunks: list[list[int]]) -> Scores:
    """Teacher-forced scores of every chunk's positions after its first, through an engine (an `LLM`)."""
    from minivllm.sampling_params import SamplingParams

    outs = llm.generate(chunks, SamplingParams(max_tokens=1, prompt_logprobs=1), use_tqdm=False)
    scores = Scores([], [])
    for chunk, out in zip(chunks, outs):
        for token, entry in zip(chunk[1:], out.prompt_logprobs[1:]):
            scores.logprobs.append(entry[token])
            scores.top1.append(max(entry, key=entry.get))
    return scores


def run_quality(candidate: EngineConfig, reference: EngineConfig, text: str, chunk_len: int,
                num_tokens: int | None) -> QualityResult:
    from minivllm.bench.workloads import load_tokenizer

    tokenizer, _ = load_tokenizer(candidate.model)
    chunks = text_chunks(tokenizer.encode(text, add_special_tokens=False), chunk_len, num_tokens)
    # One chunk per step: the logits of every scored position are materialized.
    cand, ref = (score(replace(c, max_num_batched_tokens=chunk_len), chunks) for c in (candidate, reference))
    n = len(ref.logprobs)
    return QualityResult(
        candidate=asdict(candidate), reference=asdict(reference), num_tokens=n, chunk_len=chunk_len,
        candidate_ppl=cand.perplexity, reference_ppl=ref.perplexity,
        top1_agreement=sum(a == b for a, b in zip(cand.top1, ref.top1)) / n,
        mean_abs_logprob_diff=sum(abs(a - b) for a, b in zip(cand.logprobs, ref.logprobs)) / n)
