"""Prefill/decode disaggregation at the engine level: one engine prefills (prefill_only), another imports the
KVHandoff and decodes. Greedy tokens equal transformers' and one colocated engine's (float32); blocks all come
back on both sides."""

import msgspec
import pytest

from conveyor.engine import LLM, SamplingParams
from conveyor.engine.core.invariants import check_invariants
from conveyor.engine.core.kv_handoff import HANDOFF, KVHandoff
from conveyor.engine.frontend.llm_engine import LLMEngine
from conveyor.engine.frontend.outputs import RequestOutput
from tests.helpers import assert_no_leak, engine_greedy, hf_greedy, prompt_ids

MAX_TOKENS = 20
MODEL = "demo:llama-tiny"


def run_all(engine: LLMEngine) -> dict[str, RequestOutput]:
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step(timeout_s=1.0):
            if out.finished:
                done[out.request_id] = out
    return done


def disaggregated(
    prefill: LLM, decode: LLM, prompts: list[list[int]], params: SamplingParams, wire: bool = False
) -> tuple[list[list[int]], list[KVHandoff]]:
    """Every prompt prefilled on `prefill`, then continued on `decode`; wire: the handoffs go through msgpack."""
    for i, ids in enumerate(prompts):
        prefill.engine.add_request(f"p{i}", ids, params, prefill_only=True)
    firsts = run_all(prefill.engine)
    handoffs = []
    for i in range(len(prompts)):
        out = firsts[f"p{i}"]
        assert out.outputs[0].finish_reason == HANDOFF and len(out.outputs[0].token_ids) == 1
        h = out.kv_handoff
        assert h.output_token_ids == out.outputs[0].token_ids and h.num_computed == len(prompts[i])
        if wire:
            h = msgspec.msgpack.decode(msgspec.msgpack.encode(h), type=KVHandoff)
        handoffs.append(h)
        decode.engine.import_request(f"d{i}", h)
    outs = run_all(decode.engine)
    return [outs[f"d{i}"].outputs[0].token_ids for i in range(len(prompts))], handoffs


@pytest.fixture(scope="module")
def oracle() -> tuple[list[list[int]], list[list[int]]]:
    prompts = prompt_ids(MODEL)
    return prompts, hf_greedy(MODEL, prompts, MAX_TOKENS)


def engine(core_process: bool = False, **options: object) -> LLM:
    return LLM(MODEL, dtype="float32", check_invariants=True, engine_core_process=core_process, **options)


