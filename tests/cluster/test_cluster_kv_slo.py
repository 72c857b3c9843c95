"""Cluster layer, second pass, without Ray: the KV index fed by replicas' KV events and followed by routers,
routing on real contents, service rates and the queue-time objective, several routers sharing one actor."""

import asyncio
import math
import time
from types import SimpleNamespace

import pytest

from conveyor.cluster.admission_actor import AdmissionActor, AdmissionClient
from conveyor.cluster.admission_config import AdmissionConfig
from conveyor.cluster.admission_controller import AdmissionController
from conveyor.cluster.admission_snapshot import restore, snapshot
from conveyor.cluster.kv_index import KVIndex
from conveyor.cluster.prefix_index import PrefixIndex
from conveyor.cluster.queue_time import queue_time_s, retry_after_s
from conveyor.cluster.routing import Candidate, RouterConfig, choose, score_replicas
from conveyor.cluster.stats import Rates, ReplicaStats, block_hashes
from conveyor.engine.core.prefix_hash import block_hashes as engine_block_hashes


def stats(
    rid: str,
    free: int = 100,
    total: int = 100,
    running: int = 0,
    waiting: int = 0,
    waiting_tokens: int = 0,
    busy: float = 0.0,
    prefill: int = 0,
    decode: int = 0,
    finished: int = 0,
    seqs: int = 8,
    ts: float = 0.0,
) -> dict:
    return ReplicaStats(
        rid,
        num_running=running,
        num_waiting=waiting,
        num_waiting_tokens=waiting_tokens,
        kv_blocks_total=total,
        kv_blocks_free=free,
        num_finished=finished,
        max_num_seqs=seqs,
        busy_time_s=busy,
        num_prefill_tokens=prefill,
        num_decode_tokens=decode,
        timestamp=ts,
    ).to_dict()


def events(stored=(), evicted=(), reset=False) -> dict:
    return {"stored": list(stored), "evicted": list(evicted), "reset": reset}


# ---------------------------------------------------------------- KV index


def test_cluster_keys_are_the_engines_keys():
    ids = list(range(50))
    assert block_hashes(ids, 16) == engine_block_hashes(ids, 16)
    assert (
        block_hashes(ids, 16, "t") != block_hashes(ids, 16)
        and block_hashes(ids, 16, max_blocks=2) == block_hashes(ids, 16)[:2]
    )


def test_kv_index_needs_a_reset_first_then_follows_events():
    idx = KVIndex()
    h = block_hashes(list(range(64)), 16)
    assert idx.apply("a", h, [], reset=False) is True  # never listed: events alone can't be trusted
    assert idx.match("a", h) is None and not idx.reported("a")
    assert idx.apply("a", h[:2], [], reset=True) is False
    assert idx.match("a", h) == 2
    idx.apply("a", h[2:], [h[0]], reset=False)
    assert idx.match("a", h) == 0 and idx.match("a", h, extra={h[0]}) == 4
    idx.apply("a", [h[0]], [], reset=False)
    assert idx.match("a", h) == 4
    idx.apply("a", [h[3]], [], reset=True)  # a reset replaces everything
    assert idx.match("a", h) == 0 and idx.size("a") == 1


def test_kv_index_followers_by_delta_or_full_copy():
    src, dst = KVIndex(log_size=3), KVIndex()
    h = block_hashes(list(range(96)), 16)
    src.apply("a", h[:2], [], True)
    src.apply("b", h[:1], [], True)
    dst.load(src.changes(None))  # first contact: a full copy
    assert "full" in src.changes(None) and dst.keys == src.keys
    v = dst.version
    src.apply("a", h[2:4], [h[0]], False)
    ch = src.changes(v)
    assert "events" in ch and len(ch["events"]) == 1
    dst.load(ch)
    assert dst.keys == src.keys and dst.version == src.version
    v = dst.version
    for i in range(4):  # more pushes than the log holds: the follower gets a full copy
        src.apply("b", [h[i]], [], False)
    src.forget("a")
    ch = src.changes(v)
    assert "full" in ch
    dst.load(ch)
    assert dst.keys == src.keys and not dst.reported("a")
    src2 = KVIndex()  # the actor restarted: versions went back, the follower gets a full copy
    src2.apply("c", h[:1], [], True)
    assert "full" in src2.changes(dst.version)


