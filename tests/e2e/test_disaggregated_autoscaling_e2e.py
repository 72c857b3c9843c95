"""Per-role autoscaling of a disaggregated app over real Ray Serve: decode load (long outputs) makes Serve add a
decode replica on the decode replicas' KV demand, which then takes handoffs, while the prefill role, sized on
its queued prompt tokens, stays as it is."""

import time
from typing import Any, Callable, Iterator

import pytest
import ray
from ray import serve

from conveyor.cluster.routing import RoutingHint
from tests.load import Load
from tests.serve_app import App, serve_app

pytestmark = pytest.mark.slow

SCALING = {"min_replicas": 1, "max_replicas": 2, "look_back_period_s": 2, "metrics_interval_s": 0.5}
ARGS = {
    "model": "demo:tiny",
    "disaggregation": {
        "decode_engine": {"num_blocks": 32},
        "prefill_autoscaling": {**SCALING, "policy": {"target_waiting_tokens": 100000}},
        "decode_autoscaling": {
            **SCALING,
            "policy": {"target_kv_utilization": 0.5, "upscale_delay_s": 1, "downscale_delay_s": 600},
        },
    },
}


@pytest.fixture(scope="module")
def app() -> Iterator[App]:
    with serve_app(ARGS) as a:
        yield a


def running(role: str) -> int:
    return serve.status().applications["default"].deployments[f"LLM{role}"].replica_states.get("RUNNING", 0)


def eventually(check: Callable[[], Any], timeout: float, what: str) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if check():
            return
        time.sleep(0.25)
    raise AssertionError(f"not within {timeout}s: {what}")


def imports() -> dict[str, int]:
    """Handoffs each decode replica took in, by replica id (each addressed through the KV-aware router)."""
    names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if "#LLMDecode#" in a["name"]]
    h = serve.get_deployment_handle("LLMDecode", app_name="default")
    out = {}
    for rid in (n.rsplit("#", 1)[1] for n in names):
        s = h.handoff_stats.remote(routing_hint=RoutingHint(replicas=(rid,))).result()
        out[s["replica"]] = s["imports"]
    return out


def test_decode_kv_demand_adds_a_decode_replica_and_prefill_stays(app: App) -> None:
    assert running("Prefill") == running("Decode") == 1
    with Load(app.url, n=4, prompt_len=32, max_tokens=160) as load:
        eventually(lambda: running("Decode") == 2, 240, "a 2nd decode replica under KV demand")
        eventually(lambda: len(imports()) == 2 and min(imports().values()) > 0, 120, "the new one takes handoffs")
    assert load.codes.count(200) >= 1 and set(load.codes) <= {200, 429, 503}, load.codes
    assert running("Prefill") == 1, "the prefill role's queue stayed under its target"
    status = serve.status().applications["default"].deployments["LLMPrefill"]
    assert sum(status.replica_states.values()) == 1, status.replica_states  # none starting or pending either
