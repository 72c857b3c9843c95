"""The admission controller without Ray: watermarks with hysteresis, staleness, room and refusals, reservations
and how they settle, ranking by real prefix contents, and the snapshot a router restores."""

import pytest

from conveyor.cluster.admission_config import AdmissionConfig
from conveyor.cluster.admission_controller import AdmissionController, Decision
from conveyor.cluster.admission_snapshot import from_snapshot, restore, snapshot
from conveyor.cluster.stats import ReplicaStats, block_hashes
from conveyor.cluster.watermarks import Watermarks
from tests.cluster.replica_stats import events, rs, stats


def test_watermark_hysteresis():
    w = Watermarks(high=0.9, low=0.75)
    sat, seen = False, []
    for p in [0.5, 0.89, 0.95, 0.85, 0.76, 0.7, 0.85, 0.91]:
        sat = w.saturated(sat, p)
        seen.append(sat)
    assert seen == [False, False, True, True, True, False, False, True]


def test_admission_hysteresis_per_replica():
    c = AdmissionController(AdmissionConfig(high_watermark=0.9, low_watermark=0.75))
    c.update(rs("a", used=95, ts=1), now=1.0)
    c.update(rs("b", used=10, ts=1), now=1.0)
    assert c.decide(2, now=1.0).replicas == ["b"]
    c.update(rs("a", used=80, ts=2), now=1.1)  # below high but not below low: still closed
    assert c.decide(2, now=1.1).replicas == ["b"]
    c.update(rs("a", used=70, ts=3), now=1.2)
    assert c.decide(2, now=1.2).replicas == ["b", "a"]


def test_admission_counts_waiting_queue_as_pressure():
    c = AdmissionController(AdmissionConfig(block_size=16))
    c.update(rs("a", used=50, waiting=10, waiting_tokens=16 * 45), now=0.0)  # 50 used + 45 queued > 90%
    d = c.decide(1, now=0.0)
    assert not d.admit and d.reason == "saturated"


def test_admission_staleness_counts_as_saturated():
    c = AdmissionController(AdmissionConfig(staleness_s=0.5, drop_after_s=5.0))
    c.update(rs("a", used=10), now=0.0)
    c.update(rs("b", used=20), now=0.4)
    assert set(c.decide(1, now=0.4).replicas) == {"a", "b"}
    assert c.decide(1, now=0.7).replicas == ["b"]
    d = c.decide(1, now=1.0)
    assert (d.admit, d.reason) == (False, "stale") and d.retry_after_s > 0
    assert c.expire(now=5.2) == ["a"] and list(c.replicas) == ["b"]


def test_refuse_when_every_replica_saturated():
    c = AdmissionController(AdmissionConfig(retry_after_s=2.0))
    for rid in "abc":
        c.update(rs(rid, used=95), now=0.0)
    d = c.decide(1, now=0.0)
    assert d == Decision(False, [], 2.0, "saturated")


def test_admission_room_order_and_refusals():
    c = AdmissionController()
    assert c.decide(1, 0.0).reason == "no_replicas"
    c.update(rs("a", used=60), now=0.0)
    c.update(rs("b", used=30), now=0.0)
    d = c.decide(50, now=0.0)
    assert d.admit and d.replicas == ["b"]  # only b has 50 free blocks
    assert c.decide(10, now=0.0).replicas == ["b", "a"]  # most room first
    assert c.decide(80, now=0.0).reason == "no_room"
    d = c.decide(101, now=0.0)
    assert (d.admit, d.reason, d.retry_after_s) == (False, "prompt_too_large", 0.0)
    c.reserve("b", 40, now=0.0)
    assert c.decide(50, now=0.0).reason == "no_room"
    c.update(rs("b", used=30, ts=1), now=0.1)  # too soon after the reservation to include it
    assert c.decide(50, now=0.1).reason == "no_room"
    c.update(rs("b", used=30, ts=2), now=0.3)  # settle_s later: these stats include it
    assert c.decide(50, now=0.3).replicas == ["b"]


