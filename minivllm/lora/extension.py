"""LoRA's part in the step: the adapters an engine serves (a seams.StepExtension) and the admission gate
that keeps at most --max-loras distinct adapters running at once.

A request names its adapter with the `lora_request=` option of LLMEngine.add_request; the adapter is
loaded then if need be, and the request runs under it (its rows grouped by adapter in the step) with
the adapter's salt in its prefix-cache hashes. The frontends reach add_lora / remove_lora through
LLMEngine.utility.
"""
from __future__ import annotations

from typing import Any

from minivllm.config import EngineConfig
from minivllm.engine.seams import StepExtension
from minivllm.engine.sequence import Sequence
from minivllm.lora.manager import LoadedAdapter, LoRAManager
from minivllm.lora.request import LoRARequest


class LoRAAdapters(StepExtension):
    """Without --enable-lora it has no manager and refuses requests that name an adapter."""

    def __init__(self, config: EngineConfig, runner: Any) -> None:
        self.config = config  # read when asked: max_loras may be changed on a live engine
        self.manager = (LoRAManager(runner.model, config.max_loras, config.max_cpu_loras, config.max_lora_rank)
                        if config.enable_lora else None)

    def admits(self, seq: Sequence, running: list[Sequence]) -> bool:
        """Whether `seq`'s adapter may join the running ones: at most max_loras distinct adapters run at
        once, so that no step holds more (every running sequence may be scheduled in one step)."""
        if seq.lora is None:
            return True
        adapters = {s.lora for s in running if s.lora is not None}
        return seq.lora in adapters or len(adapters) < self.config.max_loras

    def on_add(self, seq: Sequence, options: dict[str, Any]) -> None:
        lora_request = options.pop("lora_request", None)
        if lora_request is not None:
            adapter = self.adapter(lora_request)
            seq.lora = adapter
            seq.add_cache_salt(adapter.cache_salt)

    def adapter(self, lora_request: LoRARequest) -> LoadedAdapter:
        if self.manager is None:
            raise ValueError("LoRA adapters need the engine started with enable_lora (--enable-lora)")
        return self.manager.add(lora_request)

    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Load and register an adapter; raises ValueError naming what is wrong with it (a rank above
        max_lora_rank, modules the model lacks, shapes that do not fit, an unreadable file)."""
        self.adapter(lora_request)
        return True

    def add_loras(self, lora_requests: list[LoRARequest]) -> None:
        """The adapters a server starts with (--lora-modules); a bad one stops the start, named."""
        for lora_request in lora_requests:
            self.add_lora(lora_request)

    def remove_lora(self, lora_name: str) -> bool:
        """Unregister an adapter (requests running under it finish under it); False if unknown."""
        return self.manager is not None and self.manager.remove(lora_name)

    def list_loras(self) -> list[LoRARequest]:
        return self.manager.list() if self.manager is not None else []
