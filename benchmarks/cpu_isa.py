"""The C++ CPU kernels per ISA build (kernels/cpu_ops.py): gemm_packed on decode shapes against
torch.nn.functional.linear, and paged decode attention against kernels.reference, in one run.

    python -m benchmarks.cpu_isa                  # every ISA this CPU runs (generic only where it is alone)
    python -m benchmarks.cpu_isa --isas avx2 generic --threads 2
    python -m benchmarks.cpu_isa --isas avx2 --rows 1 4 32 --against BUILD.so  # before/after in one run

Each time is the fastest single call of --rounds rounds of ~20 ms (on a shared machine a mean mostly
measures the other processes), the kernel and torch timed round by round in turn on the same inputs; ratio =
torch's time / the kernel's (above 1: the kernel is faster). --against loads another build of the kernels (an
extension module file, e.g. one of main's sources from torch's extension cache), timed in the same turns: its
time and its time / the kernel's (above 1: this build is faster), the outputs checked equal. One thread by default: per-core speed.
torch picks its own kernels for this CPU (AMX or AVX512-BF16 matmuls where present); to see torch as an
AVX2-only CPU runs it: MKL_ENABLE_INSTRUCTIONS=AVX2 ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2.
"""

import argparse
import importlib.util
import time
from pathlib import Path
from types import ModuleType
from typing import Callable

import torch
import torch.nn.functional as F

from conveyor.kernels import cpu_ops, reference  # noqa: E402

GEMM_SHAPES = [(576, 1536), (1536, 576), (768, 2048)]  # (K, N): y [M, N] = x [M, K] w[N, K]^T
GEMM_ROWS = (1, 4, 8, 32)
DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16}
# paged decode attention: sequences, context, heads, kv heads, head dim, block size
ATTENTION = (32, 512, 9, 3, 64, 16)


def seconds(fns: list[Callable[[], object]], rounds: int, round_s: float = 0.02) -> list[float]:
    """The fastest single call of each fn over `rounds` rounds of ~round_s each, the fns in turn each round
    (in reverse order every other round: the first after torch's reference finds the caches it evicted), after
    a warm-up call."""
    best = [float("inf")] * len(fns)
    for fn in fns:
        fn()
    for r in range(rounds):
        for i, fn in list(enumerate(fns))[:: -1 if r % 2 else 1]:
            end = time.perf_counter() + round_s
            while (start := time.perf_counter()) < end:
                fn()
                best[i] = min(best[i], time.perf_counter() - start)
    return best


Row = tuple[str, str, str, list[float]]  # op, dtype, shape, seconds: kernel, [against,] torch


def gemm_rows(libs: list[ModuleType], rows: tuple[int, ...], rounds: int) -> list[Row]:
    out = []
    g = torch.Generator().manual_seed(0)
    for name, dtype in DTYPES.items():
        for k, n in GEMM_SHAPES:
            w = torch.randn(n, k, generator=g).to(dtype)
            packed = [lib.pack_gemm(w) for lib in libs]
            for m in rows:
                x = torch.randn(m, k, generator=g).to(dtype)
                calls = [lambda lib=lib, p=p: lib.gemm_packed(x, p, n, None) for lib, p in zip(libs, packed)]
                assert all(torch.equal(calls[0](), c()) for c in calls[1:]), "the --against build's gemm differs"
                out.append(("gemm", name, f"M={m} K={k} N={n}", seconds(calls + [lambda: F.linear(x, w)], rounds)))
    return out


def attention_rows(libs: list[ModuleType], rounds: int) -> list[Row]:
    seqs, context, heads, kv_heads, d, bs = ATTENTION
    per_seq = context // bs
    g = torch.Generator().manual_seed(1)
    out = []
    for name, dtype in DTYPES.items():
        k_cache, v_cache = (torch.randn(seqs * per_seq, bs, kv_heads, d, generator=g).to(dtype) for _ in "kv")
        tables = torch.randperm(seqs * per_seq, generator=g).view(seqs, per_seq).to(torch.int32)
        lens = torch.full((seqs,), context, dtype=torch.int32)
        q = torch.randn(seqs, heads, d, generator=g).to(dtype)
        qsl = torch.arange(seqs + 1, dtype=torch.int32)
        outs = [torch.empty_like(q) for _ in libs]
        scale = d**-0.5
        calls = [
            lambda lib=lib, o=o: lib.paged_attention(o, q, k_cache, v_cache, tables, lens, qsl, scale)
            for lib, o in zip(libs, outs)
        ]
        eager = lambda: reference.paged_decode_attention(q, k_cache, v_cache, tables, lens, scale)  # noqa: E731
        times = seconds(calls + [eager], rounds)
        assert all(torch.equal(outs[0], o) for o in outs[1:]), "the --against build's attention differs"
        out.append(("attention", name, f"{seqs} decodes ctx {context} h{heads}/kv{kv_heads} d{d}", times))
    return out


def bench(label: str, libs: list[ModuleType], rows: tuple[int, ...], rounds: int) -> list[tuple[str, ...]]:
    """One build's table rows: (build, op, dtype, shape, kernel us, [against us, against / kernel,] torch us,
    torch / kernel)."""
    table = []
    for op, dtype, shape, times in gemm_rows(libs, rows, rounds) + attention_rows(libs, rounds):
        ours, *against, eager = times
        cells = [f"{ours * 1e6:.1f}"] + [c for t in against for c in (f"{t * 1e6:.1f}", f"{t / ours:.2f}")]
        table.append((label, op, dtype, shape, *cells, f"{eager * 1e6:.1f}", f"{eager / ours:.2f}"))
    return table


def print_table(rows: list[tuple[str, ...]], against: bool) -> None:
    header = ("build", "op", "dtype", "shape", "kernel us")
    header += ("against us", "against/kernel") if against else ()
    header += ("torch us", "torch/kernel")
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
    parser.add_argument("--rows", type=int, nargs="+", default=GEMM_ROWS, help="gemm rows M")
    parser.add_argument("--against", type=Path, default=None, help="another build's extension module file")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, CPU runs {', '.join(cpu_ops.supported_isas())}",
        flush=True,
    )
    against = [load_file(args.against)] if args.against else []
    rows = []
    for isa in args.isas or default_isas():
        lib = cpu_ops.load(isa)
        if lib is None:
            print(f"{isa}: not available here (see the log)", flush=True)
            continue
        rows += bench(isa, [lib] + against, tuple(args.rows), args.rounds)
    print_table(rows, bool(against))


def load_file(path: Path) -> ModuleType:
    """The extension module in `path` (a .so torch's cpp_extension built)."""
    spec = importlib.util.spec_from_file_location(path.name.split(".")[0], path)
    assert spec and spec.loader, f"not an extension module: {path}"
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


if __name__ == "__main__":
    main()
