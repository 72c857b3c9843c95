"""The KV-aware request router without a Ray cluster: prefix affinity, headroom and queue in its score, the
router-side prefix guess and real contents, admission's order, hints, and its Ray Serve adapter."""

import asyncio
from types import SimpleNamespace

from conveyor.cluster.prefix_index import PrefixIndex
from conveyor.cluster.routing import (
    Candidate,
    RouterConfig,
    RoutingHint,
    choose,
    find_hint,
    score_replicas,
)
from conveyor.cluster.stats import ReplicaStats, block_hashes
from conveyor.engine.stats import EngineStats
from tests.cluster.fake_replicas import FakeReplica, _router
from tests.cluster.replica_stats import rs, stats


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


def test_router_all_saturated_least_loaded_and_allowed_first():
    cands = [Candidate("a", rs("a", used=99, running=5)), Candidate("b", rs("b", used=95, running=1))]
    assert choose(score_replicas(cands, (), PrefixIndex(), CFG), CFG) == ["b", "a"]
    cands = [Candidate("a", rs("a", used=10)), Candidate("b", rs("b", used=50)), Candidate("c", rs("c", used=20))]
    assert choose(score_replicas(cands, (), PrefixIndex(), CFG), CFG, allowed=["c", "b"]) == ["c", "b", "a"]
    assert choose([], CFG) == []


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


def test_routing_hint_and_lookup():
    ids = list(range(40))
    hint = RoutingHint.from_token_ids(ids, 16, replicas=["r1"])
    assert hint.prefix_hashes == tuple(block_hashes(ids, 16)) and hint.num_prompt_blocks == 3
    assert find_hint(["req"], {"routing_hint": hint}) is hint
    assert find_hint(["req", hint], {}) is hint
    assert find_hint(["req"], {}) is None
    foreign = SimpleNamespace(prefix_hashes=hint.prefix_hashes, num_prompt_blocks=3, replicas=())
    assert find_hint(["req"], {"routing_hint": foreign}) is foreign  # same shape, another class object


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
