"""A router's AdmissionClient when the admission actor cannot be reached (no Ray: an actor whose calls fail):
it fails open once its view is stale, logs it once, and is back on the actor's view as soon as a sync
succeeds; a router that never reached the actor syncs before deciding."""

import asyncio
import logging
from types import SimpleNamespace
from typing import Any

import pytest

from conveyor.cluster.admission_actor import AdmissionActor, AdmissionClient
from tests.e2e.faults import ADMISSION


class FakeAdmissionActor:
    """No Ray: `sync.remote` calls the actor body after a short await, counts calls, fails while not `alive[0]`."""

    def __init__(self, body: AdmissionActor, alive: list[bool]) -> None:
        self.syncs = 0

        async def call(*args: Any) -> dict[str, Any]:
            self.syncs += 1
            await asyncio.sleep(0.01)
            if not alive[0]:
                raise ConnectionError("actor died")
            return body.sync(*args)

        self.sync = SimpleNamespace(remote=call)


def test_admission_client_fails_open_while_the_actor_is_unreachable(caplog: pytest.LogCaptureFixture) -> None:
    """No Ray here: an actor whose calls fail. The client admits with no replica list (the request router then
    uses the replicas' own load) instead of answering 503 to everyone, logs it once, and is back on the
    actor's view as soon as a refresh succeeds."""
    body, alive = AdmissionActor(ADMISSION), [True]
    actor = FakeAdmissionActor(body, alive)

    async def get_actor() -> FakeAdmissionActor:
        return actor

    async def scenario() -> None:
        from conveyor.engine.stats import EngineStats

        client = AdmissionClient(get_actor)
        body.report({**EngineStats(kv_blocks_total=10, kv_blocks_free=10).to_dict(), "replica_id": "r"})
        d = await client.decide(2)
        assert d.admit and d.replicas == ["r"] and d.reason == "ok"
        alive[0] = False
        await asyncio.sleep(ADMISSION["staleness_s"] + 0.1)
        logger = logging.getLogger("ray.serve")
        logger.addHandler(caplog.handler)
        try:
            decisions = [await client.decide(2) for _ in range(5)]
        finally:
            logger.removeHandler(caplog.handler)
        assert all(d.admit and d.replicas == [] and d.reason == "fail_open" for d in decisions)
        assert sum("admitting without admission control" in r.message for r in caplog.records) == 1
        alive[0] = True
        body.report({**EngineStats(kv_blocks_total=10, kv_blocks_free=10).to_dict(), "replica_id": "r"})
        await client.refresh()
        d = await client.decide(2)
        assert d.admit and d.replicas == ["r"] and d.reason == "ok"
        client.controller.replicas.clear()
        body.controller.forget("r")
        assert (await client.decide(2)).reason == "no_replicas", "a reachable actor without replicas still refuses"

    asyncio.run(scenario())


def test_a_router_that_never_reached_the_actor_syncs_before_deciding_instead_of_failing_open() -> None:
    """A router starts before its replicas, so its first syncs fail; a burst that comes once the actor answers
    is decided on the actor's view (admitted up to the watermark, then refused), not failed open. The requests
    that find the view stale share one sync."""
    body, alive = AdmissionActor(ADMISSION), [False]
    actor = FakeAdmissionActor(body, [True])

    async def get_actor() -> FakeAdmissionActor:
        if not alive[0]:
            raise ConnectionError("no replica yet")
        return actor

    async def scenario() -> None:
        from conveyor.engine.stats import EngineStats

        client = AdmissionClient(get_actor)
        with pytest.raises(ConnectionError):
            await client.refresh()
        alive[0] = True
        body.report({**EngineStats(kv_blocks_total=10, kv_blocks_free=10).to_dict(), "replica_id": "r"})
        decisions = await asyncio.gather(*(client.decide(2) for _ in range(8)))
        assert actor.syncs == 1, actor.syncs
        assert [d.reason for d in decisions] == ["ok"] * 4 + ["no_room"] * 4, decisions
        assert all(d.replicas == ["r"] for d in decisions[:4])

    asyncio.run(scenario())
