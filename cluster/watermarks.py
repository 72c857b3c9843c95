"""KV watermarks with hysteresis: the one definition admission and routing share. Admission compares each
replica's `kv_pressure` (EngineStats.kv_pressure at its measured prefix-cache misses, exported under that name)."""

from dataclasses import dataclass

HIGH_WATERMARK = 0.90
LOW_WATERMARK = 0.75


@dataclass(frozen=True)
class Watermarks:
    high: float = HIGH_WATERMARK
    low: float = LOW_WATERMARK

    def saturated(self, was_saturated: bool, pressure: float) -> bool:
        """Stop above `high`; once stopped, resume only below `low`."""
        return pressure >= self.low if was_saturated else pressure > self.high
