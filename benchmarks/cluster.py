"""The cluster layer on one local Ray cluster, three scenarios (python -m benchmarks.cluster --scenario ...):

routing      KV-aware router vs Ray Serve's power-of-two router, 2 apps of 2 replicas side by side, same
             requests: a few long system prompts shared by many users (system + short user message,
             streamed, greedy); each round uses fresh system prompts, rounds alternate which app goes
             first; the KV caches hold about half the system prompts. Each app first serves `--warmup`
             unmeasured requests of unrelated prompts. Prints TTFT p50/p99 (from a
             request's first attempt; a 429 is retried after its Retry-After), output tok/s, prefix-cache
             hit rate, and the hit rate of an oracle that knows every replica's cache (a sequential
             simulation: each request goes to the replica with the longest cached prefix, LRU caches of the
             replicas' size). Targets: TTFT p50 <= -35%, p99 not worse, hit rate within 5 points of oracle.
overload     10x overload with max_queue_time_s (default 2): the cluster's capacity (requests/s) is
             measured closed-loop, then requests arrive open-loop (Poisson) at 10x that for a while; a 429
             is not retried. Prints admitted TTFT p50/p99 (target p99 <= 2.5 s), 200/429 counts, 429s
             without Retry-After, requests lost (neither a full 200 nor a 429), whether both block pools
             are whole afterwards.
two-routers  the overload through 2 router replicas, KV cache the binding limit (long prompts, small
             cache): replica KV pressure sampled from the admission actor every 20 ms; prints the longest
             time any replica stayed above its high watermark (target: <= one refresh interval).

    python -m benchmarks.cluster --scenario routing [--rounds 2 --requests 128 --concurrency 8]
    python -m benchmarks.cluster --scenario overload [--overload 10 --max-queue-time 2 --duration 10]
    python -m benchmarks.cluster --scenario two-routers
"""

import argparse
import asyncio
import json
import os
import random
import shutil
import socket
import tempfile
import time
from collections import Counter, OrderedDict
from pathlib import Path
from typing import Any

import httpx

from benchmarks.percentiles import percentile
from benchmarks.sse import read_completion_stream, server_timing_ms
from conveyor.deployments.ingress import haproxy_enabled, use_haproxy

ROUTERS = {"kv": "KV-aware (real KV contents + headroom + queue)", "p2c": "Ray default (power of two)"}


def rand_tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(4, 8000) for _ in range(n)]


