"""`minivllm bench throughput|latency|serve|compare|scheduling|startup|kernels|roofline|quality`: flags and the commands
that tie the parts."""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import sys
from dataclasses import asdict, replace
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from minivllm.bench.cli_common import (add_output_args, add_trace_args, describe_compare, dtype_name, rate, span,
                                       write_json)
from minivllm.bench.quality import DEFAULT_TEXT
from minivllm.bench.workloads import (TextCorpus, add_workload_args, build_workload, load_tokenizer, mixed_requests,
                                      requests_as_dicts, with_arrivals, workload_spec)
from minivllm.config import KV_CACHE_DTYPES, EngineConfig

if TYPE_CHECKING:
    from minivllm.bench.serve import ServeTarget


# -- throughput -----------------------------------------------------------------------------------------
def cmd_throughput(args: argparse.Namespace) -> None:
    from minivllm.bench.roofline import measure
    from minivllm.bench.throughput import run_hf, run_minivllm

    spec = workload_spec(args)
    config = EngineConfig.from_cli_args(args, seed=spec["seed"])
    if args.backend == "hf":
        tokenizer, model_config = load_tokenizer(config.model)
        result, requests = run_hf(config, spec, args.hf_batch_size, tokenizer, not args.disable_tqdm)
    else:
        result, requests, model_config = run_minivllm(config, spec, not args.disable_tqdm,
                                                      args.structured_output_ratio, args.temperature)
    print(result.text())
    out = {"workload": spec, "engine": asdict(config), "result": result.to_dict(),
           "requests": requests_as_dicts(requests)}
    if args.backend == "hf":
        out["hf_batch_size"] = args.hf_batch_size
    if args.roofline:
        dtype = dtype_name(config)
        roof = measure(model_config, config.torch_device, dtypes=(dtype,))
        fraction = roof.throughput_fraction(dtype, result.total_input_tokens, result.total_output_tokens,
                                            result.elapsed)
        print(f"Roofline ({dtype}, measured now): prefill {roof.per_dtype[dtype].prefill_tokens_per_s:.0f} tok/s, "
              f"decode {roof.per_dtype[dtype].decode_tokens_per_s:.0f} tok/s; this run reached "
              f"{fraction:.1%} of the compute roofline")
        out["roofline"] = asdict(roof)
        out["roofline_fraction"] = fraction
    write_json(args.output_json, out)


# -- latency --------------------------------------------------------------------------------------------
def cmd_latency(args: argparse.Namespace) -> None:
    from minivllm.bench.latency import run_latency

    config = EngineConfig.from_cli_args(args, max_num_seqs=max(args.batch_size, args.max_num_seqs))
    result = run_latency(config, args.batch_size, args.input_len, args.output_len, args.num_iters,
                         args.num_iters_warmup)
    print(result.text())
    write_json(args.output_json, {"engine": asdict(config),
                                  "result": asdict(result) | {"prefill_tokens_per_s": result.prefill_tokens_per_s,
                                                              "decode_tokens_per_s": result.decode_tokens_per_s,
                                                              "batch_output_tokens_per_s":
                                                                  result.batch_output_tokens_per_s}})


# -- prefill --------------------------------------------------------------------------------------------
def cmd_prefill(args: argparse.Namespace) -> None:
    from minivllm.bench.prefill import format_prefill, plot_prefill, run_prefill

    config = EngineConfig.from_cli_args(args)
    points, peaks = run_prefill(config, args.input_lens, args.num_iters, args.llama_bench, args.llama_bench_fa,
                                progress=lambda what: print(f"measuring {what}...", file=sys.stderr, flush=True))
    name = Path(config.model).name if config.model else "SmolLM2-135M-Instruct"
    print(format_prefill(points, peaks, name))
    write_json(args.output_json, {"engine": asdict(config), "peaks": asdict(peaks),
                                  "points": [asdict(p) for p in points]})
    if args.plot:
        plot_prefill(points, name, Path(args.plot))
        print(f"plot: {args.plot}")


