"""The scheduler's policy and invariants, on a fake model runner and a hand-driven clock."""
from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from minivllm.engine.policies import PriorityPolicy, SJFPolicy
from minivllm.engine.sequence import SequenceStatus
from tests.fake_engine import FakeEngine


def admission_order(engine: FakeEngine) -> list[str]:
    """Request ids in the order they were first scheduled."""
    order = []
    for out in engine.outputs:
        for seq, _ in out.scheduled:
            if seq.request_id not in order:
                order.append(seq.request_id)
    return order


# -- budgets and decode-first ------------------------------------------------------------------------
def start_decoding(eng: FakeEngine, n: int) -> None:
    for i in range(n):
        eng.add(f"short{i}", 10, 200)
    while any(eng.seqs[f"short{i}"].num_output_tokens == 0 for i in range(n)):
        eng.step()


def test_decode_first_and_long_prompt_is_chunked_while_decodes_advance():
    eng = FakeEngine(max_num_batched_tokens=64, block_size=16, num_blocks=512)
    start_decoding(eng, 8)
    eng.add("long", 1000, 5)
    chunks = []
    while eng.seqs["long"].is_prefilling or eng.seqs["long"].num_computed_tokens == 0:
        out = eng.step()
        decodes = [s.request_id for s, n in out.scheduled if n == 1]
        assert sorted(decodes) == sorted(f"short{i}" for i in range(8)), "every running sequence advances"
        assert out.scheduled[-1][0].request_id == "long", "decodes are scheduled before the prefill chunk"
        chunks.append(out.scheduled[-1][1])
    assert sum(chunks) == 1000
    assert all(c == 64 - 8 for c in chunks[:-1]), "each chunk takes exactly the budget left by the decodes"


def test_prefill_first_gives_the_budget_to_the_prompt():
    eng = FakeEngine(max_num_batched_tokens=64, block_size=16, num_blocks=512, schedule_order="prefill-first")
    start_decoding(eng, 8)
    eng.add("long", 1000, 5)
    out = eng.step()
    assert out.scheduled[0] == (eng.seqs["long"], 64), "the prompt takes the whole budget"
    assert all(n > 1 for _, n in out.scheduled), "decodes wait behind the prefill"


def test_without_chunking_a_prompt_larger_than_the_budget_runs_alone():
    eng = FakeEngine(max_num_batched_tokens=32, enable_chunked_prefill=False, block_size=16, num_blocks=64)
    eng.add("a", 10, 50)
    eng.step()
    eng.add("big", 100, 3)
    outs = [eng.step() for _ in range(3)]
    big_steps = [o for o in outs if any(s.request_id == "big" for s, _ in o.scheduled)]
    assert big_steps[0].scheduled == [(eng.seqs["big"], 100)], "the whole prompt, alone in its step"
    eng.run()


def test_max_num_partial_prefills_limits_prompts_cut_midway():
    eng = FakeEngine(max_num_batched_tokens=100, long_prefill_token_threshold=30, max_num_partial_prefills=2,
                     block_size=4, num_blocks=512)
    for i in range(4):
        eng.add(f"p{i}", 90, 2)
    out = eng.step()
    assert [n for _, n in out.scheduled] == [30, 30], "two prompts cut to the threshold, the rest wait"


