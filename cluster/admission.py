"""Cluster-wide admission: per-replica KV watermarks with hysteresis over pushed replica stats.

One `AdmissionActor` per app (cluster/admission_actor.py) holds the cluster's source of truth; replicas
push stats to it every <= 100 ms. Each router keeps its own controller, refreshed in the background
from `actor.snapshot()` through `restore(snapshot, now)`, and asks `decide(...)` locally per request:
no remote call on the request path. Admitted prompts are `reserve`d on the router until stats received `settle_s` later can reflect
them. Staleness is measured by receipt time on the actor and carried as an age in snapshots, so clocks
of different hosts never get compared.
"""
from dataclasses import asdict, dataclass, field
from typing import Any, Iterable

from cluster.stats import BLOCK_SIZE, ReplicaStats

@dataclass(frozen=True)
class Watermarks:
    high: float = 0.90
    low: float = 0.75

    def saturated(self, was_saturated: bool, pressure: float) -> bool:
        """Stop above `high`; once stopped, resume only below `low`."""
        return pressure >= self.low if was_saturated else pressure > self.high


@dataclass(frozen=True)
class AdmissionConfig:
    high_watermark: float = 0.90
    low_watermark: float = 0.75
    staleness_s: float = 0.5
    drop_after_s: float = 10.0
    retry_after_s: float = 1.0
    settle_s: float = 0.3
    queue_timeout_s: float = 0.0
    max_queued: int = 0
    block_size: int = BLOCK_SIZE
    saturate_on_preemption: bool = True

    def __post_init__(self) -> None:
        assert 0.0 < self.low_watermark <= self.high_watermark, "need 0 < low <= high"
        assert 0.0 < self.staleness_s <= self.drop_after_s, "need 0 < staleness_s <= drop_after_s"
        assert self.settle_s >= 0.0 and self.retry_after_s >= 0.0 and self.block_size >= 1
        assert self.queue_timeout_s >= 0.0 and self.max_queued >= 0, "queue_timeout_s, max_queued must be >= 0"

    @property
    def watermarks(self) -> Watermarks:
        return Watermarks(self.high_watermark, self.low_watermark)


@dataclass(frozen=True)
class Decision:
    admit: bool
    replicas: list[str] = field(default_factory=list)
    retry_after_s: float = 0.0
    reason: str = "ok"


@dataclass
class ReplicaEntry:
    stats: ReplicaStats
    received_at: float
    saturated: bool


