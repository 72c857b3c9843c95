"""C++ CPU kernels (kernels/csrc/): paged attention reading the block cache in place and the KV store
(paged_attention.h), the small-batch matmul over packed weights (gemm.h), fused RMSNorm(+residual),
SiLU·mul and RoPE, thread binding (cpu_ops.cpp).

One source, compiled per instruction set: vec.h implements its 16-lane vector once for each ISA, and
each ISA is its own extension module, built with torch's cpp_extension on first use and cached under a
name holding the ISA and a digest of the sources, flags and torch version. ISAS lists them best first:
`load()` takes the best this CPU runs, or the one the environment variable CONVEYOR_CPU_ISA names (None,
with the reason logged, where this CPU cannot run it); CONVEYOR_CPU_KERNELS=0 turns them all off. Every
build does the same operations in the same order, so results are bit-identical across ISAs, except that
the avx512bf16 build's bfloat16 instructions flush subnormals to zero.

The caches keep the engine's [num_blocks, block_size, kv_heads, head_dim] shape, but inside a block
these kernels lay K out as [kv_heads, head_dim, block_size] and V as [kv_heads, block_size, head_dim]
(`reference_layout` shows them the reference way): only store_kv_cache writes them, only
paged_attention reads them, and whole-block copies (swap, prefix sharing) do not care."""

import contextlib
import functools
import hashlib
import logging
import os
import platform
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import torch
from filelock import FileLock

