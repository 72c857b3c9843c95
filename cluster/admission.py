"""Cluster-wide admission: per-replica KV watermarks with hysteresis over pushed replica stats, and (with
`max_queue_time_s`) a queue-time objective from the replicas' measured service rates.

One `AdmissionActor` per app (cluster/admission_actor.py) holds the cluster's source of truth; replicas
push stats and KV events to it every <= 100 ms. Each router keeps its own controller, refreshed in the
background from the actor (`restore(snapshot, now)`), and asks `decide(...)` locally per request: no remote
call on the request path. An admitted prompt is `reserve`d at once on the router, sent to the actor with
the next refresh and from then on counted there for every router, until the replica's stats include it
(cluster/reservations.py). Reservations carry the prompt's block keys: blocks on their way to a replica attract its prefix as if
cached. Admission commits a replica's room only up to its high watermark; with several routers, each commits
only within its lease of that headroom (cluster/leases.py), granted by the actor at every sync. Staleness is
measured by receipt time on the actor and carried as an age in snapshots, so clocks of different hosts never
get compared.
"""

import math
from dataclasses import asdict, dataclass, field
from typing import Any, Iterable, Sequence

from conveyor.cluster import placement
from conveyor.cluster.admission_config import AdmissionConfig
from conveyor.cluster.hot_blocks import HotBlocks
from conveyor.cluster.kv_index import KVIndex
from conveyor.cluster.queue_time import queue_time_s, retry_after_s
from conveyor.cluster.reservations import Reservation, ReservationBook, SettleRule
from conveyor.cluster.score import prefer_resident, replica_score
from conveyor.cluster.stats import Rates, ReplicaStats, num_blocks


@dataclass(frozen=True)
class Decision:
    admit: bool
    replicas: list[str] = field(default_factory=list)
    retry_after_s: float = 0.0
    reason: str = "ok"
    cached_blocks: dict[str, float] = field(default_factory=dict)  # per replica: credited_blocks
    queue_time_s: float = 0.0
    new_blocks: int = 0  # on replicas[0]: the prompt's blocks less those reserved there already


@dataclass
class ReplicaEntry:
    stats: ReplicaStats
    received_at: float
    saturated: bool
    rates: Rates = field(default_factory=Rates)
    shared_blocks: int = 0  # other processes' reservations, as the actor counts them (router side)
    shared_requests: int = 0
    shared_keys: frozenset = frozenset()
    shared_unseen_blocks: int = 0  # of shared_blocks, reserved after the replica's last stats


