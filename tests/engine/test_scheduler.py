"""Property tests of scheduler + block pool with random arrivals, lengths and aborts."""

from dataclasses import replace

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conveyor.engine.config import EngineConfig
from conveyor.engine.core.block_manager import BlockManager
from conveyor.engine.core.scheduler import Scheduler, make_scheduler
from conveyor.engine.core.sequence import Sequence
from conveyor.engine.resolved_config import resolve
from conveyor.engine.sampling_params import SamplingParams
from conveyor.engine.step import ModelRunnerOutput

EOS = 2
BASE = resolve(EngineConfig(model="demo:tiny", attention_backend="torch"))

request = st.tuples(
    st.integers(0, 30),  # arrival step
    st.integers(1, 70),  # prompt length
    st.integers(1, 40),  # max_tokens
    st.integers(0, 3),  # prompt alphabet (shared prefixes when small)
    st.one_of(st.none(), st.integers(0, 60)),  # abort at step
    st.integers(0, 2),  # priority
)


def simulate(
    requests: list[tuple],
    num_blocks: int,
    block_size: int,
    budget: int,
    max_seqs: int,
    policy: str,
    caching: bool,
    mode: str,
    threshold: int,
    decode_cap: int = 0,
) -> None:
    cfg = replace(
        BASE,
        max_num_batched_tokens=budget,
        max_num_seqs=max_seqs,
        block_size=block_size,
        scheduling_policy=policy,
        enable_prefix_caching=caching,
        preemption_mode=mode,
        long_prefill_token_threshold=threshold,
        max_model_len=2048,
        max_prefill_tokens_while_decoding=decode_cap,
    )
    kv = BlockManager(num_blocks, block_size, caching, num_swap_blocks=num_blocks // 2 if mode == "swap" else 0)
    sched = make_scheduler(cfg, kv, {EOS})
    seqs, finished, runner_tables = {}, {}, {}
    for i, (arrival, plen, max_tokens, alphabet, abort_at, prio) in enumerate(requests):
        max_tokens = min(max_tokens, num_blocks * block_size - plen)
        if max_tokens < 1:
            continue
        prompt = [(7 * j + alphabet * (j > 20)) % 50 + 10 for j in range(plen)]
        seqs[str(i)] = (
            arrival,
            Sequence(str(i), prompt, SamplingParams(max_tokens=max_tokens), priority=prio),
            abort_at,
        )
    step = 0
    while len(finished) < len(seqs):
        for rid, (arrival, seq, abort_at) in seqs.items():
            if arrival == step:
                sched.add(seq)
            if abort_at == step and arrival <= step and not seq.is_finished:
                sched.finish(seq, "abort")
        decoding = any(len(s.token_ids) - s.num_computed_tokens == 1 for s in sched.running if not sched.pads(s))
        so = sched.schedule()
        assert so.num_tokens <= budget
        if decode_cap and decoding:
            assert sum(len(c.token_ids) for c in so.chunks if len(c.token_ids) > 1) <= decode_cap
        assert len(so.chunks) <= max_seqs and len(sched.running) <= max_seqs
        for c in so.chunks:
            table = runner_tables[c.req_id] = (
                list(c.new_block_ids) if c.reset_blocks else runner_tables[c.req_id] + c.new_block_ids
            )
            assert table == kv.block_ids(sched.requests[c.req_id])
            assert len(table) * block_size >= c.start + len(c.token_ids)
            assert len(c.token_ids) >= 1 and (not threshold or len(c.token_ids) <= max(threshold, 1))
        owners: dict[int, int] = {}
        for s in sched.running:
            for b in kv.block_ids(s):
                owners[b] = owners.get(b, 0) + 1
        assert all(kv.pool.blocks[b].ref_count == n for b, n in owners.items())
        sampled = [c.req_id for c in so.chunks if c.sample]
        tokens = [EOS if (int(r) * 31 + step) % 97 == 0 else 11 + step % 13 for r in sampled]
        sched.update(so, ModelRunnerOutput(sampled, tokens, [None] * len(sampled)), float(step))
        for rid, (_, seq, _) in seqs.items():
            if seq.is_finished:
                assert finished.setdefault(rid, seq.finish_reason) == seq.finish_reason
                assert seq.num_output_tokens <= seq.params.max_tokens
        step += 1
        assert step < 3000, "scheduler made no progress: deadlock"
    assert kv.num_free_blocks == kv.num_blocks
    assert all(b.ref_count == 0 for b in kv.pool.blocks) and not kv.tables and not kv.swapped
    assert len(kv.free_swap) == kv.num_swap_blocks
    assert not sched.has_unfinished and not sched.running and not sched.waiting


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    requests=st.lists(request, min_size=1, max_size=14),
    num_blocks=st.integers(8, 40),
    block_size=st.sampled_from([4, 8, 16]),
    budget=st.integers(1, 96),
    max_seqs=st.integers(1, 6),
    policy=st.sampled_from(["continuous", "static"]),
    caching=st.booleans(),
    mode=st.sampled_from(["recompute", "swap"]),
    threshold=st.sampled_from([0, 0, 5]),
    decode_cap=st.sampled_from([0, 0, 3, 24]),
)
def test_scheduler_invariants(
    requests, num_blocks, block_size, budget, max_seqs, policy, caching, mode, threshold, decode_cap
) -> None:
    simulate(requests, num_blocks, block_size, budget, max_seqs, policy, caching, mode, threshold, decode_cap)


