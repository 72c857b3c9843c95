"""What a replica reports to the cluster layer: its stats from the engine's, block counts at its block size,
the prompt block keys (the engine's own), and when a push is due."""

from dataclasses import replace

import pytest

from conveyor.cluster.stats import ReplicaStats, block_hashes, num_blocks, push_due
from conveyor.engine.core.prefix_hash import block_hashes as engine_block_hashes
from conveyor.engine.stats import EngineStats
from tests.cluster.replica_stats import rs


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


def test_cluster_keys_are_the_engines_keys():
    ids = list(range(50))
    assert block_hashes(ids, 16) == engine_block_hashes(ids, 16)
    assert (
        block_hashes(ids, 16, "t") != block_hashes(ids, 16)
        and block_hashes(ids, 16, max_blocks=2) == block_hashes(ids, 16)[:2]
    )


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
