"""Metrics: engine-side values follow known workloads offline; over real Ray Serve with two routers every
response is counted once, counters equal the usage the responses report, and a real Prometheus scrapes it."""

import asyncio
import json
import shutil
import subprocess
import time
import urllib.parse
from pathlib import Path
from typing import Callable, Iterator

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from conveyor.cluster.admission_actor import AdmissionActor
from conveyor.deployments.metrics import ReplicaMetrics, RouterMetrics, render
from conveyor.engine import LLM, EngineStats, SamplingParams
from tests.serve_app import App, app_at, wait_for


def samples(text: str | bytes) -> dict[tuple[str, frozenset], float]:
    text = text.decode() if isinstance(text, bytes) else text
    return {
        (s.name, frozenset(s.labels.items())): s.value for f in text_string_to_metric_families(text) for s in f.samples
    }


def total(s: dict, name: str, **labels: str) -> float:
    want = set(labels.items())
    return sum(v for (n, ls), v in s.items() if n == name and want <= ls)


def test_engine_metrics_follow_a_known_workload() -> None:
    llm = LLM("demo:tiny", dtype="float32", max_num_seqs=4, max_num_batched_tokens=64)
    eng, m = llm.engine, ReplicaMetrics("demo:tiny", "r0")
    lengths, prompts = [5, 9, 17, 3], [list(range(10, 10 + 7 * (i + 1))) for i in range(4)]
    for i, (p, n) in enumerate(zip(prompts, lengths)):
        eng.add_request(str(i), p, SamplingParams(max_tokens=n, ignore_eos=True, temperature=0))
    eng.add_request("s", prompts[0], SamplingParams(max_tokens=30, stop_token_ids=[], temperature=0))
    aborted, seen, execute = None, [], eng.local_core.executor.execute_model
    eng.local_core.executor.execute_model = lambda so: (seen.append(so.num_tokens), execute(so))[1]
    while eng.has_unfinished_requests():
        if eng.local_core.scheduler.num_steps == 4:
            aborted = eng.abort_request("s")
            m.observe_output(aborted)
        for out in eng.step():
            m.observe_output(out)
    s = samples(render([m.dump(eng.stats())]))
    assert total(s, "conveyor:request_success_total", finished_reason="length") == 4
    assert total(s, "conveyor:request_success_total", finished_reason="abort") == 1
    assert len(aborted.outputs[0].token_ids) >= 1
    generated = sum(lengths) + len(aborted.outputs[0].token_ids)
    assert total(s, "conveyor:generation_tokens_total") == generated
    assert total(s, "conveyor:prompt_tokens_total") == sum(map(len, prompts)) + len(prompts[0])
    assert total(s, "conveyor:inter_token_latency_seconds_count") == generated - 5
    assert total(s, "conveyor:time_to_first_token_seconds_count") == 5
    assert total(s, "conveyor:request_queue_time_seconds_count") == 5
    assert total(s, "conveyor:request_decode_time_seconds_count") == 4  # not the aborted one
    assert total(s, "conveyor:iteration_tokens_total_count") == len(seen) == eng.local_core.scheduler.num_steps
    assert total(s, "conveyor:iteration_tokens_total_sum") == sum(seen)
    assert total(s, "conveyor:iteration_tokens_total_bucket", le="+Inf") == eng.local_core.scheduler.num_steps
    assert total(s, "conveyor:prefix_cache_hits_total") == eng.local_core.block_manager.hits > 0
    assert total(s, "conveyor:kv_cache_usage_perc") == 0 and total(s, "conveyor:num_requests_running") == 0


