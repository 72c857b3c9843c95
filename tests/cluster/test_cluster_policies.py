"""Cluster policies without a Ray cluster: admission, routing, autoscaling, and their thin adapters."""

import asyncio
import time
from dataclasses import replace
from types import SimpleNamespace

import pytest
import yaml

from conveyor.cluster.admission_actor import AdmissionActor, AdmissionClient
from conveyor.cluster.admission_config import AdmissionConfig
from conveyor.cluster.admission_controller import AdmissionController, Decision
from conveyor.cluster.admission_metrics import prometheus_text
from conveyor.cluster.admission_snapshot import from_snapshot, restore, snapshot
from conveyor.cluster.autoscaling import (
    KVCacheAutoscalingPolicy,
    KVScalingConfig,
    autoscaling_metrics,
    desired_replicas,
)
from conveyor.cluster.prefix_index import PrefixIndex
from conveyor.cluster.routing import (
    Candidate,
    KVAwareRequestRouter,
    RouterConfig,
    RoutingHint,
    choose,
    find_hint,
    score_replicas,
)
from conveyor.cluster.stats import ReplicaStats, block_hashes, num_blocks, push_due
from conveyor.cluster.watermarks import Watermarks
from conveyor.engine.stats import EngineStats


def rs(
    rid: str,
    used: int = 0,
    total: int = 100,
    waiting: int = 0,
    waiting_tokens: int = 0,
    running: int = 0,
    preemptions: int = 0,
    ts: float = 0.0,
) -> ReplicaStats:
    return ReplicaStats(
        rid,
        num_running=running,
        num_waiting=waiting,
        num_waiting_tokens=waiting_tokens,
        kv_blocks_total=total,
        kv_blocks_free=total - used,
        num_preemptions=preemptions,
        timestamp=ts,
    )


# ---------------------------------------------------------------- stats


def test_replica_stats_from_engine_dict():
    e = EngineStats(
        num_running=3,
        num_waiting=2,
        num_waiting_tokens=40,
        kv_blocks_total=100,
        kv_blocks_free=30,
        num_preemptions=1,
        timestamp=5.0,
    )
    s = ReplicaStats.from_dict({**e.to_dict(), "replica_id": "r1"})
    assert s == ReplicaStats.from_engine("r1", e)
    assert (s.replica_id, s.num_running, s.kv_blocks_used, s.num_preemptions, s.timestamp) == ("r1", 3, 70, 1, 5.0)
    assert s.kv_cache_utilization == pytest.approx(0.7)
    assert s.waiting_blocks() == 3 and s.kv_pressure() == pytest.approx(0.73)
    assert ReplicaStats.from_dict(s.to_dict()) == s
    assert ReplicaStats("x").kv_pressure() == 1.0  # no capacity known: treat as full


def test_block_counts_follow_the_replicas_block_size():
    """A replica with 32-token blocks reports them: its waiting prompt tokens fill half as many blocks."""
    e = EngineStats(num_waiting_tokens=64, kv_blocks_total=16, kv_blocks_free=16, block_size=32)
    s = ReplicaStats.from_engine("r", e)
    assert s.block_size == 32 and s.waiting_blocks() == 2 and s.kv_pressure() == pytest.approx(0.125)
    assert push_due(s, ReplicaStats.from_engine("r", replace(e, num_waiting_tokens=128)), 0.0, 0.01)  # 2 -> 4 blocks
    assert not push_due(s, ReplicaStats.from_engine("r", replace(e, num_waiting_tokens=90)), 0.0, 0.01)  # 2 -> 3


def test_block_hashes_chain_full_blocks_only():
    ids = list(range(50))
    h = block_hashes(ids, 16)
    assert len(h) == 3 and len(set(h)) == 3 and all(isinstance(x, bytes) for x in h)
    assert block_hashes(ids[:48], 16) == h and block_hashes(ids[:47], 16) == h[:2]
    assert block_hashes(ids + [7, 8], 16) == h
    other = block_hashes([99] + ids[1:], 16)
    assert all(a != b for a, b in zip(h, other))  # a change in block 0 changes every later hash
    assert block_hashes(list(range(16, 32)), 16)[0] != h[1]  # same tokens, different parent
    assert block_hashes([], 16) == [] and num_blocks(0, 16) == 0 and num_blocks(17, 16) == 2


