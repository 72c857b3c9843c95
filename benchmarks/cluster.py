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

from benchmarks.cluster_overload import overload
from benchmarks.cluster_routing import routing
from benchmarks.cluster_setup import start_ray
from benchmarks.local_ray import stop_local_ray
from conveyor.deployments.ingress import haproxy_enabled


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
        stop_local_ray(args.temp_dir)


if __name__ == "__main__":
    main()
