"""Speculative decoding with a draft model (method "draft"): greedy outputs equal the non-speculative ones and
transformers' (float32) token for token, with drafting requests beside plain decodes (requests with logprobs or
a seed do not speculate) and prefill chunks, under chunked prefill, prefix caching and preemption; the
lookahead blocks come back every step (invariants checked). The draft is the target itself (every draft
accepted: the lookahead bookkeeping must be exact) or the target cut to its first layers (demo:tiny-l2)."""

import random

import pytest

from conveyor.engine import LLM, SamplingParams
from conveyor.engine.checkpoints.demo import make_model
from conveyor.engine.config import SpeculativeConfig
from conveyor.engine.core.sequence import Sequence
from conveyor.engine.core.spec_decode import SpecController
from conveyor.engine.core.spec_decode.draft_model import DraftModelProposer
from tests.engine.test_spec_decode import exact_distribution
from tests.helpers import assert_no_leak, hf_greedy, prompt_ids

MODEL = "demo:tiny"


def draft(model: str = MODEL, k: int = 3, **options: object) -> dict:
    return {"method": "draft", "model": model, "num_speculative_tokens": k, "min_acceptance_rate": 0.0, **options}


def mixed_params(n: int, max_tokens: int) -> list[SamplingParams]:
    """Greedy requests; the second asks for logprobs and the third has a seed: those two never speculate."""
    base = dict(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    extra = {1: {"logprobs": 2}, 2: {"seed": 7}}
    return [SamplingParams(**base, **extra.get(i, {})) for i in range(n)]


def run(prompts: list[list[int]], params: list[SamplingParams], **options: object) -> tuple[list[list[int]], LLM]:
    llm = LLM(MODEL, dtype="float32", **options)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs], llm


def counters(llm: LLM) -> tuple[int, int, int]:
    s = llm.engine.stats()
    return s.spec_decode_num_drafts, s.spec_decode_num_draft_tokens, s.spec_decode_num_accepted_tokens


@pytest.mark.parametrize("draft_model", [MODEL, "demo:tiny-l2"], ids=["target", "cut"])
@pytest.mark.parametrize(
    "options",
    [
        {"max_num_batched_tokens": 32},
        {"enable_prefix_caching": True, "max_num_batched_tokens": 64},
        {"num_blocks": 40, "enable_prefix_caching": False},
    ],
    ids=["chunked", "prefix-cached", "preempted"],
)
def test_greedy_matches_transformers_and_plain_decoding(draft_model: str, options: dict) -> None:
    rng = random.Random(0)
    prompts = prompt_ids(MODEL) + [[1, *rng.sample(range(4, 8192), 200)] for _ in range(2)]
    prompts.append(prompts[-1][:150] + prompts[0])  # shares 9 blocks with the one before: a prefix-cache hit
    params = mixed_params(len(prompts), 24)
    expected = hf_greedy(MODEL, prompts, 24)
    plain, _ = run(prompts, params, **options)
    assert plain == expected
    got, llm = run(prompts, params, speculative=draft(draft_model), check_invariants=True, **options)
    assert got == expected
    drafts, drafted, accepted = counters(llm)
    assert drafted > 0
    if draft_model == MODEL:
        assert accepted == drafted  # the target drafting for itself: every greedy draft is its own next token
    if "num_blocks" in options:
        assert llm.engine.stats().num_preemptions > 0
    assert_no_leak(llm)


