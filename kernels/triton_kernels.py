"""The Triton JIT kernels of the GPU attention backend (batched LoRA's: kernels/triton_lora_kernels.py);
kernels/triton_ops.py launches them. Every kernel and device function lives in one of these two modules:
benchmarks/gpu_check.py --aot compiles all of their kernels."""

import triton
import triton.language as tl


@triton.jit
def _store_kv_kernel(
    key_ptr,
    value_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_ptr,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_kcb,
    stride_kct,
    stride_kch,
    stride_vcb,
    stride_vct,
    stride_vch,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    if slot < 0:
        return
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    h = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, BLOCK_D)[None, :]
    mask = (h < NUM_KV_HEADS) & (d < HEAD_DIM)
    k = tl.load(key_ptr + token * stride_kt + h * stride_kh + d, mask=mask)
    v = tl.load(value_ptr + token * stride_vt + h * stride_vh + d, mask=mask)
    k_dst = k_cache_ptr + block * stride_kcb + offset * stride_kct + h * stride_kch + d
    v_dst = v_cache_ptr + block * stride_vcb + offset * stride_vct + h * stride_vch + d
    tl.store(k_dst, k.to(tl.float32).to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_dst, v.to(tl.float32).to(v_cache_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _attend(
    q,
    acc,
    m,
    l,
    k_ptr,
    v_ptr,
    bt_row_ptr,
    lo,
    hi,
    q_pos,
    scale_log2,
    stride_kb,
    stride_kt,
    stride_vb,
    stride_vt,
    d,
    d_mask,
    MASK: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
):
    """Online softmax of q over keys [lo, hi). MASK: 0 none (full tiles), 1 bound, 2 bound+causal."""
    n = tl.arange(0, BLOCK_N)
    for start in range(lo, hi, BLOCK_N):
        pos = start + n
        valid = pos < hi
        block = tl.load(bt_row_ptr + pos // BLOCK_SIZE, mask=valid, other=0).to(tl.int64)
        in_block = (pos % BLOCK_SIZE).to(tl.int64)
        k_row = block * stride_kb + in_block * stride_kt
        v_row = block * stride_vb + in_block * stride_vt
        k = tl.load(k_ptr + k_row[None, :] + d[:, None], mask=valid[None, :] & d_mask[:, None], other=0.0).to(DOT_DTYPE)
        s = tl.dot(q, k, input_precision="ieee") * scale_log2
        if MASK == 1:
            s = tl.where(valid[None, :], s, float("-inf"))
        elif MASK == 2:
            s = tl.where(valid[None, :] & (pos[None, :] <= q_pos[:, None]), s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        alpha = tl.exp2(m - m_new)
        p = tl.exp2(s - m_new[:, None])
        l = l * alpha + tl.sum(p, 1)
        v = tl.load(v_ptr + v_row[:, None] + d[None, :], mask=valid[:, None] & d_mask[None, :], other=0.0).to(DOT_DTYPE)
        acc = acc * alpha[:, None] + tl.dot(p.to(DOT_DTYPE), v, input_precision="ieee")
        m = m_new
    return acc, m, l


@triton.jit
def _decode_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    bt_ptr,
    seq_lens_ptr,
    out_ptr,
    lse_ptr,
    scale_log2,
    split_len,
    stride_qb,
    stride_qh,
    stride_kb,
    stride_kt,
    stride_kh,
    stride_vb,
    stride_vt,
    stride_vh,
    stride_bt,
    stride_ob,
    stride_oh,
    stride_os,
    stride_lb,
    stride_lh,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SPLIT: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + b)
    lo = split * split_len
    hi = tl.minimum(seq_len, lo + split_len)
    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    g_mask = g < GROUP
    d_mask = d < HEAD_DIM
    heads = kv_head * GROUP + g
    q = tl.load(
        q_ptr + b * stride_qb + heads[:, None] * stride_qh + d[None, :],
        mask=g_mask[:, None] & d_mask[None, :],
        other=0.0,
    ).to(DOT_DTYPE)
    acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
    m = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
    l = tl.zeros([BLOCK_G], dtype=tl.float32)
    acc, m, l = _attend(
        q,
        acc,
        m,
        l,
        k_ptr + kv_head * stride_kh,
        v_ptr + kv_head * stride_vh,
        bt_ptr + b * stride_bt,
        lo,
        hi,
        hi,
        scale_log2,
        stride_kb,
        stride_kt,
        stride_vb,
        stride_vt,
        d,
        d_mask,
        1,
        BLOCK_SIZE,
        BLOCK_N,
        DOT_DTYPE,
    )
    out = acc / tl.where(l > 0, l, 1.0)[:, None]
    o_ptrs = out_ptr + b * stride_ob + heads[:, None] * stride_oh + split * stride_os + d[None, :]
    tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=g_mask[:, None] & d_mask[None, :])
    if SPLIT:
        lse = tl.where(l > 0, m + tl.log2(tl.where(l > 0, l, 1.0)), float("-inf"))
        tl.store(lse_ptr + b * stride_lb + heads * stride_lh + split, lse, mask=g_mask)


@triton.jit
def _reduce_splits_kernel(
    part_ptr,
    lse_ptr,
    out_ptr,
    num_splits,
    stride_pb,
    stride_ph,
    stride_ps,
    stride_lb,
    stride_lh,
    stride_ob,
    stride_oh,
    HEAD_DIM: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    s = tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_D)
    lse = tl.load(lse_ptr + b * stride_lb + head * stride_lh + s, mask=s < num_splits, other=float("-inf"))
    w = tl.exp2(lse - tl.max(lse, 0))
    part = tl.load(
        part_ptr + b * stride_pb + head * stride_ph + s[:, None] * stride_ps + d[None, :],
        mask=(s[:, None] < num_splits) & (d[None, :] < HEAD_DIM),
        other=0.0,
    )
    out = tl.sum(part * w[:, None], 0) / tl.sum(w, 0)
    tl.store(out_ptr + b * stride_ob + head * stride_oh + d, out.to(out_ptr.dtype.element_ty), mask=d < HEAD_DIM)


@triton.jit
def _prefill_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    bt_ptr,
    seq_lens_ptr,
    qsl_ptr,
    out_ptr,
    scale_log2,
    stride_qt,
    stride_qh,
    stride_kb,
    stride_kt,
    stride_kh,
    stride_vb,
    stride_vt,
    stride_vh,
    stride_bt,
    stride_ot,
    stride_oh,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
):
    tile = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    head = tl.program_id(2)
    q_start = tl.load(qsl_ptr + b)
    q_len = tl.load(qsl_ptr + b + 1) - q_start
    if tile * BLOCK_M >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + b)
    kv_head = head // GROUP
    i = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    d = tl.arange(0, BLOCK_D)
    row_mask = i < q_len
    d_mask = d < HEAD_DIM
    tokens = (q_start + i).to(tl.int64)
    q = tl.load(
        q_ptr + tokens[:, None] * stride_qt + head * stride_qh + d[None, :],
        mask=row_mask[:, None] & d_mask[None, :],
        other=0.0,
    ).to(DOT_DTYPE)
    q_pos = seq_len - q_len + i
    first_pos = seq_len - q_len + tile * BLOCK_M
    # Keys before diag_lo precede every query of this tile: full tiles, no mask.
    diag_lo = first_pos // BLOCK_N * BLOCK_N
    hi = tl.minimum(seq_len, first_pos + BLOCK_M)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    m = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l = tl.zeros([BLOCK_M], dtype=tl.float32)
    k_base = k_ptr + kv_head * stride_kh
    v_base = v_ptr + kv_head * stride_vh
    bt_row = bt_ptr + b * stride_bt
    acc, m, l = _attend(
        q,
        acc,
        m,
        l,
        k_base,
        v_base,
        bt_row,
        0,
        diag_lo,
        q_pos,
        scale_log2,
        stride_kb,
        stride_kt,
        stride_vb,
        stride_vt,
        d,
        d_mask,
        0,
        BLOCK_SIZE,
        BLOCK_N,
        DOT_DTYPE,
    )
    acc, m, l = _attend(
        q,
        acc,
        m,
        l,
        k_base,
        v_base,
        bt_row,
        diag_lo,
        hi,
        q_pos,
        scale_log2,
        stride_kb,
        stride_kt,
        stride_vb,
        stride_vt,
        d,
        d_mask,
        2,
        BLOCK_SIZE,
        BLOCK_N,
        DOT_DTYPE,
    )
    out = acc / l[:, None]
    tl.store(
        out_ptr + tokens[:, None] * stride_ot + head * stride_oh + d[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=row_mask[:, None] & d_mask[None, :],
    )
