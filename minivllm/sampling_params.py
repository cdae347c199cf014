"""Per-request sampling and stopping parameters, validated on construction."""
from __future__ import annotations

from dataclasses import dataclass, field, replace


_GREEDY_BELOW = 1e-5


@dataclass
class SamplingParams:
    """Names and defaults follow vLLM's `SamplingParams` so its users feel at home."""

    n: int = 1
    max_tokens: int | None = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 (or 0) disables top-k
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    min_tokens: int = 0
    logprobs: int | None = None  # how many top logprobs to return per token, besides the sampled one
    skip_special_tokens: bool = True
    _stop_strs: list[str] = field(default_factory=list, init=False, repr=False)

    def __post_init__(self) -> None:
        if self.top_k == 0:
            self.top_k = -1
        # Type errors first, so that a wrong type gets a ValueError naming the field, not a TypeError.
        if not isinstance(self.stop, (str, list, tuple, type(None))):
            raise ValueError(f"stop must be a string or a list of strings, got {self.stop!r}")
        if not isinstance(self.stop_token_ids, (list, tuple, type(None))):
            raise ValueError(f"stop_token_ids must be a list of token ids, got {self.stop_token_ids!r}")
        self._stop_strs = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        self._validate()

    def _validate(self) -> None:
        def check(ok: bool, name: str, msg: str) -> None:
            if not ok:
                raise ValueError(f"{name} {msg}, got {getattr(self, name)!r}")

        check(isinstance(self.n, int) and self.n >= 1, "n", "must be an integer >= 1")
        check(self.max_tokens is None or (isinstance(self.max_tokens, int) and self.max_tokens >= 1),
              "max_tokens", "must be an integer >= 1")
        check(isinstance(self.temperature, (int, float)) and self.temperature >= 0,
              "temperature", "must be >= 0")
        check(isinstance(self.top_p, (int, float)) and 0 < self.top_p <= 1, "top_p", "must be in (0, 1]")
        check(isinstance(self.top_k, int) and (self.top_k == -1 or self.top_k >= 1),
              "top_k", "must be -1 (disabled) or >= 1")
        check(self.seed is None or (isinstance(self.seed, int) and -2**63 <= self.seed < 2**64),
              "seed", "must be an integer in [-2**63, 2**64)")
        check(isinstance(self.min_tokens, int) and self.min_tokens >= 0, "min_tokens", "must be an integer >= 0")
        check(self.max_tokens is None or self.min_tokens <= self.max_tokens,
              "min_tokens", f"must be <= max_tokens ({self.max_tokens})")
        check(self.logprobs is None or (isinstance(self.logprobs, int) and 0 <= self.logprobs <= 20),
              "logprobs", "must be an integer in [0, 20]")
        check(all(isinstance(s, str) and s for s in self._stop_strs), "stop", "must be non-empty strings")
        check(all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids),
              "stop_token_ids", "must be non-negative integers")

    def fan_out(self) -> list[SamplingParams]:
        """The n = 1 requests that an n > 1 request stands for (the engine runs n = 1 only); a seeded
        request's children get seeds seed, seed + 1, ... so that they differ yet stay reproducible."""
        return [replace(self, n=1, seed=None if self.seed is None else self.seed + k) for k in range(self.n)]

    @property
    def stop_strings(self) -> list[str]:
        return self._stop_strs

    @property
    def is_greedy(self) -> bool:
        # Dividing logits by a temperature this small overflows; it means greedy anyway.
        return self.temperature < _GREEDY_BELOW