class AdmissionController:
    def __init__(self, config: AdmissionConfig | None = None):
        self.config = config or AdmissionConfig()
        self.replicas: dict[str, ReplicaEntry] = {}
        self._reserved: dict[str, list[tuple[float, int]]] = {}

    def update(self, stats: ReplicaStats, now: float) -> None:
        prev = self.replicas.get(stats.replica_id)
        if prev is not None and stats.timestamp < prev.stats.timestamp:
            return
        saturated = self.config.watermarks.saturated(
            prev.saturated if prev else False, stats.pressure(self.config.block_size))
        if self.config.saturate_on_preemption and prev and stats.num_preemptions > prev.stats.num_preemptions:
            saturated = True
        self.replicas[stats.replica_id] = ReplicaEntry(stats, now, saturated)
        self._settle(stats.replica_id)

    def _settle(self, replica_id: str) -> None:
        """Drop reservations that stats received at least `settle_s` after them already include."""
        entry = self.replicas.get(replica_id)
        left = [(t, n) for t, n in self._reserved.get(replica_id, ())
                if entry is not None and entry.received_at < t + self.config.settle_s]
        if left:
            self._reserved[replica_id] = left
        else:
            self._reserved.pop(replica_id, None)

    def forget(self, replica_id: str) -> None:
        self.replicas.pop(replica_id, None)
        self._reserved.pop(replica_id, None)

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
        return now - entry.received_at <= self.config.staleness_s

    def open(self, entry: ReplicaEntry, now: float) -> bool:
        return self.fresh(entry, now) and not entry.saturated

    def room(self, replica_id: str) -> int:
        entry = self.replicas[replica_id]
        reserved = sum(n for _, n in self._reserved.get(replica_id, ()))
        return entry.stats.room_blocks(self.config.block_size) - reserved

    def pressure(self, replica_id: str) -> float:
        """KV demand / capacity, counting this controller's reservations."""
        total = self.replicas[replica_id].stats.kv_blocks_total
        return 1.0 - self.room(replica_id) / total if total else 1.0

    def pressures(self, now: float) -> dict[str, float]:
        return {rid: self.pressure(rid) for rid, e in self.replicas.items() if self.fresh(e, now)}

    def reserve(self, replica_id: str, num_blocks: int, now: float) -> None:
        """Charge an admitted prompt to a replica until stats that can include it arrive (router-side)."""
        if replica_id in self.replicas:
            self._reserved.setdefault(replica_id, []).append((now, num_blocks))

    def decide(self, num_prompt_blocks: int, now: float, largest_blocks: int | None = None) -> Decision:
        """`num_prompt_blocks`: the whole request's prompt blocks; `largest_blocks`: its largest single
        sequence (defaults to the whole), which alone decides `prompt_too_large`."""
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
        fits = sorted((rid for rid in open_
                       if self.room(rid) >= min(num_prompt_blocks, self.replicas[rid].stats.kv_blocks_total)),
                      key=self.room, reverse=True)
        if not fits:
            return Decision(False, [], retry, "no_room")
        return Decision(True, fits, 0.0, "ok")

    def snapshot(self, now: float) -> dict[str, Any]:
        rows = []
        for rid, e in sorted(self.replicas.items()):
            rows.append({**e.stats.to_dict(), "age_s": max(0.0, now - e.received_at),
                         "saturated": e.saturated, "fresh": self.fresh(e, now), "admitting": self.open(e, now),
                         "room_blocks": self.room(rid), "pressure": e.stats.pressure(self.config.block_size)})
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

    def restore(self, snapshot: dict[str, Any], now: float) -> None:
        """Replace config and state with an actor snapshot; ages are re-based onto this process's clock.
        Own reservations the snapshot cannot include yet are kept."""
        self.config = AdmissionConfig(**snapshot["config"])
        self.replicas = {r["replica_id"]: ReplicaEntry(ReplicaStats.from_dict(r), now - r["age_s"], r["saturated"])
                         for r in snapshot["replicas"]}
        for rid in list(self._reserved):
            self._settle(rid)

    @classmethod
    def from_snapshot(cls, snapshot: dict[str, Any], now: float) -> "AdmissionController":
        controller = cls()
        controller.restore(snapshot, now)
        return controller


def prometheus_text(snapshot: dict[str, Any], prefix: str = "conveyor") -> str:
    """Prometheus exposition of a snapshot, to append to the app's /metrics."""
    lines: list[str] = []
    per_replica = [("kv_cache_utilization", "kv_cache_utilization"), ("pressure", "kv_pressure"),
                   ("kv_blocks_free", "kv_blocks_free"), ("num_running", "running_requests"),
                   ("num_waiting", "waiting_requests"), ("num_preemptions", "preemptions"),
                   ("saturated", "saturated"), ("admitting", "admitting"), ("age_s", "stats_age_seconds")]
    for key, name in per_replica:
        lines.append(f"# TYPE {prefix}_replica_{name} gauge")
        for r in snapshot["replicas"]:
            lines.append(f'{prefix}_replica_{name}{{replica="{r["replica_id"]}"}} {float(r[key])}')
    for key, value in snapshot["totals"].items():
        lines.append(f"# TYPE {prefix}_cluster_{key} gauge")
        lines.append(f"{prefix}_cluster_{key} {float(value)}")
    return "\n".join(lines) + "\n"
