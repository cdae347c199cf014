"""The KV tier's part in the step (a seams.StepExtension): it plugs the tier into the block manager as
its block store (seams.KVBlockStore: evicted prefix blocks go there, a waiting prompt's next blocks come
back), lets an idle step wait on the tier's reads, reports its counters, and at close keeps the prefix
blocks still in the pool (store.py says how).
"""
from __future__ import annotations

from concurrent.futures import Future
from typing import Any

from minivllm.engine.block_manager import BlockManager
from minivllm.engine.seams import StepExtension
from minivllm.kv_tier.store import KVTier, tier_stats


class KVTierExtension(StepExtension):
    """Without a tier it only reports zeros, so that every engine's stats have the tier's keys."""

    def __init__(self, block_manager: BlockManager, tier: KVTier | None) -> None:
        self.block_manager, self.tier = block_manager, tier
        block_manager.block_store = tier

    def pending(self) -> list[Future]:
        return self.tier.pending_reads() if self.tier is not None else []

    def trace_counts(self) -> dict[str, int]:
        stats = self.tier.stats if self.tier is not None else None
        return {"num_tier_ram_tokens": stats.kv_offload_ram_hits if stats else 0,
                "num_tier_disk_tokens": stats.kv_offload_disk_hits if stats else 0}

    def stats(self) -> dict[str, Any]:
        return tier_stats(self.tier)

    def close(self) -> None:
        if self.tier is not None:
            bm = self.block_manager
            self.tier.persist((h, bm.block_tokens[b], b) for h, b in bm.cached.items())
