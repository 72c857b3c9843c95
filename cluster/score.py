"""The replica score of the KV-aware router, which admission also ranks by (so the replica admission reserves
a request on is the one the router picks): prefix affinity + KV headroom + a short queue."""

from typing import Protocol


class ScoreWeights(Protocol):
    affinity_weight: float
    headroom_weight: float
    queue_weight: float


def replica_score(weights: ScoreWeights, affinity: float, pressure: float, load: int) -> float:
    """affinity: share of the prompt's leading blocks the replica holds; pressure: its KV demand / capacity;
    load: requests running and queued there."""
    headroom = min(1.0, max(0.0, 1.0 - pressure))
    return weights.affinity_weight * affinity + weights.headroom_weight * headroom + weights.queue_weight / (1 + load)
