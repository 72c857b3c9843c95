"""How long a request sent to a replica now would wait before it starts, from the replica's queue and its
measured service rates (cluster.stats.Rates).

Two bottlenecks, whichever is worse: batch slots (a request beyond the replica's free slots starts when
enough running requests have finished: the k-th slot frees when the running request with the k-th fewest
tokens left is done, at the measured steps per second; beyond those, at the measured finish rate; slots
are `max_num_seqs`, or fewer when the KV cache holds fewer requests the size the running ones grow to by
their `max_tokens`) and prefill (the prompt tokens queued ahead drain at Rates.prefill_drain_per_s; the
engine counts a queued prompt's cached tokens too, so those are scaled by the measured prefix-cache miss
ratio). Requests admitted but not yet in the stats count as queued, their prompts as queued prefill. With a
queue but no measured finish rate the wait is unknown: infinite, so a cold replica takes what its free slots
hold and no more.
"""

import math

from conveyor.cluster.stats import Rates, ReplicaStats, num_blocks


def queue_time_s(
    stats: ReplicaStats, rates: Rates, extra_requests: int = 0, extra_tokens: int = 0, block_size: int | None = None
) -> float:
    """block_size: the replica's (its stats') unless given."""
    block_size = block_size or stats.block_size
    ahead = stats.num_waiting + extra_requests
    slots = stats.max_num_seqs - stats.num_running if stats.max_num_seqs else ahead + 1
    if stats.num_running and stats.kv_blocks_used:
        per_request = (stats.kv_blocks_used + num_blocks(sum(stats.tokens_left), block_size)) / stats.num_running
        slots = min(slots, int(stats.kv_blocks_total / per_request) - stats.num_running)
    over = ahead + 1 - slots
    left = stats.tokens_left
    if over <= 0:
        slot_wait = 0.0
    elif left and rates.steps_per_s > 0 and over <= len(left):
        slot_wait = left[over - 1] / rates.steps_per_s
    elif left and rates.steps_per_s > 0 and rates.finished_per_s > 0:
        slot_wait = left[-1] / rates.steps_per_s + (over - len(left)) / rates.finished_per_s
    else:
        slot_wait = over / rates.finished_per_s if rates.finished_per_s > 0 else math.inf
    tokens = stats.num_waiting_tokens * rates.miss_ratio + extra_tokens
    rate = rates.prefill_drain_per_s
    prefill_wait = tokens / rate if rate > 0 and tokens > 0 else 0.0
    return max(slot_wait, prefill_wait)


def retry_after_s(wait_s: float, limit_s: float, default_s: float) -> float:
    """When to come back: once the shortest queue has drained down to the limit (whole seconds, >= 1)."""
    if math.isinf(wait_s):
        return max(1.0, default_s)
    return float(max(1, math.ceil(wait_s - limit_s)))
