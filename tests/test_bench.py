"""The benchmark suite: metric definitions on hand-made timestamps, workloads on the real tokenizer,
and every `minivllm bench` command end to end on a workload of seconds (the real default model;
`bench serve` against a real `minivllm serve` process). Speed itself is never asserted."""
from __future__ import annotations

import json
import math
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch

from minivllm.bench.compare import (batch_decay, batch_size, behind_long, mean_batch, padding_waste,
                                    slot_occupancy, static_batches)
from minivllm.bench.hf_backend import BatchRun
from minivllm.bench.metrics import Distribution, RequestRecord, count_good, parse_goodput, serving_metrics, tpot
from minivllm.bench.workloads import (BenchRequest, TextCorpus, arrival_offsets, build_workload, load_tokenizer,
                                      range_around, workload_spec)
from minivllm.cli import build_parser, main
from minivllm.outputs import RequestMetrics
from minivllm.tracing.trace import StepRow

TINY = ["--dataset", "random", "--num-prompts", "4", "--input-len-range", "16:48", "--output-len-range", "4:8",
        "--disable-tqdm"]


def record(ttft: float, token_gaps: list[float], prompt_len: int = 10) -> RequestRecord:
    """A request whose first token came at `ttft` and each next one `gap` later (seconds)."""
    m = RequestMetrics(arrival_time=100.0, first_scheduled_time=100.0, first_token_time=100.0 + ttft)
    m.token_times = [100.0 + ttft]
    for gap in token_gaps:
        m.token_times.append(m.token_times[-1] + gap)
    m.finished_time = m.token_times[-1]
    return RequestRecord.from_metrics(m, prompt_len, len(m.token_times))


# -- metric definitions ---------------------------------------------------------------------------------
def test_request_metrics_follow_vllm_definitions():
    m = RequestMetrics(arrival_time=10.0, first_scheduled_time=10.5, first_token_time=11.0,
                       token_times=[11.0, 11.2, 11.6, 12.0], finished_time=12.0)
    r = RequestRecord.from_metrics(m, prompt_len=7, output_len=4)
    assert r.queue_time == pytest.approx(0.5)
    assert r.ttft == pytest.approx(1.0)
    assert r.e2e == pytest.approx(2.0)
    assert r.tpot == pytest.approx((2.0 - 1.0) / 3)  # (E2E - TTFT) / (output tokens - 1)
    assert r.itl == pytest.approx([0.2, 0.4, 0.4])
    assert tpot(e2e=1.0, ttft=1.0, output_len=1) is None  # undefined for one token, as in vLLM


def test_distribution_uses_linear_percentiles_in_ms():
    d = Distribution.of([i / 1000 for i in range(1, 101)], (90, 99))  # 1..100 ms
    assert d.mean == pytest.approx(50.5)
    assert d.median == pytest.approx(50.5)
    assert d.percentiles[90] == pytest.approx(90.1)
    assert d.percentiles[99] == pytest.approx(99.01)
    assert d.p(50) == d.median
    empty = Distribution.of([], (99,))
    assert (empty.mean, empty.percentiles[99]) == (0.0, 0.0)


def test_serving_metrics_throughput_itl_and_goodput():
    fast = record(0.1, [0.02, 0.02, 0.02])  # TPOT 20 ms, E2E 160 ms
    slow = record(0.5, [0.1, 0.1])  # TPOT 100 ms, E2E 700 ms
    single = record(0.2, [])  # one token: no TPOT
    failed = RequestRecord(prompt_len=10, output_len=0, ttft=0.0, e2e=0.0, success=False, error="boom")
    m = serving_metrics([fast, slow, single, failed], duration=2.0, slos_ms={"ttft": 300, "tpot": 50})
    assert (m.completed, m.failed) == (3, 1)
    assert m.total_input == 30 and m.total_output == 4 + 3 + 1
    assert m.request_throughput == pytest.approx(1.5)
    assert m.output_throughput == pytest.approx(4.0)
    assert m.total_token_throughput == pytest.approx(19.0)
    assert m.ttft_ms.mean == pytest.approx((100 + 500 + 200) / 3)
    assert m.tpot_ms.mean == pytest.approx((20 + 100) / 2)  # the single-token request is left out
    assert m.itl_ms.mean == pytest.approx((20 * 3 + 100 * 2) / 5)  # ITLs pooled over requests
    assert m.e2el_ms.median == pytest.approx(200)
    # fast and single meet ttft <= 300 ms and tpot <= 50 ms (single's TPOT counts as 0); slow does not.
    assert m.request_goodput == pytest.approx(2 / 2.0)
    assert count_good([fast, slow, single], {"e2el": 170}) == 1
    assert serving_metrics([fast], 1.0).request_goodput is None


