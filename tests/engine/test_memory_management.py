"""Prefix caching, swap, priority with aging, partial prefills and the watermark (issue 3).
Scheduler-level tests run against a fake runner that checks every KV slot a chunk reads; engine-level
tests check greedy outputs on demo:llama-tiny."""

import random
from collections import defaultdict
from dataclasses import replace

import pytest

from conveyor.engine import LLM, SamplingParams
from conveyor.engine.config import EngineConfig
from conveyor.engine.core.block_manager import BlockManager
from conveyor.engine.core.scheduler import Scheduler
from conveyor.engine.core.sequence import Sequence
from conveyor.engine.core.watermark import Watermark
from conveyor.engine.resolved_config import resolve
from conveyor.engine.step import ModelRunnerOutput, SchedulerOutput
from tests.helpers import assert_no_leak

EOS = 2
BASE = resolve(EngineConfig(model="demo:tiny", attention_backend="torch"))
MODEL = "demo:llama-tiny"


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


def random_workload(rng: random.Random, sched: Scheduler, runner: FakeRunner, num_requests: int) -> None:
    prefixes = [[rng.randrange(10, 50) for _ in range(40)] for _ in range(3)]
    arrivals: dict[int, list[Sequence]] = defaultdict(list)
    aborts: dict[int, list[Sequence]] = defaultdict(list)
    capacity = sched.kv.num_blocks * sched.kv.block_size
    for i in range(num_requests):
        prompt = rng.choice(prefixes)[: rng.randint(1, 40)] + [rng.randrange(10, 50) for _ in range(rng.randint(0, 9))]
        max_tokens = min(rng.randint(1, 24), capacity - len(prompt))
        seq = Sequence(
            str(i),
            prompt,
            SamplingParams(max_tokens=max_tokens),
            priority=rng.randint(0, 2),
            cache_salt=rng.choice([None, None, "tenant"]),
        )
        arrivals[rng.randint(0, 20)].append(seq)
        if rng.random() < 0.1:
            aborts[rng.randint(0, 40)].append(seq)
    for step in range(2000):
        for seq in arrivals.pop(step, []):
            sched.add(seq)
        for seq in aborts.pop(step, []):
            if seq.request_id in sched.requests:
                sched.finish(seq, "abort")
        if not arrivals and not sched.has_unfinished:
            return
        so, cfg = runner.step(), sched.config
        assert so.num_tokens <= cfg.max_num_batched_tokens and len(so.chunks) <= cfg.max_num_seqs
        assert not cfg.max_num_partial_prefills or sum(not c.sample for c in so.chunks) <= cfg.max_num_partial_prefills
        assert all(len(c.token_ids) <= (cfg.long_prefill_token_threshold or 10**9) for c in so.chunks)
    raise AssertionError("no progress")


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_every_kv_read_sees_what_was_written(mode: str) -> None:
    """Prefix hits, partial-block prefixes, salts, preemption (recompute, swap, swap full), aborts:
    a chunk only ever attends to KV computed from exactly its own token prefix, and nothing leaks."""
    for seed in range(120):
        rng = random.Random(seed)
        num_blocks, block_size = rng.randint(14, 30), rng.choice([4, 8])
        swap_blocks = rng.choice([2, 8, 30]) if mode == "swap" else 0
        sched = make_scheduler(
            num_blocks,
            block_size,
            swap_blocks,
            preemption_mode=mode,
            max_num_batched_tokens=rng.choice([8, 32, 96]),
            max_num_seqs=rng.randint(2, 6),
            long_prefill_token_threshold=rng.choice([0, 6]),
            max_num_partial_prefills=rng.choice([0, 1]),
            watermark=rng.choice([0.0, 0.1]),
            adaptive_watermark=rng.random() < 0.5,
            aging_rate=rng.choice([1.0, 20.0]),
        )
        runner = FakeRunner(sched)
        random_workload(rng, sched, runner, rng.randint(4, 14))
        assert_pool_consistent(sched.kv)