def test_push_due_interval_and_big_changes():
    a = rs("r", used=10)
    assert push_due(None, a, 0.0, 0.0)
    assert not push_due(a, rs("r", used=12), 0.0, 0.05)
    assert push_due(a, rs("r", used=12), 0.0, 0.1)
    assert push_due(a, rs("r", used=30), 0.0, 0.01)
    assert push_due(a, rs("r", used=10, preemptions=1), 0.0, 0.01)
    assert push_due(a, rs("r", used=10, waiting=1), 0.0, 0.01)


def test_push_due_an_idle_unchanged_replica_only_as_a_heartbeat():
    idle = rs("r", used=2, ts=1.0)
    assert not push_due(idle, rs("r", used=2, ts=1.1), 0.0, 0.1, idle_interval_s=0.2)  # nothing moved
    assert push_due(idle, rs("r", used=2, ts=1.2), 0.0, 0.2, idle_interval_s=0.2)  # the heartbeat
    assert push_due(idle, rs("r", used=3, ts=1.1), 0.0, 0.1, idle_interval_s=0.2)  # a block freed or taken
    busy = rs("r", used=2, running=1)
    assert push_due(busy, rs("r", used=2, running=1), 0.0, 0.1, idle_interval_s=0.2)  # running: every interval
    assert push_due(idle, rs("r", used=2), 0.0, 0.1)  # no heartbeat set: every interval as before


def test_prefix_index_lru_evicts_deep_blocks_first():
    idx = PrefixIndex(max_blocks_per_replica=4)
    h = block_hashes(list(range(16 * 3)), 16)
    idx.record("a", h)
    assert idx.match("a", h) == 3 and idx.match("a", h[:2]) == 2 and idx.match("b", h) == 0
    g = block_hashes(list(range(1000, 1032)), 16)
    idx.record("a", g)
    assert idx.size("a") == 4
    assert idx.match("a", g) == 2 and idx.match("a", h) == 2  # h's deepest block went first
    idx.retain(["b"])
    assert idx.replicas() == [] and idx.match("a", h) == 0
    idx.record("c", h, capacity=2)  # the replica's KV cache holds 2 blocks: the rest was evicted there
    assert idx.size("c") == 2 and idx.match("c", h) == 2


# ---------------------------------------------------------------- admission


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


def test_admission_actor_body_and_metrics():
    clock = [10.0]
    actor = AdmissionActor({"staleness_s": 1.0, "drop_after_s": 3.0}, clock=lambda: clock[0])
    actor.report({**EngineStats(kv_blocks_total=64, kv_blocks_free=60).to_dict(), "replica_id": "r1"})
    actor.report({**EngineStats(kv_blocks_total=64, kv_blocks_free=1).to_dict(), "replica_id": "r2"})
    snap = actor.snapshot()
    assert [r["replica_id"] for r in snap["replicas"]] == ["r1", "r2"]
    assert [r["admitting"] for r in snap["replicas"]] == [True, False]
    text = prometheus_text(snap)
    assert 'conveyor_replica_saturated{replica="r2"} 1.0' in text and "conveyor_cluster_admitting 1.0" in text
    actor.forget("r2")
    clock[0] = 14.0
    assert actor.snapshot()["replicas"] == []  # r1 stopped reporting: dropped
    actor.configure({"high_watermark": 0.95})
    assert actor.controller.config.high_watermark == 0.95


class FakeActor:
    """AdmissionActor behind awaitable `.remote()` calls, like a Ray actor handle; can be made to die."""

    def __init__(self, body: AdmissionActor):
        self.body, self.dead = body, False
        self.snapshot = SimpleNamespace(remote=self._snapshot)
        self.sync = SimpleNamespace(remote=self._sync)

    async def _snapshot(self) -> dict:
        if self.dead:
            raise RuntimeError("actor died")
        return self.body.snapshot()

    async def _sync(self, *args) -> dict:
        if self.dead:
            raise RuntimeError("actor died")
        return self.body.sync(*args)


