"""Placement by expected TTFT, without Ray: prefix affinity against queue time, hot prefixes spread by cache
capacity, KV demand that charges only uncached blocks, and the rates and queue time that feed them."""

from conveyor.cluster.admission_config import AdmissionConfig
from conveyor.cluster.admission_controller import AdmissionController
from conveyor.cluster.hot_blocks import HotBlocks
from conveyor.cluster.placement import Option, cost_s, rank
from conveyor.cluster.prefix_index import PrefixIndex
from conveyor.cluster.queue_time import queue_time_s
from conveyor.cluster.routing import Candidate, RouterConfig, choose, score_replicas
from conveyor.cluster.stats import Rates, ReplicaStats, block_hashes
from tests.cluster import replica_stats


def stats(rid: str, **fields: float) -> ReplicaStats:
    """A replica of 200 blocks and 16 sequences (tests/cluster/replica_stats.py's fields)."""
    return ReplicaStats.from_dict(replica_stats.stats(rid, **{"free": 200, "total": 200, "seqs": 16, **fields}))


def test_prefix_stays_until_its_queue_costs_more_than_the_prefill_it_saves():
    holder = Option("a", cached_blocks=32, wait_s=0.0, prefill_tokens_per_s=1000.0, hot_blocks=0, capacity_blocks=200)
    other = Option("b", cached_blocks=0, wait_s=0.0, prefill_tokens_per_s=1000.0, hot_blocks=0, capacity_blocks=200)
    assert cost_s(holder, 35, 16) == 3 * 16 / 1000 and cost_s(other, 35, 16) == 35 * 16 / 1000
    assert rank([other, holder], 35, 16) == ["a", "b"]
    queued = Option("a", 32, wait_s=0.4, prefill_tokens_per_s=1000.0, hot_blocks=0, capacity_blocks=200)
    assert rank([other, queued], 35, 16) == ["a", "b"]  # 0.4 s of queue < 0.512 s of prefill saved
    longer = Option("a", 32, wait_s=0.6, prefill_tokens_per_s=1000.0, hot_blocks=0, capacity_blocks=200)
    assert rank([other, longer], 35, 16) == ["b", "a"]  # copied to the idle replica
    assert cost_s(Option("c", 0, 0.0, 0.0, 0, 200), 35, 16) == float("inf")


def test_new_prefixes_spread_by_hot_capacity_before_evicting():
    # both idle, neither holds the prompt: the one whose cache hot prefixes fill less takes it
    full = Option("a", 0, 0.0, 1000.0, hot_blocks=96, capacity_blocks=200)
    light = Option("b", 0, 0.0, 1000.0, hot_blocks=64, capacity_blocks=200, load=5)
    assert rank([full, light], 35, 16) == ["b", "a"]
    # 110 hot + 35 new > 0.6 x 200: 25 hot blocks pushed out count as prefill to redo
    over = Option("a", 0, 0.0, 1000.0, hot_blocks=110, capacity_blocks=200)
    assert cost_s(over, 35, 16) == (35 + 25) * 16 / 1000
    busy = Option("b", 0, wait_s=0.3, prefill_tokens_per_s=1000.0, hot_blocks=0, capacity_blocks=200)
    assert rank([over, busy], 35, 16) == ["b", "a"]  # 0.4 s of recompute later > b's 0.3 s queue
    busier = Option("b", 0, wait_s=0.5, prefill_tokens_per_s=1000.0, hot_blocks=0, capacity_blocks=200)
    assert rank([over, busier], 35, 16) == ["a", "b"]
    assert rank([Option("a", 0, 0.0, 1000.0, 0, 200, load=3), Option("b", 0, 0.0, 1000.0, 0, 200, load=1)], 35, 16) == [
        "b",
        "a",
    ]  # all else equal: load


def test_hot_blocks_count_reused_keys_and_once_sent_prefixes_whole():
    hot = HotBlocks(window_s=10.0)
    a = [bytes([1, i]) for i in range(5)]
    hot.record("r", a, 0.0)
    assert hot.count("r", 0.0) == 5 and hot.count("r", 0.0, exclude=a) == 0
    hot.record("r", a[:3] + [b"t1", b"t2"], 1.0)  # shares 3 blocks: those are hot, the tails are not
    assert hot.count("r", 1.0) == 3
    b = [bytes([2, i]) for i in range(4)]
    hot.record("r", b, 2.0)
    assert hot.count("r", 2.0) == 7 and hot.count("r", 2.0, exclude=b) == 3 and hot.count("r", 2.0, a) == 4
    assert hot.count("r", 11.5) == 4  # a's keys last sent at 1 s are out of the window
    assert hot.count("r", 12.5) == 0 and hot.count("other", 0.0) == 0
    hot.forget("r")
    assert hot.count("r", 0.0) == 0


def controller(**cfg) -> AdmissionController:
    c = AdmissionController(AdmissionConfig(**cfg))
    for rid in "ab":  # 1 s busy: 2000 prompt tokens computed
        c.update(stats(rid, running=1, ts=0.0), 0.0, {"stored": [], "evicted": [], "reset": True})
        c.update(stats(rid, running=1, busy=1.0, prefill=2000, ts=1.0), 0.1, None)
    return c


def test_admission_places_by_expected_ttft_and_charges_only_uncached_blocks():
    c = controller()
    keys = block_hashes(list(range(35 * 16)), 16)
    c.kv.apply("a", keys[:32], [], False)  # a holds the 32-block system prompt
    d = c.decide(35, 0.2, keys=keys)
    assert d.replicas == ["a", "b"] and d.cached_blocks == {"a": 32, "b": 0}
    assert d.new_blocks == 3  # only what a must compute; a cached block is not charged again
    c.update(stats("a", running=1, waiting=4, waiting_tokens=4000, busy=1.0, prefill=2000, ts=2.0), 0.3, None)
    d = c.decide(35, 0.3, keys=keys)
    assert d.replicas[0] == "b" and d.new_blocks == 35  # a's queue (2 s) costs more than 32 blocks of prefill
    assert controller(placement=False).decide(35, 0.2, keys=keys).replicas  # the score ranking still works