def test_lru_eviction_order_and_plain_blocks_first() -> None:
    kv = BlockManager(8, 4, True)
    seqs = [Sequence(name, [10 + i] * 8, SamplingParams()) for i, name in enumerate("abc")]
    for s in seqs:
        assert kv.allocate(s, 8) is not None
        s.num_computed_tokens = 8
    a, b, c = (kv.block_ids(s) for s in seqs)
    for s in seqs:
        kv.forget(s)
    assert list(kv.pool.free_cached) == a[::-1] + b[::-1] + c[::-1], "released tail-first, oldest request first"
    assert kv.allocate(Sequence("d", [1] * 8, SamplingParams()), 8) == [6, 7]
    hit = Sequence("a2", [10] * 8 + [5], SamplingParams())
    assert kv.cached_prefix(hit) == [kv.pool.blocks[i] for i in a], "a is still cached: never-cached blocks went first"
    assert kv.allocate(Sequence("e", [1] * 12, SamplingParams()), 12) == [a[1], a[0], b[1]], "LRU: a, then b's tail"
    assert kv.cached_prefix(hit) == []
    assert [x.block_id for x in kv.cached_prefix(Sequence("b2", [11] * 8 + [5], SamplingParams()))] == b[:1]
    assert [x.block_id for x in kv.cached_prefix(Sequence("c2", [12] * 8 + [5], SamplingParams()))] == c


def test_high_priority_finishes_first_and_low_priority_is_the_victim() -> None:
    sched = make_scheduler(10, max_num_seqs=3, enable_prefix_caching=False)
    runner = FakeRunner(sched)
    victims = []
    preempt = sched._preempt
    sched._preempt = lambda seq, out: (
        victims.append((seq.priority, max(s.priority for s in sched.running))),
        preempt(seq, out),
    )
    seqs = [
        Sequence(f"{p}{i}", [10 + i] * 6, SamplingParams(max_tokens=10), priority=p, arrival_time=float(i))
        for i in range(4)
        for p in (1, 0)
    ]
    for s in seqs:
        sched.add(s)
    done: dict[str, int] = {}
    while sched.has_unfinished:
        runner.step()
        done.update({s.request_id: runner.steps for s in seqs if s.is_finished and s.request_id not in done})
    high, low = [done[s.request_id] for s in seqs if s.priority == 0], [done[s.request_id] for s in seqs if s.priority]
    assert max(high) <= min(low)
    assert victims and all(v == worst for v, worst in victims)
    assert any(v == 1 for v, _ in victims), "a low-priority request ran beside a high one and was preempted"


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preempted_request_resumes_before_later_arrivals(mode: str) -> None:
    sched = make_scheduler(8, max_num_seqs=2, enable_prefix_caching=False, preemption_mode=mode, swap_blocks=16)
    runner = FakeRunner(sched)
    a, b = (Sequence(r, [10 + i] * 8, SamplingParams(max_tokens=12), arrival_time=float(i)) for i, r in enumerate("ab"))
    later = Sequence("c", [12] * 4, SamplingParams(max_tokens=4), arrival_time=2.0)
    sched.add(a), sched.add(b)
    runner.step()
    sched.add(later)
    resumed_from = None
    while sched.has_unfinished:
        scheduled = {c.req_id: c.start for c in runner.step().chunks}
        if b.num_preemptions and resumed_from is None and "b" in scheduled:
            resumed_from = scheduled["b"]
        assert "c" not in scheduled or resumed_from is not None, "a later arrival overtook the preempted request"
    assert b.num_preemptions == 1 and resumed_from is not None
    assert (resumed_from > 0) == (mode == "swap"), "swapped back in where it stopped, or recomputed from 0"


def starve(aging_rate: float, steps: int, mode: str) -> int | None:
    """One low-priority request under a stream of high-priority ones arriving faster than they are served;
    the cache is tight, so it is also preempted (swapped out) while it runs."""
    sched = make_scheduler(
        12, max_num_seqs=4, enable_prefix_caching=False, aging_rate=aging_rate, preemption_mode=mode, swap_blocks=64
    )
    runner = FakeRunner(sched)
    low = Sequence("low", [9] * 8, SamplingParams(max_tokens=30), priority=3)
    sched.add(low)
    for i in range(steps):
        sched.add(Sequence(f"h{i}", [10 + i % 30] * 4, SamplingParams(max_tokens=6), priority=0))
        runner.step()
        if low.is_finished:
            return runner.steps
    return None


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_aging_bounds_the_wait_of_a_low_priority_request(mode: str) -> None:
    assert starve(aging_rate=0, steps=400, mode=mode) is None, "without aging the stream starves it"
    finished_at = starve(aging_rate=10, steps=400, mode=mode)
    assert finished_at is not None and finished_at <= 150, f"finished at step {finished_at}"


