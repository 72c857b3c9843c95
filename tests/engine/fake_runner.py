"""A scheduler over a small block pool and a fake runner that checks, for every chunk, that each KV slot it reads
holds what was computed from exactly its own token prefix: scheduler-level memory tests without a model; and
the check that a block pool is whole."""

from collections import defaultdict
from dataclasses import replace

from conveyor.engine.config import EngineConfig
from conveyor.engine.core.block_manager import BlockManager
from conveyor.engine.core.scheduler import Scheduler
from conveyor.engine.resolved_config import resolve
from conveyor.engine.step import ModelRunnerOutput, SchedulerOutput

EOS = 2


BASE = resolve(EngineConfig(model="demo:tiny", attention_backend="torch"))


def make_scheduler(num_blocks: int, block_size: int = 4, swap_blocks: int = 0, **options: object) -> Scheduler:
    options = {"enable_prefix_caching": True, "max_model_len": 2048, **options}
    cfg = replace(BASE, block_size=block_size, **options)
    kv = BlockManager(num_blocks, block_size, cfg.enable_prefix_caching, swap_blocks)
    return Scheduler(cfg, kv, {EOS})


class FakeRunner:
    """Plays the model runner on block ids: a KV slot holds a fingerprint of the token prefix it was
    computed from, and every position a chunk attends to must read back the prefix it expects."""

    def __init__(self, sched: Scheduler) -> None:
        self.sched, self.bs = sched, sched.kv.block_size
        self.gpu: dict[int, list] = defaultdict(lambda: [None] * self.bs)
        self.cpu: dict[int, list] = {}
        self.tables: dict[str, list[int]] = {}
        self.steps = 0

    def sample(self, tokens: list[int]) -> int:
        return hash(tuple(tokens)) % 40 + 10

    def execute(self, so: SchedulerOutput) -> ModelRunnerOutput:
        self.steps += 1
        for block, slot in so.swap_out:
            self.cpu[slot] = list(self.gpu[block])
        for slot, block in so.swap_in:
            self.gpu[block] = list(self.cpu[slot])
        for c in so.chunks:
            self.tables[c.req_id] = list(c.new_block_ids) if c.reset_blocks else self.tables[c.req_id] + c.new_block_ids
        tokens = {c.req_id: self.sched.requests[c.req_id].token_ids for c in so.chunks}
        for c in so.chunks:
            assert c.token_ids == tokens[c.req_id][c.start : c.start + len(c.token_ids)]
            for pos in range(c.start, c.start + len(c.token_ids)):
                self.gpu[self.tables[c.req_id][pos // self.bs]][pos % self.bs] = hash(
                    tuple(tokens[c.req_id][: pos + 1])
                )
        for c in so.chunks:
            table = self.tables[c.req_id]
            for pos in range(c.start + len(c.token_ids)):
                assert self.gpu[table[pos // self.bs]][pos % self.bs] == hash(tuple(tokens[c.req_id][: pos + 1])), (
                    f"{c.req_id} reads stale KV at position {pos} (block {table[pos // self.bs]})"
                )
        sampled = [c.req_id for c in so.chunks if c.sample]
        toks = [self.sample(tokens[r] + [0]) for r in sampled]
        return ModelRunnerOutput(sampled, toks, [None] * len(sampled))

    def step(self) -> SchedulerOutput:
        so = self.sched.schedule()
        self.sched.update(so, self.execute(so), float(self.steps))
        return so


def assert_pool_consistent(kv: BlockManager) -> None:
    pool = kv.pool
    free = list(pool.free_plain.values()) + list(pool.free_cached.values())
    assert len(free) == len({b.block_id for b in free}) == kv.num_blocks, "every block free exactly once"
    assert all(b.ref_count == 0 for b in pool.blocks) and not kv.tables and not kv.swapped
    assert all(b.hash is None for b in pool.free_plain.values())
    assert all(pool.cached[b.hash] is b for b in pool.free_cached.values())
    assert len(pool.cached) == len(pool.free_cached)
    assert len(kv.free_swap) == kv.num_swap_blocks