def test_admission_client_refreshes_reserves_and_reresolves_the_actor():
    clock = [0.0]
    body = AdmissionActor({"settle_s": 0.3}, clock=lambda: clock[0])
    actors: list[FakeActor] = []

    async def get_actor() -> FakeActor:
        actors.append(FakeActor(body))
        return actors[-1]

    async def scenario() -> None:
        client = AdmissionClient(get_actor, clock=lambda: clock[0])
        d = await client.decide(4)
        assert (d.admit, d.reason) == (False, "no_replicas") and len(actors) == 1  # looked once more, still none
        body.report({**EngineStats(kv_blocks_total=10, kv_blocks_free=10).to_dict(), "replica_id": "r"})
        assert (await client.decide(4)).reason == "no_replicas"  # looked just now: no second fetch
        clock[0] = 0.1
        body.report({**EngineStats(kv_blocks_total=10, kv_blocks_free=10).to_dict(), "replica_id": "r"})
        d = await client.decide(4)  # no refresh ran since: decide fetches one snapshot before refusing
        assert d.admit and d.replicas == ["r"]
        assert (await client.decide(4)).admit
        d = await client.decide(4)  # 8 of 10 blocks reserved locally, no remote call
        assert (d.admit, d.reason) == (False, "no_room")
        actors[-1].dead = True
        with pytest.raises(RuntimeError):
            await client.refresh()
        clock[0] = 0.5
        body.report({**EngineStats(kv_blocks_total=10, kv_blocks_free=10, num_added=2).to_dict(), "replica_id": "r"})
        await client.refresh()  # a new handle; stats counting the 2 admitted requests' arrival settle them
        assert len(actors) == 2 and client.controller.room("r") == 10
        assert client.snapshot["totals"]["replicas"] == 1

    asyncio.run(scenario())


def test_admission_client_syncs_slower_while_nothing_happens_and_wakes_on_a_request():
    body = AdmissionActor({"staleness_s": 0.6, "quiet_when_idle": True})
    body.report({**EngineStats(kv_blocks_total=10, kv_blocks_free=10).to_dict(), "replica_id": "r"})
    syncs: list[float] = []

    async def get_actor() -> FakeActor:
        actor = FakeActor(body)
        inner = actor.sync.remote

        async def counted(*args):
            syncs.append(time.monotonic())
            return await inner(*args)

        actor.sync = SimpleNamespace(remote=counted)
        return actor

    async def scenario() -> None:
        client = AdmissionClient(get_actor, refresh_s=0.02)
        client.start()
        await asyncio.sleep(0.5)
        assert client.idle_refresh_s == pytest.approx(0.2)  # the actor's staleness bound / 3
        assert client.quiet and 2 <= len(syncs) <= 4  # every 0.2 s, not every 0.02 s
        before = len(syncs)
        d = await client.decide(2)
        assert d.admit
        await asyncio.sleep(0.01)
        assert len(syncs) == before + 1  # the request woke a sync at once
        body.report({**EngineStats(kv_blocks_total=10, kv_blocks_free=8, num_running=1).to_dict(), "replica_id": "r"})
        await asyncio.sleep(0.3)
        assert not client.quiet and len(syncs) >= before + 5  # a replica at work: every refresh_s again
        body.report({**EngineStats(kv_blocks_total=10, kv_blocks_free=10).to_dict(), "replica_id": "r"})
        body.configure({"quiet_when_idle": False})  # the default: idle or not, every refresh_s
        await asyncio.sleep(0.1)
        before = len(syncs)
        await asyncio.sleep(0.2)
        assert not client.quiet and len(syncs) >= before + 5
        client._task.cancel()

    asyncio.run(scenario())


def test_admission_client_bounded_wait_queue():
    body = AdmissionActor({"queue_timeout_s": 5.0, "max_queued": 1})

    def report(free: int) -> None:
        body.report({**EngineStats(kv_blocks_total=10, kv_blocks_free=free).to_dict(), "replica_id": "r"})

    async def get_actor() -> FakeActor:
        return FakeActor(body)

    async def scenario() -> None:
        client = AdmissionClient(get_actor)
        report(0)
        await client.refresh()
        waiter = asyncio.create_task(client.decide(4))
        await asyncio.sleep(0.01)
        assert client.queued == 1 and not waiter.done()
        assert (await client.decide(4)).reason == "saturated"  # the queue is full: refused at once
        report(10)
        await client.refresh()
        d = await asyncio.wait_for(waiter, 1.0)
        assert d.admit and client.queued == 0 and client.controller.room("r") == 6
        body.configure({"queue_timeout_s": 0.1})
        report(0)
        await client.refresh()
        start = time.monotonic()
        d = await client.decide(4)  # nobody frees room: refused at the deadline
        assert d.reason == "saturated" and 0.1 <= time.monotonic() - start < 1.0 and client.queued == 0

    asyncio.run(scenario())


