"""Step-time cost models for the simulator: what one engine step costs, from the step's shape.

- `LinearCost`: fitted by `minivllm bench calibrate` to this machine and model (a profile JSON): a
  sum of explainable terms, each a count of the step's work times its measured cost.
- `RooflineCost`: a GPU's datasheet (FLOP/s, memory bandwidth) and a model's config.json; it models
  hardware that is not here, and everything it produces is labelled "modeled".
"""
from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

import numpy as np

from minivllm.model.batch import BatchInputs
from minivllm.model.loader import load_checkpoint
from minivllm.model.model_config import ModelConfig

SPECS = Path(__file__).parent / "specs"


@dataclass
class StepShape:
    """What a step computes. Read before the step runs (computed counts move on after it)."""

    prefill_tokens: int = 0  # prompt tokens (chunks), padding excluded
    prefill_seqs: int = 0  # prefill chunks: each is a span of its own in attention, inputs, sampling
    decode_seqs: int = 0  # sequences computing one new token
    padding_tokens: int = 0  # static batching's padding and its finished members' slots
    decode_context: int = 0  # K/V tokens the decodes' attention reads
    prefill_attention: int = 0  # (query, K/V token) pairs of the prefill chunks: causal, so a chunk of n
    # tokens after c computed ones has n*c + n(n+1)/2 (chunking a prompt does not change its total)
    num_seqs: int = 0  # sequences in the step (each samples or is a chunk)
    woke: int = 0  # 1: the engine sat idle before this step (StepHistory sets it and the next field)
    steps_after_prefill: int = 0  # a step with no prefill: steps since the last one with a prefill (1: next)

    @property
    def rows(self) -> int:
        """Rows through the GEMMs: every token the step computes, padding included."""
        return self.prefill_tokens + self.decode_seqs + self.padding_tokens

    @classmethod
    def of(cls, batch: BatchInputs) -> StepShape:
        shape = cls(padding_tokens=batch.num_padding_tokens, num_seqs=len(batch.spans))
        decode_seqs = decode_context = 0
        for span in batch.spans:
            if span.decode:
                decode_seqs += 1
                decode_context += span.start + 1
            else:
                n = len(span.token_ids)
                shape.prefill_seqs += 1
                shape.prefill_tokens += n
                shape.prefill_attention += n * span.start + n * (n + 1) // 2
        shape.decode_seqs, shape.decode_context = decode_seqs, decode_context
        return shape


# The first step after the engine sat idle can cost far more than its shape: on this machine (2 shared
# cores) a 64-token prefill that met an idle engine took 61-135 ms against 43 ms back to back in one
# sitting (2026-12-01, 04:30), and nothing extra in another (05:45). It is the machine, not the engine
# (LLM.generate after sleeping shows it too), so calibration measures it as it is on the day, from
# probes that sleep before each request. An idle spell shorter than this is not counted: steps back to
# back are a few milliseconds apart, while a request waited for comes tens of milliseconds later.
WAKE_AFTER_S = 0.01
# The decode steps right after a prefill cost more than their shape, a fixed 1-5 ms that fades over
# some 8 steps (every probe of the calibrations of 2026-12-01 shows it, 15-45 % of a small step).
AFTER_PREFILL_STEPS = 8


