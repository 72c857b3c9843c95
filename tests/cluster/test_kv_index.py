"""The KV index fed by replicas' KV events: a reset first, then events; followers by delta or full copy; the
admission actor asks for a listing and routers follow its index."""

from conveyor.cluster.admission_actor import AdmissionActor
from conveyor.cluster.admission_controller import AdmissionController
from conveyor.cluster.admission_snapshot import restore
from conveyor.cluster.kv_index import KVIndex
from conveyor.cluster.stats import block_hashes
from tests.cluster.replica_stats import events, stats


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
