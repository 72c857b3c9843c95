"""Faults against a real Ray Serve app on 127.0.0.1: a replica killed under load, the admission actor killed, a
tensor-parallel worker killed. Nothing hangs: every request completes or ends with an explicit error, Serve
replaces what died, and the block pools end whole."""

import os
import signal
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import pytest
import ray
from ray import serve

from tests.e2e.faults import ADMISSION, APP, eventually, fresh_replicas, join, pool_whole, start_requests, view
from tests.serve_app import TEMP_DIRS


def router_log() -> str:
    logs = Path(TEMP_DIRS[-1], "session_latest", "logs", "serve").glob("replica_faults_Router_*.log")
    return "".join(f.read_text(errors="replace") for f in logs)


def running_replicas(app: str) -> int:
    return serve.status().applications[app].deployments["LLMReplica"].replica_states.get("RUNNING", 0)


def replica_actor(replica_id: str) -> Any:
    for a in ray.util.list_named_actors(all_namespaces=True):
        if a["name"].startswith("SERVE_REPLICA::") and a["name"].endswith(replica_id):
            return ray.get_actor(a["name"], namespace=a["namespace"])
    raise LookupError(replica_id)


@pytest.mark.slow
def test_killed_replica_is_replaced_and_its_requests_end_with_an_error(cluster: SimpleNamespace) -> None:
    url, http = f"{cluster.url}/faults", cluster.http
    before = {r["replica_id"] for r in view(http)["replicas"]}
    reqs = start_requests(url, n_stream=6, n_plain=4, max_tokens=700)
    streams = [r for r in reqs if r.stream]
    for r in streams:
        assert r.started.wait(60), "a stream never started"
    on = {rid: [r for r in streams if r.replica == rid] for rid in before}
    victim = max(on, key=lambda rid: len(on[rid]))
    assert on[victim] and all(r.events and r.events[-1] != "DONE" for r in on[victim]), "victim's streams in flight"
    ray.kill(replica_actor(victim), no_restart=True)
    killed_at = time.time()
    served = []
    for i in range(6):
        r = http.post("/v1/completions", json={"prompt": f"after the kill {i}", "max_tokens": 4, "temperature": 0})
        assert r.status_code == 200, r.text
        served.append(r.headers["x-conveyor-replica"])
    assert victim not in served
    eventually(
        lambda: all(not r["fresh"] or r["replica_id"] != victim for r in view(http)["replicas"]),
        10,
        "admission stops trusting the dead replica",
    )
    stale = time.time() - killed_at
    eventually(
        lambda: victim not in {r["replica_id"] for r in view(http)["replicas"]},
        15,
        "admission forgets the dead replica",
    )
    dropped = time.time() - killed_at
    print(
        f"dead replica stale in admission after {stale:.2f}s, dropped {dropped:.2f}s after the kill "
        f"(staleness_s {ADMISSION['staleness_s']}, drop_after_s {ADMISSION['drop_after_s']})"
    )
    assert dropped <= ADMISSION["drop_after_s"] + 5
    join(reqs, 120)
    for r in reqs:
        assert r.transport_error is None, r.transport_error
        assert r.completed or r.errored, (r.stream, r.status, r.events[-3:] if r.stream else r.json)
        if r.stream:
            assert r.completed == (r.replica != victim), (r.replica, victim, r.events[-2:])
    assert sum(r.errored for r in reqs) >= len(on[victim])
    eventually(lambda: running_replicas("faults") == 2, 120, "Serve replaces the killed replica")
    eventually(
        lambda: fresh_replicas(http) == 2 and victim not in {r["replica_id"] for r in view(http)["replicas"]},
        60,
        "the new replica reports to admission",
    )
    eventually(lambda: pool_whole(http, 2), 30, "both block pools are whole")


@pytest.mark.slow
def test_killed_admission_actor_fails_open_and_comes_back(cluster: SimpleNamespace) -> None:
    http = cluster.http
    handle = serve.get_deployment_handle("LLMReplica", app_name="faults")
    actor = handle.admission.remote().result()
    old = actor._actor_id.hex()
    ray.kill(actor, no_restart=True)
    time.sleep(ADMISSION["staleness_s"] + 0.5)
    codes = []
    for i in range(8):
        r = http.post("/v1/completions", json={"prompt": f"no admission {i}", "max_tokens": 4, "temperature": 0})
        codes.append(r.status_code)
    assert codes == [200] * 8, codes
    eventually(
        lambda: "admitting without admission control" in router_log(),
        10,
        "the router's warning reaches its log file at once (Serve buffers the request path's logs)",
    )

    def back() -> bool:
        return handle.admission.remote().result()._actor_id.hex() != old and fresh_replicas(http) == 2

    took = eventually(back, 90, "Serve recreates the admission actor and both replicas report to it")
    print(f"admission actor back after {took:.1f}s")
    r = http.post("/v1/completions", json={"prompt": "admitted again", "max_tokens": 4, "temperature": 0})
    assert r.status_code == 200
    metrics = http.get("/metrics").text
    assert 'conveyor_admission_decisions_total{admitted="true",reason="fail_open"}' in metrics
    eventually(lambda: pool_whole(http, 2), 30, "both block pools are whole")


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_killed_tp_worker_makes_the_replica_unhealthy_and_it_is_replaced(cluster: SimpleNamespace) -> None:
    from conveyor.deployments.app import AppArgs, build_app

    args = AppArgs(**{**APP, "engine": {**APP["engine"], "tensor_parallel_size": 2}, "worker_num_cpus": 0.25})
    serve.run(build_app(args), name="tp", route_prefix="/tp")
    http = httpx.Client(base_url=f"{cluster.url}/tp", timeout=60)
    try:
        r = http.post("/v1/completions", json={"prompt": "tp", "max_tokens": 4, "temperature": 0})
        assert r.status_code == 200
        first = r.headers["x-conveyor-replica"]
        workers = [
            a
            for a in ray._private.state.actors().values()
            if a["ActorClassName"].endswith("Worker") and a["State"] == "ALIVE"
        ]
        assert len(workers) == 2, [a["ActorClassName"] for a in workers]
        os.kill(workers[1]["Pid"], signal.SIGKILL)
        killed = time.time()
        unhealthy = eventually(
            lambda: http.get("/health", timeout=15).status_code == 503, 60, "the replica reports itself unhealthy"
        )
        print(f"TP replica unhealthy {unhealthy:.1f}s after its worker was killed")

        def replaced() -> bool:
            r = http.post("/v1/completions", json={"prompt": "tp again", "max_tokens": 4, "temperature": 0}, timeout=30)
            return r.status_code == 200 and r.headers["x-conveyor-replica"] != first

        eventually(
            replaced, 480, "Serve replaces the replica whose TP worker died", every=2.0
        )  # a TP start: minutes here
        print(f"TP replica replaced {time.time() - killed:.1f}s after its worker was killed")
        assert running_replicas("tp") == 1
    finally:
        serve.delete("tp")
