"""`conveyor bench cluster`: the app on a multi-node Ray cluster started on this machine (every node on 127.0.0.1).

A head and `--nodes - 1` worker nodes, each offering one `conveyor_replica` (one replica per node). For k = 1 ..
`--nodes` replicas (one per node), the same closed-loop load (`conveyor bench serve`'s client, streamed, greedy,
ignore_eos) measures output tok/s and TTFT p50/p99, and each node's CPU use (its raylet's process tree, in cores).
Then the node-loss timeline: with every replica up, a closed loop of `--loss-concurrency` clients; a worker node's
raylet is killed (SIGKILL) at `--loss-at` s; requests in flight, answers and errors, and replicas per node (as
/v1/cluster sees them) are sampled every 0.25 s and drawn to `--plot`. On one machine the nodes share its cores:
scaling efficiency here is bounded by them, hence the per-node CPU."""

import argparse
import asyncio
import json
import os
import shutil
import socket
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp
import psutil

from benchmarks import serve_bench
from benchmarks.http_client import fetch_json, get_json, session

SLOT = "conveyor_replica"


def node_cpu_seconds(node: Any) -> float:
    """User + system CPU time of a node's raylet and every process under it (its workers, the replica)."""
    raylet = psutil.Process(node.all_processes["raylet"][0].process.pid)
    total = 0.0
    for p in [raylet, *raylet.children(recursive=True)]:
        try:
            t = p.cpu_times()
            total += t.user + t.system + t.children_user + t.children_system
        except psutil.NoSuchProcess:
            pass
    return total


def load_args(args: argparse.Namespace, url: str, **over: Any) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    serve_bench.add_args(p)
    a = p.parse_args(
        [
            f"--base-url={url}",
            f"--model={args.model}",
            f"--num-requests={args.requests}",
            f"--concurrency={args.concurrency}",
            f"--prompt-len={args.prompt_len}",
            f"--output-len={args.output_len}",
            "--quiet",
        ]
    )
    for k, v in over.items():
        setattr(a, k, v)
    return a


def deploy(args: argparse.Namespace, replicas: int, port: int) -> str:
    from ray import serve

    from conveyor.deployments.app import AppArgs, build_app

    app = AppArgs(
        model=args.model,
        num_replicas=replicas,
        replica_num_cpus=0.25,
        router_num_cpus=0.1,
        torch_threads=1,
        replica_node_resource=SLOT,
        engine={"dtype": "float32", "max_num_seqs": 32, "num_blocks": 512, "max_model_len": 1024},
    )
    serve.delete("default")  # a new app, not an update: Serve refuses to change a placement-grouped deployment
    serve.run(build_app(app), name="default", route_prefix="/")
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 300
    while time.time() < deadline:
        try:
            rows = get_json(f"{url}/v1/cluster", timeout_s=10)["replicas"]
            if sum(r["fresh"] for r in rows) == replicas:
                return url
        except (OSError, ValueError, KeyError):
            pass
        time.sleep(1)
    raise RuntimeError(f"{replicas} replicas did not report within 300 s")


def scaling(args: argparse.Namespace, cluster: Any, port: int) -> list[dict[str, Any]]:
    nodes = [cluster.head_node, *cluster.worker_nodes]
    rows = []
    for k in range(1, args.nodes + 1):
        url = deploy(args, k, port)
        asyncio.run(serve_bench.run(load_args(args, url, num_requests=min(args.requests, 2 * args.concurrency))))
        before, t0 = [node_cpu_seconds(n) for n in nodes], time.time()
        result = asyncio.run(serve_bench.run(load_args(args, url)))["summary"]
        wall = time.time() - t0
        cores = [(node_cpu_seconds(n) - b) / wall for n, b in zip(nodes, before)]
        rows.append(
            {
                "replicas": k,
                "output_tok_s": result["output_throughput"],
                "ttft_p50_s": result["ttft_s"]["p50"],
                "ttft_p99_s": result["ttft_s"]["p99"],
                "failed": result["failed"],
                "node_cores": cores,
            }
        )
        print(
            f"{k} node(s): {result['output_throughput']:.1f} out tok/s, TTFT p50 {result['ttft_s']['p50']:.3f} s "
            f"p99 {result['ttft_s']['p99']:.3f} s, failed {result['failed']}, cores per node "
            + " ".join(f"{c:.2f}" for c in cores)
        )
    return rows


