"""Tensor parallelism over gloo with real Ray workers: TP=2 (and TP=4, KV heads replicated) gives the same greedy
tokens and logits as TP=1 under chunking and preemption; bad configs are refused; dead workers fail fast."""

import random
import sys
import threading
import time

import pytest
import ray
import torch

from conveyor.engine import LLM, SamplingParams
from conveyor.engine.execution.model_runner import ModelRunner
from conveyor.engine.step import NewRequestData, ScheduledChunk
from tests.engine.test_kv_handoff import disaggregated
from tests.helpers import assert_no_leak, engine_greedy, prompt_ids

pytestmark = pytest.mark.slow
MAX_TOKENS = 12
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])


@pytest.fixture(scope="module", autouse=True)
def ray_session():
    ray.init(address="local", num_cpus=4, include_dashboard=False, _node_ip_address="127.0.0.1", log_to_driver=False)
    yield
    ray.shutdown()


def sequence_logits(runner: ModelRunner, ids: list[int]) -> torch.Tensor | None:
    """Logits at every position of one sequence, written into the first KV blocks (call between requests)."""
    blocks = list(range(-(-len(ids) // runner.block_size)))
    runner._add_request(NewRequestData("probe", ids, SamplingParams(), []))
    runner.batch.set_blocks("probe", blocks, append=False)
    with torch.inference_mode():
        input_ids, positions, meta, *_ = runner._prepare([ScheduledChunk("probe", ids, 0, blocks, True, True)])
        logits = runner.model.compute_logits(runner.model(input_ids, positions, meta))
    runner.requests.pop("probe")
    runner.batch.remove("probe")
    return logits


def generate(llm: LLM, prompts: list[list[int]]) -> tuple[list[list[int]], list[list[dict[int, float]]]]:
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=5)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs], [o.outputs[0].logprobs for o in outs]


def assert_logprobs_close(got: list[list[dict[int, float]]], want: list[list[dict[int, float]]]) -> None:
    for g_seq, w_seq in zip(got, want):
        for g, w in zip(g_seq, w_seq):
            keys = sorted(w)
            assert sorted(g) == keys
            torch.testing.assert_close(
                torch.tensor([g[k] for k in keys]), torch.tensor([w[k] for k in keys]), rtol=1e-4, atol=1e-4
            )


@pytest.mark.parametrize(
    "model,tp", [("demo:llama-tiny", 2), ("demo:qwen2-tiny", 2), ("demo:qwen3-tiny", 2), ("demo:llama-tiny-tied", 4)]
)
def test_tp_matches_tp1(model: str, tp: int) -> None:
    prompts = prompt_ids(model)
    ref = LLM(model, dtype="float32")
    want, want_lp = generate(ref, prompts)
    llm = LLM(model, dtype="float32", tensor_parallel_size=tp)
    try:
        got, got_lp = generate(llm, prompts)
        assert got == want
        assert_logprobs_close(got_lp, want_lp)
        seq = prompts[2] + want[2][:-1]
        logits = llm.engine.local_core.executor.collective_rpc(sequence_logits, seq)
        assert all(x is None for x in logits[1:])
        # Each rank times plain against oneDNN-packed GEMMs for its own shard's shape, so the ranks and the
        # tp=1 run may sum in different orders: up to 2.2e-4 apart on these logits (1.3e-6 per GEMM).
        torch.testing.assert_close(
            logits[0], sequence_logits(ref.engine.local_core.executor.runner, seq), rtol=1e-4, atol=5e-4
        )
        assert_no_leak(llm)
    finally:
        llm.engine.shutdown()


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_tp2_chunked_and_preempted(mode: str) -> None:
    model = "demo:qwen3-tiny"
    prompts = prompt_ids(model)
    want, _ = engine_greedy(model, prompts, 2 * MAX_TOKENS)
    got, llm = engine_greedy(
        model,
        prompts,
        2 * MAX_TOKENS,
        tensor_parallel_size=2,
        max_num_batched_tokens=7,
        num_blocks=20,
        block_size=8,
        preemption_mode=mode,
        swap_space=2**20,
        enable_prefix_caching=False,
    )
    try:
        assert llm.engine.stats().num_preemptions > 0
        assert got == want
        assert_no_leak(llm)
    finally:
        llm.engine.shutdown()


def computed_block_rows(runner: ModelRunner, blocks: dict[str, int]) -> dict[str, list[int]]:
    """Each request's block ids of its first `blocks[req_id]` blocks, as this rank's block table holds them."""
    return {rid: runner.batch.block_table[runner.batch.rows[rid], :n].tolist() for rid, n in blocks.items()}


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_tp2_ngram_speculation_matches_plain_tp1(mode: str) -> None:
    """Rank 0 verifies the drafts; rank 1 never learns how many were accepted, yet must store every computed token's
    KV in the block rank 0 does. Random weights: an output token drafts when it occurs in the prompt (each prompt
    holds 1500 distinct tokens of 8192) and nearly every draft is rejected, so drafting steps roll back. After every
    step both ranks map each request's computed tokens to the same blocks, and greedy tokens equal plain TP=1
    decoding under preemption."""
    model = "demo:qwen3-tiny"
    prompts = [[1, *random.Random(i).sample(range(4, 8192), 1500)] for i in range(3)]
    want, _ = engine_greedy(model, prompts, 2 * MAX_TOKENS)
    llm = LLM(
        model,
        dtype="float32",
        tensor_parallel_size=2,
        speculative={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1},
        max_model_len=2048,
        num_blocks=300,
        block_size=8,
        preemption_mode=mode,
        swap_space=2**22,
        enable_prefix_caching=False,
    )
    try:
        params = SamplingParams(temperature=0, max_tokens=2 * MAX_TOKENS, ignore_eos=True)
        for i, p in enumerate(prompts):
            llm.engine.add_request(str(i), p, params)
        core, got = llm.engine.local_core, {}
        while llm.engine.has_unfinished_requests():
            for out in llm.engine.step():
                if out.finished:
                    got[int(out.request_id)] = out.outputs[0].token_ids
            blocks = {s.request_id: -(-s.num_computed_tokens // 8) for s in core.scheduler.running}
            rank0, rank1 = core.executor.collective_rpc(computed_block_rows, blocks)
            assert rank1 == rank0
        s = llm.engine.stats()
        assert s.num_preemptions > 0
        assert s.spec_decode_num_draft_tokens > s.spec_decode_num_accepted_tokens
        assert [got[i] for i in range(len(prompts))] == want
        assert_no_leak(llm)
    finally:
        llm.engine.shutdown()


@pytest.mark.parametrize(
    "model,prefill_tp,decode_tp,backend",
    [
        ("demo:llama-tiny", 2, 1, "cpu"),
        ("demo:llama-tiny", 1, 2, "torch"),
        ("demo:llama-tiny-tied", 4, 1, "cpu"),  # four ranks, two KV heads: each held twice
        ("demo:llama-tiny-tied", 1, 4, "torch"),
    ],
)
def test_kv_handoff_between_tensor_parallel_sizes(model: str, prefill_tp: int, decode_tp: int, backend: str) -> None:
    """A handoff carries every KV head: gathered from the prefill engine's ranks (each head once where ranks
    replicate it) and split over the decode engine's, in the attention backend's block layout; greedy tokens equal
    one colocated TP=1 engine's."""
    prompts = prompt_ids(model)
    want, _ = engine_greedy(model, prompts, MAX_TOKENS, attention_backend=backend)
    options = dict(dtype="float32", attention_backend=backend, check_invariants=True)
    prefill = LLM(model, tensor_parallel_size=prefill_tp, **options)
    decode = LLM(model, tensor_parallel_size=decode_tp, **options)
    try:
        params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
        got, handoffs = disaggregated(prefill, decode, prompts, params, wire=True)
        assert got == want
        assert all(h.kv_layout == ("head_major" if backend == "cpu" else "token_major") for h in handoffs)
        assert_no_leak(prefill)
        assert_no_leak(decode)
    finally:
        prefill.engine.shutdown()
        decode.engine.shutdown()


def test_two_engines_on_one_node() -> None:
    prompts = prompt_ids("demo:llama-tiny")[:2]
    a, b = (LLM("demo:llama-tiny", dtype="float32", tensor_parallel_size=2) for _ in range(2))
    try:
        assert generate(a, prompts)[0] == generate(b, prompts)[0]
    finally:
        a.engine.shutdown()
        b.engine.shutdown()


@ray.remote
class Replica:
    """Stands in for a Serve replica: lives in bundle 0 of its own group and builds the engine there."""

    def __init__(self) -> None:
        self.llm = LLM("demo:llama-tiny", dtype="float32", tensor_parallel_size=2)

    def generate(self, prompts: list[list[int]]) -> tuple[list[list[int]], bool]:
        return generate(self.llm, prompts)[0], self.llm.engine.local_core.executor.own_pg

    def shutdown(self) -> None:
        self.llm.engine.shutdown()


def test_workers_join_the_callers_placement_group() -> None:
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    pg = placement_group([{"CPU": 1}, {"CPU": 1}], strategy="STRICT_PACK")
    ray.get(pg.ready(), timeout=60)
    strategy = PlacementGroupSchedulingStrategy(pg, 0, placement_group_capture_child_tasks=True)
    replica = Replica.options(num_cpus=1, scheduling_strategy=strategy).remote()
    prompts = prompt_ids("demo:llama-tiny")[:2]
    try:
        got, own_pg = ray.get(replica.generate.remote(prompts), timeout=120)
        assert not own_pg
        assert got == generate(LLM("demo:llama-tiny", dtype="float32"), prompts)[0]
        ray.get(replica.shutdown.remote(), timeout=30)
    finally:
        ray.kill(replica)
        remove_placement_group(pg)


def test_unshardable_config_is_refused_before_any_worker_starts() -> None:
    groups = len(ray.util.placement_group_table())
    with pytest.raises(ValueError, match=r"num_attention_heads \(4\) is not divisible by tensor_parallel_size \(3\)"):
        LLM("demo:tiny", tensor_parallel_size=3)
    with pytest.raises(ValueError, match=r"num_attention_heads \(12\) .* tensor_parallel_size \(8\)"):
        LLM("demo:small", tensor_parallel_size=8)
    assert len(ray.util.placement_group_table()) == groups


def test_worker_killed_mid_stream_fails_fast() -> None:
    llm = LLM("demo:llama-tiny", dtype="float32", tensor_parallel_size=2)
    engine, workers = llm.engine, llm.engine.local_core.executor.workers
    engine.add_request("a", prompt_ids("demo:llama-tiny")[3], SamplingParams(max_tokens=4000, ignore_eos=True))
    engine.step()
    threading.Timer(0.5, ray.kill, (workers[1],)).start()
    start = time.monotonic()
    try:
        with pytest.raises(RuntimeError, match="rank 1 died"):
            while time.monotonic() - start < 60:
                engine.step()
        assert time.monotonic() - start < 10
        with pytest.raises(RuntimeError, match="rank 1"):
            engine.check_health()
    finally:
        engine.shutdown()


def test_idle_worker_death_is_reported_by_health_check() -> None:
    llm = LLM("demo:llama-tiny", dtype="float32", tensor_parallel_size=2)
    engine = llm.engine
    try:
        engine.check_health()
        ray.kill(engine.local_core.executor.workers[0])
        start = time.monotonic()
        with pytest.raises(RuntimeError, match="rank 0 died or is unresponsive"):
            while time.monotonic() - start < 30:
                engine.check_health()
                time.sleep(0.2)
        assert time.monotonic() - start < 10
        with pytest.raises(RuntimeError, match="rank 0"):
            llm.generate("def", use_tqdm=False)
    finally:
        engine.shutdown()


def test_tp2_kv_tier_loads_each_ranks_shard_back() -> None:
    """Each rank keeps its shard of the host tier: a prefix evicted from the pool and loaded back at TP=2
    gives the tokens of TP=1 without a tier."""
    model = "demo:qwen3-tiny"
    base = [[(7 * c + i) % 200 + 10 for i in range(40)] for c in range(3)]
    prompts = base + [p + [11, 12, 13] for p in base]
    options = dict(num_blocks=10, block_size=8, enable_prefix_caching=True)
    want = [engine_greedy(model, [p], MAX_TOKENS, **options)[0][0] for p in prompts]
    llm = LLM(model, dtype="float32", tensor_parallel_size=2, kv_offload={"host_gib": 0.001}, **options)
    try:
        params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
        got = [llm.generate([{"prompt_token_ids": p}], params, use_tqdm=False)[0].outputs[0].token_ids for p in prompts]
        assert got == want
        assert llm.engine.stats().kv_tier_hits["host"] > 0
        assert_no_leak(llm)
    finally:
        llm.engine.shutdown()
