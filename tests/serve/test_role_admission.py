"""Per-role admission of a disaggregated app (deployments/role_admission.py) over two real admission actors, one per
role, and a router-side AdmissionClient for each: a refusal on either role holds nothing on the other, an admitted
request holds a reservation on both, and a request that runs whole on prefill ignores the decode role."""

import asyncio
from types import SimpleNamespace

from conveyor.cluster.admission_actor import AdmissionActor, AdmissionClient
from conveyor.deployments.disaggregation import DECODE_ADMISSION
from conveyor.deployments.role_admission import Ask, decide_roles, decode_hint, redecide
from tests.cluster.replica_stats import stats

PREFILL = Ask(blocks=2, output_tokens=1)
DECODE = Ask(blocks=2, output_tokens=16 * 30)  # 2 + 30 blocks of the decode replica's 36 (40 below the watermark)


class Handle:
    def __init__(self, body: AdmissionActor):
        self.sync = SimpleNamespace(remote=self._sync)
        self.body = body

    async def _sync(self, *args) -> dict:
        return self.body.sync(*args)


def roles(clock: list[float], prefill_config: dict | None = None) -> tuple[AdmissionActor, AdmissionActor, ...]:
    """The two roles' actors and a router's client of each."""
    actors = (
        AdmissionActor(prefill_config or {}, clock=lambda: clock[0]),
        AdmissionActor(DECODE_ADMISSION, clock=lambda: clock[0]),
    )
    clients = []
    for actor in actors:

        async def get(actor: AdmissionActor = actor) -> Handle:
            return Handle(actor)

        clients.append(AdmissionClient(get, clock=lambda: clock[0]))
    return (*actors, *clients)


def held(client: AdmissionClient) -> int:
    """Blocks this router has reserved on any replica of the role (sent to the actor or not)."""
    return sum(client.controller.reserved(rid)[0] for rid in client.controller.replicas)


def test_decode_full_is_refused_before_any_prefill_reservation() -> None:
    clock = [0.0]
    p_actor, d_actor, prefill, decode = roles(clock)

    async def scenario() -> None:
        p_actor.report(stats("p", total=40, free=40))
        d_actor.report(stats("d", total=40, free=5))  # 35 blocks in use: no room for 32 more
        await prefill.refresh()
        await decode.refresh()
        r = await decide_roles(prefill, decode, PREFILL, DECODE)
        assert r.refusal is r.decode and r.decode.reason == "no_room" and r.prefill is None
        assert held(prefill) == held(decode) == 0
        await prefill.refresh()
        await decode.refresh()
        assert sum(r.blocks for rs in p_actor.controller.book.held.values() for r in rs) == 0

    asyncio.run(scenario())


def test_prefill_full_is_refused_and_nothing_stays_held_on_decode() -> None:
    clock = [0.0]
    p_actor, d_actor, prefill, decode = roles(clock)

    async def scenario() -> None:
        p_actor.report(stats("p", total=40, free=0))  # saturated
        d_actor.report(stats("d", total=40, free=40))
        await prefill.refresh()
        await decode.refresh()
        r = await decide_roles(prefill, decode, PREFILL, DECODE)
        assert r.refusal is r.prefill and r.prefill.reason == "saturated"
        assert held(decode) == held(prefill) == 0
        await decode.refresh()
        assert not d_actor.controller.book.held  # the actor got no decode reservation either

    asyncio.run(scenario())


def test_both_roles_with_room_admit_and_reserve_on_each() -> None:
    clock = [0.0]
    p_actor, d_actor, prefill, decode = roles(clock)

    async def scenario() -> None:
        p_actor.report(stats("p", total=40, free=40))
        for rid in ("d1", "d2"):
            d_actor.report(stats(rid, total=40, free=40 if rid == "d2" else 30))
        await prefill.refresh()
        await decode.refresh()
        r = await decide_roles(prefill, decode, PREFILL, DECODE)
        assert r.refusal is None and r.prefill.admit and r.decode.admit
        assert r.decode.replicas == ["d2"]  # the only one with room for 32 blocks
        assert decode.controller.reserved("d2")[0] == 32 and held(prefill) == 2 + 1
        hint = decode_hint(decode, r.decode, 2, ())
        assert hint.replicas[0] == r.decode.reservation.replica_id == "d2" and "d2" in hint.kv_demand
        again = await decide_roles(prefill, decode, PREFILL, DECODE)  # d2's room is taken now
        assert again.refusal is again.decode and held(prefill) == 3 and decode.controller.reserved("d2")[0] == 32
        clock[0] = 2.5  # stats that count the admitted request settle its decode reservation
        d_actor.report({**stats("d2", total=40, free=8, running=1, ts=1), "num_added": 1})
        await decode.refresh()
        assert held(decode) == 0

    asyncio.run(scenario())


