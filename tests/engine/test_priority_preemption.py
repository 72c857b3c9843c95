"""Priority, preemption and aging at the scheduler level (tests/engine/fake_runner.py): high priority finishes
first and low priority is the victim, a preempted request resumes before later arrivals, aging bounds a
low-priority request's wait."""

import pytest

from conveyor.engine import SamplingParams
from conveyor.engine.core.sequence import Sequence
from tests.engine.fake_runner import FakeRunner, make_scheduler


def test_high_priority_finishes_first_and_low_priority_is_the_victim() -> None:
    sched = make_scheduler(10, max_num_seqs=3, enable_prefix_caching=False)
    runner = FakeRunner(sched)
    victims = []
    preempt = sched._preempt
    sched._preempt = lambda seq, out: (
        victims.append((seq.priority, max(s.priority for s in sched.running))),
        preempt(seq, out),
    )
    seqs = [
        Sequence(f"{p}{i}", [10 + i] * 6, SamplingParams(max_tokens=10), priority=p, arrival_time=float(i))
        for i in range(4)
        for p in (1, 0)
    ]
    for s in seqs:
        sched.add(s)
    done: dict[str, int] = {}
    while sched.has_unfinished:
        runner.step()
        done.update({s.request_id: runner.steps for s in seqs if s.is_finished and s.request_id not in done})
    high, low = [done[s.request_id] for s in seqs if s.priority == 0], [done[s.request_id] for s in seqs if s.priority]
    assert max(high) <= min(low)
    assert victims and all(v == worst for v, worst in victims)
    assert any(v == 1 for v, _ in victims), "a low-priority request ran beside a high one and was preempted"


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preempted_request_resumes_before_later_arrivals(mode: str) -> None:
    sched = make_scheduler(8, max_num_seqs=2, enable_prefix_caching=False, preemption_mode=mode, swap_blocks=16)
    runner = FakeRunner(sched)
    a, b = (Sequence(r, [10 + i] * 8, SamplingParams(max_tokens=12), arrival_time=float(i)) for i, r in enumerate("ab"))
    later = Sequence("c", [12] * 4, SamplingParams(max_tokens=4), arrival_time=2.0)
    sched.add(a), sched.add(b)
    runner.step()
    sched.add(later)
    resumed_from = None
    while sched.has_unfinished:
        scheduled = {c.req_id: c.start for c in runner.step().chunks}
        if b.num_preemptions and resumed_from is None and "b" in scheduled:
            resumed_from = scheduled["b"]
        assert "c" not in scheduled or resumed_from is not None, "a later arrival overtook the preempted request"
    assert b.num_preemptions == 1 and resumed_from is not None
    assert (resumed_from > 0) == (mode == "swap"), "swapped back in where it stopped, or recomputed from 0"


def starve(aging_rate: float, steps: int, mode: str) -> int | None:
    """One low-priority request under a stream of high-priority ones arriving faster than they are served;
    the cache is tight, so it is also preempted (swapped out) while it runs."""
    sched = make_scheduler(
        12, max_num_seqs=4, enable_prefix_caching=False, aging_rate=aging_rate, preemption_mode=mode, swap_blocks=64
    )
    runner = FakeRunner(sched)
    low = Sequence("low", [9] * 8, SamplingParams(max_tokens=30), priority=3)
    sched.add(low)
    for i in range(steps):
        sched.add(Sequence(f"h{i}", [10 + i % 30] * 4, SamplingParams(max_tokens=6), priority=0))
        runner.step()
        if low.is_finished:
            return runner.steps
    return None


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_aging_bounds_the_wait_of_a_low_priority_request(mode: str) -> None:
    assert starve(aging_rate=0, steps=400, mode=mode) is None, "without aging the stream starves it"
    finished_at = starve(aging_rate=10, steps=400, mode=mode)
    assert finished_at is not None and finished_at <= 150, f"finished at step {finished_at}"
