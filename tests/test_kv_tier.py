"""The KV tier (kv_tier/): prefix blocks evicted from a tiny pool come back from RAM and from a
directory bit-exact, the directory serves the next process and other engines on it, and damaged,
foreign, vanished or unwritable entries cost a recompute, never a wrong answer.

Every engine here has 8 blocks of 16 tokens. Prompt A (100 tokens: 6 full blocks that may be reused)
runs cold; prompt B takes 7 blocks and evicts A's last 5 (a prefix outlives its continuation in the
LRU order); A again finds its first block in the pool and the next 5 in the tier (80 tokens).
"""
from __future__ import annotations

import json
import logging
import resource
import signal
import struct
import threading
from pathlib import Path
from typing import Any

import pytest

from minivllm import LLM
from minivllm.engine.block_manager import block_hash
from minivllm.kv_tier.store import MAGIC
from minivllm.server.dashboard import load_trace
from minivllm.server.metrics import ServerMetrics
from tests.helpers import LONG_PROMPT, assert_idle, greedy

BS = 16
FROM_TIER = 5 * BS  # A's tokens that come back from the tier


def small_llm(dtype: str = "float32", **tier: Any) -> LLM:
    return LLM(dtype=dtype, quantization="none", num_kv_blocks=8, max_model_len=128, **tier)


def prompts(llm: LLM) -> tuple[list[int], list[int]]:
    ids = llm.engine.tokenizer.encode(LONG_PROMPT)
    return ids[:100], ids[100:200]


def run(llm: LLM, prompt: list[int]) -> tuple[list[int], list, int]:
    """Greedy tokens, their logprobs (exact floats: the same K/V bits give the same ones) and how many
    prompt tokens came from a cache."""
    out = llm.generate([prompt], greedy(4, logprobs=2), use_tqdm=False)[0]
    return out.outputs[0].token_ids, out.outputs[0].logprobs, out.metrics.num_cached_tokens


