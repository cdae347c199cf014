"""BlockManager: allocation, growth, freeing, reference counts, the prefix cache and its LRU eviction.

The tests drive it the way the scheduler and engine do: match_prefix -> can_allocate -> allocate,
then after each forward `num_computed_tokens` grows and `cache_full_blocks` registers full blocks.
"""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from minivllm.engine.block_manager import BlockManager
from minivllm.engine.sequence import Sequence
from minivllm.outputs import RequestMetrics
from minivllm.sampling_params import SamplingParams

BS = 4  # small blocks: block boundaries are crossed often


def make_seq(tokens: list[int], request_id: str = "r") -> Sequence:
    return Sequence(request_id, None, list(tokens), SamplingParams(), RequestMetrics(arrival_time=0.0))


def start(bm: BlockManager, seq: Sequence) -> list[int]:
    """Admit `seq` with its prefix-cache hits and compute its whole prompt; returns the hits."""
    hits = bm.match_prefix(seq)
    num_new = seq.num_tokens - len(hits) * BS
    assert bm.can_allocate(seq, num_new, hits)
    bm.allocate(seq, num_new, hits)
    computed(bm, seq, num_new)
    return hits


def computed(bm: BlockManager, seq: Sequence, num_tokens: int) -> None:
    """What the engine does after a forward that wrote K/V for `num_tokens` more tokens."""
    seq.num_computed_tokens += num_tokens
    bm.cache_full_blocks(seq)


