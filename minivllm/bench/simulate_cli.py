"""`minivllm bench simulate` and `minivllm bench calibrate`: flags and the commands that tie the parts."""
from __future__ import annotations

import argparse
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from minivllm.bench.cli_common import add_output_args, add_trace_args, describe_compare, write_json
from minivllm.bench.workloads import parse_range
from minivllm.config import EngineConfig

if TYPE_CHECKING:
    from minivllm.bench.compare import SystemRun

WORKLOADS = ("compare", "fixed", "chunked-prefill", "fair", "agent")
VALIDATIONS = ("compare", "fixed", "chunked-prefill", "fair")


def _mix(text: str) -> dict[str, float]:
    """'light:1,heavy:10' -> {'light': 1/11, 'heavy': 10/11}."""
    try:
        pairs = [item.rsplit(":", 1) for item in text.split(",")]
        weights = {name: float(w) for name, w in pairs}
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected NAME:WEIGHT,... got {text!r}") from None
    if not weights or min(weights.values()) < 0 or sum(weights.values()) <= 0:
        raise argparse.ArgumentTypeError(f"weights must be >= 0 with a positive sum, got {text!r}")
    total = sum(weights.values())
    return {name: w / total for name, w in weights.items()}


def _choices(names: tuple[str, ...]):
    def parse(text: str) -> list[str]:
        chosen = list(names) if text == "all" else text.split(",")
        if not set(chosen) <= set(names):
            raise argparse.ArgumentTypeError(f"expected 'all' or a comma-separated list of {', '.join(names)}")
        return chosen
    return parse


def _cost_model(args: argparse.Namespace):
    from minivllm.bench.cost_model import load_profile, roofline

    if args.profile:
        cost = load_profile(args.profile)
    elif args.gpu:
        cost = roofline(args.gpu, args.model_config, args.tensor_parallel_size)
    else:
        raise SystemExit("bench simulate needs a cost model: --profile PROFILE.json (from `minivllm bench calibrate`) "
                         "or --gpu h100|h200|SPEC.json with --model-config llama-3-8b|DIR (modeled)")
    if cost.modeled and (args.step_noise or args.validate):
        raise SystemExit("--step-noise and --validate draw on a calibration's measured steps, and --validate compares "
                         "with real runs on this machine: they need a calibrated --profile")
    if (args.step_noise or args.validate) and not cost.noise:
        raise SystemExit(f"{args.profile} has no step noise (measured by calibrate since 2026-12-01), which "
                         "--step-noise and --validate draw from: rerun `minivllm bench calibrate`")
    return cost


def _requests(args: argparse.Namespace, corpus) -> list:
    """The workload of --workload, with arrivals, tenants and priorities."""
    from minivllm.bench.scheduling import chunked_prefill_workload, fair_workload
    from minivllm.bench.workloads import (FIXED, TextCorpus, agent_requests, mixed_requests, random_requests,
                                         with_arrivals)

    rng = np.random.default_rng(args.seed)
    if args.workload == "chunked-prefill":
        return chunked_prefill_workload(corpus, rng)
    if args.workload == "fair":
        return fair_workload(corpus, rng, with_heavy=True)
    if args.workload == "fixed":
        requests = random_requests(corpus, args.num_prompts, FIXED["input_len_range"], FIXED["output_len_range"], rng)
    elif args.workload == "agent":
        # Real text: a turn's prompt is the last one's text plus more, tokenized again, as a client sends it.
        requests = agent_requests(TextCorpus(corpus.tokenizer), args.num_prompts, args.num_conversations,
                                  args.context_len, args.turn_len, args.short_output_len, rng)
    else:
        requests = mixed_requests(corpus, args.num_prompts, args.long_fraction, args.short_input_len,
                                  args.short_output_len, args.long_input_len, args.long_output_len, rng)
    with_arrivals(requests, args.request_rate, args.burstiness, rng)
    # A generator of its own, so that the mixes leave the lengths and arrivals of the seed unchanged.
    mix_rng = np.random.default_rng([args.seed, 1])
    for field, mix, kind in (("tenant", args.tenant_mix, str), ("priority", args.priority_mix, int)):
        if mix:
            names = list(mix)
            for req, k in zip(requests, mix_rng.choice(len(names), size=len(requests), p=list(mix.values()))):
                setattr(req, field, kind(names[k]))
    return requests


