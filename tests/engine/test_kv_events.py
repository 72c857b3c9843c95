"""KV events: the engine's own prefix-cache keys, stored and evicted, drained into a reader's index that
matches the cache exactly; the cluster layer hashes prompts the same way (engine.prefix_hash)."""

import random
import subprocess
import sys

from conveyor.engine import LLM, SamplingParams
from conveyor.engine.core.kv_events import KVEventLog
from conveyor.engine.core.prefix_hash import block_hashes


def apply(index: set[bytes], events) -> None:
    if events.reset:
        index.clear()
    index.difference_update(events.evicted + events.offloaded)
    index.update(events.stored)


def test_log_reports_each_changed_key_once_at_its_place_bounded_and_resets_on_overflow() -> None:
    places: dict[bytes, str] = {}
    log = KVEventLog(lambda k: places.get(k, "none"), lambda: list(places), max_entries=4)
    first = log.drain()
    assert first.reset and first.stored == []
    places[b"a"] = places[b"b"] = "pool"
    log.add(b"a")
    log.add(b"b")
    places[b"a"] = "lower"  # its pool block went, a host copy stays
    log.add(b"a")
    e = log.drain(max_events=1)
    assert (e.stored, e.evicted, e.offloaded, e.reset) == ([b"b"], [], [], False)
    assert log.drain().offloaded == [b"a"]
    del places[b"a"]
    log.add(b"a")
    assert log.drain().evicted == [b"a"]
    for k in (b"1", b"2", b"3", b"4", b"5"):
        log.add(k)
    places.clear()
    places.update({b"4": "pool", b"5": "lower"})
    e = log.drain()
    assert e.reset and e.stored == [b"4"] and e.offloaded == [b"5"]
    log.request_reset()
    places[b"x"] = "pool"
    assert log.drain().stored == [b"4", b"x"]


def test_drained_events_track_the_engine_cache_through_evictions() -> None:
    llm = LLM(
        "demo:tiny",
        dtype="float32",
        num_blocks=24,
        block_size=16,
        max_num_seqs=4,
        max_num_batched_tokens=256,
        enable_prefix_caching=True,
    )
    kv = llm.engine.local_core.block_manager
    rng = random.Random(0)
    index: set[bytes] = set()
    systems = [[rng.randrange(4, 8000) for _ in range(80)] for _ in range(4)]
    sp = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    resets = evicted = 0
    for r in range(5):
        prompts = [
            {
                "prompt_token_ids": systems[(r + i) % 4] + [rng.randrange(4, 8000) for _ in range(9)],
                "cache_salt": "t" if i == 1 else None,
            }
            for i in range(3)
        ]
        llm.generate(prompts, sp, use_tqdm=False)
        events = llm.engine.drain_kv_events()
        resets += events.reset
        evicted += len(events.evicted)
        apply(index, events)
        assert index == set(kv.pool.cached)
        for p in prompts:  # the keys the cluster computes for a prompt are the engine's own, salted alike
            keys = block_hashes(p["prompt_token_ids"], 16, p["cache_salt"])
            assert len(keys) == 5 and set(keys) <= index
    assert resets == 1  # only the first drain lists everything
    assert kv.num_free_blocks == kv.num_blocks and evicted > 0  # a 24-block cache evicted across rounds
    salted = block_hashes(systems[0], 16, "t")
    assert salted[0] != block_hashes(systems[0], 16)[0]


def test_prefix_hash_imports_without_torch() -> None:
    code = "import sys, conveyor.engine.core.prefix_hash, conveyor.engine.core.kv_events, conveyor.engine.stats; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_the_front_ends_mirror_relays_places_and_turns_a_core_reset_into_differences() -> None:
    from conveyor.engine.core.kv_events import KVEvents
    from conveyor.engine.process.core_client import KVMirror

    mirror = KVMirror()
    mirror.apply(KVEvents(stored=[b"a", b"b"], offloaded=[b"c"], reset=True))
    first = mirror.drain()  # the reader's first drain lists everything, as the core's own log does
    assert first.reset and (first.stored, first.offloaded) == ([b"a", b"b"], [b"c"])
    mirror.apply(KVEvents(offloaded=[b"a"], evicted=[b"c"]))
    e = mirror.drain()
    assert (e.stored, e.offloaded, e.evicted, e.reset) == ([], [b"a"], [b"c"], False)
    mirror.apply(KVEvents(stored=[b"b", b"d"], offloaded=[b"a"], reset=True))  # the core's log overflowed
    e = mirror.drain()
    assert (e.stored, e.offloaded, e.evicted, e.reset) == ([b"d"], [], [], False)  # only what changed
    assert mirror.places == {b"a": "lower", b"b": "pool", b"d": "pool"}
