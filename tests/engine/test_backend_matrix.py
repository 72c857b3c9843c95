"""Every attention backend the machine can run, in every scheduling scenario: float32 greedy tokens equal to
transformers' (the oracle), and half-precision runs equal to the torch reference's at the same dtype up to
near-ties. Backends: `torch` (the reference), `cpu` (the C++ kernels for this CPU's ISA), `triton` (the
Triton kernels; on a machine without CUDA they run in Triton's interpreter). The header of the test run
names the ISA and the backends (tests/conftest.py); a backend that cannot run here is skipped with the reason."""

import json
import sys

import jsonschema
import pytest
import ray
import torch

from conveyor.engine import LLM, SamplingParams
from conveyor.engine.sampling_params import StructuredParams
from conveyor.kernels import reference
from tests.helpers import assert_no_leak, hf_greedy, prompt_ids

MODEL = "demo:llama-tiny"
MAX_TOKENS = 8
PROMPT_LEN = 40  # the Triton interpreter runs a few steps a second: short prompts keep every cell small
BACKENDS = ["torch", "cpu", "triton"]
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])


def backend_unavailable(backend: str, dtype: str = "float32") -> str | None:
    """Why `backend` cannot run `dtype` on this machine, or None."""
    if backend == "cpu":
        from conveyor.kernels import cpu_ops

        if cpu_ops.load() is None:
            return "the C++ CPU kernels cannot be built for this CPU (see the run's header)"
        if dtype == "float16":
            return "the C++ CPU kernels take float32 and bfloat16"
    return None


def run(
    backend: str, prompts: list[list[int]], params: SamplingParams, dtype: str = "float32", **options: object
) -> tuple[list, LLM]:
    if (why := backend_unavailable(backend, dtype)) is not None:
        pytest.skip(why)
    llm = LLM(MODEL, dtype=dtype, attention_backend=backend, **options)
    runner = getattr(llm.engine.local_core.executor, "runner", None)  # TP > 1: the runners live in the workers
    assert llm.engine.config.attention_backend == backend
    assert runner is None or runner.model.layers[0].self_attn.attn.ops.name == backend
    return llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False), llm


def greedy(max_tokens: int = MAX_TOKENS, **kw: object) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **kw)


def tokens(outs: list) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return [p[:PROMPT_LEN] for p in prompt_ids(MODEL)]


@pytest.fixture(scope="module")
def oracle(prompts: list[list[int]]) -> list[list[int]]:
    return hf_greedy(MODEL, prompts, MAX_TOKENS)


SCENARIOS = {
    "chunked-prefill-alone": {"max_num_seqs": 1, "max_num_batched_tokens": 8},
    "chunked-prefill-with-decodes": {"max_num_batched_tokens": 12},
    "preempt-recompute": {"num_blocks": 12, "block_size": 8, "enable_prefix_caching": False},
    "preempt-swap": {
        "num_blocks": 12,
        "block_size": 8,
        "enable_prefix_caching": False,
        "preemption_mode": "swap",
        "swap_space": 2**20,
    },
}


@pytest.mark.parametrize("scenario", SCENARIOS)
@pytest.mark.parametrize("backend", BACKENDS)
def test_greedy_tokens_equal_transformers(
    backend: str, scenario: str, prompts: list[list[int]], oracle: list[list[int]]
) -> None:
    if (why := backend_unavailable(backend)) is not None:
        pytest.skip(why)
    llm = LLM(MODEL, dtype="float32", attention_backend=backend, **SCENARIOS[scenario])
    runner, swaps = llm.engine.local_core.executor.runner, []
    swap_blocks = runner.swap_blocks
    runner.swap_blocks = lambda pairs, to_cpu: (swaps.append((len(pairs), to_cpu)), swap_blocks(pairs, to_cpu))
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy(), use_tqdm=False)
    assert tokens(outs) == oracle
    if scenario.startswith("preempt"):
        assert llm.engine.stats().num_preemptions > 0
    if scenario == "preempt-swap":
        assert {to_cpu for n, to_cpu in swaps if n} == {True, False}  # blocks went out and came back
    assert_no_leak(llm)


@pytest.mark.parametrize("backend", BACKENDS)
def test_prefix_cache_hits(backend: str, prompts: list[list[int]], oracle: list[list[int]]) -> None:
    shared = [prompts[3], prompts[3][:21], prompts[3][:33] + prompts[1][:5]]
    want = hf_greedy(MODEL, shared, MAX_TOKENS)
    first, llm = run(backend, shared, greedy(), block_size=8)
    again = llm.generate([{"prompt_token_ids": p} for p in shared], greedy(), use_tqdm=False)
    assert tokens(first) == want and tokens(again) == want
    assert llm.engine.stats().prefix_cache_hits > 0
    assert all(o.metrics.num_cached_tokens > 0 for o in again)
    assert_no_leak(llm)


