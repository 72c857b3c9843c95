"""KV-aware request router vs Ray Serve's default power-of-two router, same cluster, same requests.

Two apps of 2 replicas each run side by side on one local Ray cluster (admission on in both); rounds
alternate which app goes first. Workload: a few long system prompts shared by many users (system +
short user message, streamed, greedy). Each round uses fresh system prompts, so both apps start it
cold. The replicas' KV cache holds about half of the system prompts: the KV-aware router keeps each
prompt on one replica, power-of-two spreads every prompt over both and they evict each other.

Prints a markdown table: TTFT p50/p99 (from a request's first attempt: a 429 is retried after its
Retry-After), output tokens/s, cluster prefix-cache hit rate, 429s; target TTFT p50 -30% for the
KV-aware router.

    python -m benchmarks.cluster [--rounds 2 --requests 96 --concurrency 8]
"""
import argparse
import asyncio
import json
import random
import shutil
import statistics
import tempfile
import time
from typing import Any

import httpx

from benchmarks.sse import read_completion_stream

ROUTERS = {"kv": "KV-aware (prefix + KV headroom + queue)", "p2c": "Ray default (power of two)"}


def make_round(args: argparse.Namespace, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    systems = [[rng.randrange(4, 8000) for _ in range(args.system_len)] for _ in range(args.system_prompts)]
    return [rng.choice(systems) + [rng.randrange(4, 8000) for _ in range(rng.randint(*args.user_len))]
            for _ in range(args.requests)]


async def one(client: httpx.AsyncClient, app: str, prompt: list[int], max_tokens: int) -> tuple[float, int, int]:
    """(TTFT s from the first attempt, waits after a 429 included; completion tokens; 429s)"""
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    refused, start = 0, time.perf_counter()
    while True:
        async with client.stream("POST", f"/{app}/v1/completions", json=body) as r:
            if r.status_code == 429:
                refused += 1
                await asyncio.sleep(float(r.headers.get("retry-after", 1)))
                continue
            r.raise_for_status()
            ttft, tokens = await read_completion_stream(r, start)
        return ttft if ttft is not None else time.perf_counter() - start, tokens, refused


async def run(url: str, app: str, prompts: list[list[int]], args: argparse.Namespace) -> dict[str, Any]:
    queue: asyncio.Queue = asyncio.Queue()
    for p in prompts:
        queue.put_nowait(p)
    results: list[tuple[float, int, int]] = []
    limits = httpx.Limits(max_connections=args.concurrency + 2)
    async with httpx.AsyncClient(base_url=url, timeout=300, limits=limits) as client:
        before = (await client.get(f"/{app}/v1/cluster")).json()["totals"]

        async def worker() -> None:
            while not queue.empty():
                results.append(await one(client, app, queue.get_nowait(), args.max_tokens))

        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(args.concurrency)))
        elapsed = time.perf_counter() - start
        await asyncio.sleep(0.5)
        after = (await client.get(f"/{app}/v1/cluster")).json()["totals"]
    q = after["prefix_cache_queries"] - before["prefix_cache_queries"]
    return {"ttft": [t for t, _, _ in results], "tokens": sum(n for _, n, _ in results), "elapsed": elapsed,
            "refused": sum(r for _, _, r in results), "queries": q,
            "hits": after["prefix_cache_hits"] - before["prefix_cache_hits"]}


