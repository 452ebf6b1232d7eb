"""The tasks' evaluation against the definitions, in one process: accuracy and loss by plain torch, the geometry of
every layer by models.geometry's in-memory definitions on tokens computed block by block."""

from __future__ import annotations

from contextlib import nullcontext

import pytest
import torch
import torch.nn.functional as F

import models
from models.geometry import language_collapse, neural_collapse, variance_decomposition
from study.tasks import GeometrySpec, task_class
from study.worker import Worker

WORKER = Worker(0, 1, torch.device("cpu"))


def _layer_tokens(model, x: torch.Tensor, embed) -> list[torch.Tensor]:
    """Each block's output through the final norm, by running the blocks one after the other."""
    outputs, h = [], embed(x)
    for block in model.blocks:
        h = block(h)
        outputs.append(model.norm(h))
    return outputs


def _vit_embed(model):
    def embed(images):
        x = model.patch_embed(images).flatten(2).transpose(1, 2) + model.pos_embed
        return torch.cat((model.cls_token.expand(x.shape[0], -1, -1), x), dim=1)
    return embed


def test_classification_evaluation_and_every_layers_geometry():
    torch.manual_seed(0)
    model = models.build_model({"preset": "vit_tiny_digits", "k": 2, "depth": 3}).double().eval()
    batches = [{"image": torch.randn(24, 1, 8, 8, dtype=torch.float64), "label": torch.arange(24) % 5}
               for _ in range(3)]
    task = task_class("classification")(model, WORKER, seed=0, geometry=GeometrySpec(pca_points=50))
    evaluation = task.evaluate(batches, autocast=nullcontext(), geometry=True)
    images, labels = torch.cat([b["image"] for b in batches]), torch.cat([b["label"] for b in batches])
    with torch.no_grad():
        logits = model(images)
        layers = _layer_tokens(model, images, _vit_embed(model))
    metrics = evaluation.metrics
    assert metrics["val_acc"] == pytest.approx((logits.argmax(1) == labels).double().mean().item(), abs=1e-12)
    assert metrics["val_loss"] == pytest.approx(F.cross_entropy(logits, labels).item(), rel=1e-6)  # float32 logits
    for layer, tokens in enumerate(layers):
        truth = {**variance_decomposition(tokens, labels),
                 **neural_collapse(tokens[:, 0], labels, model.classifier_weight)}
        for name in ("within_seq_var", "within_class_var", "between_class_var", "between_class_frac", "nc1"):
            assert metrics[f"geom_l{layer}_{name}"] == pytest.approx(truth[name], rel=1e-7), (layer, name)
    last = len(layers) - 1
    for name in ("within_seq_var", "between_class_frac", "nc1"):  # the last layer is the last-layer geometry
        assert metrics[f"geom_l{last}_{name}"] == pytest.approx(metrics[f"geom_{name}"], rel=1e-12)
    assert metrics["geom_l0_between_class_frac"] != pytest.approx(metrics["geom_between_class_frac"])


def test_language_model_evaluation_and_every_layers_geometry():
    torch.manual_seed(1)
    model = models.build_model({"preset": "gpt_tiny", "k": 1, "depth": 2}).double().eval()
    tokens = torch.randint(0, 12, (6, 17))  # a small alphabet: the top targets cover most positions
    batch = {"input_ids": tokens[:, :-1], "targets": tokens[:, 1:], "target_bytes": torch.ones(6, 16, dtype=torch.long)}
    task = task_class("language_modeling")(model, WORKER, seed=0, geometry=GeometrySpec(top_targets=5,
                                                                                        pca_points=50))
    task.setup(lambda: [batch])
    evaluation = task.evaluate([batch], autocast=nullcontext(), geometry=True)
    with torch.no_grad():
        logits = model(batch["input_ids"])
        layers = _layer_tokens(model, batch["input_ids"], model.wte)
    loss = F.cross_entropy(logits.flatten(0, 1), batch["targets"].flatten()).item()
    assert evaluation.metrics["val_loss"] == pytest.approx(loss, rel=1e-6)  # summed in float32 logits
    assert evaluation.metrics["val_bpb"] == pytest.approx(loss / torch.log(torch.tensor(2.0)).item(), rel=1e-6)
    for layer, layer_tokens in enumerate(layers):
        truth = language_collapse(layer_tokens, batch["targets"], top_k=5)
        for name in ("within_target_var", "between_target_var", "between_target_frac", "target_nc1"):
            assert evaluation.metrics[f"geom_l{layer}_{name}"] == pytest.approx(truth[name], rel=1e-7), (layer, name)


def test_bce_loss_is_deit3s_binary_cross_entropy_on_the_mixed_targets():
    """DeiT III (facebookresearch/deit engine.py): after Mixup/CutMix, targets = targets.gt(0.0), then
    BCEWithLogitsLoss: the mean over batch and classes of the binary cross-entropy, written out here."""
    torch.manual_seed(2)
    model = models.build_model({"preset": "vit_tiny_digits", "depth": 1}).double()
    images = torch.randn(6, 1, 8, 8, dtype=torch.float64)
    mixed = torch.zeros(6, 10, dtype=torch.float64)
    mixed[torch.arange(6), torch.arange(6)] = 0.7
    mixed[torch.arange(6), (torch.arange(6) + 3) % 10] = 0.3
    task = task_class("classification")(model, WORKER, seed=0, geometry=GeometrySpec(), loss="bce")
    loss = task.loss(model, {"image": images, "label": torch.arange(6), "soft_label": mixed})
    p = torch.sigmoid(model(images).float()).double()
    positive = (mixed > 0).double()
    expected = -(positive * torch.log(p) + (1 - positive) * torch.log(1 - p)).mean()
    assert loss.item() == pytest.approx(expected.item(), rel=1e-5)
    plain = task.loss(model, {"image": images, "label": torch.arange(6)})  # no mixing: the one-hot label
    positive = torch.nn.functional.one_hot(torch.arange(6), 10).double()
    expected = -(positive * torch.log(p) + (1 - positive) * torch.log(1 - p)).mean()
    assert plain.item() == pytest.approx(expected.item(), rel=1e-5)
