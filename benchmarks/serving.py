"""Serving over HTTP (Ray Serve + OpenAI API) vs the offline engine on the same workload.

Prints: offline tok/s with the engine core in this thread and in its own process; HTTP tok/s at saturation
(whole responses and SSE streams; one app deployed at a time) for the default (core in its own process), the
core in the replica's thread and a finer stream_interval (1); inter-chunk latency (ITL) p50/p99 under that load;
and, per app, interleaved request by request with a bare Serve app, the TTFT the Serve layer adds on loopback
(HTTP TTFT minus the replica's own time to first deltas). Prefix caching is off: runs repeat the prompts.
--haproxy adds Ray Serve's HAProxy ingress (default app), served by a second Ray
cluster in a subprocess (the flag is per cluster); --haproxy-only measures those rows alone, without the
Serve-proxy cluster idling beside them. Rounds go over every app in turn. The client is aiohttp.

    python -m benchmarks.serving --haproxy  # 256 requests x 64 tokens, 64 in flight
    python -m benchmarks.serving --quick  # minutes: 16 prompts x 16 tokens, one round, default and in-thread
"""

import argparse
import asyncio
import random
import time

import torch

from benchmarks.percentiles import percentile
from benchmarks.serving_apps import (
    APPS,
    apps_of,
    deploy_app,
    engine_options,
    floor_app,
    haproxy_deploy,
    serve_haproxy,
    start_haproxy_child,
    start_ray,
    stop_ray,
)
from benchmarks.serving_load import cpu_by_role, http_throughput, http_ttfts


def workload(n: int, lo: int, hi: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(4, 8192) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def offline_throughput(args: argparse.Namespace, prompts: list[list[int]], core_process: bool) -> tuple[float, int]:
    from conveyor.engine import LLM, SamplingParams

    llm = LLM(args.model, engine_core_process=core_process, **engine_options(args))
    sp = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    llm.generate([{"prompt_token_ids": p} for p in prompts[:4]], sp, use_tqdm=False)
    start = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    elapsed = time.perf_counter() - start
    llm.shutdown()
    return elapsed, sum(len(o.outputs[0].token_ids) for o in outs)


def ms(xs: list[float], q: float = 0.5) -> float:
    return 1000 * percentile(xs, q)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="demo:tiny")
    p.add_argument("--num-prompts", type=int, default=256)
    p.add_argument(
        "--concurrency",
        type=int,
        default=64,
        help="requests in flight over HTTP (saturation: 64 streams against 32 engine slots); offline "
        "gets every prompt at once",
    )
    p.add_argument("--prompt-len", type=int, nargs=2, default=(64, 192))
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--ttft-reps", type=int, default=30)
    p.add_argument("--max-num-seqs", type=int, default=32)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument(
        "--max-prefill-tokens-while-decoding",
        type=int,
        default=96,
        help="EngineConfig's (0: off); 96 is what serve_config.yaml ships",
    )
    p.add_argument(
        "--num-blocks",
        type=int,
        default=2048,
        help="room for 64 requests in flight, so that admission never refuses the benchmark",
    )
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--threads", type=int, default=1, help="torch threads, offline and in the replica")
    p.add_argument("--engine", default="{}", help="more EngineConfig fields, offline and in every app, JSON")
    p.add_argument("--ray-cpus", type=int, default=16, help="logical CPUs (several apps, most of them idle)")
    p.add_argument(
        "--stream-interval",
        type=int,
        default=4,
        help="replica: tokens per stream output (default app; 4 is what the app ships)",
    )
    p.add_argument("--stream-intervals", type=int, nargs="*", default=[1], help="extra apps with these intervals")
    p.add_argument("--haproxy", action="store_true", help="also measure Ray Serve's HAProxy ingress")
    p.add_argument(
        "--haproxy-only",
        action="store_true",
        help="only the HAProxy rows, with no second (Serve proxy) Ray cluster idling beside them",
    )
    p.add_argument("--apps", nargs="*", default=None, help=f"only these app prefixes ({', '.join(APPS)}, /siK/)")
    p.add_argument("--serve-haproxy", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, default=8123)
    p.add_argument(
        "--quick",
        action="store_true",
        help="16 prompts x 16 tokens, 8 TTFT requests, one round, default and in-thread apps only",
    )
    return p


