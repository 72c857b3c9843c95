from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

REPLICA_GAUGES = {
    "kv_cache_utilization": "Fraction of KV-cache blocks in use",
    "kv_blocks_free": "Free KV-cache blocks",
    "kv_blocks_total": "Total KV-cache blocks",
    "num_running": "Requests running in the engine",
    "num_waiting": "Requests waiting in the engine",
    "num_preemptions": "Preemptions so far",
}


class RouterMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("conveyor_requests", "HTTP requests by endpoint and status", ["endpoint", "status"],
                                registry=r)
        self.prompt_tokens = Counter("conveyor_prompt_tokens", "Prompt tokens admitted", registry=r)
        self.generation_tokens = Counter("conveyor_generation_tokens", "Tokens generated", registry=r)
        self.ttft = Histogram("conveyor_time_to_first_token_seconds", "Time to first token seen by the router",
                              buckets=(.005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10, 30), registry=r)
        self.latency = Histogram("conveyor_request_latency_seconds", "End-to-end request latency at the router",
                                 buckets=(.05, .1, .25, .5, 1, 2.5, 5, 10, 30, 60, 120), registry=r)
        self.admission = Counter("conveyor_admission_decisions", "Admission decisions by outcome and reason",
                                 ["admitted", "reason"], registry=r)
        self.queued = Gauge("conveyor_admission_queued", "Requests waiting for KV room at this router", registry=r)
        self.replica = {k: Gauge(f"conveyor_{k}", v, ["replica"], registry=r) for k, v in REPLICA_GAUGES.items()}

    def record_replica(self, replica: str, stats: dict[str, Any]) -> None:
        for k, g in self.replica.items():
            if k in stats:
                g.labels(replica=replica).set(stats[k])

    def render(self) -> bytes:
        return generate_latest(self.registry)