def test_parse_goodput():
    assert parse_goodput(["ttft:500", "tpot:50", "e2el:1e4"]) == {"ttft": 500.0, "tpot": 50.0, "e2el": 10000.0}
    for bad in (["itl:5"], ["ttft"], ["ttft:fast"], ["ttft:-1"]):
        with pytest.raises(ValueError, match="goodput"):
            parse_goodput(bad)


def test_arrivals_poisson_gamma_and_all_at_once():
    assert arrival_offsets(5, math.inf, 1.0, np.random.default_rng(0)) == [0.0] * 5
    times = arrival_offsets(20000, 4.0, 1.0, np.random.default_rng(0))
    gaps = np.diff(times)
    assert times[0] == 0.0 and (gaps > 0).all()
    assert gaps.mean() == pytest.approx(0.25, rel=0.05)  # rate 4/s
    assert gaps.std() / gaps.mean() == pytest.approx(1.0, rel=0.05)  # exponential: CV 1
    bursty = np.diff(arrival_offsets(20000, 4.0, 0.25, np.random.default_rng(0)))
    assert bursty.mean() == pytest.approx(0.25, rel=0.1)  # same rate...
    assert bursty.std() / bursty.mean() == pytest.approx(2.0, rel=0.1)  # ...burstier: CV 1/sqrt(shape)
    assert arrival_offsets(50, 4.0, 1.0, np.random.default_rng(7)) == arrival_offsets(50, 4.0, 1.0,
                                                                                     np.random.default_rng(7))


def test_length_ranges():
    assert range_around(100, 0.5) == (50, 150)
    assert range_around(100, 0.0) == (100, 100)
    with pytest.raises(ValueError):
        range_around(100, 1.0)
    args = build_parser().parse_args(["bench", "throughput", "--dataset", "random", "--input-len", "200",
                                      "--range-ratio", "0.25", "--output-len-range", "8:16"])
    spec = workload_spec(args)
    assert spec["input_len_range"] == (150, 250) and spec["output_len_range"] == (8, 16)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["bench", "throughput", "--input-len-range", "50:10"])


# -- static-batching analysis on a hand-made step trace -------------------------------------------------
def row(step: int, prefill: int, decode: int, padding: int, running: int, finished: int) -> StepRow:
    return StepRow(step, step - 1.0, float(step), prefill + decode + padding, prefill, decode, padding, running, 0,
                   0, 0, 0, finished)


def test_static_batch_waste_occupancy_and_decay():
    # A batch of 4 with prompts 10, 10, 5, 5 (padded to 10); outputs 1, 2, 3, 3 tokens.
    rows = [row(1, 30, 0, 10, running=3, finished=1),
            row(2, 0, 3, 1, running=2, finished=1),
            row(3, 0, 2, 2, running=0, finished=2),
            # the next batch: one request alone, output 2
            row(4, 8, 0, 0, running=1, finished=0), row(5, 0, 1, 0, running=0, finished=1)]
    assert padding_waste(rows) == pytest.approx(13 / 57)
    assert slot_occupancy(rows) == pytest.approx((3 + 2 + 1) / (4 + 4 + 1))
    assert [len(b) for b in static_batches(rows)] == [3, 2]
    assert mean_batch(rows) == pytest.approx((4 + 3 + 2 + 1 + 1) / 5)  # steps of equal length
    # First batch: 4/4, 3/4, 2/4 through its steps; second: 1/1, 1/1.
    decay = batch_decay(rows)
    assert decay[0] == pytest.approx(1.0) and decay[-1] == pytest.approx((2 / 4 + 1) / 2)
    continuous = [row(1, 40, 0, 0, 4, 0), row(2, 0, 4, 0, 4, 0)]
    assert padding_waste(continuous) == 0.0 and slot_occupancy(continuous) == 1.0


