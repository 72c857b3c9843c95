"""The admission controller's view of each replica: its pushed stats and measured rates, whether it is saturated
(KV watermarks with hysteresis) or stale, the reservations its stats cannot include yet (cluster/reservations.py),
this router's lease of its headroom (cluster/leases.py), and from them the blocks admission may still commit there
and the wait a request sent there now would see (cluster/queue_time.py).
"""

import math
from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence

from conveyor.cluster.admission_config import AdmissionConfig
from conveyor.cluster.hot_blocks import HotBlocks
from conveyor.cluster.kv_index import KVIndex
from conveyor.cluster.queue_time import queue_time_s
from conveyor.cluster.reservations import Reservation, ReservationBook, SettleRule
from conveyor.cluster.stats import Rates, ReplicaStats, num_blocks


@dataclass
class ReplicaEntry:
    stats: ReplicaStats
    received_at: float
    saturated: bool
    rates: Rates = field(default_factory=Rates)
    shared_blocks: int = 0  # other processes' reservations, as the actor counts them (router side)
    shared_requests: int = 0
    shared_keys: frozenset = frozenset()
    shared_prefill_blocks: int = 0  # of shared_blocks, prompt blocks to compute (Reservation.prefill_blocks)
    shared_unseen_prefill_blocks: int = 0  # of those, reserved after the replica's last stats


