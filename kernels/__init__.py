"""Paged-attention kernels. Every op has the same signature in both backends:
`kernels.reference` (pure torch, the CPU path and the test oracle) and `kernels.triton_ops`."""
from dataclasses import dataclass
from typing import Callable


@dataclass(frozen=True)
class AttentionOps:
    name: str
    store_kv_cache: Callable
    paged_decode_attention: Callable
    paged_prefill_attention: Callable


def attention_ops(backend: str) -> AttentionOps:
    if backend == "torch":
        from kernels import reference as mod
    elif backend == "triton":
        from kernels import triton_ops as mod
    else:
        raise ValueError(f"attention_backend must be 'torch' or 'triton', got {backend!r}")
    return AttentionOps(backend, mod.store_kv_cache, mod.paged_decode_attention,
                        mod.paged_prefill_attention)
