"""Multi-LoRA over a flat packed batch: `max_loras` resident slots, each projection's A and B stacked over them,
applied in one pass to a step whose tokens each name a slot (-1: the base model).

Gather-based (S-LoRA/punica SGMV): set_batch sorts the step's adapter rows by slot once (LoRAPlan: the rows of
each used slot as one segment); per projection the shrink multiplies each segment's rows by its slot's A and the
expand adds their product with its B into those rows of the base output, so the cost follows the tokens on an
adapter times the rank, whatever the slots. On CPU one batched matmul each over the segments padded to the
longest (padding rows contribute zero); on CUDA the Triton kernels of kernels/triton_ops.py (lora_shrink,
lora_expand). Ranks below max_lora_rank are zero-padded; the scale is folded into B.
Storage per slot: A [g * R, in] (segment i's rows at i*R), B [g * R, out] block-diagonal (segment i's rows feed
its output columns only), g the projection's output segments (q/k/v, gate/up, or one).
TP: A is replicated and B split like the base weight for column-parallel layers; A split along the input and B
replicated for row-parallel ones, whose partial sums meet in the base layer's all-reduce."""

from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from conveyor.engine.checkpoints.lora import Adapter
from conveyor.engine.model.linear import ColumnParallelLinear, QKVParallelLinear, RowParallelLinear


@dataclass
class LoRAPlan:
    """One row count's selection. rows: the adapter rows sorted by slot, starts [segments + 1] their segment
    bounds, slots each segment's slot, max_len the longest segment (CUDA kernels). padded [segments * max_len]:
    the rows laid out one segment per max_len block, valid [segments, max_len, 1] 1 on real rows (CPU path)."""

    rows: torch.Tensor
    starts: torch.Tensor
    slots: torch.Tensor
    max_len: int
    padded: torch.Tensor | None
    valid: torch.Tensor | None
    all_slots: bool  # slots are 0..segments-1: the stacks are sliced, not gathered


@dataclass
class LoRABatch:
    """This step's plans by row count: the step's rows, and the sampled rows the last layer keeps (None: no kept
    row names a slot, e.g. a step that samples nothing)."""

    plans: dict[int, LoRAPlan | None]


