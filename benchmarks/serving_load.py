"""The HTTP load of the serving benchmarks and what it measures: throughput at a concurrency, TTFT, the gaps
between stream chunks (ITL), the TTFT the Serve layer adds, CPU seconds by process role."""

import asyncio
import os
import time

import aiohttp
import psutil

from benchmarks.http_client import complete, first_event_s, session


async def http_request(
    client: aiohttp.ClientSession,
    url: str,
    prompt: list[int],
    max_tokens: int,
    stream: bool,
    model: str,
    gaps: list[float] | None = None,
) -> tuple[float | None, float, int]:
    """(TTFT (streams only), the replica's own time to its first deltas in ms, completion tokens)."""
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": stream,
        **({"stream_options": {"include_usage": True}} if stream else {}),
    }
    c = await complete(client, f"{url}v1/completions", body)
    if not c.ok:
        raise RuntimeError(f"{url}: {c.error}")
    if gaps is not None:
        gaps += c.gaps_s
    return c.ttft_s if stream else None, c.server_timing["replica"], c.tokens


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


async def http_ttfts(variants: dict[str, str], prompts: list[list[int]], model: str) -> dict[str, list[float]]:
    """Per variant (name -> full URL prefix), HTTP TTFT minus the replica's own time to first deltas (the
    floor app: its whole TTFT), one request per variant per prompt, round-robin."""
    added: dict[str, list[float]] = {name: [] for name in variants}
    async with session(4) as client:
        for i, p in enumerate(prompts):
            for name, prefix in variants.items():
                if name.endswith("bare Serve app"):
                    t = await first_event_s(client, prefix)
                else:
                    ttft, rep, _ = await http_request(client, prefix, p, 1, True, model)
                    t = ttft - rep / 1000
                if i >= 2:
                    added[name].append(t)
    return added
