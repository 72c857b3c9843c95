"""Linear layers sharded for tensor parallelism (identity sharding at tp=1).

Each weight_loader receives a tensor or a safetensors slice and reads only this rank's part."""

import sys
import time
from dataclasses import dataclass, replace
from types import ModuleType
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from conveyor.engine.model.parallel import all_reduce, divide, tp_rank, tp_size
from conveyor.engine.stats import cdiv


def _rows(loaded, start: int, size: int) -> torch.Tensor:
    return loaded[start : start + size]


PLAIN_MARGIN = 1.25  # timings on a shared machine are noisy: packed, the usual winner, stays unless clearly beaten
SMALL_ROWS = 32  # kernels/csrc/gemm.h up to here, oneDNN above (docs/decisions/08-small-batch-matmul.md)


def padded_rows(n: int) -> int:
    """The row count a step of n tokens runs its packed linears at. oneDNN builds a GEMM primitive per distinct
    shape on first use (~2 ms for prefill-sized ones on an Intel AMX VM, 0.2 ms at <= 32 rows) and caches 1024:
    a server sees every count up to its token budget, 4 weight shapes each, and would rebuild them for ever.
    Above 32 rows counts go up to a multiple of an eighth of their power of two (at least 16): fewer than
    max(16, n / 8) rows more, about 40 distinct counts up to 2048."""
    if n <= 32:
        return n
    step = max(16, (1 << (n.bit_length() - 1)) // 8)
    return cdiv(n, step) * step


@dataclass(frozen=True)
class PackedWeight:
    """How a linear of `out_features` outputs runs on this CPU: inputs of up to `small_rows` rows through `small`
    (the C++ kernel of kernels/csrc/gemm.h, on its own panel layout `small_tensor`), from `min_rows` rows
    through oneDNN's blocked layout `tensor` (None: measured slower than plain here), F.linear otherwise."""

    tensor: torch.Tensor | None
    min_rows: int
    out_features: int
    small: Callable | None = None
    small_tensor: torch.Tensor | None = None
    small_rows: int = 0

    @property
    def needs_plain(self) -> bool:
        if self.small_rows == sys.maxsize:
            return False
        return self.tensor is None or self.min_rows > self.small_rows + 1


def matmul(
    x: torch.Tensor, weight: torch.Tensor, packed: PackedWeight | None, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """x @ weight.T (+ bias), on CPU through the kernel measured fastest for its rows."""
    if packed is not None:
        if 0 < x.shape[0] <= packed.small_rows and x.dim() == 2:
            return packed.small(x.contiguous(), packed.small_tensor, packed.out_features, bias)
        if packed.tensor is not None and x.shape[0] >= packed.min_rows:
            return torch.ops.mkldnn._linear_pointwise(x, packed.tensor, bias, "none", [], "")
        if x.shape[0] == 0 and x.dim() == 2:  # a step with no rows to sample; the plain weight may be released
            return x.new_empty((0, packed.out_features))
    return F.linear(x, weight, bias)


def _seconds(a: Callable[[], object], b: Callable[[], object], rounds: int = 4, reps: int = 3) -> tuple[float, float]:
    """The best of several timings of a and of b, alternated so that a noisy neighbour slows both alike."""
    best = [float("inf"), float("inf")]
    for _ in range(rounds):
        for i, fn in enumerate((a, b)):
            for _ in range(reps):
                start = time.perf_counter()
                fn()
                best[i] = min(best[i], time.perf_counter() - start)
    return best[0], best[1]


def _pack(weight: torch.Tensor, fused: ModuleType | None) -> PackedWeight | None:
    """oneDNN's blocked layout for this weight, unless the plain layout is clearly faster on this CPU
    (by PLAIN_MARGIN, timed for a batch of 32 rows and, without the C++ kernels, a decode GEMV of 1 row).
    Which wins depends on the CPU and the shape, so it is timed here, with the weight in cache; a step streams
    every weight once, so small row counts take the C++ kernels whatever the timing says."""
    w = weight.data
    ours = fused is not None and w.dtype in (torch.float32, torch.bfloat16)
    small = dict(small=fused.gemm_packed, small_tensor=fused.pack_gemm(w), small_rows=SMALL_ROWS) if ours else {}
    try:
        packed = torch.ops.mkldnn._reorder_linear_weight(w, None)
    except RuntimeError:  # oneDNN has no path for this dtype here (bfloat16 on AVX2, float16 without AVX512-FP16)
        # torch's own fallback for bfloat16 is scalar code: the C++ kernel (bfloat16 widened in registers) takes
        # every row count
        return PackedWeight(None, 0, w.shape[0], **{**small, "small_rows": sys.maxsize}) if ours else None
    plain_wins = []
    for n in (32,) if ours else (1, 32):
        x = torch.randn(n, w.shape[1], dtype=w.dtype)
        t_packed, t_plain = _seconds(
            lambda: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], ""), lambda: F.linear(x, w)
        )
        plain_wins.append(t_plain * PLAIN_MARGIN < t_packed)
    *decode, batch = plain_wins
    if batch:
        return PackedWeight(None, 0, w.shape[0], **small) if ours else None
    return PackedWeight(packed, 4 if any(decode) else 1, w.shape[0], **small)