class StepHistory:
    """What a step follows, which its shape does not say: an idle spell of the engine (a gap of
    WAKE_AFTER_S or more since the previous step ended, on the engine's clock), and how many steps
    ago a prefill ran. A runner takes each step's shape from here (`starting`) and tells when the step
    ends, so that both are noted the same way in calibration and in the simulator."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self.clock, self.last_end = clock, clock()
        self.steps_since_prefill: int | None = None  # None: no prefill yet

    def starting(self, batch: BatchInputs) -> StepShape:
        shape = StepShape.of(batch)
        shape.woke = int(self.clock() - self.last_end >= WAKE_AFTER_S)
        if shape.prefill_tokens:
            self.steps_since_prefill = 0
        elif self.steps_since_prefill is not None:
            self.steps_since_prefill += 1
            shape.steps_after_prefill = self.steps_since_prefill
        return shape

    def ended(self) -> None:
        self.last_end = self.clock()


# The linear model's terms: a constant per step, then counts of the step's work. What each costs:
#   step               the fixed part: weights streamed once, per-layer launches, the step's Python
#   rows               a row of the step's tokens: a prompt token, a decode, or static batching's padding
#                      (which computes nothing else: it attends to nothing and is not sampled)
#   prefill_seqs       a prefill chunk's own overhead (its attention span, its inputs and logits row)
#   decode_seqs        a decode beyond its row: its attention span, logits row, sampling, detokenizing
#   decode_context     a K/V token read by a decode's attention
#   prefill_attention  a (query, K/V token) pair of a prefill chunk: prefill's quadratic attention
#   wake               the first step after an idle spell: what waking the machine adds to it
#   after_prefill      a step with no prefill right after one that had it, fading linearly to 0 over
#                      AFTER_PREFILL_STEPS steps
# Padding is a row and nothing more, by construction: a term of its own was fitted from the few
# padded steps of the probes and came out dearer than a decode (calibration of 2026-11-30).
# A row costs the same at any row count: the GEMMs share every row count evenly between threads (a
# `gemm_rows` term once priced the rows of the busiest thread, when a step just past 64 rows gave one
# thread a whole block of 64: the kernels now split by columns, calibration of 2026-12-01).
TERMS = ("step", "rows", "prefill_seqs", "decode_seqs", "decode_context", "prefill_attention", "wake",
         "after_prefill")


def features(shape: StepShape) -> list[float]:
    k = shape.steps_after_prefill
    return [1.0, shape.rows, shape.prefill_seqs, shape.decode_seqs, shape.decode_context, shape.prefill_attention,
            shape.woke, max(0.0, 1.0 - (k - 1) / AFTER_PREFILL_STEPS) if k else 0.0]


@dataclass
class LinearCost:
    """seconds = sum of coefficient x term, fitted to measured steps."""

    coefficients: dict[str, float]  # one per term of TERMS
    label: str  # what was measured: device, model, dtype
    # How measured steps spread about their fitted time: NOISE_QUANTILES quantiles of measured / fitted,
    # scaled to a mean of 1 (`step_noise`); empty where not measured.
    noise: list[float] = field(default_factory=list)
    modeled: bool = False

    def __post_init__(self) -> None:
        if set(self.coefficients) != set(TERMS):  # a term missing would cost nothing, silently
            raise ValueError(f"a calibrated profile's coefficients must be {', '.join(TERMS)}; got "
                             f"{', '.join(self.coefficients)} (an older profile: rerun `minivllm bench calibrate`)")
        self._weights = [self.coefficients[t] for t in TERMS]

    def step_time(self, shape: StepShape) -> float:
        # Plain Python: a numpy call per step costs more than the sum of eight products.
        return sum(w * x for w, x in zip(self._weights, features(shape)))

    def to_dict(self) -> dict:
        return {"kind": "calibrated", "label": self.label, "coefficients": self.coefficients, "step_noise": self.noise}


NOISE_QUANTILES = 200


def step_noise(fitted: list[float], measured: list[float]) -> list[float]:
    """The spread of measured steps about the model, for the simulator to draw each step's time from
    (`--step-noise`). A step's time on this machine is its shape's cost times a jitter of some 15 %;
    the model gives the mean, and near capacity a queue grows with the spread too (a slow step holds
    every waiting request). Scaled to a mean of 1, so that the expected time stays the model's."""
    ratios = np.quantile(np.array(measured) / np.array(fitted), (np.arange(NOISE_QUANTILES) + 0.5) / NOISE_QUANTILES)
    return [round(float(r), 4) for r in ratios / ratios.mean()]


# A step measured at more than this many times its fitted time was slowed by something else on the
# machine (on 2 shared cores, 27 ms steps were seen taking 2.9 s): no shape explains it, so the fit
# leaves it out. Interference only ever slows a step, so only the slow side is cut.
INTERFERED = 2.0


