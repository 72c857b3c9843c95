"""Paged-attention kernels. Every op has the same signature in every backend: `kernels.reference`
(pure torch, the test oracle and the fallback), `kernels.cpu_ops` (C++, the CPU path) and
`kernels.triton_ops` (the GPU path)."""

from dataclasses import dataclass
from types import ModuleType
from typing import Callable


@dataclass(frozen=True)
class AttentionOps:
    name: str
    store_kv_cache: Callable
    paged_decode_attention: Callable
    paged_prefill_attention: Callable
    paged_attention: Callable | None = None  # decodes and prefills of a step in one call
    fused: ModuleType | None = None  # rms_norm_, silu_and_mul, rotary_embedding_ (C++ CPU kernels)


def attention_ops(backend: str) -> AttentionOps:
    if backend == "torch":
        from conveyor.kernels import reference as mod
    elif backend == "triton":
        from conveyor.kernels import triton_ops as mod
    elif backend == "cpu":
        from conveyor.kernels import cpu_ops as mod

        if mod.load() is None:
            raise ValueError("attention_backend 'cpu' needs the C++ CPU kernels, which cannot be built here")
        return AttentionOps(
            backend,
            mod.store_kv_cache,
            mod.paged_decode_attention,
            mod.paged_prefill_attention,
            mod.paged_attention,
            mod.load(),
        )
    else:
        raise ValueError(f"attention_backend must be 'torch', 'cpu' or 'triton', got {backend!r}")
    return AttentionOps(backend, mod.store_kv_cache, mod.paged_decode_attention, mod.paged_prefill_attention)