def test_a_lora_request_reserves_on_a_decode_replica_holding_its_adapter() -> None:
    """The decode ask carries the adapter as the prefill ask does: among decode replicas with room, one reporting it
    resident ranks first (and holds the reservation) over one with more room; the decode routing hint names it."""
    clock = [0.0]
    p_actor, d_actor, prefill, decode = roles(clock)

    async def scenario() -> None:
        p_actor.report(stats("p", total=40, free=40))
        d_actor.report(stats("d1", total=40, free=40))
        d_actor.report({**stats("d2", total=40, free=36), "lora_adapters": ["x"]})
        await prefill.refresh()
        await decode.refresh()
        plain = await decide_roles(prefill, decode, PREFILL, DECODE)
        assert plain.decode.replicas[0] == "d1"
        decode.release(plain.decode)
        prefill.release(plain.prefill)
        r = await decide_roles(prefill, decode, Ask(2, output_tokens=1, lora="x"), Ask(2, output_tokens=64, lora="x"))
        assert r.refusal is None and r.decode.replicas[0] == r.decode.reservation.replica_id == "d2"
        hint = decode_hint(decode, r.decode, 2, (), "x")
        assert hint.replicas[0] == "d2" and hint.lora == "x"

    asyncio.run(scenario())


def test_a_retried_handoff_reserves_again_on_a_replica_not_tried() -> None:
    """After its decode replica refused or lost the handoff (its reservation withdrawn), the retry reserves on the
    next replica with room and never on one tried; with no such room it goes without a reservation."""
    clock = [0.0]
    p_actor, d_actor, prefill, decode = roles(clock)

    async def scenario() -> None:
        p_actor.report(stats("p", total=40, free=40))
        for rid, free in (("d1", 40), ("d2", 38), ("d3", 5)):
            d_actor.report(stats(rid, total=40, free=free))
        await prefill.refresh()
        await decode.refresh()
        r = await decide_roles(prefill, decode, PREFILL, DECODE)
        assert r.decode.reservation.replica_id == "d1"
        decode.release(r.decode)
        again = redecide(decode, DECODE, ["d1"])
        assert again.reservation.replica_id == "d2" and decode.controller.reserved("d2")[0] == 32
        assert held(decode) == 32  # d1's withdrawn, d2's held
        hint = decode_hint(decode, again, DECODE.blocks, ["d1"])
        assert hint.replicas[0] == "d2" and "d1" not in hint.replicas
        decode.release(again)
        assert redecide(decode, DECODE, ["d1", "d2"]) is None  # d3 has no room: no reservation
        assert held(decode) == 0
        assert redecide(None, DECODE, []) is None  # admission off

    asyncio.run(scenario())


def test_a_request_that_cannot_be_handed_off_ignores_the_decode_role() -> None:
    clock = [0.0]
    p_actor, d_actor, prefill, decode = roles(clock)

    async def scenario() -> None:
        p_actor.report(stats("p", total=40, free=40))
        d_actor.report(stats("d", total=40, free=0))  # full
        await prefill.refresh()
        await decode.refresh()
        r = await decide_roles(prefill, decode, Ask(blocks=2, output_tokens=16 * 30), None)
        assert r.refusal is None and r.prefill.admit and r.decode is None
        assert held(decode) == 0 and decode.decisions == 0

    asyncio.run(scenario())


def test_decode_room_gone_while_prefill_waited_withdraws_the_prefill_reservation() -> None:
    """Decode had room when asked; prefill queued; by the time prefill admits, another request took decode's room:
    refused on decode, and the prefill reservation just taken is withdrawn."""
    clock = [0.0]
    p_actor, d_actor, prefill, decode = roles(clock, {"queue_timeout_s": 5.0, "max_queued": 4})

    async def scenario() -> None:
        p_actor.report(stats("p", total=40, free=0))  # saturated: the request queues
        d_actor.report(stats("d", total=40, free=40))
        await prefill.refresh()
        await decode.refresh()
        task = asyncio.create_task(decide_roles(prefill, decode, PREFILL, DECODE))
        await asyncio.sleep(0)
        assert prefill.queued == 1 and held(decode) == 0
        assert decode.decide_now(*DECODE.args()).admit  # another request takes the decode room
        p_actor.report(stats("p", total=40, free=40, ts=1))
        await prefill.refresh()  # the queued request is admitted on prefill, then refused on decode
        r = await task
        assert r.refusal is r.decode and r.decode.reason == "no_room" and r.prefill.admit
        assert held(prefill) == 0

    asyncio.run(scenario())


def test_a_decode_reservation_whose_request_ends_on_prefill_is_withdrawn_from_the_actor_too() -> None:
    """Released before its sync, it never reaches the actor; released after, the next sync drops it there."""
    clock = [0.0]
    p_actor, d_actor, prefill, decode = roles(clock)

    async def scenario() -> None:
        p_actor.report(stats("p", total=40, free=40))
        d_actor.report(stats("d", total=40, free=40))
        await prefill.refresh()
        await decode.refresh()
        first = await decide_roles(prefill, decode, PREFILL, DECODE)
        decode.release(first.decode)  # not synced yet
        assert held(decode) == 0
        await decode.refresh()
        assert not d_actor.controller.book.held
        second = await decide_roles(prefill, decode, PREFILL, DECODE)
        clock[0] = 0.1
        await decode.refresh()  # the actor holds it now, for every router
        assert d_actor.controller.reserved("d")[0] == 32 and held(decode) == 32
        decode.release(second.decode)
        clock[0] = 0.2
        await decode.refresh()
        assert d_actor.controller.reserved("d")[0] == 0 and held(decode) == 0
        assert (await decide_roles(prefill, decode, PREFILL, DECODE)).refusal is None  # its room is back

    asyncio.run(scenario())
