"""The routing scenario of benchmarks/cluster.py: the KV-aware router against Ray Serve's power of two on
shared system prompts, and the hit rate of an oracle that knows every cache."""

import argparse
import asyncio
import json
import random
import time
from collections import OrderedDict
from typing import Any

from benchmarks.cluster_load import closed_loop, cluster_view, per_replica, rand_tokens, with_saturation
from benchmarks.cluster_setup import app_args, deploy
from benchmarks.percentiles import percentile

ROUTERS = {"kv": "KV-aware (real KV contents + headroom + queue)", "p2c": "Ray default (power of two)"}


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


def routing(url: str, args: argparse.Namespace) -> None:
    from ray import serve

    admission = json.loads(args.admission)
    apps = {
        "kv": app_args(args, request_router=json.loads(args.router), admission=admission),
        "p2c": app_args(args, request_router={"enabled": False}, admission=admission),
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