# ---------------------------------------------------------------- routing

CFG = RouterConfig()


def test_router_scores_affinity_headroom_queue():
    idx = PrefixIndex()
    h = block_hashes(list(range(64)), 16)
    idx.record("a", h[:3])
    cands = [
        Candidate("a", rs("a", used=40, running=2)),
        Candidate("b", rs("b", used=40, running=2)),
        Candidate("c", rs("c", used=10, running=2)),
        Candidate("d", rs("d", used=40, running=9)),
    ]
    scored = {s.replica_id: s for s in score_replicas(cands, h, idx, CFG)}
    assert scored["a"].affinity == 0.75 and scored["b"].affinity == 0.0
    assert scored["a"].score > scored["c"].score > scored["b"].score > scored["d"].score
    assert choose(score_replicas(cands, h, idx, CFG), CFG)[0] == "a"
    assert choose(score_replicas(cands, (), idx, CFG), CFG)[0] == "c"


def test_router_skips_replicas_above_high_watermark_with_hysteresis():
    idx = PrefixIndex()
    h = block_hashes(list(range(32)), 16)
    idx.record("a", h)
    cands = [Candidate("a", rs("a", used=95)), Candidate("b", rs("b", used=50))]
    scored = score_replicas(cands, h, idx, CFG)
    assert choose(scored, CFG) == ["b"]
    was = {s.replica_id: s.saturated for s in scored}
    cands[0] = Candidate("a", rs("a", used=80))
    assert choose(score_replicas(cands, h, idx, CFG, was), CFG) == ["b"]
    assert choose(score_replicas(cands, h, idx, CFG, {}), CFG)[0] == "a"


def test_router_falls_back_when_preferred_overloaded_vs_least_loaded():
    idx = PrefixIndex()
    h = block_hashes(list(range(64)), 16)
    idx.record("a", h)
    cfg = RouterConfig(max_queue_imbalance=4, max_pressure_imbalance=0.5)
    busy = [Candidate("a", rs("a", used=30, running=12)), Candidate("b", rs("b", used=30, running=2))]
    assert choose(score_replicas(busy, h, idx, cfg), cfg) == ["b", "a"]
    calm = [
        Candidate("a", rs("a", used=30, running=5)),
        Candidate("b", rs("b", used=30, running=2)),
        Candidate("c", rs("c", used=60, running=40)),
    ]  # a very busy c elsewhere does not matter
    assert choose(score_replicas(calm, h, idx, cfg), cfg)[0] == "a"
    hot = [Candidate("a", rs("a", used=85)), Candidate("b", rs("b", used=20))]
    assert choose(score_replicas(hot, h, idx, cfg), cfg)[0] == "b"  # pressure gap 0.65 > 0.5
    inflight = [Candidate("a", rs("a", used=30), ongoing=20), Candidate("b", rs("b", used=30))]
    assert choose(score_replicas(inflight, h, idx, cfg), cfg)[0] == "b"  # router's own in-flight count


def test_router_prefers_fresh_pressure_and_ongoing_over_routing_stats():
    idx = PrefixIndex()
    h = block_hashes(list(range(64)), 16)
    idx.record("a", h)
    stale = [Candidate("a", rs("a", used=95, running=8)), Candidate("b", rs("b", used=10))]
    assert choose(score_replicas(stale, h, idx, CFG), CFG)[0] == "b"  # a looks full in its old stats
    fresh = [
        Candidate("a", rs("a", used=95, running=8), ongoing=1, pressure=0.3),
        Candidate("b", rs("b", used=10), ongoing=0, pressure=0.1),
    ]
    scored = score_replicas(fresh, h, idx, CFG)
    assert choose(scored, CFG)[0] == "a" and scored[0].load == 1 and scored[0].pressure == 0.3
    hot = [Candidate("a", rs("a", used=10), pressure=0.95), Candidate("b", rs("b", used=50))]
    assert choose(score_replicas(hot, h, idx, CFG), CFG) == ["b"]  # admission's pressure saturates a