def test_head_of_line_requests_are_chosen_from_the_trace():
    kinds = ["short", "long", "short", "short", "long", "long", "short"]
    arrivals = [0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0]
    reqs = [BenchRequest(str(i), "", [1], 1, arrival=a, kind=k) for i, (k, a) in enumerate(zip(kinds, arrivals))]
    assert behind_long(reqs) == [2, 6]
    assert behind_long(list(reversed(reqs))) == [4, 0]  # by arrival, not by list order


def test_hf_static_batch_timing_and_rows():
    reqs = [BenchRequest("a", "", [5] * 3, 1), BenchRequest("b", "", [5] * 6, 3)]
    run = BatchRun(reqs, start=10.0, step_times=[11.0, 11.5, 12.0])
    ma, mb = run.metrics([9.0, 9.5])
    assert (ma.ttft, ma.e2e, ma.token_times) == (2.0, 2.0, [11.0])  # "a" ends at its own last token
    assert (mb.ttft, mb.e2e, mb.queue_time) == (1.5, 2.5, 0.5)
    rows = run.rows(t0=9.0, first_step=1, waiting_arrivals=[11.2, 12.5])
    assert [r.num_scheduled_tokens for r in rows] == [12, 2, 2]  # padded prefill, then both slots
    assert [r.num_padding_tokens for r in rows] == [3, 1, 1]  # prompt padding, then a's idle slot
    assert [batch_size(r) for r in rows] == [2, 1, 1]
    assert [r.num_waiting for r in rows] == [0, 1, 1]
    assert rows[0].t_start == 1.0 and rows[-1].t_end == 3.0


# -- workloads on the real tokenizer --------------------------------------------------------------------
@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(None)[0]


def test_prompts_are_real_text_of_the_exact_length(tokenizer):
    corpus = TextCorpus(tokenizer)
    rng = np.random.default_rng(0)
    for length in (16, 100, 512):
        text, ids = corpus.window(length, rng)
        assert len(ids) == length and tokenizer.encode(text) == ids
        assert sum(c.isalpha() for c in text) > len(text) / 2  # prose, not token soup


def test_fixed_preset_and_seeds(tokenizer):
    spec = workload_spec(build_parser().parse_args(["bench", "throughput", "--dataset", "fixed"]))
    assert spec == {"dataset": "fixed", "num_prompts": 64, "seed": 0, "input_len_range": (16, 512),
                    "output_len_range": (8, 256)}
    reqs = build_workload(spec, tokenizer, np.random.default_rng(0))
    assert len(reqs) == 64
    assert all(16 <= r.prompt_len <= 512 and 8 <= r.output_len <= 256 for r in reqs)
    assert np.std([r.prompt_len for r in reqs]) > 50  # spread over the range, not one length
    small = dict(spec, num_prompts=8)
    again = build_workload(small, tokenizer, np.random.default_rng(0))
    assert [(r.prompt_token_ids, r.output_len) for r in again] == [(r.prompt_token_ids, r.output_len)
                                                                  for r in reqs[:8]]
    other = build_workload(dict(small, seed=1), tokenizer, np.random.default_rng(1))
    assert [r.prompt_token_ids for r in other] != [r.prompt_token_ids for r in again]


