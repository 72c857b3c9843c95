"""KV-cache memory management, offline, float32, printed as markdown tables (python -m benchmarks.memory).

shared-prefix (--models, default tiny and small): N requests share a 512-token system prompt, each with a
32-token unique suffix and 64 output tokens (exact); prefix caching off vs on in the same process, with
room for every running request (no preemption). Reports prompt tokens the model computed, cache-hit
tokens, output tokens/s, model time in steps with prompt work vs decode-only steps, and checks that
greedy outputs are identical.

memory-pressure (--pressure-models, default tiny): N requests, prompts U[32, 160], outputs U[64, 192]
(exact), at most 32 running; the KV cache holds ~60% of the demand (32 x the mean request's blocks).
Watermark off (0) / fixed (0.05) / adaptive (from 0.01, engine/core/watermark.py), recompute vs swap (swap
space = the KV cache's size). Reports preemptions, blocks swapped out, tokens recomputed after
preemption and output tokens/s, and checks that greedy outputs are identical across the six runs."""

import argparse
import random
import time

import torch

from conveyor.engine import LLM, SamplingParams
from conveyor.engine.step import SchedulerOutput

WATERMARKS = {"off": (0.0, False), "fixed": (0.05, False), "adaptive": (0.01, True)}


def shared_prefix(n: int, vocab: int, seed: int) -> tuple[list[list[int]], list[SamplingParams]]:
    rng = random.Random(seed)
    system = [rng.randrange(4, vocab) for _ in range(512)]
    prompts = [system + [rng.randrange(4, vocab) for _ in range(32)] for _ in range(n)]
    return prompts, [SamplingParams(temperature=0, max_tokens=64, min_tokens=64, ignore_eos=True)] * n


def pressure(n: int, vocab: int, seed: int) -> tuple[list[list[int]], list[SamplingParams]]:
    rng = random.Random(seed)
    prompts = [[rng.randrange(4, vocab) for _ in range(rng.randint(32, 160))] for _ in range(n)]
    outs = [rng.randint(64, 192) for _ in range(n)]
    return prompts, [SamplingParams(temperature=0, max_tokens=o, min_tokens=o, ignore_eos=True) for o in outs]


def best(repeats: int, model: str, workload, n: int, seed: int, **options: object) -> dict:
    """Counters are deterministic; the time is the fastest of `repeats` runs (the machine may be shared)."""
    return min((run(model, workload, n, seed, **options) for _ in range(repeats)), key=lambda r: r["seconds"])


def run(model: str, workload, n: int, seed: int, **options: object) -> dict:
    options = {"dtype": "float32", "max_num_seqs": 32, "max_num_batched_tokens": 2048, "seed": seed, **options}
    llm = LLM(model, **options)
    prompts, params = workload(n, llm.engine.vocab_size, seed)
    llm.generate([{"prompt_token_ids": [5, 6, 7]}] * 2, SamplingParams(max_tokens=4), use_tqdm=False)
    before = llm.engine.stats()
    counts = {"steps": 0, "prompt_tokens": 0, "tokens": 0, "swapped_blocks": 0, "prompt_s": 0.0, "decode_s": 0.0}
    prompt_len: dict[str, int] = {}
    execute = llm.engine.local_core.executor.execute_model

    def counted(so: SchedulerOutput):
        counts["steps"] += 1
        counts["swapped_blocks"] += len(so.swap_out)
        prompt_len.update((r.req_id, len(r.prompt_token_ids)) for r in so.new_requests)
        prompt = sum(max(0, min(c.start + len(c.token_ids), prompt_len[c.req_id]) - c.start) for c in so.chunks)
        counts["tokens"] += so.num_tokens
        counts["prompt_tokens"] += prompt
        start = time.perf_counter()
        out = execute(so)
        counts["prompt_s" if prompt else "decode_s"] += time.perf_counter() - start
        return out

    llm.engine.local_core.executor.execute_model = counted
    start = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    seconds = time.perf_counter() - start
    stats = llm.engine.stats()
    outputs = [o.outputs[0].token_ids for o in outs]
    num_out = sum(len(o) for o in outputs)
    return {
        **counts,
        "seconds": seconds,
        "outputs": outputs,
        "tok_per_s": num_out / seconds,
        "hits": stats.prefix_cache_hits - before.prefix_cache_hits,
        "preemptions": stats.num_preemptions - before.num_preemptions,
        "recomputed": counts["tokens"] - sum(len(p) + len(o) - 1 for p, o in zip(prompts, outputs)),
        "blocks": llm.engine.local_core.block_manager.num_blocks,
    }