@pytest.mark.parametrize("backend", BACKENDS)
def test_logprobs_equal_transformers(backend: str, prompts: list[list[int]], oracle: list[list[int]]) -> None:
    from transformers import AutoModelForCausalLM

    from conveyor.engine.checkpoints.model_source import resolve_model

    outs, _ = run(backend, prompts[:3], greedy(logprobs=3), max_num_batched_tokens=16)
    hf = AutoModelForCausalLM.from_pretrained(resolve_model(MODEL), dtype=torch.float32)
    for prompt, want, out in zip(prompts, oracle, outs):
        assert out.outputs[0].token_ids == want
        with torch.no_grad():
            logits = hf(torch.tensor([prompt + want[:-1]])).logits[0, len(prompt) - 1 :]
        expected = torch.log_softmax(logits.float(), -1)
        for step, got in enumerate(out.outputs[0].logprobs):
            assert want[step] in got and len(got) >= 3
            ids = sorted(got)
            torch.testing.assert_close(torch.tensor([got[i] for i in ids]), expected[step, ids], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("backend", BACKENDS)
def test_n_greater_than_one(backend: str, prompts: list[list[int]], oracle: list[list[int]]) -> None:
    """Greedy n=2 gives the oracle twice; seeded sampling with n=3 gives the reference backend's samples."""
    outs, _ = run(backend, prompts[:2], greedy(n=2), max_num_batched_tokens=16)
    for out, want in zip(outs, oracle):
        assert [c.token_ids for c in out.outputs] == [want, want]
    sampled = SamplingParams(n=3, temperature=0.8, seed=7, max_tokens=MAX_TOKENS, ignore_eos=True)
    outs, _ = run(backend, prompts[:2], sampled, max_num_batched_tokens=16)
    ref, _ = run("torch", prompts[:2], sampled)
    got, want = ([[c.token_ids for c in o.outputs] for o in x] for x in (outs, ref))
    assert got == want
    assert all(len({tuple(t) for t in seqs}) > 1 for seqs in got)  # seeded samples differ between the n


PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 8}, "age": {"type": "integer"}},
    "required": ["name", "age"],
    "additionalProperties": False,
}


@pytest.mark.parametrize("backend", BACKENDS)
def test_structured_output(backend: str, prompts: list[list[int]]) -> None:
    """A JSON schema and a choice, greedy: valid output, and the torch reference's tokens under another budget."""
    params = [
        SamplingParams(temperature=0, max_tokens=48, structured=StructuredParams(json=PERSON)),
        SamplingParams(temperature=0, max_tokens=8, structured=StructuredParams(choice=["alpha", "beta gamma"])),
    ]
    outs, llm = run(backend, prompts[:2], params, max_num_batched_tokens=16)
    ref, _ = run("torch", prompts[:2], params)
    assert tokens(outs) == tokens(ref)
    jsonschema.validate(json.loads(outs[0].outputs[0].text, strict=False), PERSON)  # strings may hold control bytes
    assert outs[1].outputs[0].text in ("alpha", "beta gamma")
    assert_no_leak(llm)


@pytest.mark.slow
@pytest.mark.parametrize("backend", BACKENDS)
def test_tensor_parallel_2(backend: str, prompts: list[list[int]], oracle: list[list[int]]) -> None:
    if (why := backend_unavailable(backend)) is not None:
        pytest.skip(why)
    ray.init(address="local", num_cpus=4, include_dashboard=False, _node_ip_address="127.0.0.1", log_to_driver=False)
    try:
        outs, llm = run(backend, prompts, greedy(), tensor_parallel_size=2, max_num_batched_tokens=16)
        assert tokens(outs) == oracle
        assert_no_leak(llm)
        llm.engine.shutdown()
    finally:
        ray.shutdown()


def top_logprob_errors(got: list, truth: list) -> list[float]:
    """|log p(t)| error of the float32 run's greedy token t at each step where both runs took the same tokens."""
    errors = []
    for g, t in zip((o.outputs[0] for o in got), (o.outputs[0] for o in truth)):
        for step, (a, b) in enumerate(zip(g.token_ids, t.token_ids)):
            if a != b:
                break
            errors.append(abs(g.logprobs[step][b] - t.logprobs[step][b]))
    return errors


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("backend", ["cpu", "triton"])
def test_half_precision_is_as_close_to_float32_as_the_reference(
    backend: str, dtype: str, prompts: list[list[int]]
) -> None:
    """At the same dtype, a backend's greedy log-probabilities are as close to the float32 run's as the torch
    reference's (mean error within 1.5x + 0.01), over the steps where each still follows the float32 tokens."""
    params = greedy(logprobs=5)
    truth, _ = run("torch", prompts, params)
    outs, _ = run(backend, prompts, params, dtype=dtype, max_num_batched_tokens=16)
    ref, _ = run("torch", prompts, params, dtype=dtype)
    ours, theirs = top_logprob_errors(outs, truth), top_logprob_errors(ref, truth)
    mean = lambda x: sum(x) / len(x)  # noqa: E731
    print(
        f"{backend} {dtype}: mean |logprob error| {mean(ours):.4f} over {len(ours)} steps, "
        f"reference {mean(theirs):.4f} over {len(theirs)}"
    )
    assert len(ours) >= len(prompts) and mean(ours) <= 1.5 * mean(theirs) + 0.01


