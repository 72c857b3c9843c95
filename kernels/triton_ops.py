"""Triton paged attention: same signatures and layouts as kernels.reference (see its docstring)."""

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634
_TL_DTYPES = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}


def _interpret() -> bool:
    return bool(triton.knobs.runtime.interpret)


def _dot_dtype(dtype: torch.dtype) -> tl.dtype:
    # The interpreter stores bf16 as raw uint16 and cannot matmul it.
    return tl.float32 if dtype == torch.bfloat16 and _interpret() else _TL_DTYPES[dtype]


def _num_sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4


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