def test_admission_batch_blocks_and_largest_sequence():
    c = AdmissionController()
    c.update(rs("a", used=30), now=0.0)
    c.update(rs("b"), now=0.0)
    assert c.decide(150, now=0.0, largest_blocks=20).replicas == ["b"]  # n x prompt > a replica: needs an empty one
    assert c.decide(150, now=0.0, largest_blocks=101).reason == "prompt_too_large"
    c.reserve("b", 1, now=0.0)
    assert c.decide(150, now=0.0, largest_blocks=20).reason == "no_room"


def test_admission_commits_room_only_up_to_the_high_watermark():
    c = AdmissionController(AdmissionConfig(high_watermark=0.8, low_watermark=0.5))
    c.update(ReplicaStats.from_dict(stats("a", free=50, total=100)), 0.0)
    assert c.headroom("a") == 30 and c.decide(30, 0.0).admit and c.decide(31, 0.0).reason == "no_room"
    c.update(ReplicaStats.from_dict(stats("idle", free=100, total=100)), 0.0)
    assert c.decide(100, 0.0).replicas == ["idle"]  # a request that fits an idle replica's cache still runs
    c.reserve("idle", 75, 0.0)
    assert c.decide(6, 0.0).replicas == ["a"] and "idle" in c.decide(5, 0.0).replicas


def test_admission_kv_demand_counts_reservations():
    c = AdmissionController(AdmissionConfig(block_size=16))
    c.update(rs("a", used=50, waiting=1, waiting_tokens=16 * 10), now=0.0)
    c.update(rs("b", used=20), now=0.4)
    assert c.kv_demand("a") == pytest.approx(0.6)
    c.reserve("a", 20, now=0.0)
    assert c.kv_demand("a") == pytest.approx(0.8)
    assert c.kv_demands(now=0.7) == {"b": pytest.approx(0.2)}  # a is stale by then


def test_admission_ranks_by_real_prefix_and_reserved_prompts_attract():
    c = AdmissionController()
    h = block_hashes(list(range(160)), 16)
    for rid in "ab":
        c.update(ReplicaStats.from_dict(stats(rid)), 0.0, events(reset=True))
    c.update(ReplicaStats.from_dict(stats("b", ts=1)), 0.0, events(h[:8]))
    d = c.decide(10, 0.0, keys=h)
    assert d.replicas[0] == "b" and d.cached_blocks == {"a": 0, "b": 8}
    other = block_hashes(list(range(1000, 1160)), 16)
    d = c.decide(10, 0.0, keys=other)
    c.reserve(d.replicas[0], 10, 0.0, keys=other)  # on its way there: the next one like it follows
    assert c.decide(10, 0.0, keys=other).cached_blocks[d.replicas[0]] == 10


def test_restore_keeps_unsettled_reservations_and_takes_config():
    actor = AdmissionController(AdmissionConfig(settle_s=0.3, retry_after_s=3.0))
    actor.update(rs("a", used=50), now=100.0)
    router = from_snapshot(snapshot(actor, now=100.0), now=10.0)
    assert router.config.retry_after_s == 3.0
    router.reserve("a", 45, now=10.0)
    actor.update(rs("a", used=50, ts=1), now=100.1)
    restore(router, snapshot(actor, now=100.1), now=10.1)
    assert router.decide(10, now=10.1).reason == "no_room"
    actor.update(rs("a", used=95, ts=2), now=100.35)
    restore(router, snapshot(actor, now=100.35), now=10.35)
    assert router.room("a") == 5


def test_admission_dead_replica_dropped_and_out_of_order_ignored():
    c = AdmissionController()
    c.update(rs("a", used=10, ts=5.0), now=0.0)
    c.update(rs("a", used=99, ts=4.0), now=0.1)  # late delivery of an older report
    assert c.replicas["a"].stats.kv_blocks_used == 10
    c.forget("a")
    assert c.decide(1, now=0.1).reason == "no_replicas"
    c.update(rs("b"), now=0.0)
    c.update(rs("c"), now=0.0)
    c.retain(["c"])
    assert list(c.replicas) == ["c"]


