"""The pre-norm Transformer block shared by the ViT and the GPT; its token mixer is pluggable."""

from __future__ import annotations

import torch
from torch import nn

from models.layers import DropPath, LayerScale, Mlp, make_norm


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
        norm: str = "layernorm",
        mlp_act: str = "gelu",
    ):
        super().__init__()
        self.norm1 = make_norm(norm, dim, norm_eps, bias)
        self.mixer = mixer
        self.ls1 = LayerScale(dim, layer_scale_init) if layer_scale_init > 0 else nn.Identity()
        self.drop_path1 = DropPath(drop_path)
        self.norm2 = make_norm(norm, dim, norm_eps, bias)
        self.mlp = Mlp(dim, int(dim * mlp_ratio), bias=bias, act=mlp_act)
        self.ls2 = LayerScale(dim, layer_scale_init) if layer_scale_init > 0 else nn.Identity()
        self.drop_path2 = DropPath(drop_path)

    def forward(self, x: torch.Tensor, cache=None) -> torch.Tensor:
        """x (B, N, D) -> (B, N, D). ``cache``: the layer's decoding state (``GPT.new_cache``), which runs the mixer
        on the new positions (its ``mix``); x then holds only those."""
        mixed = self.mixer(self.norm1(x)) if cache is None else cache.mix(self.mixer, self.norm1(x))
        x = x + self.drop_path1(self.ls1(mixed))
        return x + self.drop_path2(self.ls2(self.mlp(self.norm2(x))))
