"""Benchmarks (`minivllm bench ...`): the numbers behind "static batching is not enough".

    throughput  offline tokens/s of a workload, minivllm or Hugging Face transformers (--backend hf)
    serve       online latency (TTFT, TPOT, ITL, E2E) and goodput against any OpenAI-compatible server
    compare     one arrival trace through static and continuous batching: report, plots, step traces
    roofline    this machine's GEMM rate and read bandwidth, and the model's tokens/s ceilings

The reference workload is `--dataset fixed`: 64 requests, seed 0, prompts of 16..512 tokens of real
English text, outputs of 8..256 tokens, greedy, ignore_eos.
"""