def test_shared_prefix_and_jsonl_workloads(tokenizer, tmp_path):
    args = build_parser().parse_args(["bench", "throughput", "--dataset", "shared-prefix", "--num-prompts", "4",
                                      "--prefix-len", "64", "--num-prefixes", "2", "--input-len-range", "8:16"])
    reqs = build_workload(workload_spec(args), tokenizer, np.random.default_rng(0))
    assert reqs[0].prompt_token_ids[:64] == reqs[2].prompt_token_ids[:64] != reqs[1].prompt_token_ids[:64]
    assert all(72 <= r.prompt_len <= 80 for r in reqs)
    path = tmp_path / "prompts.jsonl"
    path.write_text('{"prompt": "Hello there", "output_len": 5}\n\n{"prompt": "Why is the sky blue?"}\n')
    args = build_parser().parse_args(["bench", "throughput", "--dataset", "jsonl", "--dataset-path", str(path),
                                      "--output-len", "9"])
    reqs = build_workload(workload_spec(args), tokenizer, np.random.default_rng(0))
    assert [(r.prompt, r.output_len) for r in reqs] == [("Hello there", 5), ("Why is the sky blue?", 9)]
    assert reqs[0].prompt_token_ids == tokenizer.encode("Hello there")


# -- the commands end to end ----------------------------------------------------------------------------
def run_json(tmp_path: Path, *argv: str) -> dict:
    out = tmp_path / "result.json"
    main(["bench", *argv, "--output-json", str(out)])
    return json.loads(out.read_text())


def test_throughput_end_to_end(tmp_path):
    res = run_json(tmp_path, "throughput", *TINY, "--num-kv-blocks", "64")
    r, requests = res["result"], res["requests"]
    assert r["backend"] == "minivllm" and r["num_requests"] == 4
    assert r["total_output_tokens"] == sum(q["output_len"] for q in requests)  # ignore_eos: every token
    assert r["total_input_tokens"] == sum(q["prompt_len"] for q in requests)
    assert all(16 <= q["prompt_len"] <= 48 for q in requests)
    assert r["total_tokens_per_s"] == pytest.approx(r["input_tokens_per_s"] + r["output_tokens_per_s"])


def test_throughput_hf_backend_runs_the_same_requests(tmp_path, tokenizer_dir):
    """On a tiny random Llama: the backend's batching and counting are under test here, not the model (transformers
    on the default model is the reference of test_hf_equality.py)."""
    from tests.helpers import save_tiny_model, tiny_config

    save_tiny_model(tiny_config("llama"), tmp_path / "tiny", tokenizer_dir)
    res = run_json(tmp_path, "throughput", *TINY, "--model", str(tmp_path / "tiny"), "--backend", "hf",
                   "--hf-batch-size", "2")
    r = res["result"]
    assert r["backend"] == "hf" and res["hf_batch_size"] == 2
    assert r["total_output_tokens"] == sum(q["output_len"] for q in res["requests"])
    assert r["output_tokens_per_s"] > 0


def test_latency_end_to_end(tmp_path):
    res = run_json(tmp_path, "latency", "--batch-size", "3", "--input-len", "20", "--output-len", "5",
                   "--num-iters", "2", "--num-iters-warmup", "1", "--num-kv-blocks", "64")
    r = res["result"]
    assert (r["batch_size"], r["input_len"], r["output_len"]) == (3, 20, 5) and len(r["latencies"]) == 2
    # The 60 prompt tokens fit one step, which also samples each first token: 4 decode steps per iteration.
    assert r["decode_steps"] == 2 * 4
    # The decode steps are timed inside each iteration's latency, so their total is a part of it.
    assert 0 < r["decode_step_ms"] * r["decode_steps"] <= sum(r["latencies"]) * 1000
    assert set(r["step_time_shares"]) == {"schedule", "prepare", "forward", "sample", "update"}
    assert sum(r["step_time_shares"].values()) == pytest.approx(1.0)
    # The prefill is the part of each latency before the decode steps; the default file's weights held
    # are its tensors (the tied Q8_0 embedding once, norms in the model dtype) within 5 %, and the process
    # held at least them.
    assert len(r["prefill_seconds"]) == 2 and r["prefill_tokens_per_s"] == pytest.approx(
        3 * 20 * 2 / sum(r["prefill_seconds"]))
    # Two rates: the decode step's, and the whole batch's (prefill included), which is below it.
    assert r["decode_tokens_per_s"] == pytest.approx(3 * 1000 / r["decode_step_ms"])
    assert r["batch_output_tokens_per_s"] == pytest.approx(3 * 5 * 2 / sum(r["latencies"]))
    assert r["batch_output_tokens_per_s"] < r["decode_tokens_per_s"]
    from minivllm.model.gguf_file import GGUFFile
    from minivllm.model.loader import default_model_path

    file_bytes = sum(t.nbytes for t in GGUFFile(default_model_path()).tensors)
    assert 0.95 * file_bytes <= r["weight_bytes_held"] <= 1.05 * file_bytes <= r["peak_rss_bytes"]


