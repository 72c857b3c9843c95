"""Structured-output overhead: output tok/s of a batch where half the requests carry a JSON schema vs the same
batch all free. 64 requests (32 at a time), random prompts of 32-128 tokens; free requests decode exactly
--tokens tokens, constrained ones a JSON object with an array of --items digits (they end when it closes,
max_tokens = --tokens). Runs alternate on one warm engine; each mode keeps its best of --repeats. Prints tok/s,
the ratio, and how much of the constrained run went to grammar work (mask fill + matcher advance)."""
import argparse
import random
import time
from collections.abc import Callable
from typing import Any

import torch

from engine import LLM, SamplingParams
from engine.sampling_params import StructuredParams


def schema(items: int) -> dict:
    return {"type": "object", "properties": {
        "label": {"enum": ["alpha", "beta", "gamma"]},
        "values": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9},
                   "minItems": items, "maxItems": items}}, "required": ["label", "values"]}


def workload(n: int, seed: int, vocab: int, tokens: int, items: int, constrained: bool
             ) -> tuple[list[dict], list[SamplingParams]]:
    rng = random.Random(seed)
    prompts = [{"prompt_token_ids": [rng.randrange(4, vocab) for _ in range(rng.randint(32, 128))]} for _ in range(n)]
    free = SamplingParams(temperature=0, max_tokens=tokens, min_tokens=tokens, ignore_eos=True)
    json_ = SamplingParams(temperature=0, max_tokens=tokens, structured=StructuredParams(json=schema(items)))
    return prompts, [json_ if constrained and i % 2 else free for i in range(n)]


class Timed:
    """Wraps a method and adds up the seconds spent in it."""

    def __init__(self, f: Callable[..., Any]) -> None:
        self.f, self.seconds = f, 0.0

    def __call__(self, *args: Any) -> Any:
        t = time.perf_counter()
        try:
            return self.f(*args)
        finally:
            self.seconds += time.perf_counter() - t


def run(llm: LLM, prompts: list[dict], params: list[SamplingParams]) -> tuple[float, int, float]:
    manager = llm.engine.structured
    fill, accept = manager.bitmask, manager.accept
    manager.bitmask, manager.accept = Timed(fill), Timed(accept)
    try:
        start = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        elapsed = time.perf_counter() - start
    finally:
        spent = manager.bitmask.seconds + manager.accept.seconds
        manager.bitmask, manager.accept = fill, accept
    for o, p in zip(outs, params):
        if p.structured is not None:
            assert o.outputs[0].finish_reason == "stop", o.outputs[0].text
    return elapsed, sum(len(o.outputs[0].token_ids) for o in outs), spent


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default="demo:tiny")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--items", type=int, default=24)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    llm = LLM(args.model, dtype=args.dtype, max_num_seqs=32, max_num_batched_tokens=2048, enable_prefix_caching=False)
    vocab = llm.engine.vocab_size
    runs = {mode: workload(args.num_requests, args.seed, vocab, args.tokens, args.items, mode == "half-json")
            for mode in ("free", "half-json")}
    run(llm, *workload(4, args.seed + 1, vocab, 8, 2, True))
    best: dict[str, tuple[float, int, float]] = {}
    for _ in range(args.repeats):
        for mode, (prompts, params) in runs.items():
            elapsed, tokens, spent = run(llm, prompts, params)
            if mode not in best or tokens / elapsed > best[mode][1] / best[mode][0]:
                best[mode] = (elapsed, tokens, spent)
    print(f"torch threads: {torch.get_num_threads()}, model {args.model} {args.dtype}, {args.num_requests} requests")
    print(f"{'mode':<11}{'tok/s':>9}{'tokens':>8}{'seconds':>9}{'grammar s':>11}")
    for mode, (elapsed, tokens, spent) in best.items():
        print(f"{mode:<11}{tokens / elapsed:>9.1f}{tokens:>8}{elapsed:>9.2f}{spent:>11.3f}")
    free, half = (best[m][1] / best[m][0] for m in ("free", "half-json"))
    print(f"ratio half-json / free tok/s: {half / free:.3f}")


if __name__ == "__main__":
    main()
