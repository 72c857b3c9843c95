"""The admission actor's body and a router's AdmissionClient against it (behind a fake Ray handle): refreshes,
reservations, a dead actor re-resolved, idle syncing, the bounded wait queue."""

import asyncio
import time
from types import SimpleNamespace

import pytest

from conveyor.cluster.admission_actor import AdmissionActor, AdmissionClient
from conveyor.cluster.admission_metrics import prometheus_text
from conveyor.engine.stats import EngineStats


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
    decode = AdmissionActor(clock=lambda: clock[0])
    decode.report({**EngineStats(kv_blocks_total=8, kv_blocks_free=8).to_dict(), "replica_id": "d1"})
    both = prometheus_text(snap, roles={"prefill": snap, "decode": decode.snapshot()})  # a disaggregated app's
    assert 'conveyor_replica_saturated{role="prefill",replica="r2"} 1.0' in both
    assert 'conveyor_replica_kv_blocks_free{role="decode",replica="d1"} 8.0' in both
    assert 'conveyor_cluster_kv_blocks_total{role="decode"} 8.0' in both
    assert both.count("# TYPE conveyor_replica_saturated gauge") == 1  # one family, both roles' series
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