def test_actor_asks_for_a_listing_and_routers_follow_its_index():
    actor = AdmissionActor({}, clock=lambda: 0.0)
    h = block_hashes(list(range(64)), 16)
    assert actor.report({**stats("a"), "kv_events": events(h[:1])}) == {"kv_reset": True}
    assert actor.report({**stats("a"), "kv_events": events(h[:3], reset=True)}) == {"kv_reset": False}
    assert actor.report(stats("b")) == {"kv_reset": False}  # no events at all: a replica without KV events
    router = AdmissionController()
    snap = actor.sync([], None)
    restore(router, snap, 0.0)
    assert router.cached_blocks("a", h) == 3 and router.cached_blocks("b", h) is None
    actor.report({**stats("a"), "kv_events": events([h[3]], [h[2]])})
    restore(router, actor.sync([], snap["kv"]["changes"]["version"]), 0.0)
    assert router.cached_blocks("a", h) == 2
    row = actor.snapshot()["replicas"][0]
    assert row["kv_index_reported"] and row["kv_index_blocks"] == 3


# ---------------------------------------------------------------- routing on real contents


def test_router_scores_real_contents_and_guesses_only_for_unreported():
    h = block_hashes(list(range(64)), 16)
    guess = PrefixIndex()
    guess.record("a", h)  # the guess says a holds the prompt; a's real contents say it was evicted
    guess.record("c", h)
    s = lambda rid: ReplicaStats.from_dict(stats(rid))
    cands = [Candidate("a", s("a")), Candidate("b", s("b")), Candidate("c", s("c"))]
    scored = {x.replica_id: x for x in score_replicas(cands, h, guess, RouterConfig(), cached_blocks={"a": 0, "b": 4})}
    assert scored["a"].affinity == 0.0 and scored["b"].affinity == 1.0 and scored["c"].affinity == 1.0
    assert (
        choose(score_replicas(cands, h, guess, RouterConfig(), cached_blocks={"a": 0, "b": 4, "c": 1}), RouterConfig())[
            0
        ]
        == "b"
    )


def test_router_follows_admissions_order_even_when_it_looks_overloaded():
    s = lambda rid, **kw: ReplicaStats.from_dict(stats(rid, **kw))
    cands = [Candidate("a", s("a", free=90)), Candidate("b", s("b", free=40)), Candidate("c", s("c", free=95))]
    scored = score_replicas(cands, (), PrefixIndex(), RouterConfig())
    assert choose(scored, RouterConfig(), ["b", "a"]) == ["b", "a", "c"]
    busy = [Candidate("a", s("a"), ongoing=1), Candidate("b", s("b"), ongoing=30)]
    ranked = score_replicas(busy, (), PrefixIndex(), RouterConfig())
    assert choose(ranked, RouterConfig())[0] == "a"  # without admission's list: the least loaded
    assert choose(ranked, RouterConfig(), ["b", "a"])[0] == "b"  # its reservation is on b


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


# ---------------------------------------------------------------- rates and queue time


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
    assert queue_time_s(s(running=3, waiting=2, waiting_tokens=3000), rates) == 3.0  # prefill-bound
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
    off = AdmissionController()  # off: today's behaviour, only KV room matters
    restore(off, snapshot(c, 0.1), 0.1)
    assert off.config.max_queue_time_s == 2.0
    off.config = AdmissionConfig()
    assert off.decide(1, 0.1).admit


# ---------------------------------------------------------------- several routers


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


