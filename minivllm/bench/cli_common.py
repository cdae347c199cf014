"""What the bench commands (cli.py) and the simulator's (simulate_cli.py) share: the output and arrival
trace flags, the JSON results file, and the compare report's description of its run."""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from minivllm.bench.workloads import parse_range
from minivllm.config import EngineConfig


def write_json(path: str | None, result: dict) -> None:
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(result, indent=2, default=str) + "\n")
        print(f"Results written to {path}")


def dtype_name(config: EngineConfig) -> str:
    return str(config.torch_dtype).removeprefix("torch.")


def describe_compare(args: argparse.Namespace, config: EngineConfig, requests: list) -> tuple[str, str]:
    """(the workload, the systems' setup) in a sentence each, for the report."""
    n_long = sum(r.kind == "long" for r in requests)
    workload = (f"{len(requests)} requests ({n_long} long, {len(requests) - n_long} short), arrivals at "
                f"{args.request_rate} req/s (burstiness {args.burstiness}), seed {args.seed}; short: prompts "
                f"{span(args.short_input_len)}, outputs {span(args.short_output_len)} tokens; long: prompts "
                f"{span(args.long_input_len)}, outputs {span(args.long_output_len)} tokens; greedy, ignore_eos; "
                f"prompts cut from the Python docs' prose")
    setup = (f"model {config.model or 'SmolLM2-135M-Instruct (default GGUF)'}, device {config.torch_device}, dtype "
             f"{dtype_name(config)}; static batch size {args.static_batch_size}"
             + (f", hf batch size {args.hf_batch_size or args.static_batch_size}" if args.with_hf else "")
             + f"; continuous: max_num_seqs {config.max_num_seqs}, max_num_batched_tokens "
               f"{config.max_num_batched_tokens}, chunked prefill {config.enable_chunked_prefill}; "
               f"the whole engine config is in results.json")
    return workload, setup


def span(bounds: tuple[int, int], sep: str = "..") -> str:
    return f"{bounds[0]}{sep}{bounds[1]}"


def add_output_args(p: argparse.ArgumentParser, progress: bool = True) -> None:
    p.add_argument("--output-json", default=None, help="write the results (and the workload) to this JSON file")
    if progress:
        p.add_argument("--disable-tqdm", action="store_true", help="no progress bars")


def rate(text: str) -> float:
    rate = float(text)
    if not rate > 0:  # inf is welcome: everything at once
        raise argparse.ArgumentTypeError(f"must be > 0 or inf, got {text!r}")
    return rate


def add_trace_args(p: argparse.ArgumentParser) -> None:
    """bench compare's arrival trace of short and long requests (bench simulate takes it too)."""
    g = p.add_argument_group("arrival trace")
    g.add_argument("--num-prompts", type=int, default=48)
    g.add_argument("--request-rate", type=rate, default=2.0, help="requests/s (Poisson at burstiness 1)")
    g.add_argument("--burstiness", type=float, default=1.0)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--long-fraction", type=float, default=0.25, help="share of long requests")
    g.add_argument("--short-input-len", type=parse_range, default=(16, 128), metavar="MIN:MAX")
    g.add_argument("--short-output-len", type=parse_range, default=(8, 64), metavar="MIN:MAX")
    g.add_argument("--long-input-len", type=parse_range, default=(256, 512), metavar="MIN:MAX")
    g.add_argument("--long-output-len", type=parse_range, default=(128, 256), metavar="MIN:MAX")
