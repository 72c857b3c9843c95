"""The cluster layer end to end over real Ray Serve on CPU: admission under a burst (429s, then a wait
queue), KV autoscaling 1 -> 2 -> 1, prefix affinity of the KV-aware router against Ray's power-of-two
router, two router replicas under a queue-time objective. One Ray cluster for the module; each test
deploys its own apps and deletes them."""

import asyncio
import random
import time
from types import SimpleNamespace
from typing import Any, Callable, Iterator

import httpx
import pytest
import ray
from ray import serve

from tests.load import Load, tokens
from tests.serve_app import free_port, start_ray, stop_ray

pytestmark = pytest.mark.slow

ENGINE = dict(dtype="float32", max_num_seqs=8, max_num_batched_tokens=256, block_size=16, max_model_len=512)
APP = dict(replica_num_cpus=0.25, router_num_cpus=0.1, torch_threads=1)


@pytest.fixture(scope="module")
def cluster() -> Iterator[SimpleNamespace]:
    start_ray()
    port = free_port()
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        yield SimpleNamespace(url=f"http://127.0.0.1:{port}")
    finally:
        serve.shutdown()
        stop_ray()


def run_apps(**apps: dict[str, Any]) -> None:
    from conveyor.deployments.app import AppArgs, build_app

    serve.run_many(
        [
            serve.RunTarget(build_app(AppArgs(**{**APP, **args})), name=name, route_prefix=f"/{name}")
            for name, args in apps.items()
        ]
    )


def eventually(check: Callable[[], bool], timeout: float, what: str, every: float = 0.25) -> float:
    start = time.time()
    while time.time() - start < timeout:
        if check():
            return time.time() - start
        time.sleep(every)
    raise AssertionError(f"not within {timeout}s: {what}")


def running_replicas(app: str) -> int:
    return serve.status().applications[app].deployments["LLMReplica"].replica_states.get("RUNNING", 0)


def assert_burst(resps: list[httpx.Response], max_tokens: int, refusal: str) -> None:
    """Some admitted, some refused: every 200 complete, every refusal a 429 `refusal` with Retry-After."""
    codes = [r.status_code for r in resps]
    assert set(codes) <= {200, 429} and 200 in codes and 429 in codes, codes
    for r in resps:
        if r.status_code == 200:
            assert r.json()["usage"]["completion_tokens"] == max_tokens
        else:
            assert int(r.headers["retry-after"]) >= 1 and r.json()["error"]["code"] == refusal


def await_pools_whole(http: httpx.Client, blocks: int, replicas: int = 2) -> None:
    def whole() -> bool:
        snap = http.get("/v1/cluster").json()
        return len(snap["replicas"]) == replicas and all(
            r["num_running"] == r["num_waiting"] == 0 and r["kv_blocks_free"] == r["kv_blocks_total"] == blocks
            for r in snap["replicas"]
        )

    eventually(whole, 20, "every block pool is whole again")


async def post_all(url: str, bodies: list[dict]) -> list[httpx.Response]:
    limits = httpx.Limits(max_connections=len(bodies))
    async with httpx.AsyncClient(base_url=url, timeout=120, limits=limits) as client:
        return await asyncio.gather(*(client.post("/v1/completions", json=b) for b in bodies))


