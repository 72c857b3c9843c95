"""torch.profiler over `LLM.generate` on the seed workload: the top ops by self CPU time and their
share of the run. `python -m benchmarks.op_profile --model demo:small --dtype bfloat16`."""
import argparse
import time

import torch
from torch.profiler import ProfilerActivity, profile

from benchmarks.throughput import workload
from engine import LLM, SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default="demo:small")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--num-requests", type=int, default=32)
    ap.add_argument("--top", type=int, default=12)
    ap.add_argument("--options", default="", help="extra LLM options as k=v,k=v (python literals)")
    args = ap.parse_args()
    options = {k: eval(v) for k, v in (kv.split("=") for kv in args.options.split(",") if kv)}
    llm = LLM(args.model, dtype=args.dtype, max_num_seqs=32, max_num_batched_tokens=2048, **options)
    prompts, params = workload(args.num_requests, 0, llm.engine.vocab_size)
    llm.generate(prompts[:2], [SamplingParams(max_tokens=4)] * 2, use_tqdm=False)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        start = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        elapsed = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    events = [e for e in prof.key_averages() if e.self_cpu_time_total > 0]
    total = sum(e.self_cpu_time_total for e in events)
    print(f"{args.model} {args.dtype}: {tokens / elapsed:.1f} tok/s under the profiler, "
          f"{torch.get_num_threads()} threads")
    print(f"{'op':<58}{'self %':>8}{'calls':>9}{'ms/call':>9}")
    for e in sorted(events, key=lambda e: -e.self_cpu_time_total)[:args.top]:
        print(f"{e.key[:57]:<58}{100 * e.self_cpu_time_total / total:>7.1f}%{e.count:>9}"
              f"{e.self_cpu_time_total / e.count / 1000:>9.3f}")


if __name__ == "__main__":
    main()
