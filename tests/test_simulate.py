"""The simulator: the real engine step on a cost model, routing policies, calibration."""
from __future__ import annotations

import json
import time
from dataclasses import fields
from pathlib import Path

import numpy as np
import pytest

from minivllm.bench.compare import SystemSummary, replay_engine
from minivllm.bench.cost_model import NOISE_QUANTILES, TERMS, LinearCost, StepShape, load_profile
from minivllm.bench.metrics import ServingMetrics
from minivllm.bench.simulate import VirtualClock, simulate_engine
from minivllm.bench.workloads import TokenWindows, mixed_requests, with_arrivals
from minivllm.cli import main
from minivllm.config import EngineConfig
from minivllm.executor import load_parts
from minivllm.engine.llm_engine import LLMEngine
from minivllm.router.policies import Router
from minivllm.tracing.trace import StepTracer


class WallTimedRunner:
    """The real runner, whose wall time (and only that) moves the engine's clock: the real run's
    step times, with no race between an arrival and the loop's check of it."""

    def __init__(self, runner, clock: VirtualClock) -> None:
        self.runner, self.clock, self.prepare_time = runner, clock, 0.0

    def execute(self, batch):
        start = time.perf_counter()
        logits = self.runner.execute(batch)
        self.clock.sleep(time.perf_counter() - start)
        return logits


class ReplayCost:
    """A cost model that replays recorded step durations in order."""

    label, modeled = "replay", False

    def __init__(self, seconds: list[float]) -> None:
        self.seconds = iter(seconds)

    def step_time(self, shape: StepShape) -> float:
        return next(self.seconds)


def _step_sequence(rows) -> list[tuple]:
    return [(r.num_prefill_tokens, r.num_decode_tokens, r.num_padding_tokens, r.num_running, r.num_waiting,
             r.num_preempted, r.num_finished) for r in rows]


def test_simulated_steps_equal_the_real_engines_on_replayed_step_times():
    config = EngineConfig(dtype="float32", num_kv_blocks=40, max_num_batched_tokens=64, max_num_seqs=6)
    clock = VirtualClock()
    parts = load_parts(config)
    parts.runner = WallTimedRunner(parts.runner, clock)
    real = LLMEngine(config, parts=parts, clock=clock)
    real.tracer = StepTracer(None, real.start_time)
    rng = np.random.default_rng(3)
    # 100 req/s: ten requests arrive within ~0.1 s, faster than a step of 64 tokens ends on any machine here,
    # so some wait for a slot whatever the kernels' speed (at 20 req/s faster kernels left none waiting).
    requests = with_arrivals(mixed_requests(TokenWindows(real.tokenizer), 10, 0.3, (8, 40), (3, 10), (90, 160),
                                            (8, 16), rng), 100.0, 1.0, rng)
    measured = replay_engine(real, requests, "continuous", False, sleep=clock.sleep)
    durations = [r.t_end - r.t_start for r in measured.rows]

    predicted = simulate_engine(config, requests, real.model_config, ReplayCost(durations), show_progress=False)
    assert _step_sequence(predicted.rows) == _step_sequence(measured.rows)
    assert sum(r.num_prefill_tokens for r in measured.rows) > 0 and any(r.num_waiting for r in measured.rows)
    assert [m.token_times for m in predicted.metrics] == [m.token_times for m in measured.metrics]
    assert [len(m.token_times) for m in predicted.metrics] == [r.output_len for r in requests]


def _run_json(tmp_path, name: str, *args: str) -> dict:
    out = tmp_path / f"{name}.json"
    main(["bench", *args, "--output-json", str(out), "--disable-tqdm"])
    return json.loads(out.read_text())


def _hand_written_profile(tmp_path) -> Path:
    profile = tmp_path / "profile.json"
    profile.write_text(json.dumps({"kind": "calibrated", "label": "hand-written", "coefficients": dict(
        step=0.004, rows=2e-4, prefill_seqs=0.0, decode_seqs=8e-4, decode_context=1e-6, prefill_attention=0.0,
        wake=0.0, after_prefill=0.0), "step_noise": [0.8, 1.0, 1.2]}))
    return profile


