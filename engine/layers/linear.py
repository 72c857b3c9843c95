"""Linear layers sharded for tensor parallelism (identity sharding at tp=1).

Each weight_loader receives a tensor or a safetensors slice and reads only this rank's part."""
import torch
import torch.nn.functional as F
from torch import nn

from engine.parallel import all_reduce, divide, tp_rank, tp_size


def _rows(loaded, start: int, size: int) -> torch.Tensor:
    return loaded[start:start + size]


def matmul(x: torch.Tensor, weight: torch.Tensor, packed: torch.Tensor | None,
           bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ weight.T (+ bias), through oneDNN's prepacked weight on CPU when one was made."""
    if packed is None or (x.shape[0] < 4 and x.dtype == torch.float32):  # float32 GEMV: packed ran 0.5-0.9x
        return F.linear(x, weight, bias)
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def pack_weights(model: nn.Module) -> int:
    """Reorders every linear weight once into oneDNN's blocked layout, as Inductor's CPU freezing
    does: on this 2-core AVX-512/AMX machine a [32, 768] x [768, 4096] GEMM ran 3.4x (float32) and
    2x (bfloat16, AMX) faster than F.linear. Small float32 weights stay plain: below 2^19 elements
    (demo:tiny's 256-wide projections) packed ran 0.5-0.95x at 8-64 rows, while bfloat16 gained at
    every size measured (1 thread, 1-2048 rows). Returns how many weights were packed."""
    if not torch.backends.mkldnn.is_available() or not hasattr(torch.ops.mkldnn, "_reorder_linear_weight"):
        return 0
    n = 0
    for module in model.modules():
        w = getattr(module, "weight", None)
        if getattr(module, "packable", False) and w.device.type == "cpu" and (
                w.dtype != torch.float32 or w.numel() >= 2 ** 19):
            module.packed = torch.ops.mkldnn._reorder_linear_weight(module.weight.data, None)
            n += 1
    return n


class ColumnParallelLinear(nn.Module):
    """y = x W^T with W split along the output dim; each rank keeps its slice of the outputs."""

    packable, packed = True, None

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
        return matmul(x, self.weight, self.packed, self.bias)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections of one input stored as one matrix (gate_up)."""

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = False) -> None:
        self.output_sizes = output_sizes
        super().__init__(input_size, sum(output_sizes), bias)

    def weight_loader(self, param: nn.Parameter, loaded, shard_id: int) -> None:
        size = self.output_sizes[shard_id] // self.tp_size
        offset = sum(self.output_sizes[:shard_id]) // self.tp_size
        param.data[offset:offset + size].copy_(_rows(loaded, self.tp_rank * size, size))


class QKVParallelLinear(ColumnParallelLinear):
    """Fused q/k/v projection split by heads; KV heads are replicated when tp > num_kv_heads."""

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int,
                 bias: bool = False) -> None:
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
        param.data[offset:offset + size].copy_(_rows(loaded, start, size))


class RowParallelLinear(nn.Module):
    """y = x W^T with W split along the input dim; partial sums are all-reduced."""

    packable, packed = True, None

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
        param.data.copy_(loaded[:, self.tp_rank * n:(self.tp_rank + 1) * n])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = all_reduce(matmul(x, self.weight, self.packed))
        return y + self.bias if self.bias is not None else y
