"""Per-request sampling and stopping parameters, validated on construction."""
from __future__ import annotations

import enum
import json
from dataclasses import dataclass, field, fields, replace

_GREEDY_BELOW = 1e-5
MAX_LOGIT_BIAS = 100.0  # OpenAI's range for logit_bias values


@dataclass(frozen=True)
class StructuredOutputsParams:
    """vLLM's `StructuredOutputsParams`: exactly one constraint on what the output may be.

    `json` is a JSON schema (a dict or its JSON text), `regex` a regular expression, `choice` a list of
    strings the output must be one of, `grammar` an EBNF grammar (GBNF-style, as xgrammar reads it),
    `json_object` any JSON object. Whitespace inside JSON is fixed (", " and ": "), so a small model
    cannot wander off into spaces and newlines.
    """

    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None

    def __post_init__(self) -> None:
        given = [f.name for f in fields(self) if getattr(self, f.name) not in (None, False)]
        if len(given) != 1:
            raise ValueError(f"structured_outputs must set exactly one of json, regex, choice, grammar, "
                             f"json_object, got {given or 'none'}")
        if self.json is not None and not isinstance(self.json, (str, dict)):
            raise ValueError(f"structured_outputs.json must be a JSON schema object, got {self.json!r}")
        if isinstance(self.json, str):
            try:
                json.loads(self.json)
            except json.JSONDecodeError as e:
                raise ValueError(f"structured_outputs.json is not valid JSON: {e}") from None
        if self.choice is not None and not (isinstance(self.choice, (list, tuple)) and self.choice
                                            and all(isinstance(c, str) and c for c in self.choice)):
            raise ValueError(f"structured_outputs.choice must be a non-empty list of non-empty strings, "
                             f"got {self.choice!r}")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, str) and value):
                raise ValueError(f"structured_outputs.{name} must be a non-empty string, got {value!r}")

    @property
    def key(self) -> tuple[str, str]:
        """(kind, text): what the grammar compiler needs, hashable for its cache."""
        for f in fields(self):
            value = getattr(self, f.name)
            if value not in (None, False):
                if f.name == "json" and isinstance(value, dict):
                    value = json.dumps(value)  # key order kept: it is the order the output follows
                elif f.name == "choice":
                    value = json.dumps(list(value))
                return f.name, str(value)
        raise AssertionError("validated in __post_init__")


class RequestOutputKind(enum.Enum):
    """vLLM's: when the engine hands back a request's output. CUMULATIVE: after every step that
    advances it, everything so far; FINAL_ONLY: once, when it finishes (offline generation and
    benchmarks, which read only the end, skip a copy of the output per token)."""

    CUMULATIVE = 0
    FINAL_ONLY = 2


