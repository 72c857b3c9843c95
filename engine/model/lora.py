"""Multi-LoRA over a flat packed batch: `max_loras` resident slots, each projection's A and B stacked over them,
applied in one pass to a step whose tokens each name a slot (-1: the base model).

Per projection y += ((x @ A_all) * mask) @ B_all, over the slots 0..k-1 the step uses: the shrink computes every
used slot's rank-R columns for every token, the per-token mask (built once per step) keeps its own slot's, and
the expand adds that slot's B. Ranks below max_lora_rank are zero-padded; the scale is folded into B.
TP: A is replicated and B split like the base weight for column-parallel layers; A split along the input and B
replicated for row-parallel ones, whose partial sums meet in the base layer's all-reduce."""

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from conveyor.engine.checkpoints.lora import Adapter
from conveyor.engine.model.linear import ColumnParallelLinear, QKVParallelLinear, RowParallelLinear


@dataclass
class LoRABatch:
    """This step's selection: masks by row count (the step's rows, and the sampled rows the last layer keeps),
    each [rows, k * max_rank]; k: the slots 0..k-1 in use."""

    masks: dict[int, torch.Tensor]
    k: int


class LoRALinear:
    """The stacked adapters of one linear: its output segments (q/k/v, gate/up, or one) each with a B stack."""

    def __init__(
        self, owner: "LoRAModel", linear: nn.Module, segments: list[tuple[object, int, int]], in_features: int
    ) -> None:
        self.owner, self.linear, self.segments = owner, linear, segments
        s, r, dt, dev = owner.max_loras, owner.max_rank, owner.dtype, owner.device
        self.a = torch.zeros(s * r, len(segments), in_features, dtype=dt, device=dev)
        self.b = [torch.zeros(s * r, size, dtype=dt, device=dev) for _, _, size in segments]
        self.row_parallel = isinstance(linear, RowParallelLinear)

    def clear(self, slot: int) -> None:
        rows = slice(slot * self.owner.max_rank, (slot + 1) * self.owner.max_rank)
        self.a[rows] = 0
        for b in self.b:
            b[rows] = 0

    def set(self, slot: int, segment: int, a: torch.Tensor, b: torch.Tensor, scale: float) -> None:
        """a [r, in], b [out, r] in full (unsharded); this rank keeps its part as the base weight does."""
        r = a.shape[0]
        rows = slice(slot * self.owner.max_rank, slot * self.owner.max_rank + r)
        shard_id, offset, size = self.segments[segment]
        if self.row_parallel:
            local = torch.empty(r, self.a.shape[2], dtype=a.dtype)
            self.linear.weight_loader(local, a, shard_id)
            self.a[rows, segment] = local.to(self.a)
            self.b[segment][rows] = (b.T * scale).to(self.b[segment])
        else:
            local = torch.empty(self.linear.output_size_per_rank, r, dtype=b.dtype)
            self.linear.weight_loader(local, b, shard_id)
            self.a[rows, segment] = a.to(self.a)
            self.b[segment][rows] = (local[offset : offset + size].T * scale).to(self.b[segment])

    def __call__(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        batch = self.owner.batch
        if batch is None:
            return y
        n, kr, g = x.shape[0], batch.k * self.owner.max_rank, len(self.segments)
        shrunk = F.linear(x, self.a[:kr].view(kr * g, -1)).view(n, kr, g) * batch.masks[n].unsqueeze(-1)
        if g == 1:
            return y.addmm_(shrunk.view(n, kr), self.b[0][:kr])
        for i, (_, offset, size) in enumerate(self.segments):
            y[:, offset : offset + size].addmm_(shrunk[:, :, i], self.b[i][:kr])
        return y


class LoRAModel:
    """The model's adapter slots: LoRALinear on every q/k/v/o/gate/up/down projection, loaded per slot, and the
    step's per-token slot selection (set_batch)."""

    def __init__(self, model: nn.Module, max_loras: int, max_rank: int, dtype: torch.dtype, device: torch.device):
        self.max_loras, self.max_rank, self.dtype, self.device = max_loras, max_rank, dtype, device
        self.batch: LoRABatch | None = None
        self.targets: dict[tuple[int, str], tuple[LoRALinear, int]] = {}
        for i, layer in enumerate(model.layers):
            attn, mlp = layer.self_attn, layer.mlp
            for linear, names in (
                (attn.qkv_proj, ("q_proj", "k_proj", "v_proj")),
                (attn.o_proj, ("o_proj",)),
                (mlp.gate_up_proj, ("gate_proj", "up_proj")),
                (mlp.down_proj, ("down_proj",)),
            ):
                linear.lora = LoRALinear(self, linear, _segments(linear), linear.weight.shape[1])
                for seg, name in enumerate(names):
                    self.targets[(i, name)] = (linear.lora, seg)

    def load(self, slot: int, adapter: Adapter) -> None:
        for lora in {id(t[0]): t[0] for t in self.targets.values()}.values():
            lora.clear(slot)
        for key, (a, b) in adapter.weights.items():
            lora, segment = self.targets[key]
            lora.set(slot, segment, a, b, adapter.scale)

    def set_batch(self, token_slots: np.ndarray, keep: torch.Tensor | None) -> None:
        """token_slots: each row's slot (-1: base), padding rows included; keep: the rows the last layer runs."""
        k = int(token_slots.max(initial=-1)) + 1
        if k == 0:
            self.batch = None
            return
        rows = np.flatnonzero(token_slots >= 0)
        mask = np.zeros((len(token_slots), k, self.max_rank), dtype=np.float32)
        mask[rows, token_slots[rows]] = 1.0
        full = torch.from_numpy(mask.reshape(len(token_slots), -1)).to(self.device, self.dtype)
        masks = {len(token_slots): full}
        if keep is not None:
            masks[len(keep)] = full[keep]
        self.batch = LoRABatch(masks, k)


def _segments(linear: nn.Module) -> list[tuple[object, int, int]]:
    """(shard id for the linear's weight_loader, offset, size) of each output part on this rank."""
    if isinstance(linear, QKVParallelLinear):
        q, kv = linear.num_heads * linear.head_dim, linear.num_kv_heads * linear.head_dim
        return [("q", 0, q), ("k", q, kv), ("v", q + kv, kv)]
    if isinstance(linear, ColumnParallelLinear) and hasattr(linear, "output_sizes"):
        per = [size // linear.tp_size for size in linear.output_sizes]
        return [(i, sum(per[:i]), size) for i, size in enumerate(per)]
    return [(None, 0, linear.weight.shape[0])]
