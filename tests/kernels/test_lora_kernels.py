"""Triton LoRA shrink/expand against the torch path of engine/model/lora.py (apply_gathered) and a per-row loop
(interpreter on CPU): mixed slots, base rows, ranks below and at the slot rank, q/k/v output slices."""

import os

import numpy as np
import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from conveyor.engine.model.lora import apply_gathered, make_plan  # noqa: E402
from conveyor.kernels import triton_ops  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
# The oracle runs in fp32 on the same rounded inputs; the slack is the kernel's rounding of the shrunk rows to
# the model dtype and of the output.
TOL = {
    torch.float32: dict(atol=1e-5, rtol=1e-5),
    torch.float16: dict(atol=3e-3, rtol=3e-3),
    torch.bfloat16: dict(atol=2e-2, rtol=2e-2),
}
QKV = (48, 16, 16)  # output slices: q, k, v


def stacks(
    slices: tuple[int, ...], in_features: int, ranks: list[int], max_rank: int, gen: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """Slot-stacked A [S, g*R, in] and block-diagonal B [S, g*R, out] as LoRALinear keeps them: slot s of rank
    ranks[s], zero-padded to max_rank."""
    g, out = len(slices), sum(slices)
    a = torch.zeros(len(ranks), g * max_rank, in_features)
    b = torch.zeros(len(ranks), g * max_rank, out)
    for s, r in enumerate(ranks):
        offset = 0
        for i, size in enumerate(slices):
            a[s, i * max_rank : i * max_rank + r] = torch.randn(r, in_features, generator=gen) / 4
            b[s, i * max_rank : i * max_rank + r, offset : offset + size] = torch.randn(r, size, generator=gen) / 4
            offset += size
    return a, b


def per_row(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, token_slots: np.ndarray) -> torch.Tensor:
    """y = x @ A[slot].T @ B[slot] row by row, 0 on base rows."""
    y = torch.zeros(x.shape[0], b.shape[2], dtype=torch.float64)
    for row, slot in enumerate(token_slots):
        if slot >= 0:
            y[row] = x[row].double() @ a[slot].double().T @ b[slot].double()
    return y


def triton_lora(x: torch.Tensor, y: torch.Tensor, a: torch.Tensor, b: torch.Tensor, token_slots, slices, rank):
    plan = make_plan(token_slots, DEVICE, x.dtype, rank)
    bounds = torch.tensor(np.cumsum((0, *slices)), dtype=torch.int32, device=DEVICE)
    rows, starts, slots = plan.rows, plan.starts, plan.slots
    t = triton_ops.lora_shrink(x, a, rows, starts, slots, plan.max_len, rank)
    return triton_ops.lora_expand(t, b, y, rows, starts, slots, plan.max_len, bounds, max(slices))


CASES = {
    # name: (token slots, slices, in_features, each slot's rank, slot rank)
    "decode-mixed-r8": ([0, -1, 2, 1, 0, -1, 2, 2, 1, -1, 0], QKV, 40, [8, 4, 8], 8),
    "rank4": ([1, 1, -1, 0, 1, -1], (24,), 36, [4, 4], 4),
    "rank16-qkv": ([2, 0, -1, 2, -1, 0, 0, 2], QKV, 72, [16, 8, 16], 16),
    "gap-in-slots": ([3, -1, 1, 3, 3, 1], (32, 32), 48, [8, 8, 8, 8], 8),
    "long-segment": ([0] * 37 + [-1] * 3 + [1] * 5, QKV, 40, [8, 8], 8),
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_triton_shrink_expand_match_the_torch_path(case: str, dtype: torch.dtype) -> None:
    token_slots, slices, in_features, ranks, rank = CASES[case]
    token_slots = np.array(token_slots, dtype=np.int64)
    gen = torch.Generator().manual_seed(sum(map(ord, case)))
    a, b = stacks(slices, in_features, ranks, rank, gen)
    x = torch.randn(len(token_slots), in_features, generator=gen)
    y0 = torch.randn(len(token_slots), sum(slices), generator=gen)
    a, b, x, y0 = (v.to(dtype) for v in (a, b, x, y0))  # rounded once: the oracle sees the same values
    want = apply_gathered(
        x.float(),
        y0.float().clone(),
        a.float(),
        b.float(),
        make_plan(token_slots, torch.device("cpu"), torch.float32, rank),
    )
    exact = y0.double() + per_row(x.float(), a.float(), b.float(), token_slots)
    torch.testing.assert_close(want.double(), exact, atol=1e-5, rtol=1e-5)  # the torch path itself
    got = triton_lora(x.to(DEVICE), y0.clone().to(DEVICE), a.to(DEVICE), b.to(DEVICE), token_slots, slices, rank)
    base = token_slots < 0
    assert torch.equal(got.cpu()[base], y0[base])  # base rows untouched
    assert not torch.equal(got.cpu()[~base], y0[~base])
    torch.testing.assert_close(got.cpu().float(), want, **TOL[dtype])