def test_burst_gets_429_or_waits_in_queue_and_every_admitted_request_completes(cluster: SimpleNamespace) -> None:
    run_apps(burst={"engine": {**ENGINE, "num_blocks": 24, "max_num_seqs": 4}, "num_replicas": 1})
    url, http = f"{cluster.url}/burst", httpx.Client(base_url=f"{cluster.url}/burst", timeout=60)
    try:
        rng = random.Random(0)
        bodies = [
            {"prompt": tokens(rng, 64), "max_tokens": 32, "ignore_eos": True, "temperature": 0} for _ in range(32)
        ]
        start = time.time()
        resps = asyncio.run(post_all(url, bodies))
        assert time.time() - start < 120
        codes = [r.status_code for r in resps]
        decisions = [m for m in http.get("/metrics").text.splitlines() if m.startswith("conveyor_admission_decisions")]
        assert set(codes) <= {200, 429} and 200 in codes and 429 in codes, (codes, decisions)
        for r in resps:
            if r.status_code == 200:
                assert r.json()["choices"][0]["finish_reason"] == "length"
                assert r.json()["usage"]["completion_tokens"] == 32
            else:
                assert int(r.headers["retry-after"]) >= 1
                err = r.json()["error"]
                assert err["type"] == "rate_limit_error" and err["code"] in ("saturated", "no_room")
        refused = [b for b, r in zip(bodies, resps) if r.status_code == 429]
        for body in refused[:3]:  # a refused request was not half-done: sent again later, it completes
            time.sleep(1)
            r = http.post("/v1/completions", json=body)
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 32
        replica = serve.get_deployment_handle("LLMReplica", app_name="burst")

        def idle() -> bool:
            s = replica.stats.remote().result()
            return s["num_running"] == s["num_waiting"] == 0 and s["kv_blocks_free"] == s["kv_blocks_total"] == 24

        eventually(idle, 10, "the block pool is whole again")
        snap = http.get("/v1/cluster").json()
        assert snap["totals"]["replicas"] == 1 and snap["replicas"][0]["kv_blocks_total"] == 24
        assert snap["replicas"][0]["kv_blocks_free"] == 24 and snap["totals"]["admitting"] == 1
        r = http.post("/v1/completions", json={"prompt": tokens(rng, 400), "max_tokens": 8})  # 25 blocks > 24
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt" and "KV-cache" in r.text
        metrics = http.get("/metrics").text
        assert 'conveyor_admission_decisions_total{admitted="false",reason=' in metrics
        assert f'conveyor_admission_decisions_total{{admitted="true",reason="ok"}} {codes.count(200) + 3}.0' in metrics
        assert "conveyor_cluster_kv_blocks_free 24.0" in metrics and "conveyor_replica_saturated{replica=" in metrics
        actor = replica.admission.remote().result()  # the same burst, now with a wait queue at the router
        ray.get(actor.configure.remote({"queue_timeout_s": 60.0, "max_queued": 64}))
        time.sleep(0.5)
        resps = asyncio.run(post_all(url, bodies))
        assert [r.status_code for r in resps] == [200] * len(bodies)
        assert all(r.json()["usage"]["completion_tokens"] == 32 for r in resps)
        eventually(idle, 10, "the block pool is whole again after the queued burst")
    finally:
        serve.delete("burst")


def test_load_client_errors_fail_the_test() -> None:
    with pytest.raises(AssertionError, match="a load client failed"):
        with Load(f"http://127.0.0.1:{free_port()}", n=2, prompt_len=4, max_tokens=2):
            time.sleep(0.2)


def test_kv_pressure_scales_1_to_2_and_idle_back_to_1(cluster: SimpleNamespace) -> None:
    scaling = {
        "min_replicas": 1,
        "max_replicas": 2,
        "look_back_period_s": 2,
        "metrics_interval_s": 0.5,
        "policy": {"target_kv_utilization": 0.5, "tolerance": 0.1, "upscale_delay_s": 1, "downscale_delay_s": 4},
    }
    run_apps(scale={"engine": {**ENGINE, "num_blocks": 48}, "kv_autoscaling": scaling})
    http = httpx.Client(base_url=f"{cluster.url}/scale", timeout=60)
    try:
        assert running_replicas("scale") == 1
        with Load(f"{cluster.url}/scale", n=6, prompt_len=48, max_tokens=160) as load:
            eventually(lambda: running_replicas("scale") == 2, 120, "scale up to 2 replicas under KV pressure")
            eventually(
                lambda: http.get("/v1/cluster").json()["totals"]["replicas"] == 2,
                20,
                "the new replica reports to admission",
            )
        # 503 + Retry-After is a clean refusal too: while a replica starts, admission may see stale stats
        assert load.codes.count(200) >= 1 and set(load.codes) <= {200, 429, 503}, load.codes
        eventually(lambda: running_replicas("scale") == 1, 90, "scale back to 1 replica when idle")
        eventually(
            lambda: http.get("/v1/cluster").json()["totals"]["replicas"] == 1,
            15,
            "the stopped replica's stats are dropped",
        )
        assert http.post("/v1/completions", json={"prompt": "x", "max_tokens": 2}).status_code == 200
    finally:
        serve.delete("scale")


def test_shared_prefixes_stick_to_one_replica_at_the_oracle_hit_rate(cluster: SimpleNamespace) -> None:
    engine = {**ENGINE, "num_blocks": 256}
    run_apps(
        kv={"engine": engine, "num_replicas": 2},
        p2c={"engine": engine, "num_replicas": 2, "request_router": {"enabled": False}},
    )
    rng = random.Random(1)
    systems = [tokens(rng, 160) for _ in range(3)]
    work = [(g, systems[g] + tokens(rng, 20)) for g in range(3) for _ in range(8)]
    rng.shuffle(work)
    try:
        hit_rates, placement = {}, {}
        for app in ("kv", "p2c"):
            http = httpx.Client(base_url=f"{cluster.url}/{app}", timeout=60)
            placement[app] = {g: set() for g in range(3)}
            for g, prompt in work:
                r = http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 4, "temperature": 0})
                assert r.status_code == 200, r.text
                placement[app][g].add(r.headers["x-conveyor-replica"])
            time.sleep(0.5)
            totals = http.get("/v1/cluster").json()["totals"]
            assert totals["replicas"] == 2 and totals["prefix_cache_queries"] >= 24 * 180
            hit_rates[app] = totals["prefix_cache_hit_rate"]
        assert all(len(replicas) == 1 for replicas in placement["kv"].values()), placement["kv"]
        assert hit_rates["kv"] >= (21 * 160) / (24 * 180) - 0.02, hit_rates
        # not strictly: in 2 of 16 local runs of this module Ray's power-of-two also kept each group on one replica
        assert hit_rates["kv"] >= hit_rates["p2c"], (hit_rates, placement)
    finally:
        serve.delete("kv")
        serve.delete("p2c")


