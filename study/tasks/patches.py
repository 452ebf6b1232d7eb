"""The patch-token geometry the paper reads for self-supervised ViTs (seed 001): the spectral decay of patch tokens
(principal components for 99% of their variance, per image and pooled) and the PCA picture of patch features (the
top three components as RGB over each image's patch grid), gathered in the evaluation pass of a ViT task."""

from __future__ import annotations

import numpy as np
import torch

from models.geometry import PatchSpectrumAccumulator, patch_pca_rgb

PICTURED_IMAGES = 8  # images in the PCA picture: enough to see boundaries, few enough to read


class PatchGeometry:
    """Streams the last layer's patch tokens (B, 1 + P, d; token 0 the class token) of the geometry batches: the
    spectrum over every worker's images, the picture from this worker's first images."""

    metrics = ("pcs99_per_image", "pcs99_patches")

    def __init__(self, dim: int, device: torch.device):
        self.spectrum = PatchSpectrumAccumulator(dim, device=device)
        self.pictured: list[torch.Tensor] = []
        self.images: list[torch.Tensor] = []

    def update(self, tokens: torch.Tensor, images: torch.Tensor) -> None:
        patches = tokens[:, 1:].float()
        self.spectrum.update(patches)
        room = PICTURED_IMAGES - sum(len(p) for p in self.pictured)
        if room > 0:
            self.pictured.append(patches[:room].cpu())
            self.images.append(images[:room].float().cpu())

    def finish(self) -> tuple[dict[str, float], np.ndarray | None, np.ndarray | None]:
        """All-reduced spectrum metrics, and the PCA picture (B, h, w, 3) with its images (B, H, W, 3) in [0, 1]."""
        values = self.spectrum.all_reduce_().compute()
        if not self.pictured:  # this worker's shard had no geometry batch
            return values, None, None
        rgb = patch_pca_rgb(torch.cat(self.pictured))
        images = torch.cat(self.images).permute(0, 2, 3, 1)  # (B, H, W, C), normalised
        # shown, not measured: each image stretched to [0, 1] (the data's normalisation is not known here)
        low = images.amin(dim=(1, 2, 3), keepdim=True)
        high = images.amax(dim=(1, 2, 3), keepdim=True)
        shown = ((images - low) / (high - low).clamp_min(1e-12)).numpy()
        return values, rgb, shown if shown.shape[-1] == 3 else np.repeat(shown[..., :1], 3, axis=-1)