def cmd_simulate(args: argparse.Namespace) -> None:
    from minivllm.bench.compare import summarize
    from minivllm.bench.report import compare_table, verdict, write_plots
    from minivllm.bench.simulate import replicas_for_ttft, simulate_cluster, slo_text
    from minivllm.bench.workloads import TokenWindows, load_tokenizer, requests_as_dicts

    if args.validate:
        return _validate(args)
    if args.interleave_calibration:
        raise SystemExit("--interleave-calibration measures the profile between --validate's real runs: "
                         "add --validate, or calibrate first with `minivllm bench calibrate`")
    cost = _cost_model(args)
    modeled = cost.modeled
    print(f"Cost model: {cost.label}", file=sys.stderr)
    # --tensor-parallel-size is the modeled GPUs' (the cost model's); the engine here is one rank.
    overrides = {"seed": args.seed, "kv_cache_memory": args.kv_cache_memory or "1GiB", "tensor_parallel_size": 1}
    if modeled:  # the GPU's dtype, and a KV pool of what the GPU has left after the weights
        overrides.update(dtype="bfloat16", model=None,
                         kv_cache_memory=args.kv_cache_memory or str(cost.kv_cache_memory()))
    config = EngineConfig.from_cli_args(args, **overrides)
    tokenizer, model_config = load_tokenizer(config.model)
    model_config = cost.model if modeled else model_config
    show = not args.disable_tqdm
    requests = _requests(args, TokenWindows(tokenizer))
    noise_seed = args.seed if args.step_noise else None
    out_dir = Path(args.output_dir) if args.output_dir else None
    trace_dir = str(out_dir) if out_dir and args.trace else None
    result = {"modeled": modeled, "cost_model": cost.to_dict(), "num_replicas": args.num_replicas,
              "routing_policy": args.routing_policy}
    if args.slo_ttft_p99 is not None:
        cont = replace(config, scheduler="continuous")
        search = replicas_for_ttft(
            lambda n: simulate_cluster(cont, requests, model_config, cost, n, args.routing_policy, None, show,
                                       noise_seed),
            args.slo_ttft_p99, args.max_replicas)
        print(slo_text(search, cost.label))
        result["slo_search"] = asdict(search)
        write_json(args.output_json, result)
        return
    schedulers = ("static", "continuous") if args.systems == "both" else (args.systems,)
    start = time.perf_counter()
    runs = [simulate_cluster(replace(config, scheduler=s), requests, model_config, cost, args.num_replicas,
                             args.routing_policy, trace_dir, show, noise_seed) for s in schedulers]
    wall = time.perf_counter() - start
    summaries = [summarize(run) for run in runs]
    workload, setup = describe_compare(args, config, requests)
    setup = f"{cost.label}; {args.num_replicas} replica(s), routing {args.routing_policy}; {setup}"
    print(f"{'MODELED ' if modeled else ''}simulation of {len(requests)} requests in {wall:.1f} s wall time "
          f"({cost.label})")
    if args.num_replicas > 1:
        print(router_text(runs[-1], args.num_replicas, args.routing_policy))
    if len(summaries) == 2:
        print(verdict(summaries))
    print(compare_table(summaries))
    result.update(workload={"description": workload, "requests": requests_as_dicts(requests)}, setup=setup,
                  engine=asdict(config), summaries=[asdict(s) for s in summaries], wall_time_s=wall)
    if out_dir:
        out_dir.mkdir(parents=True, exist_ok=True)
        write_plots(runs, out_dir, args.static_batch_size)
        write_json(str(out_dir / "results.json"), result)
    write_json(args.output_json, result)


