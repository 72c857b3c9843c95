"""The controller's state as the admission actor hands it to routers: `snapshot` (stats, ages, reservations, totals)
and `kv_snapshot` (the KV index's changes and reserved keys) on the actor, `restore` on a router."""

import math
from dataclasses import asdict
from typing import Any

from conveyor.cluster.admission_config import AdmissionConfig
from conveyor.cluster.admission_controller import AdmissionController
from conveyor.cluster.replica_view import ReplicaEntry, ReplicaView
from conveyor.cluster.stats import Rates, ReplicaStats


def snapshot(view: ReplicaView, now: float) -> dict[str, Any]:
    rows = []
    for rid, e in sorted(view.replicas.items()):
        blocks, requests = view.reserved(rid)
        wait = view.queue_time(rid)
        rows.append(
            {
                **e.stats.to_dict(),
                "age_s": max(0.0, now - e.received_at),
                "saturated": e.saturated,
                "fresh": view.fresh(e, now),
                "admitting": view.open(e, now),
                "room_blocks": view.room(rid),
                "kv_pressure": view.kv_pressure(e.stats, e.rates),
                "reserved_blocks": blocks,
                "reserved_requests": requests,
                "rates": e.rates.to_dict(),
                "reserved_prefill_blocks": view.reserved_prefill(rid),
                "unseen_prefill_blocks": view.unseen_prefill(rid),
                "queue_time_s": wait if math.isfinite(wait) else -1.0,
                "kv_index_reported": view.kv.reported(rid),
                "kv_index_blocks": view.kv.size(rid),
            }
        )
    total = sum(r["kv_blocks_total"] for r in rows)
    free = sum(r["kv_blocks_free"] for r in rows)
    queries = sum(r["prefix_cache_queries"] for r in rows)
    hits = sum(r["prefix_cache_hits"] for r in rows)
    return {
        "config": asdict(view.config),
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


def kv_snapshot(view: ReplicaView, since: int | None) -> dict[str, Any]:
    """The KV index's changes since version `since`, and each replica's reserved block keys."""
    return {
        "changes": view.kv.changes(since),
        "pending": {rid: sorted(view.pending_keys(rid)) for rid in view.replicas},
    }


def restore(view: ReplicaView, snapshot: dict[str, Any], now: float, asked_at: float | None = None) -> None:
    """Replace config and state with an actor snapshot; ages are re-based onto this process's clock.
    The snapshot's reservations become shared ones (they include this process's in-flight ones); own
    reservations not sent yet are kept. A snapshot's "kv" part (`kv_snapshot`) updates the KV index, its
    "lease" replaces this router's lease, valid `lease_s` from `asked_at` (before the actor granted it)."""
    view.config = AdmissionConfig(**snapshot["config"])
    view.hot.window_s = view.config.hot_window_s
    kv = snapshot.get("kv") or {}
    pending = kv.get("pending", {})
    view.replicas = {
        r["replica_id"]: ReplicaEntry(
            ReplicaStats.from_dict(r),
            now - r["age_s"],
            r["saturated"],
            Rates(**r.get("rates", {})),
            r.get("reserved_blocks", 0),
            r.get("reserved_requests", 0),
            frozenset(pending.get(r["replica_id"], ())),
            r.get("reserved_prefill_blocks", 0),
            r.get("unseen_prefill_blocks", 0),
        )
        for r in snapshot["replicas"]
    }
    view.book.shared()
    view.num_routers = max(1, int(snapshot.get("routers", 1)))
    view.lease = snapshot.get("lease")
    view.lease_until = (now if asked_at is None else asked_at) + view.config.lease_s
    view.synced_at = now
    if "changes" in kv:
        view.kv.load(kv["changes"])
    for rid in list(view.book.held):
        view.settle(rid, now)


def from_snapshot(snapshot: dict[str, Any], now: float) -> AdmissionController:
    controller = AdmissionController()
    restore(controller, snapshot, now)
    return controller
