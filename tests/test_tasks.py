"""The tasks' evaluation against the definitions, in one process: accuracy and loss by plain torch, the geometry of
every layer by models.geometry's in-memory definitions on tokens computed block by block."""

from __future__ import annotations

from contextlib import nullcontext

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import models
from models.geometry import (
    language_collapse,
    neural_collapse,
    patch_pca_rgb,
    patch_spectral_decay,
    variance_decomposition,
)
from study.runspec import resolve
from study.tasks import GeometrySpec, task_class
from study.worker import Worker

WORKER = Worker(0, 1, torch.device("cpu"))


def _resolved(task: str, hyperparameters: dict | None = None):
    """A stage's resolved hyperparameters, as the training loop hands them to a task."""
    return resolve(hyperparameters or {}, task, {}, epochs=1)


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
    task = task_class("classification")(model, WORKER, seed=0, geometry=GeometrySpec(pca_points=50),
                                        resolved=_resolved("classification"))
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


class ValidationOnly:
    """What the loop hands a task's setup (study/loop.py EvalSplits) when the data has one evaluated split."""

    names = ("val",)

    def __init__(self, batches):
        self.batches = batches

    def __call__(self, split="val"):
        return iter(self.batches)


def test_language_model_evaluation_and_every_layers_geometry():
    torch.manual_seed(1)
    model = models.build_model({"preset": "gpt_tiny", "k": 1, "depth": 2}).double().eval()
    tokens = torch.randint(0, 12, (6, 17))  # a small alphabet: the top targets cover most positions
    batch = {"input_ids": tokens[:, :-1], "targets": tokens[:, 1:], "target_bytes": torch.ones(6, 16, dtype=torch.long)}
    task = task_class("language_modeling")(model, WORKER, seed=0, resolved=_resolved("language_modeling"),
                                           geometry=GeometrySpec(top_targets=5, pca_points=50))
    task.setup(ValidationOnly([batch]))
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
    task = task_class("classification")(model, WORKER, seed=0, geometry=GeometrySpec(),
                                        resolved=_resolved("classification", {"loss": "bce"}))
    loss = task.loss(model, {"image": images, "label": torch.arange(6), "soft_label": mixed})
    p = torch.sigmoid(model(images).float()).double()
    positive = (mixed > 0).double()
    expected = -(positive * torch.log(p) + (1 - positive) * torch.log(1 - p)).mean()
    assert loss.item() == pytest.approx(expected.item(), rel=1e-5)
    plain = task.loss(model, {"image": images, "label": torch.arange(6)})  # no mixing: the one-hot label
    positive = torch.nn.functional.one_hot(torch.arange(6), 10).double()
    expected = -(positive * torch.log(p) + (1 - positive) * torch.log(1 - p)).mean()
    assert plain.item() == pytest.approx(expected.item(), rel=1e-5)