def test_simulate_writes_bench_compares_layout_and_sizes_replicas(tmp_path):
    profile = _hand_written_profile(tmp_path)
    res = _run_json(tmp_path, "sim", "simulate", "--profile", str(profile), "--num-prompts", "12",
                    "--request-rate", "4", "--output-dir", str(tmp_path / "out"))
    assert {"workload", "setup", "engine", "summaries"} <= set(res) and res["modeled"] is False
    assert [s["name"] for s in res["summaries"]] == ["static", "continuous"]
    for summary in res["summaries"]:
        assert set(summary) == {f.name for f in fields(SystemSummary)}
        assert set(summary["serving"]) == {f.name for f in fields(ServingMetrics)}
        assert summary["serving"]["completed"] == 12
    assert (tmp_path / "out" / "ttft_cdf.png").exists()

    res = _run_json(tmp_path, "slo", "simulate", "--gpu", "h100", "--model-config", "llama-3-8b",
                    "--scheduler", "continuous", "--num-prompts", "200", "--request-rate", "400",
                    "--slo-ttft-p99", "300", "--max-replicas", "8")
    search = res["slo_search"]
    assert res["modeled"] is True and res["cost_model"]["label"].startswith("modeled")
    n = search["replicas"]
    assert n is not None and search["tried"][str(n)] <= 300
    assert n == 1 or search["tried"][str(n - 1)] > 300


def test_routing_policies():
    prefix = list(range(100, 164))  # four full blocks of 16 tokens
    router = Router.create("prefix-aware", ["a", "b", "c"])
    first = router.route("0", prefix + [1, 2, 3], 10)
    assert [router.route(str(i), prefix + [i] * 20, 10) for i in range(1, 4)] == [first] * 3
    other = router.route("x", list(range(500, 564)), 10)  # another prefix: the least loaded replica
    assert other != first
    # The load bound: once the owner carries far more than the mean, the prefix goes to the least loaded.
    big = [router.route(f"big{i}", prefix + [7] * 2000, 1000) for i in range(8)]
    assert big[0] == first and len(set(big)) > 1
    loads = [r.outstanding_tokens for r in router.replicas]
    assert loads[first] <= 1.5 * sum(loads) / len(loads) + 4096 + 3064

    rr = Router.create("round-robin", ["a", "b"])
    assert [rr.route(str(i), [1], 1) for i in range(4)] == [0, 1, 0, 1]
    lot = Router.create("least-outstanding-tokens", ["a", "b"])
    assert lot.route("long", [1] * 100, 100) == 0 and lot.route("short", [1], 1) == 1
    assert lot.route("next", [1], 1) == 1
    lot.finished("long")
    assert lot.replicas[0].outstanding_tokens == 0 and lot.route("after", [1], 1) == 0


def test_calibrate_writes_a_loadable_profile(tmp_path):
    res = _run_json(tmp_path, "profile", "calibrate", "--grid", "tiny", "--repeats", "1", "--dtype", "float32")
    cost = load_profile(str(tmp_path / "profile.json"))
    assert set(cost.coefficients) == set(TERMS) and res["num_steps"] > 10
    assert {"median", "total"} <= set(res["held_out_error"])
    assert min(cost.coefficients.values()) >= 0
    # How the steps spread about the fit: its quantiles, in order, with a mean of 1.
    assert len(cost.noise) == NOISE_QUANTILES and cost.noise == sorted(cost.noise) and cost.noise[0] < cost.noise[-1]
    assert abs(np.mean(cost.noise) - 1) < 1e-3
    assert cost.step_time(StepShape(prefill_tokens=64, num_seqs=1)) > 0
    # The static probe's members finish at drawn lengths: their slots pad decode steps beside live ones.
    rows = [dict(zip(res["steps"]["columns"], r)) for r in res["steps"]["rows"]]
    assert any(r["padding_tokens"] and r["decode_seqs"] and not r["prefill_tokens"] for r in rows)
    # The idle probe's requests each wake the engine with their prefill; every other step follows another.
    woke = [r for r in rows if r["woke"]]
    assert len(woke) == 3 and all(r["prefill_tokens"] and not r["decode_seqs"] for r in woke)
    # Each decode-only step counts the steps since the last prefill; a step with a prefill has none.
    assert {r["steps_after_prefill"] for r in rows if not r["prefill_tokens"]} >= {1, 2}
    assert all(r["steps_after_prefill"] == 0 for r in rows if r["prefill_tokens"])