def start(args: argparse.Namespace) -> str:
    import ray
    from ray import serve

    from deployments.app import AppArgs, build_app
    args.temp_dir = tempfile.mkdtemp(prefix="ray-bench-cluster-", dir="/tmp")
    ray.init(address="local", num_cpus=args.ray_cpus, include_dashboard=False, log_to_driver=False,
             _temp_dir=args.temp_dir, _node_ip_address="127.0.0.1", object_store_memory=256 * 2**20)
    serve.start(http_options={"host": "127.0.0.1", "port": args.port})
    engine = dict(dtype="float32", max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                  num_blocks=args.num_blocks, max_model_len=args.max_model_len, block_size=16)
    common = dict(model=args.model, engine=engine, num_replicas=2, replica_num_cpus=args.ray_cpus * 0.2,
                  router_num_cpus=args.ray_cpus * 0.05, torch_threads=args.threads)
    kv = AppArgs(**common, request_router=json.loads(args.router))
    serve.run_many([serve.RunTarget(build_app(kv), name="kv", route_prefix="/kv"),
                    serve.RunTarget(build_app(AppArgs(**common, request_router=None)), name="p2c",
                                    route_prefix="/p2c")])
    url = f"http://127.0.0.1:{args.port}"
    for app in ROUTERS:
        for _ in range(4):
            httpx.post(f"{url}/{app}/v1/completions", json={"prompt": [7] * 40, "max_tokens": 4}, timeout=60)
    return url


def pct(xs: list[float], q: float) -> float:
    return 1000 * statistics.quantiles(xs, n=100, method="inclusive")[round(q * 100) - 1]


def table(res: dict[str, list[dict[str, Any]]]) -> str:
    rows = ["| router | TTFT p50 (ms) | TTFT p99 (ms) | output tok/s | prefix-cache hit rate | 429s |",
            "|---|---:|---:|---:|---:|---:|"]
    for app, runs in res.items():
        ttft = [t for r in runs for t in r["ttft"]]
        tps = sum(r["tokens"] for r in runs) / sum(r["elapsed"] for r in runs)
        hit = sum(r["hits"] for r in runs) / max(1, sum(r["queries"] for r in runs))
        rows.append(f"| {ROUTERS[app]} | {pct(ttft, .5):.1f} | {pct(ttft, .99):.1f} | {tps:.1f} | {hit:.1%} | "
                    f"{sum(r['refused'] for r in runs)} |")
    return "\n".join(rows)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="demo:tiny")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--requests", type=int, default=128, help="per round and router")
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--system-prompts", type=int, default=8)
    p.add_argument("--system-len", type=int, default=512)
    p.add_argument("--user-len", type=int, nargs=2, default=(32, 64))
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--num-blocks", type=int, default=224, help="per replica; about half the system prompts fit")
    p.add_argument("--router", default="{}", help="KV-aware router kwargs (RouterConfig fields), JSON")
    p.add_argument("--max-num-seqs", type=int, default=16)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--threads", type=int, default=1, help="torch threads per replica")
    p.add_argument("--ray-cpus", type=int, default=2)
    p.add_argument("--port", type=int, default=8124)
    args = p.parse_args()
    import ray
    from ray import serve
    url = start(args)
    try:
        res: dict[str, list[dict[str, Any]]] = {app: [] for app in ROUTERS}
        for rnd in range(args.rounds):
            prompts = make_round(args, seed=rnd)
            for app in (list(ROUTERS) if rnd % 2 == 0 else list(ROUTERS)[::-1]):
                res[app].append(asyncio.run(run(url, app, prompts, args)))
                r = res[app][-1]
                print(f"round {rnd} {app}: TTFT p50 {pct(r['ttft'], .5):.1f} ms, "
                      f"hit rate {r['hits'] / max(1, r['queries']):.1%}, {r['elapsed']:.1f} s", flush=True)
    finally:
        serve.shutdown()
        ray.shutdown()
        shutil.rmtree(args.temp_dir, ignore_errors=True)
    print(f"\n{args.model}, 2 replicas x {args.num_blocks} KV blocks, router {args.router}, {args.system_prompts} system prompts x "
          f"{args.system_len} tokens, {args.rounds} x {args.requests} requests, concurrency {args.concurrency}, "
          f"{args.max_tokens} output tokens\n")
    print(table(res))
    kv = pct([t for r in res["kv"] for t in r["ttft"]], .5)
    p2c = pct([t for r in res["p2c"] for t in r["ttft"]], .5)
    print(f"\nTTFT p50, KV-aware vs power of two: {100 * (kv / p2c - 1):+.1f}% (target -30%)")


if __name__ == "__main__":
    main()