# -- serve ----------------------------------------------------------------------------------------------
def serve_agent_turns(args: argparse.Namespace, spec: dict, target: ServeTarget, corpus: TextCorpus,
                      rng: np.random.Generator) -> None:
    """--dataset agent over the Messages or Responses API: conversations replayed turn by turn."""
    from minivllm.bench.agent_turns import agent_sessions, per_turn, per_turn_text, replay

    if spec["dataset"] != "agent":
        raise ValueError("--api messages|responses replays --dataset agent")
    turns = max(1, spec["num_prompts"] // spec["num_prefixes"])
    sessions = agent_sessions(corpus, spec["num_prefixes"], turns, spec["input_len_range"], spec["turn_len"],
                              spec["output_len_range"], rng)
    print(f"{spec['num_prefixes']} conversations of {turns} turns over /v1/{args.api}, "
          f"max concurrency {args.max_concurrency}", flush=True)
    records, duration = asyncio.run(replay(target, sessions, args.api, args.max_concurrency))
    rows = per_turn(records)
    print(per_turn_text(rows))
    print(f"Duration: {duration:.1f} s")
    for r in records:
        if r.error:
            print(f"failed turn {r.turn + 1} of conversation {r.conversation}: {r.error}", file=sys.stderr)
    write_json(args.output_json, {"workload": spec | {"api": args.api, "turns": turns}, "base_url": target.base_url,
                                  "model": target.model, "duration_s": duration, "per_turn": rows,
                                  "records": [asdict(r) for r in records]})


def cmd_serve(args: argparse.Namespace) -> None:
    from minivllm.bench.metrics import mean_time_breakdown, parse_goodput, serving_metrics
    from minivllm.bench.report import serving_text
    from minivllm.bench.serve import (ServeTarget, counter_delta, counter_ratio, counter_totals, run_benchmark,
                                      same_texts, served_model)

    slos = parse_goodput(args.goodput or [])
    percentiles = [int(p) if p.is_integer() else p for p in map(float, args.metric_percentiles.split(","))]
    spec = workload_spec(args)
    spec.update(request_rate=args.request_rate, burstiness=args.burstiness, max_concurrency=args.max_concurrency)
    base_url = args.base_url.rstrip("/")
    target = ServeTarget(base_url, args.served_model_name or served_model(base_url, args.api_key), args.api_key,
                         tuple(args.lora_modules or ()), args.lora_field)
    tokenizer, _ = load_tokenizer(args.model)
    rng = np.random.default_rng(spec["seed"])
    if args.api != "completions":
        serve_agent_turns(args, spec, target, TextCorpus(tokenizer), rng)
        return
    requests = with_arrivals(build_workload(spec, tokenizer, rng), args.request_rate, args.burstiness, rng)
    print(f"Traffic request rate: {args.request_rate}, burstiness: {args.burstiness}, "
          f"max concurrency: {args.max_concurrency}", flush=True)
    before = counter_totals(base_url)
    records, duration = asyncio.run(run_benchmark(target, requests, tokenizer, args.max_concurrency,
                                                  not args.disable_tqdm))
    after = counter_totals(base_url)
    metrics = serving_metrics(records, duration, percentiles, slos)
    print(serving_text(metrics))
    prefix_hit_rate = counter_ratio(before, after, "prefix_cache_hits", "prefix_cache_queries")
    if prefix_hit_rate is not None:
        print(f"Prefix cache hit rate (server side, prompt tokens, all replicas): {prefix_hit_rate:.1%}")
    speculation = {"spec_acceptance_rate": counter_ratio(before, after, "spec_decode_num_accepted_tokens",
                                                         "spec_decode_num_draft_tokens"),
                   "spec_mean_accepted_length": counter_ratio(before, after, "spec_decode_num_accepted_tokens",
                                                              "spec_decode_num_drafts")}
    if speculation["spec_mean_accepted_length"] is not None:
        speculation["spec_mean_accepted_length"] += 1  # the token sampled after the accepted ones
        print(f"Speculative decoding (server side): acceptance rate {speculation['spec_acceptance_rate']:.1%}, "
              f"mean accepted length {speculation['spec_mean_accepted_length']:.2f}")
    kv_tier = {name: counter_delta(before, after, name) for name in (
        "kv_offload_ram_hits", "kv_offload_disk_hits", "kv_offload_loaded_bytes", "kv_offload_load_seconds",
        "kv_offload_read_seconds")}
    if kv_tier["kv_offload_loaded_bytes"]:
        print(f"KV tier (server side): prompt tokens loaded back {kv_tier['kv_offload_ram_hits']:.0f} from RAM, "
              f"{kv_tier['kv_offload_disk_hits']:.0f} from disk; {kv_tier['kv_offload_loaded_bytes'] / 2**20:.1f} MiB "
              f"copied in {kv_tier['kv_offload_load_seconds']:.3f} s in the steps "
              f"({kv_tier['kv_offload_read_seconds']:.3f} s of disk reads beside them)")
    time_breakdown = mean_time_breakdown(records)
    if time_breakdown:
        print("Time per request (server side, mean ms): " + ", ".join(f"{name.replace('_', ' ')} {ms:.1f}"
                                                                       for name, ms in time_breakdown.items()))
    greedy_exact = same_texts(records, args.compare_to) if args.compare_to else None
    if greedy_exact is not None:
        print(f"Outputs {'equal' if greedy_exact else 'NOT equal'} to those of {args.compare_to}")
    for r in records:
        if not r.success:
            print(f"failed request: {r.error}", file=sys.stderr)
    write_json(args.output_json, {"workload": spec, "base_url": base_url, "model": target.model, "goodput": slos,
                                  "metrics": asdict(metrics), "prefix_cache_hit_rate": prefix_hit_rate,
                                  **speculation, **kv_tier, "greedy_exact": greedy_exact,
                                  "time_breakdown_ms": time_breakdown,
                                  "requests": requests_as_dicts(requests),
                                  "records": [asdict(r) for r in records]})


# -- compare --------------------------------------------------------------------------------------------
def cmd_compare(args: argparse.Namespace) -> None:
    from minivllm.bench.compare import run_engine, run_hf, summarize
    from minivllm.bench.hf_backend import HFGenerator
    from minivllm.bench.report import compare_markdown, compare_table, verdict, write_plots, write_rows
    out_dir = Path(args.output_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    config = EngineConfig.from_cli_args(args, seed=args.seed)
    tokenizer, _ = load_tokenizer(config.model)  # the one the engines below use too (loaded once per process)
    rng = np.random.default_rng(args.seed)
    requests = mixed_requests(TextCorpus(tokenizer), args.num_prompts, args.long_fraction, args.short_input_len,
                              args.short_output_len, args.long_input_len, args.long_output_len, rng)
    with_arrivals(requests, args.request_rate, args.burstiness, rng)
    show = not args.disable_tqdm
    runs = [run_engine(replace(config, scheduler=scheduler), requests, str(out_dir / f"{scheduler}.csv"), show)
            for scheduler in ("static", "continuous")]
    files = ["static.csv", "static.json", "continuous.csv", "continuous.json"]
    if args.with_hf:
        generator = HFGenerator(config.model, config.torch_dtype, config.torch_device, tokenizer)
        runs.append(run_hf(generator, requests, args.hf_batch_size or args.static_batch_size, show))
        files.append(write_rows(out_dir / "hf.csv", runs[-1].rows))
    summaries = [summarize(run) for run in runs]
    files += write_plots(runs, out_dir, args.static_batch_size) + ["results.json"]
    workload, setup = describe_compare(args, config, requests)
    (out_dir / "report.md").write_text(compare_markdown(summaries, workload, setup, _compare_command(args), files))
    print(verdict(summaries))
    print(compare_table(summaries))
    print(f"Report: {out_dir / 'report.md'}")
    result = {"workload": {"description": workload, "requests": requests_as_dicts(requests)}, "setup": setup,
              "engine": asdict(config), "summaries": [asdict(s) for s in summaries]}
    write_json(str(out_dir / "results.json"), result)
    write_json(args.output_json, result)


def _compare_command(args: argparse.Namespace) -> str:
    """The command that replays this trace (engine flags other than these are in the setup line)."""
    flags = [f"--num-prompts {args.num_prompts}", f"--request-rate {args.request_rate}",
             f"--burstiness {args.burstiness}", f"--seed {args.seed}", f"--long-fraction {args.long_fraction}",
             *(f"--{name.replace('_', '-')} {span(getattr(args, name), ':')}"
               for name in ("short_input_len", "short_output_len", "long_input_len", "long_output_len")),
             f"--static-batch-size {args.static_batch_size}", f"--dtype {args.dtype}", f"--device {args.device}"]
    if args.with_hf:
        flags.append(f"--with-hf --hf-batch-size {args.hf_batch_size or args.static_batch_size}")
    return "minivllm bench compare " + " ".join(flags)


# -- roofline -------------------------------------------------------------------------------------------
def cmd_roofline(args: argparse.Namespace) -> None:
    import torch

    from minivllm.bench.roofline import file_bytes_per_token, format_roofline, measure
    from minivllm.model.kernels import report
    from minivllm.model.loader import load_checkpoint, resolve_model_path

    path = resolve_model_path(args.model)
    model_config, _ = load_checkpoint(path)
    device = EngineConfig(device=args.device).torch_device
    roof = measure(model_config, device, args.num_tokens, args.dtypes,
                   progress=lambda what: print(f"measuring {what}...", file=sys.stderr, flush=True))
    print(format_roofline(roof, path.stem))
    kernels = {name: report(device, getattr(torch, name)) for name in roof.per_dtype}  # the target, what runs
    for line in kernels.values():
        print(line.removeprefix("minivllm: "))
    file_bytes = file_bytes_per_token(path, model_config)
    bound = roof.read_bandwidth / file_bytes
    print(f"batch-1 bound of {path.name} as stored: {file_bytes / 1e6:.0f} MB of tensors read per token / "
          f"{roof.read_bandwidth / 1e9:.1f} GB/s = {bound:.1f} tokens/s")
    write_json(args.output_json, {"model": str(path), **asdict(roof),
                                  "batch1_decode_tokens_per_s": {d: roof.batch1_decode_tokens_per_s(d)
                                                                 for d in roof.per_dtype},
                                  "weight_bytes_per_token": file_bytes,
                                  "read_bandwidth_gb_s": roof.read_bandwidth / 1e9,
                                  "batch1_bound_tokens_per_s": bound, "kernels": kernels})


# -- the parser -----------------------------------------------------------------------------------------
def _ints(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def _kv_cache_dtypes(text: str) -> list[str]:
    values = text.split(",")
    if not set(values) <= set(KV_CACHE_DTYPES):
        raise argparse.ArgumentTypeError(f"expected comma-separated values of {', '.join(KV_CACHE_DTYPES)}, "
                                         f"got {text!r}")
    return values


def _dtypes(text: str) -> tuple[str, ...]:
    names = tuple(text.split(","))
    if not set(names) <= {"bfloat16", "float32", "float16"}:
        raise argparse.ArgumentTypeError(f"expected dtypes among bfloat16, float32, float16; got {text!r}")
    return names


def cmd_scheduling(args: argparse.Namespace) -> None:
    from minivllm.bench.scheduling import run_chunked_prefill, run_fair, table

    config = EngineConfig.from_cli_args(args)
    corpus = TextCorpus(load_tokenizer(config.model)[0])
    progress = not args.disable_tqdm
    rows = []
    if args.scenario in ("chunked-prefill", "all"):
        rows += run_chunked_prefill(config, corpus, args.seed, args.chunk_budget, args.output_dir, progress,
                                    args.long_len, args.num_streams, args.stream_output_len,
                                    args.long_prefill_thresholds)
    if args.scenario in ("fair", "all"):
        rows += run_fair(config, corpus, args.seed, args.output_dir, progress)
    print(table(rows))
    write_json(args.output_json, {"engine": asdict(config), "rows": [asdict(r) for r in rows]})


def cmd_startup(args: argparse.Namespace) -> None:
    from minivllm.bench.startup import run_startup, startup_json, startup_table

    runs = run_startup(args.cases, args.model, args.num_runs, args.num_cold_runs)
    print(startup_table(runs))
    write_json(args.output_json, startup_json(runs))


def cmd_kernels(args: argparse.Namespace) -> None:
    from minivllm.bench.kernels import (decode_attention, format_timings, layer_op_timings, linears,
                                        prefill_attention, quantized_linears)
    from minivllm.model.loader import load_checkpoint, resolve_model_path

    model_config, _ = load_checkpoint(resolve_model_path(args.model))
    timings = [*linears(model_config, args.rows), *quantized_linears(model_config, args.rows),
               *(decode_attention(model_config, n, args.context, kv_cache_dtype=kv)
                 for kv in args.kv_cache_dtype for n in args.num_seqs),
               *(prefill_attention(model_config, n, kv_cache_dtype=kv)
                 for kv in args.kv_cache_dtype for n in args.prefill_tokens),
               *layer_op_timings(model_config, args.op_rows)]
    print(format_timings(timings))
    write_json(args.output_json, {"timings": [{**asdict(t), "speedup": t.speedup} for t in timings]})


# -- quality --------------------------------------------------------------------------------------------
def cmd_quality(args: argparse.Namespace) -> None:
    from minivllm.bench.quality import parse_overrides, run_quality

    candidate = EngineConfig.from_cli_args(args)
    reference = replace(candidate, **parse_overrides(args.reference))
    result = run_quality(candidate, reference, Path(args.text).read_text(), args.chunk_len, args.num_tokens)
    print(result.text())
    write_json(args.output_json, {**asdict(result), "ppl_rel_diff": result.ppl_rel_diff, "text": args.text})


def add_bench_parser(sub: argparse._SubParsersAction) -> None:
    bench = sub.add_parser("bench", help="benchmarks: throughput, latency, serve, compare, scheduling, startup, "
                                         "kernels, roofline, quality; simulate, calibrate")
    bench_sub = bench.add_subparsers(dest="bench_command", required=True)

    p = bench_sub.add_parser("throughput", help="offline throughput of a workload (minivllm or --backend hf)")
    add_workload_args(p)
    p.add_argument("--backend", choices=("minivllm", "hf"), default="minivllm",
                   help="hf: Hugging Face transformers generate() on static, left-padded batches")
    p.add_argument("--hf-batch-size", type=int, default=16, help="batch size of --backend hf")
    p.add_argument("--structured-output-ratio", type=float, default=0.0,
                   help="share of requests constrained by a JSON schema (structured outputs), the rest "
                        "unconstrained in the same run (default: 0)")
    p.add_argument("--temperature", type=float, default=0.0,
                   help="sample at this temperature, each request with its own seed (the workload's seed plus "
                        "its index), instead of greedy: seeded outputs are compared like greedy ones")
    p.add_argument("--roofline", action="store_true",
                   help="also measure this machine's roofline and report the run as a share of it")
    add_output_args(p)
    EngineConfig.add_cli_args(p, skip=("seed",))
    p.set_defaults(func=cmd_throughput)

    p = bench_sub.add_parser("latency", help="latency of one batch, and its decode step time and phases")
    p.add_argument("--batch-size", type=int, default=8, help="requests in the batch (default: 8)")
    p.add_argument("--input-len", type=int, default=32, help="prompt tokens per request (default: 32)")
    p.add_argument("--output-len", type=int, default=128, help="tokens generated per request (default: 128)")
    p.add_argument("--num-iters-warmup", type=int, default=1, help="batches run first and not timed (default: 1)")
    p.add_argument("--num-iters", type=int, default=3, help="timed batches; the mean is reported (default: 3)")
    add_output_args(p, progress=False)
    EngineConfig.add_cli_args(p)
    p.set_defaults(func=cmd_latency)

    p = bench_sub.add_parser("prefill", help="time to first token and prefill rate as the context grows, "
                             "against the machine's peaks and llama-bench")
    p.add_argument("--input-lens", type=_ints, default=[1024, 2048, 4096, 8192, 16384],
                   help="comma-separated prompt lengths (default: 1024,2048,4096,8192,16384)")
    p.add_argument("--num-iters", type=int, default=1, help="runs per length; the best is reported (default: 1)")
    p.add_argument("--llama-bench", default=None, metavar="PATH",
                   help="llama.cpp's llama-bench binary: run -p N -n 0 on the same GGUF file at each length")
    p.add_argument("--llama-bench-fa", default="0,1", choices=("0,1", "0", "1"),
                   help="llama-bench's flash attention settings; the best is reported (default: 0,1)")
    p.add_argument("--plot", default=None, metavar="PNG", help="draw tokens/s against the context (both engines)")
    add_output_args(p, progress=False)
    EngineConfig.add_cli_args(p)
    p.set_defaults(func=cmd_prefill)

    p = bench_sub.add_parser("serve", help="online benchmark against an OpenAI-compatible server")
    p.add_argument("--base-url", required=True, help="e.g. http://127.0.0.1:8000")
    p.add_argument("--served-model-name", default=None, help="the request's model field (default: /v1/models' first)")
    p.add_argument("--api-key", default=None)
    p.add_argument("--model", default=None, help="checkpoint whose tokenizer builds the prompts (default: SmolLM2)")
    add_workload_args(p)
    p.add_argument("--request-rate", type=rate, default=math.inf,
                   help="requests/s of the arrival process (default: inf, all at once)")
    p.add_argument("--burstiness", type=float, default=1.0,
                   help="gamma shape of the inter-arrival times: 1 is Poisson, < 1 burstier, > 1 more regular")
    p.add_argument("--max-concurrency", type=int, default=None, help="most requests in flight at once")
    p.add_argument("--api", choices=("completions", "messages", "responses"), default="completions",
                   help="messages, responses: replay --dataset agent as an agent's turns over that API (tool "
                        "schemas, tool results between turns), --num-prefixes conversations of "
                        "--num-prompts / --num-prefixes turns; per-turn TTFT, TPOT and cached-token share")
    p.add_argument("--lora-modules", nargs="+", default=None, metavar="NAME",
                   help="LoRA adapters taken in turn, request by request (the probe request runs on the base)")
    p.add_argument("--lora-field", choices=("model", "lora"), default="model",
                   help="how a request names its adapter: the model field (vLLM, minivllm), or llama-server's "
                        '"lora": [{"id": NAME, "scale": 1}] with NAME its adapter index')
    p.add_argument("--goodput", nargs="+", default=None, metavar="NAME:MS",
                   help="SLOs for goodput, e.g. ttft:500 tpot:50 e2el:5000 (milliseconds)")
    p.add_argument("--metric-percentiles", default="90,99", help="comma-separated percentiles to report")
    p.add_argument("--compare-to", default=None, metavar="JSON",
                   help="another run's --output-json on the same workload: say whether every output is the same "
                        "text (greedy_exact), e.g. with and without speculative decoding")
    add_output_args(p)
    p.set_defaults(func=cmd_serve)

    p = bench_sub.add_parser("compare", help="static vs continuous batching on one arrival trace")
    add_trace_args(p)
    p.add_argument("--with-hf", action="store_true", help="also run Hugging Face transformers on static batches")
    p.add_argument("--hf-batch-size", type=int, default=None, help="default: --static-batch-size")
    p.add_argument("--output-dir", default="runs/compare", help="report.md, plots, step traces, results.json")
    add_output_args(p)
    EngineConfig.add_cli_args(p, skip=("seed", "scheduler", "trace_file"))
    p.set_defaults(func=cmd_compare)

    p = bench_sub.add_parser("scheduling", help="chunked prefill and fair-share trade-offs on the real model")
    p.add_argument("--scenario", choices=("chunked-prefill", "fair", "all"), default="all")
    p.add_argument("--chunk-budget", type=int, default=256, help="max_num_batched_tokens of the chunked run")
    p.add_argument("--long-len", type=int, default=2048, help="prompt tokens of the long request (default: 2048)")
    p.add_argument("--num-streams", type=int, default=16, help="requests decoding when it arrives (default: 16)")
    p.add_argument("--stream-output-len", type=int, default=160,
                   help="tokens each stream generates: enough to outlive the long prefill (default: 160)")
    p.add_argument("--long-prefill-thresholds", type=_ints, default=None,
                   help="comma-separated caps on the long prompt's chunk, one chunked run each "
                        "(default: half the chunk budget)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output-dir", default="runs/scheduling", help="step traces of every run")
    add_output_args(p)
    EngineConfig.add_cli_args(p, skip=("seed", "trace_file", "enable_chunked_prefill", "scheduling_policy"))
    p.set_defaults(func=cmd_scheduling)

    p = bench_sub.add_parser("startup", help="wall time and peak RSS of generate, LLM() and serve, each in a fresh "
                                             "process, with warm and cold caches")
    p.add_argument("--cases", nargs="+", choices=("generate", "llm", "serve"), default=["generate", "llm", "serve"])
    p.add_argument("--num-runs", type=int, default=5, help="runs per case with warm caches")
    p.add_argument("--num-cold-runs", type=int, default=1, help="runs per case with an empty cache directory")
    p.add_argument("--model", default=None, help="GGUF file or checkpoint directory (default: SmolLM2)")
    add_output_args(p, progress=False)
    p.set_defaults(func=cmd_startup)

    p = bench_sub.add_parser("kernels", help="the CPU fast paths (bf16) against the torch code they replace")
    p.add_argument("--model", default=None, help="checkpoint whose shapes are measured (default: SmolLM2)")
    p.add_argument("--rows", type=_ints, default=[1, 4, 8, 16, 64], help="token rows of the layer GEMMs")
    p.add_argument("--num-seqs", type=_ints, default=[1, 64], help="sequences of the decode attention")
    p.add_argument("--context", type=int, default=300, help="tokens already cached per sequence")
    p.add_argument("--prefill-tokens", type=_ints, default=[512, 2048], help="prompt lengths of the prefill attention")
    p.add_argument("--op-rows", type=_ints, default=[1, 64, 2048], help="token rows of the fused layer ops")
    p.add_argument("--kv-cache-dtype", type=_kv_cache_dtypes, default=["auto"],
                   help="KV cache formats the attention runs on, e.g. auto,int8,fp8")
    add_output_args(p, progress=False)
    p.set_defaults(func=cmd_kernels)

    p = bench_sub.add_parser("quality", help="teacher-forced perplexity and top-1 agreement of an engine setting "
                                             "(e.g. --kv-cache-dtype int8) against a reference setting")
    p.add_argument("--reference", nargs="+", default=["kv_cache_dtype=auto"], metavar="NAME=VALUE",
                   help="engine flags that make the reference from the candidate (default: kv_cache_dtype=auto)")
    p.add_argument("--text", default=str(DEFAULT_TEXT), help="held-out prose to score (default: the shipped text)")
    p.add_argument("--chunk-len", type=int, default=512, help="tokens per teacher-forced chunk")
    p.add_argument("--num-tokens", type=int, default=None, help="score only the first N tokens (default: all)")
    add_output_args(p, progress=False)
    EngineConfig.add_cli_args(p)
    p.set_defaults(func=cmd_quality)

    p = bench_sub.add_parser("roofline", help="this machine's GEMM rate, read bandwidth and the model's roofline")
    p.add_argument("--model", default=None, help="checkpoint whose layer shapes are measured (default: SmolLM2)")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    p.add_argument("--num-tokens", type=int, default=512, help="tokens per GEMM (the batch of a step)")
    p.add_argument("--dtypes", type=_dtypes, default=("bfloat16", "float32"),
                   help="comma-separated dtypes to measure (default: bfloat16,float32)")
    add_output_args(p, progress=False)
    p.set_defaults(func=cmd_roofline)

    from minivllm.bench.simulate_cli import add_simulate_parsers
    add_simulate_parsers(bench_sub)
