"""Probes on frozen features: DINO's linear classifier and the linear segmentation decoder, with streaming mIoU.

Both read what ``with model.layer_outputs() as outputs:`` collects (models/base.py): one (B, T, d) tensor per block,
each passed through the final norm, token 0 the ViT's class token and tokens 1.. its patches in row-major order.

Classification, as DINO's eval_linear.py does it (facebookresearch/dino): the class tokens of the last n blocks
concatenated (n = 4 for ViT-S, 1 for ViT-B), optionally followed by the average of the last block's patch tokens
(``--avgpool_patchtokens``, on for ViT-B), into one linear layer with weight ~ N(0, 0.01) and bias 0::

    with torch.no_grad(), model.layer_outputs() as outputs:
        model(images)
    logits = classifier(class_token_features(outputs, n_last_blocks=4))

Segmentation, the "linear" decoder of the DINOv2 segmentation probe (dinov2/eval/segmentation/models/decode_heads/
linear_head.py, BNHead on mmsegmentation's BaseDecodeHead): the patch tokens as a (B, d, h, w) map (optionally with
the class token beside every patch, and several blocks concatenated), a batch norm, a 1x1 convolution to class
logits (weight ~ N(0, 0.01), bias 0, mmseg's init of ``conv_seg``), and the logits upsampled bilinearly
(align_corners=False) to the mask's size::

    logits = head(patch_token_features(outputs, grid=(h, w)), size=mask.shape[-2:])
    loss = segmentation_loss(logits, mask)                # pixels labelled ignore_index (255) count for nothing
    confusion += confusion_matrix(logits.argmax(1), mask, num_classes)   # sum over batches and workers
    miou = mean_iou(confusion)

mIoU follows mmsegmentation's IoUMetric (mmseg/evaluation/metrics/iou_metric.py: ``intersect_and_union``,
``total_area_to_metrics``, ``np.nanmean`` in ``compute_metrics``, ``nan_to_num`` left at None): pixels whose target is
the ignore index are dropped from target and prediction alike, intersections and unions are summed over the whole
evaluation set first, IoU_c = TP_c / (TP_c + FP_c + FN_c), and mIoU is the nan-mean over classes: a class absent
from both the targets and the predictions of the whole set has 0 / 0 = NaN and is left out; a class predicted but
never present (or present but never predicted) has IoU 0 and counts.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

IGNORE_INDEX = 255  # ADE20K's "other" after mmseg's reduce_zero_label


# ---- features ---------------------------------------------------------------------------------------------------

def _last_blocks(layer_outputs: Sequence[torch.Tensor], n_last_blocks: int) -> Sequence[torch.Tensor]:
    if not 1 <= n_last_blocks <= len(layer_outputs):
        raise ValueError(f"n_last_blocks must be in 1..{len(layer_outputs)} (the blocks recorded), got {n_last_blocks}")
    return layer_outputs[-n_last_blocks:]


def class_token_features(layer_outputs: Sequence[torch.Tensor], n_last_blocks: int = 4,
                         avgpool_patchtokens: bool = False) -> torch.Tensor:
    """eval_linear.py's probe input: the class tokens of the last ``n_last_blocks`` blocks, earliest first, then
    (``avgpool_patchtokens``) the mean of the last block's patch tokens.

    layer_outputs: per block (B, 1 + P, d), as ``layer_outputs()`` records them. Returns (B, (n + avgpool) * d).
    eval_linear.py interleaves class token and average element by element (it can do so only for n = 1); here they
    are concatenated, a fixed permutation of the same inputs that a linear layer trained from scratch does not see."""
    blocks = _last_blocks(layer_outputs, n_last_blocks)
    features = [x[:, 0] for x in blocks]  # (B, d) each
    if avgpool_patchtokens:
        features.append(blocks[-1][:, 1:].mean(dim=1))  # (B, d)
    return torch.cat(features, dim=-1)


def class_token_dim(dim: int, n_last_blocks: int = 4, avgpool_patchtokens: bool = False) -> int:
    """Width of ``class_token_features``: eval_linear.py's ``embed_dim * (n_last_blocks + avgpool_patchtokens)``."""
    return dim * (n_last_blocks + int(avgpool_patchtokens))