def test_admission_charges_max_tokens_growth():
    c = AdmissionController()  # 2 running with 30 + 50 tokens left: 5 more blocks at 16 tokens each
    c.update(ReplicaStats.from_dict({**stats("a", free=40, running=2), "tokens_left": [30, 50]}), 0.0)
    assert c.room("a") == 35 and not c.decide(10, 0.0, output_tokens=480).admit
    d = c.decide(10, 0.0, output_tokens=240)  # 35 room less 10 kept above the 0.90 high watermark
    assert d.admit and d.new_blocks == 25
    assert not c.decide(10, 0.0, output_tokens=241).admit
    assert not c.decide(10, 0.0, output_tokens=120, num_seqs=2).admit  # 2 sequences of 8 blocks each


def test_admission_charges_the_likely_output_not_an_unset_max_tokens():
    """A client that leaves max_tokens unset asks for the rest of the context (2048 - prompt here): charged that,
    one request takes a whole replica. Once the replica reports how long outputs run, it is charged that instead,
    and never more than its own max_tokens."""
    c = AdmissionController()
    c.update(ReplicaStats.from_dict(stats("a", free=60, running=1)), 0.0)
    assert c.decide(2, 0.0, output_tokens=2000).reason == "no_room"
    c.update(ReplicaStats.from_dict({**stats("a", free=60, running=1, ts=0.1), "likely_output_tokens": 150}), 0.1)
    d = c.decide(2, 0.1, output_tokens=2000)
    assert d.admit and d.new_blocks == 2 + 10
    assert c.decide(2, 0.1, output_tokens=20).new_blocks == 2 + 2


def test_output_lengths_quantile_of_the_longer_recent_outputs():
    from conveyor.engine.core.output_lengths import OutputLengths

    lengths = OutputLengths(window=20, quantile=0.9, min_samples=10)
    for n in range(1, 10):
        lengths.add(n * 10)
    assert lengths.typical() == 0 and lengths.likely_total(0, 500) == 500  # too few to say
    lengths.add(100)  # 10, 20, ..., 100
    assert lengths.typical() == 90
    assert lengths.likely_total(0, 500) == 90 and lengths.likely_total(0, 40) == 40
    assert lengths.likely_total(75, 500) == 100  # of those longer than 75: 80, 90, 100
    assert lengths.likely_total(100, 500) == 500  # longer than all seen: charged in full
    for _ in range(20):
        lengths.add(5)  # the window forgets the old lengths
    assert sorted(lengths.recent) == lengths.sorted == [5] * 20 and lengths.typical() == 5
    with pytest.raises(ValueError):
        OutputLengths(quantile=0.0)
    cold = OutputLengths(min_samples=10, prior=64)  # before 10 have finished: the prior, at most max_tokens
    assert cold.typical() == 64 and cold.likely_total(0, 500) == 64 and cold.likely_total(0, 40) == 40
    assert cold.likely_total(64, 500) == 500  # outlived the prior: charged in full


def test_a_cold_replica_expects_its_prior_not_an_unset_max_tokens():
    """Before 16 requests have finished, a request that asks for the rest of the context is expected to run
    EngineConfig.cold_output_tokens (256), and the replica reports that as a new request's likely length, so
    admission charges 16 blocks, not 125; cold_output_tokens 0 charges max_tokens as before."""
    from conveyor.engine import LLM, SamplingParams

    for prior, likely, left in ((256, 256, 255), (0, 0, 1999)):
        llm = LLM(
            "demo:tiny",
            dtype="float32",
            num_blocks=256,
            block_size=16,
            max_num_batched_tokens=512,
            cold_output_tokens=prior,
        )
        llm.engine.add_request("r", list(range(5, 25)), SamplingParams(max_tokens=2000, ignore_eos=True))
        llm.engine.step()
        s = llm.engine.stats()
        assert (s.likely_output_tokens, s.tokens_left) == (likely, [left])
        c = AdmissionController()
        c.update(ReplicaStats.from_engine("r", s), 0.0)
        assert c.output_blocks("r", 2000) == (16 if prior else 125)
        llm.shutdown()


