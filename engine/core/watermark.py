"""Blocks held back from new admissions (and swap-ins) while others run, so running sequences can grow.

Adaptive rule: a step that preempts doubles the fraction (to at least 1%, at most max(4 x base, 2%)
and never above 20%); every 50 consecutive steps without a preemption halve the excess back towards
the base. So a preemption storm raises the reserve within a few steps, and a calm period gives the
memory back to admissions."""


class Watermark:
    def __init__(self, base: float, adaptive: bool, num_blocks: int) -> None:
        self.base = self.fraction = base
        self.adaptive = adaptive
        self.num_blocks = num_blocks
        self.calm_steps = 0

    @property
    def blocks(self) -> int:
        return int(self.fraction * self.num_blocks)

    def observe(self, preempted: bool) -> None:
        if not self.adaptive:
            return
        if preempted:
            self.calm_steps = 0
            self.fraction = min(max(self.fraction * 2, 0.01), max(self.base * 4, 0.02), 0.2)
        else:
            self.calm_steps += 1
            if self.calm_steps >= 50:
                self.calm_steps = 0
                self.fraction = self.base + (self.fraction - self.base) / 2