def decode_gaps(threshold: int, cap: int) -> int:
    """Short requests left without a token in a step (summed over steps), long prompts arriving among them."""
    sched = make_scheduler(
        200, max_num_batched_tokens=32, long_prefill_token_threshold=threshold, max_num_partial_prefills=cap
    )
    runner = FakeRunner(sched)
    seqs = [
        Sequence(f"s{i}", [10 + i] * 5, SamplingParams(max_tokens=20))
        if i % 2 == 0
        else Sequence(f"l{i}", [20 + i] * 120, SamplingParams(max_tokens=4))
        for i in range(5)
    ]
    for s in seqs:
        sched.add(s)
    gaps = 0
    while sched.has_unfinished:
        scheduled = {c.req_id for c in runner.step().chunks}
        gaps += sum(1 for s in seqs if s.request_id[0] == "s" and not s.is_finished and s.request_id not in scheduled)
    return gaps


def test_long_prompts_without_caps_do_block_short_ones() -> None:
    assert decode_gaps(0, 0) > 5 and decode_gaps(8, 1) == 0


@pytest.fixture(scope="module")
def reference():
    """Greedy outputs of an engine with room for everything: no preemption, no prefix caching."""
    llm = LLM(MODEL, dtype="float32", block_size=8, num_blocks=256, enable_prefix_caching=False)
    cache = {}

    def get(prompts: list[list[int]], max_tokens: int = 16) -> list[list[int]]:
        todo = [p for p in prompts if (tuple(p), max_tokens) not in cache]
        if todo:
            for p, o in zip(todo, greedy(llm, todo, max_tokens)):
                cache[tuple(p), max_tokens] = o
        assert llm.engine.stats().num_preemptions == 0
        return [cache[tuple(p), max_tokens] for p in prompts]

    return get


def greedy(llm: LLM, prompts: list[list[int]], max_tokens: int = 16, **kwargs: object) -> list[list[int]]:
    outs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts],
        SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True),
        use_tqdm=False,
        **kwargs,
    )
    return [o.outputs[0].token_ids for o in outs]


def tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(4, 8192) for _ in range(n)]


def record_steps(llm: LLM) -> list[SchedulerOutput]:
    steps, execute = [], llm.engine.local_core.executor.execute_model
    llm.engine.local_core.executor.execute_model = lambda so: (steps.append(so), execute(so))[1]
    return steps


def test_prefix_cache_hits_keep_greedy_outputs(reference) -> None:
    rng = random.Random(1)
    base = tokens(rng, 43)
    shared = [base, base[:21] + tokens(rng, 9), base[:37] + tokens(rng, 4), base[:16], base + tokens(rng, 9)]
    other = [tokens(rng, 40) for _ in range(3)]
    llm = LLM(MODEL, dtype="float32", block_size=8, num_blocks=24, max_num_seqs=2)
    kv = llm.engine.local_core.block_manager
    assert greedy(llm, shared) == reference(shared)
    first = llm.engine.stats().prefix_cache_hits
    assert first >= 16 + 16 + 32 + 8, "partial-block and whole-prompt prefixes hit full blocks only"
    cached_before = set(kv.pool.cached)
    assert greedy(llm, other) == reference(other)
    assert cached_before - set(kv.pool.cached), "the unrelated prompts evicted part of the cache"
    outs = llm.generate(
        [{"prompt_token_ids": p} for p in shared],
        SamplingParams(temperature=0, max_tokens=16, ignore_eos=True),
        use_tqdm=False,
    )
    assert [o.outputs[0].token_ids for o in outs] == reference(shared)
    assert outs[3].metrics.num_cached_tokens == 8, "a fully cached prompt still computes its last block"
    assert llm.engine.stats().prefix_cache_hits > first
    assert_no_leak(llm)
    assert_pool_consistent(kv)

    salted = tokens(rng, 30)
    assert greedy(llm, [salted], cache_salt=["t1"]) == reference([salted])
    outs = llm.generate(
        [
            {"prompt_token_ids": salted, "cache_salt": "t2"},
            {"prompt_token_ids": salted, "cache_salt": "t1"},
            {"prompt_token_ids": salted},
        ],
        SamplingParams(temperature=0, max_tokens=16, ignore_eos=True),
        use_tqdm=False,
    )
    assert [o.outputs[0].token_ids for o in outs] == reference([salted]) * 3
    assert [o.metrics.num_cached_tokens for o in outs] == [0, 24, 0], "only the same tenant hits"
    assert_no_leak(llm)