def test_linear_probe_trains_only_its_classifier_on_the_carried_backbone():
    """The probe starts from the backbone the stage before carried forward (here: a ViT trained three epochs on
    digits), never changes it, and its linear layer learns to read the frozen class tokens: far above the 0.1 of
    chance, where the same probe on an untrained backbone (whose class token hardly depends on the image with
    LayerScale at 1e-4) stays near it."""
    from sklearn.datasets import load_digits

    from digits_training import train_on_digits
    from study.optim import build_optimizer, build_schedule
    from study.runspec import TrainConfig
    from study.state import TrainState
    from study.tasks import StepSettings

    config = models.resolve_config({"preset": "vit_tiny_digits", "depth": 2, "num_classes": 10})
    torch.manual_seed(0)
    trained = models.build_model(config)
    train_on_digits(trained, torch.optim.AdamW(trained.param_groups(0.05), lr=3e-3), epochs=3, target=1.0)
    digits = load_digits()
    x = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 8.0 - 1.0
    y = torch.tensor(digits.target)

    def probe_accuracy(carried):
        torch.manual_seed(1)
        resolved = _resolved("linear_probe", {**config, "probe_blocks": 1})
        probe_type = task_class("linear_probe")
        probe = probe_type.build_model(resolved, carried)
        train = TrainConfig(lr=0.05, weight_decay=0.0, optimizer="sgd")
        optimizer = build_optimizer(probe, train, 1.0)
        state = TrainState(probe, probe, optimizer, build_schedule(optimizer, train, 22, 5))
        task = probe_type(probe, WORKER, seed=0, geometry=GeometrySpec(), resolved=resolved)
        before = {k: v.clone() for k, v in probe.backbone.state_dict().items()}
        for _ in range(5):
            probe.train()
            for i in range(22):
                batch = {"image": x[64 * i:64 * (i + 1)], "label": y[64 * i:64 * (i + 1)]}
                task.train_step(state, batch, StepSettings(nullcontext(), 0.0, 22, 5))
        assert all(torch.equal(before[k], v) for k, v in probe.backbone.state_dict().items()), "the backbone moved"
        assert {n for n, p in probe.named_parameters() if p.requires_grad} == {"classifier.linear.weight",
                                                                               "classifier.linear.bias"}
        evaluation = task.evaluate([{"image": x[1408:], "label": y[1408:]}], autocast=nullcontext(), geometry=True)
        assert "geom_nc1" in evaluation.metrics and "geom_l1_between_class_frac" in evaluation.metrics
        return probe, evaluation.metrics["val_acc"]

    probe, carried_accuracy = probe_accuracy(trained.state_dict())
    for name, value in probe.backbone.state_dict().items():
        if not name.startswith("head."):
            assert torch.equal(value, trained.state_dict()[name]), name
    _, untrained_accuracy = probe_accuracy(None)
    assert carried_accuracy > 0.6 and untrained_accuracy < 0.3, (carried_accuracy, untrained_accuracy)


def _dino(hyperparameters: dict | None = None):
    # LayerScale off: an untrained backbone's class token then depends on the image (with 1e-4 it hardly does)
    config = models.resolve_config({"preset": "vit_tiny_digits", "depth": 2, "num_classes": 10,
                                    "layer_scale_init": 0.0})
    resolved = _resolved("dino", {**config, "dino_out_dim": 64, "dino_momentum_teacher": 0.9,
                                  "dino_freeze_last_layer": 0, **(hyperparameters or {})})
    task_type = task_class("dino")
    model = task_type.build_model(resolved, None)
    return task_type, model, resolved


def test_dino_teacher_changes_only_by_the_moving_average_of_the_student():
    """No gradient ever reaches the teacher; after a step it is exactly m * teacher + (1 - m) * student (the
    student after the step), with m the momentum schedule's first value (main_dino.py:346-350)."""
    from study.optim import build_optimizer, build_schedule
    from study.runspec import TrainConfig
    from study.state import TrainState
    from study.tasks import StepSettings

    torch.manual_seed(0)
    task_type, model, resolved = _dino({"lr": 1e-3, "weight_decay": 0.04})
    train = TrainConfig(lr=1e-3, weight_decay=0.04)
    optimizer = build_optimizer(model, train, 1.0)
    state = TrainState(model, model, optimizer, build_schedule(optimizer, train, 4, 2))
    task = task_type(model, WORKER, seed=0, geometry=GeometrySpec(), resolved=resolved)
    assert not any(p.requires_grad for p in model.teacher.parameters())
    teacher_before = [p.clone() for p in model.teacher.parameters()]
    crops = [torch.randn(6, 1, 8, 8) for _ in range(2)] + [torch.randn(6, 1, 4, 4) for _ in range(3)]
    loss = task.train_step(state, {"crops": crops, "label": torch.arange(6)}, StepSettings(nullcontext(), 3.0, 4, 2))
    assert torch.isfinite(loss) and loss.item() > 0
    assert all(p.grad is None for p in model.teacher.parameters())
    for before, teacher, student in zip(teacher_before, model.teacher.parameters(), model.student.parameters()):
        torch.testing.assert_close(teacher, 0.9 * before + 0.1 * student, rtol=1e-6, atol=1e-7)
    moved = [not torch.equal(b, s) for b, s in zip(teacher_before, model.student.parameters())]
    assert any(moved)  # the student trained, so the average moved