def test_preemption_saturates_until_below_low():
    c = AdmissionController()
    c.update(rs("a", used=80, preemptions=0), now=0.0)
    c.update(rs("a", used=80, preemptions=2), now=0.1)
    assert c.decide(1, now=0.1).reason == "saturated"
    c.update(rs("a", used=50, preemptions=2), now=0.2)
    assert c.decide(1, now=0.2).admit


def test_snapshot_restore_rebases_ages():
    actor = AdmissionController()
    actor.update(rs("a", used=95), now=100.0)
    actor.update(rs("b", used=20, running=3), now=100.3)
    snap = snapshot(actor, now=100.4)
    assert snap["totals"]["replicas"] == 2 and snap["totals"]["admitting"] == 1
    assert snap["totals"]["kv_cache_utilization"] == pytest.approx(0.575)
    assert snap["totals"]["prefix_cache_hit_rate"] == 0.0
    router = from_snapshot(snap, now=7.0)  # another host, another clock
    assert router.decide(1, now=7.0).replicas == ["b"]
    # b was 0.1 s old at the sync: a router whose loop lags past staleness_s still judges it as of the sync ...
    assert router.decide(1, now=7.5).replicas == ["b"]
    assert router.decide(1, now=7.0 + 10.0).reason == "stale"  # ... up to drop_after_s
    router.synced_at = None  # cut off from the actor (AdmissionClient.refresh failed): by the clock, stale
    assert router.decide(1, now=7.5).reason == "stale"
    late = from_snapshot(snapshot(actor, now=101.0), now=7.0)  # b 0.7 s old at the actor
    assert late.decide(1, now=7.0).reason == "stale"
    assert router.replicas["a"].saturated


def test_reservations_settle_on_arrival_when_the_replica_counts_them():
    """A replica that reports num_added settles reservations when its requests arrive, not 0.3 s later: one
    whose request is late stays counted (two routers oversubscribed on the timed rule), an arrival counted
    before its reservation reached the actor settles it then, one that never arrives goes after settle_max_s."""
    c = AdmissionController(AdmissionConfig(settle_s=0.3, settle_max_s=2.0, arrival_credit_s=0.5))

    def push(t: float, added: int) -> None:
        c.update(ReplicaStats.from_dict({**stats("a", free=100, ts=t), "num_added": added}), t)

    push(0.0, 0)
    c.reserve("a", 10, 0.01)
    c.reserve("a", 20, 0.02)
    push(0.5, 1)  # 0.5 s later only the older one arrived: the timed rule would have dropped both
    assert c.reserved("a") == (20, 1)
    push(0.6, 2)
    assert c.reserved("a") == (0, 0)
    push(0.7, 3)  # an arrival whose reservation comes in after it (the router's sync lagged the stats push)
    c.reserve("a", 5, 0.72)
    assert c.reserved("a") == (0, 0)
    push(0.8, 4)
    c.reserve("a", 5, 1.4)  # that arrival is 0.6 s old: too old to be this reservation's
    assert c.reserved("a") == (5, 1)
    push(3.5, 4)  # never arrived (routed elsewhere, or refused by the replica): dropped after settle_max_s
    assert c.reserved("a") == (0, 0)
    c.reserve("a", 10, 3.6, keys=[b"k1", b"k2"])
    push(3.7, 5)  # arrived and settled, but its prefill's KV events may come later: its keys still attract
    assert c.reserved("a") == (0, 0) and c.pending_keys("a") == {b"k1", b"k2"}
    push(4.0, 5)  # settle_s after the reservation: gone
    assert c.pending_keys("a") == set()
    timed = AdmissionController(AdmissionConfig(settle_s=0.3))  # a replica without the counter: by time
    timed.update(ReplicaStats.from_dict(stats("a", free=100)), 0.0)
    timed.reserve("a", 10, 0.01)
    timed.update(ReplicaStats.from_dict(stats("a", free=100, ts=0.5)), 0.5)
    assert timed.reserved("a") == (0, 0)
