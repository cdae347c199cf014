"""Drives a scheduler exactly as LLMEngine.step does, with a deterministic fake model (no torch):
the scheduler's decisions can be tested fast and on a hand-driven clock."""
from __future__ import annotations

from minivllm.config import EngineConfig
from minivllm.engine.block_manager import BlockManager
from minivllm.engine.policies import POLICIES, SchedulingPolicy
from minivllm.engine.scheduler import Scheduler, will_sample
from minivllm.engine.scheduler_output import SchedulerOutput
from minivllm.engine.sequence import Sequence, SequenceStatus
from minivllm.engine.static_scheduler import StaticBatchScheduler
from minivllm.outputs import RequestMetrics
from minivllm.sampling_params import SamplingParams


class FakeEngine:
    def __init__(self, num_blocks: int = 256, policy: SchedulingPolicy | None = None, **config) -> None:
        config.setdefault("block_size", 4)
        self.config = EngineConfig(**config)
        self.bm = BlockManager(num_blocks, self.config.block_size, self.config.enable_prefix_caching)
        self.policy = policy or POLICIES[self.config.scheduling_policy]()
        self.now = 0.0
        if self.config.scheduler == "static":
            self.sched = StaticBatchScheduler(self.config, self.bm, self.policy, clock=lambda: self.now,
                                              max_model_len=num_blocks * self.config.block_size)
        else:
            self.sched = Scheduler(self.config, self.bm, self.policy, clock=lambda: self.now)
        self.seqs: dict[str, Sequence] = {}
        self.finished: list[Sequence] = []
        self.outputs: list[SchedulerOutput] = []

    def add(self, rid: str, prompt_len: int, max_tokens: int, priority: int = 0, tenant: str = "default",
            first_token: int = 0) -> Sequence:
        prompt = [(first_token + i) % 1000 for i in range(prompt_len)]
        seq = Sequence(rid, None, prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                       RequestMetrics(arrival_time=self.now), priority=priority, tenant=tenant)
        self.seqs[rid] = seq
        self.sched.add(seq)
        return seq

    def abort(self, rid: str) -> None:
        seq = self.seqs[rid]
        if not seq.is_finished:
            self.sched.finish(seq, "abort")
            self.finished.append(seq)

    @property
    def live(self) -> list[Sequence]:
        return [s for s in self.seqs.values() if not s.is_finished]

    def step(self, dt: float = 1.0) -> SchedulerOutput:
        out = self.sched.schedule()
        self.check(out)
        sampling = [s for s, n in out.scheduled if will_sample(s, n)]
        self.sched.on_step_done(out)
        for seq in sampling:
            seq.append_token(len(seq.token_ids) % 1000)  # deterministic stand-in for the model
            if seq.num_output_tokens >= seq.params.max_tokens:
                self.sched.finish(seq, "length")
                self.finished.append(seq)
        self.outputs.append(out)
        self.now += dt
        return out

    def check(self, out: SchedulerOutput) -> None:
        """The invariants every step must keep."""
        cfg = self.config
        ids = [s.request_id for s, _ in out.scheduled]
        assert len(ids) == len(set(ids)), "a sequence scheduled twice in one step"
        if cfg.scheduler == "continuous":
            alone = len(out.scheduled) == 1 and not cfg.enable_chunked_prefill
            assert alone or out.num_scheduled_tokens <= cfg.max_num_batched_tokens
            assert self.sched.num_running <= cfg.max_num_seqs
        for seq, n in out.scheduled:
            assert seq.status is SequenceStatus.RUNNING and 1 <= n <= seq.num_uncomputed_tokens
            assert len(seq.block_table) * cfg.block_size >= seq.num_computed_tokens + n
        self.bm.check_invariants(self.live)

    def run(self, max_steps: int = 10_000, dt: float = 1.0) -> None:
        for _ in range(max_steps):
            if not self.sched.has_unfinished():
                return
            self.step(dt)
        raise AssertionError(f"not finished after {max_steps} steps")