def test_dino_knn_evaluation_is_dinos_weighted_vote():
    """knn_acc: the share of validation images whose weighted k-NN vote over the bank's teacher features, written
    out here (cosine similarity, top k, weights exp(s / T)), names their class."""
    torch.manual_seed(0)
    task_type, model, resolved = _dino({"dino_knn_k": 5})
    bank = [{"image": torch.randn(16, 1, 8, 8), "label": torch.arange(16) % 4} for _ in range(2)]
    val = [{"image": torch.randn(12, 1, 8, 8), "label": torch.arange(12) % 4}]
    task = task_type(model, WORKER, seed=0, geometry=GeometrySpec(pca_points=20), resolved=resolved)
    task.setup(lambda split: bank if split == "bank" else val)
    evaluation = task.evaluate(val, autocast=nullcontext(), geometry=True)
    backbone = model.teacher.backbone.eval()
    with torch.no_grad():
        features = torch.nn.functional.normalize(backbone(torch.cat([b["image"] for b in bank])), dim=1)
        queries = torch.nn.functional.normalize(backbone(val[0]["image"]), dim=1)
    labels = torch.cat([b["label"] for b in bank])
    hits = 0
    for query, truth in zip(queries, val[0]["label"]):
        similarity = features @ query
        top = similarity.topk(5)
        votes = torch.zeros(10)
        for s, i in zip(top.values, top.indices):
            votes[labels[i]] += torch.exp(s / 0.07)
        hits += int(votes.argmax() == truth)
    assert evaluation.metrics["knn_acc"] == pytest.approx(hits / 12)
    assert "geom_between_class_frac" in evaluation.metrics and "geom_l0_nc1" in evaluation.metrics
    # the patch tokens' spectrum and PCA picture, of the teacher's last layer after its norm
    with torch.no_grad():
        patches = backbone(val[0]["image"], return_features=True).tokens[:, 1:]
    expected = patch_spectral_decay(patches)
    assert evaluation.metrics["geom_pcs99_per_image"] == pytest.approx(expected["pcs99_per_image"])
    assert evaluation.metrics["geom_pcs99_patches"] == expected["pcs99_patches"]
    np.testing.assert_allclose(evaluation.pictures.patch_rgb, patch_pca_rgb(patches[:8]), atol=1e-6)
    assert evaluation.pictures.images.shape == (8, 8, 8, 3)


def _shapes(seeds, size=16):
    from study.data.segmentation_sources import render_shapes

    pictures = [render_shapes(seed, size, palette="by_class") for seed in seeds]
    images = torch.tensor(np.stack([p[0] for p in pictures]), dtype=torch.float32).permute(0, 3, 1, 2) / 127.5 - 1
    return {"image": images, "mask": torch.tensor(np.stack([p[1] for p in pictures]), dtype=torch.long)}


def _segmentation_probe(carried=None):
    config = models.resolve_config({"preset": "vit_tiny_digits", "depth": 2, "num_classes": 4, "in_chans": 3,
                                    "image_size": 16, "patch_size": 4, "layer_scale_init": 0.0})
    resolved = _resolved("segmentation_probe", {**config, "seg_blocks": 2})
    task_type = task_class("segmentation_probe")
    torch.manual_seed(0)
    model = task_type.build_model(resolved, carried)
    return task_type, model, resolved


