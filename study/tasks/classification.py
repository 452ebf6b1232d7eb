"""Image classification (the ViT): cross-entropy on hard or soft (Mixup/CutMix, smoothed) labels; accuracy; the
token geometry grouped by class, with neural collapse on the feature the classifier reads."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from models.geometry import GeometryAccumulator
from study.tasks.base import GeometryPictures, Task


class Classification(Task):
    name = "classification"
    model_family = "vit"
    data_kind = "images"
    input_key = "image"
    sum_names = ("loss", "samples", "correct")
    quality_metrics = ("val_acc", "val_loss")
    geometry_metrics = ("total_var", "within_seq_var", "within_class_var", "between_class_var", "between_class_frac",
                        "nc1", "nc2_equinorm", "nc2_equiangle", "nc3", "nc4", "pcs99")
    layer_geometry_metrics = ("within_seq_var", "within_class_var", "between_class_var", "between_class_frac",
                              "nc1")
    report_geometry = ("between_class_frac", "nc1", "within_seq_var")
    reads_training = frozenset({"loss"})

    def loss(self, model, batch):
        logits = model(batch["image"]).float()
        targets = batch.get("soft_label")
        if self.hyperparameters.get("loss") == "bce":
            # DeiT III (deit engine.py): every class with a share of the (mixed) target is a positive
            if targets is None:
                targets = F.one_hot(batch["label"], logits.shape[-1])
            return F.binary_cross_entropy_with_logits(logits, targets.gt(0).float())
        if targets is not None:
            return torch.sum(-targets * F.log_softmax(logits, dim=-1), dim=-1).mean()
        return F.cross_entropy(logits, batch["label"])

    def eval_sums(self, logits, batch):
        labels = batch["label"]
        return torch.stack([F.cross_entropy(logits, labels, reduction="sum").double(),
                            torch.tensor(float(len(labels)), dtype=torch.float64, device=logits.device),
                            (logits.argmax(dim=1) == labels).sum().double()])

    def eval_metrics(self, sums):
        return {"val_loss": sums["loss"] / sums["samples"], "val_acc": sums["correct"] / sums["samples"]}

    def new_accumulator(self, layer=False):
        if not layer:
            self._features = []  # NC4 needs a second pass over the features, once the class centres are final
        weight = self.model.classifier_weight
        feature_dim = self.model.config.dim if layer else weight.shape[1]  # a layer's feature: its pooled token
        return GeometryAccumulator(self.model.config.dim, num_classes=weight.shape[0], feature_dim=feature_dim,
                                   reservoir_size=1 if layer else self.geometry.pca_points,
                                   seed=self._reservoir_seed(), device=self.worker.device)

    def accumulate(self, accumulator, tokens, feature, batch, last=False):
        accumulator.update(tokens, labels=batch["label"], features=feature)
        if last:
            self._features.append(feature)

    def finish_geometry(self, accumulator):
        weight = self.model.classifier_weight
        accumulator.all_reduce_()
        accumulator.finalize_means(weight, self.model.classifier_bias)  # NC4: the network's own decisions
        for features in self._features:
            accumulator.update_nc4(features)
        accumulator.all_reduce_()
        values = accumulator.compute(weight)
        points, labels = accumulator.pca_projection()
        parts = {"within sequence": values["within_seq_var"], "within class": values["within_class_var"],
                 "between class": values["between_class_var"]}
        return values, GeometryPictures(points, labels, "class", parts, values["total_var"])
