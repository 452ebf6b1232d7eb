"""A frozen backbone under a trained head: what the probes of a self-supervised run train (a linear classifier on
class tokens, a linear segmentation head on patch tokens). The backbone is the one the stage before carried forward;
it never trains (no gradients, always in evaluation mode)."""

from __future__ import annotations

import torch
from torch import nn

import models
from study.tasks.base import load_carried


def carried_backbone(model_config, carried: dict | None) -> nn.Module:
    """The backbone of `model_config` (what `models.build_config` built) with the carried weights (its classifier
    head, of another data's classes, left out: the backbone's own fresh head stays, unused)."""
    backbone = models.build_model(model_config)
    if carried is not None:
        own = backbone.state_dict()
        load_carried(backbone, {k: v for k, v in carried.items() if not k.startswith("head.")}
                     | {k: own[k] for k in own if k.startswith("head.")})
    return backbone


class FrozenBackbone(nn.Module):
    """The frozen `backbone`; a subclass adds the head that trains. It offers what the training loop and the
    geometry read of a model."""

    def __init__(self, backbone: nn.Module):
        super().__init__()
        self.backbone, self.config = backbone.requires_grad_(False), backbone.config

    def train(self, mode: bool = True):
        super().train(mode)
        self.backbone.eval()  # frozen: dropout and drop path stay off, as in DINO's eval_linear.py
        return self

    def layer_outputs_of(self, images: torch.Tensor) -> list[torch.Tensor]:
        """Every block's output through the final norm (models/base.py's layer_outputs), without gradients. Colour
        images for a backbone trained on one channel are read as their channel mean (its grey level)."""
        if images.shape[1] != self.config.in_chans and self.config.in_chans == 1:
            images = images.mean(dim=1, keepdim=True)
        with torch.no_grad(), self.backbone.layer_outputs() as outputs:
            self.backbone(images)
        return outputs

    @property
    def blocks(self):
        return self.backbone.blocks

    @property
    def norm(self):
        return self.backbone.norm

    def layer_outputs(self):
        return self.backbone.layer_outputs()

    def pool(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.backbone.pool(tokens)

    def param_groups(self, weight_decay: float, slow_lr_scale: float = 1.0) -> list[dict]:
        trained = [p for p in self.parameters() if p.requires_grad]
        return [{"params": trained, "weight_decay": weight_decay, "lr_scale": 1.0}]

    def set_training_step(self, step: int, total_steps: int) -> None:
        """Nothing trains but the head: the backbone's schedules stay where its own training left them."""

    def regularization_loss(self) -> torch.Tensor:
        return torch.zeros((), device=next(self.parameters()).device)

    def mixer_stats(self) -> dict[str, float]:
        return {}
