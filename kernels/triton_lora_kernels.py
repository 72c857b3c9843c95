"""The Triton JIT kernels of batched LoRA, shrink and expand over slot segments; kernels/triton_ops.py launches
them (the attention backend's: kernels/triton_kernels.py)."""

import triton
import triton.language as tl


@triton.jit
def _lora_shrink_kernel(
    x_ptr,
    a_ptr,
    t_ptr,
    rows_ptr,
    starts_ptr,
    slots_ptr,
    in_features,
    stride_xt,
    stride_as,
    stride_ar,
    stride_tt,
    RANK: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_R: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
):
    """t[i, s*RANK:(s+1)*RANK] = x[rows[i]] @ A[slot, s*RANK:(s+1)*RANK].T for the sorted rows i of one segment
    (one slot) and one output slice s; a tile of BLOCK_M rows per program."""
    tile = tl.program_id(0)
    seg = tl.program_id(1)
    sl = tl.program_id(2)
    start = tl.load(starts_ptr + seg)
    end = tl.load(starts_ptr + seg + 1)
    if start + tile * BLOCK_M >= end:
        return
    i = start + tile * BLOCK_M + tl.arange(0, BLOCK_M)
    i_mask = i < end
    row = tl.load(rows_ptr + i, mask=i_mask, other=0).to(tl.int64)
    slot = tl.load(slots_ptr + seg).to(tl.int64)
    r = tl.arange(0, BLOCK_R)
    r_mask = r < RANK
    a_rows = a_ptr + slot * stride_as + (sl * RANK + r).to(tl.int64) * stride_ar
    acc = tl.zeros([BLOCK_M, BLOCK_R], dtype=tl.float32)
    for k0 in range(0, in_features, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_mask = k < in_features
        x = tl.load(x_ptr + row[:, None] * stride_xt + k[None, :], mask=i_mask[:, None] & k_mask[None, :], other=0.0)
        a = tl.load(a_rows[None, :] + k[:, None], mask=k_mask[:, None] & r_mask[None, :], other=0.0)
        acc = tl.dot(x.to(DOT_DTYPE), a.to(DOT_DTYPE), acc, input_precision="ieee")
    t_ptrs = t_ptr + i.to(tl.int64)[:, None] * stride_tt + sl * RANK + r[None, :]
    tl.store(t_ptrs, acc.to(t_ptr.dtype.element_ty), mask=i_mask[:, None] & r_mask[None, :])


@triton.jit
def _lora_expand_kernel(
    t_ptr,
    b_ptr,
    y_ptr,
    rows_ptr,
    starts_ptr,
    slots_ptr,
    bounds_ptr,
    n_tiles,
    stride_tt,
    stride_bs,
    stride_br,
    stride_yt,
    RANK: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
):
    """y[rows[i], cols of slice s] += t[i, s*RANK:(s+1)*RANK] @ B[slot, s*RANK:(s+1)*RANK, cols]; slice s owns
    the output columns [bounds[s], bounds[s+1]). Programs cover disjoint (rows, columns): no atomics."""
    tile = tl.program_id(0)
    seg = tl.program_id(1)
    sl = tl.program_id(2) // n_tiles
    n_tile = tl.program_id(2) % n_tiles
    start = tl.load(starts_ptr + seg)
    end = tl.load(starts_ptr + seg + 1)
    lo = tl.load(bounds_ptr + sl) + n_tile * BLOCK_N
    hi = tl.load(bounds_ptr + sl + 1)
    if start + tile * BLOCK_M >= end or lo >= hi:
        return
    i = start + tile * BLOCK_M + tl.arange(0, BLOCK_M)
    i_mask = i < end
    row = tl.load(rows_ptr + i, mask=i_mask, other=0).to(tl.int64)
    slot = tl.load(slots_ptr + seg).to(tl.int64)
    r = tl.arange(0, BLOCK_R)
    r_mask = r < RANK
    n = lo + tl.arange(0, BLOCK_N)
    n_mask = n < hi
    t = tl.load(
        t_ptr + i.to(tl.int64)[:, None] * stride_tt + sl * RANK + r[None, :],
        mask=i_mask[:, None] & r_mask[None, :],
        other=0.0,
    )
    b = tl.load(
        b_ptr + slot * stride_bs + (sl * RANK + r).to(tl.int64)[:, None] * stride_br + n[None, :],
        mask=r_mask[:, None] & n_mask[None, :],
        other=0.0,
    )
    acc = tl.dot(t.to(DOT_DTYPE), b.to(DOT_DTYPE), input_precision="ieee")
    y_ptrs = y_ptr + row[:, None] * stride_yt + n[None, :]
    y_mask = i_mask[:, None] & n_mask[None, :]
    y = tl.load(y_ptrs, mask=y_mask, other=0.0)
    tl.store(y_ptrs, (y.to(tl.float32) + acc).to(y_ptr.dtype.element_ty), mask=y_mask)