async def loss_timeline(args: argparse.Namespace, cluster: Any, url: str) -> dict[str, Any]:
    """A closed loop until `--loss-duration`, the victim's raylet killed at `--loss-at`; samples every 0.25 s."""
    client = serve_bench.Client(load_args(args, url))
    victim = next(iter(cluster.worker_nodes))
    starts: dict[int, float] = {}
    ends: dict[int, tuple[float, bool]] = {}
    samples: list[dict[str, Any]] = []
    t0 = time.perf_counter()
    killed_at: float | None = None

    async def worker(http: aiohttp.ClientSession, w: int) -> None:
        i = w
        while time.perf_counter() - t0 < args.loss_duration:
            r = serve_bench.RequestResult(0.0, 64)
            starts[i] = time.perf_counter() - t0
            await client.send(http, client.body(list(range(5, 5 + 64 + i % 64)), 48), r, t0)
            ends[i] = (time.perf_counter() - t0, r.ok)
            i += args.loss_concurrency

    async def sample(http: aiohttp.ClientSession) -> None:
        nonlocal killed_at
        while time.perf_counter() - t0 < args.loss_duration + 30 and (
            len(ends) < len(starts) or time.perf_counter() - t0 < args.loss_duration
        ):
            now = time.perf_counter() - t0
            if killed_at is None and now >= args.loss_at:
                killed_at = now
                cluster.remove_node(victim, allow_graceful=False)
            try:
                rows = (await fetch_json(http, f"{url}/v1/cluster", timeout_s=5))["replicas"]
            except (aiohttp.ClientError, asyncio.TimeoutError, ValueError, KeyError):
                rows = []
            per_node: dict[str, int] = {}
            for row in rows:
                if row["fresh"]:
                    per_node[row["node_id"][:8]] = per_node.get(row["node_id"][:8], 0) + 1
            samples.append(
                {
                    "t": now,
                    "in_flight": sum(1 for i in starts if i not in ends),
                    "ok": sum(ok for _, ok in ends.values()),
                    "errors": sum(not ok for _, ok in ends.values()),
                    "replicas_per_node": per_node,
                }
            )
            await asyncio.sleep(0.25)

    async with session(args.loss_concurrency + 4, 120, connect_s=30) as http:
        await asyncio.gather(sample(http), *(worker(http, w) for w in range(args.loss_concurrency)))
    errors_after = [t for t, ok in ends.values() if not ok and killed_at is not None and t >= killed_at]
    return {
        "victim": victim.node_id,
        "killed_at_s": killed_at,
        "samples": samples,
        "requests": len(starts),
        "errors": sum(not ok for _, ok in ends.values()),
        "last_error_after_kill_s": max(errors_after) - killed_at if errors_after else None,
    }


def timeline_chart(loss: dict[str, Any], path: Path) -> None:
    from benchmarks.charts import plt

    s = loss["samples"]
    t = [x["t"] for x in s]
    nodes = sorted({n for x in s for n in x["replicas_per_node"]})
    fig, axes = plt.subplots(3, 1, figsize=(8, 6), dpi=80, sharex=True)
    axes[0].plot(t, [x["in_flight"] for x in s], drawstyle="steps-post")
    axes[0].set_ylabel("in flight", fontsize=8)
    axes[1].plot(t, [x["ok"] for x in s], drawstyle="steps-post", label="answered")
    axes[1].plot(t, [x["errors"] for x in s], drawstyle="steps-post", color="#d95f02", label="errors")
    axes[1].set_ylabel("requests (cum.)", fontsize=8)
    axes[1].legend(fontsize=7)
    for n in nodes:
        axes[2].plot(t, [x["replicas_per_node"].get(n, 0) for x in s], drawstyle="steps-post", label=f"node {n}")
    axes[2].set_ylabel("replicas", fontsize=8)
    axes[2].set_xlabel("s", fontsize=8)
    axes[2].legend(fontsize=7)
    for ax in axes:
        ax.axvline(loss["killed_at_s"], color="red", lw=1, ls="--")
        ax.grid(alpha=0.3)
    fig.suptitle(f"node loss under load ({loss['requests']} requests, {loss['errors']} errors)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--nodes", type=int, default=3, help="the head and nodes-1 workers, one replica each")
    p.add_argument("--model", default="demo:tiny")
    p.add_argument("--requests", type=int, default=96)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--prompt-len", default="uniform:32,256")
    p.add_argument("--output-len", default="uniform:16,128")
    p.add_argument("--loss-concurrency", type=int, default=48)
    p.add_argument("--loss-at", type=float, default=8.0, help="s into the node-loss run")
    p.add_argument("--loss-duration", type=float, default=25.0, help="s of load in the node-loss run")
    p.add_argument("--out", type=Path, default=Path("bench-cluster.json"))
    p.add_argument("--plot", type=Path, default=Path("bench-cluster.png"))


def main(args: argparse.Namespace) -> int:
    if args.nodes < 2:
        raise ValueError("--nodes must be >= 2 (a node is lost in the timeline)")
    import ray
    from ray import serve
    from ray._private import ray_constants
    from ray.cluster_utils import Cluster

    from conveyor.deployments.ingress import use_haproxy

    ray_constants.ENABLE_RAY_CLUSTER = False  # every node on 127.0.0.1
    tmp = tempfile.mkdtemp(prefix="ray-bench-", dir="/tmp")
    os.makedirs("/tmp/ray", exist_ok=True)
    use_haproxy(False, tmp)
    node = dict(node_ip_address="127.0.0.1", object_store_memory=80 * 2**20, temp_dir=tmp, resources={SLOT: 1})
    health = {"health_check_period_ms": 1000, "health_check_timeout_ms": 1000, "health_check_failure_threshold": 5}
    head = dict(num_cpus=1, include_dashboard=False, _system_config=health, **node)
    cluster = Cluster(initialize_head=True, head_node_args=head)
    for _ in range(args.nodes - 1):
        cluster.add_node(num_cpus=1, **node)
    ray.init(address=cluster.address, log_to_driver=False)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    try:
        serve.start(proxy_location="HeadOnly", http_options={"host": "127.0.0.1", "port": port})
        rows = scaling(args, cluster, port)
        loss = asyncio.run(loss_timeline(args, cluster, f"http://127.0.0.1:{port}"))
        print(
            f"node loss: {loss['requests']} requests, {loss['errors']} errors, the last error "
            f"{loss['last_error_after_kill_s']} s after the kill"
        )
        args.out.write_text(
            json.dumps({"config": {**vars(args), "func": None}, "scaling": rows, "loss": loss}, default=str)
        )
        timeline_chart(loss, args.plot)
        print(f"wrote {args.out} and {args.plot}")
    finally:
        serve.shutdown()
        ray.shutdown()
        cluster.shutdown()
        shutil.rmtree(tmp, ignore_errors=True)
    return 0
