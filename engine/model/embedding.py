import torch
import torch.nn.functional as F
from torch import nn

from conveyor.engine.model.linear import matmul
from conveyor.engine.model.parallel import all_reduce, divide, gather_to_rank0, tp_rank, tp_size


class VocabParallelEmbedding(nn.Module):
    """Embedding table split along the vocabulary; each rank embeds the ids it owns."""

    def __init__(self, vocab_size: int, hidden_size: int) -> None:
        super().__init__()
        self.tp_rank, self.tp_size = tp_rank(), tp_size()
        self.per_rank = divide(vocab_size, self.tp_size, "vocab_size")
        self.start = self.tp_rank * self.per_rank
        self.weight = nn.Parameter(torch.empty(self.per_rank, hidden_size), requires_grad=False)
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded, shard_id: object = None) -> None:
        param.data.copy_(loaded[self.start : self.start + self.per_rank])

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.start
        owned = (local >= 0) & (local < self.per_rank)
        y = F.embedding(local.clamp(0, self.per_rank - 1), self.weight) * owned.unsqueeze(-1)
        return all_reduce(y)


class ParallelLMHead(VocabParallelEmbedding):
    """Output projection over the sharded vocabulary; full logits are assembled on rank 0."""

    packable, packed = True, None

    def forward(self, hidden: torch.Tensor) -> torch.Tensor | None:
        return gather_to_rank0(matmul(hidden, self.weight, self.packed), dim=-1)
