"""The lower KV tiers of the prefix cache: the index's LRU and moves (unit), the tier memory's copies, and the
engine with a pool too small for the live prefixes: tokens identical to no tier and to transformers, fewer
prefill tokens, nothing leaked, nothing stale."""

import random

import pytest
import torch

from conveyor.engine import EngineConfig, SamplingParams
from conveyor.engine.core.block_manager import BlockManager
from conveyor.engine.core.invariants import InvariantError, check_tiers
from conveyor.engine.core.kv_tiers import KVTiers, LoadCost
from conveyor.engine.core.sequence import Sequence
from conveyor.engine.execution.kv_tier_store import KVTierStore
from conveyor.engine.kv_offload import KVOffloadConfig
from tests.helpers import assert_no_leak, engine_greedy, hf_greedy

MODEL = "demo:llama-tiny"
POOL = dict(num_blocks=10, block_size=8, max_num_batched_tokens=64, check_invariants=True)


def key(i: int) -> bytes:
    return i.to_bytes(4, "little")


def test_tier_lru_moves_down_then_drops_the_least_recent() -> None:
    tiers = KVTiers([("host", 2), ("disk", 2)])
    for i, block in enumerate((7, 8, 9)):
        tiers.store(key(i), block, before_forward=False)
    # host was full at key 2: its least recent key (0) moved to disk before slot 1 was reused
    assert list(tiers.tier(1).lru) == [key(1), key(2)] and list(tiers.tier(2).lru) == [key(0)]
    assert tiers.after == [(0, 7, 1, 0), (0, 8, 1, 1), (1, 0, 2, 0), (0, 9, 1, 0)]
    tiers.load(key(1), 3)  # key 1 becomes the most recent: key 2 is host's next victim
    tiers.store(key(3), 4, before_forward=True)
    assert list(tiers.tier(1).lru) == [key(1), key(3)] and list(tiers.tier(2).lru) == [key(0), key(2)]
    assert tiers.before == [(1, 1, 0, 3), (1, 0, 2, 1), (0, 4, 1, 0)]
    tiers.store(key(4), 5, before_forward=True)  # key 1 moves down, disk drops its least recent: key 0
    assert key(0) not in tiers and tiers.where[key(1)] == 2 and tiers.tier(2).stats.dropped == 1
    assert tiers.tier(1).stats.hits == 1
    assert tiers.check() is None
    transfer = tiers.take()
    assert (
        transfer.num_loads == 1
        and transfer.before[3:] == [(1, 1, 2, 0), (0, 5, 1, 1)]
        and not tiers.before
        and not tiers.after
    )


def test_the_index_check_finds_a_slot_used_twice() -> None:
    tiers = KVTiers([("host", 2)])
    tiers.store(key(0), 0, before_forward=False)
    tiers.tier(1).lru[key(1)] = tiers.tier(1).lru[key(0)]
    tiers.where[key(1)] = 1
    assert "each slot once" in tiers.check()
    kv = BlockManager(4, 4, True, tiers=tiers)
    with pytest.raises(InvariantError):
        check_tiers(kv)


def test_evicted_and_idle_blocks_are_stored_and_a_lower_hit_is_loaded_back() -> None:
    tiers = KVTiers([("host", 8)])
    kv = BlockManager(3, 4, True, tiers=tiers)
    a = Sequence("a", list(range(9)), SamplingParams())
    assert kv.allocate(a, 9) == [0, 1, 2]
    a.num_computed_tokens = 9
    kv.forget(a)  # blocks 0 and 1 are cached and idle: stored beside the next forward
    transfer = kv.take_transfer()
    assert transfer.after == [(0, 1, 1, 0), (0, 0, 1, 1)] and not transfer.before
    b = Sequence("b", [50 + i for i in range(12)], SamplingParams())
    kv.allocate(b, 12)  # takes every block: nothing more to store, both keys already are
    assert kv.take_transfer() is None
    b.num_computed_tokens = 12
    kv.forget(b)  # b's blocks go idle, but c evicts them in the same step, before they were stored
    c = Sequence("c", list(range(9)) + [99], SamplingParams())
    prefix = kv.cached_prefix(c)
    loads = kv.lower_prefix(c, prefix)
    assert prefix == [] and len(loads) == 2
    ids = kv.allocate(c, 2, prefix, 0, loads)
    transfer = kv.take_transfer()
    # b's cached blocks evicted for c are stored first (before the loads that overwrite them)
    stores = [x for x in transfer.before if x[2] == 1]
    loaded = [x for x in transfer.before if x[2] == 0]
    assert len(stores) == 3 and transfer.before[:3] == stores
    assert [x[3] for x in loaded] == ids[:2] and transfer.num_loads == 2
    assert tiers.check() is None


