"""Sampling, stopping and input validation through the offline LLM API."""
import math

import pytest

from engine import LLM, SamplingParams
from tests.helpers import PROMPTS, assert_no_leak


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM("demo:llama-tiny", dtype="float32", num_blocks=256)


def run(llm: LLM, params: SamplingParams, prompts: list = PROMPTS[:3]) -> list:
    return [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]


def test_max_tokens_and_length_finish(llm: LLM) -> None:
    for out in run(llm, SamplingParams(temperature=0, max_tokens=7, ignore_eos=True)):
        assert len(out.token_ids) == 7 and out.finish_reason == "length"
    assert_no_leak(llm)


def test_stop_token_ids_and_eos(llm: LLM) -> None:
    greedy = run(llm, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))[0].token_ids
    stop = greedy[4]
    out = run(llm, SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[stop]))[0]
    cut = greedy.index(stop)
    assert out.token_ids == greedy[:cut + 1] and out.finish_reason == "stop" and out.stop_reason == stop
    llm.engine.scheduler.eos_token_ids.add(stop)
    try:
        eos = run(llm, SamplingParams(temperature=0, max_tokens=12))[0]
        assert eos.token_ids == greedy[:cut + 1] and eos.finish_reason == "stop" and eos.stop_reason is None
        ignored = run(llm, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))[0]
        assert ignored.token_ids == greedy
        late = run(llm, SamplingParams(temperature=0, max_tokens=12, min_tokens=cut + 2))[0]
        assert stop not in late.token_ids[:cut + 2] and len(late.token_ids) >= cut + 2
    finally:
        llm.engine.scheduler.eos_token_ids.discard(stop)


def test_stop_string_across_token_boundaries(llm: LLM) -> None:
    full = run(llm, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))[1]
    pieces = [llm.tokenizer.decode([t]) for t in full.token_ids]
    k = next(i for i in range(2, len(pieces)) if len(pieces[i]) >= 2 and len(pieces[i + 1]) >= 1)
    stop = pieces[k][-1] + pieces[k + 1][:1]
    start = full.text.index(stop)
    out = run(llm, SamplingParams(temperature=0, max_tokens=16, stop=[stop]))[1]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == full.text[:start]
    kept = run(llm, SamplingParams(temperature=0, max_tokens=16, stop=stop, include_stop_str_in_output=True))[1]
    assert kept.text == full.text[:start + len(stop)]
    assert_no_leak(llm)


def test_seed_reproducible_and_batch_independent(llm: LLM) -> None:
    params = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=12, seed=1234, ignore_eos=True)
    a = run(llm, params, PROMPTS[:1])[0].token_ids
    b = run(llm, params, PROMPTS[:3])[0].token_ids
    c = run(llm, SamplingParams(temperature=1.0, top_p=0.9, max_tokens=12, seed=99, ignore_eos=True),
            PROMPTS[:1])[0].token_ids
    assert a == b and a != c


def test_top_k_one_and_tiny_top_p_are_greedy(llm: LLM) -> None:
    greedy = [o.token_ids for o in run(llm, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))]
    for params in (SamplingParams(temperature=1.5, top_k=1, max_tokens=8, ignore_eos=True),
                   SamplingParams(temperature=1.5, top_p=1e-6, max_tokens=8, ignore_eos=True),
                   SamplingParams(temperature=1.5, min_p=1.0, max_tokens=8, ignore_eos=True)):
        assert [o.token_ids for o in run(llm, params)] == greedy


def test_penalties_change_greedy_choice(llm: LLM) -> None:
    base = run(llm, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))
    rep = run(llm, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, repetition_penalty=1e4))
    for b, r in zip(base, rep):
        assert len(set(r.token_ids)) == len(r.token_ids), "a huge repetition penalty forbids repeats"
    freq = run(llm, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, frequency_penalty=2.0,
                                   presence_penalty=2.0))
    assert [f.token_ids for f in freq] != [b.token_ids for b in base] or \
        all(len(set(b.token_ids)) == len(b.token_ids) for b in base)


