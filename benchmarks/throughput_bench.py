"""`conveyor bench throughput`: offline output tokens/s, continuous vs static batching, per workload.

seed: benchmarks/throughput.py's workload (prompts U[32,256], outputs U[16,192], exact);
heavy-tail: prompts heavy-tail:32,1024, outputs heavy-tail:16,384 (Pareto, alpha 1.2);
shared-prefix and memory-pressure: benchmarks/memory.py's workloads (512-token shared system prompt;
a KV cache holding ~60% of the demand). At most 32 sequences, a 2048-token step budget, float32 by
default. Greedy outputs must be identical across the policies (checked). Writes JSON and a bar chart."""

import argparse
import json
import random
from pathlib import Path
from typing import Any, Callable

import torch

from benchmarks import memory, throughput
from benchmarks.lengths import Lengths, token_prompts
from conveyor.engine import LLM, SamplingParams

WORKLOADS = ("seed", "heavy-tail", "shared-prefix", "memory-pressure")
Workload = Callable[[int, int, int], tuple[list[list[int]], list[SamplingParams]]]


def exact(n: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=n, min_tokens=n, ignore_eos=True)


def seed_workload(n: int, vocab: int, seed: int) -> tuple[list[list[int]], list[SamplingParams]]:
    prompts, params = throughput.workload(n, seed, vocab)
    return [p["prompt_token_ids"] for p in prompts], params


def heavy_tail(n: int, vocab: int, seed: int) -> tuple[list[list[int]], list[SamplingParams]]:
    rng = random.Random(seed)
    prompts = token_prompts(Lengths("heavy-tail", 32, 1024), n, vocab, rng)
    outputs = Lengths("heavy-tail", 16, 384)
    return prompts, [exact(outputs.sample(rng)) for _ in range(n)]


def pressure_blocks(model: str, n: int, seed: int, max_num_seqs: int) -> int:
    """KV blocks holding ~60% of what min(n, max_num_seqs) mean requests of memory-pressure need."""
    probe = LLM(model, dtype="float32", num_blocks=1)
    prompts, params = memory.pressure(n, probe.engine.vocab_size, seed)
    bs = probe.engine.config.block_size
    mean = sum(-(-(len(p) + q.max_tokens) // bs) for p, q in zip(prompts, params)) / n
    need = max(-(-(len(p) + q.max_tokens) // bs) for p, q in zip(prompts, params))
    return max(need, int(0.6 * min(n, max_num_seqs) * mean))


def workload_setup(name: str, args: argparse.Namespace) -> tuple[Workload, dict[str, Any]]:
    if name == "seed":
        return seed_workload, {}
    if name == "heavy-tail":
        return heavy_tail, {"max_model_len": 2048}
    if name == "shared-prefix":
        return memory.shared_prefix, {"enable_prefix_caching": True}
    blocks = pressure_blocks(args.model, args.num_requests, args.seed, args.max_num_seqs)
    return memory.pressure, {"num_blocks": blocks, "enable_prefix_caching": False}


def capped(fn: Workload, cap: int | None) -> Workload:
    """The workload with every output length cut to `cap` tokens (smoke runs)."""
    if not cap:
        return fn

    def run(n: int, vocab: int, seed: int) -> tuple[list[list[int]], list[SamplingParams]]:
        prompts, params = fn(n, vocab, seed)
        return prompts, [exact(min(cap, p.max_tokens)) for p in params]

    return run


def run_all(args: argparse.Namespace) -> dict[str, Any]:
    rows = []
    for name in args.workloads:
        fn, options = workload_setup(name, args)
        fn = capped(fn, args.cap_output_tokens)
        outputs = None
        for policy in args.policies:
            r = memory.best(
                args.repeats,
                args.model,
                fn,
                args.num_requests,
                args.seed,
                dtype=args.dtype,
                scheduling_policy=policy,
                max_num_seqs=args.max_num_seqs,
                max_num_batched_tokens=args.max_num_batched_tokens,
                **options,
            )
            outputs = outputs or r["outputs"]
            same = r["outputs"] == outputs
            row = {
                "workload": name,
                "policy": policy,
                "tok_per_s": r["tok_per_s"],
                "seconds": r["seconds"],
                "steps": r["steps"],
                "output_tokens": sum(map(len, r["outputs"])),
                "preemptions": r["preemptions"],
                "prefix_cache_hit_tokens": r["hits"],
                "tokens_recomputed": r["recomputed"],
                "kv_blocks": r["blocks"],
                "outputs_match_first_policy": same,
            }
            rows.append(row)
            print(
                f"{name:<16}{policy:<12}{row['tok_per_s']:>9.1f}{row['steps']:>7}{row['seconds']:>9.2f}"
                f"{row['preemptions']:>7}{'' if same else '  OUTPUTS DIFFER'}",
                flush=True,
            )
            if not same:
                raise AssertionError(f"{name}: greedy outputs of {policy} differ from {args.policies[0]}")
        if len(args.policies) > 1:
            a, b = (next(r for r in rows if r["workload"] == name and r["policy"] == p) for p in args.policies[:2])
            print(f"{name:<16}{args.policies[0]}/{args.policies[1]}: {a['tok_per_s'] / b['tok_per_s']:.2f}x")
    config = {k: v for k, v in vars(args).items() if k != "func"}
    config.update(out=str(args.out), plot=str(args.plot), torch_threads=torch.get_num_threads())
    return {"config": config, "results": rows}


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="demo:tiny")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--workloads", nargs="+", choices=WORKLOADS, default=list(WORKLOADS))
    p.add_argument("--policies", nargs="+", choices=("continuous", "static"), default=["continuous", "static"])
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--max-num-seqs", type=int, default=32)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--repeats", type=int, default=1, help="keep the fastest of this many runs")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--cap-output-tokens", type=int, default=None, help="cut every output to N tokens (smoke runs)")
    p.add_argument("--out", type=Path, default=Path("bench-throughput.json"))
    p.add_argument("--plot", type=Path, default=Path("bench-throughput.png"))


def main(args: argparse.Namespace) -> int:
    if args.num_requests < 1:
        raise ValueError("--num-requests must be >= 1")
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"torch threads {torch.get_num_threads()}, {args.model} {args.dtype}, {args.num_requests} requests")
    print(f"{'workload':<16}{'policy':<12}{'tok/s':>9}{'steps':>7}{'seconds':>9}{'preempt':>7}")
    result = run_all(args)
    args.out.write_text(json.dumps(result, indent=1))
    from benchmarks.charts import throughput_chart

    throughput_chart(result, args.plot)
    print(f"wrote {args.out} and {args.plot}")
    return 0
