"""Serving over HTTP (Ray Serve + OpenAI API) vs the offline engine on the same workload.

Prints: output tokens/s offline and over HTTP at saturation (target >= 85%), and the time to first token
added by the Serve layer on loopback (HTTP TTFT p50 minus in-process AsyncEngine TTFT p50, target <= 10 ms).

    python benchmarks/serving.py --num-prompts 64 --max-tokens 64
"""
import argparse
import asyncio
import json
import random
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != HERE]  # benchmarks/kernels.py shadows kernels/
sys.path.insert(0, str(HERE.parent))
import httpx  # noqa: E402
import torch  # noqa: E402

from benchmarks.sse import read_completion_stream  # noqa: E402


def workload(n: int, lo: int, hi: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(4, 8192) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def engine_options(args: argparse.Namespace) -> dict[str, Any]:
    return dict(dtype="float32", max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                num_blocks=args.num_blocks, max_model_len=args.max_model_len)


def offline_throughput(args: argparse.Namespace, prompts: list[list[int]]) -> tuple[float, int]:
    from engine import LLM, SamplingParams
    llm = LLM(args.model, **engine_options(args))
    sp = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    llm.generate([{"prompt_token_ids": p} for p in prompts[:4]], sp, use_tqdm=False)
    start = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    elapsed = time.perf_counter() - start
    llm.engine.shutdown()
    return elapsed, sum(len(o.outputs[0].token_ids) for o in outs)


async def engine_ttfts(args: argparse.Namespace, prompts: list[list[int]]) -> list[float]:
    from engine import AsyncEngine, EngineConfig, SamplingParams
    engine = AsyncEngine(EngineConfig(model=args.model, **engine_options(args)))
    out = []
    try:
        for i, p in enumerate(prompts):
            start = time.perf_counter()
            sp = SamplingParams(temperature=0, max_tokens=1)
            async for _ in engine.generate(prompt_token_ids=p, sampling_params=sp, request_id=f"ttft-{i}"):
                out.append(time.perf_counter() - start)
                break
    finally:
        engine.shutdown()
    return out[2:]


def replica_ms(r: httpx.Response) -> float:
    timing = dict(part.strip().split(";dur=") for part in r.headers["server-timing"].split(","))
    return float(timing["replica"])


async def http_request(client: httpx.AsyncClient, prompt: list[int], max_tokens: int, stream: bool,
                       model: str) -> tuple[float | None, float, int]:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": stream, "stream_options": {"include_usage": True} if stream else None}
    start = time.perf_counter()
    if not stream:
        r = await client.post("/v1/completions", json=body)
        r.raise_for_status()
        return None, replica_ms(r), r.json()["usage"]["completion_tokens"]
    async with client.stream("POST", "/v1/completions", json=body) as r:
        r.raise_for_status()
        ttft, tokens = await read_completion_stream(r, start)
    return ttft, replica_ms(r), tokens


async def http_throughput(url: str, prompts: list[list[int]], max_tokens: int, stream: bool,
                          model: str) -> tuple[float, int, list[float]]:
    limits = httpx.Limits(max_connections=len(prompts), max_keepalive_connections=len(prompts))
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as client:
        await asyncio.gather(*(http_request(client, p, max_tokens, stream, model) for p in prompts[:16]))
        start = time.perf_counter()
        res = await asyncio.gather(*(http_request(client, p, max_tokens, stream, model) for p in prompts))
        elapsed = time.perf_counter() - start
    return elapsed, sum(t for _, _, t in res), [t for t, _, _ in res if t is not None]


async def first_line_s(client: httpx.AsyncClient, path: str, body: dict[str, Any]) -> float:
    start = time.perf_counter()
    async with client.stream("POST", path, json=body) as r:
        async for line in r.aiter_lines():
            if line.startswith("data: "):
                return time.perf_counter() - start
    raise RuntimeError(f"{path}: no data")


async def http_ttfts(url: str, prompts: list[list[int]], model: str) -> tuple[list[float], list[float], list[float]]:
    out, floor = [], []
    async with httpx.AsyncClient(base_url=url, timeout=60) as client:
        for p in prompts:
            floor.append(await first_line_s(client, "/floor/", {}))
            out.append(await http_request(client, p, 1, True, model))
    return [t for t, _, _ in out[2:]], [t - r / 1000 for t, r, _ in out[2:]], floor[2:]


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
            return StreamingResponse(iter([f"data: {json.dumps(first)}\n\n", "data: [DONE]\n\n"]),
                                     media_type="text/event-stream")

    return Front.bind(Echo.bind())


def start_app(args: argparse.Namespace) -> str:
    import ray
    from ray import serve

    from deployments.app import AppArgs, build_app
    args.temp_dir = tempfile.mkdtemp(prefix="ray-bench-", dir="/tmp")
    ray.init(address="local", num_cpus=args.ray_cpus, include_dashboard=False, log_to_driver=False,
             _temp_dir=args.temp_dir, _node_ip_address="127.0.0.1",
             object_store_memory=256 * 2**20)
    serve.start(http_options={"host": "127.0.0.1", "port": args.port})
    app_args = AppArgs(model=args.model, engine=engine_options(args), num_replicas=1, replica_num_cpus=1.0,
                       router_num_cpus=0.5, torch_threads=args.threads, port=args.port,
                       stream_interval_s=args.stream_interval, stream_chunks_per_s=args.stream_chunks_per_s)
    serve.run(build_app(app_args), name="default", route_prefix="/")
    serve.run(floor_app(), name="floor", route_prefix="/floor")
    return f"http://127.0.0.1:{args.port}"


def ms(xs: list[float], q: float = 0.5) -> float:
    return 1000 * statistics.quantiles(xs, n=100)[int(q * 100) - 1] if len(xs) > 1 else 1000 * xs[0]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="demo:tiny")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--prompt-len", type=int, nargs=2, default=(64, 192))
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--ttft-reps", type=int, default=30)
    p.add_argument("--max-num-seqs", type=int, default=32)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--num-blocks", type=int, default=1024)
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--threads", type=int, default=1, help="torch threads, offline and in the replica")
    p.add_argument("--ray-cpus", type=int, default=2)
    p.add_argument("--stream-interval", type=float, default=0.0, help="replica: min seconds between stream chunks")
    p.add_argument("--stream-chunks-per-s", type=float, default=200.0, help="replica: stream chunk budget (0: off)")
    p.add_argument("--port", type=int, default=8123)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    prompts = workload(args.num_prompts, *args.prompt_len, seed=0)
    ttft_prompts = workload(args.ttft_reps + 2, *args.prompt_len, seed=1)

    off_s, off_tok = offline_throughput(args, prompts)
    eng_ttft = asyncio.run(engine_ttfts(args, ttft_prompts))
    url = start_app(args)
    try:
        runs = [asyncio.run(http_throughput(url, prompts, args.max_tokens, stream, args.model))
                for stream in (False, True, False, True)]
        (whole_s, whole_tok, _), (http_s, http_tok, load_ttft) = min(runs[0::2]), min(runs[1::2])
        serve_ttft, added, floor = asyncio.run(http_ttfts(url, ttft_prompts, args.model))
    finally:
        import ray
        from ray import serve
        serve.shutdown()
        ray.shutdown()
        shutil.rmtree(args.temp_dir, ignore_errors=True)
    again_s, again_tok = offline_throughput(args, prompts)
    print(f"offline runs: {off_tok / off_s:.1f} and {again_tok / again_s:.1f} tok/s; the faster is the baseline")
    off_s, off_tok = min((off_s, off_tok), (again_s, again_tok))

    off_tps = off_tok / off_s
    print(f"workload: {args.num_prompts} prompts x {args.prompt_len[0]}-{args.prompt_len[1]} tokens -> "
          f"{args.max_tokens} tokens, greedy, ignore_eos; {args.threads} torch threads; model {args.model}; "
          f"stream interval {args.stream_interval}s, {args.stream_chunks_per_s} chunks/s per replica")
    print(f"offline engine      : {off_tok} tokens in {off_s:.2f}s = {off_tps:.1f} tok/s (best of 2; HTTP: best of 2)")
    for name, t, n in (("whole", whole_s, whole_tok), ("stream", http_s, http_tok)):
        print(f"HTTP {name:<15}: {n} tokens in {t:.2f}s = {n / t:.1f} tok/s  ({100 * n / t / off_tps:.1f}% of offline, "
              f"target >= 85%)")
    if load_ttft:
        print(f"TTFT at saturation  : p50 {ms(load_ttft):.1f} ms  p90 {ms(load_ttft, 0.9):.1f} ms")
    print(f"TTFT engine (in-proc): p50 {ms(eng_ttft):.2f} ms  p90 {ms(eng_ttft, 0.9):.2f} ms  (n={len(eng_ttft)})")
    print(f"TTFT over HTTP      : p50 {ms(serve_ttft):.2f} ms  p90 {ms(serve_ttft, 0.9):.2f} ms  (n={len(serve_ttft)})")
    print(f"Serve layer adds    : p50 {ms(added):.2f} ms  p90 {ms(added, 0.9):.2f} ms to TTFT (per request: HTTP TTFT "
          f"minus the replica's own time to first deltas; target <= 10 ms p50)")
    print(f"Ray Serve floor     : p50 {ms(floor):.2f} ms  p90 {ms(floor, 0.9):.2f} ms (bare proxy -> ingress -> "
          f"streamed handle call -> SSE on this machine, interleaved with the requests above)")


if __name__ == "__main__":
    main()
