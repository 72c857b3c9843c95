"""The engine's linear layers on the C++ CPU kernels: which row counts take them, the plain weight released, a
tied LM head, and prefill steps padded to bounded row counts giving the same tokens."""

from types import ModuleType

import pytest
import torch
import torch.nn.functional as F
from torch import nn


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
