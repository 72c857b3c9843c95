"""The load of the cluster benchmarks, closed-loop and open-loop (Poisson) streams of greedy completions, and
what the cluster shows meanwhile: the admission actor's replica rows, sampled every 20 ms, and /v1/cluster."""

import asyncio
import random
import time
from typing import Any

import aiohttp

from benchmarks.http_client import complete, fetch_json, session


def rand_tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(4, 8000) for _ in range(n)]


async def stream_one(
    client: aiohttp.ClientSession, url: str, prompt: list[int], max_tokens: int, retry: bool
) -> dict[str, Any]:
    """TTFT from the first attempt (a retried 429 waits its Retry-After), tokens, status, Retry-After."""
    body = {
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    refused, start = 0, time.perf_counter()
    while True:
        c = await complete(client, f"{url}/v1/completions", body)
        if c.status == 429 and retry:
            refused += 1
            await asyncio.sleep(float(c.retry_after or 1))
            continue
        break
    if c.status == -1:
        return {"status": -1, "error": c.error, "refused": refused}
    if c.status != 200:
        return {
            "status": c.status,
            "retry_after": c.retry_after,
            "refused": refused,
            "latency": c.done - start,
            "code": c.error_code if c.status in (429, 503) else None,
        }
    timing = {k: v / 1000 for k, v in c.server_timing.items()}
    return {
        "status": 200,
        "ttft": (c.chunks[0] if c.chunks else time.perf_counter()) - start,
        "tokens": c.tokens,
        "refused": refused,
        "router_ttft": timing.get("router"),
        "replica_ttft": timing.get("replica"),
        "ingress": timing.get("ingress"),
        "egress": timing.get("egress"),
        "admission": timing.get("admission"),
    }


async def closed_loop(
    url: str, path: str, prompts: list[list[int]], max_tokens: int, concurrency: int, retry: bool = True
) -> tuple[list[dict[str, Any]], float]:
    queue: asyncio.Queue = asyncio.Queue()
    for p in prompts:
        queue.put_nowait(p)
    results: list[dict[str, Any]] = []
    async with session(concurrency + 2, timeout_s=300) as c:

        async def worker() -> None:
            while not queue.empty():
                results.append(await stream_one(c, url + path, queue.get_nowait(), max_tokens, retry))

        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return results, time.perf_counter() - start


async def open_loop(
    url: str,
    path: str,
    rate: float,
    duration: float,
    prompt_len: tuple[int, int],
    max_tokens: int,
    seed: int,
    actor: Any = None,
) -> tuple[list[dict[str, Any]], list[tuple[float, dict, dict]]]:
    rng = random.Random(seed)
    samples: list[tuple[float, dict, dict]] = []
    stop = asyncio.Event()
    sampler = asyncio.create_task(sample_pressure(actor, stop, 0.02, samples)) if actor is not None else None
    async with session(2000, timeout_s=300) as c:
        tasks, start = [], time.perf_counter()
        while time.perf_counter() - start < duration:
            prompt = rand_tokens(rng, rng.randint(*prompt_len))

            async def one(prompt: list[int] = prompt, sent: float = time.perf_counter()) -> dict[str, Any]:
                return {**await stream_one(c, url + path, prompt, max_tokens, retry=False), "sent": sent}

            tasks.append(asyncio.create_task(one()))
            await asyncio.sleep(rng.expovariate(rate))
        results = await asyncio.gather(*tasks)
    stop.set()
    if sampler is not None:
        await sampler
    return list(results), samples


async def cluster_view(url: str, path: str) -> dict[str, Any]:
    async with session(1, timeout_s=30) as c:
        return await fetch_json(c, f"{url}{path}/v1/cluster")


def per_replica(before: dict[str, Any], after: dict[str, Any]) -> list[tuple[int, float]]:
    """Each replica's (requests finished, prefix-cache hit rate) between two cluster views."""
    old = {r["replica_id"]: r for r in before["replicas"]}
    out = []
    for r in after["replicas"]:
        o = old.get(r["replica_id"], {})
        q = r["prefix_cache_queries"] - o.get("prefix_cache_queries", 0)
        out.append(
            (
                r["num_finished"] - o.get("num_finished", 0),
                (r["prefix_cache_hits"] - o.get("prefix_cache_hits", 0)) / max(1, q),
            )
        )
    return out


async def with_saturation(actor: Any, work: Any) -> tuple[Any, float]:
    """Runs `work`, sampling the admission actor every 20 ms: also the share of samples with a replica saturated."""
    stop, seen = asyncio.Event(), []

    async def sample() -> None:
        while not stop.is_set():
            seen.append(any(r["saturated"] for r in (await actor.snapshot.remote())["replicas"]))
            await asyncio.sleep(0.02)

    task = asyncio.create_task(sample())
    try:
        return await work, sum(seen) / max(1, len(seen))
    finally:
        stop.set()
        await task


BOOK = (
    "kv_blocks_free",
    "num_waiting_tokens",
    "num_growth_blocks",
    "reserved_blocks",
    "reserved_requests",
    "room_blocks",
    "num_running",
    "num_waiting",
    "num_added",
    "age_s",
)


async def sample_pressure(actor: Any, stop: asyncio.Event, every_s: float, out: list[tuple[float, dict, dict]]) -> None:
    while not stop.is_set():
        snap = await actor.snapshot.remote()
        out.append(
            (
                time.perf_counter(),
                {r["replica_id"]: r["kv_pressure"] for r in snap["replicas"]},
                {
                    r["replica_id"]: (
                        r["num_running"],
                        r["num_waiting"],
                        round(r["queue_time_s"], 2),
                        r["num_preemptions"],
                    )
                    for r in snap["replicas"]
                },
                {r["replica_id"]: {k: r.get(k) for k in BOOK} for r in snap["replicas"]},
            )
        )
        await asyncio.sleep(every_s)
