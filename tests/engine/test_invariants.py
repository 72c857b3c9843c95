"""engine/core/invariants.py: the debug mode passes real workloads (preemption in both modes, prefix-cache hits)
and catches each kind of corruption of the block pool, the tables, the swap slots and the persistent batch."""

from dataclasses import replace

import pytest

from conveyor.engine import LLM, SamplingParams
from conveyor.engine.config import EngineConfig
from conveyor.engine.core.block_manager import BlockManager
from conveyor.engine.core.invariants import InvariantError, check_invariants
from conveyor.engine.core.scheduler import Scheduler
from conveyor.engine.core.sequence import Sequence
from conveyor.engine.resolved_config import resolve
from conveyor.engine.step import ModelRunnerOutput
from tests.helpers import assert_no_leak

EOS = 2
BASE = resolve(EngineConfig(model="demo:tiny", attention_backend="torch"))


def step(sched: Scheduler, token: int = 20) -> None:
    so = sched.schedule()
    sampled = [c.req_id for c in so.chunks if c.sample]
    sched.update(so, ModelRunnerOutput(sampled, [token] * len(sampled), [None] * len(sampled)), 0.0)


def busy_scheduler(mode: str = "recompute", swap_blocks: int = 0) -> Scheduler:
    """Three requests sharing a 2-block prefix on a 12-block cache, stepped until one is preempted."""
    cfg = replace(BASE, block_size=4, max_model_len=256, preemption_mode=mode, check_invariants=True)
    sched = Scheduler(cfg, BlockManager(12, 4, True, swap_blocks), {EOS})
    shared = list(range(10, 18))
    for i in range(3):
        sched.add(Sequence(str(i), shared + [30 + i] * 3, SamplingParams(max_tokens=30, ignore_eos=True)))
    for _ in range(40):
        step(sched)
        if sched.num_preemptions and sched.running and (mode == "recompute" or sched.swapped):
            return sched
    raise AssertionError("the workload must preempt")


def test_flag_defaults_off_and_the_suite_turns_it_on(monkeypatch: pytest.MonkeyPatch) -> None:
    assert EngineConfig(model="demo:tiny").check_invariants, "tests/conftest.py sets CONVEYOR_CHECK_INVARIANTS=1"
    monkeypatch.delenv("CONVEYOR_CHECK_INVARIANTS")
    assert not EngineConfig(model="demo:tiny").check_invariants


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_engine_workload_with_preemption_and_cache_hits_passes(mode: str) -> None:
    llm = LLM(
        "demo:llama-tiny",
        dtype="float32",
        num_blocks=14,
        block_size=4,
        max_num_seqs=4,
        preemption_mode=mode,
        swap_space=2**20,
        check_invariants=True,
    )
    assert llm.engine.local_core.scheduler.runner_batch is llm.engine.local_core.executor.runner.batch
    shared = list(range(100, 112))
    prompts = [{"prompt_token_ids": shared + [200 + i] * (3 + i)} for i in range(4)]
    outs = llm.generate(prompts * 2, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False)
    stats = llm.engine.stats()
    assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0
    assert all(len(o.outputs[0].token_ids) == 12 for o in outs)
    assert_no_leak(llm)


def test_clean_state_passes_after_preemption() -> None:
    for mode, swap in (("recompute", 0), ("swap", 16)):
        sched = busy_scheduler(mode, swap)
        check_invariants(sched)
        while sched.has_unfinished:
            step(sched)
        assert sched.kv.num_free_blocks == 12


def test_ref_count_off_by_one_is_caught() -> None:
    sched = busy_scheduler()
    block = sched.kv.tables[sched.running[0].request_id][0]
    block.ref_count += 1
    with pytest.raises(InvariantError, match=rf"block {block.block_id}: ref_count .* block tables hold it"):
        step(sched)


def test_block_lost_from_the_free_list_is_caught() -> None:
    sched = busy_scheduler()
    pool = sched.kv.pool
    queue = pool.free_plain if pool.free_plain else pool.free_cached
    lost = next(iter(queue))
    del queue[lost]
    with pytest.raises(InvariantError, match=rf"missing \[{lost}\]"):
        check_invariants(sched)


def test_owned_block_on_the_free_list_is_caught() -> None:
    sched = busy_scheduler()
    block = sched.kv.tables[sched.running[0].request_id][-1]
    sched.kv.pool.free_plain[block.block_id] = block
    with pytest.raises(InvariantError, match=rf"block {block.block_id} is in free_plain with ref_count"):
        check_invariants(sched)


def test_prefix_map_pointing_at_the_wrong_block_is_caught() -> None:
    sched = busy_scheduler()
    pool = sched.kv.pool
    h, block = next(iter(pool.cached.items()))
    other = next(b for b in pool.blocks if b is not block)
    pool.cached[h] = other
    with pytest.raises(InvariantError, match="prefix map entry"):
        check_invariants(sched)


def test_block_cached_under_another_prefix_is_caught() -> None:
    sched = busy_scheduler()
    seq = next(s for s in sched.running if len(sched.kv.hashes.get(s.request_id, [])) >= 2)
    table, hashes = sched.kv.tables[seq.request_id], sched.kv.hashes[seq.request_id]
    hashes[0], hashes[1] = hashes[1], hashes[0]
    with pytest.raises(InvariantError, match=f"request '{seq.request_id}': prefix hash of block 0"):
        check_invariants(sched)
    hashes[0], hashes[1] = hashes[1], hashes[0]
    check_invariants(sched)
    table[0], table[1] = table[1], table[0]
    with pytest.raises(InvariantError, match="cached under another prefix"):
        check_invariants(sched)


def test_table_shorter_than_the_computed_tokens_is_caught() -> None:
    sched = busy_scheduler()
    seq = sched.running[0]
    table = sched.kv.tables[seq.request_id]
    sched.kv.pool.release([table.pop()])
    with pytest.raises(InvariantError, match=f"request '{seq.request_id}': .* blocks for"):
        check_invariants(sched)


def test_swap_slot_given_out_twice_is_caught() -> None:
    sched = busy_scheduler("swap", 16)
    rid, slots = next(iter(sched.kv.swapped.items()))
    sched.kv.free_swap.append(slots[0])
    with pytest.raises(InvariantError, match=rf"swap slots: duplicated \[{slots[0]}\]"):
        check_invariants(sched)


def test_request_in_two_queues_is_caught() -> None:
    sched = busy_scheduler()
    sched.waiting.append(sched.running[0])
    with pytest.raises(InvariantError, match="is in both running and waiting"):
        check_invariants(sched)


def test_persistent_batch_row_out_of_step_is_caught_in_the_engine_step() -> None:
    llm = LLM("demo:llama-tiny", dtype="float32", num_blocks=32, block_size=4, check_invariants=True)
    engine = llm.engine
    engine.add_request("r", list(range(100, 110)), SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
    engine.step()
    batch = engine.local_core.executor.runner.batch
    row = batch.rows["r"]
    batch.block_table[row, 0] = (batch.block_table[row, 0] + 1) % 32
    with pytest.raises(InvariantError, match=f"persistent batch row {row} holds blocks"):
        engine.step()
