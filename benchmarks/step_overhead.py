"""Host-side cost of one engine step with the model taken out (a null model that "samples" a fixed
token without running a layer): scheduler, KV bookkeeping, batch preparation, sampling columns,
update and output handling, at 32..256 running sequences in steady decode.
`python -m benchmarks.step_overhead --seqs 32 64 128 256`."""

import argparse
import statistics
import time
from collections import defaultdict

import torch

from conveyor.engine import LLM, SamplingParams


def null_run(vocab: int):
    def run(input_ids, positions, meta, sample_idx, batch):
        return (input_ids[sample_idx] * 31 + 7) % (vocab - 10) + 5, None

    return run


CLOCK = time.perf_counter


def timed(phases: dict[str, list[float]], name: str, fn):
    def wrapper(*args, **kwargs):
        start = CLOCK()
        try:
            return fn(*args, **kwargs)
        finally:
            phases[name].append(CLOCK() - start)

    return wrapper


def measure(seqs: int, prompt_len: int, steps: int, stream: bool) -> dict[str, float]:
    llm = LLM(
        "demo:tiny",
        dtype="float32",
        max_num_seqs=seqs,
        max_num_batched_tokens=max(2048, seqs * prompt_len),
        num_blocks=seqs * (prompt_len + steps + 64) // 16 + 16,
        enable_prefix_caching=True,
    )
    engine, runner = llm.engine, llm.engine.local_core.executor.runner
    engine.stream_outputs = stream
    runner._run = null_run(engine.vocab_size)
    params = SamplingParams(temperature=0, max_tokens=steps + 8, ignore_eos=True)
    for i in range(seqs):
        engine.add_request(str(i), [(i * 7 + j) % 1000 + 5 for j in range(prompt_len)], params)
    engine.step()  # every prompt in one prefill step
    phases: dict[str, list[float]] = defaultdict(list)
    sched = engine.local_core.scheduler
    sched.schedule = timed(phases, "schedule", sched.schedule)
    sched.update = timed(phases, "update", sched.update)
    runner.execute_model = timed(phases, "prepare", runner.execute_model)
    core = engine.core.core
    core.step = timed(phases, "core", core.step)
    engine.processor.process = timed(phases, "front", engine.processor.process)
    engine.step = timed(phases, "step", engine.step)
    for _ in range(steps):
        engine.step()
    assert len(sched.running) == seqs
    out = {k: statistics.median(v) * 1e3 for k, v in phases.items()}
    out["core out"] = out["core"] - out["schedule"] - out["prepare"] - out["update"]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--seqs", type=int, nargs="+", default=[32, 64, 128, 256])
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument(
        "--stream",
        action="store_true",
        help="build every running request's RequestOutput every step, as a streaming server does",
    )
    ap.add_argument(
        "--clock",
        choices=("wall", "cpu"),
        default="wall",
        help="cpu: this thread's CPU time, steadier than wall time on a shared machine",
    )
    args = ap.parse_args()
    global CLOCK
    CLOCK = time.thread_time if args.clock == "cpu" else time.perf_counter
    torch.set_num_threads(1)
    cols = ("schedule", "prepare", "update", "core out", "core", "front", "step")
    print(
        f"median ms per decode step ({args.clock} clock), null model; outputs "
        f"{'streamed (every request every step)' if args.stream else 'finished only (offline generate)'}\n"
        "prepare = model runner without the model; core out = the core's token deltas; core = the engine core's "
        "step (what runs in the core process when served);\nfront = detokenisation, stop strings, RequestOutputs "
        "(the front end's process when served); step = both, in one thread"
    )
    print(f"{'seqs':>6}" + "".join(f"{c:>10}" for c in cols))
    rows = {}
    for n in args.seqs:
        rows[n] = measure(n, args.prompt_len, args.steps, args.stream)
        print(f"{n:>6}" + "".join(f"{rows[n][c]:>10.3f}" for c in cols), flush=True)
    lo, hi = min(rows), max(rows)
    print(
        f"growth {lo} -> {hi} seqs: core x{rows[hi]['core'] / rows[lo]['core']:.2f}, "
        f"step x{rows[hi]['step'] / rows[lo]['step']:.2f} for x{hi / lo:.0f} sequences"
    )


if __name__ == "__main__":
    main()
