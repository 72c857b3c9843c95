"""Several routers sharing one admission actor: each sees the others' reservations within one refresh, and
leases keep their joint commitments within every replica's headroom."""

import asyncio
from types import SimpleNamespace

from conveyor.cluster.admission_actor import AdmissionActor, AdmissionClient
from conveyor.cluster.stats import block_hashes
from tests.cluster.replica_stats import events, stats


class Handle:
    def __init__(self, body: AdmissionActor):
        self.sync = SimpleNamespace(remote=self._sync)
        self.body = body

    async def _sync(self, *args) -> dict:
        return self.body.sync(*args)


def test_two_routers_see_each_others_reservations_within_one_refresh():
    clock = [0.0]
    body = AdmissionActor({"settle_s": 0.3}, clock=lambda: clock[0])
    h = block_hashes(list(range(320)), 16)

    async def get() -> Handle:
        return Handle(body)

    async def scenario() -> None:
        one, two = AdmissionClient(get, clock=lambda: clock[0]), AdmissionClient(get, clock=lambda: clock[0])
        body.report({**stats("a", total=40, free=40), "kv_events": events(reset=True)})
        body.report({**stats("b", total=40, free=40), "kv_events": events(reset=True)})
        await one.refresh()
        await two.refresh()
        d1 = await one.decide(20, keys=h)
        d2 = await two.decide(20, keys=h)  # two has not seen one's reservation yet
        assert d1.admit and d2.admit
        await one.refresh()  # hands its reservation over
        await two.refresh()  # hands over its own and sees one's
        await one.refresh()
        for c in (one, two):  # both count both reservations
            assert c.controller.reserved("a")[0] + c.controller.reserved("b")[0] == 40
        assert one.controller.room("a") == two.controller.room("a")
        assert one.controller.room("b") == two.controller.room("b")
        assert one.controller.num_routers == two.controller.num_routers == 2
        free_b, lease_b = one.controller.room("b"), one.controller.lease_room("b", clock[0])
        one.controller.reserve("b", 3, clock[0])  # not shared yet: counts against this router's lease
        assert one.controller.room("b") == free_b - 3 and one.controller.lease_room("b", clock[0]) == lease_b - 3
        one.controller.book.held.clear()
        assert two.controller.cached_blocks(d1.replicas[0], h) == 20  # one's prompt, on its way there
        d3 = await two.decide(1, keys=h)
        assert d3.admit
        full = d1.replicas[0] if d1.replicas[0] == d2.replicas[0] else None
        if full is not None:  # both sent the same prompt to one replica: now full for either router
            assert one.controller.room(full) == 0 and (await one.decide(20)).replicas == ["b" if full == "a" else "a"]
        clock[0] = 0.4
        body.report({**stats("a", total=40, free=20, ts=1)})
        body.report({**stats("b", total=40, free=20, ts=1)})
        await one.refresh()
        assert sum(one.controller.reserved(r)[0] for r in "ab") == 0  # stats 0.4 s later include them all
        assert one.controller.room("a") == one.controller.room("b") == 20

    asyncio.run(scenario())


def test_two_routers_never_jointly_commit_more_than_a_replicas_headroom():
    """Routers admit between syncs, each unseen by the other: with leases their commitments together stay within
    every replica's headroom (room up to the high watermark) whatever the interleaving."""
    body = AdmissionActor({"settle_s": 10.0, "settle_max_s": 10.0}, clock=lambda: 0.0)
    for rid in "ab":
        body.report({**stats(rid, total=100, free=100), "kv_events": events(reset=True)})

    async def get() -> Handle:
        return Handle(body)

    def committed(routers: list[AdmissionClient], rid: str) -> int:
        return sum(r.blocks for r in body.controller.book.held.get(rid, ())) + sum(
            r.blocks for c in routers for r in c.controller.book.own(rid)
        )

    async def scenario() -> int:
        routers = [AdmissionClient(get, clock=lambda: 0.0) for _ in range(2)]
        for c in routers + routers:
            await c.refresh()
        worst = 0
        for turn in [0, 1, 0, 0, 1, 1, 0, 1, 0, 1, 1, 0]:  # who syncs next; both admit what they can in between
            for c in routers:
                while (d := await c.decide(5)).admit:
                    pass
                assert d.reason == "no_room"  # out of lease after asking for more: told as no room
            worst = max(worst, *(committed(routers, rid) for rid in "ab"))
            await routers[turn].refresh()
        assert body.controller.headroom("a") + body.controller.headroom("b") <= 2 * 90 - 2 * 80  # filled
        return worst

    assert asyncio.run(scenario()) <= 90


def test_lease_shares_split_evenly_and_by_demand_within_headroom():
    from conveyor.cluster.leases import Leases

    book = Leases(ttl_s=1.0)
    assert book.grant("r1", {"a": 100}, 0.0, demand=0, routers=2) == {"a": 50}
    assert book.grant("r2", {"a": 100}, 0.0, demand=30, routers=2) == {"a": 50}  # r1 holds 50
    assert book.grant("r1", {"a": 80}, 0.1, demand=10, routers=2) == {"a": 30}  # 0.25 + 0.5 * 10/40 of 80
    assert book.grant("r2", {"a": 80}, 0.2, demand=30, routers=2) == {"a": 50}  # 0.25 + 0.5 * 30/40, all free
    assert book.grant("r1", {"a": 80}, 1.5, routers=2) == {"a": 40}  # r2's lease expired: nothing held
    claims = Leases(ttl_s=1.0)  # room frees one request at a time: split in shares it fits neither router's next
    assert claims.grant("r1", {"a": 21}, 0.0, routers=2) == {"a": 10}
    assert claims.grant("r2", {"a": 21}, 0.0, routers=2) == {"a": 10}
    assert claims.grant("r1", {"a": 21}, 0.01, demand=21, routers=2, short=21) == {"a": 11}  # r2 holds 10
    assert claims.grant("r2", {"a": 21}, 0.05, demand=21, routers=2, short=21) == {"a": 0}  # r1 claimed first
    assert claims.grant("r1", {"a": 21}, 0.06, demand=21, routers=2, short=21) == {"a": 21}
    assert claims.grant("r2", {"a": 21}, 0.10, demand=21, routers=2, short=21) == {"a": 0}  # r1 holds it all
    assert claims.grant("r1", {"a": 0}, 0.11, demand=21, routers=2) == {"a": 0}  # r1 committed it: no claim left
    assert claims.grant("r2", {"a": 21}, 0.15, demand=21, routers=2, short=21) == {"a": 21}