def fit_linear(shapes: list[StepShape], seconds: list[float]) -> dict[str, float]:
    """Least squares with each step's error weighted by 1/sqrt(its time), with no negative coefficient
    (a term that comes out negative is dropped and the rest refitted), refitted without the steps
    that took over INTERFERED times their fitted time until none is left. The weight sits between
    the absolute error (thousands of decode steps would count for nothing beside a few long
    prefills) and the relative one (the long steps, which are few, come out short: on this
    machine's probes, each probe predicted by a fit to the others, the total was 6 % under with
    1/time and 2 % with 1/sqrt(time), and the median step error lower too).

    Last, the coefficients are scaled so that the kept steps' fitted total is their measured total.
    A weight taken from the measured time favours the steps that ran fast, so the weighted fit comes
    out 1-2 % short of the total on every calibration here, and the simulated engine ran that much
    fast (most settings' real steps ran 2-6 % over it). The scaling moves no step's share."""
    x = np.array([features(s) for s in shapes], dtype=float)
    y = np.array(seconds, dtype=float)
    kept = np.ones(len(y), dtype=bool)
    while True:
        coef = _fit_nonnegative(x[kept], y[kept])
        slow = y > INTERFERED * (x @ coef)
        if not (slow & kept).any():
            coef *= y[kept].sum() / (x[kept] @ coef).sum()
            return {t: float(c) for t, c in zip(TERMS, coef)}
        kept &= ~slow


