"""Every Triton kernel the engine launches compiles for real GPUs (sm_80, sm_90) on this CPU-only machine:
no register spills, shared memory within the target's limit, tensor-core MMA for every 16-bit tl.dot.
benchmarks.aot_check compiles in spawned processes with TRITON_INTERPRET unset, so the interpreter that
tests/conftest.py turns on here does not reach these compiles."""

from collections import defaultdict
from pathlib import Path

import pytest

from benchmarks.aot_cases import (
    AOT_CACHE_DIR,
    AOT_DTYPES,
    AOT_GROUPS,
    AOT_HEAD_DIMS,
    AOT_LORA_RANKS,
    AOT_SMEM_LIMIT,
    aot_cases,
    group_block_pairs,
)
from benchmarks.aot_check import run_aot_check

KERNELS = {"_store_kv_kernel", "_decode_kernel", "_reduce_splits_kernel", "_prefill_kernel"}
LORA_KERNELS = {"_lora_shrink_kernel", "_lora_expand_kernel"}


def test_covering_set_pairs_every_dtype_with_every_group_and_block_size() -> None:
    cases = aot_cases()
    for op in ("decode", "prefill"):
        for dtype in AOT_DTYPES:
            mine = [c for c in cases if c.op == op and c.dtype == dtype]
            assert {(c.group, c.block_size) for c in mine} == set(group_block_pairs())
            assert {c.head_dim for c in mine} >= set(AOT_HEAD_DIMS)
    decode = [c for c in cases if c.op == "decode"]
    for dtype in AOT_DTYPES:
        for head_dim in AOT_HEAD_DIMS:
            splits = {c.num_splits for c in decode if c.dtype == dtype and c.head_dim == head_dim}
            assert 1 in splits and any(s > 1 for s in splits)
    assert {c.group for c in cases} >= set(AOT_GROUPS)


def test_one_store_kv_case_compiles_for_both_targets_then_comes_from_the_cache(tmp_path: Path) -> None:
    label = next(c for c in aot_cases() if c.op == "store_kv").label()
    report = run_aot_check(cache_dir=tmp_path, only=label)
    assert not report.problems()
    assert sorted(r.arch for r in report.results) == sorted(AOT_SMEM_LIMIT)
    assert all(r.regs > 0 and r.kernel == "_store_kv_kernel" and not r.cached for r in report.results)
    again = run_aot_check(cache_dir=tmp_path, only=label)
    assert [r.cached for r in again.results] == [True] * len(AOT_SMEM_LIMIT)


def test_lora_kernels_compile_for_both_targets_with_tensor_cores() -> None:
    """A decode-sized LoRA launch in 16-bit: both kernels on both targets, tl.dot on HMMA/HGMMA (the cubins are
    cached in AOT_CACHE_DIR, as the slow test's are)."""
    label = next(c for c in aot_cases() if c.op == "lora" and c.dtype == "bfloat16").label()
    report = run_aot_check(cache_dir=AOT_CACHE_DIR, only=label)
    assert not report.problems(), "\n".join(report.problems())
    assert {(r.kernel, r.arch) for r in report.results} == {(k, a) for k in LORA_KERNELS for a in AOT_SMEM_LIMIT}
    assert all(r.dot_types == ["bf16"] and set(r.mma) & {"HMMA", "HGMMA"} for r in report.results)


@pytest.mark.slow
def test_every_kernel_compiles_for_sm80_and_sm90_without_spills_within_smem_with_mma() -> None:
    report = run_aot_check()
    assert not report.problems(), "\n".join(report.problems())
    assert not report.unlaunched
    seen: dict[int, set[tuple[str, str, int]]] = defaultdict(set)
    lora: dict[int, set[tuple[str, str, int]]] = defaultdict(set)
    for r in report.results:
        assert not r.error
        assert r.spill_bytes == 0, (r.kernel, r.arch, r.config)
        assert 0 <= r.smem <= AOT_SMEM_LIMIT[r.arch], (r.kernel, r.arch, r.config)
        assert 0 < r.regs <= 255
        if r.kernel in {"_decode_kernel", "_prefill_kernel"} | LORA_KERNELS:
            assert r.dot_types, (r.kernel, r.config)
        if r.mma_expected:
            assert set(r.mma) & {"HMMA", "HGMMA"}, (r.kernel, r.arch, r.config)
        if r.kernel in LORA_KERNELS:
            lora[r.arch].add((r.kernel, r.dtype, int(next(p for p in r.config.split() if p.startswith("RANK="))[5:])))
            continue
        head_dim = int(next(p for p in r.config.split() if p.startswith("D="))[2:])
        seen[r.arch].add((r.kernel, r.dtype, head_dim))
    wanted = {(k, dtype, d) for k in KERNELS for dtype in AOT_DTYPES for d in AOT_HEAD_DIMS}
    wanted_lora = {(k, dtype, rank) for k in LORA_KERNELS for dtype in AOT_DTYPES for rank in AOT_LORA_RANKS}
    for arch in AOT_SMEM_LIMIT:
        assert seen[arch] >= wanted, sorted(wanted - seen[arch])
        assert lora[arch] >= wanted_lora, sorted(wanted_lora - lora[arch])