@pytest.mark.parametrize(
    "prefill_options",
    [{}, {"max_num_batched_tokens": 16}, {"enable_prefix_caching": False}],
    ids=["whole-prompt", "chunked-prefill", "no-prefix-cache"],
)
def test_handoff_matches_transformers_and_colocated(oracle, prefill_options: dict) -> None:
    prompts, expected = oracle
    assert max(map(len, prompts)) > 16  # the chunked case splits a prompt over several steps
    colocated, llm = engine_greedy(MODEL, prompts, MAX_TOKENS)
    assert colocated == expected
    prefill, decode = engine(**prefill_options), engine(block_size=16)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    got, handoffs = disaggregated(prefill, decode, prompts, params)
    assert got == expected
    for h, ids in zip(handoffs, prompts):
        assert h.num_bytes == h.kv_tensor().numel() * 4 and h.shape[2] == -(-len(ids) // 16)
    for side in (prefill, decode, llm):
        assert_no_leak(side)
        check_invariants(side.engine.local_core.scheduler)


def test_handoff_over_the_wire_and_core_processes(oracle) -> None:
    """Both engines' cores in their own processes: the handoff crosses ZeroMQ twice and msgpack once more."""
    prompts, expected = oracle
    prefill, decode = engine(core_process=True), engine(core_process=True)
    try:
        params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
        got, _ = disaggregated(prefill, decode, prompts, params, wire=True)
        assert got == expected
        for side in (prefill, decode):
            stats = side.engine.stats()
            assert stats.kv_blocks_free == stats.kv_blocks_total and stats.num_running == 0
    finally:
        prefill.shutdown()
        decode.shutdown()


def test_seeded_sampling_continues_its_generator(oracle) -> None:
    prompts, _ = oracle
    params = SamplingParams(temperature=1.0, top_k=50, seed=7, max_tokens=MAX_TOKENS, ignore_eos=True)
    colocated = engine().generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    got, _ = disaggregated(engine(), engine(), prompts, params)
    assert got == [o.outputs[0].token_ids for o in colocated]


def test_first_token_that_finishes_needs_no_handoff(oracle) -> None:
    prompts, expected = oracle
    prefill = engine()
    prefill.engine.add_request("p", prompts[0], SamplingParams(temperature=0, max_tokens=1), prefill_only=True)
    out = run_all(prefill.engine)["p"]
    assert out.outputs[0].finish_reason == "length" and out.kv_handoff is None
    assert out.outputs[0].token_ids == expected[0][:1]
    assert_no_leak(prefill)


def test_import_that_could_never_fit_is_refused_and_changes_nothing(oracle) -> None:
    prompts, _ = oracle
    prefill = engine()
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    prefill.engine.add_request("p", prompts[3], params, prefill_only=True)
    h = run_all(prefill.engine)["p"].kv_handoff
    assert h.shape[2] == 7 and prefill.engine.local_core.config.attention_backend == "cpu"
    for decode, field in (
        (engine(block_size=8), "shape"),
        (engine(num_blocks=6, max_model_len=256), "the cache holds 6"),
        (engine(attention_backend="torch"), "kv_layout: 'head_major' blocks"),  # blocks this backend cannot read
    ):
        with pytest.raises(ValueError, match=field):
            decode.engine.import_request("d", h)
        assert "d" not in decode.engine.processor.requests
        run_all(decode.engine)
        assert_no_leak(decode)


@pytest.mark.parametrize("core_process", [False, True], ids=["in-process", "core-process"])
def test_import_waits_for_free_blocks_in_order_and_an_abort_ends_it_there(oracle, core_process: bool) -> None:
    """A decode engine whose free blocks are taken holds handoffs (FIFO) until they fit, rather than failing
    them: each then decodes to transformers' tokens; one aborted while it waits ends at once, with nothing held."""
    prompts, expected = oracle
    prefill = engine()
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    for i in (1, 2, 3):
        prefill.engine.add_request(f"p{i}", prompts[i], params, prefill_only=True)
    firsts = run_all(prefill.engine)
    decode = engine(core_process, num_blocks=10)
    long = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
    decode.engine.add_request("busy", prompts[3][:60], long)
    decode.engine.step()  # "busy" holds 4 of the 10 blocks, then up to 8: no handoff below fits beside it
    for i in (3, 1, 2):
        decode.engine.import_request(f"d{i}", firsts[f"p{i}"].kv_handoff)
    for _ in range(10):  # a core process's stats come with its next steps
        decode.engine.step(timeout_s=1.0)
        if decode.engine.stats().num_waiting == 3:
            break
    assert decode.engine.stats().num_waiting == 3
    held = sum(firsts[f"p{i}"].kv_handoff.num_computed for i in (1, 2, 3))
    assert decode.engine.stats().num_waiting_tokens == held  # their KV counts in the replica's demand
    assert decode.engine.abort_request("d1").outputs[0].finish_reason == "abort"
    outs = run_all(decode.engine)
    assert [outs[f"d{i}"].outputs[0].token_ids for i in (3, 2)] == [expected[3], expected[2]]
    assert outs["busy"].outputs[0].finish_reason == "length"
    if core_process:
        decode.engine.step(timeout_s=1.0)  # the stats after the last step
        s = decode.engine.stats()
        assert (s.num_running, s.num_waiting, s.kv_blocks_free) == (0, 0, s.kv_blocks_total)
    else:
        assert_no_leak(decode)


@pytest.mark.slow
def test_handoff_on_smollm2() -> None:
    model = "demo:smollm2"
    prompts = prompt_ids(model)[1:4]
    expected = hf_greedy(model, prompts, 12)
    options = {"dtype": "float32", "max_model_len": 512, "num_blocks": 64, "check_invariants": True}
    prefill, decode = LLM(model, max_num_batched_tokens=32, **options), LLM(model, **options)
    got, _ = disaggregated(prefill, decode, prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    assert got == expected
    assert_no_leak(prefill)
    assert_no_leak(decode)
