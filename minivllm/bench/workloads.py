"""Benchmark workloads: prompts of chosen token lengths cut from real English text, output lengths,
and arrival times. Everything is drawn from one seeded generator, so a seed fixes the workload.

Prompts are windows of the Python documentation's prose (`pydoc_data.topics`, shipped with
CPython), so that no download is needed and the text is real English rather than random token ids.
"""
from __future__ import annotations

import argparse
import functools
import json
import math
from dataclasses import dataclass, fields
from pathlib import Path

import numpy as np

from minivllm.model.loader import load_checkpoint, resolve_model_path
from minivllm.model.model_config import ModelConfig
from minivllm.model.tokenizer import Tokenizer, get_tokenizer
from minivllm.sampling_params import RequestOutputKind, SamplingParams

DATASETS = ("fixed", "random", "shared-prefix", "grounded", "agent", "jsonl")
# The project's reference workload (issues 2, 5 and 6): `--dataset fixed`.
FIXED = {"num_prompts": 64, "seed": 0, "input_len_range": (16, 512), "output_len_range": (8, 256)}
DEFAULT_NUM_PROMPTS = 64
DEFAULT_SEED = 0


@dataclass
class BenchRequest:
    request_id: str
    prompt: str
    prompt_token_ids: list[int]
    output_len: int
    arrival: float = 0.0  # seconds after the start of the run
    kind: str = ""  # "short" or "long" in the mixed workload of `bench compare`
    tenant: str = "default"  # who sent it, for the fair policy
    priority: int = 0  # for the priority policy: lower runs first

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_token_ids)

    def sampling_params(self) -> SamplingParams:
        return bench_sampling_params(self.output_len)


@functools.lru_cache(maxsize=None)
def bench_sampling_params(output_len: int) -> SamplingParams:
    """Greedy, and ignore_eos so that the output length is the workload's, whatever the text; the
    replay reads only the finished output. One object per length, shared: the engine never changes a
    request's params, and validating them anew cost the simulator seconds per 100k requests."""
    return SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True,
                          output_kind=RequestOutputKind.FINAL_ONLY)


@functools.lru_cache(maxsize=4)
def load_tokenizer(model: str | None) -> tuple[Tokenizer, ModelConfig]:
    """The checkpoint's tokenizer (and config), without loading its weights: the same tokenizer
    object as the engines' on that checkpoint (get_tokenizer builds one per process)."""
    path = resolve_model_path(model)
    config, _ = load_checkpoint(path)  # the weights are a lazy iterator: nothing is read
    return get_tokenizer(path, config), config


class TextCorpus:
    """Token windows of real prose that re-tokenize to exactly the length asked for."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        from pydoc_data.topics import topics

        self.tokenizer = tokenizer
        text = "\n\n".join(topics[key] for key in sorted(topics))
        self.token_ids: list[int] = tokenizer.encode(text, add_special_tokens=False)
        # Special tokens (a BOS) that encode() adds count towards a prompt's length.
        self.num_special = len(tokenizer.encode("a")) - len(tokenizer.encode("a", add_special_tokens=False))

    def window(self, length: int, rng: np.random.Generator) -> tuple[str, list[int]]:
        """A text of `length` tokens (as the engine tokenizes it) and those tokens."""
        n = max(1, length - self.num_special)
        if n > len(self.token_ids):
            raise ValueError(f"a prompt of {length} tokens is longer than the text corpus ({len(self.token_ids)})")
        start = int(rng.integers(0, len(self.token_ids) - n + 1))
        # Decoding then encoding can merge tokens at a window's edges; slide until it round-trips.
        for offset in range(32):
            s = (start + offset) % (len(self.token_ids) - n + 1)
            text = self.tokenizer.decode(self.token_ids[s:s + n])
            ids = self.tokenizer.encode(text)
            if len(ids) == length:
                return text, ids
        return text, ids


class TokenWindows(TextCorpus):
    """TextCorpus's draws (so a seed gives the same lengths and arrivals) without the per-prompt
    decode/encode round trip: token ids only, cheap enough for the simulator's 100k requests."""

    def window(self, length: int, rng: np.random.Generator) -> tuple[str, list[int]]:
        n = max(1, min(length - self.num_special, len(self.token_ids)))
        start = int(rng.integers(0, len(self.token_ids) - n + 1))
        return "", self.specials + self.token_ids[start:start + n]

    @functools.cached_property
    def specials(self) -> list[int]:
        return self.tokenizer.encode("")[:self.num_special]