def test_prefill_cap_applies_only_while_a_sequence_decodes() -> None:
    cfg = replace(BASE, max_num_batched_tokens=64, max_prefill_tokens_while_decoding=16)
    idle = Scheduler(cfg, BlockManager(64, 16, False), {EOS})
    idle.add(Sequence("a", [10] * 100, SamplingParams(max_tokens=5)))
    assert [len(c.token_ids) for c in idle.schedule().chunks] == [64], "nothing decodes: the whole budget"
    sched = Scheduler(cfg, BlockManager(64, 16, False), {EOS})
    sched.add(Sequence("b", [11] * 8, SamplingParams(max_tokens=50)))
    assert _step(sched) == ["b"] and _step(sched) == ["b"]
    sched.add(Sequence("c", [12] * 100, SamplingParams(max_tokens=5)))
    assert {c.req_id: len(c.token_ids) for c in sched.schedule().chunks} == {"b": 1, "c": 16}, "b decodes: c is capped"


def test_preemption_victim_goes_back_first_and_keeps_tokens() -> None:
    cfg = replace(BASE, block_size=4, enable_prefix_caching=False)
    kv = BlockManager(6, 4, False)
    sched = Scheduler(cfg, kv, {EOS})
    a = Sequence("a", [10] * 8, SamplingParams(max_tokens=12), arrival_time=1.0)
    b = Sequence("b", [11] * 8, SamplingParams(max_tokens=12), arrival_time=2.0)
    for s in (a, b):
        sched.add(s)
    preempted_at = None
    for step in range(40):
        so = sched.schedule()
        if b.num_preemptions and preempted_at is None:
            preempted_at = step
            assert b.num_computed_tokens == 0 and b.num_output_tokens > 0
            assert sched.waiting[0] is b and a.status.name == "RUNNING"
            assert not so.new_requests and all(c.req_id != "b" for c in so.chunks)
        sampled = [c.req_id for c in so.chunks if c.sample]
        sched.update(so, ModelRunnerOutput(sampled, [20] * len(sampled), [None] * len(sampled)), 0.0)
        if not sched.has_unfinished:
            break
    assert preempted_at is not None, "the tiny cache must force a preemption"
    assert a.finish_reason == b.finish_reason == "length"
    assert a.finish_time <= b.finish_time
    assert b.output_token_ids == [20] * 12
    assert kv.num_free_blocks == kv.num_blocks


def _step(sched: Scheduler) -> list[str]:
    so = sched.schedule()
    sampled = [c.req_id for c in so.chunks if c.sample]
    sched.update(so, ModelRunnerOutput(sampled, [20] * len(sampled), [None] * len(sampled)), 0.0)
    return [c.req_id for c in so.chunks]


def test_watermark_holds_back_admission_only_while_others_run() -> None:
    cfg = replace(BASE, block_size=4, watermark=0.5)
    kv = BlockManager(8, 4, False)
    sched = Scheduler(cfg, kv, {EOS})
    sched.add(Sequence("big", [10] * 20, SamplingParams(max_tokens=8)))
    assert _step(sched) == ["big"]
    sched.add(Sequence("small", [10] * 4, SamplingParams(max_tokens=2)))
    assert _step(sched) == ["big"], "2 free blocks < 4 held back: small must wait"
    while "big" in sched.requests:
        _step(sched)
    assert _step(sched) == ["small"], "nothing runs: the watermark no longer applies"


def test_static_policy_runs_batches_in_lockstep() -> None:
    """Request-level batching: a new batch starts only when the previous one is done, and a member
    that finishes early keeps its slot (decoding padding) until the longest member finishes."""
    cfg = replace(BASE, scheduling_policy="static", max_num_seqs=2)
    sched = make_scheduler(cfg, BlockManager(64, 16, False), {EOS})
    a = Sequence("a", [10] * 5, SamplingParams(max_tokens=1))
    b = Sequence("b", [10] * 5, SamplingParams(max_tokens=6))
    c = Sequence("c", [10] * 5, SamplingParams(max_tokens=1))
    for s in (a, b, c):
        sched.add(s)
    assert sorted(_step(sched)) == ["a", "b"]
    for _ in range(5):
        assert sorted(_step(sched)) == ["a", "b"]
    assert a.is_finished and b.is_finished and a.output_token_ids == [20] and len(b.output_token_ids) == 6
    assert _step(sched) == ["c"]
    assert sched.kv.num_free_blocks == 64