def patch_token_features(layer_outputs: Sequence[torch.Tensor], grid: int | tuple[int, int] | None = None,
                         n_last_blocks: int = 1, cls_token: bool = False) -> torch.Tensor:
    """The patch tokens of the last ``n_last_blocks`` blocks as feature maps, concatenated on channels (earliest block
    first; per block its patches, then with ``cls_token`` its class token copied to every position, the order of
    DINOv2's resize_concat).

    layer_outputs: per block (B, 1 + h * w, d), patches in row-major order. grid: (h, w), or the side of a square grid
    (None: square, from the token count). Returns (B, n * d * (1 + cls_token), h, w)."""
    blocks = _last_blocks(layer_outputs, n_last_blocks)
    batch, tokens, dim = blocks[-1].shape
    patches = tokens - 1
    if grid is None:
        side = math.isqrt(patches)
        grid = (side, side)
    elif isinstance(grid, int):
        grid = (grid, grid)
    h, w = grid
    if h * w != patches:
        raise ValueError(f"grid {h}x{w} does not hold the {patches} patch tokens")
    maps = []
    for x in blocks:
        maps.append(x[:, 1:].transpose(1, 2).reshape(batch, dim, h, w))  # (B, P, d) -> (B, d, h, w)
        if cls_token:
            maps.append(x[:, 0, :, None, None].expand(batch, dim, h, w))
    return torch.cat(maps, dim=1)


def patch_token_dim(dim: int, n_last_blocks: int = 1, cls_token: bool = False) -> int:
    """Channels of ``patch_token_features``."""
    return dim * n_last_blocks * (1 + int(cls_token))


