"""Triton paged-attention kernels against the pure-torch reference (interpreter on CPU)."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from conveyor.kernels import (  # noqa: E402
    attention_ops,
    reference,
    triton_ops,  # noqa: E402
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# Oracle is the reference in fp32 on the same rounded inputs; the slack is the kernel's own
# low-precision P@V operand and output rounding (about 2 ulp of the dtype).
TOL = {
    torch.float32: dict(atol=2e-5, rtol=2e-5),
    torch.float16: dict(atol=2e-3, rtol=2e-3),
    torch.bfloat16: dict(atol=1.6e-2, rtol=1.6e-2),
}


def make_cache(
    num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, gen: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k = torch.randn(shape, generator=gen).to(dtype).to(DEVICE)
    v = torch.randn(shape, generator=gen).to(dtype).to(DEVICE)
    return k, v


def make_block_tables(seq_lens: list[int], block_size: int, num_blocks: int, gen: torch.Generator) -> torch.Tensor:
    """Shuffled, non-contiguous block ids; unused entries hold other valid ids; rows are strided."""
    max_blocks = max(-(-n // block_size) for n in seq_lens) + 1
    ids = torch.randperm(num_blocks, generator=gen)
    used = sum(-(-n // block_size) for n in seq_lens)
    assert used <= num_blocks
    wide = torch.randint(0, num_blocks, (len(seq_lens), max_blocks + 3), generator=gen)
    start = 0
    for row, n in enumerate(seq_lens):
        nb = -(-n // block_size)
        wide[row, :nb] = ids[start : start + nb]
        start += nb
    return wide.to(torch.int32).to(DEVICE)[:, :max_blocks]


def fp32_reference(fn, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *args) -> torch.Tensor:
    return fn(q.float(), k.float(), v.float(), *args)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size", [16, 32])
def test_store_kv_cache_matches_reference_and_skips_padding(dtype: torch.dtype, block_size: int) -> None:
    gen = torch.Generator().manual_seed(0)
    k_cache, v_cache = make_cache(6, block_size, 2, 32, dtype, gen)
    slots = torch.randperm(6 * block_size, generator=gen)[:9]
    slots[[1, 4, 8]] = -1
    slots[0] = 6 * block_size - 1
    key = torch.randn(9, 2, 32, generator=gen).to(dtype).to(DEVICE)
    value = torch.randn(9, 2, 32, generator=gen).to(dtype).to(DEVICE)
    got_k, got_v, want_k, want_v = k_cache.clone(), v_cache.clone(), k_cache.clone(), v_cache.clone()
    triton_ops.store_kv_cache(key, value, got_k, got_v, slots.to(torch.int32).to(DEVICE))
    reference.store_kv_cache(key, value, want_k, want_v, slots.to(DEVICE))
    assert torch.equal(got_k, want_k) and torch.equal(got_v, want_v)
    assert not torch.equal(got_k, k_cache)
    written = got_k.view(-1, 2, 32)[slots[slots >= 0].to(DEVICE)]
    assert torch.equal(written, key[(slots >= 0).to(DEVICE)])


def test_store_kv_cache_casts_to_cache_dtype_from_strided_rows() -> None:
    gen = torch.Generator().manual_seed(1)
    k_cache, v_cache = make_cache(4, 16, 2, 64, torch.float16, gen)
    qkv = torch.randn(5, 8, 64, generator=gen).to(DEVICE)
    key, value = qkv[:, 4:6], qkv[:, 6:8]
    slots = torch.tensor([0, 17, -1, 63, 5], dtype=torch.int64, device=DEVICE)
    got_k, got_v, want_k, want_v = k_cache.clone(), v_cache.clone(), k_cache.clone(), v_cache.clone()
    triton_ops.store_kv_cache(key, value, got_k, got_v, slots)
    reference.store_kv_cache(key, value, want_k, want_v, slots)
    assert torch.equal(got_k, want_k) and torch.equal(got_v, want_v)


def run_decode(
    dtype: torch.dtype, gqa: int, block_size: int, seq_lens: list[int], head_dim: int = 32, num_kv_heads: int = 2, **kw
) -> None:
    gen = torch.Generator().manual_seed(gqa * 100 + block_size + len(seq_lens))
    num_blocks = sum(-(-n // block_size) for n in seq_lens) + 3
    k_cache, v_cache = make_cache(num_blocks, block_size, num_kv_heads, head_dim, dtype, gen)
    block_tables = make_block_tables(seq_lens, block_size, num_blocks, gen)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    num_heads = num_kv_heads * gqa
    qkv = torch.randn(len(seq_lens), num_heads + 2 * num_kv_heads, head_dim, generator=gen)
    q = qkv.to(dtype).to(DEVICE)[:, :num_heads]
    scale = head_dim**-0.5
    out = triton_ops.paged_decode_attention(q, k_cache, v_cache, block_tables, lens, scale, **kw)
    want = fp32_reference(reference.paged_decode_attention, q, k_cache, v_cache, block_tables, lens, scale)
    assert out.dtype == dtype and out.shape == q.shape
    torch.testing.assert_close(out.float(), want, **TOL[dtype])


@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("gqa", [1, 2, 4])
@pytest.mark.parametrize("dtype", DTYPES)
def test_decode_matches_reference(dtype: torch.dtype, gqa: int, block_size: int, num_splits: int) -> None:
    ragged = [1, block_size - 1, block_size, block_size + 1, 2 * block_size + 7, 90]
    run_decode(dtype, gqa, block_size, ragged, num_splits=num_splits)


def test_decode_default_split_heuristic_long_context_odd_group_and_head_dim() -> None:
    assert triton_ops._default_num_splits(2, 2, 700, torch.device("cpu")) > 1
    run_decode(torch.float16, 3, 16, [700, 37], head_dim=80, num_kv_heads=2)


def test_decode_split_request_beyond_tiles_and_max_seq_len_hint() -> None:
    run_decode(torch.float32, 2, 16, [5, 1, 40], num_splits=16, max_seq_len=64)


def run_prefill(
    dtype: torch.dtype,
    gqa: int,
    block_size: int,
    q_lens: list[int],
    ctx_lens: list[int],
    head_dim: int = 32,
    num_kv_heads: int = 2,
) -> None:
    gen = torch.Generator().manual_seed(gqa * 1000 + block_size + sum(q_lens))
    seq_lens = [q + c for q, c in zip(q_lens, ctx_lens)]
    num_blocks = sum(-(-n // block_size) for n in seq_lens) + 2
    k_cache, v_cache = make_cache(num_blocks, block_size, num_kv_heads, head_dim, dtype, gen)
    block_tables = make_block_tables(seq_lens, block_size, num_blocks, gen)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    qsl = torch.tensor([0] + q_lens, device=DEVICE).cumsum(0).to(torch.int32)
    num_heads = num_kv_heads * gqa
    qkv = torch.randn(sum(q_lens), num_heads + 2 * num_kv_heads, head_dim, generator=gen)
    q = qkv.to(dtype).to(DEVICE)[:, :num_heads]
    scale = head_dim**-0.5
    args = (block_tables, lens, qsl, max(q_lens), scale)
    out = triton_ops.paged_prefill_attention(q, k_cache, v_cache, *args)
    want = fp32_reference(reference.paged_prefill_attention, q, k_cache, v_cache, *args)
    assert out.dtype == dtype and out.shape == q.shape
    torch.testing.assert_close(out.float(), want, **TOL[dtype])


@pytest.mark.parametrize("gqa,block_size", [(1, 16), (2, 32), (4, 16), (4, 32)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_prefill_over_cached_prefix_matches_reference(dtype: torch.dtype, gqa: int, block_size: int) -> None:
    q_lens = [block_size + 1, 1, block_size - 1, 20]
    ctx_lens = [0, 2 * block_size, block_size + 1, block_size - 1]
    run_prefill(dtype, gqa, block_size, q_lens, ctx_lens)


def test_prefill_empty_sequence_odd_group_and_head_dim() -> None:
    run_prefill(torch.float16, 3, 16, [0, 33, 2], [7, 18, 0], head_dim=80)


def test_prefill_of_whole_prompt_equals_chunked_prefill_then_decode() -> None:
    gen = torch.Generator().manual_seed(7)
    block_size, n, h, kvh, d = 16, 37, 4, 2, 32
    k_cache, v_cache = make_cache(4, block_size, kvh, d, torch.float32, gen)
    block_tables = make_block_tables([n], block_size, 4, gen)
    q = torch.randn(n, h, d, generator=gen).to(DEVICE)
    full = triton_ops.paged_prefill_attention(
        q,
        k_cache,
        v_cache,
        block_tables,
        torch.tensor([n], dtype=torch.int32, device=DEVICE),
        torch.tensor([0, n], dtype=torch.int32, device=DEVICE),
        n,
        0.2,
    )
    chunks = []
    for lo, hi in [(0, 20), (20, 36)]:
        chunks.append(
            triton_ops.paged_prefill_attention(
                q[lo:hi],
                k_cache,
                v_cache,
                block_tables,
                torch.tensor([hi], dtype=torch.int32, device=DEVICE),
                torch.tensor([0, hi - lo], dtype=torch.int32, device=DEVICE),
                hi - lo,
                0.2,
            )
        )
    chunks.append(
        triton_ops.paged_decode_attention(
            q[36:], k_cache, v_cache, block_tables, torch.tensor([n], dtype=torch.int32, device=DEVICE), 0.2
        )
    )
    torch.testing.assert_close(torch.cat(chunks), full, atol=2e-5, rtol=2e-5)


def test_triton_backend_dispatches_to_these_kernels() -> None:
    ops = attention_ops("triton")
    assert ops.paged_decode_attention is triton_ops.paged_decode_attention
    assert ops.paged_prefill_attention is triton_ops.paged_prefill_attention
    assert ops.store_kv_cache is triton_ops.store_kv_cache