@dataclass
class SamplingParams:
    """Names, defaults and meanings follow vLLM's `SamplingParams` so its users feel at home."""

    n: int = 1
    best_of: int | None = None  # vLLM v1 keeps only best_of == n (or 1)
    presence_penalty: float = 0.0  # OpenAI: subtracted once from every token already in the output
    frequency_penalty: float = 0.0  # OpenAI: subtracted per occurrence in the output
    repetition_penalty: float = 1.0  # CTRL/HF: logits of tokens in prompt or output divided (>0) or multiplied (<0)
    max_tokens: int | None = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 (or 0) disables top-k
    min_p: float = 0.0  # drop tokens less likely than min_p times the likeliest
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    bad_words: list[str] | None = None  # words that never appear (each as tokens, with and without a space)
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    min_tokens: int = 0
    logprobs: int | None = None  # how many top logprobs to return per token, besides the sampled one
    prompt_logprobs: int | None = None  # the same for each prompt token (after the first)
    skip_special_tokens: bool = True
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit, in [-100, 100]
    allowed_token_ids: list[int] | None = None  # only these may be sampled
    structured_outputs: StructuredOutputsParams | None = None
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    _stop_strs: list[str] = field(default_factory=list, init=False, repr=False)

    def __post_init__(self) -> None:
        if self.top_k == 0:
            self.top_k = -1
        # Type errors first, so that a wrong type gets a ValueError naming the field, not a TypeError.
        if not isinstance(self.stop, (str, list, tuple, type(None))):
            raise ValueError(f"stop must be a string or a list of strings, got {self.stop!r}")
        for name in ("stop_token_ids", "bad_words", "allowed_token_ids"):
            if not isinstance(getattr(self, name), (list, tuple, type(None))):
                raise ValueError(f"{name} must be a list, got {getattr(self, name)!r}")
        if not isinstance(self.logit_bias, (dict, type(None))):
            raise ValueError(f"logit_bias must be a map of token id to bias, got {self.logit_bias!r}")
        if not isinstance(self.structured_outputs, (StructuredOutputsParams, type(None))):
            raise ValueError(f"structured_outputs must be a StructuredOutputsParams, got {self.structured_outputs!r}")
        if not isinstance(self.output_kind, RequestOutputKind):
            raise ValueError(f"output_kind must be a RequestOutputKind, got {self.output_kind!r}")
        self._stop_strs = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        self._validate()

    def _validate(self) -> None:
        def check(ok: bool, name: str, msg: str) -> None:
            if not ok:
                raise ValueError(f"{name} {msg}, got {getattr(self, name)!r}")

        def number(name: str) -> bool:
            value = getattr(self, name)
            return isinstance(value, (int, float)) and not isinstance(value, bool) and abs(value) < float("inf")

        check(isinstance(self.n, int) and self.n >= 1, "n", "must be an integer >= 1")
        check(self.best_of is None or self.best_of in (1, self.n), "best_of",
              f"must equal n ({self.n}) or 1: only best_of == n is supported, as in vLLM v1")
        check(number("presence_penalty") and -2 <= self.presence_penalty <= 2, "presence_penalty", "must be in [-2, 2]")
        check(number("frequency_penalty") and -2 <= self.frequency_penalty <= 2,
              "frequency_penalty", "must be in [-2, 2]")
        check(number("repetition_penalty") and self.repetition_penalty > 0, "repetition_penalty", "must be > 0")
        check(self.max_tokens is None or (isinstance(self.max_tokens, int) and self.max_tokens >= 1),
              "max_tokens", "must be an integer >= 1")
        check(number("temperature") and self.temperature >= 0, "temperature", "must be >= 0")
        check(number("top_p") and 0 < self.top_p <= 1, "top_p", "must be in (0, 1]")
        check(isinstance(self.top_k, int) and (self.top_k == -1 or self.top_k >= 1),
              "top_k", "must be -1 (disabled) or >= 1")
        check(number("min_p") and 0 <= self.min_p <= 1, "min_p", "must be in [0, 1]")
        check(self.seed is None or (isinstance(self.seed, int) and -2**63 <= self.seed < 2**64),
              "seed", "must be an integer in [-2**63, 2**64)")
        check(isinstance(self.min_tokens, int) and self.min_tokens >= 0, "min_tokens", "must be an integer >= 0")
        check(self.max_tokens is None or self.min_tokens <= self.max_tokens,
              "min_tokens", f"must be <= max_tokens ({self.max_tokens})")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            check(value is None or (isinstance(value, int) and 0 <= value <= 20), name, "must be an integer in [0, 20]")
        check(all(isinstance(s, str) and s for s in self._stop_strs), "stop", "must be non-empty strings")
        for name in ("stop_token_ids", "allowed_token_ids"):
            check(all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in getattr(self, name) or []),
                  name, "must be non-negative integers")
        check(self.allowed_token_ids is None or len(self.allowed_token_ids) > 0,
              "allowed_token_ids", "must not be empty")
        check(all(isinstance(w, str) and w.strip() for w in self.bad_words or []), "bad_words",
              "must be non-empty strings")
        check(all(isinstance(t, int) and not isinstance(t, bool) and t >= 0
                  and isinstance(b, (int, float)) and -MAX_LOGIT_BIAS <= b <= MAX_LOGIT_BIAS
                  for t, b in (self.logit_bias or {}).items()),
              "logit_bias", f"must map token ids to biases in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}]")

    def fan_out(self) -> list[SamplingParams]:
        """The n = 1 requests that an n > 1 request stands for (the engine runs n = 1 only); a seeded
        request's children get seeds seed, seed + 1, ... so that they differ yet stay reproducible."""
        return [replace(self, n=1, best_of=None, seed=None if self.seed is None else self.seed + k)
                for k in range(self.n)]

    @property
    def stop_strings(self) -> list[str]:
        return self._stop_strs

    @property
    def is_greedy(self) -> bool:
        # Dividing logits by a temperature this small overflows; it means greedy anyway.
        return self.temperature < _GREEDY_BELOW

    @property
    def has_penalties(self) -> bool:
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1.0