CSRC = Path(__file__).with_name("csrc")
SOURCE = CSRC / "cpu_ops.cpp"  # one translation unit; it includes the headers beside it
_AVX512 = ("avx512f", "avx512bw", "avx512vl", "avx512dq")
# ISA -> the /proc/cpuinfo flags it needs (x86) and its compiler flags, best first. generic runs anywhere.
ISA_CPU_FLAGS: dict[str, tuple[str, ...]] = {
    "avx512bf16": _AVX512 + ("avx512_bf16",),
    "avx512": _AVX512,
    "avx2": ("avx2", "fma", "f16c"),
    "generic": (),
}
ISA_CFLAGS: dict[str, list[str]] = {
    "avx512bf16": [
        "-DCONVEYOR_ISA_AVX512BF16",
        "-mavx512f",
        "-mavx512bw",
        "-mavx512vl",
        "-mavx512dq",
        "-mavx512bf16",
        "-mfma",
    ],
    "avx512": ["-DCONVEYOR_ISA_AVX512", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma"],
    "avx2": ["-DCONVEYOR_ISA_AVX2", "-mavx2", "-mfma", "-mf16c"],
    "generic": ["-DCONVEYOR_ISA_GENERIC"],
}
ISAS = tuple(ISA_CFLAGS)
# -fopenmp: at::parallel_for is a header template; without it the kernels' loops run on one thread.
# -ffp-contract=off: a multiply and an add stay two roundings unless the source asks for fma.
COMMON_CFLAGS = ["-O3", "-fopenmp", "-ffp-contract=off"]
log = logging.getLogger("conveyor")


@functools.cache
def _cpu_flags() -> frozenset[str]:
    """This CPU's /proc/cpuinfo flags, read once: `load()` runs on every kernel call."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    line = next((ln for ln in text.splitlines() if ln.startswith("flags")), "")
    return frozenset(line.split(":", 1)[-1].split())


@functools.cache
def _is_x86() -> bool:
    return platform.machine().lower() in ("x86_64", "amd64", "i386", "i686")


def missing_cpu_flags(isa: str) -> list[str]:
    """The /proc/cpuinfo flags `isa` needs that this CPU lacks (["x86"] off x86 for the x86 ISAs)."""
    needed = ISA_CPU_FLAGS[isa]
    if needed and not _is_x86():
        return ["x86"]
    flags = _cpu_flags()
    return [f for f in needed if f not in flags]


def supported_isas() -> list[str]:
    """The ISAs this CPU can run, best first (generic always)."""
    return [isa for isa in ISAS if not missing_cpu_flags(isa)]


@functools.cache
def _best_isa() -> str:
    return supported_isas()[0]


def cflags(isa: str) -> list[str]:
    return COMMON_CFLAGS + ISA_CFLAGS[isa]


def module_name(isa: str) -> str:
    """The extension's cache name: the ISA and a digest of the sources, its flags and torch's version."""
    digest = hashlib.sha256(
        b"".join(f.read_bytes() for f in sorted(CSRC.iterdir()))
        + " ".join(cflags(isa)).encode()
        + torch.__version__.encode()
    ).hexdigest()[:12]
    return f"conveyor_cpu_ops_{isa}_{digest}"


def load(isa: str | None = None) -> ModuleType | None:
    """The kernels compiled for `isa`, else for CONVEYOR_CPU_ISA, else for the best ISA this CPU runs;
    None (the reason logged) where that ISA cannot run or build here, or with CONVEYOR_CPU_KERNELS=0."""
    if os.environ.get("CONVEYOR_CPU_KERNELS", "1") == "0":
        return None
    return _load(isa or os.environ.get("CONVEYOR_CPU_ISA") or _best_isa())


def isa() -> str | None:
    """The ISA of the kernels `load()` gives, or None where it gives none."""
    lib = load()
    return None if lib is None else lib.isa


@functools.cache
def _load(isa: str) -> ModuleType | None:
    if isa not in ISA_CFLAGS:
        log.warning("C++ CPU kernels off: unknown ISA %r (CONVEYOR_CPU_ISA takes one of %s)", isa, ", ".join(ISAS))
        return None
    missing = missing_cpu_flags(isa)
    if missing:
        log.warning("C++ CPU kernels off: the CPU lacks %s for ISA %s", ", ".join(missing), isa)
        return None
    name = module_name(isa)
    try:
        from torch.utils.cpp_extension import load as build

        with build_lock(name):
            return build(name=name, sources=[str(SOURCE)], extra_cflags=cflags(isa), extra_ldflags=["-fopenmp"])
    except Exception as e:  # no compiler or headers: the pure-torch path still runs
        log.warning("C++ CPU kernels (%s) unavailable (%s); using the torch reference", isa, e)
        return None


@contextlib.contextmanager
def build_lock(name: str) -> Iterator[None]:
    """Held while extension `name` builds: an OS file lock (filelock), which the kernel releases when its holder
    dies. torch's own lock file is a plain file that a build killed midway leaves behind, and torch then waits on
    it for ever; while this lock is held no other build of `name` runs, so that file is removed first."""
    from torch.utils.cpp_extension import _get_build_directory

    directory = Path(_get_build_directory(name, False))
    with FileLock(str(directory.with_name(directory.name + ".conveyor.lock"))):
        stale = directory / "lock"
        if stale.exists():
            log.warning("removing the build lock a killed build left: %s", stale)
            stale.unlink(missing_ok=True)
        yield


def reference_layout(k_cache: torch.Tensor, v_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Views of caches these kernels wrote, indexed [block, offset, kv_head, dim] as kernels/reference.py's."""
    n, bs, h, d = k_cache.shape
    return k_cache.view(n, h, d, bs).permute(0, 3, 1, 2), v_cache.view(n, h, bs, d).permute(0, 2, 1, 3)


def store_kv_cache(
    key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    load().store_kv_cache(key, value, k_cache, v_cache, slot_mapping)


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Every sequence's new tokens over its whole cached context, decodes and prefills alike:
    q [T, h, d] packed as query_start_loc says -> [T, h, d]."""
    out = torch.empty(q.shape, dtype=q.dtype)
    load().paged_attention(out, q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale)
    return out


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    max_seq_len: int | None = None,
) -> torch.Tensor:
    qsl = torch.arange(q.shape[0] + 1, dtype=torch.int32)
    return paged_attention(q, k_cache, v_cache, block_tables, seq_lens, qsl, scale)


def paged_prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    max_query_len: int,
    scale: float,
    max_seq_len: int | None = None,
) -> torch.Tensor:
    return paged_attention(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale)


def bind_threads(cpus: list[int]) -> list[int]:
    """Pins torch's intra-op thread i to cpus[i]; returns the cpu each thread was bound to (-1: not)."""
    return load().bind_threads(cpus)
