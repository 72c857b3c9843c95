"""The C++ CPU kernels per ISA build (kernels/cpu_ops.py): gemm_packed on decode shapes against
torch.nn.functional.linear, and paged decode attention against kernels.reference, in one run.

    python -m benchmarks.cpu_isa                  # every ISA this CPU runs (generic only where it is alone)
    python -m benchmarks.cpu_isa --isas avx2 generic --threads 2

Each time is the fastest single call of --rounds rounds of ~20 ms (on a shared machine a mean mostly
measures the other processes), the kernel and torch timed back to back on the same inputs; ratio =
torch's time / the kernel's (above 1: the kernel is faster). One thread by default: per-core speed.
torch picks its own kernels for this CPU (AMX or AVX512-BF16 matmuls where present); to see torch as an
AVX2-only CPU runs it: MKL_ENABLE_INSTRUCTIONS=AVX2 ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2.
"""

import argparse
import time
from types import ModuleType
from typing import Callable

import torch
import torch.nn.functional as F

from conveyor.kernels import cpu_ops, reference  # noqa: E402

GEMM_SHAPES = [(576, 1536), (1536, 576), (768, 2048)]  # (K, N): y [M, N] = x [M, K] w[N, K]^T
GEMM_ROWS = (1, 8, 32)
DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16}
# paged decode attention: sequences, context, heads, kv heads, head dim, block size
ATTENTION = (32, 512, 9, 3, 64, 16)


def seconds(fn: Callable[[], object], rounds: int, round_s: float = 0.02) -> float:
    """The fastest single call of `rounds` rounds of ~round_s each, after a warm-up call."""
    fn()
    best = float("inf")
    for _ in range(rounds):
        end = time.perf_counter() + round_s
        while (start := time.perf_counter()) < end:
            fn()
            best = min(best, time.perf_counter() - start)
    return best


def gemm_rows(lib: ModuleType, rounds: int) -> list[tuple[str, str, str, float, float]]:
    rows = []
    g = torch.Generator().manual_seed(0)
    for name, dtype in DTYPES.items():
        for k, n in GEMM_SHAPES:
            w = torch.randn(n, k, generator=g).to(dtype)
            packed = lib.pack_gemm(w)
            for m in GEMM_ROWS:
                x = torch.randn(m, k, generator=g).to(dtype)
                ours = seconds(lambda: lib.gemm_packed(x, packed, n, None), rounds)
                eager = seconds(lambda: F.linear(x, w), rounds)
                rows.append(("gemm", name, f"M={m} K={k} N={n}", ours, eager))
    return rows


def attention_rows(lib: ModuleType, rounds: int) -> list[tuple[str, str, str, float, float]]:
    seqs, context, heads, kv_heads, d, bs = ATTENTION
    per_seq = context // bs
    g = torch.Generator().manual_seed(1)
    rows = []
    for name, dtype in DTYPES.items():
        k_cache, v_cache = (torch.randn(seqs * per_seq, bs, kv_heads, d, generator=g).to(dtype) for _ in "kv")
        tables = torch.randperm(seqs * per_seq, generator=g).view(seqs, per_seq).to(torch.int32)
        lens = torch.full((seqs,), context, dtype=torch.int32)
        q = torch.randn(seqs, heads, d, generator=g).to(dtype)
        qsl = torch.arange(seqs + 1, dtype=torch.int32)
        out = torch.empty_like(q)
        scale = d**-0.5
        ours = seconds(lambda: lib.paged_attention(out, q, k_cache, v_cache, tables, lens, qsl, scale), rounds)
        eager = seconds(lambda: reference.paged_decode_attention(q, k_cache, v_cache, tables, lens, scale), rounds)
        rows.append(("attention", name, f"{seqs} decodes ctx {context} h{heads}/kv{kv_heads} d{d}", ours, eager))
    return rows


def bench(label: str, lib: ModuleType, rounds: int) -> list[tuple[str, ...]]:
    """One build's table rows: (build, op, dtype, shape, kernel us, torch us, torch / kernel)."""
    return [
        (label, op, dtype, shape, f"{ours * 1e6:.1f}", f"{eager * 1e6:.1f}", f"{eager / ours:.2f}")
        for op, dtype, shape, ours, eager in gemm_rows(lib, rounds) + attention_rows(lib, rounds)
    ]


def print_table(rows: list[tuple[str, ...]]) -> None:
    header = ("build", "op", "dtype", "shape", "kernel us", "torch us", "torch/kernel")
    widths = [max(len(r[i]) for r in rows + [header]) for i in range(len(header))]
    for r in [header] + rows:
        print("  ".join(c.ljust(w) if i < 4 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))), flush=True)


def default_isas() -> list[str]:
    isas = cpu_ops.supported_isas()
    return [i for i in isas if i != "generic"] or isas


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--isas", nargs="+", default=None, choices=cpu_ops.ISAS)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, CPU runs {', '.join(cpu_ops.supported_isas())}",
        flush=True,
    )
    rows = []
    for isa in args.isas or default_isas():
        lib = cpu_ops.load(isa)
        if lib is None:
            print(f"{isa}: not available here (see the log)", flush=True)
            continue
        rows += bench(isa, lib, args.rounds)
    print_table(rows)


if __name__ == "__main__":
    main()
