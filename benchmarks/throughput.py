"""Offline throughput, continuous vs static batching, on the workload of the continuous-batching
literature scaled to CPU: 64 requests, prompts U[32, 256] tokens, outputs U[16, 192] tokens (exact),
at most 32 sequences, a 2048-token step budget. Prints output tokens/s and the ratio."""
import argparse
import random
import time

import torch

from engine import LLM, SamplingParams


def workload(n: int, seed: int, vocab: int) -> tuple[list[dict], list[SamplingParams]]:
    rng = random.Random(seed)
    prompts, params = [], []
    for _ in range(n):
        prompts.append({"prompt_token_ids": [rng.randrange(4, vocab) for _ in range(rng.randint(32, 256))]})
        out = rng.randint(16, 192)
        params.append(SamplingParams(temperature=0, max_tokens=out, min_tokens=out, ignore_eos=True))
    return prompts, params


def measure(model: str, dtype: str, policy: str, n: int, seed: int, **options: object) -> dict:
    llm = LLM(model, dtype=dtype, max_num_seqs=32, max_num_batched_tokens=2048, scheduling_policy=policy,
              seed=seed, **options)
    prompts, params = workload(n, seed, llm.engine.vocab_size)
    llm.generate(prompts[:2], [SamplingParams(max_tokens=4)] * 2, use_tqdm=False)
    steps = 0
    step = llm.engine.step

    def counted() -> list:
        nonlocal steps
        steps += 1
        return step()
    llm.engine.step = counted
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    stats = llm.engine.stats()
    return {"model": model, "dtype": dtype, "policy": policy, "seconds": elapsed, "output_tokens": tokens,
            "tok_per_s": tokens / elapsed, "steps": steps, "preemptions": stats.num_preemptions}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--models", nargs="+", default=["demo:tiny", "demo:small"])
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--repeats", type=int, default=1, help="alternate the policies N times, keep each one's best")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"torch threads: {torch.get_num_threads()}")
    print(f"{'model':<12}{'dtype':<10}{'policy':<12}{'tok/s':>9}{'steps':>7}{'seconds':>9}{'ratio':>8}")
    for model in args.models:
        for dtype in args.dtypes:
            rows: dict[str, dict] = {}
            for _ in range(args.repeats):
                for p in ("continuous", "static"):
                    r = measure(model, dtype, p, args.num_requests, args.seed)
                    if p not in rows or r["tok_per_s"] > rows[p]["tok_per_s"]:
                        rows[p] = r
            ratio = rows["continuous"]["tok_per_s"] / rows["static"]["tok_per_s"]
            for p, r in rows.items():
                tail = f"{ratio:>8.2f}" if p == "continuous" else ""
                print(f"{model:<12}{dtype:<10}{p:<12}{r['tok_per_s']:>9.1f}{r['steps']:>7}{r['seconds']:>9.1f}{tail}",
                      flush=True)


if __name__ == "__main__":
    main()
