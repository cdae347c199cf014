"""Turns logits into one token per sequence: logits processing, then greedy or sampling.

In vLLM v1's order: (1) masks and biases: `allowed_token_ids`, structured-output grammars,
`bad_words`, `min_tokens` (no EOS or stop token before it), `logit_bias`; (2) penalties:
`repetition_penalty` over prompt + output, `presence_penalty` and `frequency_penalty` over the output;
(3) greedy argmax, or temperature, `min_p`, top-k, top-p and a draw.

Every step is a tensor op over the rows that need it, and every op is per row (no reduction across
rows), so a request's tokens never depend on what else is in the batch. Rows that use none of a
feature skip it, and a batch that uses none skips it entirely.

Sampling uses the exponential race (argmax of p / E with E ~ Exp(1)), which draws exactly from p.
A seeded request's noise is a function of its seed and the position of the token drawn
(`noise_seed`), so its tokens depend neither on the batch nor on how many positions a step samples:
verifying k draft tokens draws what k + 1 plain steps would (speculative decoding stays exact).

A row is a SamplingRow (batch.py), one per token drawn, built by the engine: a verify row takes
the draft tokens before it as already output, and a structured-output row brings its grammar's mask.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from minivllm.model.batch import SamplingRow


@dataclass
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[dict[int, float] | None]  # per sequence: sampled token and top-k, when asked


def _argmax(logits: torch.Tensor) -> torch.Tensor:
    # max().indices picks the same (first) maximum as argmax, about 2.5x faster on the CPU.
    return logits.max(dim=-1).indices


def _where(rows: list[SamplingRow], wanted) -> list[int]:
    return [i for i, r in enumerate(rows) if wanted(r)]


_MASK64 = (1 << 64) - 1


def noise_seed(seed: int, position: int) -> int:
    """The generator seed of a seeded request's noise at one token position: splitmix64 of the pair,
    so that neighbouring seeds (n > 1 fans out seed, seed + 1, ...) and positions give unrelated draws."""
    z = ((seed & _MASK64) * 0x9E3779B97F4A7C15 + position + 1) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


class Sampler:
    def __init__(self, device: torch.device, seed: int) -> None:
        self.device = device
        self.generator = torch.Generator(device=device).manual_seed(seed)  # unseeded requests share it
        self._keyed = torch.Generator(device=device)  # re-seeded per (seed, position)

    @torch.inference_mode()
    def __call__(self, logits: torch.Tensor, rows: list[SamplingRow]) -> SamplerOutput:
        """One token per row of `logits` (a float32 [len(rows), vocab] that is processed in place)."""
        # Logprobs are the model's own (vLLM's default "raw_logprobs"), before any processing.
        raw = logits.clone() if any(r.params.logprobs is not None for r in rows) else logits
        self._mask_and_bias(logits, rows)
        self._penalize(logits, rows)
        if all(r.params.is_greedy for r in rows):
            tokens = _argmax(logits)
        else:
            tokens = self._sample(logits, rows)
        return SamplerOutput(tokens.tolist(), self._logprobs(raw, tokens, rows))

    # -- (1) masks and biases ---------------------------------------------------------------------------
    def _mask_and_bias(self, logits: torch.Tensor, rows: list[SamplingRow]) -> None:
        vocab = logits.shape[-1]
        if which := _where(rows, lambda r: r.params.allowed_token_ids is not None):
            allowed = torch.zeros(len(which), vocab, dtype=torch.bool, device=self.device)
            r, t = self._pairs([rows[i].params.allowed_token_ids for i in which])
            allowed[r, t] = True
            self._keep_only(logits, which, allowed)
        if which := _where(rows, lambda r: r.grammar_mask is not None):
            self._keep_only(logits, which, torch.stack([rows[i].grammar_mask for i in which]).to(self.device))
        banned = [self._banned(r) for r in rows]
        if any(banned):
            r, t = self._pairs(banned)
            logits[r, t] = float("-inf")
        if which := _where(rows, lambda r: r.params.logit_bias):
            biases = [rows[i].params.logit_bias for i in which]
            r, t = self._pairs([list(b) for b in biases])
            values = torch.tensor([v for b in biases for v in b.values()], dtype=logits.dtype, device=self.device)
            logits.index_put_((torch.tensor(which, device=self.device)[r], t), values, accumulate=True)

    def _keep_only(self, logits: torch.Tensor, which: list[int], allowed: torch.Tensor) -> None:
        index = torch.tensor(which, device=self.device)
        logits[index] = logits[index].masked_fill(~allowed, float("-inf"))

    @staticmethod
    def _banned(row: SamplingRow) -> list[int]:
        """Tokens `row` may not draw now. Below `min_tokens`: EOS and the stop tokens, whether or not EOS
        would stop the request (`ignore_eos`), as vLLM and HF's `min_new_tokens` do. A bad word's
        last token, once the output ends with the tokens before it (a one-token word: always)."""
        banned = []
        out = row.output_token_ids
        if len(out) < row.params.min_tokens:
            banned += [*row.params.stop_token_ids, *row.eos_token_ids]
        for word in row.bad_words_token_ids:
            prefix = word[:-1]
            if not prefix or out[len(out) - len(prefix):] == prefix:
                banned.append(word[-1])
        return banned

    def _pairs(self, per_row: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        """(row index, token) tensors for a ragged list of per-row token lists."""
        rows = [r for r, tokens in enumerate(per_row) for _ in tokens]
        tokens = [t for ts in per_row for t in ts]
        return (torch.tensor(rows, dtype=torch.long, device=self.device),
                torch.tensor(tokens, dtype=torch.long, device=self.device))

    # -- (2) penalties --------------------------------------------------------------------------------------
    def _penalize(self, logits: torch.Tensor, rows: list[SamplingRow]) -> None:
        which = _where(rows, lambda r: r.params.has_penalties)
        if not which:
            return
        params = [rows[i].params for i in which]
        index = torch.tensor(which, device=self.device)
        x = logits[index]
        vocab = x.shape[-1]
        output_counts = self._counts([rows[i].output_token_ids for i in which], vocab)
        if any(p.repetition_penalty != 1.0 for p in params):
            seen = self._counts([rows[i].prompt_token_ids for i in which], vocab) + output_counts > 0
            penalty = self._column([p.repetition_penalty for p in params])
            x = torch.where(seen, torch.where(x > 0, x / penalty, x * penalty), x)
        frequency = self._column([p.frequency_penalty for p in params])
        presence = self._column([p.presence_penalty for p in params])
        x = x - frequency * output_counts - presence * (output_counts > 0)
        logits[index] = x

    def _counts(self, token_lists: list[list[int]], vocab: int) -> torch.Tensor:
        """float [rows, vocab]: how often each token occurs in each row's list. Padding goes to an extra
        column that is dropped; each row is summed alone (scatter_add within the row)."""
        width = max(1, max(map(len, token_lists)))
        ids = torch.tensor([t + [vocab] * (width - len(t)) for t in token_lists], dtype=torch.long, device=self.device)
        counts = torch.zeros(len(token_lists), vocab + 1, device=self.device)
        counts.scatter_add_(1, ids, torch.ones_like(ids, dtype=counts.dtype))
        return counts[:, :vocab]

    def _column(self, values: list[float]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.float32, device=self.device)[:, None]

    # -- (3) sampling ------------------------------------------------------------------------------------------
    def _sample(self, logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        params = [r.params for r in rows]
        greedy = torch.tensor([p.is_greedy for p in params], device=self.device)
        temps = torch.tensor([1.0 if p.is_greedy else p.temperature for p in params], device=self.device)
        probs = torch.softmax(logits / temps[:, None], dim=-1)
        if any(p.min_p > 0 for p in params):
            min_p = torch.tensor([p.min_p for p in params], device=self.device)[:, None]
            probs = probs.masked_fill(probs < min_p * probs.max(dim=-1, keepdim=True).values, 0.0)
        if any(p.top_k > 0 or p.top_p < 1 for p in params):
            probs = self._top_k_top_p(probs, params)
        noise = torch.empty_like(probs).exponential_(generator=self.generator)
        for i, r in enumerate(rows):
            if r.params.seed is not None:
                noise[i].exponential_(generator=self._keyed.manual_seed(noise_seed(r.params.seed, r.position)))
        sampled = (probs / noise).argmax(dim=-1)
        return torch.where(greedy, _argmax(logits), sampled)

    def _top_k_top_p(self, probs: torch.Tensor, params) -> torch.Tensor:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        vocab = probs.shape[-1]
        top_k = torch.tensor([min(p.top_k, vocab) if p.top_k > 0 else vocab for p in params], device=self.device)
        top_p = torch.tensor([p.top_p for p in params], device=self.device)
        ranks = torch.arange(vocab, device=self.device)[None, :]
        # Keep a token while the mass before it is below top_p: the most likely token always stays.
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
        drop = (ranks >= top_k[:, None]) | (mass_before >= top_p[:, None])
        sorted_probs = sorted_probs.masked_fill(drop, 0.0)
        return torch.zeros_like(probs).scatter_(-1, order, sorted_probs)

    @staticmethod
    def _logprobs(logits: torch.Tensor, tokens: torch.Tensor, rows: list[SamplingRow]) -> list[dict[int, float] | None]:
        wanted = [r.params.logprobs for r in rows]
        if all(w is None for w in wanted):
            return [None] * len(rows)
        logp = torch.log_softmax(logits, dim=-1)
        k = max(w or 0 for w in wanted)
        top_vals, top_ids = logp.topk(k, dim=-1) if k else (None, None)
        chosen = logp.gather(-1, tokens[:, None]).squeeze(-1).tolist()
        result: list[dict[int, float] | None] = []
        for i, w in enumerate(wanted):
            if w is None:
                result.append(None)
                continue
            entry = {int(tokens[i]): chosen[i]}
            if w:
                entry.update(zip(top_ids[i, :w].tolist(), top_vals[i, :w].tolist()))
            result.append(entry)
        return result
