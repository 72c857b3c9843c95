from types import ModuleType

import torch
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float, fused: ModuleType | None = None) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(size), requires_grad=False)
        self.fused = fused if size % 16 == 0 else None

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if self.fused is not None and x.is_contiguous():
            if residual is None:
                x = x.clone()
            self.fused.rms_norm_(x, residual, self.weight, self.eps)  # in place: both are this step's own
            return x if residual is None else (x, residual)
        if residual is not None:
            x = x + residual
            residual = x
        dtype = x.dtype
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        y = self.weight * xf.to(dtype)
        return y if residual is None else (y, residual)
