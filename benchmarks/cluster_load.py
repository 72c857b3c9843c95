"""The load of the cluster benchmarks, closed-loop and open-loop (Poisson) streams of greedy completions, and
what the cluster shows meanwhile: the admission actor's replica rows, sampled every 20 ms, and /v1/cluster."""

import asyncio
import random
import time
from typing import Any

import httpx

from benchmarks.sse import read_completion_stream, server_timing_ms


def rand_tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(4, 8000) for _ in range(n)]


async def stream_one(
    client: httpx.AsyncClient, path: str, prompt: list[int], max_tokens: int, retry: bool
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
        try:
            async with client.stream("POST", f"{path}/v1/completions", json=body) as r:
                if r.status_code == 429 and retry:
                    refused += 1
                    await asyncio.sleep(float(r.headers.get("retry-after", 1)))
                    continue
                if r.status_code != 200:
                    await r.aread()
                    return {
                        "status": r.status_code,
                        "retry_after": r.headers.get("retry-after"),
                        "refused": refused,
                        "latency": time.perf_counter() - start,
                        "code": r.json().get("error", {}).get("code") if r.status_code in (429, 503) else None,
                    }
                timing = server_timing_ms(r.headers.get("server-timing", ""))
                router_ms, replica_ms = timing.get("router"), timing.get("replica")
                ingress_ms, egress_ms, admission_ms = (
                    timing.get("ingress"),
                    timing.get("egress"),
                    timing.get("admission"),
                )
                ttft, tokens = await read_completion_stream(r.aiter_lines(), start)
        except httpx.HTTPError as e:
            return {"status": -1, "error": repr(e), "refused": refused}
        return {
            "status": 200,
            "ttft": ttft if ttft is not None else time.perf_counter() - start,
            "tokens": tokens,
            "refused": refused,
            "router_ttft": router_ms / 1000 if router_ms is not None else None,
            "replica_ttft": replica_ms / 1000 if replica_ms is not None else None,
            "ingress": ingress_ms / 1000 if ingress_ms is not None else None,
            "egress": egress_ms / 1000 if egress_ms is not None else None,
            "admission": admission_ms / 1000 if admission_ms is not None else None,
        }


async def closed_loop(
    url: str, path: str, prompts: list[list[int]], max_tokens: int, concurrency: int, retry: bool = True
) -> tuple[list[dict[str, Any]], float]:
    queue: asyncio.Queue = asyncio.Queue()
    for p in prompts:
        queue.put_nowait(p)
    results: list[dict[str, Any]] = []
    async with httpx.AsyncClient(base_url=url, timeout=300, limits=httpx.Limits(max_connections=concurrency + 2)) as c:

        async def worker() -> None:
            while not queue.empty():
                results.append(await stream_one(c, path, queue.get_nowait(), max_tokens, retry))

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
    async with httpx.AsyncClient(base_url=url, timeout=300, limits=httpx.Limits(max_connections=2000)) as c:
        tasks, start = [], time.perf_counter()
        while time.perf_counter() - start < duration:
            prompt = rand_tokens(rng, rng.randint(*prompt_len))

            async def one(prompt: list[int] = prompt, sent: float = time.perf_counter()) -> dict[str, Any]:
                return {**await stream_one(c, path, prompt, max_tokens, retry=False), "sent": sent}

            tasks.append(asyncio.create_task(one()))
            await asyncio.sleep(rng.expovariate(rate))
        results = await asyncio.gather(*tasks)
    stop.set()
    if sampler is not None:
        await sampler
    return list(results), samples


async def cluster_view(url: str, path: str) -> dict[str, Any]:
    async with httpx.AsyncClient(base_url=url, timeout=30) as c:
        return (await c.get(f"{path}/v1/cluster")).json()


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
