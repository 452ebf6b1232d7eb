"""A linear probe on frozen features (DINO's eval_linear.py): a later stage of a self-supervised run, classifying
images from the class tokens of the last blocks of the backbone the stage before it trained. Only the linear layer
trains; its accuracy is how good the frozen features are."""

from __future__ import annotations

import torch
from pydantic import Field
from torch import nn

from models.base import ModelOutput
from models.probes import LinearClassifier, class_token_dim, class_token_features
from study.schema import StrictModel
from study.tasks.classification import Classification
from study.tasks.frozen import FrozenBackbone, carried_backbone


class ProbeOptions(StrictModel):
    probe_blocks: int = Field(4, ge=1, description="class tokens of this many last blocks, concatenated (DINO's "
                                                   "n_last_blocks: 4 for ViT-S, 1 for ViT-B)")
    probe_avgpool: bool = Field(False, description="also the mean of the last block's patch tokens (ViT-B)")


class FrozenBackboneProbe(FrozenBackbone):
    """The frozen backbone and a linear classifier on its class tokens."""

    def __init__(self, backbone: nn.Module, num_classes: int, blocks: int, avgpool: bool):
        super().__init__(backbone)
        self.blocks_read, self.avgpool = blocks, avgpool
        self.classifier = LinearClassifier(class_token_dim(backbone.config.dim, blocks, avgpool), num_classes)

    def forward(self, images: torch.Tensor, return_features: bool = False):
        outputs = self.layer_outputs_of(images)
        feature = class_token_features(outputs, self.blocks_read, self.avgpool)
        logits = self.classifier(feature)
        return ModelOutput(logits, outputs[-1], feature) if return_features else logits

    @property
    def classifier_weight(self) -> torch.Tensor:
        return self.classifier.linear.weight

    @property
    def classifier_bias(self) -> torch.Tensor:
        return self.classifier.linear.bias


class LinearProbe(Classification):
    name = "linear_probe"
    options = ProbeOptions
    data_sets = frozenset({"num_classes"})
    carried_sets = frozenset({"image_size"})

    @classmethod
    def build_model(cls, resolved, carried):
        """The backbone the previous stage carried forward (its classifier head, of another data's classes, left
        out), frozen, under a new linear classifier for this stage's classes."""
        option = resolved.options
        return FrozenBackboneProbe(carried_backbone(resolved.config, carried), resolved.model["num_classes"],
                                   option.probe_blocks, option.probe_avgpool)

    def carry(self) -> dict:
        return self.model.backbone.state_dict()