def test_the_tier_memory_round_trips_a_block_through_host_and_disk(tmp_path) -> None:
    pool = torch.randn(2, 3, 4, 8, 2, 4)
    store = KVTierStore(pool, [("host", 2), ("disk", 3)], str(tmp_path), rank=0)
    assert list(tmp_path.iterdir()) == []  # the disk file is unlinked once mapped
    want = pool[:, :, 1].clone()
    store.start([(0, 1, 1, 0), (1, 0, 2, 2)])  # pool -> host -> disk, on the copy thread
    store.wait()
    pool[:, :, 1] = 0
    store.run([(2, 2, 0, 3)])
    assert torch.equal(pool[:, :, 3], want)
    store.close()


def test_offload_config_is_validated_by_name() -> None:
    with pytest.raises(ValueError, match="kv_offload.host_gib"):
        KVOffloadConfig(host_gib=-1)
    with pytest.raises(ValueError, match="disk_path and disk_gib"):
        KVOffloadConfig(disk_gib=1)
    with pytest.raises(ValueError, match="needs host_gib"):
        KVOffloadConfig()
    with pytest.raises(ValueError, match="unknown fields"):
        KVOffloadConfig.of({"host_gb": 1})
    with pytest.raises(ValueError, match="enable_prefix_caching"):
        EngineConfig(model=MODEL, kv_offload={"host_gib": 1}, enable_prefix_caching=False)
    assert EngineConfig(model=MODEL, kv_offload={"host_gib": 0.5}).kv_offload == KVOffloadConfig(host_gib=0.5)
    assert KVOffloadConfig(host_gib=1).tier_slots(1 << 20) == [("host", 1024)]
    with pytest.raises(ValueError, match="kv_offload.disk_gib .* holds no KV block"):
        KVOffloadConfig(host_gib=1, disk_path="/tmp", disk_gib=1e-9).tier_slots(1 << 20)


def test_load_cost_is_load_time_over_prefill_time_per_block() -> None:
    cost = LoadCost(block_size=16)
    assert cost.ratio == cost.prior
    cost.observe(step_s=0.16, num_prefill_tokens=160, load_s=0.0, num_loads=0)  # 1 ms a token
    cost.observe(step_s=0.0, num_prefill_tokens=0, load_s=0.004, num_loads=4)  # 1 ms a block
    assert cost.ratio == pytest.approx(1 / 16)


def conversations(n: int, rounds: int, system_len: int, seed: int = 0) -> list[list[list[int]]]:
    """Per conversation, each round's new user tokens (the first with its long system prompt)."""
    rng = random.Random(seed)
    return [
        [[rng.randrange(3, 250) for _ in range(system_len if r == 0 else 5)] for r in range(rounds)] for _ in range(n)
    ]


def chat(llm, convs: list[list[list[int]]], max_tokens: int = 4) -> tuple[list[list[int]], list[list[int]]]:
    """Round-robin multi-turn chat: each turn's prompt is the whole history. Returns prompts and outputs."""
    history = [[] for _ in convs]
    prompts, outputs = [], []
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    for r in range(len(convs[0])):
        for i, conv in enumerate(convs):
            prompt = history[i] + conv[r]
            out = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0].outputs[0].token_ids
            history[i] = prompt + list(out)
            prompts.append(prompt)
            outputs.append(list(out))
    return prompts, outputs


TIERS = {
    "host": {"host_gib": 0.001},
    "disk": {"disk_path": None, "disk_gib": 0.001},
    "host+disk, both tiny": {"host_gib": 1.25e-4, "disk_path": None, "disk_gib": 1.9e-4},  # 4 and 6 blocks
}


@pytest.fixture(scope="module")
def baseline() -> tuple[list[list[list[int]]], list[list[int]], list[list[int]], int]:
    convs = conversations(4, 3, system_len=40)
    _, llm = engine_greedy(MODEL, [], 1, **POOL)
    prompts, outputs = chat(llm, convs)
    return convs, prompts, outputs, llm.engine.local_core.num_prefill_tokens