def test_allocate_append_free() -> None:
    bm = BlockManager(8, BS)
    seq = make_seq(list(range(10)))
    start(bm, seq)
    assert len(seq.block_table) == 3 and bm.num_free_blocks == 5
    assert all(bm.ref_counts[b] == 1 for b in seq.block_table)
    bm.check_invariants([seq])

    # Decode: a new block is taken exactly when a token crosses a block boundary.
    for num_tokens in range(10, 14):
        seq.append_token(num_tokens)
        assert bm.can_append(seq, 1)
        bm.append_slots(seq, 1)
        computed(bm, seq, 1)
        assert len(seq.block_table) == -(-seq.num_computed_tokens // BS)
        bm.check_invariants([seq])
    assert len(seq.block_table) == 4

    bm.free(seq)
    assert seq.block_table == [] and bm.num_free_blocks == bm.num_blocks
    bm.check_invariants([])


def test_allocation_respects_free_blocks_and_reserve() -> None:
    bm = BlockManager(4, BS)
    assert bm.can_allocate(make_seq(list(range(16))), 16, [])
    assert not bm.can_allocate(make_seq(list(range(16))), 16, [], reserve=1)
    assert not bm.can_allocate(make_seq(list(range(17))), 17, [])
    seq = make_seq(list(range(16)))
    start(bm, seq)
    seq.append_token(99)
    assert not bm.can_append(seq, 1)
    with pytest.raises(RuntimeError, match="exhausted"):
        bm.append_slots(seq, 1)
    bm.check_invariants([seq])


def test_shared_prefix_is_reference_counted() -> None:
    bm = BlockManager(8, BS)
    a = make_seq(list(range(10)), "a")
    start(bm, a)
    b = make_seq(list(range(8)) + [50, 51, 52], "b")
    hits = start(bm, b)
    assert hits == a.block_table[:2]
    assert b.num_computed_tokens == b.num_tokens and b.metrics.num_cached_tokens == 8
    assert [bm.ref_counts[x] for x in hits] == [2, 2]
    bm.check_invariants([a, b])

    bm.free(a)
    assert [bm.ref_counts[x] for x in hits] == [1, 1]
    bm.check_invariants([b])
    bm.free(b)
    assert bm.num_free_blocks == bm.num_blocks
    bm.check_invariants([])


def test_match_prefix_leaves_the_last_token_to_compute() -> None:
    bm = BlockManager(8, BS)
    a = make_seq(list(range(8)), "a")
    start(bm, a)
    twin = make_seq(list(range(8)), "twin")
    # Both blocks are cached, but the last token's logits are needed: only the first block is served.
    assert bm.match_prefix(twin) == a.block_table[:1]


def test_freed_cached_blocks_are_revived() -> None:
    bm = BlockManager(6, BS)
    a = make_seq(list(range(9)), "a")
    start(bm, a)
    full_blocks = a.block_table[:2]
    bm.free(a)
    assert bm.num_free_blocks == 6

    # Reviving a free cached block takes it out of the free queue: 2 revived + 5 new > 6 free.
    longer = make_seq(list(range(8)) + [0] * 17, "longer")
    assert bm.match_prefix(longer) == full_blocks
    assert not bm.can_allocate(longer, 17, full_blocks)

    again = make_seq(list(range(9)), "again")
    hits = start(bm, again)
    assert hits == full_blocks
    assert bm.num_free_blocks == 3
    bm.check_invariants([again])


def test_lru_evicts_the_least_recently_freed_and_a_continuation_before_its_prefix() -> None:
    bm = BlockManager(5, BS)
    x = make_seq([1] * 9, "x")  # two full blocks (cached) and a partial one
    y = make_seq([2] * 5, "y")  # one full block and a partial one
    start(bm, x)
    bm.free(x)
    start(bm, y)  # takes x's partial block first (it caches nothing), then a never-used one
    bm.free(y)
    assert len(bm.cached) == 3

    # Three blocks: the two uncached partial blocks, then the oldest cached one, x's continuation.
    start(bm, make_seq([3] * 9, "z"))
    assert len(bm.match_prefix(make_seq([1] * 9, "x2"))) == 1
    assert len(bm.match_prefix(make_seq([2] * 5, "y2"))) == 1
    assert len(bm.cached) == 4  # x's first block, y's, and z's two: the evicted one is forgotten
    # One more: x's prefix goes before y's block, which was freed later.
    start(bm, make_seq([4, 4], "v"))
    assert bm.match_prefix(make_seq([1] * 9, "x3")) == []
    assert len(bm.match_prefix(make_seq([2] * 5, "y3"))) == 1
    assert len(bm.cached) == 3


def test_prefix_caching_disabled_shares_nothing() -> None:
    bm = BlockManager(8, BS, enable_prefix_caching=False)
    a = make_seq(list(range(9)), "a")
    start(bm, a)
    assert bm.match_prefix(make_seq(list(range(9)), "b")) == []
    assert not bm.cached


# -- random workloads ------------------------------------------------------------------------------
BASE = [7, 3, 7, 3, 1, 2, 3, 4, 5, 6, 7, 8, 9, 1, 2]  # shared prefixes make the cache hit often

prompts = st.builds(lambda k, tail: BASE[:k] + tail, st.integers(0, len(BASE)),
                    st.lists(st.integers(0, 3), max_size=6)).filter(bool)
# Mostly steps, so that prompts get computed, cached, finished and matched again.
ops = st.lists(st.one_of(st.tuples(st.just("add"), prompts),
                         st.tuples(st.sampled_from(["step"] * 6 + ["finish", "preempt"]), st.integers(0, 99),
                                   st.integers(1, 12))),
               min_size=10, max_size=80)


class Workload:
    """The scheduler's protocol, with a shadow KV cache: every slot remembers which token's K/V it
    holds, so that a prefix hit serving the wrong contents is caught."""

    def __init__(self, num_blocks: int, caching: bool) -> None:
        self.bm = BlockManager(num_blocks, BS, caching)
        self.waiting: list[Sequence] = []
        self.running: list[Sequence] = []
        self.slots: dict[tuple[int, int], int] = {}  # (block, offset) -> token whose K/V is there
        self.count = 0

    def add(self, tokens: list[int]) -> None:
        self.count += 1
        self.waiting.append(make_seq(tokens, str(self.count)))

    def step(self, pick: int, chunk: int) -> None:
        seqs = self.waiting + self.running
        if not seqs:
            return
        seq = seqs[pick % len(seqs)]
        if seq in self.waiting:
            hits = self.bm.match_prefix(seq)
            for i, block in enumerate(hits):  # a hit must hold exactly this prefix's K/V
                assert [self.slots[(block, o)] for o in range(BS)] == seq.token_ids[i * BS:(i + 1) * BS]
            n = min(seq.num_tokens - len(hits) * BS, chunk)
            if not self.bm.can_allocate(seq, n, hits):
                return
            self.bm.allocate(seq, n, hits)
            self.waiting.remove(seq)
            self.running.append(seq)
        else:
            n = min(seq.num_uncomputed_tokens, chunk)
            if not self.bm.can_append(seq, n):
                return
            self.bm.append_slots(seq, n)
        self._write(seq, n)

    def _write(self, seq: Sequence, n: int) -> None:
        for pos in range(seq.num_computed_tokens, seq.num_computed_tokens + n):
            self.slots[(seq.block_table[pos // BS], pos % BS)] = seq.token_ids[pos]
        computed(self.bm, seq, n)
        if seq.num_computed_tokens == seq.num_tokens:
            seq.append_token(seq.num_tokens % 4)  # "sample" the next token

    def finish(self, pick: int) -> None:
        if self.running:
            self.bm.free(self.running.pop(pick % len(self.running)))

    def preempt(self, pick: int) -> None:
        if self.running:
            seq = self.running.pop(pick % len(self.running))
            self.bm.free(seq)
            seq.num_computed_tokens = 0
            self.waiting.insert(0, seq)


@settings(max_examples=300, deadline=None)
@given(ops=ops, num_blocks=st.integers(1, 12), caching=st.booleans())
def test_random_workloads_end_with_every_block_free(ops: list[tuple], num_blocks: int, caching: bool) -> None:
    w = Workload(num_blocks, caching)
    for op in ops:
        if op[0] == "add":
            w.add(op[1])
        elif op[0] == "step":
            w.step(op[1], op[2])
        else:
            getattr(w, op[0])(op[1])
        w.bm.check_invariants(w.running + w.waiting)
        assert all(not s.block_table for s in w.waiting)
    for seq in w.running:
        w.bm.free(seq)
    assert w.bm.num_free_blocks == num_blocks
    w.bm.check_invariants([])
