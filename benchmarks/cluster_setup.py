"""The local Ray cluster the cluster benchmarks run on (Serve's proxy or HAProxy ingress) and their apps: two
replicas each, the engine fields from the command line."""

import argparse
import json
import socket
import time
from typing import Any

from benchmarks.http_client import post_json
from benchmarks.local_ray import ray_temp_dir, start_local_ray
from conveyor.deployments.ingress import use_haproxy


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
    from ray.serve._private.constants import RAY_SERVE_HAPROXY_METRICS_PORT, RAY_SERVE_HAPROXY_STATS_PORT

    extra = [("0.0.0.0", RAY_SERVE_HAPROXY_STATS_PORT), ("0.0.0.0", RAY_SERVE_HAPROXY_METRICS_PORT)]
    wait_for_ports([("127.0.0.1", args.port), *(extra if args.haproxy else [])])
    args.temp_dir = ray_temp_dir("ray-bench-cluster-")
    use_haproxy(args.haproxy, args.temp_dir)
    print(f"ingress: {'HAProxy, direct to the router replicas' if args.haproxy else 'Serve proxy'}", flush=True)
    return start_local_ray(args.ray_cpus, args.port, args.temp_dir)


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
            post_json(f"{url}/{name}/v1/completions", {"prompt": [7] * 40, "max_tokens": 4}, timeout_s=60)