def _validate(args: argparse.Namespace) -> None:
    from minivllm.bench.calibrate import Calibrator
    from minivllm.bench.simulate import measure, perfect_prediction, predict, validation_cases, validation_table
    from minivllm.bench.workloads import TextCorpus, load_tokenizer, mixed_requests, with_arrivals

    if args.gpu or bool(args.profile) == bool(args.interleave_calibration):
        raise SystemExit("--validate compares with real runs on this machine: it takes a calibrated --profile, or "
                         "--interleave-calibration to calibrate in the same sitting (not both)")
    if args.validate_repeats < 1:
        raise SystemExit(f"--validate-repeats must be at least 1, got {args.validate_repeats}")
    cost = _cost_model(args) if args.profile else None
    config = EngineConfig.from_cli_args(args, seed=args.seed, kv_cache_memory=args.kv_cache_memory or "1GiB",
                                        tensor_parallel_size=1)
    tokenizer, model_config = load_tokenizer(config.model)
    corpus, show = TextCorpus(tokenizer), not args.disable_tqdm
    rng = np.random.default_rng(args.seed)
    compare_requests = with_arrivals(mixed_requests(corpus, args.num_prompts, args.long_fraction,
                                                    args.short_input_len, args.short_output_len, args.long_input_len,
                                                    args.long_output_len, rng), args.request_rate, args.burstiness, rng)
    cases = validation_cases(config, compare_requests, corpus, args.seed, args.validate)
    out_dir = args.output_dir or "runs/simulate-validate"
    calibrator = Calibrator(config, args.interleave_calibration) if args.interleave_calibration else None
    reals = measure(cases, out_dir, show, args.validate_repeats, calibrator and (lambda: calibrator.run_round(show)))
    if calibrator:
        calibration = calibrator.finish()
        _report_calibration(calibration, f"{out_dir}/profile.json")
        cost = calibration.cost
    print(f"Cost model: {cost.label}", file=sys.stderr)
    results = predict(cases, reals, model_config, cost, out_dir, show)
    cells, every = perfect_prediction(results)
    print(validation_table(results, (cells, every)))
    write_json(args.output_json, {"cost_model": cost.to_dict(), "engine": asdict(config),
                                  "validation": [v.to_dict() for v in results],
                                  "perfect_prediction": {"cells_within": cells, "all_within": every}})


def cmd_calibrate(args: argparse.Namespace) -> None:
    from minivllm.bench.calibrate import calibrate

    config = EngineConfig.from_cli_args(args)
    _report_calibration(calibrate(config, args.grid, args.repeats, not args.disable_tqdm), args.output_json)


def _report_calibration(cal, output_json: str | None) -> None:
    """Prints the fit and its errors; writes the profile."""
    from minivllm.bench.cost_model import INTERFERED

    cost, fit, held = cal.cost, cal.fit_error, cal.held_out_error
    print(f"{cost.label}: {len(cal.steps)} steps, {cal.num_interfered} left out (over {INTERFERED:g} times their "
          f"fitted time: slowed by something else on the machine)")
    print("seconds per step = " + " + ".join(f"{c:.3g} x {t}" for t, c in cost.coefficients.items()))
    print(f"error per step (median) / of the total time: fitted steps {fit.median:.1%} / {fit.total:+.1%}, "
          f"held-out probes {held.median:.1%} / {held.total:+.1%}")
    write_json(output_json, cost.to_dict() | {"fit_error": asdict(fit), "held_out_error": asdict(held),
                                              "num_steps": len(cal.steps), "num_interfered": cal.num_interfered,
                                              "steps": cal.steps_dict()})


def router_text(run: SystemRun, num_replicas: int, policy: str) -> str:
    """The router's own cost against the cluster's rate: where one router core would become the bottleneck."""
    per_request = run.router_seconds / len(run.requests)
    span = max(m.finished_time for m in run.metrics) - min(m.arrival_time for m in run.metrics)
    hits = sum(m.num_cached_tokens for m in run.metrics) / sum(len(r.prompt_token_ids) for r in run.requests)
    return (f"router ({policy}, {num_replicas} replicas): {per_request * 1e6:.1f} us of policy and book a request, "
            f"so one core routes at most {1 / per_request:,.0f} req/s; the simulated cluster served "
            f"{len(run.requests) / span:,.1f} req/s, prefix-cache hit rate {hits:.1%}")