class LoRALinear:
    """The stacked adapters of one linear: its output segments (q/k/v, gate/up, or one)."""

    def __init__(
        self, owner: "LoRAModel", linear: nn.Module, segments: list[tuple[object, int, int]], in_features: int
    ) -> None:
        self.owner, self.linear, self.segments = owner, linear, segments
        s, r, g, dt, dev = owner.max_loras, owner.max_rank, len(segments), owner.dtype, owner.device
        out = sum(size for _, _, size in segments)
        self.a = torch.zeros(s, g * r, in_features, dtype=dt, device=dev)
        self.b = torch.zeros(s, g * r, out, dtype=dt, device=dev)
        self.bounds = torch.tensor([off for _, off, _ in segments] + [out], dtype=torch.int32, device=dev)
        self.widest = max(size for _, _, size in segments)
        self.row_parallel = isinstance(linear, RowParallelLinear)

    def clear(self, slot: int) -> None:
        self.a[slot] = 0
        self.b[slot] = 0

    def set(self, slot: int, segment: int, a: torch.Tensor, b: torch.Tensor, scale: float) -> None:
        """a [r, in], b [out, r] in full (unsharded); this rank keeps its part as the base weight does."""
        r, R = a.shape[0], self.owner.max_rank
        shard_id, offset, size = self.segments[segment]
        if self.row_parallel:
            local = torch.empty(r, self.a.shape[2], dtype=a.dtype)
            self.linear.weight_loader(local, a, shard_id)
            a_local, b_local = local, b.T * scale
        else:
            local = torch.empty(self.linear.output_size_per_rank, r, dtype=b.dtype)
            self.linear.weight_loader(local, b, shard_id)
            a_local, b_local = a, local[offset : offset + size].T * scale
        self.a[slot, segment * R : segment * R + r] = a_local.to(self.a)
        self.b[slot, segment * R : segment * R + r, offset : offset + size] = b_local.to(self.b)

    def __call__(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        batch = self.owner.batch
        if batch is None:
            return y
        plan = batch.plans[x.shape[0]]
        if plan is None:
            return y
        if x.is_cuda:
            from conveyor.kernels.triton_ops import lora_expand, lora_shrink

            shrunk = lora_shrink(x, self.a, plan.rows, plan.starts, plan.slots, plan.max_len, self.owner.max_rank)
            return lora_expand(
                shrunk, self.b, y, plan.rows, plan.starts, plan.slots, plan.max_len, self.bounds, self.widest
            )
        return apply_gathered(x, y, self.a, self.b, plan)


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
        if token_slots.max(initial=-1) < 0:
            self.batch = None
            return
        plans = {len(token_slots): make_plan(token_slots, self.device, self.dtype, self.max_rank)}
        if keep is not None:
            kept = token_slots[keep.cpu().numpy()]
            plans[len(keep)] = (
                make_plan(kept, self.device, self.dtype, self.max_rank) if kept.max(initial=-1) >= 0 else None
            )
        self.batch = LoRABatch(plans)


def make_plan(token_slots: np.ndarray, device: torch.device, dtype: torch.dtype, max_rank: int) -> LoRAPlan:
    """The plan of rows whose slots are token_slots (-1: base); at least one row names a slot."""
    order = np.argsort(token_slots, kind="stable")
    order = order[token_slots[order] >= 0]
    slots, counts = np.unique(token_slots[order], return_counts=True)
    starts = np.concatenate(([0], np.cumsum(counts)))
    max_len = int(counts.max())
    padded = valid = None
    if device.type != "cuda":
        pos = np.arange(max_len)
        real = pos[None, :] < counts[:, None]
        padded_np = np.where(real, order[np.minimum(starts[:-1, None] + pos[None, :], len(order) - 1)], 0)
        padded = torch.from_numpy(padded_np.reshape(-1)).to(device)
        valid = torch.from_numpy(real[:, :, None]).to(device, dtype)
    return LoRAPlan(
        torch.from_numpy(order.astype(np.int32)).to(device),
        torch.from_numpy(starts.astype(np.int32)).to(device),
        torch.from_numpy(slots.astype(np.int64)).to(device),
        max_len,
        padded,
        valid,
        bool(slots[-1] == len(slots) - 1),
    )


def apply_gathered(x: torch.Tensor, y: torch.Tensor, a: torch.Tensor, b: torch.Tensor, plan: LoRAPlan) -> torch.Tensor:
    """The torch path: y += each adapter row's x @ A[slot].T @ B[slot], a [S, g*R, in], b [S, g*R, out] stacked
    by slot; one batched shrink and expand over the plan's segments padded to the longest. Returns y."""
    k = len(plan.slots)
    a, b = (a[:k], b[:k]) if plan.all_slots else (a[plan.slots], b[plan.slots])
    xs = x.index_select(0, plan.padded).view(k, plan.max_len, -1)
    shrunk = torch.bmm(xs, a.transpose(1, 2)).mul_(plan.valid)
    return y.index_add_(0, plan.padded, torch.bmm(shrunk, b).view(-1, y.shape[1]))


def _segments(linear: nn.Module) -> list[tuple[object, int, int]]:
    """(shard id for the linear's weight_loader, offset, size) of each output part on this rank."""
    if isinstance(linear, QKVParallelLinear):
        q, kv = linear.num_heads * linear.head_dim, linear.num_kv_heads * linear.head_dim
        return [("q", 0, q), ("k", q, kv), ("v", q + kv, kv)]
    if isinstance(linear, ColumnParallelLinear) and hasattr(linear, "output_sizes"):
        per = [size // linear.tp_size for size in linear.output_sizes]
        return [(i, sum(per[:i]), size) for i, size in enumerate(per)]
    return [(None, 0, linear.weight.shape[0])]
