"""A LoRA request handed off between a prefill and a decode engine: the handoff names its adapter, the decode engine
runs it with that adapter (loaded into one of its own slots) and keys the imported blocks with the adapter's prefix
keys. Greedy tokens and prefix keys equal one colocated engine's (float32, several adapters and the base model in one
decode batch); an adapter the decode engine cannot load refuses the import with nothing held."""

from pathlib import Path

import msgspec
import pytest
from transformers import AutoConfig

from conveyor.engine import LLM, SamplingParams
from conveyor.engine.checkpoints.lora import write_random_adapter
from conveyor.engine.checkpoints.model_source import resolve_model
from conveyor.engine.core.invariants import check_invariants
from conveyor.engine.core.kv_handoff import HANDOFF, KVHandoff
from conveyor.engine.frontend.llm_engine import LLMEngine
from conveyor.engine.frontend.outputs import RequestOutput
from conveyor.engine.lora_request import LoRARequest
from tests.helpers import assert_no_leak, prompt_ids

MODEL = "demo:llama-tiny"
MAX_TOKENS = 16
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module")
def adapters(tmp_path_factory: pytest.TempPathFactory) -> list[LoRARequest]:
    hf, root = AutoConfig.from_pretrained(resolve_model(MODEL)), tmp_path_factory.mktemp("adapters")
    return [
        LoRARequest(name, i + 1, str(write_random_adapter(root / name, hf, MODEL, rank=8, seed=i)))
        for i, name in enumerate(("a", "b"))
    ]


def engine(core_process: bool = False, **options: object) -> LLM:
    options = {"max_loras": 2, "max_lora_rank": 8, **options}
    return LLM(MODEL, dtype="float32", check_invariants=True, engine_core_process=core_process, **options)


def run_all(engine: LLMEngine) -> dict[str, RequestOutput]:
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step(timeout_s=1.0):
            if out.finished:
                done[out.request_id] = out
    return done


def prefill(llm: LLM, jobs: list[tuple[list[int], LoRARequest | None]]) -> list[KVHandoff]:
    """Each job prefilled (prefill_only) with its adapter; the handoffs as they cross a wire (msgpack)."""
    for i, (ids, lora) in enumerate(jobs):
        llm.engine.add_request(f"p{i}", ids, GREEDY, prefill_only=True, lora_request=lora)
    firsts = run_all(llm.engine)
    handoffs = []
    for i, (_, lora) in enumerate(jobs):
        out = firsts[f"p{i}"]
        assert out.outputs[0].finish_reason == HANDOFF and out.kv_handoff.lora == lora
        handoffs.append(msgspec.msgpack.decode(msgspec.msgpack.encode(out.kv_handoff), type=KVHandoff))
    assert_no_leak(llm)
    return handoffs


def jobs_of(adapters: list[LoRARequest]) -> list[tuple[list[int], LoRARequest | None]]:
    ids = prompt_ids(MODEL)
    return [(ids[3], None), (ids[3], adapters[0]), (ids[2], adapters[1]), (ids[4], adapters[0]), (ids[2], None)]


@pytest.mark.parametrize("core_process", [False, True], ids=["in-process", "core-process"])
def test_lora_handoff_matches_colocated_tokens_and_prefix_keys(adapters, core_process: bool) -> None:
    """Two adapters and the base model decode in one batch on the decode engine, which registered neither adapter
    before (its slots load them from the handoffs' paths)."""
    jobs = jobs_of(adapters)
    colocated = engine()
    outs = colocated.generate(
        [{"prompt_token_ids": ids} for ids, _ in jobs], GREEDY, use_tqdm=False, lora_request=[lora for _, lora in jobs]
    )
    expected = [o.outputs[0].token_ids for o in outs]
    assert expected[0] != expected[1] != expected[4]  # the adapters change the tokens

    handoffs = prefill(engine(max_num_batched_tokens=32), jobs)
    decode = engine(core_process)
    try:
        for i, h in enumerate(handoffs):
            decode.engine.import_request(f"d{i}", h)
        done = run_all(decode.engine)
        assert [done[f"d{i}"].outputs[0].token_ids for i in range(len(jobs))] == expected
        assert {lo.name for lo in decode.engine.loras.values()} == {"a", "b"}
        if core_process:
            decode.engine.step(timeout_s=1.0)
            s = decode.engine.stats()
            assert s.kv_blocks_free == s.kv_blocks_total and sorted(s.lora_adapters) == ["a", "b"]
            return
        core = decode.engine.local_core
        assert core.stats().num_lora_loads == 2
        # every block the colocated engine cached, under the same keys (each adapter's its own): same KV reuse
        assert set(core.block_manager.pool.cached) == set(colocated.engine.local_core.block_manager.pool.cached)
        check_invariants(core.scheduler)
        assert_no_leak(decode)
        # the adapter's prefix is reusable here; another adapter's request on the same prompt reuses nothing
        ids = jobs[1][0]
        decode.engine.add_request("again", ids, GREEDY, lora_request=adapters[0])
        decode.engine.add_request("other", ids, GREEDY, lora_request=adapters[1])
        again = run_all(decode.engine)
        assert again["again"].metrics.num_cached_tokens > 0 == again["other"].metrics.num_cached_tokens
        assert again["again"].outputs[0].token_ids == expected[1]
        assert_no_leak(decode)
    finally:
        decode.shutdown()


