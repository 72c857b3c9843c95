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
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.percentiles import percentile

HERE = Path(__file__).resolve().parent
import aiohttp  # noqa: E402
import psutil  # noqa: E402
import torch  # noqa: E402

from benchmarks.sse import aiohttp_lines, read_completion_stream, server_timing_ms  # noqa: E402
from conveyor.deployments.ingress import haproxy_env  # noqa: E402


def workload(n: int, lo: int, hi: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(4, 8192) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


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


def replica_ms(headers: Any) -> float:
    return server_timing_ms(headers["server-timing"])["replica"]


async def http_request(
    client: aiohttp.ClientSession,
    url: str,
    prompt: list[int],
    max_tokens: int,
    stream: bool,
    model: str,
    gaps: list[float] | None = None,
) -> tuple[float | None, float, int]:
    """aiohttp, as vLLM's serving benchmark uses: on 2 shared cores the client's own CPU is part of the load
    (httpx's stream reader measured ~30% of a core at 1600 tok/s)."""
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": stream,
        **({"stream_options": {"include_usage": True}} if stream else {}),
    }
    start = time.perf_counter()
    async with client.post(f"{url}v1/completions", json=body) as r:
        r.raise_for_status()
        if not stream:
            return None, replica_ms(r.headers), (await r.json())["usage"]["completion_tokens"]
        arrivals: list[float] = []
        ttft, tokens = await read_completion_stream(aiohttp_lines(r), start, arrivals)
    if gaps is not None:
        gaps += [b - a for a, b in zip(arrivals, arrivals[1:])]
    return ttft, replica_ms(r.headers), tokens


ROLES = (
    ("conveyor.engine.process.core_process", "core"),
    ("LLMReplica", "replica"),
    ("Router", "router"),
    ("ProxyActor", "proxy"),
    ("bin/haproxy", "haproxy"),
)


def cpu_by_role() -> dict[str, float]:
    """CPU seconds so far of this machine's processes, summed by role (the rest: Ray's own, other apps);
    CPU per token is steadier than tok/s on a shared machine."""
    totals: dict[str, float] = {}
    for proc in psutil.process_iter(["pid", "cmdline", "cpu_times"]):
        try:
            cmd, t = " ".join(proc.info["cmdline"] or []), proc.info["cpu_times"]
        except (psutil.Error, TypeError):
            continue
        if t is None:
            continue
        role = "client" if proc.info["pid"] == os.getpid() else next((r for key, r in ROLES if key in cmd), "other")
        totals[role] = totals.get(role, 0.0) + t.user + t.system
    return totals


def session(connections: int) -> aiohttp.ClientSession:
    return aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=connections), timeout=aiohttp.ClientTimeout(total=600)
    )


async def http_throughput(
    url: str, prompts: list[list[int]], max_tokens: int, stream: bool, model: str, concurrency: int
) -> tuple[float, int, list[float], list[float]]:
    """At most `concurrency` requests in flight (a new one starts as one ends), as vLLM's --max-concurrency."""
    gaps: list[float] = []
    slots = asyncio.Semaphore(concurrency)

    async def limited(p: list[int]) -> tuple[float | None, float, int]:
        async with slots:
            return await http_request(client, url, p, max_tokens, stream, model, gaps)

    async with session(concurrency) as client:
        await asyncio.gather(*(http_request(client, url, p, max_tokens, stream, model) for p in prompts[:16]))
        start = time.perf_counter()
        res = await asyncio.gather(*(limited(p) for p in prompts))
        elapsed = time.perf_counter() - start
    return elapsed, sum(t for _, _, t in res), [t for t, _, _ in res if t is not None], gaps


async def first_line_s(client: aiohttp.ClientSession, url: str) -> float:
    start = time.perf_counter()
    async with client.post(url, json={}) as r:
        async for line in r.content:
            if line.startswith(b"data: "):
                return time.perf_counter() - start
    raise RuntimeError(f"{url}: no data")


async def http_ttfts(variants: dict[str, str], prompts: list[list[int]], model: str) -> dict[str, list[float]]:
    """Per variant (name -> full URL prefix), HTTP TTFT minus the replica's own time to first deltas (the
    floor app: its whole TTFT), one request per variant per prompt, round-robin."""
    added: dict[str, list[float]] = {name: [] for name in variants}
    async with session(4) as client:
        for i, p in enumerate(prompts):
            for name, prefix in variants.items():
                if name.endswith("bare Serve app"):
                    t = await first_line_s(client, prefix)
                else:
                    ttft, rep, _ = await http_request(client, prefix, p, 1, True, model)
                    t = ttft - rep / 1000
                if i >= 2:
                    added[name].append(t)
    return added


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
    import ray
    from ray import serve

    args.temp_dir = tempfile.mkdtemp(prefix="ray-bench-", dir="/tmp")
    ray.init(
        address="local",
        num_cpus=args.ray_cpus,
        include_dashboard=False,
        log_to_driver=False,
        _temp_dir=args.temp_dir,
        _node_ip_address="127.0.0.1",
        object_store_memory=256 * 2**20,
    )
    serve.start(http_options={"host": "127.0.0.1", "port": port})


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
    import ray
    from ray import serve

    serve.shutdown()
    ray.shutdown()
    shutil.rmtree(args.temp_dir, ignore_errors=True)


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
        __file__,
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
