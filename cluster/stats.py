"""Plain load snapshots of one replica, its measured service rates, and the block keys of prompts.

A replica reports `EngineStats.to_dict() | {"replica_id": id}`; `ReplicaStats.from_dict` reads it.
The replica id is `serve.get_replica_context().replica_id.unique_id` everywhere in cluster/.
"""

import math
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any, Sequence

from conveyor.engine.core import prefix_hash
from conveyor.engine.stats import EngineStats, cdiv


@dataclass(frozen=True)
class ReplicaStats(EngineStats):
    """One replica's EngineStats as the cluster layer reads them, from a dict (`from_dict`)."""

    replica_id: str
    # None: a replica that does not report it (reservations settle by time)
    num_added: int | None = field(default=None, kw_only=True)
    # None: a replica that does not report it (growth from tokens_left)
    num_growth_blocks: int | None = field(default=None, kw_only=True)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ReplicaStats":
        known = {f.name for f in fields(cls)}
        return cls(
            **{k: v for k, v in d.items() if k in known and v is not None} | {"replica_id": str(d["replica_id"])}
        )

    @classmethod
    def from_engine(cls, replica_id: str, stats: EngineStats) -> "ReplicaStats":
        return cls.from_dict({**stats.to_dict(), "replica_id": replica_id})

    @property
    def growth_blocks(self) -> int:
        if self.num_growth_blocks is None:
            return num_blocks(sum(self.tokens_left), self.block_size)
        return self.num_growth_blocks

    @property
    def idle(self) -> bool:
        return not self.num_running and not self.num_waiting

    def idle_since(self, earlier: "ReplicaStats") -> bool:
        """Nothing ran, waited or changed between `earlier` and this snapshot."""
        return self.idle and replace(self, timestamp=earlier.timestamp) == earlier


def num_blocks(num_tokens: int, block_size: int) -> int:
    return cdiv(num_tokens, block_size) if num_tokens > 0 else 0


def block_hashes(
    token_ids: Sequence[int],
    block_size: int,
    salt: str | None = None,
    max_blocks: int | None = None,
    lora: str | None = None,
) -> list[bytes]:
    """The engine's own prefix-cache keys of the prompt's full blocks (engine/core/prefix_hash.py); lora: the
    adapter's cache key (engine/lora_request.py lora_cache_key)."""
    return prefix_hash.block_hashes(token_ids, block_size, salt, max_blocks, lora)


@dataclass(frozen=True)
class Rates:
    """Service rates per busy second of the engine, decayed over `window_s` of busy time: what a queue ahead of
    a new request drains at. Busy: time inside its steps, or all the time between two pushes when it had work
    at the first (output processing and streaming between steps delay a queue too, so rates per step time
    alone overstate how fast a queue drains). Zero: not measured yet."""

    prefill_tokens_per_s: float = 0.0
    decode_tokens_per_s: float = 0.0
    finished_per_s: float = 0.0
    steps_per_s: float = 0.0
    busy_s: float = 0.0
    prefill_tokens: float = 0.0
    decode_tokens: float = 0.0
    finished: float = 0.0
    steps: float = 0.0
    prompt_tokens: float = 0.0  # prefix-cache queries (prompt tokens scheduled), decayed like the rest
    missed_tokens: float = 0.0  # of those, not found in the prefix cache

    @property
    def prefill_drain_per_s(self) -> float:
        """What a queue of prompt tokens drains at: every token computed per busy second, prompt or sampled. A
        queued prompt's tokens share the steps' token budget with the running requests' decode tokens, and a
        step costs no more per token for taking more of them, so this is a floor; the prefill rate alone is
        what arrivals asked for, far below it on a replica that mostly decodes."""
        return self.prefill_tokens_per_s + self.decode_tokens_per_s

    @property
    def miss_ratio(self) -> float:
        """Share of queued prompt tokens that will really be computed (1 until measured)."""
        return self.missed_tokens / self.prompt_tokens if self.prompt_tokens > 0 else 1.0

    def update(self, prev: ReplicaStats, cur: ReplicaStats, window_s: float = 4.0) -> "Rates":
        busy = cur.busy_time_s - prev.busy_time_s
        if busy <= 0 or cur.busy_time_s < prev.busy_time_s:
            return self
        if prev.num_running + prev.num_waiting > 0 and cur.timestamp > prev.timestamp:
            busy = max(busy, cur.timestamp - prev.timestamp)  # had work throughout: the wall time between steps counts
        keep = math.exp(-busy / window_s)
        b = self.busy_s * keep + busy
        p = self.prefill_tokens * keep + max(0, cur.num_prefill_tokens - prev.num_prefill_tokens)
        d = self.decode_tokens * keep + max(0, cur.num_decode_tokens - prev.num_decode_tokens)
        f = self.finished * keep + max(0, cur.num_finished - prev.num_finished)
        n = self.steps * keep + max(0, cur.num_steps - prev.num_steps)
        q = max(0, cur.prefix_cache_queries - prev.prefix_cache_queries)
        m = max(0, q - max(0, cur.prefix_cache_hits - prev.prefix_cache_hits))
        return Rates(
            p / b, d / b, f / b, n / b, b, p, d, f, n, self.prompt_tokens * keep + q, self.missed_tokens * keep + m
        )

    def to_dict(self) -> dict[str, float]:
        return asdict(self)


def push_due(
    last: ReplicaStats | None,
    current: ReplicaStats,
    last_push_at: float,
    now: float,
    interval_s: float = 0.1,
    big_change: float = 0.1,
    idle_interval_s: float = 0.0,
) -> bool:
    """Replica-side push rule: every `interval_s`, or at once on a big change in KV pressure/queue; an idle
    replica whose stats have not moved since the last push, only every `idle_interval_s` (a heartbeat)."""
    if last is None:
        return True
    if now - last_push_at >= interval_s:
        return now - last_push_at >= idle_interval_s or not current.idle_since(last)
    if current.num_preemptions != last.num_preemptions:
        return True
    if abs(current.kv_pressure() - last.kv_pressure()) >= big_change:
        return True
    return current.num_waiting > 0 and last.num_waiting == 0
