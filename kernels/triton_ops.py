"""Triton paged attention, the launchers: same signatures and layouts as kernels.reference (see its
docstring); and batched LoRA's shrink and expand over slot segments (engine/model/lora.py, whose torch path
is their oracle). The kernels they launch are in kernels/triton_kernels.py and
kernels/triton_lora_kernels.py."""

import torch
import triton
import triton.language as tl

from conveyor.kernels.triton_kernels import (
    _decode_kernel,
    _prefill_kernel,
    _reduce_splits_kernel,
    _store_kv_kernel,
)
from conveyor.kernels.triton_lora_kernels import _lora_expand_kernel, _lora_shrink_kernel

LOG2E = 1.4426950408889634
_TL_DTYPES = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}


def _interpret() -> bool:
    return bool(triton.knobs.runtime.interpret)


def _dot_dtype(dtype: torch.dtype) -> tl.dtype:
    # The interpreter stores bf16 as raw uint16 and cannot matmul it.
    return tl.float32 if dtype == torch.bfloat16 and _interpret() else _TL_DTYPES[dtype]


def _num_sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4


def store_kv_cache(
    key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Write key/value rows [T, kv_heads, d] to flat slots; slot -1 is skipped."""
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    assert key.stride(-1) == value.stride(-1) == k_cache.stride(-1) == v_cache.stride(-1) == 1
    _store_kv_kernel[(num_tokens,)](
        key,
        value,
        k_cache,
        v_cache,
        slot_mapping.contiguous(),
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        *k_cache.stride()[:3],
        *v_cache.stride()[:3],
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_SIZE=k_cache.shape[1],
        BLOCK_H=triton.next_power_of_2(num_kv_heads),
        BLOCK_D=triton.next_power_of_2(head_dim),
    )


def _default_num_splits(batch: int, num_kv_heads: int, max_seq_len: int, device: torch.device) -> int:
    # Split only until the grid covers the SMs ~4x; each split keeps >= 256 keys to amortise the reduction.
    wanted = triton.cdiv(4 * _num_sms(device), batch * num_kv_heads)
    return max(1, min(wanted, max_seq_len // 256, 64))


def _decode_block_n(dtype: torch.dtype) -> int:
    """Keys per tile of _decode_kernel (split_len is a multiple of it)."""
    if _interpret():
        return 32
    # fp32 dots are input_precision="ieee" FMA loops holding whole operand rows in registers: with wider
    # key tiles ptxas spills them.
    return 16 if dtype == torch.float32 else 64


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    max_seq_len: int | None = None,
    num_splits: int | None = None,
) -> torch.Tensor:
    """One query per sequence: q [B, h, d] -> [B, h, d]. num_splits > 1 is split-K (flash-decoding)."""
    batch, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    out = torch.empty((batch, num_heads, head_dim), dtype=q.dtype, device=q.device)
    if batch == 0:
        return out
    assert q.stride(-1) == k_cache.stride(-1) == v_cache.stride(-1) == block_tables.stride(1) == 1
    assert num_heads % num_kv_heads == 0
    if max_seq_len is None:
        max_seq_len = int(seq_lens.max())
    block_n = _decode_block_n(k_cache.dtype)
    if num_splits is None:
        num_splits = _default_num_splits(batch, num_kv_heads, max_seq_len, q.device)
    split_len = triton.cdiv(triton.cdiv(max_seq_len, num_splits), block_n) * block_n
    num_splits = max(1, triton.cdiv(max_seq_len, split_len))
    group = num_heads // num_kv_heads
    block_d = max(16, triton.next_power_of_2(head_dim))
    split = num_splits > 1
    if split:
        part = torch.empty((batch, num_heads, num_splits, head_dim), dtype=torch.float32, device=q.device)
        lse = torch.empty((batch, num_heads, num_splits), dtype=torch.float32, device=q.device)
        dst, s_o, s_l = part, part.stride(), lse.stride()
    else:
        lse, dst, s_o, s_l = out, out, (*out.stride()[:2], 0), (0, 0)
    _decode_kernel[(batch, num_kv_heads, num_splits)](
        q,
        k_cache,
        v_cache,
        block_tables,
        seq_lens,
        dst,
        lse,
        scale * LOG2E,
        split_len,
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        block_tables.stride(0),
        s_o[0],
        s_o[1],
        s_o[2],
        s_l[0],
        s_l[1],
        GROUP=group,
        HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size,
        BLOCK_G=max(16, triton.next_power_of_2(group)),
        BLOCK_D=block_d,
        BLOCK_N=block_n,
        SPLIT=split,
        DOT_DTYPE=_dot_dtype(k_cache.dtype),
        num_warps=4,
        num_stages=3,
    )
    if split:
        _reduce_splits_kernel[(batch, num_heads)](
            part,
            lse,
            out,
            num_splits,
            *part.stride()[:3],
            *lse.stride()[:2],
            *out.stride()[:2],
            HEAD_DIM=head_dim,
            BLOCK_S=triton.next_power_of_2(num_splits),
            BLOCK_D=block_d,
        )
    return out


def _prefill_config(head_dim: int, max_query_len: int, dtype: torch.dtype) -> dict:
    """Tile sizes and launch options of _prefill_kernel. Off the interpreter, each choice compiles without
    register spills for sm_80 and sm_90 (benchmarks/gpu_check.py --aot checks it)."""
    if _interpret():
        return dict(BLOCK_M=16, BLOCK_N=16, num_warps=4, num_stages=1)
    block_d = max(16, triton.next_power_of_2(head_dim))
    num_stages = 2 if block_d > 128 else 3
    if dtype == torch.float32:
        # ieee fp32 dots are FMA loops holding whole operand rows in registers: the smallest tiles tl.dot
        # takes; rows wider than 64 spread over 8 warps without a cp.async pipeline (ptxas spills otherwise).
        wide_rows = block_d > 64
        return dict(BLOCK_M=16, BLOCK_N=16, num_warps=8 if wide_rows else 4, num_stages=1 if wide_rows else 3)
    # The fp32 accumulator and the Q operand (BLOCK_M x BLOCK_D) stay in registers: 8 warps share them from
    # 128x128 elements up, 256-wide rows stop at 64 queries, and 256-wide rows or 4 warps on 64 queries of
    # 128-wide rows take 32 keys at a time.
    block_m = min(128 if block_d <= 128 else 64, max(16, triton.next_power_of_2(max_query_len)))
    num_warps = 8 if block_m * block_d >= 128 * 128 else 4
    block_n = 32 if block_d > 128 or (num_warps == 4 and block_m >= 64 and block_d >= 128) else 64
    return dict(BLOCK_M=block_m, BLOCK_N=block_n, num_warps=num_warps, num_stages=num_stages)


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
    """Variable-length new tokens over cached context: q [T, h, d] -> [T, h, d]."""
    num_tokens, num_heads, head_dim = q.shape
    num_seqs = seq_lens.shape[0]
    out = torch.empty((num_tokens, num_heads, head_dim), dtype=q.dtype, device=q.device)
    if num_tokens == 0 or num_seqs == 0:
        return out
    assert q.stride(-1) == k_cache.stride(-1) == v_cache.stride(-1) == block_tables.stride(1) == 1
    assert num_heads % k_cache.shape[2] == 0
    config = _prefill_config(head_dim, max_query_len, k_cache.dtype)
    grid = (triton.cdiv(max_query_len, config["BLOCK_M"]), num_seqs, num_heads)
    _prefill_kernel[grid](
        q,
        k_cache,
        v_cache,
        block_tables,
        seq_lens,
        query_start_loc,
        out,
        scale * LOG2E,
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        block_tables.stride(0),
        out.stride(0),
        out.stride(1),
        GROUP=num_heads // k_cache.shape[2],
        HEAD_DIM=head_dim,
        BLOCK_SIZE=k_cache.shape[1],
        BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
        DOT_DTYPE=_dot_dtype(k_cache.dtype),
        **config,
    )
    return out


def _lora_config(max_len: int, rank: int, dtype: torch.dtype) -> dict:
    """Tile sizes of the LoRA kernels: BLOCK_M rows of a segment (16 for decode-sized segments, up to 64), the rank
    padded to a power of two >= 16 for tl.dot. Off the interpreter each choice compiles without register spills
    for sm_80 and sm_90 (benchmarks/gpu_check.py --aot checks it)."""
    block_r = max(16, triton.next_power_of_2(rank))
    if _interpret():
        return dict(BLOCK_M=16, BLOCK_R=block_r, BLOCK_K=32, BLOCK_N=32)
    block_m = min(64, max(16, triton.next_power_of_2(max_len)))
    if dtype == torch.float32:  # ieee fp32 dots: FMA loops, the smallest tiles; ranks above 32 spill at 32 columns
        return dict(BLOCK_M=16, BLOCK_R=block_r, BLOCK_K=32, BLOCK_N=32 if block_r <= 32 else 16)
    return dict(BLOCK_M=block_m, BLOCK_R=block_r, BLOCK_K=64, BLOCK_N=64)


def lora_shrink(
    x: torch.Tensor,
    a: torch.Tensor,
    rows: torch.Tensor,
    starts: torch.Tensor,
    slots: torch.Tensor,
    max_len: int,
    rank: int,
) -> torch.Tensor:
    """x [T, in], a [S, g * rank, in] (slot-stacked A, slice s at rows s*rank); rows [M] the adapter rows of x sorted
    by slot, starts [segments + 1] (int32) their segment bounds, slots [segments] each segment's slot.
    Returns t [M, g * rank] in x's dtype: t[i] = x[rows[i]] @ A[slot of i].T, slice by slice."""
    num_rows, width = rows.shape[0], a.shape[1]
    t = torch.empty((num_rows, width), dtype=x.dtype, device=x.device)
    if num_rows == 0:
        return t
    assert x.stride(-1) == a.stride(-1) == 1 and width % rank == 0
    config = _lora_config(max_len, rank, x.dtype)
    grid = (triton.cdiv(max_len, config["BLOCK_M"]), slots.shape[0], width // rank)
    _lora_shrink_kernel[grid](
        x,
        a,
        t,
        rows,
        starts,
        slots,
        x.shape[1],
        x.stride(0),
        a.stride(0),
        a.stride(1),
        t.stride(0),
        RANK=rank,
        BLOCK_M=config["BLOCK_M"],
        BLOCK_K=config["BLOCK_K"],
        BLOCK_R=config["BLOCK_R"],
        DOT_DTYPE=_dot_dtype(x.dtype),
        num_warps=4,
    )
    return t


def lora_expand(
    t: torch.Tensor,
    b: torch.Tensor,
    y: torch.Tensor,
    rows: torch.Tensor,
    starts: torch.Tensor,
    slots: torch.Tensor,
    max_len: int,
    bounds: torch.Tensor,
    max_slice: int,
) -> torch.Tensor:
    """y [T, out] += per row rows[i]: t[i, slice s] @ B[slot of i, slice s, bounds[s]:bounds[s+1]] for each slice;
    b [S, g * rank, out] (slot-stacked, slice s at rows s*rank), bounds [g + 1] (int32) the slices' output
    columns, max_slice the widest slice. t, rows, starts, slots as lora_shrink returns and takes them. Returns y,
    updated in place."""
    num_rows, width = rows.shape[0], b.shape[1]
    if num_rows == 0:
        return y
    num_slices = bounds.shape[0] - 1
    rank = width // num_slices
    assert t.stride(-1) == b.stride(-1) == y.stride(-1) == 1
    config = _lora_config(max_len, rank, y.dtype)
    n_tiles = triton.cdiv(max_slice, config["BLOCK_N"])
    grid = (triton.cdiv(max_len, config["BLOCK_M"]), slots.shape[0], num_slices * n_tiles)
    _lora_expand_kernel[grid](
        t,
        b,
        y,
        rows,
        starts,
        slots,
        bounds,
        n_tiles,
        t.stride(0),
        b.stride(0),
        b.stride(1),
        y.stride(0),
        RANK=rank,
        BLOCK_M=config["BLOCK_M"],
        BLOCK_N=config["BLOCK_N"],
        BLOCK_R=config["BLOCK_R"],
        DOT_DTYPE=_dot_dtype(y.dtype),
        num_warps=4,
    )
    return y
