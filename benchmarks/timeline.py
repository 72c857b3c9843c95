"""`conveyor bench timeline`: the engine's step trace, static vs continuous batching on the same workload.

One PNG: per policy, rows = batch slots, columns = engine steps, colour = prefill / decode / idle-padding
(a finished request that static batching keeps decoding until its whole batch is done), the KV-cache use
beneath. Also writes both traces as Chrome trace JSON (open in https://ui.perfetto.dev)."""

import argparse
import json
import random
from pathlib import Path
from typing import Any

from benchmarks.lengths import Lengths, token_prompts
from conveyor.engine import LLM, SamplingParams
from conveyor.engine.core.step_trace import StepRecord, chrome_trace


def trace_run(
    model: str, policy: str, prompts: list[list[int]], outputs: list[int], **options: Any
) -> tuple[list[StepRecord], list[list[int]]]:
    llm = LLM(model, scheduling_policy=policy, **options)
    llm.generate([{"prompt_token_ids": [5, 6, 7]}], SamplingParams(max_tokens=2), use_tqdm=False)
    llm.engine.local_core.step_trace.enable()
    params = [SamplingParams(temperature=0, max_tokens=n, min_tokens=n, ignore_eos=True) for n in outputs]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return llm.engine.local_core.step_trace.disable(), [o.outputs[0].token_ids for o in outs]


def summary(records: list[StepRecord]) -> dict[str, Any]:
    return {
        "steps": len(records),
        "seconds": sum(r.duration_s for r in records),
        **{f"{k}_tokens": sum(r.tokens(k) for r in records) for k in ("prefill", "decode", "padding")},
        "preemptions": sum(r.num_preemptions for r in records),
        "peak_kv_blocks_used": max((r.kv_blocks_used for r in records), default=0),
    }


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="demo:tiny")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--num-requests", type=int, default=24)
    p.add_argument("--prompt-len", default="uniform:16,128")
    p.add_argument("--output-len", default="uniform:4,64")
    p.add_argument("--max-num-seqs", type=int, default=8)
    p.add_argument("--max-num-batched-tokens", type=int, default=512)
    p.add_argument("--num-blocks", type=int, default=None, help="a small KV cache shows preemptions")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=Path("bench-timeline.png"))
    p.add_argument("--trace", type=Path, default=Path("bench-timeline.trace.json"))


def main(args: argparse.Namespace) -> int:
    rng = random.Random(args.seed)
    prompt_spec, output_spec = (
        Lengths.parse(args.prompt_len, "--prompt-len"),
        Lengths.parse(args.output_len, "--output-len"),
    )
    if args.num_requests < 1:
        raise ValueError("--num-requests must be >= 1")
    prompts = token_prompts(prompt_spec, args.num_requests, 256, rng)
    outputs = [output_spec.sample(rng) for _ in prompts]
    options = dict(
        dtype=args.dtype,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        seed=args.seed,
        enable_prefix_caching=False,
    )
    if args.num_blocks:
        options["num_blocks"] = args.num_blocks
    traces, results = {}, {}
    for policy in ("static", "continuous"):
        traces[policy], results[policy] = trace_run(args.model, policy, prompts, outputs, **options)
        s = summary(traces[policy])
        print(
            f"{policy:<11} steps {s['steps']:>5}  {s['seconds']:.2f} s  prefill {s['prefill_tokens']}  "
            f"decode {s['decode_tokens']}  padding {s['padding_tokens']}  preemptions {s['preemptions']}"
        )
    if results["static"] != results["continuous"]:
        raise AssertionError("static and continuous batching produced different greedy outputs")
    from benchmarks.charts import timeline_chart

    title = (
        f"{args.model}: {args.num_requests} requests, prompts {args.prompt_len}, outputs {args.output_len}, "
        f"max_num_seqs {args.max_num_seqs}"
    )
    timeline_chart(traces, args.out, title)
    events = [e for pid, (name, rec) in enumerate(traces.items()) for e in chrome_trace(rec, f"{name} batching", pid)]
    args.trace.write_text(
        json.dumps(
            {"traceEvents": events, "displayTimeUnit": "ms", "otherData": {k: summary(v) for k, v in traces.items()}}
        )
    )
    print(f"wrote {args.out} and {args.trace}")
    return 0