def test_logprobs_top_n_and_sampled(llm: LLM) -> None:
    out = run(llm, SamplingParams(temperature=0, max_tokens=5, logprobs=3, ignore_eos=True))[0]
    assert len(out.logprobs) == 5
    for tok, entry in zip(out.token_ids, out.logprobs):
        assert tok in entry and 3 <= len(entry) <= 4
        assert entry[tok] == max(entry.values()), "greedy picks the most likely token"
        assert all(v <= 0 for v in entry.values())
        assert math.fsum(math.exp(v) for v in entry.values()) <= 1 + 1e-5


def test_n_samples(llm: LLM) -> None:
    out = llm.generate(PROMPTS[0], SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=6), use_tqdm=False)
    assert len(out) == 1 and [c.index for c in out[0].outputs] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in out[0].outputs}) > 1


@pytest.mark.parametrize("kwargs, field", [
    ({"temperature": -0.1}, "temperature"), ({"top_p": 0.0}, "top_p"), ({"top_p": 1.5}, "top_p"),
    ({"top_k": 0}, "top_k"), ({"top_k": -2}, "top_k"), ({"max_tokens": 0}, "max_tokens"),
    ({"min_tokens": 5, "max_tokens": 4}, "min_tokens"), ({"temperature": "hot"}, "temperature"),
    ({"max_tokens": 2.5}, "max_tokens"), ({"stop": [""]}, "stop"), ({"logprobs": 50}, "logprobs"),
    ({"stop_token_ids": [-1]}, "stop_token_ids"), ({"n": 0}, "n"), ({"seed": "x"}, "seed"),
])
def test_bad_sampling_params_name_the_field(kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


@pytest.mark.parametrize("prompt, match", [
    ("", "empty"), ({"prompt_token_ids": []}, "empty"), ({"prompt_token_ids": [1, 8192]}, "vocabulary"),
    ({"prompt_token_ids": [1, -3]}, "vocabulary"), ({"prompt_token_ids": [5] * 4096}, "max_model_len"),
    (42, "prompt"),
])
def test_bad_prompts_rejected_before_engine(llm: LLM, prompt, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        llm.generate([PROMPTS[0], prompt], SamplingParams(max_tokens=4), use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
    assert run(llm, SamplingParams(temperature=0, max_tokens=3))[0].token_ids


def test_request_larger_than_cache_is_refused() -> None:
    fitted = LLM("demo:llama-tiny", num_blocks=4, block_size=16)  # max_model_len shrinks to the 64 cached tokens
    assert fitted.engine.max_model_len == 64
    with pytest.raises(ValueError, match="max_model_len"):
        fitted.generate({"prompt_token_ids": [5] * 70}, SamplingParams(max_tokens=10), use_tqdm=False)
    explicit = LLM("demo:llama-tiny", num_blocks=4, block_size=16, max_model_len=128)
    with pytest.raises(ValueError, match="KV blocks"):
        explicit.generate({"prompt_token_ids": [5] * 60}, SamplingParams(max_tokens=10), use_tqdm=False)
    assert explicit.generate({"prompt_token_ids": [5] * 30}, SamplingParams(max_tokens=10), use_tqdm=False)


def test_bad_engine_config_names_the_field() -> None:
    from engine import EngineConfig
    for kwargs, field in [({"block_size": 12}, "block_size"), ({"max_num_seqs": 0}, "max_num_seqs"),
                          ({"scheduling_policy": "fifo"}, "scheduling_policy"),
                          ({"attention_backend": "cuda"}, "attention_backend"),
                          ({"model": "demo:huge"}, "demo"), ({"max_model_len": 10 ** 6}, "max_model_len")]:
        with pytest.raises(ValueError, match=field):
            EngineConfig(**kwargs)