@pytest.mark.parametrize("tier", list(TIERS))
def test_a_pool_smaller_than_the_live_prefixes_hits_the_tiers(baseline, tier: str, tmp_path) -> None:
    convs, prompts, want, prefill_without = baseline
    if tier == "host+disk, both tiny":  # two conversations: the tiers hold about one history each
        keep = [i for i in range(len(prompts)) if i % len(convs) < 2]
        convs, prompts, want = convs[:2], [prompts[i] for i in keep], [want[i] for i in keep]
    offload = {k: (str(tmp_path) if k == "disk_path" else v) for k, v in TIERS[tier].items()}
    _, llm = engine_greedy(MODEL, [], 1, kv_offload=offload, **POOL)
    got_prompts, got = chat(llm, convs)
    assert got_prompts == prompts and got == want
    core = llm.engine.local_core
    tiers = core.block_manager.tiers
    assert sum(t.stats.hits for t in tiers.tiers) > 0
    assert core.num_prefill_tokens < prefill_without / 2 or tier == "host+disk, both tiny"
    if tier == "host+disk, both tiny":  # slots reused many times over: a stale slot would change tokens
        assert [t.num_slots for t in tiers.tiers] == [4, 6] and tiers.tier(2).stats.dropped > 0
    assert_no_leak(llm)
    assert tiers.check() is None


def test_tier_hits_match_transformers(baseline, tmp_path) -> None:
    convs, prompts, _, _ = baseline
    _, llm = engine_greedy(MODEL, [], 1, kv_offload={"host_gib": 0.001}, **POOL)
    chat(llm, convs)  # every conversation's history is in the tiers now
    last = prompts[-len(convs) :]
    outs = llm.generate([{"prompt_token_ids": p} for p in last], PARAMS, use_tqdm=False)
    got = [o.outputs[0].token_ids for o in outs]
    assert llm.engine.local_core.block_manager.tiers.tier(1).stats.hits > 0
    assert got == hf_greedy(MODEL, last, 6)
    assert_no_leak(llm)


PARAMS = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


def test_aborts_and_preemption_with_tiers_leak_nothing(baseline) -> None:
    convs, prompts, _, _ = baseline
    _, llm = engine_greedy(MODEL, [], 1, kv_offload={"host_gib": 0.001}, **{**POOL, "max_num_batched_tokens": 16})
    engine = llm.engine
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, PARAMS)
    for _ in range(6):
        engine.step()
    for i in range(0, len(prompts), 2):
        engine.abort_request(f"r{i}")
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.stats().num_preemptions > 0
    assert_no_leak(llm)


def test_stores_planned_while_allocating_for_loads_never_take_the_loaded_slots() -> None:
    tiers = KVTiers([("host", 2)])
    tiers.store(key(0), 0, before_forward=False)
    tiers.store(key(1), 1, before_forward=False)
    tiers.held = {key(0), key(1)}
    tiers.store(key(2), 2, before_forward=True)  # every key is held: the evicted block is not stored
    assert key(2) not in tiers and set(tiers.where) == {key(0), key(1)} and not tiers.before
    tiers.held = {key(0)}
    tiers.store(key(2), 2, before_forward=True)
    assert set(tiers.where) == {key(0), key(2)}


def test_kv_events_place_each_key_in_the_pool_a_lower_tier_or_nowhere(tmp_path) -> None:
    """What the cluster's index learns from the drained events (engine/core/kv_events.py) is where each key
    really is, through stores, loads, moves down and drops from the last tier."""
    offload = {k: (str(tmp_path) if k == "disk_path" else v) for k, v in TIERS["host+disk, both tiny"].items()}
    _, llm = engine_greedy(MODEL, [], 1, kv_offload=offload, **POOL)
    kv = llm.engine.local_core.block_manager
    index: dict[bytes, str] = {}
    seen = {"stored": 0, "offloaded": 0, "evicted": 0}
    history = [[] for _ in range(3)]
    for r, turn in enumerate(zip(*conversations(3, 4, system_len=40))):
        for i, new in enumerate(turn):
            prompt = history[i] + new
            out = llm.generate([{"prompt_token_ids": prompt}], PARAMS, use_tqdm=False)[0].outputs[0].token_ids
            history[i] = prompt + list(out)
            events = llm.engine.drain_kv_events()
            if events.reset:
                index.clear()
            for name in seen:
                seen[name] += len(getattr(events, name))
            index.update({k: "pool" for k in events.stored} | {k: "lower" for k in events.offloaded})
            for k in events.evicted:
                index.pop(k, None)
            truth = {k: "lower" for k in kv.tiers.where} | {k: "pool" for k in kv.pool.cached}
            assert index == truth, f"round {r}, conversation {i}"
    assert all(seen.values()) and kv.tiers.tier(2).stats.dropped > 0, seen
