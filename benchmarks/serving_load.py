"""The HTTP load of the serving benchmarks and what it measures: throughput at a concurrency, TTFT, the gaps
between stream chunks (ITL), the TTFT the Serve layer adds, CPU seconds by process role."""

import asyncio
import os
import time
from typing import Any

import aiohttp
import psutil

from benchmarks.sse import aiohttp_lines, read_completion_stream, server_timing_ms


def replica_ms(headers: Any) -> float:
    return server_timing_ms(headers["server-timing"])["replica"]


async def http_request(
    client: aiohttp.ClientSession,
    url: str,
    prompt: list[int],
    max_tokens: int,
    stream: bool,
    model: str,
    gaps: list[float] | None = None,
) -> tuple[float | None, float, int]:
    """aiohttp, as vLLM's serving benchmark uses: on 2 shared cores the client's own CPU is part of the load
    (httpx's stream reader measured ~30% of a core at 1600 tok/s)."""
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": stream,
        **({"stream_options": {"include_usage": True}} if stream else {}),
    }
    start = time.perf_counter()
    async with client.post(f"{url}v1/completions", json=body) as r:
        r.raise_for_status()
        if not stream:
            return None, replica_ms(r.headers), (await r.json())["usage"]["completion_tokens"]
        arrivals: list[float] = []
        ttft, tokens = await read_completion_stream(aiohttp_lines(r), start, arrivals)
    if gaps is not None:
        gaps += [b - a for a, b in zip(arrivals, arrivals[1:])]
    return ttft, replica_ms(r.headers), tokens


ROLES = (
    ("conveyor.engine.process.core_process", "core"),
    ("LLMReplica", "replica"),
    ("Router", "router"),
    ("ProxyActor", "proxy"),
    ("bin/haproxy", "haproxy"),
)


def cpu_by_role() -> dict[str, float]:
    """CPU seconds so far of this machine's processes, summed by role (the rest: Ray's own, other apps);
    CPU per token is steadier than tok/s on a shared machine."""
    totals: dict[str, float] = {}
    for proc in psutil.process_iter(["pid", "cmdline", "cpu_times"]):
        try:
            cmd, t = " ".join(proc.info["cmdline"] or []), proc.info["cpu_times"]
        except (psutil.Error, TypeError):
            continue
        if t is None:
            continue
        role = "client" if proc.info["pid"] == os.getpid() else next((r for key, r in ROLES if key in cmd), "other")
        totals[role] = totals.get(role, 0.0) + t.user + t.system
    return totals


def session(connections: int) -> aiohttp.ClientSession:
    return aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=connections), timeout=aiohttp.ClientTimeout(total=600)
    )


async def http_throughput(
    url: str, prompts: list[list[int]], max_tokens: int, stream: bool, model: str, concurrency: int
) -> tuple[float, int, list[float], list[float]]:
    """At most `concurrency` requests in flight (a new one starts as one ends), as vLLM's --max-concurrency."""
    gaps: list[float] = []
    slots = asyncio.Semaphore(concurrency)

    async def limited(p: list[int]) -> tuple[float | None, float, int]:
        async with slots:
            return await http_request(client, url, p, max_tokens, stream, model, gaps)

    async with session(concurrency) as client:
        await asyncio.gather(*(http_request(client, url, p, max_tokens, stream, model) for p in prompts[:16]))
        start = time.perf_counter()
        res = await asyncio.gather(*(limited(p) for p in prompts))
        elapsed = time.perf_counter() - start
    return elapsed, sum(t for _, _, t in res), [t for t, _, _ in res if t is not None], gaps


async def first_line_s(client: aiohttp.ClientSession, url: str) -> float:
    start = time.perf_counter()
    async with client.post(url, json={}) as r:
        async for line in r.content:
            if line.startswith(b"data: "):
                return time.perf_counter() - start
    raise RuntimeError(f"{url}: no data")


async def http_ttfts(variants: dict[str, str], prompts: list[list[int]], model: str) -> dict[str, list[float]]:
    """Per variant (name -> full URL prefix), HTTP TTFT minus the replica's own time to first deltas (the
    floor app: its whole TTFT), one request per variant per prompt, round-robin."""
    added: dict[str, list[float]] = {name: [] for name in variants}
    async with session(4) as client:
        for i, p in enumerate(prompts):
            for name, prefix in variants.items():
                if name.endswith("bare Serve app"):
                    t = await first_line_s(client, prefix)
                else:
                    ttft, rep, _ = await http_request(client, prefix, p, 1, True, model)
                    t = ttft - rep / 1000
                if i >= 2:
                    added[name].append(t)
    return added