STEP_SHAPES = {  # (context lengths after the step, new tokens per sequence): decodes first, then prefill chunks
    "empty": ([], []),
    "one-token": ([1], [1]),
    "decodes-only": ([5, 17, 33], [1, 1, 1]),
    "partial-chunk-only": ([24], [8]),
    "chunk-over-cached-prefix-with-decodes": ([9, 40, 30], [1, 12, 30]),
}


@pytest.mark.parametrize("shape", STEP_SHAPES)
@pytest.mark.parametrize("backend", BACKENDS)
def test_attention_in_every_step_shape(backend: str, shape: str) -> None:
    """The attention layer of each backend equals the float64 reference in every step shape, the empty one too."""
    from conveyor.engine.model.attention import Attention, AttentionMetadata
    from conveyor.kernels import attention_ops, cpu_ops

    if (why := backend_unavailable(backend)) is not None:
        pytest.skip(why)
    lens, q_lens = STEP_SHAPES[shape]
    g = torch.Generator().manual_seed(len(lens))
    heads, kv_heads, d, bs, blocks = 4, 2, 64, 8, 32
    attn = Attention(heads, kv_heads, d, d**-0.5, attention_ops(backend))
    attn.k_cache, attn.v_cache = (torch.zeros(blocks, bs, kv_heads, d) for _ in "kv")
    ref_k, ref_v = (torch.randn(blocks, bs, kv_heads, d, generator=g, dtype=torch.float64) for _ in "kv")
    tables = (
        torch.stack([torch.randperm(blocks, generator=g)[:6] for _ in lens]).int()
        if lens
        else torch.zeros(0, 6, dtype=torch.int32)
    )
    cached = [n - q for n, q in zip(lens, q_lens)]
    for b, n in enumerate(cached):  # the context before the step, written through the backend's own store
        slots = (tables[b, torch.arange(n) // bs] * bs + torch.arange(n) % bs).long()
        attn.ops.store_kv_cache(
            *(
                torch.stack([c.view(-1, kv_heads, d)[s] for s in slots]).float() if n else torch.zeros(0, kv_heads, d)
                for c in (ref_k, ref_v)
            ),
            attn.k_cache,
            attn.v_cache,
            slots,
        )
    new_slots = (
        torch.cat(
            [
                (tables[b, torch.arange(c, n) // bs] * bs + torch.arange(c, n) % bs).long()
                for b, (c, n) in enumerate(zip(cached, lens))
            ]
        )
        if lens
        else torch.zeros(0, dtype=torch.long)
    )
    k, v = (c.view(-1, kv_heads, d)[new_slots].float() for c in (ref_k, ref_v))
    q = torch.randn(int(sum(q_lens)), heads, d, generator=g)
    qsl = torch.tensor([0, *torch.tensor(q_lens, dtype=torch.int64).cumsum(0).tolist()], dtype=torch.int32)
    seq_lens, nd = torch.tensor(lens, dtype=torch.int32), sum(1 for x in q_lens if x == 1)
    meta = AttentionMetadata(
        slot_mapping=new_slots,
        num_decodes=nd,
        decode_block_tables=tables[:nd],
        decode_seq_lens=seq_lens[:nd],
        decode_max_seq_len=max(lens[:nd], default=0),
        prefill_block_tables=tables[nd:],
        prefill_seq_lens=seq_lens[nd:],
        prefill_query_start_loc=qsl[nd:] - qsl[nd],
        prefill_max_query_len=max(q_lens[nd:], default=0),
        prefill_max_seq_len=max(lens[nd:], default=0),
        block_tables=tables,
        seq_lens=seq_lens,
        query_start_loc=qsl,
    )
    got = attn(q, k, v, meta)
    ref_cache = (
        (attn.k_cache, attn.v_cache) if backend != "cpu" else cpu_ops.reference_layout(attn.k_cache, attn.v_cache)
    )
    want = reference.paged_prefill_attention(
        q.double(), ref_k, ref_v, tables, seq_lens, qsl, max(q_lens, default=0), d**-0.5
    )
    assert got.shape == q.shape
    torch.testing.assert_close(got.double(), want, rtol=2e-5, atol=2e-5)
    for cache, full in zip(ref_cache, (ref_k, ref_v)):  # every context key was stored where the tables say
        for b, n in enumerate(lens):
            slots = (tables[b, torch.arange(n) // bs] * bs + torch.arange(n) % bs).long()
            torch.testing.assert_close(
                cache.reshape(-1, kv_heads, d)[slots].double(), full.view(-1, kv_heads, d)[slots], rtol=1e-6, atol=1e-6
            )
