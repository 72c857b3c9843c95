"""The admission snapshot (AdmissionController.snapshot) in Prometheus' text format, appended to /metrics."""

from typing import Any


def prometheus_text(snapshot: dict[str, Any], prefix: str = "conveyor") -> str:
    """Prometheus exposition of a snapshot, to append to the app's /metrics."""
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
        for r in snapshot["replicas"]:
            lines.append(f'{prefix}_replica_{name}{{replica="{r["replica_id"]}"}} {float(r[key])}')
    lines.append(f"# TYPE {prefix}_replica_node gauge")  # 1 per replica: its Ray node, to join on `replica`
    for r in snapshot["replicas"]:
        node = f'node_id="{r.get("node_id", "")}",node_ip="{r.get("node_ip", "")}"'
        lines.append(f'{prefix}_replica_node{{replica="{r["replica_id"]}",{node}}} 1.0')
    for key, value in snapshot["totals"].items():
        lines.append(f"# TYPE {prefix}_cluster_{key} gauge")
        lines.append(f"{prefix}_cluster_{key} {float(value)}")
    return "\n".join(lines) + "\n"
