"""Which replica a prompt should start on: the one where its first token is expected soonest.

A replica's cost is its queue time (cluster.queue_time, unscaled) plus the prefill of the prompt blocks it
does not hold (real KV contents, and prompts on their way there) at its measured prefill rate, plus the
recompute a placement forces later: new blocks beyond the replica's hot capacity (`hot_fraction` of its
cache, for blocks other prompts reused recently) push hot blocks out, to be prefilled again. So a prefix
stays on the replica holding it until that replica's queue costs more than the prefill it saves (then it is
copied to the other), and a new prefix goes where it evicts no hot one: hot prefixes spread by capacity.
"""

from dataclasses import dataclass
from typing import Sequence


@dataclass(frozen=True)
class Option:
    replica_id: str
    cached_blocks: int
    wait_s: float
    prefill_tokens_per_s: float
    hot_blocks: int  # blocks other prompts reused there recently (cluster.hot_blocks)
    capacity_blocks: int
    load: int = 0
    lower_blocks: int = 0  # prompt blocks after the cached ones held in a lower KV tier: loaded, not prefilled
    load_cost: float = 0.0  # a lower-tier block's load time over its prefill time


def evicted_hot_blocks(o: Option, new_blocks: int, hot_fraction: float) -> int:
    """Hot blocks the new ones push out: no more than there are new blocks (hot blocks beyond the capacity, e.g.
    from a burst of one-off prompts, were pushed out by their own successors, not by this placement)."""
    return min(o.hot_blocks, new_blocks, max(0, o.hot_blocks + new_blocks - int(hot_fraction * o.capacity_blocks)))


def cost_s(o: Option, prompt_blocks: int, block_size: int, hot_fraction: float = 0.6) -> float:
    """Expected seconds until the prompt's first token there, plus the recompute of hot blocks it evicts."""
    new = max(0, prompt_blocks - o.cached_blocks)
    if o.prefill_tokens_per_s <= 0:
        return float("inf")
    computed = new - min(new, o.lower_blocks) * (1.0 - o.load_cost)
    return o.wait_s + (computed + evicted_hot_blocks(o, new, hot_fraction)) * block_size / o.prefill_tokens_per_s


def hot_share(o: Option, hot_fraction: float) -> float:
    """The share of the hot capacity that hot blocks fill, at most 1: past it every new block evicts a hot one
    wherever it goes, so the count beyond (e.g. a burst of one-off prompts) tells replicas apart no more."""
    capacity = max(1, int(hot_fraction * o.capacity_blocks))
    return min(o.hot_blocks, capacity) / capacity


def rank(options: Sequence[Option], prompt_blocks: int, block_size: int, hot_fraction: float = 0.6) -> list[str]:
    """Replica ids, cheapest first; ties by the blocks held (no second copy of a prefix for nothing), then
    (a prompt no replica holds, queues alike) by the share of the hot capacity that hot blocks fill, so new
    prefixes spread by capacity before they evict anything, then by load."""
    return [
        o.replica_id
        for o in sorted(
            options,
            key=lambda o: (
                cost_s(o, prompt_blocks, block_size, hot_fraction),
                -o.cached_blocks,
                hot_share(o, hot_fraction),
                o.load,
                o.replica_id,
            ),
        )
    ]