def shared_prefix_table(models: list[str], n: int, seed: int, repeats: int, max_num_seqs: int) -> None:
    print(f"\n### Shared prefix: {n} requests, 512-token system prompt + 32 unique tokens, 64 output tokens\n")
    print(
        f"max_num_seqs {max_num_seqs}. Model time is split between steps that compute prompt tokens and "
        "decode-only steps, which prefix caching cannot shorten.\n"
    )
    print(
        "| model | prefix caching | prompt tokens computed | cache-hit tokens | output tok/s | seconds | "
        "model s: prompt steps | model s: decode-only steps | computed vs off | tok/s vs off |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for model in models:
        size = {"max_num_seqs": max_num_seqs, "num_blocks": max_num_seqs * 40}  # 38 blocks per request: no preemption
        off = best(repeats, model, shared_prefix, n, seed, enable_prefix_caching=False, **size)
        on = best(repeats, model, shared_prefix, n, seed, enable_prefix_caching=True, **size)
        assert on["outputs"] == off["outputs"], "prefix caching changed greedy outputs"
        assert on["preemptions"] == off["preemptions"] == 0
        for name, r in (("off", off), ("on", on)):
            print(
                f"| {model} | {name} | {r['prompt_tokens']} | {r['hits']} | {r['tok_per_s']:.1f} | "
                f"{r['seconds']:.1f} | {r['prompt_s']:.1f} | {r['decode_s']:.1f} | "
                f"{r['prompt_tokens'] / off['prompt_tokens'] - 1:+.1%} | "
                f"{r['tok_per_s'] / off['tok_per_s']:.2f}x |",
                flush=True,
            )


def pressure_table(models: list[str], n: int, seed: int, repeats: int) -> None:
    print(f"\n### Memory pressure: {n} requests, KV cache ~60% of demand, prefix caching off\n")
    print(
        "| model | KV blocks | preemption | watermark | preemptions | blocks swapped out | tokens recomputed | "
        "output tok/s | steps | seconds |"
    )
    print("|---|---:|---|---|---:|---:|---:|---:|---:|---:|")
    for model in models:
        probe = LLM(model, dtype="float32", num_blocks=1)
        prompts, params = pressure(n, probe.engine.vocab_size, seed)
        bs, block_bytes = probe.engine.config.block_size, probe.engine.local_core.executor.runner.block_bytes
        mean_blocks = sum(-(-(len(p) + q.max_tokens) // bs) for p, q in zip(prompts, params)) / n
        blocks = int(0.6 * 32 * mean_blocks)
        reference = None
        for mode in ("recompute", "swap"):
            for name, (fraction, adaptive) in WATERMARKS.items():
                r = best(
                    repeats,
                    model,
                    pressure,
                    n,
                    seed,
                    num_blocks=blocks,
                    enable_prefix_caching=False,
                    preemption_mode=mode,
                    swap_space=blocks * block_bytes if mode == "swap" else 0,
                    watermark=fraction,
                    adaptive_watermark=adaptive,
                )
                reference = reference or r["outputs"]
                assert r["outputs"] == reference, "preemption changed greedy outputs"
                print(
                    f"| {model} | {blocks} | {mode} | {name} | {r['preemptions']} | {r['swapped_blocks']} | "
                    f"{r['recomputed']} | {r['tok_per_s']:.1f} | {r['steps']} | {r['seconds']:.1f} |",
                    flush=True,
                )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=["demo:tiny", "demo:small"])
    ap.add_argument("--pressure-models", nargs="+", default=["demo:tiny"])
    ap.add_argument("--workloads", nargs="+", default=["shared-prefix", "memory-pressure"])
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--repeats", type=int, default=1, help="report the fastest of this many runs")
    ap.add_argument("--max-num-seqs", type=int, default=32, help="shared-prefix workload only")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"torch threads: {torch.get_num_threads()}")
    if "shared-prefix" in args.workloads:
        shared_prefix_table(args.models, args.num_requests, args.seed, args.repeats, args.max_num_seqs)
    if "memory-pressure" in args.workloads:
        pressure_table(args.pressure_models, args.num_requests, args.seed, args.repeats)


if __name__ == "__main__":
    main()
