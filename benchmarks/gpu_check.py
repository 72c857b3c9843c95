"""The one prepared GPU check (a CUDA machine, no network): the Triton kernels against the reference
and their timings (benchmarks/kernels.py --quick), then the engine end to end on CUDA — greedy tokens
in float32 equal to the CPU run on demo:small (and on SmolLM2 when its checkpoint is in the model
cache), and bfloat16 tok/s on the seed workload. `python -m benchmarks.gpu_check`; exits 1 on any
mismatch, within ~8 minutes on one GPU."""
import argparse
import subprocess
import sys
import time

import torch

from benchmarks.throughput import workload
from engine import LLM, SamplingParams


def greedy(model: str, device: str, dtype: str, prompts: list[dict], max_tokens: int) -> list[list[int]]:
    llm = LLM(model, device=device, dtype=dtype, max_num_seqs=32, max_num_batched_tokens=2048)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True), use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def tok_per_s(model: str, dtype: str, n: int) -> float:
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
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to check here")
        return 1
    ok = True
    if not args.skip_kernels:
        ok &= subprocess.run([sys.executable, "-m", "benchmarks.kernels", "--quick"]).returncode == 0
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
