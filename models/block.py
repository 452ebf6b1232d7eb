"""The pre-norm Transformer block shared by the ViT and the GPT; its token mixer is pluggable."""

from __future__ import annotations

import torch
from torch import nn

from models.layers import DropPath, LayerScale, Mlp


class Block(nn.Module):
    """x + DropPath(LayerScale(mixer(norm(x)))), then the same around the MLP."""

    def __init__(
        self,
        dim: int,
        mixer: nn.Module,
        mlp_ratio: float = 4.0,
        drop_path: float = 0.0,
        layer_scale_init: float = 0.0,
        bias: bool = True,
        norm_eps: float = 1e-5,
    ):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim, eps=norm_eps, bias=bias)
        self.mixer = mixer
        self.ls1 = LayerScale(dim, layer_scale_init) if layer_scale_init > 0 else nn.Identity()
        self.drop_path1 = DropPath(drop_path)
        self.norm2 = nn.LayerNorm(dim, eps=norm_eps, bias=bias)
        self.mlp = Mlp(dim, int(dim * mlp_ratio), bias=bias)
        self.ls2 = LayerScale(dim, layer_scale_init) if layer_scale_init > 0 else nn.Identity()
        self.drop_path2 = DropPath(drop_path)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.drop_path1(self.ls1(self.mixer(self.norm1(x))))
        return x + self.drop_path2(self.ls2(self.mlp(self.norm2(x))))
