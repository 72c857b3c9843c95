"""Cluster-wide admission: per-replica KV watermarks with hysteresis over pushed replica stats.

One `AdmissionController` lives in the `AdmissionActor` (the cluster's source of truth); replicas
push stats to it (`report`) every <= 100 ms. Each router keeps its own controller, refreshed in
the background from `actor.snapshot()` through `restore(snapshot, now)`, and asks `decide(...)`
locally per request: no remote call on the request path. Staleness is measured by receipt time on
the actor and carried as an age in snapshots, so clocks of different hosts never get compared.
"""
from dataclasses import asdict, dataclass, field, replace
import time
from typing import Any, Callable, Iterable

from cluster.stats import BLOCK_SIZE, ReplicaStats

ADMISSION_ACTOR_NAME = "conveyor-admission"
ADMISSION_NAMESPACE = "conveyor"


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
    block_size: int = BLOCK_SIZE
    saturate_on_preemption: bool = True

    def __post_init__(self) -> None:
        assert 0.0 < self.low_watermark <= self.high_watermark, "need 0 < low <= high"
        assert 0.0 < self.staleness_s <= self.drop_after_s

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
        self._reserved: dict[str, int] = {}

    def update(self, stats: ReplicaStats, now: float) -> None:
        prev = self.replicas.get(stats.replica_id)
        if prev is not None and stats.timestamp < prev.stats.timestamp:
            return
        saturated = self.config.watermarks.saturated(
            prev.saturated if prev else False, stats.pressure(self.config.block_size))
        if self.config.saturate_on_preemption and prev and stats.num_preemptions > prev.stats.num_preemptions:
            saturated = True
        self.replicas[stats.replica_id] = ReplicaEntry(stats, now, saturated)
        self._reserved.pop(stats.replica_id, None)

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
        return entry.stats.room_blocks(self.config.block_size) - self._reserved.get(replica_id, 0)

    def reserve(self, replica_id: str, num_blocks: int) -> None:
        """Charge an admitted prompt to a replica until its next stats arrive (router-side)."""
        if replica_id in self.replicas:
            self._reserved[replica_id] = self._reserved.get(replica_id, 0) + num_blocks

    def decide(self, num_prompt_blocks: int, now: float) -> Decision:
        retry = self.config.retry_after_s
        if not self.replicas:
            return Decision(False, [], retry, "no_replicas")
        if num_prompt_blocks > max(e.stats.kv_blocks_total for e in self.replicas.values()):
            return Decision(False, [], 0.0, "prompt_too_large")
        fresh = [rid for rid, e in self.replicas.items() if self.fresh(e, now)]
        if not fresh:
            return Decision(False, [], retry, "stale")
        open_ = [rid for rid in fresh if not self.replicas[rid].saturated]
        if not open_:
            return Decision(False, [], retry, "saturated")
        fits = sorted((rid for rid in open_ if self.room(rid) >= num_prompt_blocks), key=self.room, reverse=True)
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
            },
        }

    def restore(self, snapshot: dict[str, Any], now: float) -> None:
        """Replace state with an actor snapshot; ages are re-based onto this process's clock."""
        self.replicas = {r["replica_id"]: ReplicaEntry(ReplicaStats.from_dict(r), now - r["age_s"], r["saturated"])
                         for r in snapshot["replicas"]}
        self._reserved = {}

    @classmethod
    def from_snapshot(cls, snapshot: dict[str, Any], now: float) -> "AdmissionController":
        controller = cls(AdmissionConfig(**snapshot["config"]))
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


class AdmissionActor:
    """Ray actor body (wrap with `ray.remote`, or use `admission_actor()`); plain class for tests."""

    def __init__(self, config: dict[str, Any] | None = None, clock: Callable[[], float] = time.time):
        self._clock = clock
        self.controller = AdmissionController(AdmissionConfig(**(config or {})))

    def report(self, stats: dict[str, Any]) -> None:
        now = self._clock()
        self.controller.update(ReplicaStats.from_dict(stats), now)
        self.controller.expire(now)

    def forget(self, replica_id: str) -> None:
        self.controller.forget(replica_id)

    def snapshot(self) -> dict[str, Any]:
        now = self._clock()
        self.controller.expire(now)
        return self.controller.snapshot(now)

    def configure(self, config: dict[str, Any]) -> None:
        self.controller.config = replace(self.controller.config, **config)


def admission_actor(app_name: str = "default", config: dict[str, Any] | None = None, detached: bool = True):
    """Get or create the app's admission actor by name (safe to call from every process, any order)."""
    import ray

    cls = ray.remote(num_cpus=0, max_restarts=-1)(AdmissionActor)
    options: dict[str, Any] = {"name": f"{ADMISSION_ACTOR_NAME}:{app_name}", "namespace": ADMISSION_NAMESPACE,
                               "get_if_exists": True}
    if detached:
        options["lifetime"] = "detached"
    return cls.options(**options).remote(config)
