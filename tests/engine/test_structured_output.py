import json
import re
import threading

import jsonschema
import pytest

from conveyor.engine import LLM, SamplingParams
from conveyor.engine.sampling_params import StructuredParams
from tests.helpers import assert_no_leak

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "user", "guest"]},
    },
    "required": ["name", "age", "role"],
}
NESTED = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 1, "maximum": 9999},
        "owner": {
            "type": "object",
            "properties": {
                "active": {"type": "boolean"},
                "address": {
                    "type": "object",
                    "properties": {
                        "city": {"type": "string", "maxLength": 10},
                        "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
                    },
                    "required": ["city", "zip"],
                },
            },
            "required": ["active", "address"],
        },
    },
    "required": ["id", "owner"],
}
ARRAYS = {
    "type": "object",
    "properties": {
        "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "minItems": 1, "maxItems": 4},
        "scores": {"type": "array", "items": {"type": "integer", "minimum": -5, "maximum": 5}, "maxItems": 3},
        "note": {"type": "string", "maxLength": 6},
    },
    "required": ["tags", "scores"],
}
SCHEMAS = [PERSON, NESTED, ARRAYS]
PROMPTS = ["Describe a user as JSON:", "def parse(config):", "The quick brown fox"]


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM("demo:tiny", dtype="float32")


def json_params(schema: dict, greedy: bool, seed: int = 0, **kw: object) -> SamplingParams:
    return SamplingParams(
        temperature=0 if greedy else 1.0,
        seed=None if greedy else seed,
        max_tokens=160,
        structured=StructuredParams(json=schema),
        **kw,
    )


def free_params(max_tokens: int = 24) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)


def assert_valid(text: str, schema: dict) -> None:
    jsonschema.validate(json.loads(text), schema)


def test_json_schemas_greedy_and_sampled_batched_with_free_requests(llm: LLM) -> None:
    params = [json_params(schema, greedy, seed=i) for i, schema in enumerate(SCHEMAS) for greedy in (True, False)]
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(len(params))]
    free = PROMPTS[:2]
    free_alone = llm.generate(free, free_params(), use_tqdm=False)
    mixed = llm.generate(prompts + free, params + [free_params()] * len(free), use_tqdm=False)
    for out, p in zip(mixed, params):
        c = out.outputs[0]
        assert c.finish_reason == "stop", c.text
        assert_valid(c.text, json.loads(p.structured.text))
    assert [o.outputs[0].token_ids for o in mixed[len(params) :]] == [o.outputs[0].token_ids for o in free_alone]
    assert_no_leak(llm)
    assert not llm.engine.local_core.structured.matchers


def test_regex_choice_json_object_and_n(llm: LLM) -> None:
    regex = r"[a-z]{2,5}-[0-9]{3}"
    choices = ["yes", "no", "maybe later"]
    params = [
        SamplingParams(temperature=0.9, seed=s, max_tokens=20, structured=StructuredParams(regex=regex))
        for s in range(2)
    ]
    params += [
        SamplingParams(temperature=0.9, seed=s, max_tokens=20, structured=StructuredParams(choice=choices))
        for s in range(2)
    ]
    params.append(
        SamplingParams(temperature=1.0, seed=5, n=2, max_tokens=160, structured=StructuredParams(json=PERSON))
    )
    outs = llm.generate(["hi"] * len(params), params, use_tqdm=False)
    for o in outs[:2]:
        assert re.fullmatch(regex, o.outputs[0].text), o.outputs[0].text
    for o in outs[2:4]:
        assert o.outputs[0].text in choices
    assert len(outs[4].outputs) == 2
    for c in outs[4].outputs:
        assert_valid(c.text, PERSON)
    obj = (
        llm.generate(
            ["x"],
            SamplingParams(temperature=0, max_tokens=8, structured=StructuredParams(json_object=True)),
            use_tqdm=False,
        )[0]
        .outputs[0]
        .text
    )
    assert obj.startswith("{")
    assert_no_leak(llm)


def test_stop_string_cuts_constrained_output(llm: LLM) -> None:
    full = llm.generate(["a"], json_params(PERSON, True), use_tqdm=False)[0].outputs[0]
    cut = llm.generate(["a"], json_params(PERSON, True, stop=[","]), use_tqdm=False)[0].outputs[0]
    assert cut.text == full.text.split(",")[0] and cut.finish_reason == "stop"


def test_preempted_and_chunked_constrained_requests_give_the_same_output(llm: LLM) -> None:
    params = [json_params(NESTED, True), json_params(PERSON, False, seed=3), json_params(ARRAYS, True)]
    prompts = [p * 8 for p in PROMPTS]
    expected = [o.outputs[0].text for o in llm.generate(prompts, params, use_tqdm=False)]
    tight = LLM(
        "demo:tiny",
        dtype="float32",
        num_blocks=16,
        block_size=16,
        max_num_batched_tokens=32,
        enable_prefix_caching=False,
    )
    got = [o.outputs[0].text for o in tight.generate(prompts, params, use_tqdm=False)]
    assert tight.engine.local_core.scheduler.num_preemptions > 0
    assert got == expected
    for text, p in zip(got, params):
        assert_valid(text, json.loads(p.structured.text))
    assert_no_leak(tight)


