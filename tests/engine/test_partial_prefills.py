"""Partial prefills at the scheduler level (tests/engine/fake_runner.py): without caps long prompts hold short
requests' decodes back; with long_prefill_token_threshold and max_num_partial_prefills they decode every step."""

from conveyor.engine import SamplingParams
from conveyor.engine.core.sequence import Sequence
from tests.engine.fake_runner import FakeRunner, make_scheduler


def decode_gaps(threshold: int, cap: int) -> int:
    """Short requests left without a token in a step (summed over steps), long prompts arriving among them."""
    sched = make_scheduler(
        200, max_num_batched_tokens=32, long_prefill_token_threshold=threshold, max_num_partial_prefills=cap
    )
    runner = FakeRunner(sched)
    seqs = [
        Sequence(f"s{i}", [10 + i] * 5, SamplingParams(max_tokens=20))
        if i % 2 == 0
        else Sequence(f"l{i}", [20 + i] * 120, SamplingParams(max_tokens=4))
        for i in range(5)
    ]
    for s in seqs:
        sched.add(s)
    gaps = 0
    while sched.has_unfinished:
        scheduled = {c.req_id for c in runner.step().chunks}
        gaps += sum(1 for s in seqs if s.request_id[0] == "s" and not s.is_finished and s.request_id not in scheduled)
    return gaps


def test_long_prompts_without_caps_do_block_short_ones() -> None:
    assert decode_gaps(0, 0) > 5 and decode_gaps(8, 1) == 0