def test_two_routers_queue_time_objective_refuses_with_retry_after_and_loses_nothing(cluster: SimpleNamespace) -> None:
    """2 router replicas share reservations and the KV index through the admission actor; with
    max_queue_time_s a burst far beyond 2 replicas x 4 slots is partly refused (429 queue_time)."""
    run_apps(
        slo={
            "engine": {**ENGINE, "num_blocks": 128, "max_num_seqs": 4},
            "num_replicas": 2,
            "router_replicas": 2,
            "admission": {"max_queue_time_s": 1.0},
        }
    )
    url, http = f"{cluster.url}/slo", httpx.Client(base_url=f"{cluster.url}/slo", timeout=60)
    try:
        rng = random.Random(2)
        warm = [{"prompt": tokens(rng, 40), "max_tokens": 16, "ignore_eos": True} for _ in range(8)]
        assert [http.post("/v1/completions", json=b).status_code for b in warm] == [200] * 8  # rates get measured
        time.sleep(0.5)
        snap = http.get("/v1/cluster").json()
        assert snap["config"]["max_queue_time_s"] == 1.0 and snap["totals"]["replicas"] == 2
        assert all(r["kv_index_reported"] and r["kv_index_blocks"] > 0 for r in snap["replicas"])
        assert all(r["rates"]["finished_per_s"] > 0 for r in snap["replicas"])
        bodies = [
            {"prompt": tokens(rng, 40), "max_tokens": 48, "ignore_eos": True, "temperature": 0} for _ in range(48)
        ]
        assert_burst(asyncio.run(post_all(url, bodies)), 48, "queue_time")
        replica = serve.get_deployment_handle("LLMReplica", app_name="slo")
        await_pools_whole(http, 128)
        routers = serve.status().applications["slo"].deployments["Router"].replica_states.get("RUNNING", 0)
        assert routers == 2
        assert replica.stats.remote().result()["num_finished"] >= 1
    finally:
        serve.delete("slo")


def test_two_routers_commit_within_leases_and_no_request_is_preempted(cluster: SimpleNamespace) -> None:
    """KV cache the limit: 2 router replicas admit a burst within the leases the admission actor grants each
    at every sync, so together they never commit more than a replica's headroom (room up to the high
    watermark, every request's growth to max_tokens counted): the excess gets 429 no_room, nothing is
    preempted, nothing lost."""
    run_apps(
        leases={
            "engine": {**ENGINE, "num_blocks": 48},
            "num_replicas": 2,
            "router_replicas": 2,
        }
    )
    url, http = f"{cluster.url}/leases", httpx.Client(base_url=f"{cluster.url}/leases", timeout=60)
    try:
        rng = random.Random(5)
        for _ in range(4):
            assert http.post("/v1/completions", json={"prompt": tokens(rng, 40), "max_tokens": 8}).status_code == 200

        def leased() -> bool:
            snap = http.get("/v1/cluster").json()
            ids = {r["replica_id"] for r in snap["replicas"]}
            return snap.get("routers") == 2 and len(ids) == 2 and set(snap.get("lease", {})) == ids

        eventually(leased, 20, "both routers sync and hold a lease of both replicas")
        bodies = [
            {"prompt": tokens(rng, 120), "max_tokens": 48, "ignore_eos": True, "temperature": 0} for _ in range(40)
        ]  # 11 blocks each; a replica's headroom is 43 of its 48
        assert_burst(asyncio.run(post_all(url, bodies)), 48, "no_room")
        await_pools_whole(http, 48)
        preempted = [r["num_preemptions"] for r in http.get("/v1/cluster").json()["replicas"]]
        decisions = [
            ln for ln in http.get("/metrics").text.splitlines() if ln.startswith("conveyor_admission_decisions_total")
        ]
        assert preempted == [0, 0], decisions  # a rare CI failure: which path admitted too much (fail_open?)
    finally:
        serve.delete("leases")