def make_round(args: argparse.Namespace, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    systems = [rand_tokens(rng, args.system_len) for _ in range(args.system_prompts)]
    return [rng.choice(systems) + rand_tokens(rng, rng.randint(*args.user_len)) for _ in range(args.requests)]


def oracle_hit_rate(
    rounds: list[list[list[int]]], num_blocks: int, max_tokens: int, replicas: int = 2, block_size: int = 16
) -> float:
    """Each request to the replica whose LRU cache holds the longest prefix of it (ties: fewest requests). As
    in the engine, the full blocks of its output are cached too (keys no other request has); unlike it, no
    block is ever pinned by a running request, so the oracle's caches hold more: an upper bound."""
    from conveyor.engine.core.prefix_hash import block_hashes

    caches: list[OrderedDict] = [OrderedDict() for _ in range(replicas)]
    sent, hits, queries, served = [0] * replicas, 0, 0, 0
    for prompts in rounds:
        for p in prompts:
            served += 1
            keys = block_hashes(p, block_size)
            tail = [(served, i) for i in range((len(p) + max_tokens) // block_size - len(keys))]

            def held(c: OrderedDict) -> int:
                return next((i for i, k in enumerate(keys) if k not in c), len(keys))

            r = max(range(replicas), key=lambda i: (held(caches[i]), -sent[i]))
            sent[r] += 1
            queries += len(p)
            hits += min(held(caches[r]) * block_size, len(p) - 1)
            for k in keys + tail:
                caches[r][k] = None
                caches[r].move_to_end(k)
            while len(caches[r]) > num_blocks:
                caches[r].popitem(last=False)
    return hits / queries


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


def wait_for_ports(ports: list[tuple[str, int]], timeout_s: float = 60.0) -> None:
    """Until each (host, port) can be bound: a run started right after another found the last one's HAProxy
    still holding its ports, and the new HAProxy exited."""
    deadline = time.monotonic() + timeout_s
    for host, port in ports:
        while True:
            with socket.socket() as s:
                s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                try:
                    s.bind((host, port))
                    break
                except OSError:
                    if time.monotonic() > deadline:
                        raise RuntimeError(f"port {host}:{port} still in use after {timeout_s:g} s") from None
            time.sleep(0.5)


def start_ray(args: argparse.Namespace) -> str:
    import ray
    from ray import serve
    from ray.serve._private.constants import RAY_SERVE_HAPROXY_METRICS_PORT, RAY_SERVE_HAPROXY_STATS_PORT

    extra = [("0.0.0.0", RAY_SERVE_HAPROXY_STATS_PORT), ("0.0.0.0", RAY_SERVE_HAPROXY_METRICS_PORT)]
    wait_for_ports([("127.0.0.1", args.port), *(extra if args.haproxy else [])])
    args.temp_dir = tempfile.mkdtemp(prefix="ray-bench-cluster-", dir="/tmp")
    use_haproxy(args.haproxy, args.temp_dir)
    print(f"ingress: {'HAProxy, direct to the router replicas' if args.haproxy else 'Serve proxy'}", flush=True)
    ray.init(
        address="local",
        num_cpus=args.ray_cpus,
        include_dashboard=False,
        log_to_driver=False,
        _temp_dir=args.temp_dir,
        _node_ip_address="127.0.0.1",
        object_store_memory=256 * 2**20,
    )
    serve.start(http_options={"host": "127.0.0.1", "port": args.port})
    return f"http://127.0.0.1:{args.port}"


def app_args(args: argparse.Namespace, **over: Any) -> Any:
    from conveyor.deployments.app import AppArgs

    engine = {
        **dict(
            dtype="float32",
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            num_blocks=args.num_blocks,
            max_model_len=args.max_model_len,
            block_size=16,
        ),
        **json.loads(args.engine),
        **over.pop("engine", {}),
    }
    common = dict(
        model=args.model,
        engine=engine,
        num_replicas=2,
        replica_num_cpus=args.ray_cpus * 0.2,
        router_num_cpus=args.ray_cpus * 0.05,
        torch_threads=args.threads,
    )
    return AppArgs(**{**common, **over})


def deploy(url: str, apps: dict[str, Any]) -> None:
    from ray import serve

    from conveyor.deployments.app import build_app

    serve.run_many([serve.RunTarget(build_app(a), name=name, route_prefix=f"/{name}") for name, a in apps.items()])
    for name in apps:
        for _ in range(4):
            httpx.post(f"{url}/{name}/v1/completions", json={"prompt": [7] * 40, "max_tokens": 4}, timeout=60)


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


def routing(url: str, args: argparse.Namespace) -> None:
    from ray import serve

    admission = json.loads(args.admission)
    apps = {
        "kv": app_args(args, request_router=json.loads(args.router), admission=admission),
        "p2c": app_args(args, request_router=None, admission=admission),
    }
    names = [a for a in ROUTERS if a in args.apps.split(",")]
    deploy(url, {a: apps[a] for a in names})
    rng = random.Random(999)  # prompts of the workload's shape that share nothing with it
    warm = [rand_tokens(rng, args.system_len + rng.randint(*args.user_len)) for _ in range(args.warmup)]
    for app in names:  # a fresh replica's first requests pay one-off costs: they went to whichever app ran first
        asyncio.run(closed_loop(url, f"/{app}", warm, args.max_tokens, args.concurrency))
    time.sleep(args.warmup_pause_s)
    res: dict[str, list[dict[str, Any]]] = {app: [] for app in names}
    rounds = [make_round(args, seed=r) for r in range(args.rounds)]
    for rnd, prompts in enumerate(rounds):
        for app in names if rnd % 2 == 0 else names[::-1]:
            actor = serve.get_deployment_handle("LLMReplica", app_name=app).admission.remote().result()
            view = asyncio.run(cluster_view(url, f"/{app}"))
            (out, elapsed), saturated = asyncio.run(
                with_saturation(actor, closed_loop(url, f"/{app}", prompts, args.max_tokens, args.concurrency))
            )
            time.sleep(0.5)
            view_after = asyncio.run(cluster_view(url, f"/{app}"))
            before, after = view["totals"], view_after["totals"]
            r = {
                "ttft": [o["ttft"] for o in out if o["status"] == 200],
                "tokens": sum(o.get("tokens", 0) for o in out),
                "inside": [
                    (o["router_ttft"], o["replica_ttft"], o["ingress"], o["egress"], o["admission"])
                    for o in out
                    if o.get("admission") is not None
                ],
                "elapsed": elapsed,
                "refused": sum(o["refused"] for o in out),
                "queries": after["prefix_cache_queries"] - before["prefix_cache_queries"],
                "hits": after["prefix_cache_hits"] - before["prefix_cache_hits"],
            }
            res[app].append(r)
            split = ", ".join(f"{n} req at {h:.0%} hits" for n, h in per_replica(view, view_after))
            print(
                f"round {rnd} {app}: TTFT p50 {1000 * percentile(r['ttft'], 0.5):.1f} ms, p99 {1000 * percentile(r['ttft'], 0.99):.1f} "
                f"ms, hit rate {r['hits'] / max(1, r['queries']):.1%}, {elapsed:.1f} s; replicas: {split}; a replica "
                f"saturated in {saturated:.0%} of samples",
                flush=True,
            )
    oracle = oracle_hit_rate(rounds, args.num_blocks, args.max_tokens)
    print(
        f"\n{args.model}, 2 replicas x {args.num_blocks} KV blocks, router {args.router}, {args.system_prompts} system "
        f"prompts x {args.system_len} tokens, {args.rounds} x {args.requests} requests, concurrency "
        f"{args.concurrency}, {args.max_tokens} output tokens\n"
    )
    print("| router | TTFT p50 (ms) | TTFT p99 (ms) | output tok/s | prefix-cache hit rate | 429s |")
    print("|---|---:|---:|---:|---:|---:|")
    stat = {}
    for app, runs in res.items():
        ttft = [t for r in runs for t in r["ttft"]]
        tps = sum(r["tokens"] for r in runs) / sum(r["elapsed"] for r in runs)
        hit = sum(r["hits"] for r in runs) / max(1, sum(r["queries"] for r in runs))
        stat[app] = (percentile(ttft, 0.5), percentile(ttft, 0.99), hit)
        print(
            f"| {ROUTERS[app]} | {1000 * stat[app][0]:.1f} | {1000 * stat[app][1]:.1f} | {tps:.1f} | {hit:.1%} | "
            f"{sum(r['refused'] for r in runs)} |"
        )
    print(f"| oracle (knows every cache; sequential simulation) | | | | {oracle:.1%} | |")
    for app, runs in res.items():
        inside = [x for r in runs for x in r["inside"]]
        if inside:
            router, replica, ingress, egress, admission = ([x[i] for x in inside] for i in range(5))
            print(
                f"{ROUTERS[app]}: TTFT inside the router p50/p99 {1000 * percentile(router, 0.5):.1f} / "
                f"{1000 * percentile(router, 0.99):.1f} ms, of which in the replica (arrival to first token) "
                f"{1000 * percentile(replica, 0.5):.1f} / {1000 * percentile(replica, 0.99):.1f} ms; p50 of router receipt to engine "
                f"arrival {1000 * percentile(ingress, 0.5):.1f} ms (to the handle call {1000 * percentile(admission, 0.5):.1f} ms, p99 "
                f"{1000 * percentile(admission, 0.99):.1f}), of first token out to the router "
                f"{1000 * percentile(egress, 0.5):.1f} ms"
            )
    if len(stat) < 2:
        return
    print(
        f"\nKV-aware vs power of two: TTFT p50 {100 * (stat['kv'][0] / stat['p2c'][0] - 1):+.1f}% (target <= -35%), "
        f"p99 {100 * (stat['kv'][1] / stat['p2c'][1] - 1):+.1f}% (target <= 0); hit rate "
        f"{100 * (stat['kv'][2] - oracle):+.1f} points vs oracle (target within 5)"
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


def preemptions_seen(samples: list[tuple], before: int = 4) -> list[str]:
    """Each preemption during the sampled window, with the admission actor's book on that replica just before."""
    lines = []
    for i in range(1, len(samples)):
        for rid, row in samples[i][2].items():
            was = samples[i - 1][2].get(rid)
            if was is not None and row[3] > was[3]:
                book = [samples[j][3].get(rid) for j in range(max(0, i - before), i + 1)]
                lines.append(f"preemption on {rid} at {samples[i][0] - samples[0][0]:.2f} s; book before: {book}")
    return lines


def longest_above(samples: list[tuple], high: float) -> float:
    longest, since = 0.0, {}
    for t, rows, *_ in samples:
        for rid, p in rows.items():
            if p > high:
                since.setdefault(rid, t)
                longest = max(longest, t - since[rid])
            else:
                since.pop(rid, None)
    return longest


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


def overload(url: str, args: argparse.Namespace, routers: int) -> None:
    import ray
    from ray import serve

    kv_bound = args.scenario == "two-routers" or routers > 1
    name = f"slo{routers}" + ("kv" if kv_bound else "")
    engine = {"num_blocks": args.kv_bound_blocks} if kv_bound else {}
    deploy(
        url,
        {
            name: app_args(
                args,
                engine=engine,
                router_replicas=routers,
                max_queue_time_s=args.max_queue_time,
                admission=json.loads(args.admission),
            )
        },
    )
    prompt_len = tuple(args.kv_bound_prompt_len if kv_bound else args.overload_prompt_len)
    rng = random.Random(7)
    warm = [rand_tokens(rng, rng.randint(*prompt_len)) for _ in range(args.capacity_requests)]
    out, elapsed = asyncio.run(closed_loop(url, f"/{name}", warm, args.overload_max_tokens, 2 * args.max_num_seqs))
    capacity = sum(o["status"] == 200 for o in out) / elapsed
    rate = args.rate or args.overload * capacity
    print(
        f"\n{name}: {routers} router replica(s), admission {args.admission}, capacity {capacity:.2f} req/s closed-loop "
        f"({2 * args.max_num_seqs} clients); offering {rate:.1f} req/s for {args.duration:.0f} s",
        flush=True,
    )
    actor = serve.get_deployment_handle("LLMReplica", app_name=name).admission.remote().result()
    results, samples = asyncio.run(
        open_loop(url, f"/{name}", rate, args.duration, prompt_len, args.overload_max_tokens, seed=11, actor=actor)
    )
    ok = [r for r in results if r["status"] == 200 and r["tokens"] == args.overload_max_tokens]
    refused = [r for r in results if r["status"] == 429]
    no_retry_after = sum(1 for r in refused if not r.get("retry_after"))
    lost = len(results) - len(ok) - len(refused)
    kinds = Counter(
        f"{r['status']} {r.get('code') or ''}".strip() if r["status"] != 200 else f"200 with {r['tokens']} tokens"
        for r in results
        if r not in ok and r not in refused
    )
    deadline, whole = time.time() + 30, False
    while time.time() < deadline and not whole:
        snap = ray.get(actor.snapshot.remote())
        whole = (
            all(
                r["kv_blocks_free"] == r["kv_blocks_total"] and r["num_running"] == r["num_waiting"] == 0
                for r in snap["replicas"]
            )
            and len(snap["replicas"]) == 2
        )
        time.sleep(0.2)
    ttft = [r["ttft"] for r in ok]
    codes = sorted({r.get("code") for r in refused} - {None})
    high = snap["config"]["high_watermark"]
    print(
        f"| requests | 200 (complete) | 429 | 429 without Retry-After | lost | admitted TTFT p50 | admitted TTFT p99 "
        f"| pools whole after |\n|---:|---:|---:|---:|---:|---:|---:|---|\n| {len(results)} | {len(ok)} | "
        f"{len(refused)} ({', '.join(codes)}) | {no_retry_after} | {lost}{f' ({dict(kinds)})' if kinds else ''} | "
        f"{percentile(ttft, 0.5):.2f} s | "
        f"{percentile(ttft, 0.99):.2f} s | {whole} |"
    )
    router_ttft = [r["router_ttft"] for r in ok if r.get("router_ttft") is not None]
    if router_ttft and refused:
        refusal = [r["latency"] for r in refused]
        print(
            f"admitted TTFT inside the router (Server-Timing) p50/p99 {percentile(router_ttft, 0.5):.2f} / "
            f"{percentile(router_ttft, 0.99):.2f} s; a 429's latency at the client p50/p99 {percentile(refusal, 0.5):.2f} / "
            f"{percentile(refusal, 0.99):.2f} s"
        )
    if lost:
        print("lost:", [r for r in results if r not in ok and r not in refused][:5])
    if os.environ.get("CONVEYOR_BENCH_DUMP"):
        Path(os.environ["CONVEYOR_BENCH_DUMP"]).write_text(json.dumps(samples))
    preempted = preemptions_seen(samples)
    print(f"preemptions while arrivals ran: {len(preempted)}")
    for line in preempted[:4]:
        print(line)
    peak = max((p for _, rows, *_ in samples for p in rows.values()), default=0.0)
    t0 = samples[0][0] if samples else 0.0
    for r in sorted(ok, key=lambda r: -r["ttft"])[:3]:
        at = next((q for t, _, q, _ in samples if t >= r["sent"]), None)
        print(
            f"slow: sent at {r['sent'] - t0:.2f} s, TTFT {r['ttft']:.2f} s; replicas (running, waiting, estimated "
            f"queue s, preemptions) then: {at}"
        )
    print(
        f"KV pressure sampled every 20 ms ({len(samples)} samples): peak {peak:.2f}, longest above the high "
        f"watermark {high:.2f}: {1000 * longest_above(samples, high):.0f} ms (stats push 100 ms, router refresh "
        f"50 ms); target admitted TTFT p99 <= {args.max_queue_time + 0.5:.1f} s"
    )
    serve.delete(name)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--scenario", choices=["routing", "overload", "two-routers", "all"], default="routing")
    p.add_argument("--model", default="demo:tiny")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--requests", type=int, default=128, help="per round and router")
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--system-prompts", type=int, default=8)
    p.add_argument("--system-len", type=int, default=512)
    p.add_argument("--user-len", type=int, nargs=2, default=(32, 64))
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--num-blocks", type=int, default=224, help="per replica; about half the system prompts fit")
    p.add_argument("--apps", default="kv,p2c", help="routing: which routers to run (kv, p2c)")
    p.add_argument("--warmup", type=int, default=32, help="routing: unmeasured requests per app first")
    p.add_argument("--warmup-pause-s", type=float, default=0.0, help="routing: seconds between warm-up and round 0")
    p.add_argument("--router", default="{}", help="KV-aware router kwargs (RouterConfig fields), JSON")
    p.add_argument("--engine", default="{}", help="EngineConfig fields for every app, JSON")
    p.add_argument("--admission", default="{}", help="AdmissionConfig fields for every app, JSON")
    p.add_argument("--routers", type=int, default=2, help="two-routers: router replicas")
    p.add_argument("--overload", type=float, default=10.0, help="offered load / measured capacity")
    p.add_argument("--rate", type=float, default=0.0, help="offer this many req/s instead of overload x capacity")
    p.add_argument("--max-queue-time", type=float, default=2.0)
    p.add_argument("--duration", type=float, default=10.0, help="seconds of open-loop arrivals")
    p.add_argument("--capacity-requests", type=int, default=48)
    p.add_argument("--overload-prompt-len", type=int, nargs=2, default=(64, 128))
    p.add_argument("--overload-max-tokens", type=int, default=128)
    p.add_argument("--kv-bound-blocks", type=int, default=96, help="two-routers: per replica, below what slots hold")
    p.add_argument("--kv-bound-prompt-len", type=int, nargs=2, default=(160, 256))
    p.add_argument("--max-num-seqs", type=int, default=16)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--threads", type=int, default=1, help="torch threads per replica")
    p.add_argument("--ray-cpus", type=int, default=2)
    p.add_argument("--port", type=int, default=8124)
    p.add_argument(
        "--haproxy",
        action=argparse.BooleanOptionalAction,
        default=haproxy_enabled(),
        help="Serve's HAProxy ingress (direct ingress to the routers) instead of Serve's proxy",
    )
    args = p.parse_args()
    import ray
    from ray import serve

    url = start_ray(args)
    try:
        if args.scenario in ("routing", "all"):
            routing(url, args)
            for app in args.apps.split(","):
                serve.delete(app)
        if args.scenario in ("overload", "all"):
            overload(url, args, routers=1)
        if args.scenario in ("two-routers", "all"):
            overload(url, args, routers=args.routers)
    finally:
        serve.shutdown()
        ray.shutdown()
        shutil.rmtree(args.temp_dir, ignore_errors=True)


if __name__ == "__main__":
    main()
