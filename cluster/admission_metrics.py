"""The admission snapshot (AdmissionController.snapshot) in Prometheus' text format, appended to /metrics."""

from typing import Any


def prometheus_text(snapshot: dict[str, Any], prefix: str = "conveyor", roles: dict[str, Any] | None = None) -> str:
    """Prometheus exposition of a snapshot, to append to the app's /metrics. `roles`: a disaggregated app's
    snapshot per role ({"prefill": ..., "decode": ...}) instead of `snapshot`; each series then carries `role`."""
    views = list(roles.items()) if roles else [(None, snapshot)]

    def labels(role: str | None, **more: str) -> str:
        pairs = ({"role": role} if role is not None else {}) | more
        return "{" + ",".join(f'{k}="{v}"' for k, v in pairs.items()) + "}" if pairs else ""

    lines: list[str] = []
    per_replica = [
        ("kv_cache_utilization", "kv_cache_utilization"),
        ("kv_pressure", "kv_pressure"),
        ("kv_blocks_free", "kv_blocks_free"),
        ("num_running", "running_requests"),
        ("num_waiting", "waiting_requests"),
        ("num_preemptions", "preemptions"),
        ("saturated", "saturated"),
        ("admitting", "admitting"),
        ("age_s", "stats_age_seconds"),
    ]
    for key, name in per_replica:
        lines.append(f"# TYPE {prefix}_replica_{name} gauge")
        for role, snap in views:
            for r in snap["replicas"]:
                lines.append(f"{prefix}_replica_{name}{labels(role, replica=r['replica_id'])} {float(r[key])}")
    lines.append(f"# TYPE {prefix}_replica_node gauge")  # 1 per replica: its Ray node, to join on `replica`
    for role, snap in views:
        for r in snap["replicas"]:
            node = labels(role, replica=r["replica_id"], node_id=r.get("node_id", ""), node_ip=r.get("node_ip", ""))
            lines.append(f"{prefix}_replica_node{node} 1.0")
    for key in views[0][1]["totals"]:
        lines.append(f"# TYPE {prefix}_cluster_{key} gauge")
        for role, snap in views:
            if key in snap["totals"]:
                lines.append(f"{prefix}_cluster_{key}{labels(role)} {float(snap['totals'][key])}")
    return "\n".join(lines) + "\n"