def _step_times(engine, clock: VirtualClock) -> list[float]:
    """Steps the simulated engine until it is done; each step's time on its virtual clock."""
    times = []
    while engine.has_unfinished_requests():
        start = clock.now
        engine.step()
        times.append(round(clock.now - start, 9))
    return times


def test_a_step_costs_what_it_follows_an_idle_spell_and_a_prefill():
    from minivllm.bench.simulate import simulated_engine
    from minivllm.bench.workloads import load_tokenizer
    from minivllm.sampling_params import SamplingParams

    _, model_config = load_tokenizer(None)
    cost = LinearCost(dict.fromkeys(TERMS, 0.0) | {"step": 0.01, "wake": 0.03, "after_prefill": 0.008}, "hand-written")
    engine, clock = simulated_engine(EngineConfig(num_kv_blocks=16), model_config, cost)

    # Its arrival met an engine just started: no idle spell. The decodes after its prefill cost the
    # after-prefill term, fading by an eighth a step.
    engine.add_request("first", [1, 2, 3], SamplingParams(max_tokens=3, ignore_eos=True))
    assert _step_times(engine, clock) == [0.01, 0.018, 0.017]
    clock.sleep(0.5)
    engine.add_request("after-idle", [1, 2, 3], SamplingParams(max_tokens=11, ignore_eos=True))
    assert _step_times(engine, clock) == [0.04] + [round(0.01 + 0.008 * (1 - k / 8), 9) for k in range(8)] + [0.01, 0.01]


def test_step_noise_draws_each_steps_jitter_from_the_calibrated_spread(tmp_path):
    from minivllm.bench.simulate import StepNoise, simulated_engine
    from minivllm.bench.workloads import load_tokenizer
    from minivllm.sampling_params import SamplingParams

    _, model_config = load_tokenizer(None)
    cost = LinearCost(dict.fromkeys(TERMS, 0.0) | {"step": 0.01}, "hand-written", noise=[0.5, 1.5])

    def step_times(seed: str) -> list[float]:
        engine, clock = simulated_engine(EngineConfig(num_kv_blocks=16), model_config, cost,
                                         noise=StepNoise(cost.noise, seed))
        engine.add_request("r", [1, 2, 3], SamplingParams(max_tokens=40, ignore_eos=True))
        return _step_times(engine, clock)

    first = step_times("0-0")
    assert set(first) == {0.005, 0.015}  # the model's 10 ms times a drawn quantile, both drawn in 40 steps
    assert step_times("0-0") == first and step_times("1-0") != first  # seeded

    profile = _hand_written_profile(tmp_path)
    res = _run_json(tmp_path, "noisy", "simulate", "--profile", str(profile), "--num-prompts", "8",
                    "--request-rate", "inf", "--scheduler", "continuous", "--step-noise")
    assert res["summaries"][0]["serving"]["completed"] == 8 and res["cost_model"]["step_noise"] == [0.8, 1.0, 1.2]
    old = json.loads(profile.read_text())
    del old["step_noise"]
    profile.write_text(json.dumps(old))
    with pytest.raises(SystemExit, match="no step noise"):
        main(["bench", "simulate", "--profile", str(profile), "--step-noise"])
    with pytest.raises(SystemExit, match="need a calibrated --profile"):
        main(["bench", "simulate", "--gpu", "h100", "--step-noise"])


def test_padding_costs_a_row_and_an_older_profile_is_refused():
    cost = LinearCost({"step": 0.005, "rows": 7e-4, "prefill_seqs": 4e-3, "decode_seqs": 3e-4,
                       "decode_context": 2e-6, "prefill_attention": 6e-7, "wake": 0.0,
                       "after_prefill": 0.0}, "hand-written")
    live = StepShape(decode_seqs=2, decode_context=300, num_seqs=2)
    padded = StepShape(decode_seqs=2, decode_context=300, num_seqs=2, padding_tokens=6)
    prompt = StepShape(prefill_tokens=6, prefill_seqs=1, prefill_attention=21, num_seqs=1)
    # A padding slot passes through the GEMMs as a prompt token does, and costs nothing else.
    assert padded.rows == 8 and abs(cost.step_time(padded) - cost.step_time(live) - 6 * 7e-4) < 1e-12
    assert cost.step_time(prompt) > cost.step_time(StepShape(padding_tokens=6)) > cost.step_time(StepShape())
    with pytest.raises(ValueError, match="rerun `minivllm bench calibrate`"):
        LinearCost({"step": 0.005, "prefill_tokens": 7e-4, "padding_tokens": 1e-3}, "an older profile")