def test_swap_round_trip_and_fallback_to_recompute(reference) -> None:
    rng = random.Random(2)
    prompts = [tokens(rng, rng.randint(20, 34)) for _ in range(6)]
    llm = LLM(
        MODEL,
        dtype="float32",
        block_size=8,
        num_blocks=16,
        enable_prefix_caching=False,
        preemption_mode="swap",
        swap_space=4 * 32768,
    )
    assert llm.engine.local_core.block_manager.num_swap_blocks == 4, "room for the smaller victims only"
    steps = record_steps(llm)
    outs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts],
        SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
        use_tqdm=False,
    )
    assert [o.outputs[0].token_ids for o in outs] == reference(prompts, 24)
    chunks = defaultdict(list)
    for so in steps:
        for c in so.chunks:
            chunks[c.req_id].append(c)
    swapped_in = {r: sum(c.reset_blocks and c.start > 0 for c in cs) for r, cs in chunks.items()}
    recomputed = {r: sum(c.start == 0 for c in cs) - 1 for r, cs in chunks.items()}
    assert sum(swapped_in.values()) > 0 and sum(recomputed.values()) > 0, "swapped, and fell back when full"
    assert sum(len(so.swap_in) for so in steps) == sum(len(so.swap_out) for so in steps) > 0
    for i, o in enumerate(outs):
        rid = str(i)
        assert o.metrics.num_preemptions == swapped_in[rid] + recomputed[rid], "every preemption counted"
        if not recomputed[rid]:
            assert sum(len(c.token_ids) for c in chunks[rid]) == len(prompts[i]) + 24 - 1, "resumed, not recomputed"
    assert_no_leak(llm)


def test_short_requests_decode_every_step_beside_long_prompts(reference) -> None:
    llm = LLM(
        MODEL,
        dtype="float32",
        block_size=8,
        num_blocks=128,
        max_num_batched_tokens=32,
        long_prefill_token_threshold=8,
        max_num_partial_prefills=1,
    )
    engine, steps = llm.engine, record_steps(llm)
    rng = random.Random(3)
    short, long = [tokens(rng, 5) for _ in range(3)], [tokens(rng, 120) for _ in range(2)]
    for i, p in enumerate([short[0], long[0], short[1], long[1], short[2]]):
        engine.add_request(
            f"{'sl'[i % 2]}{i}", p, SamplingParams(temperature=0, max_tokens=4 if i % 2 else 20, ignore_eos=True)
        )
    done = {}
    while engine.has_unfinished_requests():
        done.update({o.request_id: o.outputs[0].token_ids for o in engine.step() if o.finished})
        so, live = steps[-1], {r for r in engine.local_core.scheduler.requests if r[0] == "s"}
        sizes = {c.req_id: len(c.token_ids) for c in so.chunks}
        assert all(r in sizes for r in live), f"step {len(steps)}: a short request did not decode"
        assert all(n <= 8 for r, n in sizes.items() if r[0] == "l")
        assert sum(c.req_id[0] == "l" and c.start + len(c.token_ids) < 120 for c in so.chunks) <= 1
    assert len(steps) >= 240 // 8, "the long prompts were chunked"
    assert [done[r] for r in ("s0", "s2", "s4")] == reference(short, 20)
    assert [done[r] for r in ("l1", "l3")] == reference(long, 4)
    assert_no_leak(llm)


def test_adaptive_watermark_rule() -> None:
    w = Watermark(0.01, adaptive=True, num_blocks=1000)
    for expected in (0.02, 0.04, 0.04):
        w.observe(preempted=True)
        assert w.fraction == pytest.approx(expected)
    assert w.blocks == 40
    for _ in range(49):
        w.observe(preempted=False)
    assert w.fraction == pytest.approx(0.04)
    w.observe(preempted=False)
    assert w.fraction == pytest.approx(0.025), "50 calm steps halve the excess"
    w.observe(preempted=True)
    assert w.calm_steps == 0 and w.fraction == pytest.approx(0.04)
    fixed = Watermark(0.05, adaptive=False, num_blocks=1000)
    fixed.observe(preempted=True)
    assert fixed.blocks == 50
