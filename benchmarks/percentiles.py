"""The one percentile every benchmark reports: linear interpolation between order statistics (numpy's default,
`statistics.quantiles(method="inclusive")`)."""

import numpy as np


def percentile(values: list[float], q: float) -> float:
    """The q-quantile (q in [0, 1]) of a non-empty sample."""
    if not values:
        raise ValueError("percentile of no values")
    return float(np.quantile(np.asarray(values, dtype=float), q))


def summary(values: list[float]) -> dict[str, float | None]:
    """mean, p50, p90 and p99 (None for an empty sample)."""
    if not values:
        return {"mean": None, "p50": None, "p90": None, "p99": None}
    return {"mean": float(np.mean(values)), **{f"p{q}": percentile(values, q / 100) for q in (50, 90, 99)}}
