"""torch.profiler over `LLM.generate` on the seed workload: the top ops by self CPU time and their
share of the run's wall time, the C++ CPU kernels (pybind calls the profiler cannot see) included as
`conveyor::*` ranges, and what is left: host time outside any op.
`python -m benchmarks.op_profile --model demo:small --dtype bfloat16`."""

import argparse
import time

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from benchmarks.throughput import workload
from conveyor.engine import LLM, SamplingParams
from conveyor.kernels import cpu_ops

KERNELS = ("paged_attention", "store_kv_cache", "rms_norm_", "silu_and_mul", "rotary_embedding_", "gemm_packed")


def trace_cpu_kernels() -> None:
    """Wraps the C++ kernels in profiler ranges; the engine looks them up as module attributes."""
    lib = cpu_ops.load()
    if lib is None:
        return
    for name in KERNELS:
        fn = getattr(lib, name)

        def traced(*args, _fn=fn, _name=f"conveyor::{name}", **kwargs):
            with record_function(_name):
                return _fn(*args, **kwargs)

        setattr(lib, name, traced)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default="demo:small")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--num-requests", type=int, default=32)
    ap.add_argument("--top", type=int, default=12)
    ap.add_argument("--options", default="", help="extra LLM options as k=v,k=v (python literals)")
    args = ap.parse_args()
    options = {k: eval(v) for k, v in (kv.split("=") for kv in args.options.split(",") if kv)}
    trace_cpu_kernels()
    llm = LLM(args.model, dtype=args.dtype, max_num_seqs=32, max_num_batched_tokens=2048, **options)
    prompts, params = workload(args.num_requests, 0, llm.engine.vocab_size)
    llm.generate(prompts[:2], [SamplingParams(max_tokens=4)] * 2, use_tqdm=False)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        start = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        elapsed = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    events = [e for e in prof.key_averages() if e.self_cpu_time_total > 0 and e.key != "ProfilerStep*"]
    wall_us = elapsed * 1e6
    print(
        f"{args.model} {args.dtype}: {tokens / elapsed:.1f} tok/s under the profiler, "
        f"{torch.get_num_threads()} threads; shares are of the run's wall time"
    )
    print(f"{'op':<58}{'wall %':>8}{'calls':>9}{'ms/call':>9}")
    for e in sorted(events, key=lambda e: -e.self_cpu_time_total)[: args.top]:
        print(
            f"{e.key[:57]:<58}{100 * e.self_cpu_time_total / wall_us:>7.1f}%{e.count:>9}"
            f"{e.self_cpu_time_total / e.count / 1000:>9.3f}"
        )
    host = wall_us - sum(e.self_cpu_time_total for e in events)
    print(f"{'host: Python and everything outside an op':<58}{100 * host / wall_us:>7.1f}%")


if __name__ == "__main__":
    main()