def test_cold_prompts_alternate_between_replicas_by_hot_share():
    c = controller()
    firsts = []
    for p in range(4):  # 4 system prompts, none cached anywhere, each sent twice
        keys = block_hashes([p + 1] * (35 * 16), 16)
        for _ in range(2):
            d = c.decide(35, 0.2, keys=keys)
            c.reserve(d.replicas[0], d.new_blocks, 0.2, keys=keys)
        firsts.append(d.replicas[0])
    assert sorted(firsts) == ["a", "a", "b", "b"]


def test_replicas_past_their_hot_capacity_take_new_prefixes_by_load():
    # 32 one-off prompts (a warm-up burst) were sent 20 to a, 12 to b: both past 0.6 x 200 hot blocks, so a new
    # prefix evicts hot blocks on either; the hot counts beyond the capacity no longer steer it, load does
    a = Option("a", 0, 0.0, 1000.0, hot_blocks=20 * 36, capacity_blocks=200, load=0)
    b = Option("b", 0, 0.0, 1000.0, hot_blocks=12 * 36, capacity_blocks=200, load=2)
    assert cost_s(a, 35, 16) == cost_s(b, 35, 16) == 2 * 35 * 16 / 1000
    assert rank([a, b], 35, 16) == ["a", "b"]
    c = controller()
    for i in range(32):
        keys = block_hashes([1000 + i] * (36 * 16), 16)
        c.hot.record("a" if i < 20 else "b", keys, 0.1)
    firsts = []
    for p in range(8):  # 8 new system prompts right after: half each (before the fix: all 8 to b)
        keys = block_hashes([p + 1] * (35 * 16), 16)
        d = c.decide(35, 0.2, keys=keys)
        c.reserve(d.replicas[0], d.new_blocks, 0.2, keys=keys)
        firsts.append(d.replicas[0])
    assert sorted(firsts) == ["a"] * 4 + ["b"] * 4


def test_waiting_queue_demand_is_scaled_by_the_measured_miss_ratio():
    prev = stats("a", running=2, queries=0, hits=0, ts=0.0)
    cur = stats("a", running=2, busy=1.0, prefill=1000, queries=4000, hits=3000, ts=1.0)
    rates = Rates().update(prev, cur)
    assert rates.miss_ratio == 0.25 and Rates().miss_ratio == 1.0
    queued = stats("a", free=100, waiting=2, waiting_tokens=1600)  # 100 blocks asked, a quarter to compute
    assert queued.waiting_blocks(rates.miss_ratio) == 25 and queued.waiting_blocks(Rates().miss_ratio) == 100
    assert AdmissionController.kv_pressure(queued, rates) == (100 + 25) / 200  # what the watermarks compare
    assert queue_time_s(queued, rates) == 1600 * 0.25 / rates.prefill_drain_per_s


def test_rates_count_wall_time_between_pushes_while_working():
    idle, working = stats("a", ts=0.0), stats("a", running=4, ts=0.0)
    later = stats("a", running=4, busy=0.5, prefill=1000, ts=2.0)
    assert Rates().update(idle, later).prefill_tokens_per_s == 2000.0  # was idle: its step time only
    assert Rates().update(working, later).prefill_tokens_per_s == 500.0  # had work for the whole 2 s


def test_queue_time_kv_slots_count_growth_to_max_tokens():
    rates = Rates(prefill_tokens_per_s=1000.0, finished_per_s=1.0, steps_per_s=10.0)
    s = ReplicaStats(
        "r", num_running=4, kv_blocks_total=100, kv_blocks_free=60, max_num_seqs=16, tokens_left=(10, 20, 160, 160)
    )
    # 4 use 40 blocks but will use 40 + 22: 6 full-grown requests fit, so 2 slots, and the 3rd waits for one
    assert queue_time_s(s, rates) == 0.0 and queue_time_s(s, rates, extra_requests=2) == 1.0


def test_router_takes_admissions_replica_even_if_its_own_view_says_saturated():
    s = lambda rid: stats(rid)
    cands = [Candidate("a", s("a"), pressure=0.95), Candidate("b", s("b"), pressure=0.2)]
    scored = score_replicas(cands, (), PrefixIndex(), RouterConfig())
    assert choose(scored, RouterConfig()) == ["b"]  # no admission list: saturated a is skipped
    assert choose(scored, RouterConfig(), ["a"]) == ["a", "b"]


def test_ranking_ignores_reservations_older_than_the_replicas_stats():
    c = controller()
    h = block_hashes([7] * (11 * 16), 16)
    c.reserve("a", 11, 0.15, keys=block_hashes([9] * (11 * 16), 16))  # another prompt, sent to a
    assert c.queue_time("a", shared=0) > 0 and c.decide(11, 0.16, keys=h).replicas[0] == "b"
    c.update(stats("a", running=1, busy=1.0, prefill=2000, ts=1.1), 0.2, None)  # stats after it: it started
    assert c.queue_time("a", shared=0) == 0.0 and c.reserved("a")[0] == 11  # still charged for room
    c.reserve("a", 11, 0.2, keys=h)
    d = c.decide(11, 0.21, keys=h)  # waiting behind a prompt it shares costs nothing of its own
    assert d.replicas[0] == "a" and d.new_blocks == 0
