"""`conveyor bench serve --disaggregated P,D`: deploys the model on a local Ray cluster twice, as P+D colocated
replicas and as P prefill + D decode replicas (app argument `disaggregation`), runs the same `bench serve` load
against each and prints TTFT / ITL / tok/s side by side, with the KV bytes the handoffs moved."""

import argparse
import asyncio
import time
from typing import Any

import ray
from ray import serve

from benchmarks.http_client import get_json
from benchmarks.serve_bench import print_summary, run

ENGINE = {"dtype": "float32", "max_num_seqs": 16, "max_num_batched_tokens": 256, "num_blocks": 256}


def deploy_and_wait(app: dict[str, Any], port: int) -> None:
    from conveyor.deployments.app import deploy

    deploy({**app, "port": port}, name="bench")
    deadline = time.time() + 300
    while time.time() < deadline:
        try:
            get_json(f"http://127.0.0.1:{port}/v1/models", timeout_s=5)
            return
        except (OSError, ValueError):
            pass
        time.sleep(1)
    raise TimeoutError("the app did not come up")


def handoff_bytes() -> tuple[int, int]:
    stats = serve.get_deployment_handle("LLMPrefill", app_name="bench").handoff_stats.remote().result()
    return int(stats["handoffs"]), int(stats["bytes"])


def main(args: argparse.Namespace) -> int:
    prefill, decode = (int(x) for x in args.disaggregated.split(","))
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, _node_ip_address="127.0.0.1")
    port = int(args.base_url.rsplit(":", 1)[1])
    args.base_url = f"http://127.0.0.1:{port}"
    common = {
        "model": args.model,
        "engine": ENGINE,
        "replica_num_cpus": 0.5,
        "router_num_cpus": 0.25,
        "torch_threads": 1,
    }
    layouts = {
        f"colocated x{prefill + decode}": {**common, "num_replicas": prefill + decode},
        f"disaggregated {prefill}P+{decode}D": {
            **common,
            "disaggregation": {"prefill_replicas": prefill, "decode_replicas": decode},
        },
    }
    rows = []
    for name, app in layouts.items():
        deploy_and_wait(app, port)
        result = asyncio.run(run(args))["summary"]
        moved = handoff_bytes() if "disaggregation" in app else (0, 0)
        serve.delete("bench")
        print(f"== {name}")
        print_summary(result)
        rows.append((name, result, moved))
    serve.shutdown()
    ray.shutdown()
    print("\n| layout | TTFT p50 | TTFT p99 | ITL p50 | ITL p99 | output tok/s | handoffs | KV MiB per handoff |")
    print("|---|---|---|---|---|---|---|---|")
    for name, s, (n, nbytes) in rows:
        ms = {k: {q: 1000 * (s[k][q] or 0) for q in ("p50", "p99")} for k in ("ttft_s", "itl_s")}
        per = f"{nbytes / n / 2**20:.2f}" if n else "-"
        print(
            f"| {name} | {ms['ttft_s']['p50']:.0f} ms | {ms['ttft_s']['p99']:.0f} ms | {ms['itl_s']['p50']:.1f} ms | "
            f"{ms['itl_s']['p99']:.1f} ms | {s['output_throughput']:.1f} | {n} | {per} |"
        )
    return 0 if all(s["completed"] for _, s, _ in rows) else 1
