"""The C++ CPU kernels (kernels/csrc/cpu_ops.cpp) against the pure-torch reference and the eager layers, on
every ISA build (kernels/cpu_ops.py's ISAS), and every ISA's bits against the portable build's."""

from types import ModuleType

import pytest
import torch
import torch.nn.functional as F
from transformers import LlamaConfig

from conveyor.engine.model.norm import RMSNorm
from conveyor.engine.model.rotary import RotaryEmbedding, apply_rotary
from conveyor.kernels import cpu_ops, reference
from tests.kernels.cpu_isa import isa_module

TOL = {torch.float32: 2e-6, torch.bfloat16: 1.6e-2}


DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])


@DTYPES
@pytest.mark.parametrize(
    "block_size,heads,kv_heads,head_dim",
    [(16, 12, 4, 64), (32, 4, 2, 64), (8, 9, 3, 64), (16, 8, 8, 128), (4, 4, 1, 32)],
)
def test_paged_attention_mixed_step_matches_reference(
    lib: ModuleType, dtype: torch.dtype, block_size: int, heads: int, kv_heads: int, head_dim: int
) -> None:
    g = torch.Generator().manual_seed(block_size * heads + head_dim)
    num_blocks, width = 96, 24
    want_k, want_v = (torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=g).to(dtype) for _ in "kv")
    k_cache, v_cache = torch.empty_like(want_k), torch.empty_like(want_v)  # the kernels' own layout
    slots = torch.arange(num_blocks * block_size)
    cpu_ops.store_kv_cache(want_k.flatten(0, 1), want_v.flatten(0, 1), k_cache, v_cache, slots)
    seq_lens = torch.tensor([5, 40, 17, 1, 30, 70], dtype=torch.int32)  # 4 decodes, then 2 prefills over context
    q_lens = torch.tensor([1, 1, 1, 1, 30, 25])
    qsl = torch.zeros(len(q_lens) + 1, dtype=torch.int32)
    qsl[1:] = torch.cumsum(q_lens, 0)
    tables = torch.stack([torch.randperm(num_blocks, generator=g)[:width] for _ in q_lens]).to(torch.int32)
    q = torch.randn(int(qsl[-1]), heads + 2 * kv_heads, head_dim, generator=g).to(dtype)[:, :heads]  # as in qkv
    scale = head_dim**-0.5
    got = cpu_ops.paged_attention(q, k_cache, v_cache, tables, seq_lens, qsl, scale)
    f = lambda t: t.float()  # noqa: E731
    want = torch.cat(
        (
            reference.paged_decode_attention(f(q[:4]), f(want_k), f(want_v), tables[:4], seq_lens[:4], scale),
            reference.paged_prefill_attention(
                f(q[4:]), f(want_k), f(want_v), tables[4:], seq_lens[4:], qsl[4:] - qsl[4], 30, scale
            ),
        )
    )
    assert got.dtype == dtype
    assert (got.float() - want).abs().max() <= TOL[dtype] * max(1.0, want.abs().max())


@DTYPES
def test_store_kv_cache_is_the_reference_in_its_own_layout_and_skips_padding(
    lib: ModuleType, dtype: torch.dtype
) -> None:
    g = torch.Generator().manual_seed(1)
    caches = [torch.zeros(8, 16, 2, 64, dtype=dtype) for _ in range(4)]
    kv = torch.randn(10, 4, 64, generator=g).to(dtype)  # strided rows, as a slice of a fused qkv
    key, value = kv[:, :2], kv[:, 2:]
    slots = torch.tensor([3, -1, 7, 100, 5, 6, 8, 9, 10, 127])
    cpu_ops.store_kv_cache(key, value, caches[0], caches[1], slots)
    reference.store_kv_cache(key, value, caches[2], caches[3], slots)
    got_k, got_v = cpu_ops.reference_layout(caches[0], caches[1])
    assert torch.equal(got_k, caches[2]) and torch.equal(got_v, caches[3])
    assert not torch.equal(caches[0], caches[2])  # the layout really differs: a reference read would be wrong


