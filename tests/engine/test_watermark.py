"""The watermark of blocks held back from admissions and swap-ins: fixed, or adaptive to preemptions."""

import pytest

from conveyor.engine.core.watermark import Watermark


def test_adaptive_watermark_rule() -> None:
    w = Watermark(0.01, adaptive=True, num_blocks=1000)
    for expected in (0.02, 0.04, 0.04):
        w.observe(preempted=True)
        assert w.fraction == pytest.approx(expected)
    assert w.blocks == 40
    for _ in range(49):
        w.observe(preempted=False)
    assert w.fraction == pytest.approx(0.04)
    w.observe(preempted=False)
    assert w.fraction == pytest.approx(0.025), "50 calm steps halve the excess"
    w.observe(preempted=True)
    assert w.calm_steps == 0 and w.fraction == pytest.approx(0.04)
    fixed = Watermark(0.05, adaptive=False, num_blocks=1000)
    fixed.observe(preempted=True)
    assert fixed.blocks == 50
