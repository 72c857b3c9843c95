"""Lower KV tiers in the cluster layer: the index follows keys offloaded to a replica's host or disk tier, and
admission credits a prompt's blocks found there at what a load saves over a prefill (1 - the replica's
measured load cost): below the same blocks in a pool, above none."""

import pytest

from conveyor.cluster.admission_actor import AdmissionActor
from conveyor.cluster.admission_controller import AdmissionController
from conveyor.cluster.admission_snapshot import restore
from conveyor.cluster.kv_index import KVIndex
from conveyor.cluster.stats import ReplicaStats, block_hashes
from tests.cluster.replica_stats import events, stats

H = block_hashes(list(range(160)), 16)  # 10 blocks


def test_the_index_follows_offloads_and_its_followers_too():
    src, delta, full = KVIndex(), KVIndex(), KVIndex()
    src.apply("a", H[:4], [], True, offloaded=H[4:6])
    delta.load(src.changes(None))
    v = delta.version
    assert (src.match("a", H), src.match_lower("a", H, 4)) == (4, 2)
    src.apply("a", [], [], False, offloaded=H[2:4])  # its pool blocks went, host copies stay
    assert (src.match("a", H), src.match_lower("a", H, 2)) == (2, 4)
    src.apply("a", [H[2]], [H[5]], False)  # one loaded back into the pool, one dropped from the last tier
    assert (src.match("a", H), src.match_lower("a", H, 3)) == (3, 2)
    delta.load(src.changes(v))
    full.load(src.changes(None))
    for follower in (delta, full):
        assert follower.keys == src.keys and follower.lower == src.lower
    src.forget("a")
    delta.load(src.changes(src.version - 1))
    assert not delta.reported("a") and "a" not in delta.lower


@pytest.mark.parametrize("placement", [False, True], ids=["score", "expected TTFT"])
def test_admission_ranks_pool_over_lower_tier_over_none_and_credits_the_load(placement: bool):
    c = AdmissionController()
    c.config = type(c.config)(**{**c.config.__dict__, "placement": placement})
    measured = dict(busy=1.0, prefill=1000) if placement else {}
    # named so that without the credit the tie between a_none and b_lower would go to a_none
    for rid, ev in (("a_none", events()), ("b_lower", events(offloaded=H[:8])), ("c_pool", events(H[:8]))):
        c.update(ReplicaStats.from_dict({**stats(rid), "kv_tier_load_cost": 0.25}), 0.0, {**ev, "reset": True})
        c.update(ReplicaStats.from_dict({**stats(rid, ts=1, **measured), "kv_tier_load_cost": 0.25}), 1.0, events())
    d = c.decide(10, 1.0, keys=H)
    assert d.admit and d.replicas == ["c_pool", "b_lower", "a_none"]
    assert d.cached_blocks == {"a_none": 0.0, "b_lower": 8 * 0.75, "c_pool": 8.0}


def test_the_actor_passes_offloads_to_the_routers():
    actor = AdmissionActor({}, clock=lambda: 0.0)
    actor.report({**stats("a"), "kv_events": events(H[:2], reset=True)})
    actor.report({**stats("a"), "kv_events": events(offloaded=H[:3])})
    router = AdmissionController()
    restore(router, actor.sync([], None), 0.0)
    assert router.cached_blocks("a", H) == 0 and router.kv.match_lower("a", H, 0) == 3