def test_final_only_outputs_come_once_when_finished():
    """RequestOutputKind.FINAL_ONLY (what LLM.generate and the benchmarks ask for) skips the per-step
    outputs; the default still reports every step that advances a request."""
    from minivllm.bench.simulate import simulated_engine
    from minivllm.bench.workloads import load_tokenizer
    from minivllm.sampling_params import RequestOutputKind, SamplingParams

    _, model_config = load_tokenizer(None)
    cost = LinearCost(dict.fromkeys(TERMS, 0.0) | {"step": 0.01, "decode_seqs": 0.001, "rows": 1e-4}, "hand-written")
    engine, _ = simulated_engine(EngineConfig(num_kv_blocks=16), model_config, cost)
    engine.add_request("final", [1, 2, 3], SamplingParams(max_tokens=4, ignore_eos=True,
                                                          output_kind=RequestOutputKind.FINAL_ONLY))
    engine.add_request("each", [1, 2, 3], SamplingParams(max_tokens=4, ignore_eos=True))
    seen: dict[str, list] = {"final": [], "each": []}
    while engine.has_unfinished_requests():
        for out in engine.step():
            seen[out.request_id].append((out.finished, len(out.outputs[0].token_ids)))
    assert seen["final"] == [(True, 4)]
    assert seen["each"] == [(False, 1), (False, 2), (False, 3), (True, 4)]


def test_cost_model_counts_causal_pairs_and_its_fit_recovers_known_costs():
    from minivllm.bench.cost_model import INTERFERED, FitError, features, fit_linear, held_out_error
    from minivllm.model.batch import BatchInputs, SeqSpan

    def chunk(computed: int, n: int) -> StepShape:
        return StepShape.of(BatchInputs([SeqSpan(list(range(computed, computed + n)), computed, list(range(7)))]))

    # A prompt's attention pairs are the same whole or chunked (causal: token i sees i + 1 tokens).
    whole = chunk(0, 100).prefill_attention
    assert whole == 100 * 101 // 2 == sum(chunk(c, 25).prefill_attention for c in range(0, 100, 25))

    rng = np.random.default_rng(0)
    truth = dict(zip(TERMS, [0.02, 5e-4, 4e-3, 2e-3, 2e-6, 5e-7, 0.03, 0.004]))
    groups = []
    for _ in range(5):
        shapes = [StepShape(prefill_tokens=int(p), prefill_seqs=int(k), decode_seqs=int(d), padding_tokens=int(pad),
                            decode_context=int(d * c), prefill_attention=int(p * a), woke=int(w),
                            steps_after_prefill=int(after))
                  for p, k, d, pad, c, a, w, after in zip(rng.integers(0, 512, 40), rng.integers(1, 4, 40),
                                                          rng.integers(0, 64, 40), rng.integers(0, 32, 40),
                                                          rng.integers(16, 1024, 40), rng.integers(1, 1024, 40),
                                                          rng.random(40) < 0.1, rng.integers(0, 12, 40))]
        groups.append((shapes, [float(np.dot(list(truth.values()), features(s))) for s in shapes]))
    fitted = fit_linear([s for g in groups for s in g[0]], [t for g in groups for t in g[1]])
    assert all(abs(fitted[t] - truth[t]) <= 1e-6 * max(truth[t], 1e-3) for t in TERMS)
    held = held_out_error(groups)
    assert held.median < 1e-6 and abs(held.total) < 1e-6

    # With jitter (and a step slowed by something else, which the fit leaves out), the fitted total is
    # the kept steps' measured total: a weight from the measured time alone would come out short.
    shapes = [s for g in groups for s in g[0]]
    seconds = [t * j for t, j in zip((t for g in groups for t in g[1]), rng.lognormal(0.0, 0.2, len(shapes)))]
    seconds[0] *= 5
    jittered = LinearCost(fit_linear(shapes, seconds), "")
    kept = [(jittered.step_time(s), t) for s, t in zip(shapes, seconds) if t <= INTERFERED * jittered.step_time(s)]
    assert len(kept) == len(shapes) - 1
    assert abs(FitError.of(*zip(*kept)).total) < 1e-9


