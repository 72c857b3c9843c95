"""Multi-LoRA against transformers + peft on random adapters: greedy tokens identical in float32 for a batch mixing
several adapters and the base model, under chunked prefill and preemption; slots, LRU and per-adapter prefix keys."""

from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from conveyor.engine import LLM, SamplingParams
from conveyor.engine.checkpoints.lora import write_random_adapter
from conveyor.engine.checkpoints.model_source import resolve_model
from conveyor.engine.core.prefix_hash import block_hashes
from conveyor.engine.lora_request import LoRARequest
from tests.helpers import PROMPTS, assert_no_leak, generate_greedy, hf_greedy, prompt_ids

MAX_TOKENS = 16
# rank, targets: every projection, attention only, MLP (and o) only
ADAPTERS = [
    (8, ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")),
    (4, ("q_proj", "v_proj")),
    (16, ("o_proj", "gate_proj", "up_proj", "down_proj")),
]


def make_adapters(model: str, root: Path) -> list[LoRARequest]:
    hf = AutoConfig.from_pretrained(resolve_model(model))
    return [
        LoRARequest(f"a{i}", i + 1, str(write_random_adapter(root / f"a{i}", hf, model, rank, seed=i, targets=t)))
        for i, (rank, t) in enumerate(ADAPTERS)
    ]


def peft_greedy(model: str, adapter: str, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    from peft import PeftModel

    base = AutoModelForCausalLM.from_pretrained(resolve_model(model), dtype=torch.float32)
    return generate_greedy(PeftModel.from_pretrained(base, adapter).eval(), prompts, max_tokens)


def mixed_run(model: str, loras: list[LoRARequest], prompts: list[list[int]], **options: object):
    """Every prompt with the base model and each adapter, in one generate; records the slots of each step."""
    llm = LLM(model, dtype="float32", max_lora_rank=16, **options)
    steps: list[set[int]] = []
    lora = llm.engine.local_core.executor.runner.lora
    set_batch = lora.set_batch

    def recording(token_slots, keep):
        steps.append(set(token_slots.tolist()))
        set_batch(token_slots, keep)

    lora.set_batch = recording
    which = [None, *loras]
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    requests = [(p, w) for p in prompts for w in which]  # interleaved: adapters arrive in turn
    outs = llm.generate(
        [{"prompt_token_ids": p} for p, _ in requests], params, use_tqdm=False, lora_request=[w for _, w in requests]
    )
    got = [o.outputs[0].token_ids for o in outs]
    return [got[i :: len(which)] for i in range(len(which))], llm, steps


@pytest.mark.parametrize(
    "model,prompts,options",
    [
        ("demo:llama-tiny", PROMPTS, dict(num_blocks=40, block_size=8, max_num_batched_tokens=48)),
        pytest.param(
            "demo:smollm2",
            PROMPTS[1:4],
            dict(num_blocks=24, block_size=8, max_num_batched_tokens=40, max_model_len=256),
            marks=pytest.mark.slow,
        ),
    ],
    ids=["llama-tiny", "smollm2"],
)
def test_mixed_adapters_match_peft(tmp_path: Path, model: str, prompts: list[str], options: dict) -> None:
    loras = make_adapters(model, tmp_path)
    ids = prompt_ids(model, prompts)
    expected = [hf_greedy(model, ids, MAX_TOKENS)] + [peft_greedy(model, a.path, ids, MAX_TOKENS) for a in loras]
    for adapter_out in expected[1:]:
        assert adapter_out != expected[0]  # each adapter changes the greedy tokens
    got, llm, steps = mixed_run(model, loras, ids, max_loras=3, **options)
    assert got == expected
    stats = llm.engine.stats()
    assert stats.num_preemptions > 0
    assert any(s == {-1, 0, 1, 2} for s in steps)  # 3 adapters and the base in one step
    assert sorted(stats.lora_adapters) == ["a0", "a1", "a2"]
    assert_no_leak(llm)


def test_an_adapter_prompt_longer_than_the_budget_alone(tmp_path: Path) -> None:
    """Its first chunks sample no row (the last layer keeps none), then the adapter applies as peft's."""
    model = "demo:llama-tiny"
    lora = make_adapters(model, tmp_path)[0]
    ids = [list(range(5, 125))]
    llm = LLM(model, dtype="float32", max_lora_rank=16, max_loras=1, max_num_batched_tokens=32)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    out = llm.generate([{"prompt_token_ids": ids[0]}], params, use_tqdm=False, lora_request=lora)[0].outputs[0]
    assert out.finish_reason == "length"
    assert [out.token_ids] == peft_greedy(model, lora.path, ids, MAX_TOKENS)
    assert_no_leak(llm)


def test_fewer_slots_than_adapters_rotates_by_lru(tmp_path: Path) -> None:
    model = "demo:llama-tiny"
    loras = make_adapters(model, tmp_path)
    ids = prompt_ids(model)
    expected = [hf_greedy(model, ids, MAX_TOKENS)] + [peft_greedy(model, a.path, ids, MAX_TOKENS) for a in loras]
    got, llm, steps = mixed_run(model, loras, ids, max_loras=2, max_num_seqs=4)
    assert got == expected
    assert all(len(s - {-1}) <= 2 for s in steps)
    stats = llm.engine.stats()
    assert stats.num_lora_loads > 3 and len(stats.lora_adapters) == 2
    assert_no_leak(llm)


def test_two_adapters_never_share_kv() -> None:
    ids = list(range(64))
    base = block_hashes(ids, 16)
    a = block_hashes(ids, 16, lora=LoRARequest("a", 1, "/x/a").cache_key)
    b = block_hashes(ids, 16, lora=LoRARequest("b", 2, "/x/b").cache_key)
    assert len({*base, *a, *b}) == 12
    assert block_hashes(ids, 16, salt="s", lora="k") != block_hashes(ids, 16, salt="s\x00", lora="")


def test_bad_adapters_are_refused_by_field(tmp_path: Path) -> None:
    model = "demo:llama-tiny"
    hf = AutoConfig.from_pretrained(resolve_model(model))
    llm = LLM(model, dtype="float32", max_loras=1, max_lora_rank=8)
    big = write_random_adapter(tmp_path / "big", hf, model, rank=16, seed=0)
    with pytest.raises(ValueError, match="r .16. exceeds max_lora_rank .8."):
        llm.generate("hi", lora_request=LoRARequest("big", 1, str(big)), use_tqdm=False)
    other = AutoConfig.from_pretrained(resolve_model("demo:small"))
    wrong = write_random_adapter(tmp_path / "wrong", other, "demo:small", rank=4, seed=0)
    with pytest.raises(ValueError, match="weights"):
        llm.generate("hi", lora_request=LoRARequest("wrong", 2, str(wrong)), use_tqdm=False)
    with pytest.raises(ValueError, match="not a PEFT adapter"):
        llm.generate("hi", lora_request=LoRARequest("none", 3, str(tmp_path)), use_tqdm=False)
    assert not llm.engine.loras and not llm.engine.has_unfinished_requests()
    off = LLM(model, dtype="float32")
    with pytest.raises(ValueError, match="max_loras is 0"):
        off.generate("hi", lora_request=LoRARequest("big", 1, str(big)), use_tqdm=False)


@pytest.mark.slow
@pytest.mark.parametrize("model", ["demo:llama-tiny", "demo:qwen2-tiny"])
def test_tp2_shards_adapters_like_the_base_layers(tmp_path: Path, model: str) -> None:
    """Column-parallel projections split B by output rows, row-parallel ones A by input columns (their partial
    sums meet in the base layer's all-reduce): TP=2 gives TP=1's greedy tokens, which match peft above."""
    import ray

    loras = make_adapters(model, tmp_path)
    ids = prompt_ids(model)
    want, _, _ = mixed_run(model, loras, ids, max_loras=3)
    ray.init(address="local", num_cpus=4, include_dashboard=False, _node_ip_address="127.0.0.1", log_to_driver=False)
    try:
        llm = LLM(model, dtype="float32", max_lora_rank=16, max_loras=3, tensor_parallel_size=2)
        params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
        which = [None, *loras]
        requests = [(p, w) for p in ids for w in which]
        outs = llm.generate(
            [{"prompt_token_ids": p} for p, _ in requests],
            params,
            use_tqdm=False,
            lora_request=[w for _, w in requests],
        )
        got = [o.outputs[0].token_ids for o in outs]
        assert [got[i :: len(which)] for i in range(len(which))] == want
        assert_no_leak(llm)
        llm.engine.shutdown()
    finally:
        ray.shutdown()
