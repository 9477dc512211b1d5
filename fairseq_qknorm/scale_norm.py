"""ScaleNorm (Nguyen & Salazar, 2019, "Transformers without Tears"): g * x / ||x||, one learned
scalar g initialized to sqrt(d). The paper's baseline uses it where the QKNorm system uses LayerNorm."""

import math

import torch
from torch import nn


class ScaleNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.scale = nn.Parameter(torch.tensor(math.sqrt(dim)))
        self.eps = eps

    def forward(self, x):
        norm = x.float().norm(dim=-1, keepdim=True).clamp(min=self.eps)
        return (x.float() * (self.scale / norm)).type_as(x)


def use_scale_norm(module: nn.Module, names) -> None:
    """Replace the LayerNorms module.<name> (where present) by ScaleNorms of the same width."""
    for name in names:
        norm = getattr(module, name, None)
        if isinstance(norm, nn.LayerNorm):
            setattr(module, name, ScaleNorm(norm.normalized_shape[-1]))