def test_admission_kv_demand_counts_reservations():
    c = AdmissionController(AdmissionConfig(block_size=16))
    c.update(rs("a", used=50, waiting=1, waiting_tokens=16 * 10), now=0.0)
    c.update(rs("b", used=20), now=0.4)
    assert c.kv_demand("a") == pytest.approx(0.6)
    c.reserve("a", 20, now=0.0)
    assert c.kv_demand("a") == pytest.approx(0.8)
    assert c.kv_demands(now=0.7) == {"b": pytest.approx(0.2)}  # a is stale by then


def test_router_all_saturated_least_loaded_and_allowed_first():
    cands = [Candidate("a", rs("a", used=99, running=5)), Candidate("b", rs("b", used=95, running=1))]
    assert choose(score_replicas(cands, (), PrefixIndex(), CFG), CFG) == ["b", "a"]
    cands = [Candidate("a", rs("a", used=10)), Candidate("b", rs("b", used=50)), Candidate("c", rs("c", used=20))]
    assert choose(score_replicas(cands, (), PrefixIndex(), CFG), CFG, allowed=["c", "b"]) == ["c", "b", "a"]
    assert choose([], CFG) == []


def test_routing_hint_and_lookup():
    ids = list(range(40))
    hint = RoutingHint.from_token_ids(ids, 16, replicas=["r1"])
    assert hint.prefix_hashes == tuple(block_hashes(ids, 16)) and hint.num_prompt_blocks == 3
    assert find_hint(["req"], {"routing_hint": hint}) is hint
    assert find_hint(["req", hint], {}) is hint
    assert find_hint(["req"], {}) is None
    foreign = SimpleNamespace(prefix_hashes=hint.prefix_hashes, num_prompt_blocks=3, replicas=())
    assert find_hint(["req"], {"routing_hint": foreign}) is foreign  # same shape, another class object


class FakeReplica:
    def __init__(self, rid: str, stats: dict):
        from ray.serve._private.common import DeploymentID, ReplicaID

        self.replica_id = ReplicaID(rid, DeploymentID(name="llm", app_name="conveyor"))
        self.routing_stats = stats
        self.max_ongoing_requests = 64


def _router(**kwargs) -> KVAwareRequestRouter:
    from ray.serve._private.common import DeploymentHandleSource, DeploymentID

    router = KVAwareRequestRouter(
        deployment_id=DeploymentID(name="llm", app_name="conveyor"),
        handle_source=DeploymentHandleSource.UNKNOWN,
        use_replica_queue_len_cache=True,
    )
    router.initialize_state(**kwargs)
    return router


def test_kv_aware_request_router_smoke():
    router = _router(max_queue_imbalance=100)

    def es(free: int, running: int) -> dict:
        return EngineStats(num_running=running, kv_blocks_total=100, kv_blocks_free=free).to_dict()

    reps = [FakeReplica("r1", es(90, 0)), FakeReplica("r2", es(60, 3)), FakeReplica("r3", {})]
    hint = RoutingHint.from_token_ids(list(range(64)), 16)
    pr = SimpleNamespace(
        args=["req"], kwargs={"routing_hint": hint}, routing_context=SimpleNamespace(should_backoff=False)
    )
    ranks = asyncio.run(router.choose_replicas(reps, pr))
    assert pr.routing_context.should_backoff
    assert all(len(r) == 1 for r in ranks) and ranks[0][0].replica_id.unique_id in {"r1", "r3"}
    router.on_request_routed(pr, reps[1].replica_id, None)
    assert router.index.match("r2", hint.prefix_hashes) == 4
    assert asyncio.run(router.choose_replicas(reps, pr))[0][0] is reps[1]  # affinity now wins
    assert asyncio.run(router.choose_replicas(reps, None))[0][0] is not reps[1]
    router.on_new_queue_len_info(reps[2].replica_id, 30)  # r3 has no stats, but 30 requests in flight
    assert asyncio.run(router.choose_replicas(reps, None))[0][0] is reps[0]
    reps[1].routing_stats = es(2, 3)  # above the high watermark: skipped despite affinity
    assert reps[1] not in [r[0] for r in asyncio.run(router.choose_replicas(reps, pr))]
    pr.kwargs["routing_hint"] = RoutingHint.from_token_ids(list(range(64)), 16, kv_demand={"r2": 0.2})
    assert asyncio.run(router.choose_replicas(reps, pr))[0][0] is reps[1]  # admission's fresher view wins
    router.on_replica_actor_died(reps[1].replica_id)
    assert router.index.match("r2", hint.prefix_hashes) == 0 and "r2" not in router.saturated
    small = FakeReplica("r4", EngineStats(kv_blocks_total=3, kv_blocks_free=3).to_dict())

    async def route_to_small() -> None:
        router.update_replicas([reps[0], small])
        router.on_request_routed(pr, small.replica_id, None)

    asyncio.run(route_to_small())
    assert router.index.size("r4") == 3  # the index holds no more than the replica's cache