def add_simulate_parsers(bench_sub: argparse._SubParsersAction) -> None:
    from minivllm.router.policies import ROUTING_POLICIES

    p = bench_sub.add_parser("simulate", help="the real scheduler on a cost model and a virtual clock: "
                                              "a workload in seconds, replicas for an SLO")
    add_trace_args(p)
    g = p.add_argument_group("workload")
    g.add_argument("--workload", choices=WORKLOADS, default="compare",
                   help="compare: bench compare's short/long trace (the flags above); fixed: the reference "
                        "lengths (16..512 in, 8..256 out) at the arrival flags; chunked-prefill, fair: bench "
                        "scheduling's scenarios (fair: light beside 10x heavy); agent: turns of --num-conversations "
                        "conversations in rotation (bench serve --dataset agent's), outputs of --short-output-len")
    g.add_argument("--num-conversations", type=int, default=8, help="agent: conversations taken in rotation")
    g.add_argument("--context-len", type=parse_range, default=(384, 768), metavar="MIN:MAX",
                   help="agent: a conversation's first prompt, in tokens")
    g.add_argument("--turn-len", type=int, default=64, help="agent: tokens each later turn adds")
    g.add_argument("--tenant-mix", type=_mix, default=None, metavar="NAME:WEIGHT,...",
                   help="tenants of the requests (for --scheduling-policy fair), e.g. light:1,heavy:10")
    g.add_argument("--priority-mix", type=_mix, default=None, metavar="PRIORITY:WEIGHT,...",
                   help="priorities of the requests (for --scheduling-policy priority), e.g. 0:1,1:4")
    g = p.add_argument_group("cost model")
    g.add_argument("--profile", default=None, help="a profile JSON from `minivllm bench calibrate`")
    g.add_argument("--gpu", default=None, help="modeled: h100, h200 or a GPU spec JSON (roofline)")
    g.add_argument("--model-config", default="llama-3-8b",
                   help="modeled: llama-3-8b, llama-3-70b, or a Llama-family config.json / checkpoint directory")
    g.add_argument("--tensor-parallel-size", type=int, default=1, help="modeled: GPUs per replica")
    g.add_argument("--step-noise", action="store_true",
                   help="calibrated: each step takes the model's time times a jitter drawn (seeded by --seed) "
                        "from how calibration's steps spread about it; without it every step takes its mean time, "
                        "and near capacity queues come out shorter than the machine's")
    g = p.add_argument_group("cluster")
    g.add_argument("--num-replicas", type=int, default=1)
    g.add_argument("--routing-policy", choices=tuple(ROUTING_POLICIES), default="least-outstanding-tokens")
    g.add_argument("--slo-ttft-p99", type=float, default=None, metavar="MS",
                   help="find the fewest replicas whose P99 TTFT is within MS (continuous batching)")
    g.add_argument("--max-replicas", type=int, default=64, help="the most replicas --slo-ttft-p99 tries")
    p.add_argument("--scheduler", dest="systems", choices=("both", "continuous", "static"), default="both")
    p.add_argument("--validate", type=_choices(VALIDATIONS), default=None, metavar="all|" + ",".join(VALIDATIONS),
                   help="run these workloads on the real engine too and print predicted vs measured")
    p.add_argument("--validate-repeats", type=int, default=1, metavar="N",
                   help="real runs per validated setting; the measured figure is their median (and range)")
    p.add_argument("--interleave-calibration", nargs="?", const="default", choices=("default", "tiny"), default=None,
                   metavar="GRID", help="with --validate, in place of --profile: calibrate in the same sitting, a "
                                        "round of calibrate's probes (GRID: default or tiny) before each round of "
                                        "real runs, so that the machine's drift falls on both alike; the profile "
                                        "goes to OUTPUT_DIR/profile.json")
    p.add_argument("--output-dir", default=None, help="plots and results.json (and step traces with --trace)")
    p.add_argument("--trace", action="store_true", help="write each engine's step trace to --output-dir")
    add_output_args(p)
    EngineConfig.add_cli_args(p, skip=("seed", "scheduler", "trace_file", "tensor_parallel_size"))
    p.set_defaults(func=cmd_simulate, with_hf=False, kv_cache_memory=None)

    p = bench_sub.add_parser("calibrate", help="time engine steps on this machine and model; write the "
                                               "simulator's cost profile")
    p.add_argument("--grid", choices=("default", "tiny"), default="default", help="the step shapes measured")
    p.add_argument("--repeats", type=int, default=2, help="times each probe runs")
    add_output_args(p)
    EngineConfig.add_cli_args(p, skip=("seed", "scheduler", "trace_file", "static_batch_size"))
    p.set_defaults(func=cmd_calibrate)