def test_validate_sets_the_median_of_repeated_real_runs_beside_the_prediction(tmp_path, capsys):
    profile = _hand_written_profile(tmp_path)
    res = _run_json(tmp_path, "validate", "simulate", "--profile", str(profile), "--validate", "compare",
                    "--validate-repeats", "3", "--num-prompts", "4", "--request-rate", "inf", "--dtype", "float32",
                    "--short-output-len", "2:4", "--long-output-len", "2:4",
                    "--output-dir", str(tmp_path / "v"))
    assert [v["setting"] for v in res["validation"]] == ["static", "continuous"]
    for v in res["validation"]:
        for key, (low, high) in v["measured_range"].items():
            assert low <= v["measured"][key] <= high  # the median of the three runs
        # Each real run's steps, timed against the hand-written model's time for the same steps.
        assert len(v["steps_vs_model"]) == 3 and all(-1 < r < 1000 for r in v["steps_vs_model"])
        assert all(v["measured"][k] == np.median(runs) and len(runs) == 3 for k, runs in v["measured_runs"].items())
        # The prediction is the median of the noisy simulations; without noise each step takes the model's time.
        for key, (low, high) in v["predicted_range"].items():
            assert low <= v["predicted"][key] <= high
            assert 0.8 * low <= v["predicted_without_noise"][key] <= 1.2 * high
    assert len(list((tmp_path / "v").glob("measured-0*.csv"))) == 3  # three real runs of the first setting
    table = capsys.readouterr().out
    assert "[range]" in table and "cells within 10 %" in table and "real steps vs model" in table
    assert "a perfect prediction" in table and 0 <= res["perfect_prediction"]["all_within"] <= 1
    with pytest.raises(SystemExit, match="at least 1"):
        main(["bench", "simulate", "--profile", str(profile), "--validate", "compare", "--validate-repeats", "0"])
    with pytest.raises(SystemExit, match="not both"):
        main(["bench", "simulate", "--profile", str(profile), "--validate", "compare", "--interleave-calibration"])
    with pytest.raises(SystemExit, match="add --validate"):
        main(["bench", "simulate", "--interleave-calibration"])


def test_a_perfect_prediction_meets_every_cell_only_where_the_real_runs_repeat():
    from minivllm.bench.simulate import VALIDATED, Validation, perfect_prediction

    def setting(runs: list[float]) -> Validation:
        figures = {k: runs for k in VALIDATED}
        return Validation("w", "s", figures, {}, {}, {}, [])

    steady, spread = setting([100.0, 101.0, 99.0, 100.0, 102.0]), setting([50.0, 100.0, 150.0, 80.0, 120.0])
    assert perfect_prediction([steady, steady]) == (2 * len(VALIDATED), 1.0)
    cells, every = perfect_prediction([steady, spread])
    assert len(VALIDATED) < cells < 2 * len(VALIDATED) and 0 < every < 1
    # A draw of the spread runs has its median within 10 % of 100 only when it is 100 itself.
    assert perfect_prediction([spread], resamples=4000)[1] == pytest.approx(0.4, abs=0.05)


def test_validate_can_calibrate_between_its_rounds_of_real_runs(tmp_path):
    from minivllm.bench.calibrate import GRIDS

    res = _run_json(tmp_path, "validate", "simulate", "--interleave-calibration", "tiny", "--validate", "compare",
                    "--validate-repeats", "2", "--num-prompts", "3", "--request-rate", "inf", "--dtype", "float32",
                    "--short-output-len", "2:3", "--long-output-len", "2:3", "--output-dir", str(tmp_path / "v"))
    profile = json.loads((tmp_path / "v" / "profile.json").read_text())
    assert res["cost_model"] == {k: profile[k] for k in ("kind", "label", "coefficients", "step_noise")}
    # Two rounds of the tiny grid: each probe ran twice, and the fit is to both rounds' steps.
    rows = [dict(zip(profile["steps"]["columns"], r)) for r in profile["steps"]["rows"]]
    assert {r["probe"] for r in rows} == set(range(len(GRIDS["tiny"])))
    assert len([r for r in rows if r["probe"] == 0]) == 2 * 4  # one prompt, 4 tokens out: 4 steps a round
    assert [len(v["steps_vs_model"]) for v in res["validation"]] == [2, 2]
