"""A DeiT-III-style Vision Transformer with Laplacian heads.

Patch embedding, a class token, learned position embeddings (on the patches; the class token carries none, as in
DeiT-III, or one too with ``class_pos_embed``, as in DINO), pre-norm blocks with LayerScale and stochastic depth, a
final norm and a linear classifier reading the class token (or the mean of the patch tokens with ``pool="mean"``).

The defaults are DeiT III's (facebookresearch/deit, models_v2.py): LayerNorm eps 1e-6 in every norm (:325), LayerScale
initialised to 1e-4 on both branches (:182, :77-78), and the same stochastic-depth rate in every block (:200).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from models.base import MixerModel, ModelOutput
from models.checks import check_bool, check_choice, check_int, check_number
from models.config import TransformerConfig
from models.errors import ConfigError
from models.mixers import build_blocks


@dataclass
class ViTConfig(TransformerConfig):
    image_size: int = 32
    patch_size: int = 4
    in_chans: int = 3
    num_classes: int = 10
    qkv_bias: bool = True
    pool: str = "cls"
    layer_scale_init: float = 1e-4
    norm_eps: float = 1e-6  # every LayerNorm (DeiT III); PyTorch's default is 1e-5
    drop_path_by_depth: str = "uniform"  # "uniform": drop_path in every block (DeiT III); "linear": 0 -> drop_path
    # A learned position embedding for the class token too, stored as DINO's and timm's ViT store it: one pos_embed
    # over 1 + P tokens, the class token's first (one tensor to DINO's per-parameter gradient clipping, as there).
    # DeiT III adds position embeddings to the patches only.
    class_pos_embed: bool = False

    def __post_init__(self):
        check_int("image_size", self.image_size, low=1)
        check_int("patch_size", self.patch_size, low=1, high=self.image_size)
        if self.image_size % self.patch_size:
            raise ConfigError("patch_size", f"must divide image_size ({self.image_size}); got {self.patch_size}")
        check_int("in_chans", self.in_chans, low=1)
        check_int("num_classes", self.num_classes, low=2)
        check_choice("pool", self.pool, ("cls", "mean"))
        check_number("layer_scale_init", self.layer_scale_init, low=0.0)
        check_number("norm_eps", self.norm_eps, low=0.0, low_open=True)
        check_choice("drop_path_by_depth", self.drop_path_by_depth, ("uniform", "linear"))
        check_bool("class_pos_embed", self.class_pos_embed)
        super().__post_init__()

    @property
    def num_patches(self) -> int:
        return (self.image_size // self.patch_size) ** 2


class ViT(MixerModel):
    def __init__(self, config: ViTConfig):
        super().__init__()
        self.config = c = config
        self.patch_embed = nn.Conv2d(c.in_chans, c.dim, kernel_size=c.patch_size, stride=c.patch_size)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, c.dim))
        self.pos_embed = nn.Parameter(torch.zeros(1, int(c.class_pos_embed) + c.num_patches, c.dim))
        self.mixer_kinds = c.mixer_kinds
        self.blocks = build_blocks(c, causal=False, seq_len=c.num_patches + 1, proj_bias=True, rope=None,
                                   drop_path_by_depth=c.drop_path_by_depth, layer_scale_init=c.layer_scale_init,
                                   norm_eps=c.norm_eps)
        self.norm = nn.LayerNorm(c.dim, eps=c.norm_eps)
        self.head = nn.Linear(c.dim, c.num_classes)
        self.apply(_init_weights)
        nn.init.trunc_normal_(self.pos_embed, std=0.02)
        nn.init.trunc_normal_(self.cls_token, std=0.02)

    def forward(self, images: torch.Tensor, return_features: bool = False):
        """images (B, C, H, W) -> logits (B, num_classes), or ModelOutput with the last-layer tokens (B, 1 + P, d)
        after the final norm and the feature (B, d) the classifier reads."""
        x = self.patch_embed(images)  # (B, d, H / patch, W / patch)
        x = x.flatten(2).transpose(1, 2) + self.position_embedding(*x.shape[-2:])  # (B, P, d)
        cls = self.cls_token + self.pos_embed[:, :1] if self.config.class_pos_embed else self.cls_token
        x = torch.cat((cls.expand(x.shape[0], -1, -1), x), dim=1)
        for block in self.blocks:
            x = block(x)
        tokens = self.norm(x)
        feature = self.pool(tokens)
        logits = self.head(feature)
        return ModelOutput(logits, tokens, feature) if return_features else logits

    def position_embedding(self, grid_h: int, grid_w: int) -> torch.Tensor:
        """Position embeddings (1, grid_h * grid_w, d) of a grid_h x grid_w patch grid: the learned ones at the
        configured image size, else those resized bicubically as DINO does for its 96-pixel local crops
        (facebookresearch/dino vision_transformer.py:174-194): torch's bicubic interpolation with a scale factor of
        (grid + 0.1) / side, the 0.1 keeping floor(side * scale) from falling one short (:184-186). The class token's
        embedding (`class_pos_embed`, pos_embed's first row) is not part of it and kept as it is, as DINO keeps it."""
        side = self.config.image_size // self.config.patch_size
        patches = self.pos_embed[:, 1:] if self.config.class_pos_embed else self.pos_embed  # (1, side * side, d)
        if (grid_h, grid_w) == (side, side):
            return patches
        dim = patches.shape[-1]
        grid = patches.reshape(1, side, side, dim).permute(0, 3, 1, 2)  # (1, d, side, side)
        resized = nn.functional.interpolate(
            grid, scale_factor=((grid_h + 0.1) / side, (grid_w + 0.1) / side), mode="bicubic"
        )  # (1, d, grid_h, grid_w)
        return resized.permute(0, 2, 3, 1).reshape(1, grid_h * grid_w, dim)

    def pool(self, tokens: torch.Tensor) -> torch.Tensor:
        """What the classifier reads of tokens (B, 1 + P, d): the class token, or the mean of the patch tokens."""
        return tokens[:, 0] if self.config.pool == "cls" else tokens[:, 1:].mean(dim=1)

    @property
    def classifier_weight(self) -> torch.Tensor:
        return self.head.weight

    @property
    def classifier_bias(self) -> torch.Tensor:
        return self.head.bias

    def no_weight_decay(self) -> set[str]:
        return {"pos_embed", "cls_token"}  # DeiT III's models_v2.py:229-231


def _init_weights(module: nn.Module) -> None:
    if isinstance(module, nn.Linear):
        nn.init.trunc_normal_(module.weight, std=0.02)
        if module.bias is not None:
            nn.init.zeros_(module.bias)
    elif isinstance(module, nn.LayerNorm):
        nn.init.ones_(module.weight)
        if module.bias is not None:
            nn.init.zeros_(module.bias)