def test_a_handoff_waits_for_an_adapter_slot(adapters) -> None:
    """With every slot held by running requests' adapters, an import waits (in order, as for blocks) until one
    frees, then runs with its own adapter: never the base model, never another adapter's slot."""
    jobs = [jobs_of(adapters)[2]]  # adapter b
    expected = (
        engine(max_loras=1)
        .generate([{"prompt_token_ids": jobs[0][0]}], GREEDY, use_tqdm=False, lora_request=adapters[1])[0]
        .outputs[0]
        .token_ids
    )
    (h,) = prefill(engine(), jobs)
    decode = engine(max_loras=1)
    decode.engine.add_request("busy", jobs[0][0], GREEDY, lora_request=adapters[0])
    decode.engine.step()
    decode.engine.import_request("d", h)
    decode.engine.step()
    core = decode.engine.local_core
    assert len(core.importing) == 1 and core.stats().lora_adapters == ["a"]
    done = run_all(decode.engine)
    assert done["d"].outputs[0].token_ids == expected and done["busy"].outputs[0].finish_reason == "length"
    assert core.stats().lora_adapters == ["b"]
    check_invariants(core.scheduler)
    assert_no_leak(decode)


def test_an_adapter_the_decode_engine_cannot_load_refuses_the_import(adapters, tmp_path: Path) -> None:
    (h,) = prefill(engine(), [jobs_of(adapters)[1]])
    cases = [
        (engine(), LoRARequest("a", 1, str(tmp_path / "gone")), "not a PEFT adapter directory"),
        (engine(max_loras=0), adapters[0], "LoRA is off"),
        (engine(max_lora_rank=4), adapters[0], "max_lora_rank"),
    ]
    for decode, lora, why in cases:
        with pytest.raises(ValueError, match=why):
            decode.engine.import_request("d", msgspec.structs.replace(h, lora=lora))
        assert "d" not in decode.engine.processor.requests and not decode.engine.local_core.importing
        run_all(decode.engine)
        check_invariants(decode.engine.local_core.scheduler)
        assert_no_leak(decode)
    # a name this engine serves from another path: refused, not run with the adapter it has under that name
    decode = engine()
    decode.engine.add_lora(LoRARequest("a", 5, adapters[1].path))
    with pytest.raises(ValueError, match="already loaded"):
        decode.engine.import_request("d", h)
    assert_no_leak(decode)


def test_a_handoff_from_before_the_adapter_and_layout_fields_decodes_and_is_refused(adapters) -> None:
    """The adapter and the KV layout are the handoff's last fields, with defaults: an encoding without them (an
    engine from before them) decodes to the same base-model handoff with no layout, which an import refuses by
    name (its blocks' layout is unknown), changing nothing."""
    base, lora = prefill(engine(), jobs_of(adapters)[:2])
    assert base.lora is None and lora.lora == adapters[0] and base.kv_layout
    fields = msgspec.msgpack.decode(msgspec.msgpack.encode(base))
    assert len(fields) == len(KVHandoff.__struct_fields__) and fields[-2] is None
    old = msgspec.msgpack.decode(msgspec.msgpack.encode(fields[:-2]), type=KVHandoff)
    assert old == msgspec.structs.replace(base, kv_layout="")
    decode = engine()
    with pytest.raises(ValueError, match="KVHandoff.kv_layout"):
        decode.engine.import_request("d", old)
    assert_no_leak(decode)


def test_imported_lora_requests_preempted_and_recomputed_keep_their_adapters(adapters) -> None:
    """A decode pool too small for every import's growth: imported requests are preempted and recomputed there,
    with their own adapters (recompute prefills under the adapter's prefix keys), to the colocated tokens."""
    jobs = jobs_of(adapters)
    outs = engine().generate(
        [{"prompt_token_ids": ids} for ids, _ in jobs], GREEDY, use_tqdm=False, lora_request=[lora for _, lora in jobs]
    )
    handoffs = prefill(engine(), jobs)
    decode = engine(num_blocks=10)
    for i, h in enumerate(handoffs):
        decode.engine.import_request(f"d{i}", h)
    done = run_all(decode.engine)
    assert [done[f"d{i}"].outputs[0].token_ids for i in range(len(jobs))] == [o.outputs[0].token_ids for o in outs]
    assert decode.engine.stats().num_preemptions > 0
    check_invariants(decode.engine.local_core.scheduler)
    assert_no_leak(decode)
