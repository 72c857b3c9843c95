"""The overload and two-routers scenarios of benchmarks/cluster.py: open-loop arrivals at a multiple of the
measured capacity; admitted TTFT, refusals, lost requests, pools whole afterwards, KV pressure over time."""

import argparse
import asyncio
import json
import os
import random
import time
from collections import Counter
from pathlib import Path

from benchmarks.cluster_load import closed_loop, open_loop, rand_tokens
from benchmarks.cluster_setup import app_args, deploy
from benchmarks.percentiles import percentile


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
                admission={"max_queue_time_s": args.max_queue_time, **json.loads(args.admission)},
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
