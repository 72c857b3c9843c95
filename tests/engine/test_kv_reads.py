"""Prefix caching, swap and recompute at the scheduler level (tests/engine/fake_runner.py): under prefix hits,
partial-block prefixes, salts, preemption and aborts a chunk reads only its own prefix's KV and nothing
leaks; eviction order."""

import random
from collections import defaultdict

import pytest

from conveyor.engine import SamplingParams
from conveyor.engine.core.block_manager import BlockManager
from conveyor.engine.core.scheduler import Scheduler
from conveyor.engine.core.sequence import Sequence
from tests.engine.fake_runner import FakeRunner, assert_pool_consistent, make_scheduler


def random_workload(rng: random.Random, sched: Scheduler, runner: FakeRunner, num_requests: int) -> None:
    prefixes = [[rng.randrange(10, 50) for _ in range(40)] for _ in range(3)]
    arrivals: dict[int, list[Sequence]] = defaultdict(list)
    aborts: dict[int, list[Sequence]] = defaultdict(list)
    capacity = sched.kv.num_blocks * sched.kv.block_size
    for i in range(num_requests):
        prompt = rng.choice(prefixes)[: rng.randint(1, 40)] + [rng.randrange(10, 50) for _ in range(rng.randint(0, 9))]
        max_tokens = min(rng.randint(1, 24), capacity - len(prompt))
        seq = Sequence(
            str(i),
            prompt,
            SamplingParams(max_tokens=max_tokens),
            priority=rng.randint(0, 2),
            cache_salt=rng.choice([None, None, "tenant"]),
        )
        arrivals[rng.randint(0, 20)].append(seq)
        if rng.random() < 0.1:
            aborts[rng.randint(0, 40)].append(seq)
    for step in range(2000):
        for seq in arrivals.pop(step, []):
            sched.add(seq)
        for seq in aborts.pop(step, []):
            if seq.request_id in sched.requests:
                sched.finish(seq, "abort")
        if not arrivals and not sched.has_unfinished:
            return
        so, cfg = runner.step(), sched.config
        assert so.num_tokens <= cfg.max_num_batched_tokens and len(so.chunks) <= cfg.max_num_seqs
        assert not cfg.max_num_partial_prefills or sum(not c.sample for c in so.chunks) <= cfg.max_num_partial_prefills
        assert all(len(c.token_ids) <= (cfg.long_prefill_token_threshold or 10**9) for c in so.chunks)
    raise AssertionError("no progress")


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_every_kv_read_sees_what_was_written(mode: str) -> None:
    """Prefix hits, partial-block prefixes, salts, preemption (recompute, swap, swap full), aborts:
    a chunk only ever attends to KV computed from exactly its own token prefix, and nothing leaks."""
    for seed in range(120):
        rng = random.Random(seed)
        num_blocks, block_size = rng.randint(14, 30), rng.choice([4, 8])
        swap_blocks = rng.choice([2, 8, 30]) if mode == "swap" else 0
        sched = make_scheduler(
            num_blocks,
            block_size,
            swap_blocks,
            preemption_mode=mode,
            max_num_batched_tokens=rng.choice([8, 32, 96]),
            max_num_seqs=rng.randint(2, 6),
            long_prefill_token_threshold=rng.choice([0, 6]),
            max_num_partial_prefills=rng.choice([0, 1]),
            watermark=rng.choice([0.0, 0.1]),
            adaptive_watermark=rng.random() < 0.5,
            aging_rate=rng.choice([1.0, 20.0]),
        )
        runner = FakeRunner(sched)
        random_workload(rng, sched, runner, rng.randint(4, 14))
        assert_pool_consistent(sched.kv)


def test_lru_eviction_order_and_plain_blocks_first() -> None:
    kv = BlockManager(8, 4, True)
    seqs = [Sequence(name, [10 + i] * 8, SamplingParams()) for i, name in enumerate("abc")]
    for s in seqs:
        assert kv.allocate(s, 8) is not None
        s.num_computed_tokens = 8
    a, b, c = (kv.block_ids(s) for s in seqs)
    for s in seqs:
        kv.forget(s)
    assert list(kv.pool.free_cached) == a[::-1] + b[::-1] + c[::-1], "released tail-first, oldest request first"
    assert kv.allocate(Sequence("d", [1] * 8, SamplingParams()), 8) == [6, 7]
    hit = Sequence("a2", [10] * 8 + [5], SamplingParams())
    assert kv.cached_prefix(hit) == [kv.pool.blocks[i] for i in a], "a is still cached: never-cached blocks went first"
    assert kv.allocate(Sequence("e", [1] * 12, SamplingParams()), 12) == [a[1], a[0], b[1]], "LRU: a, then b's tail"
    assert kv.cached_prefix(hit) == []
    assert [x.block_id for x in kv.cached_prefix(Sequence("b2", [11] * 8 + [5], SamplingParams()))] == b[:1]
    assert [x.block_id for x in kv.cached_prefix(Sequence("c2", [12] * 8 + [5], SamplingParams()))] == c
