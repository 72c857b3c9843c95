"""Speculative decoding (n-gram prompt lookup): greedy outputs equal the non-speculative ones and transformers'
(float32) token for token, with drafting requests mixed with plain decodes and prefill chunks, under chunked
prefill and preemption; rejected drafts' blocks come back; the controller backs off."""

import random

import pytest
from transformers import AutoTokenizer

from conveyor.engine import LLM, SamplingParams
from conveyor.engine.checkpoints.model_source import resolve_model
from conveyor.engine.config import SpeculativeConfig
from conveyor.engine.core.sequence import Sequence
from conveyor.engine.core.spec_decode import SpecController
from conveyor.engine.core.spec_decode.ngram import NgramProposer
from conveyor.engine.execution.rejection_sampler import verify
from tests.helpers import assert_no_leak, engine_greedy, hf_greedy, prompt_ids

NGRAM = {"method": "ngram", "num_speculative_tokens": 4}
PASSAGE = (
    "The committee met on Tuesday to review the budget for the coming year. After a long discussion, the "
    "members agreed to increase funding for the library and to reduce spending on travel."
)
CODE = "def area(width, height):\n    return width * height\n\n\ndef perimeter(width, height):\n    return 2 * (width + height)\n"
CHATS = [
    f"Rewrite this passage, replacing 'Tuesday' with 'Friday' and changing nothing else:\n\n{PASSAGE}",
    f"Rename the function `area` to `rectangle_area` in this code and change nothing else:\n\n{CODE}",
    "What is the capital of France?",
]


def chat_prompts(model: str = "demo:smollm2") -> list[list[int]]:
    tok = AutoTokenizer.from_pretrained(resolve_model(model))
    out = []
    for text in CHATS:
        ids = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
        out.append(list(ids["input_ids"] if hasattr(ids, "keys") else ids))
    return out


def spec_counters(llm: LLM) -> tuple[int, int]:
    s = llm.engine.stats()
    return s.spec_decode_num_draft_tokens, s.spec_decode_num_accepted_tokens


def test_ngram_proposes_what_followed_the_latest_match() -> None:
    p = NgramProposer(2, 3)
    seq = Sequence("a", [1, 2, 3, 4, 9, 2, 3, 5, 6, 2, 3], SamplingParams())
    assert p.propose(seq, 2) == [5, 6]  # (2, 3) last occurred before 5, 6
    seq.token_ids += [5]
    assert p.propose(seq, 4) == [6, 2, 3, 5]  # (2, 3, 5) matches; continuation stops at the sequence's end
    seq.token_ids += [7]
    assert p.propose(seq, 4) == []
    assert NgramProposer(1, 1).propose(Sequence("b", [8, 7, 8], SamplingParams()), 3) == [7, 8]


def test_verify_accepts_the_prefix_that_matches_the_samples() -> None:
    assert verify([5, 6, 7, 8], [5, 6, 9]) == ([5, 6], 7)
    assert verify([5, 6, 7, 8], [5, 6, 7]) == ([5, 6, 7], 8)
    assert verify([4, 6, 7, 8], [5, 6, 7]) == ([], 4)


def test_controller_backs_off_and_probes_again() -> None:
    c = SpecController(SpeculativeConfig(num_speculative_tokens=2, prompt_lookup_min=1, min_acceptance_rate=0.5))
    seq = Sequence("a", [1, 2, 1, 2, 1], SamplingParams(temperature=0))
    many = 32  # decodes in the step: the full bar applies
    drafting = []
    for step in range(300):
        if c.propose(seq, step, 8, many):
            drafting.append(step)
            c.observe("a", 2, 0)
    gaps = [b - a for a, b in zip(drafting, drafting[1:])]
    assert len(drafting) < 15 and gaps == sorted(gaps) and gaps[-1] > 32  # rejected every time: longer pauses
    assert c.propose(seq, 10**6, 8, 1) == [2, 1]  # alone in a step, drafting pays at any acceptance
    assert c.counters.num_accepted_tokens == 0 and c.counters.num_draft_tokens > 0
    seeded = Sequence("b", [1, 2, 1, 2, 1], SamplingParams(seed=3))
    assert c.propose(seeded, 0, 8, 1) == []  # sampled token by token with its own generator: no drafts


def test_draft_length_stops_where_drafts_are_rejected() -> None:
    """At the full bar a request whose drafts are accepted up to the second position drafts two, trying the longer
    run again after a run accepted whole; alone in a step it drafts all four (a row costs almost nothing there)."""
    c = SpecController(SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_min=1, min_acceptance_rate=0.5))
    seq = Sequence("a", [1, 2, 3, 4, 5, 6, 1, 2], SamplingParams(temperature=0))
    lengths = []
    for step in range(40):
        drafts = c.propose(seq, step, 8, 32)
        assert drafts == [3, 4, 5, 6][: len(drafts)]
        lengths.append(len(drafts))
        c.observe("a", len(drafts), min(2, len(drafts)))
    later = lengths[4:]
    assert lengths[0] == 4 and min(later) == 2 and sum(later) / len(later) <= 3.1, lengths
    assert c.counters.num_accepted_tokens == 2 * len(lengths)  # never paused, never cut below the accepted run
    assert len(c.propose(seq, 40, 8, 1)) == 4


def test_config_refuses_what_is_not_implemented() -> None:
    with pytest.raises(ValueError, match="speculative.num_speculative_tokens"):
        LLM("demo:tiny", speculative={"method": "ngram", "num_speculative_tokens": 0})
    with pytest.raises(ValueError, match="speculative.k.*not a speculative option"):
        LLM("demo:tiny", speculative={"k": 3})
    with pytest.raises(ValueError, match="speculative needs scheduling_policy"):
        LLM("demo:tiny", speculative=NGRAM, scheduling_policy="static")


