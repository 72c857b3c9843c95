"""The one prepared GPU check (a CUDA machine, no network): the Triton kernels against the reference
and their timings (benchmarks/triton_kernels.py --quick), then the engine end to end on CUDA — greedy tokens
in float32 equal to the CPU run on demo:small (and on SmolLM2 when its checkpoint is in the model
cache), and bfloat16 tok/s on the seed workload. `python -m benchmarks.gpu_check`; exits 1 on any
mismatch, within ~8 minutes on one GPU.

`python -m benchmarks.gpu_check --aot` needs no GPU: it compiles every Triton kernel the engine launches
(kernels/triton_kernels.py, kernels/triton_lora_kernels.py) for sm_80 and sm_90 with the constexprs and launch
options the launchers (kernels/triton_ops.py) pick, and fails on register spills, shared memory over the
target's limit, or a 16-bit tl.dot without tensor-core MMA in the SASS. Results are cached under
~/.cache/conveyor/triton-aot/."""

import argparse
import subprocess
import sys
import time
from pathlib import Path

import torch

from benchmarks.aot_cases import AOT_CACHE_DIR
from benchmarks.aot_check import aot_main


def greedy(model: str, device: str, dtype: str, prompts: list[dict], max_tokens: int) -> list[list[int]]:
    from conveyor.engine import LLM, SamplingParams

    llm = LLM(model, device=device, dtype=dtype, max_num_seqs=32, max_num_batched_tokens=2048)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True), use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def tok_per_s(model: str, dtype: str, n: int) -> float:
    from benchmarks.throughput import workload
    from conveyor.engine import LLM, SamplingParams

    llm = LLM(model, device="cuda", dtype=dtype, max_num_seqs=32, max_num_batched_tokens=2048)
    prompts, params = workload(n, 0, llm.engine.vocab_size)
    llm.generate(prompts[:2], [SamplingParams(max_tokens=4)] * 2, use_tqdm=False)
    torch.cuda.synchronize()
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    torch.cuda.synchronize()
    return sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - start)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--models", nargs="+", default=["demo:small", "demo:smollm2"])
    ap.add_argument("--skip-kernels", action="store_true")
    ap.add_argument(
        "--aot",
        action="store_true",
        help="no GPU needed: compile every Triton kernel for sm_80 and sm_90 and check the binaries",
    )
    ap.add_argument("--jobs", type=int, default=2, help="--aot: compile processes")
    ap.add_argument("--only", help="--aot: only cases whose label contains this, e.g. 'prefill float32'")
    ap.add_argument("--cache-dir", type=Path, default=AOT_CACHE_DIR, help="--aot: result cache")
    ap.add_argument("--no-cache", action="store_true", help="--aot: compile everything, read and write no cache")
    args = ap.parse_args()
    if args.aot:
        return aot_main(args)
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to check here")
        return 1
    ok = True
    if not args.skip_kernels:
        ok &= subprocess.run([sys.executable, "-m", "benchmarks.triton_kernels", "--quick"]).returncode == 0
    from benchmarks.throughput import workload
    from conveyor.engine import LLM

    for model in args.models:
        try:
            probe = LLM(model, device="cpu", dtype="float32")
        except (ValueError, OSError, RuntimeError) as e:
            print(f"{model}: not available offline here ({e}); skipped")
            continue
        prompts, _ = workload(8, 1, probe.engine.vocab_size)
        del probe
        cpu = greedy(model, "cpu", "float32", prompts, 24)
        gpu = greedy(model, "cuda", "float32", prompts, 24)
        same = sum(a == b for a, b in zip(cpu, gpu))
        print(f"{model}: float32 greedy tokens CUDA == CPU for {same}/{len(cpu)} requests", flush=True)
        ok &= same == len(cpu)
        print(f"{model}: bfloat16 seed workload {tok_per_s(model, 'bfloat16', 64):.0f} tok/s on CUDA", flush=True)
    print("GPU check", "passed" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
