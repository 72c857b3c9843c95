"""Measured service rates and the queue-time objective: the wait a replica's queue predicts, and admission's
refusal with Retry-After beyond max_queue_time_s."""

import math

import pytest

from conveyor.cluster.admission_config import AdmissionConfig
from conveyor.cluster.admission_controller import AdmissionController
from conveyor.cluster.admission_snapshot import restore, snapshot
from conveyor.cluster.queue_time import queue_time_s, retry_after_s
from conveyor.cluster.stats import Rates, ReplicaStats
from tests.cluster.replica_stats import stats


def test_rates_per_busy_second_decay_over_the_window():
    prev = ReplicaStats.from_dict(stats("r"))
    cur = ReplicaStats.from_dict(stats("r", busy=2.0, prefill=2000, decode=400, finished=4))
    r = Rates().update(prev, cur, window_s=4.0)
    assert (r.prefill_tokens_per_s, r.decode_tokens_per_s, r.finished_per_s) == (1000.0, 200.0, 2.0)
    later = ReplicaStats.from_dict(stats("r", busy=6.0, prefill=2000, decode=2400, finished=4))
    r2 = r.update(cur, later, window_s=4.0)
    assert r2.prefill_tokens_per_s < 1000 * math.exp(-1) / (1 + 0) and r2.decode_tokens_per_s > 200
    assert r2.update(later, later) is r2  # no busy time passed: nothing learnt


def test_queue_time_slots_and_prefill_bottlenecks():
    rates = Rates(prefill_tokens_per_s=1000.0, decode_tokens_per_s=500.0, finished_per_s=4.0)
    s = lambda **kw: ReplicaStats.from_dict(stats("r", seqs=8, **kw))
    assert queue_time_s(s(running=3), rates) == 0.0  # a free slot, nothing queued
    # prefill-bound: queued prompt tokens drain at every token computed per busy second (1000 + 500)
    assert queue_time_s(s(running=3, waiting=2, waiting_tokens=3000), rates) == 2.0
    assert queue_time_s(s(running=8, waiting=7, waiting_tokens=700), rates) == 2.0  # 8 must finish first
    assert queue_time_s(s(running=8, waiting=7), rates, extra_requests=4) == 3.0  # admitted, not yet seen
    assert queue_time_s(s(running=8), Rates()) == math.inf  # full and no finish rate measured
    assert queue_time_s(s(running=4, free=20), rates) == 0.0  # 4 use 80 of 100 blocks: 1 more fits, not 4
    assert queue_time_s(s(running=4, free=20, waiting=1), rates) == 0.25
    timed = Rates(prefill_tokens_per_s=1000.0, finished_per_s=4.0, steps_per_s=20.0)
    cohort = ReplicaStats.from_dict({**stats("r", seqs=4, running=4, waiting=1), "tokens_left": [40, 60, 100, 120]})
    assert queue_time_s(cohort, timed) == 3.0  # 2 must finish: the second-shortest has 60 tokens at 20 steps/s
    assert queue_time_s(cohort, timed, extra_requests=5) == 6.0 + 3 / 4.0  # 7 must: 4 done in 6 s, then 3 more
    assert retry_after_s(3.2, 2.0, 1.0) == 2.0 and retry_after_s(2.1, 2.0, 1.0) == 1.0
    assert retry_after_s(math.inf, 2.0, 1.0) == 1.0


def test_reservations_queue_their_prompts_not_their_outputs():
    """A decode-heavy replica measured 302 prompt and 1684 sampled tokens per busy second: 8 requests admitted to
    it while idle (2 prompt blocks and 8 output blocks each, 32 free slots) are 256 prompt tokens of prefill
    ahead of the next, not 1280 tokens at the prompt rate."""
    c = AdmissionController(AdmissionConfig(queue_time_safety=1.0, block_size=16))
    c.update(ReplicaStats.from_dict(stats("a", free=1000, total=1000, seqs=32)), 0.0)
    later = stats("a", free=1000, total=1000, seqs=32, busy=1.0, prefill=302, decode=1684, finished=17, ts=1.0)
    c.update(ReplicaStats.from_dict(later), 0.1)
    for _ in range(8):
        d = c.decide(2, 0.2, output_tokens=128)
        assert d.admit and (d.new_blocks, d.prefill_blocks) == (10, 2)
        c.reserve(d.replicas[0], d.new_blocks, 0.2, prefill_blocks=d.prefill_blocks)
    assert c.queue_time("a") == pytest.approx(8 * 32 / (302 + 1684))
    assert c.queue_time("a", shared=0) == c.queue_time("a")  # all newer than its last stats
    restored = AdmissionController()
    restore(restored, snapshot(c, 0.2), 0.2)
    assert restored.queue_time("a") == pytest.approx(c.queue_time("a"))


def test_max_queue_time_refuses_with_retry_after_and_counts_reservations():
    c = AdmissionController(AdmissionConfig(max_queue_time_s=2.0, queue_time_safety=1.0))
    for rid in "ab":  # 1 s of busy time: 4 requests finished, 4000 prompt tokens
        c.update(ReplicaStats.from_dict(stats(rid, running=8)), 0.0)
        c.update(
            ReplicaStats.from_dict(stats(rid, running=8, waiting=3, busy=1.0, prefill=4000, finished=4, ts=1)), 0.1
        )
    assert c.replicas["a"].rates.finished_per_s == 4.0
    admitted = []
    for _ in range(20):
        d = c.decide(1, 0.1)
        if not d.admit:
            break
        admitted.append(d.replicas[0])
        c.reserve(d.replicas[0], 1, 0.1)
    # each replica: 3 waiting + k reserved ahead; (3 + k + 1) / 4 <= 2 s  ->  k <= 4
    assert sorted(admitted) == ["a"] * 5 + ["b"] * 5
    assert (d.reason, d.retry_after_s) == ("queue_time", 1.0) and d.queue_time_s == pytest.approx(2.25)
    assert c.decide(1, 0.1, queue_time=False).admit  # judged at the door already (deployments/door.py)
    off = AdmissionController()  # off: today's behaviour, only KV room matters
    restore(off, snapshot(c, 0.1), 0.1)
    assert off.config.max_queue_time_s == 2.0
    off.config = AdmissionConfig()
    assert off.decide(1, 0.1).admit