def test_admission_commits_room_only_up_to_the_high_watermark():
    c = AdmissionController(AdmissionConfig(high_watermark=0.8, low_watermark=0.5))
    c.update(ReplicaStats.from_dict(stats("a", free=50, total=100)), 0.0)
    assert c.headroom("a") == 30 and c.decide(30, 0.0).admit and c.decide(31, 0.0).reason == "no_room"
    c.update(ReplicaStats.from_dict(stats("idle", free=100, total=100)), 0.0)
    assert c.decide(100, 0.0).replicas == ["idle"]  # a request that fits an idle replica's cache still runs
    c.reserve("idle", 75, 0.0)
    assert c.decide(6, 0.0).replicas == ["a"] and "idle" in c.decide(5, 0.0).replicas


def test_growth_blocks_count_running_and_waiting_requests_to_max_tokens():
    """The engine's stat that admission charges: every request's blocks still to come if it runs to
    max_tokens, waiting ones included (before, only running requests' tokens_left were summed)."""
    from conveyor.engine import LLM, SamplingParams

    llm = LLM("demo:tiny", dtype="float32", num_blocks=64, block_size=16, max_num_seqs=1, max_num_batched_tokens=64)
    engine = llm.engine
    for i, (prompt, out) in enumerate([(20, 30), (40, 100)]):
        engine.add_request(str(i), list(range(5, 5 + prompt)), SamplingParams(max_tokens=out, ignore_eos=True))
    engine.step()  # request 0 runs (its 20 prompt tokens in 2 blocks, 1 sampled), request 1 waits (one sequence)
    s = engine.stats()
    assert (s.num_running, s.num_waiting) == (1, 1)
    running = math.ceil((20 + 30) / 16) - 2  # 4 blocks at max_tokens, 2 held
    waiting = math.ceil((40 + 100) / 16) - math.ceil(40 / 16)  # its prompt's 3 blocks are in num_waiting_tokens
    assert s.num_growth_blocks == running + waiting == 2 + 6
    assert s.demand_blocks() == s.kv_blocks_used + math.ceil(s.num_waiting_tokens / 16) + 8  # autoscaling's metric
    c = AdmissionController()
    c.update(ReplicaStats.from_engine("r", s), 0.0)
    assert c.room("r") == s.kv_blocks_free - math.ceil(s.num_waiting_tokens / 16) - 8
    core = engine.core.core  # the EngineCore, in process; the recount is rate-limited while the same requests run...
    assert core.growth_blocks(every_s=1e9) == 8
    while engine.has_unfinished_requests():
        engine.step()
    assert core.growth_blocks(every_s=1e9) == 0  # ...but not once they leave: no phantom growth on an idle replica


def test_engine_bounds_growth_by_how_long_outputs_run():
    """Requests that ask for 200 tokens but stop at 12 (max_tokens here stands for a stop): once 16 have finished,
    a new one's growth and tokens_left count 12 tokens, not 200, and the replica reports 12 as a new request's
    likely length. A request that outlives every finished one is charged its max_tokens again."""
    from conveyor.engine import LLM, SamplingParams

    llm = LLM("demo:tiny", dtype="float32", num_blocks=256, block_size=16, max_num_seqs=16, max_num_batched_tokens=512)
    llm.generate(
        [{"prompt_token_ids": [5 + i] * 20} for i in range(16)], SamplingParams(max_tokens=12, ignore_eos=True)
    )
    core = llm.engine.core.core
    assert core.stats().likely_output_tokens == 12
    engine = llm.engine
    engine.add_request("long", list(range(5, 25)), SamplingParams(max_tokens=200, ignore_eos=True))
    engine.step()
    s = engine.stats()
    assert s.tokens_left == [12 - 1] and s.num_growth_blocks == math.ceil(32 / 16) - 2  # 20 + 12 in 2 blocks
    for _ in range(12):
        engine.step()
    time.sleep(0.05)  # while the same requests run, the growth count may be up to 20 ms old (EngineCore.growth_blocks)
    s = engine.stats()
    assert s.tokens_left == [200 - 13] and s.num_growth_blocks == math.ceil(220 / 16) - s.kv_blocks_used


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
