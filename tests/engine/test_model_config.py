"""What real checkpoints' configs bring: generation_config.json defaults, sliding windows, max_model_len from the KV
cache; on generated checkpoints, checked against transformers where the maths is involved."""

import logging
from pathlib import Path

import pytest

from conveyor.deployments.request_models import ChatCompletionRequest, CompletionRequest
from conveyor.engine import LLM, SamplingParams
from conveyor.engine.checkpoints.demo import make_model
from conveyor.engine.frontend.generation_defaults import SAMPLING_KEYS, load_generation_defaults
from tests.helpers import hf_greedy

PROMPTS = [[1, 400, 401, 402, 403], [1, 17, 230, 999, 5, 6, 7, 8, 9]]


def test_generation_config_defaults_offline(tmp_path: Path) -> None:
    sampling = dict(top_k=1, repetition_penalty=1.3, temperature=0.7)
    plain = LLM(str(make_model(tmp_path / "plain")), dtype="float32", num_blocks=16)
    first = (
        plain.generate({"prompt_token_ids": PROMPTS[0]}, SamplingParams(**sampling, max_tokens=1), use_tqdm=False)[0]
        .outputs[0]
        .token_ids[0]
    )
    gen = {**sampling, "eos_token_id": [2, first]}
    llm = LLM(str(make_model(tmp_path / "m", generation_config=gen)), dtype="float32", num_blocks=16)
    defaults = llm.get_default_sampling_params()
    assert (defaults.top_k, defaults.repetition_penalty, defaults.temperature) == (1, 1.3, 0.7)
    out = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], use_tqdm=False)
    explicit = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], SamplingParams(**sampling), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in out] == [o.outputs[0].token_ids for o in explicit]
    assert out[0].outputs[0].token_ids == [first] and out[0].outputs[0].finish_reason == "stop"
    again = llm.generate(
        {"prompt_token_ids": PROMPTS[0]}, SamplingParams(**sampling, max_tokens=4, ignore_eos=True), use_tqdm=False
    )[0].outputs[0]
    assert again.token_ids[0] == first and len(again.token_ids) == 4


def test_generation_config_defaults_fill_only_unset_request_fields(tmp_path: Path) -> None:
    path = make_model(tmp_path / "m", generation_config={"temperature": 0.6, "top_p": 0.9, "top_k": 0})
    defaults = load_generation_defaults(path)
    assert defaults.sampling == {"temperature": 0.6, "top_p": 0.9, "top_k": -1}
    req = CompletionRequest(prompt="x", temperature=0.0)
    sp = defaults.apply(req.sampling(8), set(SAMPLING_KEYS) - req.model_fields_set)
    assert sp["temperature"] == 0.0 and sp["top_p"] == 0.9 and sp["top_k"] == -1
    chat = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "hi"}], "top_p": 0.5})
    sp = defaults.apply(chat.sampling(8), set(SAMPLING_KEYS) - chat.model_fields_set)
    assert sp["temperature"] == 0.6 and sp["top_p"] == 0.5
    SamplingParams(**sp)


def test_max_model_len_defaults_to_what_the_kv_cache_holds(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="conveyor"):
        llm = LLM("demo:tiny", dtype="float32", num_blocks=8, block_size=16)
    assert llm.engine.max_model_len == 128 and llm.engine.config.hf_config.max_position_embeddings == 2048
    assert "max_model_len 128 (the KV cache's 8 blocks" in caplog.text
    with pytest.raises(ValueError, match="max_model_len is 128"):
        llm.generate({"prompt_token_ids": [1] * 130}, use_tqdm=False)
    assert LLM("demo:tiny", num_blocks=8, block_size=16, max_model_len=1024).engine.max_model_len == 1024


@pytest.mark.parametrize(
    "arch,config",
    [
        ("mistral", {"sliding_window": 64}),
        ("qwen2", {"use_sliding_window": True, "sliding_window": 64, "max_window_layers": 2, "layer_types": None}),
    ],
)
def test_sliding_window_caps_or_refuses(tmp_path: Path, arch: str, config: dict) -> None:
    path = str(make_model(tmp_path / arch, arch=arch, config=config))
    with pytest.raises(ValueError, match=r"max_model_len \(128\) exceeds the model's sliding_window \(64\)"):
        LLM(path, max_model_len=128)
    llm = LLM(path, dtype="float32", num_blocks=16)
    assert llm.engine.max_model_len == 64
    prompt = [1] + [(31 * i + 7) % 8000 + 4 for i in range(40)]
    out = llm.generate(
        {"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True), use_tqdm=False
    )[0].outputs[0]
    assert out.token_ids == hf_greedy(path, [prompt], 20)[0]
    with pytest.raises(ValueError, match="max_model_len is 64"):
        llm.generate({"prompt_token_ids": [1] * 64}, use_tqdm=False)


def test_qwen2_sliding_window_off_is_not_capped(tmp_path: Path) -> None:
    path = make_model(tmp_path / "q", arch="qwen2", config={"use_sliding_window": False, "sliding_window": 64})
    assert LLM(str(path), num_blocks=16, max_model_len=200).engine.max_model_len == 200