@pytest.mark.parametrize(
    "options",
    [
        {"max_num_batched_tokens": 64},
        {"num_blocks": 200, "preemption_mode": "recompute", "enable_prefix_caching": False},
        {"num_blocks": 200, "preemption_mode": "swap", "swap_space": 2**23},
    ],
    ids=["chunked", "recompute", "swap"],
)
def test_demo_model_greedy_matches_transformers(options: dict) -> None:
    """Random weights: an output token drafts when it occurs in the prompt (two prompts hold 1500 distinct
    tokens each), and nearly every draft is rejected, so drafting steps roll back."""
    model = "demo:llama-tiny"
    prompts = prompt_ids(model) + [[1, *random.Random(i).sample(range(4, 8192), 1500)] for i in range(2)]
    expected = hf_greedy(model, prompts, 24)
    spec = {**NGRAM, "prompt_lookup_min": 1}
    got, llm = engine_greedy(model, prompts, 24, speculative=spec, check_invariants=True, **options)
    assert got == expected
    drafted, _ = spec_counters(llm)
    assert drafted > 0
    if "preemption_mode" in options:
        assert llm.engine.stats().num_preemptions > 0
    assert_no_leak(llm)


@pytest.mark.slow
def test_smollm2_greedy_matches_transformers_and_plain_decoding() -> None:
    """SmolLM2 copies the passage and the code: drafts are accepted and rejected; prompts of different lengths
    under a small token budget put drafting chunks beside prefill chunks and plain decodes in one step."""
    model, prompts = "demo:smollm2", chat_prompts()
    plain, _ = engine_greedy(model, prompts, 32, max_num_batched_tokens=64)
    # transformers' generate(min_new_tokens) bans <|im_end|>: its tokens are the oracle up to the engine's first one
    for want, got in zip(hf_greedy(model, prompts, 32), plain):
        end = got.index(2) if 2 in got else len(got)
        assert got[:end] == want[:end]
    llm = LLM(model, dtype="float32", speculative=NGRAM, check_invariants=True, max_num_batched_tokens=64)
    core = llm.engine.local_core
    core.step_trace.enable()
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == plain
    drafted, accepted = spec_counters(llm)
    assert 0 < accepted < drafted
    records = core.step_trace.disable()
    assert any(r.num_draft_tokens and r.tokens("prefill") for r in records), "no drafts beside a prefill chunk"
    assert sum(r.num_accepted_tokens for r in records) == accepted
    assert_no_leak(llm)


@pytest.mark.slow
def test_smollm2_preemption_with_drafts() -> None:
    model, prompts = "demo:smollm2", chat_prompts()[:2]
    plain, _ = engine_greedy(model, prompts, 32, max_num_batched_tokens=64)
    got, llm = engine_greedy(
        model, prompts, 32, speculative=NGRAM, check_invariants=True, num_blocks=10, max_num_batched_tokens=64
    )
    assert got == plain
    assert llm.engine.stats().num_preemptions > 0
    assert spec_counters(llm)[1] > 0
    assert_no_leak(llm)


def exact_distribution(model: str, prompt: list[int], length: int, top_k: int) -> dict[tuple[int, ...], float]:
    """P(next `length` tokens) under temperature 1 and top_k, from transformers' logits."""
    import torch
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(resolve_model(model), dtype=torch.float32)
    dist = {(): 1.0}
    for _ in range(length):
        grown = {}
        for prefix, prob in dist.items():
            with torch.no_grad():
                logits = hf(torch.tensor([prompt + list(prefix)])).logits[0, -1]
            values, ids = logits.topk(top_k)
            for t, p in zip(ids.tolist(), values.softmax(-1).tolist()):
                grown[(*prefix, t)] = prob * p
        dist = grown
    return dist


@pytest.mark.slow
def test_sampling_with_drafts_keeps_the_target_distribution() -> None:
    """temperature 1, top_k 3, 3 tokens: the empirical distribution of the 3-token outputs, with and without
    speculation, against the exact one; total variation within 4 standard deviations of its sampling noise."""
    model, n = "demo:smollm2", 192
    tok = AutoTokenizer.from_pretrained(resolve_model(model))
    prompt = tok(
        "one two three four five six seven eight. one two three four five six seven eight. one two three"
    ).input_ids
    exact = exact_distribution(model, prompt, 3, 3)
    params = SamplingParams(temperature=1.0, top_k=3, max_tokens=3, ignore_eos=True)
    noise = sum((p * (1 - p) / n) ** 0.5 for p in exact.values()) / 2  # E|p_hat - p| ~ its std, summed, halved
    for spec in (None, {**NGRAM, "min_acceptance_rate": 0.0}):
        llm = LLM(model, dtype="float32", speculative=spec, check_invariants=True)
        outs = llm.generate([{"prompt_token_ids": prompt}] * n, params, use_tqdm=False)
        counts: dict[tuple[int, ...], int] = {}
        for o in outs:
            key = tuple(o.outputs[0].token_ids)
            counts[key] = counts.get(key, 0) + 1
        tv = sum(abs(counts.get(k, 0) / n - exact.get(k, 0.0)) for k in exact.keys() | counts.keys()) / 2
        assert tv < 4 * noise, (spec, tv, noise)
        if spec is not None:
            assert spec_counters(llm)[1] > 0
        assert_no_leak(llm)