def test_acceptance_length_is_k_plus_one_when_the_draft_is_the_target() -> None:
    """A request's first decode step carries no drafts (the draft proposes after it); every later step emits
    k + 1 tokens when max_tokens leaves room for all of them."""
    k, steps = 4, 6
    prompts = prompt_ids(MODEL)[:3]
    params = SamplingParams(temperature=0, max_tokens=2 + steps * (k + 1), ignore_eos=True)
    llm = LLM(MODEL, dtype="float32", speculative=draft(k=k), check_invariants=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    stats = llm.engine.stats()
    assert stats.spec_decode_num_drafts == len(prompts) * steps
    assert stats.spec_decode_num_draft_tokens == stats.spec_decode_num_accepted_tokens == len(prompts) * steps * k
    assert stats.spec_decode_num_accepted_tokens_per_pos == [len(prompts) * steps] * k
    assert all(len(o.outputs[0].token_ids) == params.max_tokens for o in outs)
    assert_no_leak(llm)


def test_sampling_with_a_draft_model_keeps_the_target_distribution() -> None:
    """temperature 1, top_k 2, 5 tokens (the last 3 drafted): the empirical distribution of the outputs with a
    greedy draft (the target itself: its argmax is accepted with the target's probability of it) against the
    exact one; total variation within 4 standard deviations of its sampling noise."""
    n, prompt = 256, prompt_ids(MODEL)[3]
    exact = exact_distribution(MODEL, prompt, 5, 2)
    params = SamplingParams(temperature=1.0, top_k=2, max_tokens=5, ignore_eos=True)
    noise = sum((p * (1 - p) / n) ** 0.5 for p in exact.values()) / 2
    llm = LLM(MODEL, dtype="float32", speculative=draft(k=2), check_invariants=True)
    outs = llm.generate([{"prompt_token_ids": prompt}] * n, params, use_tqdm=False)
    counts: dict[tuple[int, ...], int] = {}
    for o in outs:
        key = tuple(o.outputs[0].token_ids)
        counts[key] = counts.get(key, 0) + 1
    tv = sum(abs(counts.get(k, 0) / n - exact.get(k, 0.0)) for k in exact.keys() | counts.keys()) / 2
    assert tv < 4 * noise, (tv, noise)
    _, drafted, accepted = counters(llm)
    assert 0 < accepted < drafted
    assert_no_leak(llm)


def test_proposals_are_used_only_for_the_length_they_follow() -> None:
    p = DraftModelProposer()
    seq = Sequence("a", [1, 2, 3], SamplingParams())
    p.store({"a": (3, [7, 8, 9])})
    assert p.propose(seq, 2) == [7, 8]
    assert p.propose(seq, 2) == []  # taken once
    p.store({"a": (3, [7, 8, 9])})
    seq.token_ids.append(4)  # moved on since (a preemption and recompute, say)
    assert p.propose(seq, 3) == []


def test_config_errors_name_the_field(tmp_path) -> None:
    with pytest.raises(ValueError, match="speculative.model must name the draft checkpoint"):
        LLM(MODEL, speculative={"method": "draft", "num_speculative_tokens": 3})
    with pytest.raises(ValueError, match="speculative.model is only for method 'draft'"):
        LLM(MODEL, speculative={"method": "ngram", "model": MODEL})
    with pytest.raises(ValueError, match="speculative.model.*not a built-in name"):
        LLM(MODEL, speculative=draft("no-such-model"))
    other = make_model(tmp_path / "vocab4096", config={"vocab_size": 4096})
    with pytest.raises(ValueError, match="speculative.model.*vocab_size 4096.*8192"):
        LLM(MODEL, speculative=draft(str(other)))
    with pytest.raises(ValueError, match="speculative.method 'draft' is not implemented with tensor_parallel_size > 1"):
        LLM(MODEL, speculative=draft(), tensor_parallel_size=2)
    with pytest.raises(ValueError, match="speculative.method 'draft' needs preemption_mode 'recompute'"):
        LLM(MODEL, speculative=draft(), preemption_mode="swap", swap_space=2**20)


def test_a_draft_model_backs_off_alone_too() -> None:
    """Proposals cost k draft forwards even alone in a step: the full bar applies, and a paused request is not
    named for proposals (no lookahead slots, no draft forwards for it)."""
    c = SpecController(
        SpeculativeConfig(method="draft", model=MODEL, num_speculative_tokens=2, min_acceptance_rate=0.5)
    )
    seq = Sequence("a", [1, 2, 3], SamplingParams(temperature=0))
    drafting, named = [], 0
    for step in range(300):
        named += c.lookahead(seq, step)
        c.proposer.store({"a": (seq.num_tokens, [5, 6])})
        if c.propose(seq, step, 8, 1):
            drafting.append(step)
            c.observe("a", 2, 0)
    gaps = [b - a for a, b in zip(drafting, drafting[1:])]
    assert len(drafting) < 15 and gaps == sorted(gaps) and gaps[-1] > 32
    assert named < 40  # of 300 steps
    assert not c.lookahead(Sequence("b", [1, 2], SamplingParams(logprobs=1)), 0)  # never speculates


def test_a_draft_of_another_shape_up_to_max_model_len() -> None:
    """demo:small-l2 (hidden 768, 4 KV heads) drafting for demo:tiny (hidden 256, 2 KV heads): the draft's KV
    cache takes its own shape on the same block ids. Outputs run into max_model_len, where the lookahead slots
    stop fitting; the outputs still equal plain decoding's."""
    prompts = [p[:40] for p in prompt_ids(MODEL)]
    params = mixed_params(len(prompts), 64)
    opts = {"max_model_len": 72, "max_num_batched_tokens": 48}
    plain, _ = run(prompts, params, **opts)
    assert all(len(p) + len(o) == 72 or len(o) == 64 for p, o in zip(prompts, plain))
    got, llm = run(prompts, params, speculative=draft("demo:small-l2", k=4), check_invariants=True, **opts)
    assert got == plain
    assert counters(llm)[1] > 0
    assert_no_leak(llm)