def test_counters_never_go_back_across_engine_or_replica_restarts() -> None:
    m = ReplicaMetrics("m", "r1")
    first = EngineStats(
        num_preemptions=5,
        prefix_cache_hits=40,
        num_steps=3,
        iteration_tokens_sum=90,
        iteration_tokens_counts=[0] * 6 + [3] + [0] * 7,
    )
    after_restart = EngineStats(
        num_preemptions=2,
        prefix_cache_hits=8,
        num_steps=1,
        iteration_tokens_sum=1,
        iteration_tokens_counts=[1] + [0] * 13,
    )
    m.observe_stats(first)
    m.observe_stats(first)
    s = samples(render([m.dump(after_restart)]))
    assert total(s, "conveyor:num_preemptions_total") == 7 and total(s, "conveyor:prefix_cache_hits_total") == 48
    assert (
        total(s, "conveyor:iteration_tokens_total_count") == 4 and total(s, "conveyor:iteration_tokens_total_sum") == 91
    )
    actor = AdmissionActor()
    actor.report(
        {
            **EngineStats(num_running=2, kv_blocks_total=8).to_dict(),
            "replica_id": "r1",
            "metrics": m.dump(EngineStats(num_running=2, num_preemptions=9, kv_blocks_total=8)),
        }
    )
    actor.forget("r1")  # the replica went away; a new one reports under a new id
    fresh = ReplicaMetrics("m", "r2")
    actor.report({**EngineStats().to_dict(), "replica_id": "r2", "metrics": fresh.dump(EngineStats(num_preemptions=1))})
    router = RouterMetrics("m", "router-a")
    s = samples(router.render(actor.metrics()))
    assert total(s, "conveyor:num_preemptions_total", replica="r1") == 7 + 7  # its last value stays
    assert total(s, "conveyor:num_preemptions_total", replica="r2") == 1
    assert ("conveyor:num_requests_running", frozenset({("model_name", "m"), ("replica", "r1")})) not in s
    assert total(s, "conveyor:num_requests_running", replica="r2") == 0


# ---------------------------------------------------------------- over real Ray Serve, two routers
ENGINE = dict(
    dtype="float32", max_num_seqs=8, max_num_batched_tokens=256, block_size=16, num_blocks=96, max_model_len=512
)


@pytest.fixture(scope="module")
def app() -> Iterator[App]:
    from ray import serve

    from tests.serve_app import free_port, start_ray, stop_ray, wait_ready

    start_ray()
    port = free_port()
    try:
        from conveyor.deployments.app import deploy

        deploy(
            {
                "engine": ENGINE,
                "replica_num_cpus": 0.5,
                "router_num_cpus": 0.25,
                "router_replicas": 2,
                "torch_threads": 1,
                "port": port,
            }
        )
        url = f"http://127.0.0.1:{port}"
        wait_ready(url, 120)
        # both routers' admission views hold the replica (/v1/models answers before its first report)
        assert wait_for(lambda: all(httpx.get(f"{url}/v1/cluster").json()["totals"]["replicas"] for _ in range(4)), 60)
        app = app_at(url)
        app.port = port
        yield app
    finally:
        serve.shutdown()
        stop_ray()


def scrape_until(http: httpx.Client, ok: Callable[[dict], bool], timeout: float = 20) -> dict:
    deadline = time.time() + timeout
    while True:
        s = samples(http.get("/metrics").text)
        if ok(s) or time.time() > deadline:
            return s
        time.sleep(0.25)


