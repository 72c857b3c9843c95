"""Tensor parallelism on CPU: per-step dispatch overhead and throughput, TP=1 vs TP=2.

Dispatch overhead is the round trip of a step with no model work (a SchedulerOutput listing --num-prompts
request ids: driver -> every rank -> rank 0's reply back), i.e. what TP adds to every step (target <= 1 ms at
TP=2; the step goes as a pickled delta over one TCP connection per rank). "idle CPU/rank" is what a rank burns
while waiting for the next step.

    python -m benchmarks.tp --model demo:small --num-prompts 16 --max-tokens 32
"""

import argparse
import os
import statistics
import time

from benchmarks.percentiles import percentile

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
import ray  # noqa: E402
import torch  # noqa: E402

from conveyor.engine import LLM, SamplingParams  # noqa: E402
from conveyor.engine.step import SchedulerOutput  # noqa: E402


def dispatch_overhead_ms(llm: LLM, steps: int, batch: int) -> tuple[float, float]:
    so = SchedulerOutput(finished_req_ids=[f"req-{i}" for i in range(batch)])
    ex = llm.engine.local_core.executor
    for _ in range(20):
        ex.execute_model(so)
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        ex.execute_model(so)
        times.append((time.perf_counter() - t) * 1e3)
    return percentile(times, 0.5), percentile(times, 0.9)


def idle_cpu_percent(llm: LLM, seconds: float = 2.0) -> float:
    """CPU a waiting rank burns (mean over ranks, % of one core): a spinning channel shows up here."""
    import psutil

    workers = getattr(llm.engine.local_core.executor, "workers", [])
    if not workers:
        return 0.0
    procs = [psutil.Process(i.pid) for i in ray.get([w.info.remote() for w in workers])]
    before = [sum(p.cpu_times()[:2]) for p in procs]
    time.sleep(seconds)
    return statistics.mean(sum(p.cpu_times()[:2]) - b for p, b in zip(procs, before)) / seconds * 100


def throughput(llm: LLM, args: argparse.Namespace) -> tuple[float, float]:
    import random

    rng = random.Random(0)
    prompts = [
        {"prompt_token_ids": [rng.randrange(4, 8192) for _ in range(rng.randint(16, 64))]}
        for _ in range(args.num_prompts)
    ]
    sp = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    llm.generate(prompts[:2], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    engine, steps = llm.engine, 0
    start = time.perf_counter()
    for i, p in enumerate(prompts):
        engine.add_request(f"bench-{i}", p["prompt_token_ids"], sp)
    tokens = 0
    while engine.has_unfinished_requests():
        tokens += sum(1 for o in engine.step() if o.finished) * args.max_tokens
        steps += 1
    elapsed = time.perf_counter() - start
    return tokens / elapsed, elapsed / steps * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="demo:small")
    ap.add_argument("--num-prompts", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--threads", type=int, default=1, help="torch threads per rank (and for TP=1)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    ray.init(address="local", num_cpus=4, include_dashboard=False, _node_ip_address="127.0.0.1", log_to_driver=False)
    opts = dict(dtype="float32", max_num_seqs=args.num_prompts, max_model_len=256, enable_prefix_caching=False)
    rows = []
    try:
        for tp in (1, 2):
            llm = LLM(args.model, tensor_parallel_size=tp, **opts)
            try:
                p50, p90 = dispatch_overhead_ms(llm, args.steps, args.num_prompts)
                idle = idle_cpu_percent(llm)
                tps, step_ms = throughput(llm, args)
            finally:
                llm.engine.shutdown()
            rows.append((tp, p50, p90, idle, tps, step_ms))
    finally:
        ray.shutdown()
    print(
        f"\n{args.model}, {args.num_prompts} prompts x {args.max_tokens} tokens, float32, "
        f"{args.threads} torch thread(s) per rank, {os.cpu_count()} CPUs"
    )
    print(f"{'TP':>3} {'overhead p50 ms':>16} {'p90 ms':>8} {'idle CPU/rank':>14} {'tokens/s':>10} {'ms/step':>9}")
    for tp, p50, p90, idle, tps, step_ms in rows:
        print(f"{tp:>3} {p50:>16.3f} {p90:>8.3f} {idle:>13.0f}% {tps:>10.1f} {step_ms:>9.1f}")


if __name__ == "__main__":
    main()
