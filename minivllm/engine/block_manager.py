"""The paged KV cache's bookkeeping: which fixed-size blocks each sequence owns.

Blocks are reference counted so that sequences with the same prompt prefix can share them (prefix
caching). A full block is named by a chained hash of its tokens and of every block before it; a freed
block keeps its contents and its hash, and stays reusable until it is evicted in least-recently-used
order. Invariant: every block is either counted by exactly the tables that hold it, or free.

With a block store (seams.KVBlockStore: the KV tier, kv_tier/), an evicted block's K/V is first copied
there, and a prompt whose next blocks the store holds gets them copied back into free blocks instead of
recomputing them.
"""
from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING

from minivllm.engine.sequence import Sequence

if TYPE_CHECKING:
    from minivllm.engine.seams import KVBlockStore


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def block_hash(parent: bytes | None, tokens: list[int]) -> bytes:
    """A full block's name: its tokens and, through `parent`, every block before it. sha256, so that the
    name is the same in every process (the KV tier's files are named by it) and collisions are out of reach."""
    return hashlib.sha256((parent or b"") + array("q", tokens).tobytes()).digest()


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 block_store: KVBlockStore | None = None) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.block_store = block_store
        self.ref_counts = [0] * num_blocks
        self.block_hash: list[bytes | None] = [None] * num_blocks
        self.block_tokens: list[tuple[int, ...] | None] = [None] * num_blocks
        # Free blocks, the next to be evicted first. Cached blocks keep their hash while they wait here.
        self.free_queue: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.cached: dict[bytes, int] = {}  # block hash -> block id
        self.prefix_queries = 0  # prompt tokens looked up in the prefix cache
        self.prefix_hits = 0  # of which found

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self.free_queue)

    @property
    def usage(self) -> float:
        return self.num_used_blocks / self.num_blocks

    def blocks_for(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.block_size)

    # -- prefix cache -------------------------------------------------------------------------------
    def _block_hashes(self, seq: Sequence, num_full_blocks: int) -> list[bytes]:
        bs = self.block_size
        for i in range(len(seq.block_hashes), num_full_blocks):
            # The first block's parent is the request's cache salt (its LoRA adapter's): the same tokens
            # under another adapter have other K/V, so they must hash apart.
            parent = seq.block_hashes[i - 1] if i else seq.cache_salt
            seq.block_hashes.append(block_hash(parent, seq.token_ids[i * bs:(i + 1) * bs]))
        return seq.block_hashes

    def _num_reusable_blocks(self, seq: Sequence) -> int:
        """How many of `seq`'s leading full blocks may come from a cache: the last token is always
        left to compute, because its logits are needed to sample."""
        if not self.enable_prefix_caching or seq.params.prompt_logprobs is not None:
            return 0  # prompt_logprobs needs every prompt position's logits, as in vLLM
        return (seq.num_tokens - 1) // self.block_size

    def match_prefix(self, seq: Sequence) -> list[int]:
        """Cached blocks holding a prefix of `seq`."""
        bs = self.block_size
        num_full = self._num_reusable_blocks(seq)
        hits: list[int] = []
        for i, h in enumerate(self._block_hashes(seq, num_full)[:num_full]):
            block_id = self.cached.get(h)
            # Compare tokens, not only hashes: a collision must never serve another prompt's K/V.
            if block_id is None or self.block_tokens[block_id] != tuple(seq.token_ids[i * bs:(i + 1) * bs]):
                break
            hits.append(block_id)
        return hits

    def _blocks_after(self, seq: Sequence, start: int) -> Iterator[tuple[bytes, tuple[int, ...], int | None]]:
        """(hash, tokens, pool block or None) of `seq`'s reusable blocks from block `start` on, up to the
        first whose pool block holds other tokens (a hash collision never serves another prompt's K/V)."""
        bs = self.block_size
        for i in range(start, self._num_reusable_blocks(seq)):
            h, tokens = seq.block_hashes[i], tuple(seq.token_ids[i * bs:(i + 1) * bs])
            block_id = self.cached.get(h)
            if block_id is not None and self.block_tokens[block_id] != tokens:
                return
            yield h, tokens, block_id

    def reading_from_store(self, seq: Sequence, hits: list[int]) -> bool:
        """Whether blocks that follow `hits` (match_prefix's) are still being read into the block store
        (from its directory); asking starts their reads, which run beside the steps."""
        assert self.block_store is not None
        reading = False
        for h, tokens, block_id in self._blocks_after(seq, len(hits)):
            if block_id is None:
                ready = self.block_store.ready(h, tokens)
                if ready is False:
                    break
                reading |= ready is None
        return reading

    def load_from_store(self, seq: Sequence, hits: list[int]) -> list[int]:
        """`hits` (match_prefix's) extended by the blocks that follow them in the pool or the block store,
        those of the store copied into free blocks, registered as cached and left free for allocate() to take.
        Call it only when can_allocate(seq, ..., hits) holds: a loaded block takes the place of a
        block the prompt would take anyway, so the loads fit, and they never evict a hit (hits are moved
        to the far end of the free queue first, loaded blocks join them there)."""
        assert self.block_store is not None
        hits = list(hits)
        for block_id in hits:
            if self.ref_counts[block_id] == 0:
                self.free_queue.move_to_end(block_id)
        for h, tokens, block_id in self._blocks_after(seq, len(hits)):
            if block_id is None:  # not in the pool: in the store?
                data = self.block_store.fetch(h, tokens)  # in hand before _pop_free may evict into the store
                if data is None:
                    break
                block_id = self._pop_free()
                self.block_store.copy_into(block_id, data)
                self.ref_counts[block_id] = 0
                self.free_queue[block_id] = None
                self.cached[h], self.block_hash[block_id], self.block_tokens[block_id] = block_id, h, tokens
            elif self.ref_counts[block_id] == 0:
                self.free_queue.move_to_end(block_id)
            hits.append(block_id)
        return hits

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Register the blocks that `seq` has filled since the last call."""
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        # Accepted draft tokens are computed before the engine appends them: blocks wait for their tokens.
        num_full = min(seq.num_computed_tokens, seq.num_tokens) // bs
        hashes = self._block_hashes(seq, num_full)
        for i in range(seq.num_cached_blocks, num_full):
            block_id = seq.block_table[i]
            if self.block_hash[block_id] is None and hashes[i] not in self.cached:
                self.cached[hashes[i]] = block_id
                self.block_hash[block_id] = hashes[i]
                self.block_tokens[block_id] = tuple(seq.token_ids[i * bs:(i + 1) * bs])
        seq.num_cached_blocks = max(seq.num_cached_blocks, num_full)

    # -- allocation ---------------------------------------------------------------------------------
    def can_allocate(self, seq: Sequence, num_new_tokens: int, hits: list[int], reserve: int = 0) -> bool:
        """Can a waiting `seq` start, with `hits` reused and room for `num_new_tokens` more,
        leaving `reserve` blocks free?"""
        new_blocks = self.blocks_for(len(hits) * self.block_size + num_new_tokens) - len(hits)
        # A hit on a free cached block takes that block out of the free queue too.
        revived = sum(1 for b in hits if self.ref_counts[b] == 0)
        return new_blocks + revived <= self.num_free_blocks - reserve

    def allocate(self, seq: Sequence, num_new_tokens: int, hits: list[int]) -> None:
        assert not seq.block_table, "allocate() is for sequences that hold no blocks"
        for block_id in hits:
            self._take(block_id)
        seq.block_table = list(hits)
        seq.num_cached_blocks = len(hits)
        seq.num_computed_tokens = len(hits) * self.block_size
        seq.metrics.num_cached_tokens = seq.num_computed_tokens
        if self.enable_prefix_caching:
            self.prefix_queries += seq.num_tokens
            self.prefix_hits += seq.num_computed_tokens
        self.append_slots(seq, num_new_tokens)

    def can_append(self, seq: Sequence, num_new_tokens: int) -> bool:
        needed = self.blocks_for(seq.num_computed_tokens + num_new_tokens) - len(seq.block_table)
        return needed <= self.num_free_blocks

    def append_slots(self, seq: Sequence, num_new_tokens: int) -> None:
        """Grow `seq.block_table` to hold K/V for `num_new_tokens` tokens past the computed ones."""
        if not self.try_append(seq, num_new_tokens):
            raise RuntimeError("append_slots without can_append: KV cache exhausted")

    def try_append(self, seq: Sequence, num_new_tokens: int) -> bool:
        """append_slots if can_append (in one call: the scheduler asks this of every running
        sequence every step, and a decode mostly needs no new block)."""
        needed = -(-(seq.num_computed_tokens + num_new_tokens) // self.block_size) - len(seq.block_table)
        if needed <= 0:
            return True
        if needed > len(self.free_queue):
            return False
        for _ in range(needed):
            seq.block_table.append(self._pop_free())
        return True

    def free_tail(self, seq: Sequence) -> None:
        """Free the blocks past those that `seq`'s computed tokens fill (after rejected draft tokens
        were rolled back). They were taken for this step's draft alone: never shared, never cached."""
        keep = self.blocks_for(seq.num_computed_tokens)
        for block_id in reversed(seq.block_table[keep:]):
            assert self.ref_counts[block_id] == 1 and self.block_hash[block_id] is None
            self.ref_counts[block_id] = 0
            self.free_queue[block_id] = None
            self.free_queue.move_to_end(block_id, last=False)  # nothing worth keeping: reuse it first
        del seq.block_table[keep:]

    def free(self, seq: Sequence) -> None:
        # Tail blocks first, so that a prefix outlives its own continuation in the LRU order.
        for block_id in reversed(seq.block_table):
            self.ref_counts[block_id] -= 1
            if self.ref_counts[block_id] == 0:
                self.free_queue[block_id] = None
                if self.block_hash[block_id] is None:  # nothing worth keeping: reuse it first
                    self.free_queue.move_to_end(block_id, last=False)
        seq.block_table = []
        seq.num_cached_blocks = 0

    def _take(self, block_id: int) -> None:
        if self.ref_counts[block_id] == 0:
            del self.free_queue[block_id]
        self.ref_counts[block_id] += 1

    def _pop_free(self) -> int:
        block_id, _ = self.free_queue.popitem(last=False)
        h = self.block_hash[block_id]
        if h is not None:  # evict: the block's old contents are about to be overwritten
            if self.cached.get(h) == block_id:
                del self.cached[h]
                if self.block_store is not None:  # ... so keep them in the store first
                    self.block_store.store(h, self.block_tokens[block_id], block_id)
            self.block_hash[block_id] = None
            self.block_tokens[block_id] = None
        self.ref_counts[block_id] = 1
        return block_id

    def check_invariants(self, seqs: Iterable[Sequence]) -> None:
        """Every block is counted by exactly the tables that hold it, or is free."""
        counts = [0] * self.num_blocks
        for seq in seqs:
            for block_id in seq.block_table:
                counts[block_id] += 1
        assert counts == self.ref_counts, "reference counts differ from the block tables"
        free = {b for b in range(self.num_blocks) if counts[b] == 0}
        assert free == set(self.free_queue), "free queue differs from the unreferenced blocks"
