"""serve_config.yaml's admission under a burst far past capacity, behind the README's ingress
(RAY_SERVE_ENABLE_HA_PROXY=1): every request ends before the client's timeout; an admitted one starts within
the queue-time bound (its own generation time comes on top); the others are refused with Retry-After. How long
a refusal took is printed, not asserted: issue 39 asks for "within a second", which this 2-core machine does not
meet (docs/cluster.md, "A burst far past capacity")."""

import asyncio
import random
import time
from collections import Counter
from typing import Any

import aiohttp
import pytest
import yaml
from ray import serve

from tests.load import tokens
from tests.serve_app import ROOT, free_port, start_ray, stop_ray

pytestmark = pytest.mark.slow


async def stream_timed(client: aiohttp.ClientSession, url: str, body: dict) -> dict[str, Any]:
    """One streamed completion: status, Retry-After, seconds to the first token and to the end (or the error)."""
    start = time.perf_counter()
    out: dict[str, Any] = {"status": None, "first": None, "tokens": 0}
    try:
        async with client.post(f"{url}/v1/completions", json={**body, "stream": True}) as r:
            out["status"], out["retry_after"] = r.status, r.headers.get("retry-after")
            async for line in r.content:
                if line.startswith(b"data: {") and b'"text"' in line:
                    out["first"] = out["first"] or time.perf_counter() - start
                    out["tokens"] += 1
    except (aiohttp.ClientError, asyncio.TimeoutError) as e:
        out["error"] = repr(e)
    out["end_s"] = time.perf_counter() - start
    return out


async def burst(url: str, n: int, rng: random.Random) -> list[dict[str, Any]]:
    """n streams at once from one aiohttp session (an unbounded pool: one connection each). The client shares the
    2 cores with the app; aiohttp's costs about a sixth of the CPU httpx's does for the same burst."""
    bodies = [{"prompt": tokens(rng, 32), "max_tokens": 128, "ignore_eos": True} for _ in range(n)]
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=240)) as client:
        return await asyncio.gather(*(stream_timed(client, url, b) for b in bodies))


def test_the_default_config_refuses_what_it_could_not_start_in_time() -> None:
    from conveyor.deployments.app import AppArgs, build_app

    args = yaml.safe_load((ROOT / "serve_config.yaml").read_text())["applications"][0]["args"]
    bound = args["admission"]["max_queue_time_s"]
    args = {**args, "model": "demo:tiny", "chat_template": None, "num_replicas": 1, "replica_num_cpus": 0.25}
    args.update(router_num_cpus=0.1, torch_threads=1)
    del args["kv_autoscaling"]
    start_ray(haproxy=True)
    port = free_port()
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run(build_app(AppArgs(**args)), name="default_config", route_prefix="/")
        url = f"http://127.0.0.1:{port}"
        rng = random.Random(5)
        warm = asyncio.run(burst(url, 32, rng))  # within the batch: measures the replica's service rates
        assert [w["status"] for w in warm] == [200] * 32
        start = time.perf_counter()
        results = asyncio.run(burst(url, 800, rng))
        elapsed = time.perf_counter() - start
        assert not [r for r in results if "error" in r], "none fails at the client or runs past its timeout"
        admitted = [r for r in results if r["status"] == 200]
        refused = [r for r in results if r["status"] != 200]
        waits = sorted(r["first"] for r in admitted)
        refusals = sorted(r["end_s"] for r in refused)
        print(
            f"burst of 800 in {elapsed:.1f} s: {len(admitted)} admitted, started p50 {waits[len(waits) // 2]:.1f} s, "
            f"max {waits[-1]:.1f} s (bound {bound} s); {len(refused)} refused {Counter(r['status'] for r in refused)}"
            f" in p50 {refusals[len(refusals) // 2]:.3f} s, p90 {refusals[len(refusals) * 9 // 10]:.3f} s, "
            f"max {refusals[-1]:.3f} s"
        )
        assert all(r["tokens"] > 0 for r in admitted)
        assert len(admitted) >= 32 and refused, "the burst fills the replica and overflows the bound"
        assert waits[-1] <= bound + 2.0
        assert all(r["status"] in (429, 503) and int(r["retry_after"]) >= 1 for r in refused)
    finally:
        serve.shutdown()
        stop_ray()
