"""`python -m conveyor.deployments.launch serve_config.yaml` (or `conveyor-serve`): deploys a Serve config file as
`serve run` does (Ray Serve's own ServeDeploySchema and deploy path), and on SIGINT or SIGTERM drains before
shutting Serve down: the routers refuse new requests (503 `shutting_down` + Retry-After), the requests in flight
finish, anything still running at `--drain-timeout` ends with an explicit error (503 `drain_timeout`, or an SSE
error event then [DONE]); then Serve shuts down and the process exits 0. A second signal ends what is still in
flight at once, with the same explicit errors, then shuts down and exits 1."""

import argparse
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

import ray
import yaml
from ray import serve
from ray.serve._private import api as serve_api
from ray.serve._private.constants import SERVE_NAMESPACE
from ray.serve.config import gRPCOptions
from ray.serve.schema import ServeDeploySchema

from conveyor.deployments.drain import DRAIN_SIGNAL, DrainSignal


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="conveyor-serve", description=__doc__.split("\n\n")[0])
    p.add_argument("config", help="a Serve config file (the schema `serve run` reads)")
    p.add_argument("--address", default=os.environ.get("RAY_ADDRESS"), help="Ray cluster address (as serve run)")
    p.add_argument(
        "--drain-timeout",
        type=float,
        default=30.0,
        help="seconds the requests in flight get to finish after the first SIGINT/SIGTERM (default 30)",
    )
    args = p.parse_args(argv)
    if args.drain_timeout <= 0:
        p.error("--drain-timeout: must be > 0")
    return args


def load_config(path: str) -> ServeDeploySchema:
    return ServeDeploySchema.model_validate(yaml.safe_load(Path(path).read_text()))


def deploy(config: ServeDeploySchema) -> None:
    client = serve_api.serve_start(
        http_options=config.http_options.model_dump(),
        proxy_location=config.proxy_location,
        grpc_options=gRPCOptions(**config.grpc_options.model_dump()),
        controller_options=config.controller_options,
    )
    client.deploy_apps(config, _blocking=False)


def drain(actor: Any, timeout_s: float, grace_s: float = 15.0) -> dict[str, Any]:
    """Start the drain and wait until every router that subscribed has reported (or timeout + grace)."""
    watchers = ray.get(actor.start.remote(timeout_s))
    print(
        f"draining: {watchers} router(s) refuse new requests; in-flight requests get up to {timeout_s:g}s", flush=True
    )
    return reports(actor, timeout_s + grace_s)


def reports(actor: Any, within_s: float) -> dict[str, Any]:
    deadline = time.monotonic() + within_s
    while True:
        progress = ray.get(actor.progress.remote())
        if set(progress["reports"]) >= set(progress["watchers"]) or time.monotonic() > deadline:
            return progress
        time.sleep(0.1)


def summary(progress: dict[str, Any]) -> str:
    reports = progress["reports"].values()
    total = {k: sum(r[k] for r in reports) for k in ("in_flight_at_start", "ended_by_timeout", "left")}
    missing = len(set(progress["watchers"]) - set(progress["reports"]))
    return (
        f"drained: {total['in_flight_at_start']} request(s) in flight at the signal, "
        f"{total['in_flight_at_start'] - total['ended_by_timeout']} finished, {total['ended_by_timeout']} ended "
        f"with an error at the drain's end, {total['left']} left; {len(progress['reports'])} router(s) reported"
        + (f", {missing} did not" if missing else "")
    )


def pool_report(deadline_s: float = 5.0) -> list[str]:
    """Each Conveyor app's LLM replicas after the drain (what `stats` answered, sampled twice per replica)."""
    lines = []
    for name, app in serve.status().applications.items():
        if "LLMReplica" not in app.deployments:
            continue
        replicas = app.deployments["LLMReplica"].replica_states.get("RUNNING", 0)
        handle, deadline = serve.get_deployment_handle("LLMReplica", app_name=name), time.monotonic() + deadline_s
        while True:
            stats = [handle.stats.remote().result(timeout_s=10) for _ in range(2 * replicas)]
            whole = all(
                s["num_running"] == s["num_waiting"] == 0 and s["kv_blocks_free"] == s["kv_blocks_total"] for s in stats
            )
            if whole or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        worst = min(stats, key=lambda s: s["kv_blocks_free"] - s["kv_blocks_total"], default=None)
        lines.append(
            f"app {name}: {replicas} LLM replica(s), {len(stats)} stats answers, "
            + ("every KV pool whole, nothing running or waiting" if whole else f"NOT idle: {worst}")
        )
    return lines


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    config = load_config(args.config)
    ray.init(address=args.address, namespace=SERVE_NAMESPACE)
    stop = threading.Event()

    def on_signal(signum: int, _: Any) -> None:
        if stop.is_set():
            raise KeyboardInterrupt
        stop.set()
        print(f"got {signal.Signals(signum).name}: draining (a second one ends the drain at once)", flush=True)

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    actor = ray.remote(DrainSignal).options(name=DRAIN_SIGNAL, namespace=SERVE_NAMESPACE, num_cpus=0).remote()
    try:
        ray.get(actor.progress.remote())
        deploy(config)
        print(
            f"deployed {', '.join(a.name for a in config.applications)} from {args.config}; Ctrl-C (or SIGTERM) "
            f"drains for up to {args.drain_timeout:g}s, a second Ctrl-C ends it at once",
            flush=True,
        )
        while not stop.wait(1.0):
            pass
        print(summary(drain(actor, args.drain_timeout)), flush=True)
        for line in pool_report():
            print(line, flush=True)
        code = 0
    except KeyboardInterrupt:
        print("second signal: ending the requests still in flight now", flush=True)
        code = 1
        try:
            ray.get(actor.expire.remote(), timeout=5)
            print(summary(reports(actor, 5.0)), flush=True)
        except (KeyboardInterrupt, ray.exceptions.GetTimeoutError):
            pass
    print("shutting down Serve", flush=True)
    serve.shutdown()
    ray.kill(actor)
    print("Serve shut down", flush=True)
    return code


if __name__ == "__main__":
    sys.exit(main())