# ---------------------------------------------------------------- autoscaling

SCALE = KVScalingConfig(
    target_kv_utilization=0.5,
    tolerance=0.1,
    target_waiting_per_replica=4,
    upscale_delay_s=0.0,
    downscale_delay_s=10.0,
    min_replicas=1,
    max_replicas=6,
)


def test_autoscaling_up_down_hold():
    assert desired_replicas(2, [0.9, 0.7], [0, 0], SCALE, {}, 0.0) == 4  # ceil(2 * 0.8 / 0.5)
    assert desired_replicas(2, [0.52, 0.5], [0, 0], SCALE, {}, 0.0) == 2  # inside the dead band
    assert desired_replicas(4, [0.2] * 4, [0] * 4, SCALE, {}, 0.0) == 4  # down needs 10 s
    state: dict = {}
    assert desired_replicas(4, [0.2] * 4, [0] * 4, SCALE, state, 0.0) == 4
    assert desired_replicas(4, [0.2] * 4, [0] * 4, SCALE, state, 9.0) == 4
    assert desired_replicas(4, [0.2] * 4, [0] * 4, SCALE, state, 10.0) == 2  # ceil(4 * 0.2 / 0.5)
    assert state == {}


def test_autoscaling_hysteresis_resets_and_no_flap():
    state: dict = {}
    assert desired_replicas(4, [0.2] * 4, [0] * 4, SCALE, state, 0.0) == 4
    assert desired_replicas(4, [0.5] * 4, [0] * 4, SCALE, state, 5.0) == 4  # load came back: timer reset
    assert desired_replicas(4, [0.2] * 4, [0] * 4, SCALE, state, 12.0) == 4
    assert desired_replicas(4, [0.2] * 4, [0] * 4, SCALE, state, 22.0) == 2
    n, util = 1, 0.95  # after scaling to ceil(n u / t) the new per-replica load holds steady
    m = desired_replicas(n, [util], [0], SCALE, {}, 0.0)
    assert m == 2 and desired_replicas(m, [n * util / m] * m, [0] * m, SCALE, {}, 100.0) == m


def test_autoscaling_bounds_waiting_and_starting():
    assert desired_replicas(4, [1.0] * 4, [0] * 4, SCALE, {}, 0.0) == 6  # max
    assert desired_replicas(2, [0.0, 0.0], [0, 0], SCALE, {}, 100.0) == 2  # down after delay...
    state: dict = {}
    desired_replicas(2, [0.0, 0.0], [0, 0], SCALE, state, 0.0)
    assert desired_replicas(2, [0.0, 0.0], [0, 0], SCALE, state, 10.0) == 1  # ...never below min
    assert desired_replicas(2, [0.5, 0.5], [10, 10], SCALE, {}, 0.0) == 5  # ceil(2 * 10 / 4)
    assert desired_replicas(4, [0.1, 0.1], [0, 0], SCALE, {"kv_down_since": -99.0}, 0.0) == 4  # 2 of 4 up
    assert desired_replicas(3, [], [], SCALE, {}, 0.0) == 3
    assert desired_replicas(9, [0.5] * 9, [0] * 9, SCALE, {"kv_down_since": 0.0}, 10.0) == 6


def test_autoscaling_metrics_from_stats():
    """Autoscaling reads the blocks committed (held, waiting prompts', likely growth), not only those held."""
    s = EngineStats(num_waiting=3, num_waiting_tokens=20, kv_blocks_total=10, kv_blocks_free=4, num_growth_blocks=1)
    m = autoscaling_metrics(s)  # 6 held + 2 for the 20 waiting prompt tokens + 1 of growth, not 6
    assert m == {"kv_demand": pytest.approx(0.9), "num_waiting": 3.0, "num_waiting_tokens": 20.0}
    assert all(isinstance(v, float) for v in m.values())


