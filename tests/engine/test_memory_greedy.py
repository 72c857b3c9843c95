"""Memory management end to end on demo:llama-tiny: prefix cache hits, swap (and its fallback to recompute) and
partial prefills keep greedy outputs equal to an engine with room for everything."""

import random
from collections import defaultdict

import pytest

from conveyor.engine import LLM, SamplingParams
from conveyor.engine.step import SchedulerOutput
from tests.engine.fake_runner import assert_pool_consistent
from tests.helpers import assert_no_leak

MODEL = "demo:llama-tiny"


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