def _fit_nonnegative(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    scale = x.max(axis=0)
    scale[scale == 0] = 1.0
    xs, w = x / scale, 1.0 / np.sqrt(y)
    active = [i for i in range(len(TERMS)) if x[:, i].any()]
    while True:
        coef, *_ = np.linalg.lstsq(xs[:, active] * w[:, None], y * w, rcond=None)
        if (coef >= 0).all():
            break
        del active[int(np.argmin(coef))]
    full = np.zeros(len(TERMS))
    full[active] = coef / scale[active]
    return full


@dataclass
class FitError:
    """How far a profile's step times are from measured ones."""

    median: float  # median relative error per step
    total: float  # relative error of the summed time (what throughput sees)

    @classmethod
    def of(cls, predicted: list[float], measured: list[float]) -> FitError:
        p, y = np.array(predicted), np.array(measured)
        return cls(float(np.median(np.abs(p - y) / y)), float((p.sum() - y.sum()) / y.sum()))


def held_out_error(groups: list[tuple[list[StepShape], list[float]]]) -> FitError:
    """Each group (a probe's steps) predicted by a fit to all the other groups: the error on steps
    the fit has not seen, which the error on the fitted steps understates."""
    predicted, measured = [], []
    for i, (shapes, seconds) in enumerate(groups):
        rest = [g for j, g in enumerate(groups) if j != i]
        cost = LinearCost(fit_linear([s for g in rest for s in g[0]], [t for g in rest for t in g[1]]), "")
        predicted += [cost.step_time(s) for s in shapes]
        measured += seconds
    return FitError.of(predicted, measured)


@dataclass
class GpuSpec:
    name: str
    peak_flops: float  # dense, in the dtype the model runs (bf16)
    memory_bandwidth: float  # bytes/s
    memory_bytes: float
    flops_efficiency: float  # share of the peak a large GEMM reaches
    bandwidth_efficiency: float
    step_overhead_s: float  # launch, scheduling and sampling time per step
    source: str = ""

    @classmethod
    def load(cls, name_or_path: str) -> GpuSpec:
        data = json.loads(_spec_path(name_or_path, "gpus", ".json").read_text())
        return cls(**{f.name: data[f.name] for f in fields(cls) if f.name in data})


def _spec_path(name_or_path: str, kind: str, suffix: str) -> Path:
    """A shipped spec by name (`h100`, `llama-3-8b`) or a path."""
    path = Path(name_or_path)
    if path.exists():
        return path
    shipped = SPECS / kind / (name_or_path + suffix)
    if not shipped.exists():
        names = sorted(p.name.removesuffix(suffix) for p in (SPECS / kind).iterdir())
        raise ValueError(f"no {kind[:-1]} spec {name_or_path!r}: pass a path or one of {', '.join(names)}")
    return shipped


def model_config_of(name_or_path: str) -> ModelConfig:
    """A Llama-family config.json (a shipped one by name, a directory, or the file itself)."""
    path = _spec_path(name_or_path, "models", "")
    return load_checkpoint(path.parent if path.is_file() else path)[0]


@dataclass
class RooflineCost:
    """A step takes the longer of its FLOPs at the achievable rate and its bytes (weights read once,
    K/V read and written) at the achievable bandwidth, plus a fixed overhead. Tensor parallelism
    multiplies rate, bandwidth and memory (communication and waking an idle machine are not modeled)."""

    gpu: GpuSpec
    model: ModelConfig
    model_name: str
    tensor_parallel_size: int = 1
    dtype_bytes: int = 2  # bf16
    modeled: bool = True

    @property
    def label(self) -> str:
        tp = f" x{self.tensor_parallel_size} (TP)" if self.tensor_parallel_size > 1 else ""
        return f"modeled: {self.model_name} on {self.gpu.name}{tp}, roofline"

    @property
    def layer_params(self) -> int:
        m = self.model
        q, kv = m.num_attention_heads * m.head_dim, m.num_key_value_heads * m.head_dim
        per_layer = m.hidden_size * (q + 2 * kv) + q * m.hidden_size + 3 * m.hidden_size * m.intermediate_size
        return per_layer * m.num_hidden_layers

    @property
    def weight_bytes(self) -> int:
        embeddings = self.model.vocab_size * self.model.hidden_size * (1 if self.model.tie_word_embeddings else 2)
        return (self.layer_params + embeddings) * self.dtype_bytes

    @property
    def kv_bytes_per_token(self) -> int:
        m = self.model
        return 2 * m.num_hidden_layers * m.num_key_value_heads * m.head_dim * self.dtype_bytes

    def kv_cache_memory(self, gpu_memory_utilization: float = 0.9) -> int:
        """Bytes left for the KV cache after the weights (vLLM's --gpu-memory-utilization)."""
        free = self.gpu.memory_bytes * self.tensor_parallel_size * gpu_memory_utilization - self.weight_bytes
        if free <= 0:
            raise ValueError(f"{self.model_name} ({self.weight_bytes / 1e9:.0f} GB of weights) does not fit on "
                             f"{self.tensor_parallel_size} x {self.gpu.name}: raise --tensor-parallel-size")
        return int(free)

    def step_time(self, shape: StepShape) -> float:
        m, tp = self.model, self.tensor_parallel_size
        tokens = shape.rows
        q_dim = m.num_attention_heads * m.head_dim
        attention = 4 * m.num_hidden_layers * q_dim * (shape.decode_context + shape.prefill_attention)
        flops = 2 * self.layer_params * tokens + 2 * m.vocab_size * m.hidden_size * shape.num_seqs + attention
        moved = self.weight_bytes + self.kv_bytes_per_token * (shape.decode_context + tokens)
        g = self.gpu
        return g.step_overhead_s + max(flops / (g.peak_flops * g.flops_efficiency * tp),
                                       moved / (g.memory_bandwidth * g.bandwidth_efficiency * tp))

    def to_dict(self) -> dict:
        return {"kind": "modeled", "label": self.label, "gpu": asdict(self.gpu), "model_name": self.model_name,
                "model": asdict(self.model), "tensor_parallel_size": self.tensor_parallel_size}


CostModel = LinearCost | RooflineCost


def roofline(gpu: str, model: str, tensor_parallel_size: int = 1) -> RooflineCost:
    return RooflineCost(GpuSpec.load(gpu), model_config_of(model), Path(model).name or model, tensor_parallel_size)


def load_profile(path: str) -> CostModel:
    data = json.loads(Path(path).read_text())
    if data.get("kind") == "calibrated":
        return LinearCost(data["coefficients"], data["label"], data.get("step_noise", []))
    if data.get("kind") == "modeled":
        return RooflineCost(GpuSpec(**data["gpu"]), ModelConfig(**data["model"]), data["model_name"],
                            data["tensor_parallel_size"])
    raise ValueError(f"{path}: not a cost profile (its 'kind' must be 'calibrated' or 'modeled')")