@pytest.mark.slow
@pytest.mark.usefixtures("pool_whole")
def test_served_metrics_follow_requests_and_count_every_response(app: App) -> None:
    before = samples(app.http.get("/metrics").text)
    bodies = [
        {
            "prompt": f"def f{i}(x):",
            "max_tokens": 4 + 3 * i,
            "ignore_eos": True,
            "temperature": 0,
            "stream": i % 2 == 1,
            "stream_options": {"include_usage": True} if i % 2 else None,
        }
        for i in range(6)
    ]

    async def send_all() -> list[dict]:
        async with httpx.AsyncClient(base_url=app.url, timeout=60) as client:

            async def one(b: dict) -> dict:
                if not b["stream"]:
                    r = await client.post("/v1/completions", json=b)
                    assert r.status_code == 200, r.text
                    return r.json()["usage"]
                async with client.stream("POST", "/v1/completions", json=b) as r:
                    events = [json.loads(line[6:]) async for line in r.aiter_lines() if line.startswith("data: {")]
                return events[-1]["usage"]

            return await asyncio.gather(*(one(b) for b in bodies))

    usages = asyncio.run(send_all())
    bad = [
        app.http.post("/v1/completions", json={"prompt": "x", "temperature": -1}),
        app.http.post("/v1/completions", json={"prompt": "x", "max_tokens": "many"}),
        app.http.post("/v1/chat/completions", content=b"{oops", headers={"content-type": "application/json"}),
    ]
    assert [r.status_code for r in bad] == [400, 400, 400]
    n, gen, prompt = len(bodies), sum(u["completion_tokens"] for u in usages), sum(u["prompt_tokens"] for u in usages)
    assert gen == sum(b["max_tokens"] for b in bodies)

    def delta(s: dict, name: str, **labels: str) -> float:
        return total(s, name, **labels) - total(before, name, **labels)

    def settled(s: dict) -> bool:
        return (
            delta(s, "conveyor:request_success_total", finished_reason="length") == n
            and delta(s, "conveyor:http_requests_total", status="400") == 3
            and delta(s, "conveyor:http_requests_total", endpoint="/v1/completions", status="200") == n
            # counted at the response's start, its duration after its last byte: a stream's may come later
            and delta(s, "conveyor:http_request_duration_seconds_count") == n
            and len({v for (name, ls) in s if name == "conveyor:http_requests_total" for k, v in ls if k == "router"})
            == 2
        )

    s = scrape_until(app.http, settled)
    assert settled(s), (
        delta(s, "conveyor:request_success_total", finished_reason="length"),
        delta(s, "conveyor:http_requests_total", status="400"),
        sorted(k for k in s if k[0] == "conveyor:http_requests_total"),
    )
    assert delta(s, "conveyor:generation_tokens_total") == gen
    assert delta(s, "conveyor:prompt_tokens_total") == prompt
    assert delta(s, "conveyor:inter_token_latency_seconds_count") == gen - n
    assert delta(s, "conveyor:e2e_request_latency_seconds_count") == n
    assert delta(s, "conveyor:http_requests_total", endpoint="/v1/completions", status="200") == n
    assert delta(s, "conveyor:http_requests_total", endpoint="/v1/chat/completions", status="400") == 1
    assert delta(s, "conveyor:serve_overhead_seconds_count", phase="ingress") == n
    assert delta(s, "conveyor:serve_overhead_seconds_count", phase="egress") >= n
    assert delta(s, "conveyor:http_request_duration_seconds_count") == n
    for name in ("conveyor:num_requests_running", "conveyor:num_requests_waiting", "conveyor:kv_cache_usage_perc"):
        assert [v for (k, ls), v in s.items() if k == name] == [0.0], name
    again = [samples(app.http.get("/metrics").text) for _ in range(4)]  # whichever router answers: same totals
    for name in ("conveyor:http_requests_total", "conveyor:generation_tokens_total"):
        values = [total(x, name) for x in again]
        assert values == sorted(values) and values[0] >= total(s, name) - 1, (name, values)