def test_segmentation_probe_scores_every_pixel_as_mmsegmentation_does():
    """val_miou and val_acc over two batches, written out: per class |pred ∩ target| / |pred ∪ target| over all
    pixels not labelled 255, summed over the batches first; classes in neither left out of the mean."""
    task_type, model, resolved = _segmentation_probe()
    batches = [_shapes(range(4)), _shapes(range(4, 10))]
    batches[1]["mask"][:, :3] = 255  # unlabelled rows
    task = task_type(model, WORKER, seed=0, geometry=GeometrySpec(pca_points=20), resolved=resolved)
    evaluation = task.evaluate(batches, autocast=nullcontext(), geometry=True)
    model.eval()
    with torch.no_grad():
        predicted = [F.interpolate(model(b["image"]), size=(16, 16), mode="bilinear").argmax(1) for b in batches]
    prediction, target = torch.cat(predicted).numpy(), torch.cat([b["mask"] for b in batches]).numpy()
    labelled = target != 255
    ious = []
    for c in range(4):
        union = ((prediction == c) | (target == c)) & labelled
        if union.any():
            ious.append((((prediction == c) & (target == c)) & labelled).sum() / union.sum())
    assert evaluation.metrics["val_miou"] == pytest.approx(np.mean(ious))
    assert evaluation.metrics["val_acc"] == pytest.approx((prediction == target)[labelled].mean())
    assert evaluation.pictures.patch_rgb.shape == (8, 4, 4, 3)
    assert {"geom_between_class_frac", "geom_pcs99_per_image", "geom_l1_nc1"} <= set(evaluation.metrics)


def test_segmentation_probe_learns_on_a_frozen_backbone():
    """Shapes whose class is their colour: the linear head on frozen patch tokens of even an untrained ViT learns to
    label them (mIoU far above its start), and the backbone never moves."""
    from study.optim import build_optimizer, build_schedule
    from study.runspec import TrainConfig
    from study.state import TrainState
    from study.tasks import StepSettings

    task_type, model, resolved = _segmentation_probe()
    train = TrainConfig(lr=0.05, weight_decay=0.0, optimizer="sgd")
    optimizer = build_optimizer(model, train, 1.0)
    state = TrainState(model, model, optimizer, build_schedule(optimizer, train, 8, 10))
    task = task_type(model, WORKER, seed=0, geometry=GeometrySpec(), resolved=resolved)
    val = [_shapes(range(1000, 1032))]
    start = task.evaluate(val, autocast=nullcontext(), geometry=False).metrics["val_miou"]
    before = {k: v.clone() for k, v in model.backbone.state_dict().items()}
    for epoch in range(10):
        model.train()
        for step in range(8):
            batch = _shapes(range(32 * step, 32 * step + 32))
            task.train_step(state, batch, StepSettings(nullcontext(), 0.0, 8, 10))
    end = task.evaluate(val, autocast=nullcontext(), geometry=False).metrics["val_miou"]
    assert all(torch.equal(before[k], v) for k, v in model.backbone.state_dict().items()), "the backbone moved"
    assert {n for n, p in model.named_parameters() if p.requires_grad} == {
        "head.norm.weight", "head.norm.bias", "head.conv_seg.weight", "head.conv_seg.bias"}
    assert end > start + 0.2 and end > 0.5, (start, end)


def test_a_stage_whose_data_reshapes_the_carried_model_is_refused_by_name():
    """A chat stage's vocabulary (the byte vocabulary plus nanochat's special tokens) after a pre-training stage
    without them: the carried model does not fit, and the error says which shape and how to make the stages agree."""
    pretrained = models.build_model({"preset": "gpt_tiny", "depth": 1, "vocab_size": 257}).state_dict()
    language_modeling = task_class("language_modeling")
    same = language_modeling.build_model(_resolved("language_modeling", {"preset": "gpt_tiny", "depth": 1,
                                                                         "vocab_size": 257}), pretrained)
    assert all(torch.equal(value, pretrained[key]) for key, value in same.state_dict().items())
    with pytest.raises(ValueError, match=r"size mismatch .*chat_tokens: true"):
        language_modeling.build_model(_resolved("language_modeling", {"preset": "gpt_tiny", "depth": 1,
                                                                      "vocab_size": 265}), pretrained)