def test_kernels_end_to_end(tmp_path):
    res = run_json(tmp_path, "kernels", "--rows", "1,9", "--num-seqs", "2", "--context", "20", "--op-rows", "3",
                   "--prefill-tokens", "40", "--kv-cache-dtype", "auto,int8")
    what = [t["what"] for t in res["timings"]]
    four_bit = [w for w in what if w.endswith(", 4-bit")]  # the quantized GEMM, where the CPU has VNNI
    assert four_bit in ([], ["120 layer GEMMs x 1 rows, 4-bit", "120 layer GEMMs x 9 rows, 4-bit"])
    assert [w for w in what if w not in four_bit] == [
                    "120 layer GEMMs x 1 rows", "120 layer GEMMs x 9 rows",
                    "decode attention, 2 seqs x 20 tokens, 30 layers, KV auto",
                    "decode attention, 2 seqs x 20 tokens, 30 layers, KV int8",
                    "prefill attention, 1 prompt x 40 tokens, 30 layers, KV auto",
                    "prefill attention, 1 prompt x 40 tokens, 30 layers, KV int8",
                    "add + RMSNorm, 3 rows", "SiLU and mul, 3 rows", "RoPE on q and k, 3 rows"]
    assert all(t["torch_ms"] > 0 for t in res["timings"])
    for t in res["timings"]:
        if t["native_ms"] is not None:
            assert t["speedup"] == pytest.approx(t["torch_ms"] / t["native_ms"])


def test_quality_end_to_end(tmp_path, capsys):
    """Two chunks of the shipped prose, teacher-forced with an int8 KV cache against the fp32 one."""
    res = run_json(tmp_path, "quality", "--dtype", "float32", "--kv-cache-dtype", "int8", "--chunk-len", "64",
                   "--num-tokens", "128", "--num-kv-blocks", "16")
    assert res["num_tokens"] == 2 * 63 and res["chunk_len"] == 64
    assert res["candidate"]["kv_cache_dtype"] == "int8" and res["reference"]["kv_cache_dtype"] == "auto"
    assert 1 < res["reference_ppl"] < 1000 and 0.5 < res["top1_agreement"] <= 1
    assert res["ppl_rel_diff"] == pytest.approx(res["candidate_ppl"] / res["reference_ppl"] - 1)
    with pytest.raises(SystemExit):  # the CLI prints the error and exits 2
        run_json(tmp_path, "quality", "--reference", "no_such_flag=1")
    assert "reference: expected NAME=VALUE" in capsys.readouterr().err


