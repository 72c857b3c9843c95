"""Structured-output overhead: output tok/s of a batch where half the requests carry a JSON schema vs the same
batch all free. 64 requests (32 at a time), random prompts of 32-128 tokens. In the half-json run, free
requests decode exactly --tokens tokens and constrained ones a JSON object with an array of --items digits
(ending when it closes, max_tokens = --tokens); in the free run every request decodes exactly as many tokens
as it did in the half-json run, so both runs have the same batch shape every step. Runs alternate on one warm
engine; each mode keeps its best of --repeats. Prints tok/s, tok per process CPU-second (robust when the
machine is shared), the ratios, and the seconds spent in grammar work (mask fill, matcher advance, mask rows, masking the logits)."""

import argparse
import random
import time
from collections.abc import Callable
from typing import Any

import torch

import conveyor.engine.execution.model_runner as model_runner
import conveyor.engine.execution.sampler as sampler
from conveyor.engine import LLM, SamplingParams
from conveyor.engine.sampling_params import StructuredParams


def schema(items: int) -> dict:
    return {
        "type": "object",
        "properties": {
            "label": {"enum": ["alpha", "beta", "gamma"]},
            "values": {
                "type": "array",
                "items": {"type": "integer", "minimum": 0, "maximum": 9},
                "minItems": items,
                "maxItems": items,
            },
        },
        "required": ["label", "values"],
    }


def workload(
    n: int, seed: int, vocab: int, tokens: int, items: int, constrained: bool, lengths: list[int] | None = None
) -> tuple[list[dict], list[SamplingParams]]:
    """`lengths` (the half-json run's output lengths) make the free run decode exactly as many tokens per request."""
    rng = random.Random(seed)
    prompts = [{"prompt_token_ids": [rng.randrange(4, vocab) for _ in range(rng.randint(32, 128))]} for _ in range(n)]
    lengths = lengths or [tokens] * n
    free = [SamplingParams(temperature=0, max_tokens=k, min_tokens=k, ignore_eos=True) for k in lengths]
    json_ = SamplingParams(temperature=0, max_tokens=tokens, structured=StructuredParams(json=schema(items)))
    return prompts, [json_ if constrained and i % 2 else free[i] for i in range(n)]


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


def run(llm: LLM, prompts: list[dict], params: list[SamplingParams]) -> tuple[float, float, list[int], float]:
    """(wall s, process CPU s, output tokens per request, s in constraint work: mask fill, matcher advance,
    bitmask rows for the sampler, applying the mask to the logits)."""
    manager = llm.engine.local_core.structured
    fill, accept = manager.bitmask, manager.accept
    manager.bitmask, manager.accept = Timed(fill), Timed(accept)
    rows, apply = model_runner.add_constraints, sampler.apply_bitmask
    model_runner.add_constraints, sampler.apply_bitmask = Timed(rows), Timed(apply)
    try:
        start, cpu = time.perf_counter(), time.process_time()
        outs = llm.generate(prompts, params, use_tqdm=False)
        elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu
    finally:
        spent = sum(
            t.seconds for t in (manager.bitmask, manager.accept, model_runner.add_constraints, sampler.apply_bitmask)
        )
        manager.bitmask, manager.accept = fill, accept
        model_runner.add_constraints, sampler.apply_bitmask = rows, apply
    for o, p in zip(outs, params):
        if p.structured is not None:
            assert o.outputs[0].finish_reason == "stop", o.outputs[0].text
    return elapsed, cpu, [len(o.outputs[0].token_ids) for o in outs], spent


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default="demo:tiny")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--items", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    llm = LLM(args.model, dtype=args.dtype, max_num_seqs=32, max_num_batched_tokens=2048, enable_prefix_caching=False)
    vocab = llm.engine.vocab_size
    half = workload(args.num_requests, args.seed, vocab, args.tokens, args.items, True)
    lengths = run(llm, *half)[2]
    runs = {
        "free": workload(args.num_requests, args.seed, vocab, args.tokens, args.items, False, lengths),
        "half-json": half,
    }
    run(llm, *runs["free"])
    best: dict[str, tuple[float, float, int, float]] = {}
    for _ in range(args.repeats):
        for mode, (prompts, params) in runs.items():
            elapsed, cpu, per_request, spent = run(llm, prompts, params)
            tokens = sum(per_request)
            if mode not in best or tokens / elapsed > best[mode][2] / best[mode][0]:
                best[mode] = (elapsed, cpu, tokens, spent)
    print(
        f"torch threads: {torch.get_num_threads()}, model {args.model} {args.dtype}, {args.num_requests} requests, "
        f"best of {args.repeats} after a warm-up run of each"
    )
    print(f"{'mode':<11}{'tok/s':>9}{'tok/cpu-s':>11}{'tokens':>8}{'wall s':>8}{'cpu s':>8}{'constraint s':>14}")
    for mode, (elapsed, cpu, tokens, spent) in best.items():
        print(
            f"{mode:<11}{tokens / elapsed:>9.1f}{tokens / cpu:>11.1f}{tokens:>8}{elapsed:>8.2f}{cpu:>8.2f}{spent:>14.3f}"
        )
    (fw, fc, ft, _), (hw, hc, ht, _) = best["free"], best["half-json"]
    print(f"ratio half-json / free: tok/s {ht / hw / (ft / fw):.3f}, tok per CPU-second {ht / hc / (ft / fc):.3f}")
    print(
        f"constraint work: {best['half-json'][3]:.3f} s = {best['half-json'][3] / hw:.1%} of the half-json run's wall "
        f"time (the rest of the step is shared with free requests)"
    )


if __name__ == "__main__":
    main()