def main() -> None:
    args = build_parser().parse_args()
    if args.quick:
        args.num_prompts, args.concurrency, args.max_tokens, args.ttft_reps, args.stream_intervals = 16, 16, 16, 8, []
    rounds = 1 if args.quick else 2
    torch.set_num_threads(args.threads)
    if args.serve_haproxy:
        return serve_haproxy(args)
    args.haproxy |= args.haproxy_only
    prompts = workload(args.num_prompts, *args.prompt_len, seed=0)
    ttft_prompts = workload(args.ttft_reps + 2, *args.prompt_len, seed=1)

    offline = {mode: [] for mode in (False, True)}
    for mode in (False, True, True, False)[: 2 * rounds]:
        offline[mode].append(offline_throughput(args, prompts, mode))
    print(
        f"workload: {args.num_prompts} prompts x {args.prompt_len[0]}-{args.prompt_len[1]} tokens -> "
        f"{args.max_tokens} tokens, greedy, ignore_eos; {args.threads} torch threads; model {args.model}"
    )
    for mode, name in ((False, "core in this thread"), (True, "core in own process")):
        runs = ", ".join(f"{n / t:.1f}" for t, n in offline[mode])
        print(f"offline, {name}: {runs} tok/s" + (" (best kept)" if rounds > 1 else ""))
    best = {mode: max(n / t for t, n in runs) for mode, runs in offline.items()}
    off_tps = max(best.values())
    print(f"offline core process / in-thread: {best[True] / best[False]:.3f}; baseline {off_tps:.1f} tok/s")

    names = {
        "/inthread/": "today (core in replica thread)",
        "/": "default (core process)",
        **{f"/si{k}/": f"stream_interval={k}" for k in args.stream_intervals},
    }
    url, child = f"http://127.0.0.1:{args.port}", None
    results: dict[tuple[str, bool], list] = {}
    added: dict[str, tuple[list[float], list[float]]] = {}

    def measure(name: str, prefix_url: str, floor_url: str) -> None:
        """Throughput (the best round kept), then the TTFT the Serve layer adds, interleaved with the bare app."""
        for stream in (False, True):
            before = cpu_by_role()
            r = asyncio.run(http_throughput(prefix_url, prompts, args.max_tokens, stream, args.model, args.concurrency))
            after = cpu_by_role()
            used = {k: 1000 * (after[k] - before.get(k, 0.0)) / r[1] for k in after}  # ms per token
            if (name, stream) not in results or r[1] / r[0] > results[name, stream][1] / results[name, stream][0]:
                results[name, stream] = (*r, used)
        ttfts = asyncio.run(http_ttfts({name: prefix_url, "bare Serve app": floor_url}, ttft_prompts, args.model))
        mine, bare = added.setdefault(name, ([], []))
        mine += ttfts[name]
        bare += ttfts["bare Serve app"]

    try:
        from ray import serve

        if not args.haproxy_only:
            start_ray(args, args.port)
            serve.run(floor_app(), name="floor", route_prefix="/floor")
        if args.haproxy:
            try:
                child = start_haproxy_child(args)
            except RuntimeError as e:
                print(f"HAProxy variant not measured: {e}")
        hap = f"http://127.0.0.1:{args.port + 1}"
        for _ in range(rounds):  # one model app deployed at a time: each idle app's Ray actors cost CPU too
            for prefix in {} if args.haproxy_only else apps_of(args):
                app = deploy_app(args, prefix)
                measure(names[prefix], f"{url}{prefix}", f"{url}/floor/")
                serve.delete(app)
            if child is not None:
                for prefix, name in (("/", "HAProxy ingress, default app"),):
                    if args.apps is not None and prefix not in args.apps:
                        continue
                    haproxy_deploy(child, prefix)
                    measure(name, f"{hap}{prefix}", f"{hap}/floor/")
                haproxy_deploy(child, "-")
    finally:
        if child is not None:
            child.stdin.close()
            child.wait(timeout=120)
        if not args.haproxy_only:
            stop_ray(args)

    print(
        f"HTTP throughput, {args.num_prompts} requests, at most {args.concurrency} in flight (best of {rounds} rounds, one model app deployed at a time) "
        f"vs offline {off_tps:.1f} tok/s; ITL = gaps between a stream's content chunks:"
    )
    for (name, stream), (t, n, load_ttft, gaps, _) in results.items():
        line = f"  {name:<36} {'stream' if stream else 'whole ':<6}: {n / t:7.1f} tok/s ({100 * n / t / off_tps:5.1f}%)"
        if stream and gaps:
            line += (
                f"  TTFT p50 {ms(load_ttft):6.1f} ms  ITL p50 {ms(gaps):5.1f} ms p99 {ms(gaps, 0.99):6.1f} ms "
                f"(p99/p50 {ms(gaps, 0.99) / ms(gaps):.2f})"
            )
        print(line)
    print("CPU ms per output token by process, in the run kept above (every Ray cluster's processes counted):")
    for (name, stream), (*_, used) in results.items():
        parts = "  ".join(f"{k} {v:.3f}" for k, v in sorted(used.items(), key=lambda kv: -kv[1]) if v >= 0.005)
        print(f"  {name:<36} {'stream' if stream else 'whole ':<6}: total {sum(used.values()):.3f} = {parts}")
    print(
        f"TTFT added by the Serve layer (HTTP TTFT - replica's own first-delta time), {args.ttft_reps} requests per "
        f"round, interleaved with a bare Serve app on the same ingress (Serve's proxy or HAProxy):"
    )
    for name, (xs, bare) in added.items():
        print(
            f"  {name:<36}: p50 {ms(xs):6.2f} ms  p90 {ms(xs, 0.9):6.2f} ms   bare app p50 {ms(bare):6.2f} ms  "
            f"difference {ms(xs) - ms(bare):+6.2f} ms"
        )


if __name__ == "__main__":
    main()
