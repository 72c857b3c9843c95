"""Multi-LoRA, two scenarios (python -m benchmarks.lora --scenario ...), random rank-8 adapters on every projection
written for the model first:

step     the cost of a decode step mixing adapters: `--seqs` sequences in steady decode, all on the base model
         with LoRA off, then split evenly over N adapters + the base model (max_loras N) for each N of `--loras`,
         alternated over `--rounds`; prints the median decode step of each and their ratio (target <= 1.3 at 4).
routing  8 adapters over 2 replicas (max_loras 2 each), Zipf popularity (`--zipf`), open-loop Poisson arrivals:
         two apps side by side, LoRA-aware routing and adapter-blind (request_router.lora_affinity false), same
         requests, rounds alternating which goes first; prints TTFT p50/p99 and the adapter loads (the replicas'
         num_lora_loads) of each.

    python -m benchmarks.lora --scenario step [--seqs 32 --rounds 3 --loras 1,4,8]
    python -m benchmarks.lora --scenario routing [--requests 96 --rate 3 --rounds 2]
"""

import argparse
import asyncio
import json
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp

from benchmarks.http_client import complete, get_json, session
from benchmarks.percentiles import percentile

RANK = 8


def write_adapters(model: str, n: int, root: Path) -> list[tuple[str, str]]:
    from transformers import AutoConfig

    from conveyor.engine.checkpoints.lora import write_random_adapter
    from conveyor.engine.checkpoints.model_source import resolve_model

    hf = AutoConfig.from_pretrained(resolve_model(model))
    return [(f"a{i}", str(write_random_adapter(root / f"a{i}", hf, model, RANK, seed=i))) for i in range(n)]


def decode_steps(llm: Any, prompts: list[list[int]], loras: list[Any], steps: int) -> list[float]:
    """Durations of the steps in which every sequence decodes (the step trace's records)."""
    from conveyor.engine import SamplingParams

    core = llm.engine.local_core
    core.step_trace.enable()
    core.step_trace.records.clear()
    params = SamplingParams(temperature=0, max_tokens=steps, ignore_eos=True)
    llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False, lora_request=loras)
    n = len(prompts)
    return [r.duration_s for r in core.step_trace.records if r.tokens("decode") == n and r.tokens("prefill") == 0]


def step_cost(args: argparse.Namespace) -> None:
    times = step_times(args)
    ref = statistics.median(times["base (LoRA off)"])
    for name, t in times.items():
        med = statistics.median(t)
        print(f"  {name:18s} median decode step {1000 * med:7.2f} ms over {len(t):4d} steps  ratio {med / ref:.3f}")


def step_times(args: argparse.Namespace) -> dict[str, list[float]]:
    """Decode-step durations of the base model (LoRA off), and of each --loras N: N adapters + base (max_loras N)
    and, for the first N, the base alone with LoRA on; all alternated over --rounds."""
    from conveyor.engine import LLM
    from conveyor.engine.lora_request import LoRARequest

    counts = [int(n) for n in args.loras.split(",")]
    root = Path(tempfile.mkdtemp(prefix="lora-bench-"))
    written = write_adapters(args.model, max(counts), root)
    adapters = [LoRARequest(name, i + 1, path) for i, (name, path) in enumerate(written)]
    opts = dict(dtype="float32", max_num_seqs=args.seqs, max_model_len=512, num_blocks=args.seqs * 8 + 16)
    base = LLM(args.model, **opts)
    mixed = {n: LLM(args.model, max_loras=n, max_lora_rank=RANK, **opts) for n in counts}
    rng = random.Random(0)
    prompts = [[rng.randrange(100, 20000) for _ in range(32)] for _ in range(args.seqs)]
    times: dict[str, list[float]] = {"base (LoRA off)": []}
    print(f"model {args.model}, {args.seqs} sequences in decode, rank {RANK} on q/k/v/o/gate/up/down")
    for _ in range(args.rounds):
        times["base (LoRA off)"] += decode_steps(base, prompts, [None] * args.seqs, args.steps)
        for n in counts:
            split = [([None, *adapters[:n]])[i % (n + 1)] for i in range(args.seqs)]
            times.setdefault(f"{n} adapters + base", []).extend(decode_steps(mixed[n], prompts, split, args.steps))
        times.setdefault("base (LoRA on)", []).extend(
            decode_steps(mixed[counts[0]], prompts, [None] * args.seqs, args.steps)
        )
    return times


