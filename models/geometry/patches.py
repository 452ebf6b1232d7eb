"""Geometry of self-supervised ViTs' patch tokens: spectral decay per image and pooled, the PCA picture of DINO's
figures, and ``PatchSpectrumAccumulator``, the spectral decay over a stream of batches."""

from __future__ import annotations

import math

import numpy as np
import torch
import torch.distributed as dist

from models.geometry.finishing import (
    SPECTRAL_FRACTION,
    check_tokens,
    pcs_from_covariance,
    pcs_from_eigenvalues,
    to_float64,
    top_components,
)
from models.geometry.reference import pcs_for_variance
from models.geometry.streaming import GroupMoments


def patch_spectral_decay(patch_tokens: torch.Tensor, fraction: float = SPECTRAL_FRACTION) -> dict[str, float]:
    """Spectral decay of the patch tokens (B, P, d) of B images (a class-token ViT's tokens[:, 1:]):
    ``pcs99_per_image``, the fewest principal components of one image's patches (centred on that image's mean)
    explaining ``fraction`` of their variance, averaged over the images; ``pcs99_patches``, the same over all
    patches of all images pooled (centred on their mean)."""
    x = to_float64(patch_tokens)
    check_tokens(x)
    per_image = _pcs_per_image(x, fraction)
    return {"pcs99_per_image": per_image.double().mean().item(), "pcs99_patches": pcs_for_variance(x, fraction)}


def patch_pca_rgb(patch_tokens: torch.Tensor, grid: tuple[int, int] | None = None,
                  per_image: bool = False) -> np.ndarray:
    """The PCA picture of patch features (DINO's figures): the top three principal components of all patch tokens
    (B, P, d) of the B images pooled, each image's patches projected on them, each component min-max scaled to
    [0, 1] over all the images (``per_image``: over each image alone), and laid out on the patch grid (H, W) with
    H * W = P, row by row (default: square). Returns (B, H, W, 3) float64, red the first component. Components are
    signed so that their largest entry is positive; a component constant over the patches maps to 0."""
    x = to_float64(patch_tokens)
    check_tokens(x)
    batch, patches, dim = x.shape
    if dim < 3:
        raise ValueError(f"the PCA picture needs tokens of width at least 3, got {dim}")
    height, width = grid if grid is not None else (math.isqrt(patches),) * 2
    if height * width != patches:
        raise ValueError(f"grid {height} x {width} does not hold {patches} patches; pass grid=(H, W)")
    flat = x.reshape(-1, dim)
    centred = flat - flat.mean(dim=0)
    projected = (centred @ top_components(centred.T @ centred / len(flat), 3)).reshape(batch, patches, 3)
    over = (1,) if per_image else (0, 1)
    low, high = projected.amin(dim=over, keepdim=True), projected.amax(dim=over, keepdim=True)
    scaled = torch.where(high > low, (projected - low) / (high - low).clamp_min(torch.finfo(x.dtype).tiny), 0.0)
    return scaled.reshape(batch, height, width, 3).cpu().numpy()


class PatchSpectrumAccumulator:
    """``patch_spectral_decay`` over a stream of batches of patch tokens (B, P, d), mergeable across workers.

    Per image the component count is taken at ``update`` (so ``fraction`` is fixed up front) and summed with the
    number of images; over all patches the pooled moments are kept as the token moments of GeometryAccumulator
    (count, shift, sum, d x d scatter, float64). Memory O(d^2) whatever the number of images.
    """

    def __init__(self, dim: int, fraction: float = SPECTRAL_FRACTION, device: torch.device | str = "cpu"):
        if not 0 < fraction <= 1:
            raise ValueError(f"fraction must be in (0, 1], got {fraction}")
        self.dim, self.fraction, self.device = dim, fraction, torch.device(device)
        self.patches = GroupMoments(1, dim, with_scatter=True, device=device)
        self.image_counts = torch.zeros(2, dtype=torch.float64, device=device)  # sum of per-image pcs, images
        self._reduced = False

    def update(self, patch_tokens: torch.Tensor) -> None:
        if self._reduced:
            raise RuntimeError("update() after all_reduce_(): the statistics are final")
        x = patch_tokens.detach().to(device=self.device, dtype=torch.float64)
        if x.ndim != 3 or x.shape[-1] != self.dim:
            raise ValueError(f"patch_tokens must have shape (B, P, {self.dim}), got {tuple(x.shape)}")
        flat = x.reshape(-1, self.dim)
        self.patches.update(flat, torch.zeros(len(flat), dtype=torch.long, device=self.device))
        per_image = _pcs_per_image(x, self.fraction)
        self.image_counts += torch.stack([per_image.sum().to(torch.float64),
                                          torch.tensor(float(len(x)), dtype=torch.float64, device=self.device)])

    def merge(self, other: PatchSpectrumAccumulator) -> PatchSpectrumAccumulator:
        """Add another worker's accumulator (same dim and fraction) into this one; returns self."""
        if (other.dim, other.fraction) != (self.dim, self.fraction):
            raise ValueError("merge(): accumulators were built with different dim or fraction")
        other = other if other.device == self.device else PatchSpectrumAccumulator.from_state_dict(
            other.state_dict(), device=self.device)
        self.patches.merge_(other.patches)
        self.image_counts += other.image_counts
        return self

    def all_reduce_(self, group=None) -> PatchSpectrumAccumulator:
        """Sum over the process group (a no-op without torch.distributed); once."""
        if not (dist.is_available() and dist.is_initialized()):
            return self
        if self._reduced:
            raise RuntimeError("all_reduce_() twice would count every worker again")
        self.patches.all_reduce_(group)
        dist.all_reduce(self.image_counts, group=group)
        self._reduced = True
        return self

    def compute(self) -> dict[str, float]:
        """``pcs99_per_image`` and ``pcs99_patches`` as ``patch_spectral_decay`` gives them on all the data."""
        if self.image_counts[1] == 0:
            raise ValueError("compute() before any update()")
        covariance = self.patches.within_scatter() / self.patches.count[0]
        return {
            "pcs99_per_image": (self.image_counts[0] / self.image_counts[1]).item(),
            "pcs99_patches": pcs_from_covariance(covariance, self.fraction),
        }

    def state_dict(self) -> dict[str, torch.Tensor]:
        state = {"image_counts": self.image_counts,
                 "fraction": torch.tensor(self.fraction, dtype=torch.float64)}
        state.update(self.patches.state_dict("patches."))
        return {name: tensor.detach().clone() for name, tensor in state.items()}

    @classmethod
    def from_state_dict(cls, state: dict[str, torch.Tensor],
                        device: torch.device | str | None = None) -> PatchSpectrumAccumulator:
        device = state["image_counts"].device if device is None else device
        acc = cls(state["patches.scatter"].shape[0], float(state["fraction"]), device=device)
        acc.image_counts = state["image_counts"].to(device=device, dtype=torch.float64).clone()
        acc.patches.load_state_dict(state, "patches.")
        return acc


def _pcs_per_image(x: torch.Tensor, fraction: float) -> torch.Tensor:
    """pcs for ``fraction`` of each image's patches (B, P, d), centred per image, (B,). The nonzero eigenvalues of
    the scatter X^T X (d x d) are those of the Gram matrix X X^T (P x P): the smaller of the two is decomposed."""
    centred = x - x.mean(dim=1, keepdim=True)
    transposed = centred.transpose(1, 2)
    scatter = transposed @ centred if x.shape[2] <= x.shape[1] else centred @ transposed
    return pcs_from_eigenvalues(torch.linalg.eigvalsh(scatter), fraction)
