"""Small building blocks shared by the models: stochastic depth, LayerScale, the MLP and its activations, norms."""

from __future__ import annotations

import torch
from torch import nn


class DropPath(nn.Module):
    """Stochastic depth: drops a residual branch for a whole sample, rescaling the kept ones (timm's DropPath)."""

    def __init__(self, p: float = 0.0):
        super().__init__()
        self.p = p

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.p == 0.0 or not self.training:
            return x
        keep = 1.0 - self.p
        mask = x.new_empty((x.shape[0],) + (1,) * (x.ndim - 1)).bernoulli_(keep)
        return x * mask / keep

    def extra_repr(self) -> str:
        return f"p={self.p}"


class LayerScale(nn.Module):
    """Per-channel learnable scale of a residual branch (CaiT / DeiT-III), initialised small."""

    def __init__(self, dim: int, init_value: float):
        super().__init__()
        self.gamma = nn.Parameter(torch.full((dim,), float(init_value)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.gamma


class ReluSquared(nn.Module):
    """relu(x)^2, nanochat's MLP activation (from the Primer paper)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(x).square()


ACTIVATIONS = {"gelu": nn.GELU, "relu2": ReluSquared}


def make_norm(kind: str, dim: int, eps: float = 1e-5, bias: bool = True) -> nn.Module:
    """``layernorm`` (affine, optional bias) or ``rmsnorm`` (nanochat's: no parameters, eps the dtype's epsilon)."""
    if kind == "rmsnorm":
        return nn.RMSNorm(dim, eps=None, elementwise_affine=False)
    return nn.LayerNorm(dim, eps=eps, bias=bias)


class Mlp(nn.Module):
    def __init__(self, dim: int, hidden: int, bias: bool = True, act: str = "gelu"):
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden, bias=bias)
        self.act = ACTIVATIONS[act]()
        self.fc2 = nn.Linear(hidden, dim, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))
