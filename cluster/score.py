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


LORA_MAX_IMBALANCE = 8  # requests more queued than the best-ranked replica before a resident adapter stops drawing


def prefer_resident(ranked: list[str], resident: set[str], load: dict[str, int]) -> list[str]:
    """LoRA-aware order: the replicas holding the request's adapter first (in `ranked`'s order), unless their
    queue is LORA_MAX_IMBALANCE longer than the best-ranked replica's; where none does, `ranked` stands and the
    adapter loads on its first (the best-scored, as a rule the least loaded)."""
    if not ranked or not resident:
        return ranked
    limit = load.get(ranked[0], 0) + LORA_MAX_IMBALANCE
    first = [r for r in ranked if r in resident and load.get(r, 0) <= limit]
    return first + [r for r in ranked if r not in first]
