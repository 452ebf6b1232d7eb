"""A linear probe on frozen features (DINO's eval_linear.py): a later stage of a self-supervised run, classifying
images from the class tokens of the last blocks of the backbone the stage before it trained. Only the linear layer
trains; its accuracy is how good the frozen features are."""

from __future__ import annotations

import torch
from pydantic import BaseModel, ConfigDict, Field
from torch import nn

import models
from models.base import ModelOutput
from models.probes import LinearClassifier, class_token_dim, class_token_features
from study.tasks.classification import Classification


class ProbeOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    probe_blocks: int = Field(4, ge=1, description="class tokens of this many last blocks, concatenated (DINO's "
                                                   "n_last_blocks: 4 for ViT-S, 1 for ViT-B)")
    probe_avgpool: bool = Field(False, description="also the mean of the last block's patch tokens (ViT-B)")


class FrozenBackboneProbe(nn.Module):
    """A backbone that never trains (no gradients, always in evaluation mode) and a linear classifier on its
    features. It offers what the training loop and the classification task use of a model."""

    def __init__(self, backbone: nn.Module, num_classes: int, blocks: int, avgpool: bool):
        super().__init__()
        self.backbone, self.blocks_read, self.avgpool = backbone.requires_grad_(False), blocks, avgpool
        self.classifier = LinearClassifier(class_token_dim(backbone.config.dim, blocks, avgpool), num_classes)
        self.config = backbone.config

    def train(self, mode: bool = True):
        super().train(mode)
        self.backbone.eval()  # frozen: dropout and drop path stay off, as in eval_linear.py
        return self

    def forward(self, images: torch.Tensor, return_features: bool = False):
        with torch.no_grad(), self.backbone.layer_outputs() as outputs:
            self.backbone(images)
        feature = class_token_features(outputs, self.blocks_read, self.avgpool)
        logits = self.classifier(feature)
        return ModelOutput(logits, outputs[-1], feature) if return_features else logits

    # what the loop and the geometry read of a model
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

    @property
    def classifier_weight(self) -> torch.Tensor:
        return self.classifier.linear.weight

    @property
    def classifier_bias(self) -> torch.Tensor:
        return self.classifier.linear.bias

    def param_groups(self, weight_decay: float, slow_lr_scale: float = 1.0) -> list[dict]:
        return [{"params": list(self.classifier.parameters()), "weight_decay": weight_decay, "lr_scale": 1.0}]

    def set_training_step(self, step: int, total_steps: int) -> None:
        """Nothing trains but the classifier: the backbone's schedules stay where its own training left them."""

    def regularization_loss(self) -> torch.Tensor:
        return torch.zeros((), device=self.classifier.linear.weight.device)

    def mixer_stats(self) -> dict[str, float]:
        return {}


class LinearProbe(Classification):
    name = "linear_probe"
    options = ProbeOptions
    data_sets = frozenset({"num_classes"})
    carried_sets = frozenset({"image_size"})

    @classmethod
    def build_model(cls, model_config, hyperparameters, carried):
        """The backbone the previous stage carried forward (its classifier head, of another data's classes, left
        out), frozen, under a new linear classifier for this stage's classes."""
        backbone = models.build_model(model_config)
        if carried is not None:
            own = backbone.state_dict()
            backbone.load_state_dict({k: v for k, v in carried.items() if not k.startswith("head.")}
                                     | {k: own[k] for k in own if k.startswith("head.")})
        option = ProbeOptions(**cls.option_values(hyperparameters))
        return FrozenBackboneProbe(backbone, model_config["num_classes"], option.probe_blocks, option.probe_avgpool)

    def carry(self) -> dict:
        return self.model.backbone.state_dict()