def test_logit_bias(llm: LLM) -> None:
    base = llm.generate(["def"], free_params(6), use_tqdm=False)[0].outputs[0].token_ids
    forced = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logit_bias={77: 100.0})
    assert llm.generate(["def"], forced, use_tqdm=False)[0].outputs[0].token_ids == [77] * 6
    banned = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logit_bias={base[0]: -100.0})
    assert llm.generate(["def"], banned, use_tqdm=False)[0].outputs[0].token_ids[0] != base[0]
    with pytest.raises(ValueError, match="logit_bias"):
        llm.generate(["def"], SamplingParams(logit_bias={10**6: 1.0}), use_tqdm=False)


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"json": {"type": "nonsense"}}, "structured.json"),
        ({"json": "{not json"}, "structured.json"),
        ({"regex": "[a-"}, "structured.regex"),
        ({"grammar": "root ::= undefined_rule"}, "structured.grammar"),
        ({"choice": []}, "structured.choice"),
        ({"regex": "a", "choice": ["b"]}, "structured"),
    ],
)
def test_bad_constraints_raise_naming_the_field(kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=re.escape(f"SamplingParams.{field} ")):
        StructuredParams(**kwargs)


def test_incompatible_options_raise() -> None:
    with pytest.raises(ValueError, match="SamplingParams.ignore_eos"):
        SamplingParams(ignore_eos=True, structured={"regex": "a+"})
    with pytest.raises(ValueError, match="SamplingParams.min_tokens"):
        SamplingParams(min_tokens=2, structured={"regex": "a+"})


def test_slow_compile_does_not_stall_other_requests(llm: LLM) -> None:
    manager = llm.engine.local_core.structured
    gate, real = threading.Event(), manager._compile
    manager._compile = lambda kind, text: gate.wait(30) and real(kind, text)
    try:
        engine = llm.engine
        engine.add_request(
            "slow", [5, 6, 7], SamplingParams(temperature=0, max_tokens=8, structured={"regex": "[0-9]{4}z"})
        )
        engine.add_request("free", [5, 6, 7], free_params(8))
        done: dict[str, str] = {}
        while "free" not in done:
            done.update({o.request_id: o.outputs[0].text for o in engine.step() if o.finished})
        assert "slow" not in done and "slow" in engine.local_core.compiling
        gate.set()
        while engine.has_unfinished_requests():
            done.update({o.request_id: o.outputs[0].text for o in engine.step() if o.finished})
        assert re.fullmatch("[0-9]{4}z", done["slow"])
    finally:
        manager._compile = real
    assert_no_leak(llm)


def test_abort_while_compiling_and_while_running_releases(llm: LLM) -> None:
    engine = llm.engine
    engine.add_request("a", [5, 6], json_params(ARRAYS, True))
    assert engine.abort_request("a").finished
    engine.add_request("b", [5, 6], json_params(ARRAYS, True))
    while "b" not in engine.local_core.structured.matchers:
        engine.step()
    engine.step()
    assert engine.abort_request("b").outputs[0].finish_reason == "abort"
    assert not engine.local_core.structured.matchers and not engine.local_core.compiling
    assert_no_leak(llm)


def test_chat_applies_the_template_and_refuses_tools_it_cannot_render(llm: LLM) -> None:
    messages = [{"role": "user", "content": "Pick one"}]
    out = llm.chat(
        messages, SamplingParams(temperature=0, max_tokens=10, structured={"choice": ["red", "blue"]}), use_tqdm=False
    )[0]
    text = llm.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert out.prompt_token_ids == llm.tokenizer(text, add_special_tokens=False).input_ids
    assert out.outputs[0].text in ("red", "blue")
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    with pytest.raises(ValueError, match="^tools: "):
        llm.chat(messages, tools=[tool], use_tqdm=False)


@pytest.mark.slow
def test_real_model_json_schemas_greedy_and_sampled_with_a_free_request() -> None:
    real = LLM("demo:smollm2", dtype="float32", max_model_len=512, num_blocks=48)
    ask = [{"role": "user", "content": "Describe a person as JSON."}]
    params = [
        json_params(PERSON, True),
        json_params(PERSON, False, seed=2),
        json_params(ARRAYS, True),
        json_params(NESTED, False, seed=4),
        SamplingParams(temperature=0, max_tokens=16),
    ]
    outs = real.chat([ask] * len(params), params, use_tqdm=False)
    for out, p in zip(outs[:-1], params):
        assert out.outputs[0].finish_reason == "stop", out.outputs[0].text
        assert_valid(out.outputs[0].text, json.loads(p.structured.text))
    alone = real.chat(ask, params[-1], use_tqdm=False)[0]
    assert outs[-1].outputs[0].token_ids == alone.outputs[0].token_ids
    assert_no_leak(real)
