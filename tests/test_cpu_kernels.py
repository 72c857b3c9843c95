"""The C++ CPU kernels (kernels/csrc/cpu_ops.cpp) against the pure-torch reference and the eager layers."""
import time
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from transformers import LlamaConfig

from engine.layers.norm import RMSNorm
from engine.layers.rotary import RotaryEmbedding, apply_rotary
from kernels import cpu_ops, reference

lib = cpu_ops.load()
pytestmark = pytest.mark.skipif(lib is None, reason="the CPU lacks AVX-512 BF16 or no compiler")  # CI runs on this CPU kind: they run
TOL = {torch.float32: 2e-6, torch.bfloat16: 1.6e-2}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_size,heads,kv_heads,head_dim", [(16, 12, 4, 64), (32, 4, 2, 64), (8, 9, 3, 64),
                                                                 (16, 8, 8, 128), (4, 4, 1, 32)])
def test_paged_attention_mixed_step_matches_reference(dtype: torch.dtype, block_size: int, heads: int,
                                                      kv_heads: int, head_dim: int) -> None:
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
    scale = head_dim ** -0.5
    got = cpu_ops.paged_attention(q, k_cache, v_cache, tables, seq_lens, qsl, scale)
    f = lambda t: t.float()  # noqa: E731
    want = torch.cat((
        reference.paged_decode_attention(f(q[:4]), f(want_k), f(want_v), tables[:4], seq_lens[:4], scale),
        reference.paged_prefill_attention(f(q[4:]), f(want_k), f(want_v), tables[4:], seq_lens[4:],
                                          qsl[4:] - qsl[4], 30, scale)))
    assert got.dtype == dtype
    assert (got.float() - want).abs().max() <= TOL[dtype] * max(1.0, want.abs().max())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_store_kv_cache_is_the_reference_in_its_own_layout_and_skips_padding(dtype: torch.dtype) -> None:
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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_elementwise_ops_match_the_eager_layers(dtype: torch.dtype) -> None:
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
    assert torch.allclose(lib.silu_and_mul(gate_up).float(), (F.silu(gate) * up).float(), rtol=1e-2 if exact else 1e-6,
                          atol=1e-6)
    config = LlamaConfig(hidden_size=256, num_attention_heads=4, num_key_value_heads=2)
    rope = RotaryEmbedding(config, 64, 512)
    qkv = torch.randn(6, 8 * 64, generator=g).to(dtype)
    positions = torch.tensor([0, 5, 100, 7, 300, 2])
    want_q, want_k = apply_rotary(qkv[:, :256].view(-1, 4, 64), qkv[:, 256:384].view(-1, 2, 64),
                                  *rope(positions, dtype))
    got_q, got_k = qkv[:, :256].view(-1, 4, 64), qkv[:, 256:384].view(-1, 2, 64)
    lib.rotary_embedding_(positions, got_q, got_k, rope.cos, rope.sin)  # in place on the strided views
    assert torch.equal(got_q, want_q) and torch.equal(got_k, want_k)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_small_batch_matmul_is_as_close_to_float64_as_torch_linear(dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    for n, k, bias in [(256, 256, False), (515, 251, True), (3, 17, True), (1536, 576, False), (40, 2048, True)]:
        w = torch.randn(n, k).to(dtype)
        b = torch.randn(n).to(dtype) if bias else None
        packed = lib.pack_gemm(w)
        for rows in (1, 2, 5, 11, 12, 13, 24, 32, 37):
            x = torch.randn(rows, k).to(dtype)
            exact = F.linear(x.double(), w.double(), None if b is None else b.double())
            ours, eager = lib.gemm_packed(x, packed, n, b), F.linear(x, w, b)
            assert ours.dtype == dtype and ours.shape == (rows, n)
            err, eager_err = (ours.double() - exact).abs().max().item(), (eager.double() - exact).abs().max().item()
            assert err <= max(2 * eager_err, 1e-5), (rows, n, k, err, eager_err)
    with pytest.raises(RuntimeError, match="pack_gemm's layout"):
        lib.gemm_packed(torch.randn(4, 16), lib.pack_gemm(torch.randn(8, 32)), 8, None)


def test_engine_linears_take_the_cpp_kernels_up_to_small_rows_only_and_release_the_plain_weight(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from types import SimpleNamespace

    from engine.layers import linear
    from engine.layers.linear import SMALL_ROWS, ColumnParallelLinear, pack_weights
    monkeypatch.setattr(linear, "PLAIN_MARGIN", float("inf"))  # oneDNN above SMALL_ROWS, whatever the timing
    layer = ColumnParallelLinear(64, 96)
    layer.weight.data.normal_()
    weight = layer.weight.detach().clone()
    calls = []

    def counted(name: str):
        def run(*args):
            calls.append((name, args[0].shape[0]))
            return getattr(lib, name)(*args)
        return run
    pack_weights(layer, SimpleNamespace(gemm_packed=counted("gemm_packed"), pack_gemm=lib.pack_gemm))
    assert layer.packed.tensor is not None and layer.weight.numel() == 0  # both packed layouts serve every row
    for rows in (1, 2, SMALL_ROWS, SMALL_ROWS + 1, 64):
        x = torch.randn(rows, 64)
        torch.testing.assert_close(layer(x), F.linear(x, weight), rtol=1e-5, atol=1e-5)
    assert calls == [("gemm_packed", 1), ("gemm_packed", 2), ("gemm_packed", SMALL_ROWS)]
    assert layer(torch.randn(0, 64)).shape == (0, 96)  # a step with no rows to sample


def test_a_tied_lm_head_keeps_the_embedding_it_shares() -> None:
    from engine.layers.embedding import ParallelLMHead, VocabParallelEmbedding
    from engine.layers.linear import pack_weights
    model = nn.Module()
    model.embed, model.head = VocabParallelEmbedding(100, 64), ParallelLMHead(100, 64)
    model.embed.weight.data.normal_()
    model.head.weight = model.embed.weight
    weight = model.embed.weight.detach().clone()
    pack_weights(model, lib)
    assert model.head.packed is not None and torch.equal(model.embed.weight, weight)
    x = torch.randn(3, 64)
    torch.testing.assert_close(model.head(x), F.linear(x, weight), rtol=1e-5, atol=1e-5)


def test_auto_backend_on_cpu_is_the_cpp_kernels_except_float16() -> None:
    from engine.config import EngineConfig
    assert EngineConfig(model="demo:tiny", dtype="float32").attention_backend == "cpu"
    assert EngineConfig(model="demo:tiny", dtype="bfloat16").attention_backend == "cpu"
    assert EngineConfig(model="demo:tiny", dtype="float16").attention_backend == "torch"


def test_kernels_run_on_every_torch_thread_and_bind_one_per_core() -> None:
    """Built without -fopenmp, at::parallel_for ran each kernel on one thread and bind_threads pinned
    only the caller (to the last cpu). In a subprocess: binding moves this process's threads."""
    import os
    import subprocess
    import sys
    cpus = sorted(os.sched_getaffinity(0))[:2]
    if len(cpus) < 2:
        pytest.skip("needs two cpus")
    code = (f"import os, torch; torch.set_num_threads(2); from kernels import cpu_ops; "
            f"print(cpu_ops.bind_threads({cpus}), sorted(os.sched_getaffinity(0)))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip().splitlines()[-1] == f"{cpus} [{cpus[0]}]"


def test_a_second_engine_in_the_process_binds_threads_to_distinct_cpus() -> None:
    """cpus were read from the calling thread's affinity, which the first engine had pinned to one cpu:
    the second engine then pinned both torch threads there (demo:tiny ran 25x slower)."""
    import os
    import subprocess
    import sys
    cpus = sorted(os.sched_getaffinity(0))[:2]
    if len(cpus) < 2:
        pytest.skip("needs two cpus")
    code = ("import os, torch; torch.set_num_threads(2); from engine import LLM\n"
            "for _ in range(2):\n"
            "    LLM('demo:tiny', dtype='float32', cpu_threads_bind='auto')\n"
            "    pinned = [os.sched_getaffinity(int(t)) for t in os.listdir('/proc/self/task')]\n"
            "    print(sorted(set().union(*(a for a in pinned if len(a) == 1))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip().splitlines()[-2:] == [str(cpus)] * 2


def test_prefill_steps_padded_to_bounded_row_counts_give_the_same_tokens() -> None:
    """oneDNN builds a primitive per row count: steps with a prefill run at padded_rows(tokens), a bounded set;
    the padding rows store no K/V, reach no sampler and change no real row's tokens."""
    from engine import LLM, SamplingParams
    from engine.layers.linear import padded_rows
    assert all(padded_rows(n) == n for n in range(1, 33))
    assert all(0 <= padded_rows(n) - n < max(16, n / 8) for n in range(33, 4097))
    assert [padded_rows(n) for n in (32, 33, 49, 100, 257, 1000, 2048)] == [32, 48, 64, 112, 288, 1024, 2048]
    assert len({padded_rows(n) for n in range(1, 2049)}) <= 80
    llm = LLM("demo:tiny", dtype="float32", enable_prefix_caching=False)
    runner = llm.engine.core.core.executor.runner
    rows: list[int] = []
    forward = runner.model.forward

    def counted(input_ids: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        rows.append(input_ids.shape[0])
        return forward(input_ids, *args, **kwargs)
    runner.model.forward = counted
    prompts = [{"prompt_token_ids": list(range(5, 5 + n))} for n in (37, 50)]
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    outs = {}
    for pad in (True, False):
        runner.pad_steps, rows[:] = pad, []
        outs[pad] = [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]
        assert rows[0] == (96 if pad else 87) and rows[1:] == [2] * 7
    assert outs[True] == outs[False]
    assert llm.engine.stats().kv_blocks_free == llm.engine.stats().kv_blocks_total


def test_a_stale_build_lock_is_removed_and_a_fresh_one_kept(tmp_path, monkeypatch) -> None:
    """A build killed midway leaves torch's lock file; the next build would wait on it for ever."""
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    from torch.utils.cpp_extension import _get_build_directory
    lock = Path(_get_build_directory("conveyor_lock_test", False)) / "lock"
    lock.parent.mkdir(parents=True, exist_ok=True)
    lock.touch()
    assert not cpu_ops.clear_stale_lock("conveyor_lock_test") and lock.exists()  # a build may be running
    assert cpu_ops.clear_stale_lock("conveyor_lock_test", now=time.time() + cpu_ops.STALE_LOCK_S + 1)
    assert not lock.exists() and not cpu_ops.clear_stale_lock("conveyor_lock_test")
