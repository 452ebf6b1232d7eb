"""Token geometry of the last layer: variance decomposition, neural collapse, spectral decay, PCA pictures.

The definitions beside the fast path, as fla keeps ``naive.py`` beside ``chunk.py``:
- ``reference``: the definitions (docs/geometry.md), one-shot functions on tensors held in memory;
- ``streaming``: ``GeometryAccumulator``, the same statistics over a stream of batches, mergeable across workers;
- ``patches``: self-supervised ViTs' patch tokens (spectral decay, the PCA picture) and their accumulator;
- ``finishing``: the steps both kinds share (NC1-NC3 from class means, component counts, checks).
"""

from models.geometry.finishing import PINV_RTOL, SPECTRAL_FRACTION
from models.geometry.patches import PatchSpectrumAccumulator, patch_pca_rgb, patch_spectral_decay
from models.geometry.reference import (
    language_collapse,
    most_frequent_targets,
    neural_collapse,
    pca_projection,
    pcs_for_variance,
    variance_decomposition,
)
from models.geometry.streaming import GeometryAccumulator

__all__ = [
    "PINV_RTOL",
    "SPECTRAL_FRACTION",
    "GeometryAccumulator",
    "PatchSpectrumAccumulator",
    "language_collapse",
    "most_frequent_targets",
    "neural_collapse",
    "patch_pca_rgb",
    "patch_spectral_decay",
    "pca_projection",
    "pcs_for_variance",
    "variance_decomposition",
]