SERVE_YAML = """
applications:
- name: conveyor
  route_prefix: /
  import_path: conveyor.deployments.app:app
  deployments:
  - name: LLMReplica
    max_ongoing_requests: 64
    autoscaling_config:
      min_replicas: 1
      max_replicas: 4
      look_back_period_s: 15
      upscale_delay_s: 0
      downscale_delay_s: 0
      policy:
        policy_function: conveyor.cluster.autoscaling:KVCacheAutoscalingPolicy
        policy_kwargs: {target_kv_utilization: 0.7, tolerance: 0.1, target_waiting_per_replica: 4,
                        upscale_delay_s: 5, downscale_delay_s: 60}
    request_router_config:
      request_router_class: conveyor.cluster.routing:KVAwareRequestRouter
      request_routing_stats_period_s: 0.5
      request_routing_stats_timeout_s: 2
      request_router_kwargs: {affinity_weight: 1.0, headroom_weight: 0.5, queue_weight: 0.5,
                              high_watermark: 0.9, low_watermark: 0.75, max_queue_imbalance: 8}
"""


def test_serve_config_yaml_builds_policy_and_router():
    from ray.serve._private.autoscaling_state import _resolve_policy_callable
    from ray.serve.autoscaling_policy import _apply_autoscaling_config
    from ray.serve.config import AutoscalingConfig, AutoscalingContext, RequestRouterConfig
    from ray.serve.schema import ServeDeploySchema

    from tests.cluster.autoscaling_context import autoscaling_context

    dep = ServeDeploySchema(**yaml.safe_load(SERVE_YAML)).applications[0].deployments[0]
    router_cfg = RequestRouterConfig(**dep.request_router_config)
    assert router_cfg.get_request_router_class() is KVAwareRequestRouter
    assert RouterConfig(**router_cfg.request_router_kwargs).max_queue_imbalance == 8
    autoscaling = AutoscalingConfig(**dep.autoscaling_config)
    policy = _resolve_policy_callable(autoscaling.policy)
    assert isinstance(policy, KVCacheAutoscalingPolicy) and policy.config.downscale_delay_s == 60

    def ctx(util: list[float], t: float, state: dict) -> AutoscalingContext:
        ids = [f"r{i}" for i in range(len(util))]
        metrics = {"kv_demand": dict(zip(ids, util)), "num_waiting": dict.fromkeys(ids, 0.0)}
        return autoscaling_context("LLMReplica", metrics, ids, autoscaling, t, state, 1, 4)

    wrapped = _apply_autoscaling_config(policy)  # Ray's own wrapper: bounds, factors, its (zero) delays
    n, state = wrapped(ctx([0.9, 0.9], 0.0, {}))
    assert n == 2 and "kv_up_since" in state  # our 5 s upscale delay runs
    n, state = wrapped(ctx([0.9, 0.9], 5.0, state))
    assert n == 3  # ceil(2 * 0.9 / 0.7)
    n, _ = wrapped(ctx([1.0] * 3, 5.0, {"kv_up_since": 0.0}))
    assert n == 4  # ceil(3 / 0.7) = 5, bounded by max_replicas


def test_router_skips_excluded_replicas_unless_none_is_left():
    """A handoff refused by a decode replica goes elsewhere (RoutingHint.exclude); with no other replica the
    excluded one is still ranked (it answers the retry with a refusal of its own)."""
    router = _router()
    idle = EngineStats(kv_blocks_total=100, kv_blocks_free=100).to_dict()
    reps = [FakeReplica("r1", idle), FakeReplica("r2", idle)]

    def ranked(exclude: tuple[str, ...], replicas: list = reps) -> list[str]:
        hint = RoutingHint(num_prompt_blocks=2, exclude=exclude)
        pr = SimpleNamespace(args=[], kwargs={"routing_hint": hint}, routing_context=SimpleNamespace())
        return [r[0].replica_id.unique_id for r in asyncio.run(router.choose_replicas(replicas, pr))]

    assert ranked(()) == ["r1", "r2"]
    assert ranked(("r1",)) == ["r2"]
    assert ranked(("r1", "r2")) == ["r1", "r2"]
    assert ranked(("r1",), reps[:1]) == ["r1"]
