"""Tensor parallel on CPU with gloo: greedy fp32 outputs of TP=N equal TP=1 token for token, with
chunked prefill and preemption, on the default model (TP=3: 9 query / 3 KV heads) and on a small
random Llama checkpoint (8 query / 2 KV heads: TP=2 splits the KV heads, TP=4 replicates them);
the head-count refusal, a torchrun launch, a dying worker, no process left behind."""
from __future__ import annotations

import multiprocessing
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from minivllm import LLM
from minivllm.distributed.group import TensorParallelError
from tests.helpers import LONG_PROMPT, assert_idle, greedy

# A 32-token step budget chunks every prompt; a pool of 6-9 blocks makes the batch preempt.
TIGHT = dict(dtype="float32", max_num_batched_tokens=32, block_size=16)


def generate_tight(llm: LLM, prompts: list[Any], num_tokens: int) -> list[list[int]]:
    outs = llm.generate(prompts, greedy(num_tokens), use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def close_without_leaks(llm: LLM, threads: int) -> None:
    """Close: every worker exits 0, none is left, and this process has its torch threads back."""
    workers = llm.engine.runner.group.workers
    assert_idle(llm.engine)
    llm.engine.close()
    assert [p.exitcode for p in workers] == [0] * len(workers)
    assert multiprocessing.active_children() == []
    assert torch.get_num_threads() == threads


def test_tp2_on_the_default_model_is_refused_naming_the_head_counts() -> None:
    with pytest.raises(ValueError, match=r"tensor_parallel_size 2 does not divide the model's 9 attention heads "
                                         r"\(3 KV heads\)"):
        LLM(dtype="float32", tensor_parallel_size=2)
    assert multiprocessing.active_children() == []  # refused before any worker started


def test_tp3_default_model_equals_tp1(llm: LLM) -> None:
    prompts = [LONG_PROMPT[:200], "The capital of France is", "Write a haiku about the sea:"]
    reference = generate_tight(llm, prompts, 16)  # TP=1, unchunked: the kernels are batch-invariant
    threads = torch.get_num_threads()
    # Dequantized, as the reference `llm`: float32 shards sum to TP=1's numbers up to rounding. (Kept
    # quantized, the shards are the file's blocks exactly (test below), but each rank re-quantizes its
    # activations per 32 k after the all_reduce, which turns a last-bit difference into a different int8
    # now and then: greedy outputs agree on a few tokens, then may part.)
    tp = LLM(tensor_parallel_size=3, num_kv_blocks=6, max_model_len=96, quantization="none", **TIGHT)
    assert tp.engine.model_config.num_attention_heads == 9  # the engine sees the whole model ...
    assert tp.engine.runner.model.config.num_attention_heads == 3  # ... rank 0 holds 3 heads, 1 KV head
    assert generate_tight(tp, prompts, 16) == reference
    assert tp.engine.scheduler.num_preemptions > 0
    close_without_leaks(tp, threads)


def test_quantized_shards_are_the_blocks_of_the_whole(default_model_path: Path) -> None:
    """A GGUF's quantized weights cut with narrow (rows, or columns at block boundaries) dequantize to
    the same slice of the dequantized whole, for every rank at TP=3."""
    from minivllm.distributed.sharding import ShardPlan, shard_weights
    from minivllm.model.loader import load_checkpoint
    from minivllm.model.quant import QuantizedTensor

    config, weights = load_checkpoint(default_model_path, torch.float32, keep_quantized=True)
    whole = {name: t for name, t in weights if ".layers.0." in name or ".layers.29." in name}
    for rank in range(3):
        cuts = ShardPlan.of(config, rank, 3).cuts()
        shards = dict(shard_weights(whole.items(), config, rank, 3))
        quantized = [name for name, t in whole.items() if isinstance(t, QuantizedTensor)]
        assert len(quantized) == 14
        for name in quantized:
            dim, (start, length) = cuts[name.split(".")[-2]]
            assert torch.equal(shards[name].dequantize(), whole[name].dequantize().narrow(dim, start, length)), name


# -- a small random Llama: 8 query heads, 2 KV heads ----------------------------------------------------
@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path) -> Path:
    from transformers import AutoModelForCausalLM, LlamaConfig

    path = tmp_path_factory.mktemp("tiny-llama-8q2kv")
    config = LlamaConfig(vocab_size=49152, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=512,
                         tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # large random weights: logits far apart, RoPE and attention matter
        for name, param in model.named_parameters():
            param.uniform_(0.5, 1.5) if "norm" in name else param.normal_(0.0, 0.2)
    model.save_pretrained(path)
    shutil.copytree(tokenizer_dir, path, dirs_exist_ok=True)
    return path


TINY_PROMPTS = [list(range(100 + 7 * i, 160 + 7 * i)) for i in range(4)]  # 60 tokens each


TEXT_PROMPT = "Tensor parallel across two processes"


@pytest.fixture(scope="module")
def tiny_reference(tiny_llama: Path) -> tuple[list[list[int]], str]:
    """TP=1's greedy outputs: token ids of TINY_PROMPTS, and the text of TEXT_PROMPT."""
    tp1 = LLM(model=str(tiny_llama), num_kv_blocks=64, **TIGHT)
    tokens = generate_tight(tp1, TINY_PROMPTS, 20)
    text = tp1.generate(TEXT_PROMPT, greedy(12), use_tqdm=False)[0].outputs[0].text
    tp1.engine.close()
    return tokens, text


def test_tp2_small_llama_equals_tp1(tiny_llama: Path, tiny_reference: tuple[list[list[int]], str]) -> None:
    """TP=2: 4 query heads and 1 KV head per rank (TP=4, which replicates the KV heads, runs over Ray in
    test_ray.py: the same shards, its workers placed by Ray)."""
    threads = torch.get_num_threads()
    tp = LLM(model=str(tiny_llama), tensor_parallel_size=2, num_kv_blocks=9, **TIGHT)
    assert (tp.engine.runner.model.config.num_attention_heads, tp.engine.runner.model.config.num_key_value_heads) \
        == (4, 1)
    assert generate_tight(tp, TINY_PROMPTS, 20) == tiny_reference[0]
    assert tp.engine.scheduler.num_preemptions > 0
    close_without_leaks(tp, threads)


def test_a_dying_worker_ends_the_engine_with_a_clear_error(tiny_llama: Path) -> None:
    tp = LLM(model=str(tiny_llama), tensor_parallel_size=2, num_kv_blocks=16, **TIGHT)
    worker = tp.engine.runner.group.workers[0]
    worker.kill()
    worker.join()
    with pytest.raises(TensorParallelError, match=r"rank 1 exited with code -9"):
        tp.generate([TINY_PROMPTS[0]], greedy(4), use_tqdm=False)
    with pytest.raises(TensorParallelError, match="failed earlier"):
        tp.engine.runner.execute(None)
    tp.engine.close()
    assert multiprocessing.active_children() == []


def test_torchrun_two_processes_on_localhost(tiny_llama: Path, tiny_reference: tuple[list[list[int]], str]) -> None:
    """`torchrun --nproc-per-node 2 -m minivllm.cli generate ... --tensor-parallel-size 2`: rank 0 runs
    the command, rank 1 serves steps until rank 0 closes the engine; both exit 0."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    run = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
         "--master-port", str(port), "-m", "minivllm.cli", "generate", TEXT_PROMPT, "--model", str(tiny_llama),
         "--tensor-parallel-size", "2", "--dtype", "float32", "--num-kv-blocks", "16", "--max-tokens", "12",
         "--min-tokens", "12", "--ignore-eos", "--temperature", "0"],
        capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=300,
        cwd=Path(__file__).parents[1])
    assert run.returncode == 0, run.stdout + run.stderr
    assert run.stdout.endswith(tiny_reference[1] + "\n"), run.stdout