def test_roofline_end_to_end(tmp_path):
    res = run_json(tmp_path, "roofline", "--num-tokens", "32", "--dtypes", "float32")
    f32 = res["per_dtype"]["float32"]
    # SmolLM2-135M: 30 layers of qkv (576x960), o (576x576), gate_up (576x3072), down (1536x576), and a
    # 576x49152 lm_head: the shapes come from the model code, the bytes from them.
    assert sorted((g["shape"]["name"], g["shape"]["count"]) for g in f32["body"]) == [
        ("down_proj", 30), ("gate_up_proj", 30), ("o_proj", 30), ("qkv_proj", 30)]
    assert f32["weight_bytes"] == 4 * (30 * (576 * 960 + 576 * 576 + 576 * 3072 + 1536 * 576) + 576 * 49152)
    assert res["read_bandwidth"] > 0
    assert res["batch1_decode_tokens_per_s"]["float32"] == pytest.approx(res["read_bandwidth"] / f32["weight_bytes"])
    # The file as stored: every tensor but the embedding, which is the tied LM head here, so all of them.
    from minivllm.model.gguf_file import GGUFFile

    tensors = GGUFFile(res["model"]).tensors
    assert "output.weight" not in {t.name for t in tensors}
    assert res["weight_bytes_per_token"] == sum(t.nbytes for t in tensors)
    assert res["read_bandwidth_gb_s"] == pytest.approx(res["read_bandwidth"] / 1e9)
    from minivllm.model.kernels import cpu_arch, report
    from minivllm.model.kernels import library as kernels_library

    assert res["kernels"] == {"float32": report(torch.device("cpu"), torch.float32)}  # the target and its kernels
    assert res["batch1_bound_tokens_per_s"] == pytest.approx(res["read_bandwidth"] / res["weight_bytes_per_token"])
    lib = kernels_library(cpu_arch())
    assert (res["tile_bf16_flops"] is not None) == (lib is not None and bool(lib.amx_tiles_ready()))


def test_prefill_end_to_end(tmp_path):
    """Two lengths with a plot: each point's work is the model's (SmolLM2: 30 layers of qkv 576x960, o
    576x576, gate_up 576x3072, down 1536x576 per token; QK^T and PV over the causal context, 9 heads of
    64), its rate its length over its TTFT, and the peaks are measured (the tiles' only where they run)."""
    png = tmp_path / "prefill.png"
    res = run_json(tmp_path, "prefill", "--input-lens", "48,96", "--plot", str(png), "--num-kv-blocks", "16")
    assert [p["input_len"] for p in res["points"]] == [48, 96]
    for p in res["points"]:
        n = p["input_len"]
        layers = 2 * n * 30 * (576 * 960 + 576 * 576 + 576 * 3072 + 1536 * 576)
        assert p["flops"] == layers + 4 * 9 * 64 * 30 * n * (n + 1) // 2
        assert p["tokens_per_s"] == pytest.approx(n / p["ttft_s"]) and p["llama_cpp_tokens_per_s"] is None
    from minivllm.model.kernels import amx_peak, cpu_arch, library

    lib = library(cpu_arch())
    peaks = res["peaks"]
    assert peaks["torch_matmul_flops"] > 0 and peaks["torch_matmul_dtype"] in ("bfloat16", "float32")
    tiles = lib is not None and lib.amx_tiles_ready()
    assert (peaks["tile_bf16_flops"] is not None) == (peaks["tile_int8_ops"] is not None) == tiles
    if tiles:  # the counts, not the rates (a timed ratio would be noise on a shared machine): int8 does
        # twice bf16's multiply-adds per tile product, four products a round on every thread
        peak, per_thread = amx_peak(torch.device("cpu")), 10 * 4 * 16 * 16 * 32 * 2
        threads = peak(1, 10) / per_thread
        assert threads == int(threads) and 1 <= threads <= os.cpu_count() and peak(0, 10) == 2 * peak(1, 10)
        assert peaks["tile_int8_ops"] > 0 and peaks["tile_bf16_flops"] > 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_compare_continuous_beats_static(tmp_path):
    out_dir = tmp_path / "compare"
    # Static batches of 2 run one after another to their longest member, while continuous batching
    # runs all 12 at once: a gap of several times in steps, which no noise on a shared machine hides.
    res = run_json(tmp_path, "compare", "--num-prompts", "12", "--request-rate", "50", "--long-fraction", "0.3",
                   "--short-input-len", "16:32", "--short-output-len", "2:6", "--long-input-len", "64:96",
                   "--long-output-len", "16:24", "--static-batch-size", "2", "--num-kv-blocks", "128",
                   "--output-dir", str(out_dir), "--disable-tqdm")
    s = {x["name"]: x for x in res["summaries"]}
    static, cont = s["static"], s["continuous"]
    assert cont["serving"]["total_token_throughput"] > static["serving"]["total_token_throughput"]
    assert cont["serving"]["ttft_ms"]["percentiles"]["99"] < static["serving"]["ttft_ms"]["percentiles"]["99"]
    assert static["padding_waste"] > 0 and cont["padding_waste"] == 0
    assert static["slot_occupancy"] < 1 and cont["slot_occupancy"] == 1
    assert static["batch_decay"][0] == 1 and static["batch_decay"][-1] < 1 and cont["batch_decay"] is None
    assert cont["queue_ms"]["mean"] < static["queue_ms"]["mean"]
    assert cont["serving"]["completed"] == static["serving"]["completed"] == 12
    assert cont["num_steps"] < static["num_steps"]
    for name in ("report.md", "occupancy.png", "ttft_cdf.png", "tokens_per_step.png", "static.csv",
                 "continuous.csv", "static.json", "continuous.json", "results.json"):
        assert (out_dir / name).stat().st_size > 0, name
    report = (out_dir / "report.md").read_text()
    assert "Padding waste" in report and "Head-of-line" in report
    header = (out_dir / "static.csv").read_text().splitlines()[0]
    assert header.startswith("step,t_start,t_end,num_scheduled_tokens")