class AdmissionController:
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
        self._settle(stats.replica_id, now)
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

    def _settle(self, replica_id: str, now: float) -> None:
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
        entry, own, k = self.replicas[replica_id], self.book.own(replica_id), self.num_routers
        return (
            entry.shared_blocks + (1 if self.lease is not None else k) * sum(r.blocks for r in own),
            entry.shared_requests + k * sum(r.requests for r in own),
        )

    def lease_room(self, replica_id: str, now: float) -> int:
        """Blocks of its lease this router has not committed yet (0 once the lease has expired)."""
        lease = self.lease.get(replica_id, 0) if self.lease is not None and now <= self.lease_until else 0
        return lease - sum(r.blocks for r in self.book.own(replica_id))

    def unseen_blocks(self, replica_id: str) -> int:
        """Reserved blocks newer than the replica's last stats, every router's (own ones once per router)."""
        e = self.replicas[replica_id]
        return e.shared_unseen_blocks + self.num_routers * sum(
            r.blocks for r in self.book.own(replica_id) if r.at > e.received_at
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
        With `shared` (for ranking, not admission): of this router's reservations only those newer than the
        replica's last stats count as queued prefill (older ones started or finished, as a rule, long before
        they settle), less the `shared` blocks the request shares with them (computed once for both).
        `extra_requests`: requests ahead of it that admission has not decided yet (their size unknown)."""
        e = self.replicas[replica_id]
        blocks, requests = self.reserved(replica_id)
        if shared is not None:
            blocks = self.unseen_blocks(replica_id) - shared
        tokens = max(0, blocks) * self.config.block_size
        wait = queue_time_s(e.stats, e.rates, requests + extra_requests, tokens, self.config.block_size)
        return wait * self.config.queue_time_safety

    def score(self, replica_id: str, keys: Sequence[bytes], cached: float | None) -> float:
        """The KV-aware router's score (cluster.routing), so the reserved replica is the one it picks; `cached`:
        its credited prefix blocks."""
        cfg, e = self.config, self.replicas[replica_id]
        affinity = (cached or 0) / len(keys) if keys else 0.0
        load = e.stats.num_running + e.stats.num_waiting + self.reserved(replica_id)[1]
        return replica_score(cfg, affinity, self.kv_demand(replica_id), load)

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
        self, replica_id: str, num_blocks: int, now: float, requests: int = 1, keys: Sequence[bytes] = ()
    ) -> None:
        """Charge an admitted request to a replica until stats that can include it arrive."""
        if replica_id in self.replicas:
            self.book.add(Reservation(replica_id, now, num_blocks, requests, tuple(keys)))
            self._settle(replica_id, now)
            self.hot.record(replica_id, keys, now)

    def decide(
        self,
        num_prompt_blocks: int,
        now: float,
        largest_blocks: int | None = None,
        keys: Sequence[bytes] = (),
        output_tokens: int = 0,
        num_seqs: int = 1,
        lora: str | None = None,
    ) -> Decision:
        """`lora`: the LoRA adapter it runs with (replicas reporting it resident rank first, score.prefer_resident).
        `num_prompt_blocks`: the whole request's prompt blocks; `largest_blocks`: its largest single
        sequence (defaults to the whole), which alone decides `prompt_too_large`; `keys`: the prompt's block
        keys, for the ranking; `output_tokens`: each of its `num_seqs` sequences' max_tokens, charged as
        its likely output (output_blocks).
        Admitted: the replicas with room, best first (the KV-aware router's score); with `max_queue_time_s`,
        only those whose queue time is within it, else a refusal `queue_time` whose Retry-After is when the
        shortest queue is due to be back within it."""
        retry = self.config.retry_after_s
        if not self.replicas:
            return Decision(False, [], retry, "no_replicas")
        capacity = max(e.stats.kv_blocks_total for e in self.replicas.values())
        if (num_prompt_blocks if largest_blocks is None else largest_blocks) > capacity:
            return Decision(False, [], 0.0, "prompt_too_large")
        fresh = [rid for rid, e in self.replicas.items() if self.fresh(e, now)]
        if not fresh:
            return Decision(False, [], retry, "stale")
        open_ = [rid for rid in fresh if not self.replicas[rid].saturated]
        if not open_:
            return Decision(False, [], retry, "saturated")
        cached = {rid: c for rid in open_ if (c := self.cached_blocks(rid, keys)) is not None}
        need = {
            rid: max(0, num_prompt_blocks - cached.get(rid, self.shared_blocks(rid, keys)))
            + self.output_blocks(rid, output_tokens, num_seqs)
            for rid in open_
        }
        fits = [rid for rid in open_ if self.fits(rid, need[rid])]
        if not fits:
            return Decision(False, [], retry, "no_room")
        if self.lease is not None:
            leased = [
                rid
                for rid in fits
                if self.fits(rid, need[rid], self.lease_room(rid, now)) or need[rid] > self.even_share(rid)
            ]
            if not leased:
                return Decision(False, [], retry, "lease", new_blocks=min(need[rid] for rid in fits))
            fits = leased
        wait = {rid: self.queue_time(rid) for rid in fits}
        limit = self.config.max_queue_time_s
        if limit > 0:
            best = min(wait.values())
            fits = [rid for rid in fits if wait[rid] <= limit]
            if not fits:
                return Decision(False, [], retry_after_s(best, limit, retry), "queue_time", queue_time_s=best)
        lower = {rid: self.kv.match_lower(rid, keys, c) for rid, c in cached.items() if rid in wait}
        fits = self.rank(fits, keys, num_prompt_blocks, cached, wait, now, lower)
        if lora is not None and self.config.lora_affinity:
            resident = {rid for rid in fits if lora in self.replicas[rid].stats.lora_adapters}
            load = {rid: self.replicas[rid].stats.num_running + self.replicas[rid].stats.num_waiting for rid in fits}
            fits = prefer_resident(fits, resident, {rid: n + self.reserved(rid)[1] for rid, n in load.items()})
        credit = {r: self.credited_blocks(r, c, lower[r]) for r, c in cached.items() if r in wait}
        return Decision(True, fits, 0.0, "ok", credit, wait[fits[0]], need[fits[0]])

    def rank(
        self,
        rids: list[str],
        keys: Sequence[bytes],
        prompt_blocks: int,
        cached: dict[str, int],
        wait: dict[str, float],
        now: float,
        lower: dict[str, int] | None = None,
    ) -> list[str]:
        """Best first: by expected TTFT (cluster.placement) once some replica's prefill rate is measured, else
        by the KV-aware router's score. One pooled rate for all: replicas of one deployment run one model, and
        their own rates differ mostly by how much of their busy time went to decoding."""
        lower = lower or {}
        measured = [self.replicas[rid].rates for rid in rids]
        busy = sum(r.busy_s for r in measured if r.prefill_tokens > 0)
        if not self.config.placement or busy <= 0:

            def credit(rid: str) -> float | None:
                c = cached.get(rid)
                return None if c is None else self.credited_blocks(rid, c, lower.get(rid, 0))

            return sorted(rids, key=lambda rid: (-self.score(rid, keys, credit(rid)), wait[rid], -self.room(rid), rid))
        rate = sum(r.prefill_tokens for r in measured if r.prefill_tokens > 0) / busy
        options = []
        for rid in rids:
            e = self.replicas[rid]
            options.append(
                placement.Option(
                    rid,
                    cached.get(rid, self.shared_blocks(rid, keys)),
                    self.queue_time(rid, self.shared_blocks(rid, keys)) / self.config.queue_time_safety,
                    rate,
                    self.hot.count(rid, now, keys),
                    e.stats.kv_blocks_total,
                    e.stats.num_running + e.stats.num_waiting + self.reserved(rid)[1],
                    lower.get(rid, 0),
                    self.load_cost(rid),
                )
            )
        return placement.rank(options, prompt_blocks, self.config.block_size, self.config.hot_fraction)

    def snapshot(self, now: float) -> dict[str, Any]:
        rows = []
        for rid, e in sorted(self.replicas.items()):
            blocks, requests = self.reserved(rid)
            wait = self.queue_time(rid)
            rows.append(
                {
                    **e.stats.to_dict(),
                    "age_s": max(0.0, now - e.received_at),
                    "saturated": e.saturated,
                    "fresh": self.fresh(e, now),
                    "admitting": self.open(e, now),
                    "room_blocks": self.room(rid),
                    "kv_pressure": self.kv_pressure(e.stats, e.rates),
                    "reserved_blocks": blocks,
                    "reserved_requests": requests,
                    "rates": e.rates.to_dict(),
                    "unseen_reserved_blocks": self.unseen_blocks(rid),
                    "queue_time_s": wait if math.isfinite(wait) else -1.0,
                    "kv_index_reported": self.kv.reported(rid),
                    "kv_index_blocks": self.kv.size(rid),
                }
            )
        total = sum(r["kv_blocks_total"] for r in rows)
        free = sum(r["kv_blocks_free"] for r in rows)
        queries = sum(r["prefix_cache_queries"] for r in rows)
        hits = sum(r["prefix_cache_hits"] for r in rows)
        return {
            "config": asdict(self.config),
            "replicas": rows,
            "totals": {
                "replicas": len(rows),
                "admitting": sum(r["admitting"] for r in rows),
                "saturated": sum(r["saturated"] for r in rows),
                "stale": sum(not r["fresh"] for r in rows),
                "kv_blocks_total": total,
                "kv_blocks_free": free,
                "kv_cache_utilization": (total - free) / total if total else 0.0,
                "num_running": sum(r["num_running"] for r in rows),
                "num_waiting": sum(r["num_waiting"] for r in rows),
                "num_preemptions": sum(r["num_preemptions"] for r in rows),
                "prefix_cache_queries": queries,
                "prefix_cache_hits": hits,
                "prefix_cache_hit_rate": hits / queries if queries else 0.0,
            },
        }

    def kv_snapshot(self, since: int | None) -> dict[str, Any]:
        """The KV index's changes since version `since`, and each replica's reserved block keys."""
        return {
            "changes": self.kv.changes(since),
            "pending": {rid: sorted(self.pending_keys(rid)) for rid in self.replicas},
        }

    def restore(self, snapshot: dict[str, Any], now: float, asked_at: float | None = None) -> None:
        """Replace config and state with an actor snapshot; ages are re-based onto this process's clock.
        The snapshot's reservations become shared ones (they include this process's in-flight ones); own
        reservations not sent yet are kept. A snapshot's "kv" part (`kv_snapshot`) updates the KV index, its
        "lease" replaces this router's lease, valid `lease_s` from `asked_at` (before the actor granted it)."""
        self.config = AdmissionConfig(**snapshot["config"])
        self.hot.window_s = self.config.hot_window_s
        kv = snapshot.get("kv") or {}
        pending = kv.get("pending", {})
        self.replicas = {
            r["replica_id"]: ReplicaEntry(
                ReplicaStats.from_dict(r),
                now - r["age_s"],
                r["saturated"],
                Rates(**r.get("rates", {})),
                r.get("reserved_blocks", 0),
                r.get("reserved_requests", 0),
                frozenset(pending.get(r["replica_id"], ())),
                r.get("unseen_reserved_blocks", 0),
            )
            for r in snapshot["replicas"]
        }
        self.book.shared()
        self.num_routers = max(1, int(snapshot.get("routers", 1)))
        self.lease = snapshot.get("lease")
        self.lease_until = (now if asked_at is None else asked_at) + self.config.lease_s
        self.synced_at = now
        if "changes" in kv:
            self.kv.load(kv["changes"])
        for rid in list(self.book.held):
            self._settle(rid, now)

    @classmethod
    def from_snapshot(cls, snapshot: dict[str, Any], now: float) -> "AdmissionController":
        controller = cls()
        controller.restore(snapshot, now)
        return controller
