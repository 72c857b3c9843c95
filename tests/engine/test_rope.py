"""RoPE: one table per model sized to max_model_len; scaled rope types give transformers' logits past the
original context (generated checkpoints, checked against transformers' generate and its log-probabilities)."""

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from conveyor.engine import LLM, SamplingParams
from conveyor.engine.checkpoints.demo import make_model
from conveyor.engine.model.rotary import RotaryEmbedding

ORIGINAL = 32
ROPE = {
    "linear": {"rope_type": "linear", "factor": 4.0},
    "llama3": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": ORIGINAL,
    },
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": ORIGINAL},
}
PROMPT = [1] + [(37 * i + 11) % 8000 + 4 for i in range(95)]
MAX_TOKENS = 8


def model_with(tmp_path: Path, rope: dict | None, **config: object) -> str:
    extra = {"max_position_embeddings": 4 * ORIGINAL * 2, **config}
    if rope is not None:
        extra["rope_scaling"] = {**rope, "rope_theta": 10000.0}
    return str(make_model(tmp_path / "m", config=extra))


def hf_reference(path: str) -> tuple[list[int], list[float]]:
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    x = torch.tensor([PROMPT])
    out = hf.generate(
        x,
        attention_mask=torch.ones_like(x),
        max_new_tokens=MAX_TOKENS,
        min_new_tokens=MAX_TOKENS,
        do_sample=False,
        pad_token_id=3,
        output_scores=True,
        return_dict_in_generate=True,
    )
    tokens = out.sequences[0, len(PROMPT) :].tolist()
    logprobs = [torch.log_softmax(s[0].float(), -1)[t].item() for s, t in zip(out.scores, tokens)]
    return tokens, logprobs


@pytest.mark.parametrize("kind", sorted(ROPE))
def test_scaled_rope_matches_transformers_past_the_original_context(tmp_path: Path, kind: str) -> None:
    path = model_with(tmp_path, ROPE[kind])
    tokens, logprobs = hf_reference(path)
    llm = LLM(path, dtype="float32", num_blocks=32, max_num_batched_tokens=64)
    out = llm.generate(
        {"prompt_token_ids": PROMPT},
        SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=0),
        use_tqdm=False,
    )[0]
    assert len(PROMPT) > 2 * ORIGINAL and out.outputs[0].token_ids == tokens
    ours = [lp[t] for lp, t in zip(out.outputs[0].logprobs, tokens)]
    assert ours == pytest.approx(logprobs, abs=1e-2)


@pytest.mark.parametrize("kind", sorted(ROPE))
def test_table_is_transformers_cos_sin(tmp_path: Path, kind: str) -> None:
    from transformers import AutoConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    config = AutoConfig.from_pretrained(model_with(tmp_path, ROPE[kind]))
    n = config.max_position_embeddings
    ours = RotaryEmbedding(config, 64, n)
    cos, sin = LlamaRotaryEmbedding(config)(torch.zeros(1, dtype=torch.float32), torch.arange(n)[None])
    assert torch.allclose(ours.cos, cos[0], atol=1e-6) and torch.allclose(ours.sin, sin[0], atol=1e-6)
    plain = RotaryEmbedding(AutoConfig.from_pretrained(model_with(tmp_path / "plain", None)), 64, n)
    assert not torch.allclose(plain.cos[2 * ORIGINAL :], cos[0, 2 * ORIGINAL :], atol=1e-2)


def test_one_table_sized_to_max_model_len(tmp_path: Path) -> None:
    path = model_with(tmp_path, ROPE["yarn"])
    llm = LLM(path, dtype="float32", num_blocks=32, max_model_len=100)
    model = llm.engine.local_core.executor.runner.model
    tables = [m for m in model.modules() if isinstance(m, RotaryEmbedding)]
    assert len(tables) == 1 and tuple(tables[0].cos.shape) == (100, 64)


def test_dynamic_ntk_is_refused_by_name(tmp_path: Path) -> None:
    path = model_with(tmp_path, {"rope_type": "dynamic", "factor": 2.0})
    with pytest.raises(ValueError, match="rope_scaling.rope_type 'dynamic' is not supported"):
        LLM(path)
