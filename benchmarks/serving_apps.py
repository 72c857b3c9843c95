"""The apps the serving benchmarks deploy: conveyor apps (one Ray cluster, or a second one behind HAProxy
in a child process) and the bare Serve app that is their floor."""

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from benchmarks.local_ray import ray_temp_dir, start_local_ray, stop_local_ray
from conveyor.deployments.ingress import haproxy_env

SERVING = Path(__file__).resolve().with_name("serving.py")
"""The benchmark's script: the HAProxy child runs it with --serve-haproxy."""


def engine_options(args: argparse.Namespace) -> dict[str, Any]:
    # no prefix caching: every run sends the same prompts, and a warm cache would skip their prefill
    return dict(
        dtype="float32",
        enable_prefix_caching=False,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        num_blocks=args.num_blocks,
        max_model_len=args.max_model_len,
        max_prefill_tokens_while_decoding=args.max_prefill_tokens_while_decoding,
        **json.loads(args.engine),
    )


def floor_app() -> Any:
    """The least a streaming Serve app with this shape costs: proxy -> ingress -> one streamed item from a
    second deployment -> SSE, no model, no pydantic, no tokenizer."""
    from fastapi import FastAPI
    from fastapi.responses import StreamingResponse
    from ray import serve

    api = FastAPI()

    @serve.deployment(ray_actor_options={"num_cpus": 0.05})
    class Echo:
        async def gen(self) -> Any:
            yield {"deltas": []}

    @serve.deployment(ray_actor_options={"num_cpus": 0.05})
    @serve.ingress(api)
    class Front:
        def __init__(self, echo: Any) -> None:
            self.echo = echo.options(stream=True)

        @api.post("/")
        async def run(self, body: dict) -> StreamingResponse:
            first = await anext(self.echo.gen.remote())
            return StreamingResponse(
                iter([f"data: {json.dumps(first)}\n\n", "data: [DONE]\n\n"]), media_type="text/event-stream"
            )

    return Front.bind(Echo.bind())


APPS = {  # route prefix -> AppArgs overrides; "/" is the default configuration
    "/": {},
    "/inthread/": {"engine_core_process": False},
}


QUICK_APPS = {k: APPS[k] for k in ("/", "/inthread/")}


def app_args(args: argparse.Namespace, **overrides: Any) -> Any:
    from conveyor.deployments.app import AppArgs

    return AppArgs(
        **{
            **dict(
                model=args.model,
                engine=engine_options(args),
                num_replicas=1,
                replica_num_cpus=1.0,
                router_num_cpus=0.5,
                torch_threads=args.threads,
                port=args.port,
                stream_interval=args.stream_interval,
            ),
            **overrides,
        }
    )


def start_ray(args: argparse.Namespace, port: int) -> None:
    args.temp_dir = ray_temp_dir("ray-bench-")
    start_local_ray(args.ray_cpus, port, args.temp_dir)


def apps_of(args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    """--quick: the default and the core in the replica's thread (each app loads a model replica)."""
    extra = {f"/si{k}/": {"stream_interval": k} for k in args.stream_intervals}
    apps = {**(QUICK_APPS if args.quick else APPS), **extra}
    return apps if args.apps is None else {k: v for k, v in apps.items() if k in args.apps}


def deploy_app(args: argparse.Namespace, prefix: str) -> str:
    from ray import serve

    from conveyor.deployments.app import build_app

    name = prefix.strip("/") or "default"
    serve.run(build_app(app_args(args, **apps_of(args)[prefix])), name=name, route_prefix=prefix.rstrip("/") or "/")
    return name


def stop_ray(args: argparse.Namespace) -> None:
    stop_local_ray(args.temp_dir)


def serve_haproxy(args: argparse.Namespace) -> None:
    """Child mode: a Ray cluster of its own with RAY_SERVE_ENABLE_HA_PROXY=1 (set by the parent before Ray is
    imported) and the bare app; each stdin line names an app prefix to deploy instead of the last one ("-":
    none), answered READY; serves until stdin closes."""
    from ray import serve

    start_ray(args, args.port)
    try:
        serve.run(floor_app(), name="floor", route_prefix="/floor")
        print("READY", flush=True)
        current = None
        for line in sys.stdin:
            if current is not None:
                serve.delete(current)
            current = deploy_app(args, line.strip()) if line.strip() != "-" else None
            print("READY", flush=True)
    finally:
        stop_ray(args)


def haproxy_deploy(child: subprocess.Popen, prefix: str) -> None:
    child.stdin.write(prefix + "\n")
    child.stdin.flush()
    if (line := child.stdout.readline()).strip() != "READY":
        raise RuntimeError(f"HAProxy cluster did not deploy {prefix}: {line!r}")


def start_haproxy_child(args: argparse.Namespace) -> subprocess.Popen:
    port = args.port + 1
    cmd = [
        sys.executable,
        str(SERVING),
        "--serve-haproxy",
        "--port",
        str(port),
        "--model",
        args.model,
        "--threads",
        str(args.threads),
        "--ray-cpus",
        str(args.ray_cpus),
        "--stream-interval",
        str(args.stream_interval),
        "--max-num-seqs",
        str(args.max_num_seqs),
        "--max-num-batched-tokens",
        str(args.max_num_batched_tokens),
        "--num-blocks",
        str(args.num_blocks),
        "--max-prefill-tokens-while-decoding",
        str(args.max_prefill_tokens_while_decoding),
        "--max-model-len",
        str(args.max_model_len),
        "--engine",
        args.engine,
    ]
    env = {**os.environ, **haproxy_env(f"/tmp/haproxy-bench-{os.getpid()}")}
    proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
    line = proc.stdout.readline()
    if line.strip() != "READY":
        proc.kill()
        raise RuntimeError(f"HAProxy cluster did not start: {line!r}")
    return proc