def patch_majority_labels(mask: torch.Tensor, patch_size: int, num_classes: int,
                          ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """The class of each patch: the most frequent label among its pixels that are not ``ignore_index`` (ties to the
    smaller class), -1 for a patch with no such pixel.

    mask (B, H, W) integer, H and W multiples of ``patch_size``. Returns (B, P) int64, patches in row-major order (the
    order of a ViT's patch tokens)."""
    batch, height, width = mask.shape
    if height % patch_size or width % patch_size:
        raise ValueError(f"mask {height}x{width} is not a whole number of {patch_size}-pixel patches")
    mask = mask.long()
    valid = mask != ignore_index
    onehot = F.one_hot(torch.where(valid, mask, 0), num_classes) * valid[..., None]  # (B, H, W, K)
    counts = onehot.reshape(batch, height // patch_size, patch_size, width // patch_size, patch_size, num_classes)
    counts = counts.sum(dim=(2, 4)).reshape(batch, -1, num_classes)  # (B, P, K), patches row by row
    return torch.where(counts.sum(-1) > 0, counts.argmax(-1), -1)


# ---- heads ------------------------------------------------------------------------------------------------------

class LinearClassifier(nn.Module):
    """eval_linear.py's LinearClassifier: flatten, one linear layer, weight ~ N(0, 0.01), bias 0."""

    def __init__(self, dim: int, num_labels: int = 1000):
        super().__init__()
        self.num_labels = num_labels
        self.linear = nn.Linear(dim, num_labels)
        self.linear.weight.data.normal_(mean=0.0, std=0.01)
        self.linear.bias.data.zero_()

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        """features (B, ...) flattening to (B, dim) -> logits (B, num_labels)."""
        return self.linear(features.flatten(1))


class LinearSegmentationHead(nn.Module):
    """DINOv2's linear segmentation decoder (BNHead): batch norm over the feature channels, a 1x1 convolution to class
    logits (mmseg's conv_seg: weight ~ N(0, 0.01), bias 0), bilinear upsampling to the mask's size.

    batch_norm=False leaves the bare linear map. Under data parallelism DINOv2 uses SyncBatchNorm:
    ``nn.SyncBatchNorm.convert_sync_batchnorm(head)`` before wrapping the head in DDP does the same."""

    def __init__(self, in_channels: int, num_classes: int, batch_norm: bool = True):
        super().__init__()
        self.num_classes = num_classes
        self.norm = nn.BatchNorm2d(in_channels) if batch_norm else nn.Identity()
        self.conv_seg = nn.Conv2d(in_channels, num_classes, kernel_size=1)
        nn.init.normal_(self.conv_seg.weight, mean=0.0, std=0.01)
        nn.init.zeros_(self.conv_seg.bias)

    def forward(self, features: torch.Tensor, size: tuple[int, int] | None = None) -> torch.Tensor:
        """features (B, C, h, w) -> logits (B, num_classes, h, w), or (B, num_classes, *size) upsampled."""
        logits = self.conv_seg(self.norm(features))
        return upsample_logits(logits, size) if size is not None else logits


def upsample_logits(logits: torch.Tensor, size) -> torch.Tensor:
    """(B, K, h, w) -> (B, K, H, W), bilinear with align_corners=False (mmseg's ``resize`` in the decode head)."""
    size = tuple(int(s) for s in size)
    if tuple(logits.shape[-2:]) == size:
        return logits
    return F.interpolate(logits, size=size, mode="bilinear", align_corners=False)


# ---- loss and metrics -------------------------------------------------------------------------------------------

def segmentation_loss(logits: torch.Tensor, mask: torch.Tensor, ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """Per-pixel cross-entropy averaged over the pixels not labelled ``ignore_index`` (0 when there are none).

    logits (B, K, h, w), upsampled bilinearly to the mask's size when smaller; mask (B, H, W) integer.
    mmseg's CrossEntropyLoss divides by all pixels unless ``avg_non_ignore=True`` (its recommended setting, and
    PyTorch's own ``ignore_index`` rule); this divides by the valid pixels, so batches with many "other" pixels
    weigh the same as the rest."""
    logits = upsample_logits(logits, mask.shape[-2:])
    mask = mask.long()
    total = F.cross_entropy(logits, mask, ignore_index=ignore_index, reduction="sum")
    return total / (mask != ignore_index).sum().clamp(min=1)


def confusion_matrix(prediction: torch.Tensor, target: torch.Tensor, num_classes: int,
                     ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """Pixel counts (num_classes, num_classes) int64, rows the target class, columns the predicted class, over the
    pixels whose target is not ``ignore_index``. Matrices of disjoint sets of pixels add up: sum them over batches
    and all-reduce (sum) them over workers.

    prediction, target: integer tensors of one shape (e.g. (B, H, W)); values in 0..num_classes-1 (target may also
    be ignore_index)."""
    if prediction.shape != target.shape:
        raise ValueError(f"prediction {tuple(prediction.shape)} and target {tuple(target.shape)} differ in shape")
    valid = target != ignore_index
    target, prediction = target[valid].long(), prediction[valid].long()
    if bool(((target < 0) | (target >= num_classes) | (prediction < 0) | (prediction >= num_classes)).any()):
        raise ValueError(f"class indices must lie in 0..{num_classes - 1} (or be the ignore index {ignore_index})")
    counts = torch.bincount(target * num_classes + prediction, minlength=num_classes * num_classes)
    return counts.reshape(num_classes, num_classes)


def iou_per_class(confusion: torch.Tensor) -> torch.Tensor:
    """IoU_c = TP / (TP + FP + FN) per class, float64 (num_classes,); NaN for a class absent from both targets and
    predictions (mmseg's 0 / 0)."""
    confusion = confusion.double()
    tp = confusion.diagonal()
    union = confusion.sum(dim=0) + confusion.sum(dim=1) - tp  # (TP + FP) + (TP + FN) - TP
    return tp / union


def mean_iou(confusion: torch.Tensor) -> float:
    """mmseg's mIoU: the mean IoU over the classes present in targets or predictions (NaN-mean of iou_per_class)."""
    return float(torch.nanmean(iou_per_class(confusion)))


def pixel_accuracy(confusion: torch.Tensor) -> float:
    """mmseg's aAcc: correctly labelled pixels over all pixels not ignored."""
    confusion = confusion.double()
    return float(confusion.diagonal().sum() / confusion.sum())
