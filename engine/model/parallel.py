"""Tensor-parallel group state. With no process group initialised everything is rank 0 of 1."""

import torch
import torch.distributed as dist
from transformers import PretrainedConfig


def tp_rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def tp_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    if tp_size() > 1:
        dist.all_reduce(x)
    return x


def gather_to_rank0(x: torch.Tensor, dim: int = -1) -> torch.Tensor | None:
    """Concatenate each rank's shard along `dim` on rank 0; other ranks get None."""
    if tp_size() == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(tp_size())] if tp_rank() == 0 else None
    dist.gather(x.contiguous(), parts, dst=0)
    return torch.cat(parts, dim) if parts is not None else None


def divide(numerator: int, denominator: int, what: str) -> int:
    if numerator % denominator:
        raise ValueError(f"{what} ({numerator}) is not divisible by tensor_parallel_size ({denominator})")
    return numerator // denominator


def check_shardable(hf_config: PretrainedConfig, size: int) -> None:
    """Refuse at start-up a model that cannot be split over `size` ranks, naming the numbers."""
    if size == 1:
        return
    heads = hf_config.num_attention_heads
    kv = getattr(hf_config, "num_key_value_heads", None) or heads
    divide(heads, size, "num_attention_heads")
    if kv >= size:
        divide(kv, size, "num_key_value_heads")
    elif size % kv:
        raise ValueError(
            f"tensor_parallel_size ({size}) must be a multiple of num_key_value_heads ({kv}) when it exceeds it"
        )
    divide(hf_config.intermediate_size, size, "intermediate_size")
    divide(hf_config.vocab_size, size, "vocab_size")