# -- bench serve against a real server ------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server_url(tmp_path_factory) -> Iterator[str]:
    port = free_port()
    log = open(tmp_path_factory.mktemp("server") / "server.log", "w+")
    proc = subprocess.Popen([sys.executable, "-m", "minivllm.cli", "serve", "--port", str(port),
                             "--num-kv-blocks", "128"], stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while True:
            if proc.poll() is not None:
                log.seek(0)
                pytest.fail(f"minivllm serve exited with {proc.returncode}:\n{log.read()[-3000:]}")
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                pytest.fail("minivllm serve did not become healthy in 300 s")
            time.sleep(0.5)
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        log.close()


def test_serve_end_to_end(tmp_path, server_url):
    res = run_json(tmp_path, "serve", "--base-url", server_url, *TINY, "--request-rate", "20",
                   "--goodput", "ttft:600000", "e2el:600000")
    m, records = res["metrics"], res["records"]
    assert (m["completed"], m["failed"]) == (4, 0)
    assert res["workload"]["num_prompts"] == 4 and res["spec_acceptance_rate"] is None  # no speculation here
    # ignore_eos and max_tokens reach the server, and usage reports what it generated.
    assert [r["output_len"] for r in records] == [q["output_len"] for q in res["requests"]]
    assert m["total_output"] == sum(q["output_len"] for q in res["requests"])
    for r in records:
        assert 0 < r["ttft"] <= r["e2e"]
        assert r["e2e"] == pytest.approx(r["ttft"] + sum(r["itl"]))
    assert m["tpot_ms"]["mean"] > 0 and m["itl_ms"]["mean"] > 0
    assert m["request_goodput"] == pytest.approx(m["request_throughput"])  # generous SLOs: all good
    assert res["greedy_exact"] is None and all(r["text"] for r in records)
    # Where each request's time went, from the engine's timestamps: per request, and the means.
    phases = {"frontend_queue", "engine_queue", "prefill", "decode", "detokenize_stream"}
    assert all(set(r["time_breakdown_ms"]) == phases for r in records)
    assert set(res["time_breakdown_ms"]) == phases and all(v >= 0 for v in res["time_breakdown_ms"].values())
    (tmp_path / "again").mkdir()
    again = run_json(tmp_path / "again", "serve", "--base-url", server_url, *TINY, "--compare-to",
                     str(tmp_path / "result.json"))
    assert again["greedy_exact"] is True  # the same greedy texts, request by request


def test_throughput_with_speculation_checks_seeded_outputs(tmp_path):
    """bench throughput with --speculative-config reruns the workload without it and says whether the
    outputs are the same: here seeded sampling (--temperature), which speculation keeps exact too."""
    res = run_json(tmp_path, "throughput", "--dataset", "grounded", "--num-prompts", "1", "--max-num-seqs", "1",
                   "--speculative-config", '{"method": "suffix", "num_speculative_tokens": 6}',
                   "--temperature", "0.7", "--disable-tqdm")
    r = res["result"]
    assert r["greedy_exact"] is True and r["spec_mean_accepted_length"] > 1


def test_agent_turns_resend_their_conversation_in_rotation() -> None:
    from minivllm.bench.workloads import TextCorpus, agent_requests, load_tokenizer

    corpus = TextCorpus(load_tokenizer(None)[0])
    reqs = agent_requests(corpus, 7, 3, (200, 300), 40, (4, 8), np.random.default_rng(0))
    assert [r.kind for r in reqs] == ["first"] * 3 + ["return"] * 4
    assert all(200 <= r.prompt_len <= 300 for r in reqs[:3])
    for i, r in enumerate(reqs[3:], 3):
        previous = reqs[i - 3]
        assert r.tenant == previous.tenant and r.prompt.startswith(previous.prompt)
        # Its previous prompt's tokens come first (but the last, which the new text may extend).
        assert r.prompt_token_ids[:previous.prompt_len - 1] == previous.prompt_token_ids[:-1]
        assert 30 <= r.prompt_len - previous.prompt_len <= 50


def test_scheduling_scenarios_show_chunked_steps_and_fair_rows(tmp_path):
    """`bench scheduling` on tiny sizes: the chunked run never exceeds its budget and keeps the
    streams decoding beside the long prompt; the unchunked run computes the prompt in one step."""
    import csv

    from minivllm.bench.scheduling import run_chunked_prefill, run_fair, table
    from minivllm.bench.workloads import TextCorpus, load_tokenizer
    from minivllm.config import EngineConfig

    base = EngineConfig(dtype="float32", num_kv_blocks=128)
    corpus = TextCorpus(load_tokenizer(None)[0])
    rows = run_chunked_prefill(base, corpus, 0, 64, str(tmp_path), False, long_len=256, num_streams=2,
                               stream_output_len=200)
    traces = [list(csv.DictReader(open(tmp_path / f"chunked-prefill-{i}.csv"))) for i in range(3)]
    chunked, capped, whole = ([{k: int(float(v)) for k, v in r.items()} for r in t] for t in traces)
    assert all(r["num_scheduled_tokens"] <= 64 for r in chunked)
    assert any(r["num_prefill_tokens"] >= 32 and r["num_decode_tokens"] > 0 for r in chunked)
    events = json.loads((tmp_path / "chunked-prefill-1.json").read_text())["traceEvents"]
    long_tid = next(e["tid"] for e in events if e["ph"] == "M" and e["args"]["name"] == "request long")
    long_chunks = [int(e["name"].split()[1]) for e in events if e["tid"] == long_tid and e["name"].startswith("prefill")]
    assert sum(long_chunks) == 256 and max(long_chunks) == 32, "the long prompt's chunks are capped"
    assert any(r["num_prefill_tokens"] >= 256 for r in whole), "the whole prompt in one step"
    assert [r.group for r in rows] == ["short", "long", "stream, the same tokens alone",
                                       "stream, during the long prefill"] * 3
    alone, during = rows[2], rows[3]
    assert during.itl_ms.mean > 0 and during.itl_vs_alone > 0, "the streams decoded while the long prompt prefilled"
    assert alone.itl_ms.mean > 0, "each gap compared with the same token's gap in the streams-alone run"
    fair_rows = run_fair(base, corpus, 0, str(tmp_path), False, num_light=2)
    assert [(r.name.split(",")[0], r.group) for r in fair_rows] == [
        ("fair", "light"), ("fair", "light"), ("fair", "heavy"), ("fcfs", "light"), ("fcfs", "heavy")]
    assert "| setting |" in table(rows + fair_rows)


def test_quality_reference_overrides_keep_choice_values() -> None:
    """`--reference quantization=none` means the choice "none" (the dequantized model), not a missing value."""
    from minivllm.bench.quality import parse_overrides

    assert parse_overrides(["quantization=none", "max_model_len=none", "dtype=float32", "num-kv-blocks=64"]) == {
        "quantization": "none", "max_model_len": None, "dtype": "float32", "num_kv_blocks": 64}