def pack_weights(model: nn.Module, fused: ModuleType | None = None) -> int:
    """Reorders linear weights once into oneDNN's blocked layout, as Inductor's CPU freezing does,
    where that measured faster on this CPU (one timing per distinct shape); `fused`: the C++ kernels
    (kernels/cpu_ops.py), which take inputs of up to SMALL_ROWS rows. The plain weight is released where the
    packed layouts serve every row count and no other module shares it (a tied embedding). Returns how many
    weights were packed."""
    if not torch.backends.mkldnn.is_available() or not hasattr(torch.ops.mkldnn, "_reorder_linear_weight"):
        return 0
    choice: dict[tuple, PackedWeight | None] = {}
    shared = {
        p.data_ptr() for m in model.modules() if not getattr(m, "packable", False) for p in m.parameters(recurse=False)
    }
    n = 0
    for module in model.modules():
        w = getattr(module, "weight", None)
        if not getattr(module, "packable", False) or w.device.type != "cpu":
            continue
        key = (tuple(w.shape), w.dtype)
        if key not in choice:
            module.packed = choice[key] = _pack(w, fused)
        elif (plan := choice[key]) is not None:
            tensor = None if plan.tensor is None else torch.ops.mkldnn._reorder_linear_weight(w.data, None)
            small = None if plan.small is None else fused.pack_gemm(w.data)
            module.packed = replace(plan, tensor=tensor, small_tensor=small)
        if module.packed is not None and not module.packed.needs_plain and w.data_ptr() not in shared:
            w.data = w.data.new_empty(0)
        n += module.packed is not None and module.packed.tensor is not None
    return n


class ColumnParallelLinear(nn.Module):
    """y = x W^T with W split along the output dim; each rank keeps its slice of the outputs."""

    packable, packed, lora = True, None, None  # lora: its adapters' LoRALinear (engine/model/lora.py)

    def __init__(self, input_size: int, output_size: int, bias: bool = False) -> None:
        super().__init__()
        self.tp_rank, self.tp_size = tp_rank(), tp_size()
        self.output_size_per_rank = divide(output_size, self.tp_size, "linear output size")
        self.weight = nn.Parameter(torch.empty(self.output_size_per_rank, input_size), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(self.output_size_per_rank), requires_grad=False) if bias else None
        for p in self.parameters():
            p.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded, shard_id: object = None) -> None:
        n = param.shape[0]
        param.data.copy_(_rows(loaded, self.tp_rank * n, n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = matmul(x, self.weight, self.packed, self.bias)
        return y if self.lora is None else self.lora(x, y)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections of one input stored as one matrix (gate_up)."""

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = False) -> None:
        self.output_sizes = output_sizes
        super().__init__(input_size, sum(output_sizes), bias)

    def weight_loader(self, param: nn.Parameter, loaded, shard_id: int) -> None:
        size = self.output_sizes[shard_id] // self.tp_size
        offset = sum(self.output_sizes[:shard_id]) // self.tp_size
        param.data[offset : offset + size].copy_(_rows(loaded, self.tp_rank * size, size))


class QKVParallelLinear(ColumnParallelLinear):
    """Fused q/k/v projection split by heads; KV heads are replicated when tp > num_kv_heads."""

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool = False) -> None:
        tp = tp_size()
        self.head_dim = head_dim
        self.num_heads = divide(num_heads, tp, "num_attention_heads")
        if num_kv_heads >= tp:
            self.num_kv_heads = divide(num_kv_heads, tp, "num_key_value_heads")
        else:
            divide(tp, num_kv_heads, "tensor_parallel_size must be a multiple of num_key_value_heads; it")
            self.num_kv_heads = 1
        self.kv_replicas = max(1, tp // num_kv_heads)
        output = (self.num_heads + 2 * self.num_kv_heads) * head_dim * tp
        super().__init__(hidden_size, output, bias)

    def weight_loader(self, param: nn.Parameter, loaded, shard_id: str) -> None:
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        if shard_id == "q":
            offset, size, start = 0, q, self.tp_rank * q
        else:
            offset = q if shard_id == "k" else q + kv
            size, start = kv, (self.tp_rank // self.kv_replicas) * kv
        param.data[offset : offset + size].copy_(_rows(loaded, start, size))


class RowParallelLinear(nn.Module):
    """y = x W^T with W split along the input dim; partial sums are all-reduced."""

    packable, packed, lora = True, None, None

    def __init__(self, input_size: int, output_size: int, bias: bool = False) -> None:
        super().__init__()
        self.tp_rank, self.tp_size = tp_rank(), tp_size()
        self.input_size_per_rank = divide(input_size, self.tp_size, "linear input size")
        self.weight = nn.Parameter(torch.empty(output_size, self.input_size_per_rank), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(output_size), requires_grad=False) if bias else None
        for p in self.parameters():
            p.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded, shard_id: object = None) -> None:
        if param.dim() == 1:
            param.data.copy_(loaded[:])
            return
        n = param.shape[1]
        param.data.copy_(loaded[:, self.tp_rank * n : (self.tp_rank + 1) * n])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = matmul(x, self.weight, self.packed)
        y = all_reduce(y if self.lora is None else self.lora(x, y))
        return y + self.bias if self.bias is not None else y
