"""The C++ CPU kernels (kernels/csrc/cpu_ops.cpp) against the pure-torch reference and the eager layers, on
every ISA build (kernels/cpu_ops.py's ISAS): an ISA this CPU cannot run is skipped naming the CPU flags it lacks."""

import logging
import os
import subprocess
import sys
import threading
from pathlib import Path
from types import ModuleType

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from transformers import LlamaConfig

from conveyor.engine.model.norm import RMSNorm
from conveyor.engine.model.rotary import RotaryEmbedding, apply_rotary
from conveyor.kernels import cpu_ops, reference
from conveyor.kernels.cpu_ops import load as load_kernels  # the real one: the fixture below patches cpu_ops.load

TOL = {torch.float32: 2e-6, torch.bfloat16: 1.6e-2}
DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])


def isa_module(isa: str) -> ModuleType:
    """The kernels built for `isa`; skips (naming the missing CPU flags) where this CPU cannot run them and
    fails where they do not build."""
    missing = cpu_ops.missing_cpu_flags(isa)
    if missing:
        pytest.skip(f"the CPU lacks {', '.join(missing)} for {isa}")
    lib = load_kernels(isa)
    assert lib is not None, f"the {isa} kernels did not build (see the log)"
    assert lib.isa == isa
    return lib


@pytest.fixture(params=cpu_ops.ISAS)
def lib(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    """One ISA's kernels, also behind cpu_ops' wrappers (cpu_ops.paged_attention, store_kv_cache...)."""
    module = isa_module(request.param)
    monkeypatch.setattr(cpu_ops, "load", lambda isa=None: module)
    return module


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
    lib: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    from types import SimpleNamespace

    from conveyor.engine.model import linear
    from conveyor.engine.model.linear import SMALL_ROWS, ColumnParallelLinear, pack_weights

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


def test_without_a_onednn_bfloat16_path_the_cpp_kernel_takes_every_row_count(
    lib: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On AVX2, oneDNN cannot reorder a bfloat16 weight and torch's bfloat16 linear is scalar code: the C++
    kernel, bfloat16 widened in registers, serves every row count and the plain weight is released."""
    from conveyor.engine.model.linear import ColumnParallelLinear, pack_weights

    def no_bf16_path(*args: object) -> None:
        raise RuntimeError("mkldnn_reorder_linear_weight: bf16 path needs the cpu support avx_ne_convert")

    monkeypatch.setattr(torch.ops.mkldnn, "_reorder_linear_weight", no_bf16_path)
    layer = ColumnParallelLinear(64, 96).to(torch.bfloat16)
    layer.weight.data.normal_()
    weight = layer.weight.detach().float()
    pack_weights(layer, lib)
    assert layer.packed.tensor is None and layer.weight.numel() == 0
    for rows in (1, 32, 33, 200):
        x = torch.randn(rows, 64).bfloat16()
        exact = x.double() @ weight.double().T
        assert (layer(x).double() - exact).abs().max() <= 0.02 * exact.abs().max()


def test_a_tied_lm_head_keeps_the_embedding_it_shares(lib: ModuleType) -> None:
    from conveyor.engine.model.embedding import ParallelLMHead, VocabParallelEmbedding
    from conveyor.engine.model.linear import pack_weights

    model = nn.Module()
    model.embed, model.head = VocabParallelEmbedding(100, 64), ParallelLMHead(100, 64)
    model.embed.weight.data.normal_()
    model.head.weight = model.embed.weight
    weight = model.embed.weight.detach().clone()
    pack_weights(model, lib)
    assert model.head.packed is not None and torch.equal(model.embed.weight, weight)
    x = torch.randn(3, 64)
    torch.testing.assert_close(model.head(x), F.linear(x, weight), rtol=1e-5, atol=1e-5)


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
        w, x = torch.randn(200, 333, generator=g).to(dtype), torch.randn(19, 333, generator=g).to(dtype)
        bias = torch.randn(200, generator=g).to(dtype)
        assert torch.equal(
            lib.gemm_packed(x, lib.pack_gemm(w), 200, bias), generic.gemm_packed(x, generic.pack_gemm(w), 200, bias)
        )
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


def test_load_takes_the_best_isa_the_cpu_runs_or_the_one_named(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(cpu_ops, "_is_x86", lambda: True)
    monkeypatch.setattr(cpu_ops, "_cpu_flags", lambda: {"sse2", "avx", "avx2", "fma", "f16c"})  # AMD EPYC Zen 2
    assert cpu_ops.supported_isas() == ["avx2", "generic"]
    assert cpu_ops.missing_cpu_flags("avx512bf16") == ["avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16"]
    with caplog.at_level(logging.WARNING, logger="conveyor"):
        assert cpu_ops._load.__wrapped__("avx512") is None  # unmemoized: the decision, not a cached module
        assert cpu_ops._load.__wrapped__("sse9") is None
    assert "lacks avx512f, avx512bw, avx512vl, avx512dq for ISA avx512" in caplog.text
    assert "unknown ISA 'sse9'" in caplog.text
    monkeypatch.setattr(cpu_ops, "_is_x86", lambda: False)  # aarch64: the portable build only
    assert cpu_ops.supported_isas() == ["generic"] and cpu_ops.missing_cpu_flags("avx2") == ["x86"]
    monkeypatch.undo()
    best = cpu_ops.supported_isas()[0]
    monkeypatch.delenv("CONVEYOR_CPU_ISA", raising=False)
    assert cpu_ops.isa() == best and cpu_ops.load() is cpu_ops.load(best)
    monkeypatch.setenv("CONVEYOR_CPU_ISA", "generic")
    assert cpu_ops.isa() == "generic" and cpu_ops.load() is cpu_ops.load("generic")
    monkeypatch.setenv("CONVEYOR_CPU_KERNELS", "0")
    assert cpu_ops.load() is None and cpu_ops.isa() is None


def test_each_isa_is_its_own_module_named_by_isa_and_digest() -> None:
    names = {isa: cpu_ops.module_name(isa) for isa in cpu_ops.ISAS}
    assert len(set(names.values())) == len(names)
    assert all(name.startswith(f"conveyor_cpu_ops_{isa}_") for isa, name in names.items())
    assert "-DCONVEYOR_ISA_AVX2" in cpu_ops.cflags("avx2") and "-mavx512bf16" not in cpu_ops.cflags("avx512")
    assert all({"-fopenmp", "-ffp-contract=off"} <= set(cpu_ops.cflags(isa)) for isa in cpu_ops.ISAS)


def test_auto_backend_on_cpu_is_the_cpp_kernels_except_float16() -> None:
    from conveyor.engine.config import EngineConfig
    from conveyor.engine.resolved_config import resolve

    assert EngineConfig(model="demo:tiny", dtype="float32").attention_backend == "auto"
    assert resolve(EngineConfig(model="demo:tiny", dtype="float32")).attention_backend == "cpu"
    assert resolve(EngineConfig(model="demo:tiny", dtype="bfloat16")).attention_backend == "cpu"
    assert resolve(EngineConfig(model="demo:tiny", dtype="float16")).attention_backend == "torch"


def test_kernels_run_on_every_torch_thread_and_bind_one_per_core(tmp_path: Path) -> None:
    """Built without -fopenmp, at::parallel_for ran each kernel on one thread and bind_threads pinned
    only the caller (to the last cpu). In a subprocess (outside the repository, whose source folders would
    shadow installed packages of the same name): binding moves this process's threads."""
    import os
    import subprocess
    import sys

    cpus = sorted(os.sched_getaffinity(0))[:2]
    if len(cpus) < 2:
        pytest.skip("needs two cpus")
    code = (
        f"import os, torch; torch.set_num_threads(2); from conveyor.kernels import cpu_ops; "
        f"print(cpu_ops.bind_threads({cpus}), sorted(os.sched_getaffinity(0)))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=tmp_path).stdout
    assert out.strip().splitlines()[-1] == f"{cpus} [{cpus[0]}]"


def test_a_second_engine_in_the_process_binds_threads_to_distinct_cpus(tmp_path: Path) -> None:
    """cpus were read from the calling thread's affinity, which the first engine had pinned to one cpu:
    the second engine then pinned both torch threads there (demo:tiny ran 25x slower)."""
    import os
    import subprocess
    import sys

    cpus = sorted(os.sched_getaffinity(0))[:2]
    if len(cpus) < 2:
        pytest.skip("needs two cpus")
    code = (
        "import os, torch; torch.set_num_threads(2); from conveyor.engine import LLM\n"
        "for _ in range(2):\n"
        "    LLM('demo:tiny', dtype='float32', cpu_threads_bind='auto')\n"
        "    pinned = [os.sched_getaffinity(int(t)) for t in os.listdir('/proc/self/task')]\n"
        "    print(sorted(set().union(*(a for a in pinned if len(a) == 1))))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=tmp_path).stdout
    assert out.strip().splitlines()[-2:] == [str(cpus)] * 2


def test_prefill_steps_padded_to_bounded_row_counts_give_the_same_tokens() -> None:
    """oneDNN builds a primitive per row count: steps with a prefill run at padded_rows(tokens), a bounded set;
    the padding rows store no K/V, reach no sampler and change no real row's tokens."""
    from conveyor.engine import LLM, SamplingParams
    from conveyor.engine.model.linear import padded_rows

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


def test_a_running_build_is_waited_for_and_a_killed_ones_lock_removed(tmp_path, monkeypatch) -> None:
    """A build killed midway leaves torch's lock file, on which torch would wait for ever: the next build
    waits while the builder lives and removes that file once it is gone."""
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    from torch.utils.cpp_extension import _get_build_directory

    name = "conveyor_lock_test"
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD_BUILD_LOCK, name], env={**os.environ}, stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout.readline().strip() == "building"
        lock = Path(_get_build_directory(name, False)) / "lock"
        assert lock.exists()
        entered = threading.Event()

        def build() -> None:
            with cpu_ops.build_lock(name):
                entered.set()

        waiter = threading.Thread(target=build)
        waiter.start()
        assert not entered.wait(1.0), "a live build is waited for"
        holder.kill()
        holder.wait()
        assert entered.wait(10.0), "the killed build's lock is released with its process"
        waiter.join()
        assert not lock.exists()
    finally:
        holder.kill()


HOLD_BUILD_LOCK = """
import sys, time
from pathlib import Path
from torch.utils.cpp_extension import _get_build_directory
from conveyor.kernels import cpu_ops
with cpu_ops.build_lock(sys.argv[1]):
    (Path(_get_build_directory(sys.argv[1], False)) / "lock").touch()  # what torch's FileBaton does
    print("building", flush=True)
    time.sleep(60)
"""
