"""SamplingParams as a typed msgspec struct: the same object crosses router -> replica (pickled by Ray) and
front end -> core (msgpack), is validated by its own __post_init__ on every copy, and encodes no derived state."""

import pickle

import msgspec
import pydantic
import pytest

from conveyor.deployments.protocol import GenerateRequest
from conveyor.engine import SamplingParams
from conveyor.engine.core.messages import AddRequest, Codec, CoreOutput
from conveyor.engine.sampling_params import StructuredParams

RICH = [
    SamplingParams(temperature=0, max_tokens=8),
    SamplingParams(
        n=1,
        temperature=0.7,
        top_p=0.9,
        top_k=5,
        min_p=0.1,
        seed=3,
        presence_penalty=0.5,
        frequency_penalty=-0.5,
        repetition_penalty=1.2,
        max_tokens=32,
        min_tokens=2,
        stop=("END", "\n\n"),
        stop_token_ids=(7, 9),
        include_stop_str_in_output=True,
        logprobs=4,
        skip_special_tokens=False,
        logit_bias={5: 2, 11: -100.0},
    ),
    SamplingParams(max_tokens=4, stop="x", structured={"regex": "[ab]+"}),
    SamplingParams(max_tokens=4, structured=StructuredParams(json={"type": "object"})),
    SamplingParams(max_tokens=4, structured=StructuredParams(json=True)),
    SamplingParams(max_tokens=4, structured=StructuredParams(choice=["red", "blue"])),
    SamplingParams(max_tokens=4, structured=StructuredParams(json_object=True)),
]


@pytest.mark.parametrize("sp", RICH)
def test_add_request_decodes_typed_params_equal_to_the_sent_ones(sp: SamplingParams) -> None:
    codec = Codec()
    wire = codec.encode(AddRequest("r", [1, 2, 3], sp))
    got = codec.inputs.decode(wire)
    assert isinstance(got, AddRequest) and type(got.params) is SamplingParams
    assert got.params == sp
    assert got.params.stop_strings == sp.stop_strings
    assert got.params.greedy == sp.greedy and got.params.has_penalties == sp.has_penalties
    if sp.structured is not None:
        assert type(got.params.structured) is StructuredParams
        assert got.params.structured.key == sp.structured.key
    assert b"stop_strings" not in wire and b"kind" not in wire and b"text" not in wire


@pytest.mark.parametrize("sp", RICH)
def test_pickle_keeps_the_params_and_their_derived_state(sp: SamplingParams) -> None:
    got = pickle.loads(pickle.dumps(GenerateRequest(prompts=[[1]], sampling=sp))).sampling
    assert got == sp and got.stop_strings == sp.stop_strings
    assert (got.structured and got.structured.key) == (sp.structured and sp.structured.key)


def test_decoding_validates_and_names_the_field() -> None:
    sp = SamplingParams(max_tokens=4)
    sp.top_p = 2.0  # a struct's attributes are not checked on assignment; decoding checks them
    wire = Codec().encode(AddRequest("r", [1], sp))
    with pytest.raises(msgspec.ValidationError, match=r"SamplingParams\.top_p"):
        Codec().inputs.decode(wire)
    refused = Codec().decode_input(wire)  # what the core process does: it refuses that request alone
    assert isinstance(refused, CoreOutput) and refused.request_id == "r" and refused.finish_reason == "error"
    assert "SamplingParams.top_p" in refused.stop_reason
    assert isinstance(Codec().decode_input(Codec().encode(AddRequest("r", [1], SamplingParams()))), AddRequest)
    with pytest.raises(msgspec.ValidationError, match="Expected `int`"):
        msgspec.msgpack.decode(msgspec.msgpack.encode({"max_tokens": "4"}), type=SamplingParams)


def test_keyword_construction_and_field_named_errors() -> None:
    sp = SamplingParams(temperature=0, max_tokens=8)
    assert sp.greedy and sp.max_tokens == 8 and sp.n == 1 and sp.stop_token_ids == [] and sp.stop_strings == []
    with pytest.raises(TypeError):
        SamplingParams(2)  # keyword-only
    with pytest.raises(ValueError, match=r"SamplingParams\.structured\.json_object"):
        StructuredParams(json_object=1)
    with pytest.raises(ValueError, match=r"SamplingParams\.structured\.choice"):
        SamplingParams(structured={"choice": []})
    with pytest.raises(ValueError, match=r"SamplingParams\.structured "):
        SamplingParams(structured={"regex": "a", "grammar": "b"})
    with pytest.raises(ValueError, match=r"SamplingParams\.logit_bias"):
        msgspec.structs.replace(sp, logit_bias={1: 101})


def test_fan_out_copies_with_seeds_and_leaves_the_original() -> None:
    sp = SamplingParams(n=3, seed=10, stop="z", structured={"regex": "a+"})
    samples = sp.fan_out()
    assert [s.n for s in samples] == [1, 1, 1] and [s.seed for s in samples] == [10, 11, 12]
    assert all(s.stop_strings == ["z"] and s.structured == sp.structured for s in samples)
    assert sp.n == 3 and sp.seed == 10
    assert [s.seed for s in SamplingParams(n=2).fan_out()] == [None, None]
    one = SamplingParams()
    assert one.fan_out() == [one]


def test_generate_request_carries_a_sampling_params_not_a_dict() -> None:
    assert GenerateRequest(prompts=[[1]]).sampling == SamplingParams()
    with pytest.raises(pydantic.ValidationError):
        GenerateRequest(prompts=[[1]], sampling={"max_tokens": 4})