class ReplicaView:
    def __init__(self, config: AdmissionConfig | None = None):
        self.config = config or AdmissionConfig()
        self.replicas: dict[str, ReplicaEntry] = {}
        self.book = ReservationBook()
        self.num_routers = 1  # routers syncing with the actor, as its last snapshot said (router side)
        self.lease: dict[str, int] | None = None  # blocks this router may commit per replica (router side)
        self.lease_until = float("-inf")
        self.synced_at: float | None = None  # router side: when the last snapshot was restored
        self.kv = KVIndex()
        self.hot = HotBlocks(self.config.hot_window_s)

    def update(self, stats: ReplicaStats, now: float, kv_events: dict[str, Any] | None = None) -> bool:
        """Takes a stats push (and its KV events); True when the replica must list its KV keys (reset)."""
        prev = self.replicas.get(stats.replica_id)
        if prev is not None and stats.timestamp < prev.stats.timestamp:
            return False
        rates = prev.rates.update(prev.stats, stats, self.config.rate_window_s) if prev else Rates()
        saturated = self.config.watermarks.saturated(prev.saturated if prev else False, self.kv_pressure(stats, rates))
        if self.config.saturate_on_preemption and prev and stats.num_preemptions > prev.stats.num_preemptions:
            saturated = True
        self.replicas[stats.replica_id] = ReplicaEntry(stats, now, saturated, rates)
        if prev is not None and stats.num_added is not None and prev.stats.num_added is not None:
            self.book.count_arrivals(
                stats.replica_id, stats.num_added - prev.stats.num_added, now, self.config.arrival_credit_s
            )
        self.settle(stats.replica_id, now)
        if kv_events is None:
            return False
        return self.kv.apply(
            stats.replica_id,
            kv_events.get("stored", ()),
            kv_events.get("evicted", ()),
            bool(kv_events.get("reset")),
            kv_events.get("offloaded", ()),
        )

    @staticmethod
    def kv_pressure(stats: ReplicaStats, rates: Rates) -> float:
        """What the watermarks compare, exported as `kv_pressure`: the replica's, at its measured prefix-cache
        misses."""
        return stats.kv_pressure(rates.miss_ratio)

    def settle(self, replica_id: str, now: float) -> None:
        """Drop reservations the replica's stats already include (cluster.reservations)."""
        entry = self.replicas.get(replica_id)
        if entry is None:
            self.book.forget(replica_id)
            return
        cfg = self.config
        self.book.settle(
            replica_id,
            entry.received_at,
            entry.stats.num_added is not None,
            now,
            SettleRule(cfg.settle_s, cfg.settle_max_s, cfg.arrival_credit_s),
        )

    def forget(self, replica_id: str) -> None:
        self.replicas.pop(replica_id, None)
        self.book.forget(replica_id)
        self.kv.forget(replica_id)
        self.hot.forget(replica_id)

    def retain(self, replica_ids: Iterable[str]) -> None:
        keep = set(replica_ids)
        for rid in [r for r in self.replicas if r not in keep]:
            self.forget(rid)

    def expire(self, now: float) -> list[str]:
        dead = [rid for rid, e in self.replicas.items() if now - e.received_at > self.config.drop_after_s]
        for rid in dead:
            self.forget(rid)
        return dead

    def fresh(self, entry: ReplicaEntry, now: float) -> bool:
        """The replica reported within staleness_s of the last look at it: on the actor, now; on a router, its
        last sync, so that a router whose own loop lags behind a burst does not take its lag for the replicas'
        silence (its reservations keep its view conservative meanwhile; past drop_after_s nothing is fresh)."""
        at = now if self.synced_at is None else min(now, self.synced_at)
        return at - entry.received_at <= self.config.staleness_s and now - entry.received_at <= self.config.drop_after_s

    def open(self, entry: ReplicaEntry, now: float) -> bool:
        return self.fresh(entry, now) and not entry.saturated

    def reserved(self, replica_id: str) -> tuple[int, int]:
        """(blocks, requests) admitted to the replica that its stats cannot include yet, every router's.
        Own reservations the actor has not shared yet count once per router (blocks: unless this router holds a
        lease, which bounds the others): until the next refresh each of the others may be admitting as much."""
        entry, own = self.replicas[replica_id], self.book.own(replica_id)
        return (
            entry.shared_blocks + self._own_block_copies() * sum(r.blocks for r in own),
            entry.shared_requests + self.num_routers * sum(r.requests for r in own),
        )

    def _own_block_copies(self) -> int:
        """How many times `reserved` counts an own reservation's blocks: once under a lease, else once per router."""
        return 1 if self.lease is not None else self.num_routers

    def lease_room(self, replica_id: str, now: float) -> int:
        """Blocks of its lease this router has not committed yet (0 once the lease has expired)."""
        lease = self.lease.get(replica_id, 0) if self.lease is not None and now <= self.lease_until else 0
        return lease - sum(r.blocks for r in self.book.own(replica_id))

    def reserved_prefill(self, replica_id: str) -> int:
        """Of `reserved` blocks, the prompt blocks the replica will compute (counted as `reserved` counts blocks)."""
        entry, own = self.replicas[replica_id], self.book.own(replica_id)
        return entry.shared_prefill_blocks + self._own_block_copies() * sum(r.prefill_blocks for r in own)

    def unseen_prefill(self, replica_id: str) -> int:
        """Of those, the ones reserved after the replica's last stats, every router's (own ones once per router)."""
        e = self.replicas[replica_id]
        return e.shared_unseen_prefill_blocks + self.num_routers * sum(
            r.prefill_blocks for r in self.book.own(replica_id) if r.at > e.received_at
        )

    def room(self, replica_id: str) -> int:
        """The cache less the replica's KV demand (EngineStats.demand_blocks, at its measured prefix-cache misses)
        and the reservations its stats cannot include yet."""
        e = self.replicas[replica_id]
        return e.stats.kv_blocks_total - e.stats.demand_blocks(e.rates.miss_ratio) - self.reserved(replica_id)[0]

    def output_blocks(self, replica_id: str, max_tokens: int, num_seqs: int = 1) -> int:
        """The blocks a request's outputs are charged on the replica: each sequence's likely length there (the
        quantile of its recent outputs, or its prior while cold: engine.output_lengths), at most max_tokens;
        max_tokens from a replica that does not report one."""
        likely = self.replicas[replica_id].stats.likely_output_tokens
        return num_seqs * num_blocks(min(max_tokens, likely) if likely else max_tokens, self.config.block_size)

    def reserve_blocks(self, replica_id: str) -> int:
        """Blocks kept free above the high watermark: admission commits a replica's room only up to it."""
        total = self.replicas[replica_id].stats.kv_blocks_total
        return math.ceil(round((1.0 - self.config.high_watermark) * total, 6))

    def capacity(self, replica_id: str) -> int:
        """An idle replica's headroom: its cache up to the high watermark."""
        return self.replicas[replica_id].stats.kv_blocks_total - self.reserve_blocks(replica_id)

    def headroom(self, replica_id: str) -> int:
        """Blocks admission may still commit before the replica's demand passes its high watermark."""
        return self.room(replica_id) - self.reserve_blocks(replica_id)

    def fits(self, replica_id: str, need: int, headroom: int | None = None) -> bool:
        """The request keeps demand within the high watermark (or within `headroom`, a lease); on an idle replica,
        any request that fits its cache."""
        cap = self.capacity(replica_id)
        return (self.headroom(replica_id) if headroom is None else headroom) >= min(need, cap)

    def even_share(self, replica_id: str) -> int:
        """An idle replica's headroom split evenly among the routers: a larger request cannot wait for a lease
        (it might never get one), so it is decided on this router's own view."""
        return self.capacity(replica_id) // self.num_routers

    def pending_keys(self, replica_id: str) -> set[bytes]:
        keys = set(self.replicas[replica_id].shared_keys)
        for r in self.book.own(replica_id):
            keys.update(r.keys)
        return keys

    def shared_blocks(self, replica_id: str, keys: Sequence[bytes]) -> int:
        """Leading blocks of a prompt that requests reserved on the replica bring anyway: in use when it runs,
        shared, costing no new block (a cached but idle block does cost one: it leaves the free pool)."""
        pending = self.pending_keys(replica_id) if keys else ()
        return next((i for i, k in enumerate(keys) if k not in pending), len(keys))

    def cached_blocks(self, replica_id: str, keys: Sequence[bytes]) -> int | None:
        """Leading blocks of a prompt the replica holds or is about to (reservations); None: not reported."""
        if not self.kv.reported(replica_id):
            return None
        return self.kv.match(replica_id, keys, self.pending_keys(replica_id))

    def load_cost(self, replica_id: str) -> float:
        """A lower-tier block's load time over its prefill time, as the replica measured it (0..1)."""
        return min(1.0, max(0.0, self.replicas[replica_id].stats.kv_tier_load_cost))

    def credited_blocks(self, replica_id: str, cached: int, lower: int) -> float:
        """Leading prompt blocks the replica spares a prefill: `cached` in its pool, and `lower` after them in a
        lower tier, each worth what its load saves (1 - load_cost)."""
        return cached + lower * (1.0 - self.load_cost(replica_id)) if lower else float(cached)

    def queue_time(self, replica_id: str, shared: int | None = None, extra_requests: int = 0) -> float:
        """Estimated wait before a request sent now starts there (cluster.queue_time) x queue_time_safety.
        Reservations queue their prompt blocks as prefill (their output blocks come later, one token a step).
        With `shared` (for ranking, not admission): only reservations newer than the replica's last stats count
        (older ones started or finished, as a rule, long before they settle), less the `shared` blocks the
        request shares with them (computed once for both).
        `extra_requests`: requests ahead of it that admission has not decided yet (their size unknown)."""
        e = self.replicas[replica_id]
        requests = self.reserved(replica_id)[1]
        blocks = self.reserved_prefill(replica_id) if shared is None else self.unseen_prefill(replica_id) - shared
        tokens = max(0, blocks) * self.config.block_size
        wait = queue_time_s(e.stats, e.rates, requests + extra_requests, tokens, self.config.block_size)
        return wait * self.config.queue_time_safety

    def idle(self) -> bool:
        """No replica runs or queues a request, and no reservation is outstanding."""
        return all(e.stats.idle and not self.reserved(rid)[1] for rid, e in self.replicas.items())

    def kv_demand(self, replica_id: str) -> float:
        """The replica's KV demand over its cache as `room` counts it: with reservations, for routing."""
        total = self.replicas[replica_id].stats.kv_blocks_total
        return 1.0 - self.room(replica_id) / total if total else 1.0

    def kv_demands(self, now: float) -> dict[str, float]:
        return {rid: self.kv_demand(rid) for rid, e in self.replicas.items() if self.fresh(e, now)}

    def reserve(
        self,
        replica_id: str,
        num_blocks: int,
        now: float,
        requests: int = 1,
        keys: Sequence[bytes] = (),
        prefill_blocks: int | None = None,
    ) -> Reservation | None:
        """Charge an admitted request to a replica until stats that can include it arrive; `prefill_blocks`: of
        `num_blocks`, the prompt blocks to compute (all of them unless given)."""
        if replica_id not in self.replicas:
            return None
        prefill = num_blocks if prefill_blocks is None else min(prefill_blocks, num_blocks)
        r = Reservation(replica_id, now, num_blocks, requests, tuple(keys), prefill)
        self.book.add(r)
        self.settle(replica_id, now)
        self.hot.record(replica_id, keys, now)
        return r
