"""A linear segmentation probe on frozen patch features (the DINOv2 "linear" decoder, models/probes.py): a later
stage of a self-supervised run that labels every pixel from the patch tokens of the backbone the stage before it
trained, scored by mIoU as mmsegmentation scores ADE20K. Only the head (a batch norm and a 1x1 convolution) trains.

Its geometry is that of the patch tokens grouped by the class most of a patch's pixels carry (patches of only
ignored pixels left out), with the patch-token spectrum and the PCA picture of patch features (study/tasks/
patches.py): the picture in which the paper sees object boundaries come out sharper with Laplacian heads."""

from __future__ import annotations

import torch
import torch.distributed as dist
from pydantic import Field
from torch import nn

from models.base import ModelOutput
from models.geometry import GeometryAccumulator
from models.probes import (
    IGNORE_INDEX,
    LinearSegmentationHead,
    confusion_matrix,
    mean_iou,
    patch_majority_labels,
    patch_token_dim,
    patch_token_features,
    pixel_accuracy,
    segmentation_loss,
    upsample_logits,
)
from study.schema import StrictModel
from study.tasks.base import GeometryPictures, Task
from study.tasks.frozen import FrozenBackbone, carried_backbone
from study.tasks.patches import PatchGeometry


class SegmentationProbeOptions(StrictModel):
    seg_blocks: int = Field(1, ge=1, description="patch tokens of this many last blocks, concatenated (DINOv2's "
                                                 "linear head: 1; its multi-scale head: 4)")
    seg_cls_token: bool = Field(True, description="the class token beside every patch (DINOv2's linear head)")
    seg_batch_norm: bool = Field(True, description="a batch norm before the 1x1 convolution (DINOv2's BNHead)")


class FrozenBackboneSegmenter(FrozenBackbone):
    """The frozen backbone and a linear segmentation head on its patch tokens; logits at patch resolution."""

    def __init__(self, backbone: nn.Module, num_classes: int, option: SegmentationProbeOptions):
        super().__init__(backbone)
        self.option = option
        self.head = LinearSegmentationHead(
            patch_token_dim(backbone.config.dim, option.seg_blocks, option.seg_cls_token), num_classes,
            batch_norm=option.seg_batch_norm)

    def forward(self, images: torch.Tensor, return_features: bool = False):
        outputs = self.layer_outputs_of(images)
        logits = self.logits_from(outputs)
        return ModelOutput(logits, outputs[-1], None) if return_features else logits

    def logits_from(self, layer_outputs: list[torch.Tensor]) -> torch.Tensor:
        """(B, K, h, w) from the blocks' outputs."""
        return self.head(patch_token_features(layer_outputs, n_last_blocks=self.option.seg_blocks,
                                              cls_token=self.option.seg_cls_token))


class SegmentationProbe(Task):
    name = "segmentation_probe"
    model_family = "vit"
    data_kind = "segmentation"
    input_key = "image"
    sum_names = ("loss", "pixels")  # and the confusion matrix, added up beside them (evaluate)
    quality_metrics = ("val_miou", "val_acc", "val_loss")
    geometry_metrics = ("total_var", "within_class_var", "between_class_var", "between_class_frac", "nc1",
                        "nc2_equinorm", "nc2_equiangle", "pcs99", *PatchGeometry.metrics)
    layer_geometry_metrics = ("within_class_var", "between_class_var", "between_class_frac", "nc1")
    report_geometry = ("between_class_frac", "nc1", "pcs99_per_image")
    options = SegmentationProbeOptions
    data_sets = frozenset({"num_classes"})
    carried_sets = frozenset({"image_size", "in_chans"})

    @classmethod
    def build_model(cls, resolved, carried):
        model = FrozenBackboneSegmenter(carried_backbone(resolved.config, carried), resolved.model["num_classes"],
                                        resolved.options)
        if dist.is_initialized() and dist.get_world_size() > 1 and torch.cuda.is_available():
            # DINOv2 trains the head with SyncBatchNorm; converted before Ray wraps the model in DDP
            model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
        return model

    def carry(self) -> dict:
        return self.model.backbone.state_dict()

    @property
    def num_classes(self) -> int:
        return self.hyperparameters["num_classes"]

    @property
    def ignore_index(self) -> int:
        return self.hyperparameters.get("ignore_index", IGNORE_INDEX)

    def loss(self, model, batch):
        return segmentation_loss(model(batch["image"]).float(), batch["mask"], self.ignore_index)

    def evaluate(self, batches, *, autocast, geometry):
        """Every pixel of this worker's shard once: the confusion matrix, summed over batches and workers before any
        ratio (mmseg's IoUMetric), gives mIoU and pixel accuracy; the loss is averaged over the valid pixels."""
        model = self.model
        model.eval()
        classes = self.num_classes
        sums = torch.zeros(2 + classes * classes, dtype=torch.float64)
        last = self.new_accumulator() if geometry else None
        layers = [self.new_accumulator(layer=True) for _ in model.blocks] if geometry else []
        patches = PatchGeometry(model.config.dim, self.worker.device) if geometry else None
        with torch.no_grad():
            for index, batch in enumerate(batches):
                want = geometry and (self.geometry.max_batches is None or index < self.geometry.max_batches)
                with autocast:
                    outputs = model.layer_outputs_of(batch["image"])
                    logits = model.logits_from(outputs)
                mask = batch["mask"]
                logits = upsample_logits(logits.float(), mask.shape[-2:])
                valid = int((mask != self.ignore_index).sum())
                confusion = confusion_matrix(logits.argmax(1), mask, classes, self.ignore_index)
                sums += torch.cat([torch.tensor([segmentation_loss(logits, mask, self.ignore_index).item() * valid,
                                                 valid], dtype=torch.float64),
                                   confusion.reshape(-1).double().cpu()])
                if want:
                    labels = patch_majority_labels(mask, model.config.patch_size, classes, self.ignore_index)
                    self.accumulate(last, outputs[-1], None, {"patch_label": labels}, last=True)
                    patches.update(outputs[-1], batch["image"])
                    for accumulator, tokens in zip(layers, outputs):
                        self.accumulate(accumulator, tokens, None, {"patch_label": labels})
        totals = self.worker.all_reduce(sums)
        confusion = totals[2:].reshape(classes, classes)
        metrics = {"val_miou": mean_iou(confusion), "val_acc": pixel_accuracy(confusion),
                   "val_loss": float(totals[0] / totals[1].clamp_min(1))}
        return self.finish_evaluation(metrics, last, layers, patches)

    # ---- geometry: each labelled patch token one sample of its class ----------------------------------------------

    def new_accumulator(self, layer=False):
        return GeometryAccumulator(self.model.config.dim, num_classes=self.num_classes,
                                   reservoir_size=1 if layer else self.geometry.pca_points,
                                   seed=self._reservoir_seed(), device=self.worker.device)

    def accumulate(self, accumulator, tokens, feature, batch, last=False):
        labels = batch["patch_label"].reshape(-1).to(tokens.device)
        patch_tokens = tokens[:, 1:].reshape(len(labels), -1)[labels >= 0]
        kept = labels[labels >= 0]
        if len(kept):
            accumulator.update(patch_tokens[:, None], labels=kept, features=patch_tokens)

    def finish_geometry(self, accumulator):
        values = accumulator.all_reduce_().compute()
        points, labels = accumulator.pca_projection()
        parts = {"within class": values["within_class_var"], "between class": values["between_class_var"]}
        return values, GeometryPictures(points, labels, "patch class", parts, values["total_var"])
