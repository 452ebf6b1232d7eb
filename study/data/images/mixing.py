"""The worker-side steps on a training batch, on the training device after the worker's shuffle, as timm runs
them: normalisation (by the data's mean and std; ImageNet's for most), then Mixup/CutMix and label smoothing
(`BatchMixer`)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    import torch

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


@dataclass(frozen=True)
class BatchMixer:
    """Worker-side steps on a training batch: normalisation, then Mixup/CutMix and label smoothing (timm's rules)."""

    num_classes: int
    mean: tuple[float, ...]
    std: tuple[float, ...]
    mixup: float = 0.0
    cutmix: float = 0.0
    mix_prob: float = 1.0
    switch_prob: float = 0.5
    label_smoothing: float = 0.0
    views: int = 0  # multi-crop training batches: their views, normalised, as the list "crops" (no mixing)

    @property
    def soft(self) -> bool:
        return self.mixup > 0 or self.cutmix > 0 or self.label_smoothing > 0

    def normalize(self, images: torch.Tensor) -> torch.Tensor:
        import torch

        mean = torch.tensor(self.mean, device=images.device, dtype=torch.float32).view(1, -1, 1, 1)
        std = torch.tensor(self.std, device=images.device, dtype=torch.float32).view(1, -1, 1, 1)
        return (images.float() / 255.0 - mean) / std

    def evaluate(self, batch: dict) -> dict:
        return {"image": self.normalize(batch["image"]), "label": batch["label"].long()}

    def __call__(self, batch: dict, rng: np.random.Generator) -> dict:
        import torch

        labels = batch["label"].long()
        if self.views:
            return {"crops": [self.normalize(batch[f"view_{i}"]) for i in range(self.views)], "label": labels}
        images = self.normalize(batch["image"])
        out = {"image": images, "label": labels}
        if not self.soft:
            return out
        off = self.label_smoothing / self.num_classes
        targets = torch.full((len(labels), self.num_classes), off, device=images.device)
        targets.scatter_(1, labels[:, None], 1.0 - self.label_smoothing + off)
        if (self.mixup > 0 or self.cutmix > 0) and rng.random() < self.mix_prob:
            use_cutmix = self.cutmix > 0 and (self.mixup == 0 or rng.random() < self.switch_prob)
            alpha = self.cutmix if use_cutmix else self.mixup
            lam = float(rng.beta(alpha, alpha))
            flipped = images.flip(0)
            if use_cutmix:
                images, lam = cutmix(images, flipped, lam, rng)
            else:
                images = images * lam + flipped * (1 - lam)
            targets = targets * lam + targets.flip(0) * (1 - lam)
            out["image"] = images
        out["soft_label"] = targets
        return out


def cutmix(images: torch.Tensor, flipped: torch.Tensor, lam: float, rng: np.random.Generator):
    """Paste a box of area ~(1 - lam) from the flipped batch; lam is corrected to the box actually pasted."""
    height, width = images.shape[-2:]
    cut = math.sqrt(1 - lam)
    ch, cw = int(height * cut), int(width * cut)
    cy, cx = int(rng.integers(0, height)), int(rng.integers(0, width))
    y0, y1 = max(cy - ch // 2, 0), min(cy + ch // 2, height)
    x0, x1 = max(cx - cw // 2, 0), min(cx + cw // 2, width)
    images = images.clone()
    images[..., y0:y1, x0:x1] = flipped[..., y0:y1, x0:x1]
    return images, 1 - (y1 - y0) * (x1 - x0) / (height * width)