def entry_files(llm: LLM, prompt: list[int]) -> list[Path]:
    """The directory entries of `prompt`'s reusable blocks, in prefix order."""
    disk = llm.engine.block_manager.block_store.disk
    paths, parent = [], None
    for i in range((len(prompt) - 1) // BS):
        parent = block_hash(parent, prompt[i * BS:(i + 1) * BS])
        paths.append(disk.directory / disk._name(parent))
    return paths


@pytest.mark.parametrize("tier, dtype", [("ram", "float32"), ("disk", "bfloat16")])
def test_evicted_prefix_comes_back_from_the_tier_bit_identical(tier: str, dtype: str, tmp_path: Path) -> None:
    place = {"kv_offloading_size": 0.01} if tier == "ram" else {"kv_offloading_dir": str(tmp_path / "tier")}
    llm = small_llm(dtype, trace_file=str(tmp_path / "steps.csv"), **place)
    a, b = prompts(llm)
    cold = run(llm, a)
    assert cold[2] == 0
    run(llm, b)
    warm = run(llm, a)
    stats = llm.engine.get_stats()
    assert warm[2] == 6 * BS, "one block from the pool, five from the tier"
    assert stats[f"kv_offload_{tier}_hits"] == FROM_TIER
    assert warm[:2] == cold[:2]
    assert stats["kv_offload_loaded_bytes"] == 5 * llm.engine.block_manager.block_store.pool.nbytes
    assert stats["kv_offload_load_seconds"] > 0 and stats[f"kv_offload_{tier}_usage_bytes"] > 0
    metrics = ServerMetrics("m", llm.engine.get_stats).render()[0].decode()
    assert f"minivllm:kv_offload_{tier}_hits_total{{model_name=\"m\"}} {FROM_TIER}.0" in metrics
    assert_idle(llm.engine)
    llm.engine.close()
    steps = [r for r in load_trace(tmp_path / "steps.csv").records if r["kind"] == "step"]
    assert sum(r[f"num_tier_{tier}_tokens"] for r in steps) == FROM_TIER  # what the dashboard sums


def test_restart_reuses_the_directory_and_another_dtype_does_not(tmp_path: Path) -> None:
    first = small_llm(kv_offloading_dir=str(tmp_path))
    a, _ = prompts(first)
    cold = run(first, a)
    first.engine.close()  # writes out what the pool still holds: A's 6 full blocks
    assert all(p.exists() for p in entry_files(first, a))

    second = small_llm(kv_offloading_dir=str(tmp_path))  # a new engine indexes the directory
    warm = run(second, a)
    assert warm[2] == 6 * BS and second.engine.get_stats()["kv_offload_disk_hits"] == 6 * BS
    assert warm[:2] == cold[:2]

    other = small_llm("bfloat16", kv_offloading_dir=str(tmp_path))  # another key: the entries are not its own
    run(other, a)
    assert other.engine.get_stats()["kv_offload_disk_hits"] == 0
    for llm in (second, other):
        assert_idle(llm.engine)


def test_a_prompt_reading_from_disk_does_not_stall_the_others(tmp_path: Path) -> None:
    """The directory is read on the tier's I/O thread: while A's entries are being read (a disk held up
    by the test), B decodes step after step; then A loads them and answers as it did cold."""
    first = small_llm(kv_offloading_dir=str(tmp_path))
    a, b = prompts(first)
    cold = run(first, a)
    first.engine.close()

    second = small_llm(kv_offloading_dir=str(tmp_path))
    engine, disk = second.engine, second.engine.block_manager.block_store.disk
    disk_released, real_get = threading.Event(), disk.get

    def slow_get(*args: Any) -> Any:
        disk_released.wait(timeout=30)
        return real_get(*args)

    disk.get = slow_get
    engine.add_request("b", b[:8], greedy(12))
    engine.add_request("a", a, greedy(4, logprobs=2))
    outputs: dict[str, Any] = {}
    for _ in range(6):
        outputs.update({o.request_id: o for o in engine.step()})
    a_seq = engine.requests["a"]
    assert a_seq.num_computed_tokens == 0 and len(engine.requests["b"].output_token_ids) >= 5
    assert disk.pending_reads(), "A's blocks are being read"
    disk_released.set()
    while engine.has_unfinished_requests():
        outputs.update({o.request_id: o for o in engine.step() if o.finished})
    warm = outputs["a"].outputs[0]
    assert (warm.token_ids, warm.logprobs) == cold[:2] and outputs["a"].metrics.num_cached_tokens == 6 * BS
    assert engine.get_stats()["kv_offload_disk_hits"] == 6 * BS
    assert engine.get_stats()["kv_offload_read_seconds"] > 0
    assert_idle(engine)


def test_damaged_and_foreign_entries_are_dropped_never_used(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    first = small_llm(kv_offloading_dir=str(tmp_path))
    a, _ = prompts(first)
    cold = run(first, a)
    first.engine.close()
    files = entry_files(first, a)

    def rewrite_header(path: Path, **changes: Any) -> None:
        raw = path.read_bytes()
        (length,) = struct.unpack_from("<I", raw, len(MAGIC))
        start = len(MAGIC) + 4
        header = json.dumps({**json.loads(raw[start:start + length]), **changes}).encode()
        path.write_bytes(MAGIC + struct.pack("<I", len(header)) + header + raw[start + length:])

    corrupt = bytearray(files[0].read_bytes())
    corrupt[-100] ^= 0x01  # one bit of the K/V data
    files[0].write_bytes(corrupt)
    files[1].write_bytes(files[1].read_bytes()[:-1000])  # truncated
    rewrite_header(files[2], identity="0" * 64)  # written by an engine of another model, dtype or build
    rewrite_header(files[3], tokens=a[:BS])  # another prefix's tokens under this name
    files[4].write_bytes(b"not an entry")

    second = small_llm(kv_offloading_dir=str(tmp_path))
    with caplog.at_level(logging.WARNING, logger="minivllm.kv_tier.store"):
        warm = run(second, a)  # the first block is corrupt: nothing is loaded, all is computed
        assert warm[2] == 0 and warm[:2] == cold[:2]
        disk = second.engine.block_manager.block_store.disk
        parent = None
        for i, path in enumerate(files):
            parent = block_hash(parent, a[i * BS:(i + 1) * BS])
            intact = disk.get(parent, tuple(a[i * BS:(i + 1) * BS])) is not None
            assert intact == (i == 5) and path.exists() == (i == 5)
    messages = "\n".join(r.getMessage() for r in caplog.records)
    for problem in ("checksum mismatch", "truncated", "another model", "other tokens", "not an entry"):
        assert problem in messages
    assert second.engine.get_stats()["kv_offload_dropped_entries"] == 5
    assert_idle(second.engine)


def test_two_engines_share_a_directory_and_survive_deletions(tmp_path: Path,
                                                             caplog: pytest.LogCaptureFixture) -> None:
    one, two = small_llm(kv_offloading_dir=str(tmp_path)), small_llm(kv_offloading_dir=str(tmp_path))
    a, b = prompts(one)
    cold = run(one, a)
    one.engine.close()
    warm = run(two, a)  # entries written after `two` indexed the directory: found when looked up
    assert warm[2] == 6 * BS and warm[:2] == cold[:2]
    run(one, b)
    run(two, b)  # both evict A's blocks into the same names: each write replaces the file whole
    one.engine.close()
    two.engine.close()
    for path in tmp_path.glob("*.kv"):  # deleted under both engines
        path.unlink()
    with caplog.at_level(logging.INFO, logger="minivllm.kv_tier.store"):
        again = run(two, a)
    assert again[:2] == cold[:2] and again[2] == BS  # only the block still in the pool
    assert "deleted under the engine" in caplog.text
    assert not list(tmp_path.glob(".writing-*"))
    for llm in (one, two):
        assert_idle(llm.engine)


def test_a_full_disk_is_logged_and_skipped(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """RLIMIT_FSIZE makes every write past 256 KiB fail (EFBIG, with SIGXFSZ ignored), as a full disk
    fails with ENOSPC: an entry is 720 KiB. Set for this process and restored (tests run as root, where
    a chmod does not make a directory read-only)."""
    llm = small_llm(kv_offloading_dir=str(tmp_path))
    a, b = prompts(llm)
    cold = run(llm, a)
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (256 * 1024, hard))
    try:
        with caplog.at_level(logging.WARNING, logger="minivllm.kv_tier.store"):
            run(llm, b)  # evicts A's blocks: none can be written
            warm = run(llm, a)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, handler)
    assert warm[:2] == cold[:2] and warm[2] == BS
    stats = llm.engine.get_stats()
    assert stats["kv_offload_write_errors"] >= 5 and stats["kv_offload_disk_hits"] == 0
    assert "cannot write" in caplog.text
    assert not list(tmp_path.iterdir()), "no entry, and no file left half written"
    assert_idle(llm.engine)