@pytest.mark.slow
@pytest.mark.usefixtures("pool_whole")
def test_real_prometheus_scrapes_the_endpoint(app: App, tmp_path: Path) -> None:
    binary = shutil.which("prometheus")
    assert binary, "the Debian `prometheus` package is a test dependency (apt-get install -y prometheus)"
    from tests.serve_app import free_port

    port = free_port()
    config = tmp_path / "prometheus.yml"
    config.write_text(
        f"global: {{scrape_interval: 1s}}\nscrape_configs:\n  - job_name: conveyor\n"
        f"    static_configs: [{{targets: ['127.0.0.1:{app.port}']}}]\n"
    )
    assert app.http.post("/v1/completions", json={"prompt": "x", "max_tokens": 3}).status_code == 200
    proc = subprocess.Popen(
        [
            binary,
            f"--config.file={config}",
            f"--storage.tsdb.path={tmp_path / 'data'}",
            f"--web.listen-address=127.0.0.1:{port}",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.STDOUT,
    )
    try:
        api = f"http://127.0.0.1:{port}/api/v1/query?query="
        deadline, found = time.time() + 60, {}
        want = [
            "conveyor:request_success_total",
            "conveyor:time_to_first_token_seconds_count",
            "conveyor:kv_cache_usage_perc",
            "conveyor:http_requests_total",
        ]
        while time.time() < deadline and len(found) < len(want):
            for q in want:
                try:
                    r = httpx.get(api + urllib.parse.quote(q), timeout=5).json()
                except (httpx.HTTPError, ValueError):  # not listening yet, or "Service Unavailable" while starting
                    continue
                if r.get("status") == "success" and r["data"]["result"]:
                    found[q] = r["data"]["result"]
            time.sleep(0.5)
        assert sorted(found) == sorted(want), f"Prometheus returned only {sorted(found)}"
        assert all(x["metric"]["job"] == "conveyor" for x in found["conveyor:request_success_total"])
        assert {x["metric"]["model_name"] for x in found["conveyor:kv_cache_usage_perc"]} == {"demo:tiny"}
        assert float(found["conveyor:request_success_total"][0]["value"][1]) >= 1
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_grafana_dashboard_queries_only_exported_series() -> None:
    import re

    dash = json.loads((Path(__file__).resolve().parents[2] / "deployments/grafana/conveyor.json").read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    used = {re.sub(r"_(bucket|sum|count)$", "", n) for e in exprs for n in re.findall(r"conveyor:[a-z0-9_]+", e)}
    replica, router = ReplicaMetrics("m", "r"), RouterMetrics("m", "x")
    exported = {
        f["name"] + ("_total" if f["type"] == "counter" else "") for f in replica.dump(EngineStats()) + router.dump()
    }
    assert used and used <= exported, used - exported
    assert {"conveyor:serve_overhead_seconds", "conveyor:inter_token_latency_seconds"} <= used


@pytest.mark.slow
@pytest.mark.usefixtures("pool_whole")
def test_bench_serve_end_to_end_agrees_with_the_metrics(app: App, tmp_path: Path) -> None:
    from conveyor.cli import main

    before = samples(app.http.get("/metrics").text)
    out, plot = tmp_path / "serve.json", tmp_path / "serve.png"
    assert (
        main(
            [
                "bench",
                "serve",
                "--base-url",
                app.url,
                "--num-requests",
                "6",
                "--request-rate",
                "20",
                "--concurrency",
                "4",
                "--prompt-len",
                "shared-prefix:32,8",
                "--output-len",
                "uniform:2,6",
                "--slo",
                "ttft=30,itl=10",
                "--quiet",
                "--out",
                str(out),
                "--plot",
                str(plot),
            ]
        )
        == 0
    )
    result = json.loads(out.read_text())
    s, reqs = result["summary"], result["requests"]
    assert s["completed"] == 6 and s["failed"] == 0 and s["good_fraction"] == 1.0
    assert s["output_tokens"] == sum(r["output_tokens"] for r in reqs) and all(
        2 <= r["output_tokens"] <= 6 for r in reqs
    )
    assert all(r["ttft_s"] <= r["e2e_s"] and len(r["itl_s"]) <= r["output_tokens"] - 1 for r in reqs)
    assert s["ttft_s"]["p50"] <= s["ttft_s"]["p99"] and s["output_throughput"] > 0
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    def delta(x: dict, name: str, **labels: str) -> float:
        return total(x, name, **labels) - total(before, name, **labels)

    after = scrape_until(app.http, lambda x: delta(x, "conveyor:request_success_total") >= 6)
    assert delta(after, "conveyor:request_success_total", finished_reason="length") == 6
    assert delta(after, "conveyor:generation_tokens_total") == s["output_tokens"]
    assert delta(after, "conveyor:prompt_tokens_total") == s["prompt_tokens"] == 6 * 40
    assert delta(after, "conveyor:prefix_cache_hits_total") > 0


def test_kv_tier_metrics_follow_the_engine_tiers() -> None:
    llm = LLM("demo:tiny", dtype="float32", num_blocks=6, block_size=8, kv_offload={"host_gib": 0.001})
    params = SamplingParams(max_tokens=2, ignore_eos=True, temperature=0)
    prompts = [list(range(10 + 50 * i, 50 + 50 * i)) for i in range(3)]
    for _ in range(2):  # three 40-token prompts in a 6-block pool: the second round loads from the host tier
        for p in prompts:
            llm.generate([{"prompt_token_ids": p}], params, use_tqdm=False)
    stats, m = llm.engine.stats(), ReplicaMetrics("demo:tiny", "r0")
    s = samples(render([m.dump(stats)]))
    hits, size = stats.kv_tier_hits["host"], stats.kv_tier_block_bytes
    assert hits > 0 and size > 0 and stats.kv_tier_loads == hits and 0 < stats.kv_tier_load_cost <= 1
    assert total(s, "conveyor:kv_tier_hits_total", tier="host") == hits
    assert total(s, "conveyor:kv_tier_bytes_total", tier="host", op="loaded") == hits * size
    assert total(s, "conveyor:kv_tier_bytes_total", tier="host", op="stored") == stats.kv_tier_stored["host"] * size
    assert total(s, "conveyor:kv_tier_loads_total") == hits and total(s, "conveyor:kv_tier_load_seconds_total") > 0