@DTYPES
def test_fused_elementwise_ops_match_the_eager_layers(lib: ModuleType, dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(2)
    eager, fused = RMSNorm(256, 1e-5), RMSNorm(256, 1e-5, lib)
    eager.weight.data = fused.weight.data = torch.randn(256, generator=g)
    eager, fused = eager.to(dtype), fused.to(dtype)
    x, r = (torch.randn(7, 256, generator=g).to(dtype) for _ in range(2))
    (want, want_r), (got, got_r) = eager(x, r), fused(x.clone(), r.clone())
    exact = dtype == torch.bfloat16  # every rounding where torch rounds; float32 differs in summation order only
    assert torch.equal(got_r, want_r)
    assert torch.equal(got, want) if exact else torch.allclose(got, want, rtol=1e-6, atol=1e-6)
    assert torch.equal(fused(x), eager(x)) if exact else torch.allclose(fused(x), eager(x), rtol=1e-6, atol=1e-6)
    gate_up = torch.randn(5, 2 * 768, generator=g).to(dtype)
    gate, up = gate_up.chunk(2, -1)
    assert torch.allclose(
        lib.silu_and_mul(gate_up).float(), (F.silu(gate) * up).float(), rtol=1e-2 if exact else 1e-6, atol=1e-6
    )
    config = LlamaConfig(hidden_size=256, num_attention_heads=4, num_key_value_heads=2)
    rope = RotaryEmbedding(config, 64, 512)
    qkv = torch.randn(6, 8 * 64, generator=g).to(dtype)
    positions = torch.tensor([0, 5, 100, 7, 300, 2])
    want_q, want_k = apply_rotary(
        qkv[:, :256].view(-1, 4, 64), qkv[:, 256:384].view(-1, 2, 64), *rope(positions, dtype)
    )
    got_q, got_k = qkv[:, :256].view(-1, 4, 64), qkv[:, 256:384].view(-1, 2, 64)
    lib.rotary_embedding_(positions, got_q, got_k, rope.cos, rope.sin)  # in place on the strided views
    assert torch.equal(got_q, want_q) and torch.equal(got_k, want_k)


@DTYPES
def test_packed_small_batch_matmul_is_as_close_to_float64_as_torch_linear(lib: ModuleType, dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    for n, k, bias in [(256, 256, False), (515, 251, True), (3, 17, True), (1536, 576, False), (40, 2048, True)]:
        w = torch.randn(n, k).to(dtype)
        b = torch.randn(n).to(dtype) if bias else None
        packed = lib.pack_gemm(w)
        for rows in (1, 2, 3, 4, 5, 7, 11, 12, 13, 24, 32, 37):
            x = torch.randn(rows, k).to(dtype)
            exact = F.linear(x.double(), w.double(), None if b is None else b.double())
            ours, eager = lib.gemm_packed(x, packed, n, b), F.linear(x, w, b)
            assert ours.dtype == dtype and ours.shape == (rows, n)
            err, eager_err = (ours.double() - exact).abs().max().item(), (eager.double() - exact).abs().max().item()
            assert err <= max(2 * eager_err, 1e-5), (rows, n, k, err, eager_err)
    with pytest.raises(RuntimeError, match="pack_gemm's layout"):
        lib.gemm_packed(torch.randn(4, 16), lib.pack_gemm(torch.randn(8, 32)), 8, None)


def test_bfloat16_rounding_is_torchs_bit_for_bit(lib: ModuleType) -> None:
    """f32 -> bf16 round-to-nearest-even in integer ops equals torch's .to(torch.bfloat16) on every value;
    AVX512-BF16's instruction (the avx512bf16 build) flushes subnormal inputs to signed zero."""
    g = torch.Generator().manual_seed(3)
    scales = torch.tensor([1e-38, 1e-30, 1e-5, 1.0, 3e4, 1e30, 1e38])
    random = (torch.randn(len(scales), 4000, generator=g) * scales[:, None]).flatten()
    bits = torch.randint(0, 2**16, (4000,), generator=g, dtype=torch.int32) << 16
    ties = torch.cat([bits | 0x8000, bits | 0x18000, bits | 0x7FFF, bits | 0x8001])  # halfway, both parities
    ties = ties[~ties.view(torch.float32).isnan()]  # exponent all ones: NaN and inf come below
    subnormal = torch.randint(1, 0x800000, (4000,), generator=g, dtype=torch.int32)
    special = torch.tensor(
        [0x7F7FFFFF, 0x7F7F8000, 0x7F7F7FFF, 0x00800000, 0x007FFFFF, 0x007F8000, 0x00008000, 0, 0x7F800000],
        dtype=torch.int32,
    )  # max, ties at the top, min normal, zero, inf
    x = torch.cat([random, ties.view(torch.float32), subnormal.view(torch.float32), special.view(torch.float32)])
    x = torch.cat([x, -x, x[:37]])  # signs, and a length that ends in a partial vector
    got, want = lib.to_bfloat16(x).view(torch.int16), x.to(torch.bfloat16).view(torch.int16)
    tiny = x.abs() < torch.finfo(torch.float32).tiny
    if lib.isa == "avx512bf16":
        assert torch.equal(got[tiny], torch.where(x[tiny].signbit(), -0.0, 0.0).to(torch.bfloat16).view(torch.int16))
        got, want = got[~tiny], want[~tiny]
    assert torch.equal(got, want)
    nan = torch.tensor([float("nan"), -float("nan")])
    assert lib.to_bfloat16(nan).isnan().all()


def test_every_isa_computes_the_bits_of_the_generic_build(lib: ModuleType) -> None:
    """One source, the same operations in the same order on every ISA: results equal the portable build's."""
    generic = isa_module("generic")
    g = torch.Generator().manual_seed(4)
    for dtype in (torch.float32, torch.bfloat16):
        w, bias = torch.randn(200, 333, generator=g).to(dtype), torch.randn(200, generator=g).to(dtype)
        for rows in (*range(1, 13), 19):  # every tile shape of every ISA (vec.h's kTiles)
            x = torch.randn(rows, 333, generator=g).to(dtype)
            assert torch.equal(
                lib.gemm_packed(x, lib.pack_gemm(w), 200, bias), generic.gemm_packed(x, generic.pack_gemm(w), 200, bias)
            ), (dtype, rows)
        gate_up = torch.randn(5, 2 * 96, generator=g).to(dtype)
        assert torch.equal(lib.silu_and_mul(gate_up), generic.silu_and_mul(gate_up))
        caches = [torch.randn(20, 16, 2, 64, generator=g).to(dtype) for _ in "kv"]
        q = torch.randn(7, 6, 64, generator=g).to(dtype)
        args = (
            caches[0],
            caches[1],
            torch.randperm(20, generator=g)[None, :20].to(torch.int32),
            torch.tensor([300], dtype=torch.int32),
            torch.tensor([0, 7], dtype=torch.int32),
            0.125,
        )
        outs = [torch.empty_like(q) for _ in range(2)]
        lib.paged_attention(outs[0], q, *args)
        generic.paged_attention(outs[1], q, *args)
        assert torch.equal(outs[0], outs[1])
