"""C++ CPU kernels (kernels/csrc/, AVX-512): paged attention reading the block cache in place and
the KV store (paged_attention.h), fused RMSNorm(+residual), SiLU·mul and RoPE, thread binding
(cpu_ops.cpp). Built once with torch's cpp_extension on first use and cached per CPU; `load()` is
None where they cannot run.

The caches keep the engine's [num_blocks, block_size, kv_heads, head_dim] shape, but inside a block
these kernels lay K out as [kv_heads, head_dim, block_size] and V as [kv_heads, block_size, head_dim]
(`reference_layout` shows them the reference way): only store_kv_cache writes them, only
paged_attention reads them, and whole-block copies (swap, prefix sharing) do not care."""
import functools
import hashlib
import logging
import os
import time
from pathlib import Path
from types import ModuleType

import torch

CSRC = Path(__file__).with_name("csrc")
SOURCE = CSRC / "cpu_ops.cpp"  # one translation unit; it includes the headers beside it
CPU_FLAGS = ("avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16")
# -fopenmp: at::parallel_for is a header template; without it the kernels' loops run on one thread
CFLAGS = ["-O3", "-fopenmp", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512bf16", "-mfma",
          "-ffp-contract=off"]
log = logging.getLogger("conveyor")


def _cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    line = next((ln for ln in text.splitlines() if ln.startswith("flags")), "")
    return set(line.split(":", 1)[-1].split())


@functools.cache
def load() -> ModuleType | None:
    if os.environ.get("CONVEYOR_CPU_KERNELS", "1") == "0":
        return None
    missing = [f for f in CPU_FLAGS if f not in _cpu_flags()]
    if missing:
        log.info("C++ CPU kernels off: the CPU lacks %s", ", ".join(missing))
        return None
    digest = hashlib.sha256(b"".join(f.read_bytes() for f in sorted(CSRC.iterdir()))
                            + " ".join(CFLAGS).encode()
                            + torch.__version__.encode()).hexdigest()[:12]
    try:
        from torch.utils.cpp_extension import load as build
        clear_stale_lock(f"conveyor_cpu_ops_{digest}")
        return build(name=f"conveyor_cpu_ops_{digest}", sources=[str(SOURCE)], extra_cflags=CFLAGS,
                     extra_ldflags=["-fopenmp"])
    except Exception as e:  # no compiler or headers: the pure-torch path still runs
        log.warning("C++ CPU kernels unavailable (%s); using the torch reference", e)
        return None


STALE_LOCK_S = 600.0  # a build takes about a minute


def clear_stale_lock(name: str, now: float | None = None) -> bool:
    """Removes the build lock of extension `name` when it is older than STALE_LOCK_S. A build killed midway
    leaves it behind, and torch's cpp_extension then waits on it for ever, silently. True: one was removed."""
    from torch.utils.cpp_extension import _get_build_directory
    lock = Path(_get_build_directory(name, False)) / "lock"
    try:
        age = (time.time() if now is None else now) - lock.stat().st_mtime
    except FileNotFoundError:
        return False
    if age <= STALE_LOCK_S:
        return False
    log.warning("removing a stale build lock (%.0f s old, from a killed build): %s", age, lock)
    lock.unlink(missing_ok=True)
    return True


def reference_layout(k_cache: torch.Tensor, v_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Views of caches these kernels wrote, indexed [block, offset, kv_head, dim] as kernels/reference.py's."""
    n, bs, h, d = k_cache.shape
    return k_cache.view(n, h, d, bs).permute(0, 3, 1, 2), v_cache.view(n, h, bs, d).permute(0, 2, 1, 3)


def store_kv_cache(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   slot_mapping: torch.Tensor) -> None:
    load().store_kv_cache(key, value, k_cache, v_cache, slot_mapping)


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                    seq_lens: torch.Tensor, query_start_loc: torch.Tensor, scale: float) -> torch.Tensor:
    """Every sequence's new tokens over its whole cached context, decodes and prefills alike:
    q [T, h, d] packed as query_start_loc says -> [T, h, d]."""
    out = torch.empty(q.shape, dtype=q.dtype)
    load().paged_attention(out, q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale)
    return out


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                           max_seq_len: int | None = None) -> torch.Tensor:
    qsl = torch.arange(q.shape[0] + 1, dtype=torch.int32)
    return paged_attention(q, k_cache, v_cache, block_tables, seq_lens, qsl, scale)


def paged_prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            block_tables: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor,
                            max_query_len: int, scale: float, max_seq_len: int | None = None) -> torch.Tensor:
    return paged_attention(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale)


def bind_threads(cpus: list[int]) -> list[int]:
    """Pins torch's intra-op thread i to cpus[i]; returns the cpu each thread was bound to (-1: not)."""
    return load().bind_threads(cpus)