async def stream_one(client: aiohttp.ClientSession, url: str, model: str, prompt: list[int], tokens: int) -> dict:
    body = {"model": model, "prompt": prompt, "max_tokens": tokens, "temperature": 0, "ignore_eos": True}
    c = await complete(client, f"{url}/v1/completions", {**body, "stream": True})
    if not c.ok:
        return {"status": c.status, "error": c.error}
    return {"status": 200, "ttft": (c.chunks[0] if c.chunks else c.done) - c.sent, "tokens": c.tokens}


async def open_loop(url: str, path: str, work: list[tuple[float, str, list[int]]], tokens: int) -> list[dict]:
    async with session(256) as c:
        start = time.perf_counter()

        async def one(at: float, model: str, prompt: list[int]) -> dict:
            await asyncio.sleep(max(0.0, at - (time.perf_counter() - start)))
            return await stream_one(c, url + path, model, prompt, tokens)

        return await asyncio.gather(*(one(*w) for w in work))


def loads(url: str, path: str) -> int:
    view = get_json(f"{url}{path}/v1/cluster")
    return sum(r.get("num_lora_loads", 0) for r in view["replicas"])


def routing(args: argparse.Namespace) -> None:
    from benchmarks.cluster_setup import app_args, deploy, start_ray
    from benchmarks.local_ray import stop_local_ray

    root = Path(tempfile.mkdtemp(prefix="lora-bench-"))
    adapters = write_adapters(args.model, 8, root)
    url = start_ray(args)
    modules = [{"name": n, "path": p} for n, p in adapters]
    engine = {"max_loras": 2, "max_lora_rank": RANK}
    apps = {
        "aware": app_args(args, engine=engine, lora_modules=modules),
        "blind": app_args(args, engine=engine, lora_modules=modules, request_router={"lora_affinity": False}),
    }
    deploy(url, apps)
    weights = [1 / (k + 1) ** args.zipf for k in range(len(adapters))]
    results: dict[str, list[dict]] = {name: [] for name in apps}
    loaded = dict.fromkeys(apps, 0)
    for rnd in range(args.rounds):
        rng = random.Random(rnd)
        at, work = 0.0, []
        for _ in range(args.requests):
            at += rng.expovariate(args.rate)
            name = rng.choices([n for n, _ in adapters], weights)[0]
            work.append((at, name, [rng.randrange(100, 20000) for _ in range(args.prompt_len)]))
        order = list(apps) if rnd % 2 == 0 else list(apps)[::-1]
        for name in order:
            before = loads(url, f"/{name}")
            results[name] += asyncio.run(open_loop(url, f"/{name}", work, args.max_tokens))
            time.sleep(1.0)
            loaded[name] += loads(url, f"/{name}") - before
    print(
        f"model {args.model}, 8 adapters (rank {RANK}) over 2 replicas, max_loras 2 each, Zipf s={args.zipf}, "
        f"{args.rounds} rounds x {args.requests} requests at {args.rate}/s, {args.prompt_len}-token prompts, "
        f"{args.max_tokens} output tokens"
    )
    for name, rs in results.items():
        ok = [r["ttft"] for r in rs if r["status"] == 200]
        print(
            f"  {name:6s} TTFT p50 {percentile(ok, 0.5):6.3f} s  p99 {percentile(ok, 0.99):6.3f} s  "
            f"adapter loads {loaded[name]:4d}  ok {len(ok)}/{len(rs)}"
        )
    stop_local_ray(args.temp_dir)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--scenario", choices=("step", "routing"), required=True)
    p.add_argument("--model", default="demo:smollm2")
    p.add_argument("--seqs", type=int, default=32)
    p.add_argument("--loras", default="4", help="step: adapter counts, comma-separated (max_loras each)")
    p.add_argument("--steps", type=int, default=24)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--requests", type=int, default=96)
    p.add_argument("--rate", type=float, default=3.0)
    p.add_argument("--zipf", type=float, default=1.1)
    p.add_argument("--prompt-len", type=int, default=48)
    p.add_argument("--max-tokens", type=int, default=16)
    # the engine and cluster knobs benchmarks.cluster_setup's helpers read
    p.add_argument("--port", type=int, default=8011)
    p.add_argument("--haproxy", action="store_true")
    p.add_argument("--ray-cpus", type=int, default=4)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--max-num-seqs", type=int, default=8)
    p.add_argument("--max-num-batched-tokens", type=int, default=512)
    p.add_argument("--num-blocks", type=int, default=256)
    p.add_argument("--max-model-len", type=int, default=512)
    p.add_argument("--engine", default="{}")
    args = p.parse_args()
    json.loads(args.engine)
    step_cost(args) if args.scenario == "step" else routing(args)


if __name__ == "__main__":
    main()