def uniform(rng: np.random.Generator, bounds: tuple[int, int]) -> int:
    """An integer uniform in [low, high], both included."""
    return int(rng.integers(bounds[0], bounds[1] + 1))


def draw_request(corpus: TextCorpus, request_id: str, input_range: tuple[int, int], output_range: tuple[int, int],
                 rng: np.random.Generator, kind: str = "") -> BenchRequest:
    # One request's draws together, so that the first k requests do not depend on how many follow.
    prompt_len, output_len = uniform(rng, input_range), uniform(rng, output_range)
    return BenchRequest(request_id, *corpus.window(prompt_len, rng), output_len, kind=kind)


def range_around(length: int, ratio: float) -> tuple[int, int]:
    """vLLM's --random-range-ratio: lengths uniform in [L * (1 - r), L * (1 + r)]."""
    if not 0 <= ratio < 1:
        raise ValueError(f"--range-ratio must be in [0, 1), got {ratio}")
    return max(1, math.floor(length * (1 - ratio))), math.ceil(length * (1 + ratio))


def parse_range(text: str) -> tuple[int, int]:
    """'16:512' -> (16, 512)."""
    try:
        low, high = (int(x) for x in text.split(":"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected MIN:MAX (integers), got {text!r}") from None
    if not 1 <= low <= high:
        raise argparse.ArgumentTypeError(f"expected 1 <= MIN <= MAX, got {text!r}")
    return low, high


def random_requests(corpus: TextCorpus, n: int, input_range: tuple[int, int], output_range: tuple[int, int],
                    rng: np.random.Generator) -> list[BenchRequest]:
    return [draw_request(corpus, str(i), input_range, output_range, rng) for i in range(n)]


def shared_prefix_requests(corpus: TextCorpus, n: int, prefix_len: int, num_prefixes: int,
                           input_range: tuple[int, int], output_range: tuple[int, int],
                           rng: np.random.Generator) -> list[BenchRequest]:
    """Each prompt is one of `num_prefixes` common prefixes followed by its own suffix of
    `input_range` tokens: what a shared system prompt looks like to the prefix cache."""
    prefixes = [corpus.window(prefix_len, rng)[1] for _ in range(num_prefixes)]
    requests = []
    for i in range(n):
        suffix = draw_request(corpus, str(i), input_range, output_range, rng)
        # The suffix's own special tokens (a BOS) are dropped: only the prefix starts a prompt.
        ids = prefixes[i % num_prefixes] + suffix.prompt_token_ids[corpus.num_special:]
        requests.append(BenchRequest(str(i), corpus.tokenizer.decode(ids, skip_special_tokens=False), ids,
                                     suffix.output_len))
    return requests


def jsonl_requests(path: str, tokenizer: Tokenizer, n: int | None, default_output_len: int) -> list[BenchRequest]:
    """One JSON object per line: {"prompt": "...", "output_len": 128} (output_len optional)."""
    requests = []
    for line_no, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
            prompt = item["prompt"]
        except (json.JSONDecodeError, KeyError, TypeError):
            raise ValueError(f"{path}:{line_no}: expected a JSON object with a 'prompt'") from None
        output_len = int(item.get("output_len", item.get("max_tokens", default_output_len)))
        requests.append(BenchRequest(str(len(requests)), prompt, tokenizer.encode(prompt), output_len))
    if not requests:
        raise ValueError(f"{path} has no prompts")
    return requests[:n] if n else requests


# -- grounded: chat requests whose answer is mostly in their input (speculative decoding's home) ---------
# Functions of CPython's own pure-Python standard library: real code, shipped with the interpreter.
GROUNDED_FUNCTIONS = ("textwrap:dedent", "textwrap:indent", "shlex:split", "shlex:quote", "heapq:nsmallest",
                      "difflib:get_close_matches", "statistics:median", "statistics:mode", "colorsys:rgb_to_hsv",
                      "colorsys:hls_to_rgb", "base64:b64encode", "string:capwords", "fnmatch:filter",
                      "calendar:monthrange", "textwrap:shorten", "statistics:fmean")
GROUNDED_TASKS = ("rename", "bug-fix", "quote", "multi-turn")
_BUGS = {"<=": "<", ">=": ">", "==": "!=", "!=": "==", " + 1": " - 1", " - 1": " + 1", " and ": " or "}
_NEW_NAMES = ("value", "item", "result", "count", "buffer", "current", "total", "entry")


@functools.lru_cache(maxsize=1)
def grounded_sources() -> list[str]:
    import importlib
    import inspect

    sources = []
    for name in GROUNDED_FUNCTIONS:
        module, function = name.split(":")
        try:
            sources.append(inspect.getsource(getattr(importlib.import_module(module), function)))
        except (ImportError, AttributeError, OSError, TypeError):  # another Python may lack one
            continue
    return sources


def _rename(source: str, rng: np.random.Generator) -> tuple[str, str, str]:
    """(old name, new name, source with it renamed): a parameter or local variable of the function."""
    import ast
    import re

    tree = ast.parse(source).body[0]
    names = sorted({a.arg for a in tree.args.args} | {n.id for n in ast.walk(tree)
                                                       if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)})
    old = names[int(rng.integers(len(names)))]
    new = next(n for n in (_NEW_NAMES[int(rng.integers(len(_NEW_NAMES)))], *_NEW_NAMES, "renamed") if n not in names)
    return old, new, re.sub(rf"(?<![.\w]){old}\b", new, source)


def _with_bug(source: str, rng: np.random.Generator) -> str:
    """`source` with one operator flipped (a comparison, an off-by-one, a boolean), or as it is if none."""
    found = [op for op in _BUGS if op in source]
    if not found:
        return source
    op = found[int(rng.integers(len(found)))]
    parts = source.split(op)
    at = int(rng.integers(len(parts) - 1))
    return op.join(parts[:at + 1]) + _BUGS[op] + op.join(parts[at + 1:])


def grounded_conversation(task: str, corpus: TextCorpus, rng: np.random.Generator) -> tuple[list[dict], str]:
    """One chat request of kind `task`, and the answer it asks for (whose length sets its output_len)."""
    sources = grounded_sources()
    source = sources[int(rng.integers(len(sources)))]
    if task == "rename":
        old, new, renamed = _rename(source, rng)
        return [{"role": "user", "content": f"Rename `{old}` to `{new}` in this function. Reply with the whole "
                                            f"function and nothing else.\n\n```python\n{source}```"}], renamed
    if task == "bug-fix":
        return [{"role": "user", "content": "This function has a bug. Fix it and reply with the whole corrected "
                                            f"function.\n\n```python\n{_with_bug(source, rng)}```"}], source
    if task == "quote":
        text, _ = corpus.window(int(rng.integers(200, 400)), rng)
        return [{"role": "user", "content": "Summarize this text for a colleague. Quote its key sentences word "
                                            f"for word.\n\n{text}"}], text[:len(text) // 2]
    old, new, renamed = _rename(source, rng)  # multi-turn: a second edit of the file the first one returned
    old2, new2, renamed2 = _rename(renamed, rng)
    return [{"role": "user", "content": f"Rename `{old}` to `{new}` in this function. Reply with the whole "
                                        f"function.\n\n```python\n{source}```"},
            {"role": "assistant", "content": f"```python\n{renamed}```"},
            {"role": "user", "content": f"Thanks. Now rename `{old2}` to `{new2}` as well, and reply with the whole "
                                        "function again."}], renamed2


def grounded_requests(corpus: TextCorpus, n: int, rng: np.random.Generator) -> list[BenchRequest]:
    """Input-grounded chat requests, the kinds in turn (code edits of a given function, bug fixes, quoting
    summaries, multi-turn edits of the same function); each may write as many tokens as its answer has,
    plus a little, as the prompt (with the model's chat template) asks for it."""
    tok, requests = corpus.tokenizer, []
    for i in range(n):
        messages, answer = grounded_conversation(GROUNDED_TASKS[i % len(GROUNDED_TASKS)], corpus, rng)
        prompt = tok.apply_chat_template(messages)
        output_len = len(tok.encode(answer, add_special_tokens=False)) + 16
        requests.append(BenchRequest(str(i), prompt, tok.encode(prompt), output_len,
                                     kind=GROUNDED_TASKS[i % len(GROUNDED_TASKS)]))
    return requests


def agent_requests(corpus: TextCorpus, n: int, num_contexts: int, context_range: tuple[int, int], turn_len: int,
                   output_range: tuple[int, int], rng: np.random.Generator) -> list[BenchRequest]:
    """`n` turns of `num_contexts` long conversations taken in rotation, as an agent that switches
    between tasks sends them: a conversation starts with a context of `context_range` tokens, and each
    later turn re-sends it all with `turn_len` new tokens (text of the corpus stands in for the answer
    and the next message). A turn's prompt starts with its conversation's previous prompt, so it finds
    that prefix cached, if a cache still holds it. Kinds: "first" (a conversation's first turn), "return"."""
    texts = [corpus.window(int(rng.integers(lo, hi + 1)), rng)[0] for lo, hi in [context_range] * num_contexts]
    requests = []
    for i in range(n):
        c = i % num_contexts
        if i >= num_contexts:
            texts[c] += "\n\n" + corpus.window(turn_len, rng)[0]
        output_len = int(rng.integers(output_range[0], output_range[1] + 1))
        requests.append(BenchRequest(str(i), texts[c], corpus.tokenizer.encode(texts[c]), output_len,
                                     kind="first" if i < num_contexts else "return", tenant=f"context-{c}"))
    return requests


def mixed_requests(corpus: TextCorpus, n: int, long_fraction: float, short_input: tuple[int, int],
                   short_output: tuple[int, int], long_input: tuple[int, int], long_output: tuple[int, int],
                   rng: np.random.Generator) -> list[BenchRequest]:
    """Short and long requests interleaved at random: the traffic that shows head-of-line blocking."""
    requests = []
    for i in range(n):
        long = rng.random() < long_fraction
        inputs, outputs = (long_input, long_output) if long else (short_input, short_output)
        requests.append(draw_request(corpus, str(i), inputs, outputs, rng, kind="long" if long else "short"))
    return requests


def arrival_offsets(n: int, request_rate: float, burstiness: float, rng: np.random.Generator) -> list[float]:
    """Arrival instants (seconds from the start), the first at 0. Gaps are gamma-distributed with
    shape `burstiness` and mean 1/rate, as in vLLM: burstiness 1 is a Poisson process, lower is
    burstier, higher is more regular. An infinite rate sends everything at once."""
    if request_rate <= 0 or burstiness <= 0:
        raise ValueError("--request-rate and --burstiness must be > 0")
    if math.isinf(request_rate):
        return [0.0] * n
    gaps = rng.gamma(shape=burstiness, scale=1 / (request_rate * burstiness), size=max(n - 1, 0))
    return [0.0] + [float(t) for t in np.cumsum(gaps)]


def with_arrivals(requests: list[BenchRequest], request_rate: float, burstiness: float,
                  rng: np.random.Generator) -> list[BenchRequest]:
    for req, t in zip(requests, arrival_offsets(len(requests), request_rate, burstiness, rng)):
        req.arrival = t
    return requests


# -- command-line workloads (`bench throughput` and `bench serve`) ---------------------------------
def add_workload_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("workload")
    g.add_argument("--dataset", choices=DATASETS, default="fixed",
                   help="fixed: the reference workload (64 prompts, seed 0, prompts of 16..512 and outputs of "
                        "8..256 tokens, greedy, ignore_eos); random: lengths from the flags below; "
                        "shared-prefix: prompts that share --prefix-len tokens; grounded: chat requests whose "
                        "answer is mostly in their input (function edits, bug fixes, quoting summaries, "
                        "multi-turn edits; output lengths from the answers); agent: turns of --num-prefixes long "
                        "conversations in rotation, contexts of --input-len-range tokens, each turn adding "
                        "--turn-len; jsonl: --dataset-path")
    g.add_argument("--dataset-path", default=None, help='JSONL file, one {"prompt": ..., "output_len": ...} a line')
    g.add_argument("--num-prompts", type=int, default=None,
                   help=f"number of requests (default: {DEFAULT_NUM_PROMPTS}; the whole file for jsonl)")
    g.add_argument("--seed", type=int, default=None, help=f"workload (and engine) seed (default: {DEFAULT_SEED})")
    g.add_argument("--input-len", type=int, default=256, help="mean prompt length in tokens (shared-prefix: after the prefix)")
    g.add_argument("--output-len", type=int, default=128, help="mean output length in tokens")
    g.add_argument("--range-ratio", type=float, default=0.0,
                   help="lengths uniform in [len * (1 - r), len * (1 + r)], as vLLM's --random-range-ratio")
    g.add_argument("--input-len-range", type=parse_range, default=None, metavar="MIN:MAX",
                   help="prompt lengths uniform in MIN..MAX (overrides --input-len and --range-ratio)")
    g.add_argument("--output-len-range", type=parse_range, default=None, metavar="MIN:MAX",
                   help="output lengths uniform in MIN..MAX (overrides --output-len and --range-ratio)")
    g.add_argument("--prefix-len", type=int, default=256, help="shared-prefix: tokens of the common prefix")
    g.add_argument("--num-prefixes", type=int, default=1,
                   help="shared-prefix: how many distinct prefixes; agent: how many conversations")
    g.add_argument("--turn-len", type=int, default=128, help="agent: tokens each turn adds to its conversation")


def workload_spec(args: argparse.Namespace) -> dict:
    """The workload's defining numbers, with the fixed preset applied; recorded with every result."""
    fixed = args.dataset == "fixed"
    spec = {"dataset": args.dataset,
            "num_prompts": args.num_prompts or (FIXED["num_prompts"] if fixed else DEFAULT_NUM_PROMPTS),
            "seed": DEFAULT_SEED if args.seed is None else args.seed}
    if args.dataset == "jsonl":
        if not args.dataset_path:
            raise ValueError("--dataset jsonl needs --dataset-path")
        spec.update(dataset_path=args.dataset_path, num_prompts=args.num_prompts, output_len=args.output_len)
        return spec
    if args.dataset == "grounded":  # lengths come from the requests themselves
        return spec
    if fixed:
        spec.update(input_len_range=FIXED["input_len_range"], output_len_range=FIXED["output_len_range"])
    else:
        spec.update(input_len_range=args.input_len_range or range_around(args.input_len, args.range_ratio),
                    output_len_range=args.output_len_range or range_around(args.output_len, args.range_ratio))
    if args.dataset == "shared-prefix":
        spec.update(prefix_len=args.prefix_len, num_prefixes=args.num_prefixes)
    if args.dataset == "agent":
        spec.update(num_prefixes=args.num_prefixes, turn_len=args.turn_len)
    return spec


def build_workload(spec: dict, tokenizer: Tokenizer, rng: np.random.Generator) -> list[BenchRequest]:
    if spec["dataset"] == "jsonl":
        return jsonl_requests(spec["dataset_path"], tokenizer, spec["num_prompts"], spec["output_len"])
    corpus = TextCorpus(tokenizer)
    if spec["dataset"] == "grounded":
        return grounded_requests(corpus, spec["num_prompts"], rng)
    n, inputs, outputs = spec["num_prompts"], spec["input_len_range"], spec["output_len_range"]
    if spec["dataset"] == "shared-prefix":
        return shared_prefix_requests(corpus, n, spec["prefix_len"], spec["num_prefixes"], inputs, outputs, rng)
    if spec["dataset"] == "agent":
        return agent_requests(corpus, n, spec["num_prefixes"], inputs, spec["turn_len"], outputs, rng)
    return random_requests(corpus, n, inputs, outputs, rng)


def requests_as_dicts(requests: list[BenchRequest]) -> list[dict]:
    """Per-request lengths (and arrivals) for a results file; the prompts themselves are left out."""
    # Not asdict(): it deep-copies every prompt, which dominates at the simulator's 100k requests.
    names = [f.name for f in fields(BenchRequest) if f.name not in ("prompt", "prompt_token_ids")]
    return [{k: getattr(r, k) for k in names} | {"prompt_len": r.prompt_len} for r in requests]