def test_a_long_prompt_beside_decodes_gets_its_chunk_every_interval_steps():
    eng = FakeEngine(max_num_batched_tokens=64, long_prefill_token_threshold=8, long_prefill_interval=3,
                     block_size=4, num_blocks=512)
    eng.add("long", 64, 2)
    assert [n for _, n in eng.step().scheduled] == [8], "alone: a chunk every step"
    assert [n for _, n in eng.step().scheduled] == [8]
    eng.add("stream", 4, 30)
    assert sorted(n for _, n in eng.step().scheduled) == [4, 8], "the stream's prompt: nobody decodes yet"
    chunks = [dict((s.request_id, n) for s, n in eng.step().scheduled).get("long", 0) for _ in range(6)]
    assert chunks == [0, 0, 8, 0, 0, 8], "beside a decode: one chunk every 3 steps"
    eng.run()


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_random_workloads_keep_every_invariant(data):
    """Random prompts, budgets, pool sizes, policies and aborts: every step keeps the budgets and
    the block invariant; every request ends exactly once; no block leaks."""
    chunked = data.draw(st.booleans())
    block_size = data.draw(st.sampled_from([1, 4, 16]))
    max_len = 120
    eng = FakeEngine(
        num_blocks=data.draw(st.integers(max_len // block_size + 1, 4 * max_len // block_size)),
        block_size=block_size,
        max_num_batched_tokens=data.draw(st.integers(8, 160)),
        max_num_seqs=data.draw(st.integers(1, 12)),
        enable_chunked_prefill=chunked,
        long_prefill_token_threshold=data.draw(st.sampled_from([0, 7, 32])),
        long_prefill_interval=data.draw(st.sampled_from([1, 1, 3])),
        scheduling_policy=data.draw(st.sampled_from(["fcfs", "sjf", "priority", "fair"])),
        schedule_order=data.draw(st.sampled_from(["decode-first", "prefill-first"])),
        enable_prefix_caching=data.draw(st.booleans()),
    )
    num_requests = data.draw(st.integers(1, 25))
    arrivals = sorted(data.draw(st.lists(st.integers(0, 40), min_size=num_requests, max_size=num_requests)))
    aborts = data.draw(st.dictionaries(st.integers(0, num_requests - 1), st.integers(0, 60), max_size=6))
    pending = list(range(num_requests))
    step = 0
    while pending or eng.sched.has_unfinished():
        while pending and arrivals[pending[0]] <= step:
            i = pending.pop(0)
            prompt_len = data.draw(st.integers(1, 90))
            eng.add(f"r{i}", prompt_len, data.draw(st.integers(1, max_len - prompt_len)),
                    priority=data.draw(st.integers(0, 3)), tenant=data.draw(st.sampled_from("ab")),
                    first_token=data.draw(st.sampled_from([0, 0, 500])))  # shared prefixes too
        for i, at in aborts.items():
            if at == step and f"r{i}" in eng.seqs:
                eng.abort(f"r{i}")
        eng.step()
        step += 1
        assert step < 5000, "no progress"
    ended = [s.request_id for s in eng.finished]
    assert sorted(ended) == sorted(eng.seqs), "every request ends exactly once"
    assert all(s.finish_reason in ("length", "abort") for s in eng.finished)
    assert all(s.num_output_tokens == s.params.max_tokens for s in eng.finished if s.finish_reason == "length")
    assert eng.bm.num_free_blocks == eng.bm.num_blocks, "no block leaks"


# -- preemption and abort ------------------------------------------------------------------------------
def test_preemption_picks_the_latest_arrival_and_keeps_its_output():
    eng = FakeEngine(num_blocks=12, block_size=4, max_num_batched_tokens=64, watermark=0.0,
                     enable_prefix_caching=False)
    eng.add("old", 8, 40)
    eng.now += 1
    eng.add("new", 8, 40)
    preempted_step = None
    for _ in range(60):
        out = eng.step()
        if out.preempted:
            preempted_step = out
            break
    assert preempted_step is not None, "a 12-block pool cannot hold two 48-token sequences"
    victim = preempted_step.preempted[0]
    assert victim.request_id == "new"
    assert victim.status is SequenceStatus.WAITING and victim.num_computed_tokens == 0
    assert victim.num_output_tokens > 0, "output so far is kept"
    assert eng.sched.waiting[0] is victim, "the victim goes to the front of the queue"
    assert all(seq.request_id != "new" for seq, _ in preempted_step.scheduled)
    eng.run()
    assert {s.request_id: s.num_output_tokens for s in eng.finished} == {"old": 40, "new": 40}
    assert eng.seqs["new"].metrics.num_preemptions >= 1 and eng.sched.num_preemptions >= 1


def test_no_admission_in_a_step_that_preempted():
    eng = FakeEngine(num_blocks=12, block_size=4, max_num_batched_tokens=64, watermark=0.0,
                     enable_prefix_caching=False)
    eng.add("a", 12, 30)
    eng.add("b", 12, 30)
    eng.step()
    eng.add("c", 1, 1)
    steps_that_preempted = 0
    while eng.sched.has_unfinished():
        waiting_before = {s.request_id for s in eng.sched.waiting}
        out = eng.step()
        if out.preempted:
            steps_that_preempted += 1
            assert not waiting_before & {s.request_id for s, _ in out.scheduled}, "admitted while preempting"
    assert steps_that_preempted > 0


def test_abort_in_every_state_frees_blocks():
    eng = FakeEngine(max_num_batched_tokens=16, block_size=4, num_blocks=64, max_num_seqs=2)
    eng.add("running", 4, 100)
    eng.add("prefilling", 40, 5)
    eng.add("waiting", 4, 5)
    eng.step()
    eng.step()
    assert eng.seqs["prefilling"].is_prefilling and eng.seqs["prefilling"].num_computed_tokens > 0
    assert eng.seqs["waiting"].status is SequenceStatus.WAITING
    for rid in ("waiting", "prefilling", "running"):
        eng.abort(rid)
        assert eng.seqs[rid].finish_reason == "abort" and eng.seqs[rid].block_table == []
        eng.bm.check_invariants(eng.live)
    eng.abort("running")  # already finished: a no-op
    assert [s.request_id for s in eng.finished] == ["waiting", "prefilling", "running"]
    assert eng.bm.num_free_blocks == eng.bm.num_blocks and not eng.sched.has_unfinished()


# -- policies ------------------------------------------------------------------------------------------
def queue_then_release(policy: str, requests: list[tuple], **kw) -> list[str]:
    """Hold one slot busy, queue `requests` (id, prompt_len, priority, tenant), and return the
    order in which they are admitted once slots free up one at a time."""
    eng = FakeEngine(max_num_seqs=1, max_num_batched_tokens=512, scheduling_policy=policy, **kw)
    eng.add("busy", 4, 3)
    eng.step()
    for rid, prompt_len, priority, tenant in requests:
        eng.now += 0.001
        eng.add(rid, prompt_len, 1, priority=priority, tenant=tenant)
    eng.run(dt=0.001)
    return [r for r in admission_order(eng) if r != "busy"]


def test_fcfs_admits_in_arrival_order():
    reqs = [("a", 50, 0, "x"), ("b", 5, 2, "y"), ("c", 20, 1, "x")]
    assert queue_then_release("fcfs", reqs) == ["a", "b", "c"]


def test_sjf_admits_the_shortest_prompt_first():
    reqs = [("a", 50, 0, "x"), ("b", 5, 0, "x"), ("c", 20, 0, "x")]
    assert queue_then_release("sjf", reqs) == ["b", "c", "a"]


def test_priority_admits_the_lowest_value_first():
    reqs = [("a", 5, 3, "x"), ("b", 5, 1, "x"), ("c", 5, 2, "x")]
    assert queue_then_release("priority", reqs) == ["b", "c", "a"]


def test_fair_admits_the_least_served_tenant_first():
    reqs = [("h0", 100, 0, "heavy"), ("h1", 10, 0, "heavy"), ("h2", 10, 0, "heavy"), ("l0", 4, 0, "light"),
            ("l1", 10, 0, "light")]
    # After h0's 100 tokens, the light tenant is behind: both its requests jump the heavy queue.
    assert queue_then_release("fair", reqs) == ["h0", "l0", "l1", "h1", "h2"]
    assert queue_then_release("fcfs", reqs) == ["h0", "h1", "h2", "l0", "l1"]


def test_priority_preempts_a_lower_priority_running_request_when_slots_are_full():
    eng = FakeEngine(max_num_seqs=2, max_num_batched_tokens=512, scheduling_policy="priority")
    eng.add("low", 4, 50, priority=5)
    eng.add("mid", 4, 50, priority=3)
    eng.step()
    eng.add("urgent", 4, 2, priority=0)
    out = eng.step()
    assert [s.request_id for s in out.preempted] == ["low"]
    assert "urgent" in [s.request_id for s, _ in out.scheduled]
    eng.run()
    assert {s.request_id for s in eng.finished} == {"low", "mid", "urgent"}


def wait_of_long_request(policy, steps: int = 400) -> float | None:
    """A steady stream of short requests (one per step) and one long or low-priority request:
    how long until the latter is first scheduled (None: never, within `steps`)."""
    eng = FakeEngine(max_num_seqs=1, max_num_batched_tokens=4096, policy=policy, num_blocks=4096)
    eng.add("victim", 1000, 1, priority=10)
    for i in range(steps):
        eng.add(f"short{i}", 10, 1, priority=0)
        eng.step(dt=0.1)
        t = eng.seqs["victim"].metrics.first_scheduled_time
        if t is not None:
            return t
    return None


def test_sjf_aging_bounds_the_wait_of_a_long_prompt():
    assert wait_of_long_request(SJFPolicy(aging_tokens_per_s=0)) is None, "without aging it starves"
    waited = wait_of_long_request(SJFPolicy(aging_tokens_per_s=256))
    assert waited is not None and waited <= (1000 - 10) / 256 + 0.5


def test_priority_aging_bounds_the_wait_of_a_low_priority_request():
    assert wait_of_long_request(PriorityPolicy(aging_s=1e9)) is None, "without aging it starves"
    waited = wait_of_long_request(PriorityPolicy(aging_s=1.0))
    assert waited is not None and waited <= 10 * 1.0 + 0.5


def test_fair_share_between_a_heavy_and_a_light_tenant():
    """Both tenants backlogged, one sending 10x more requests: computed-token shares over the
    window stay within 10 % of each other."""
    eng = FakeEngine(max_num_seqs=4, max_num_batched_tokens=64, scheduling_policy="fair", num_blocks=2048,
                     enable_prefix_caching=False)
    for i in range(300):
        eng.add(f"h{i}", 24, 16, tenant="heavy")
        if i % 10 == 0:
            eng.add(f"l{i}", 24, 16, tenant="light")
    served = {"heavy": 0, "light": 0}
    while any(s.tenant == "light" and s.status is SequenceStatus.WAITING for s in eng.live):
        for seq, n in eng.step().scheduled:
            served[seq.tenant] += n
    share = served["light"] / sum(served.values())
    assert abs(share - 0.5) <= 0.05, f"light tenant's share {share:.2f}"
