"""Geometry of self-supervised ViTs' patch tokens (models/geometry/patches.py): the spectral decay per image and pooled,
against numpy's eigendecomposition and spectra built to order, and the PCA picture on a known low-rank structure."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from models.geometry import PatchSpectrumAccumulator, patch_pca_rgb, patch_spectral_decay

OFFSET = 1e3


def image_with_spectrum(variances, patches, dim, seed):
    """Patch tokens (patches, dim) whose covariance (centred on their own mean) has exactly these eigenvalues and
    zeros elsewhere, in random directions, around a random mean far from the origin."""
    g = torch.Generator().manual_seed(seed)
    directions, _ = torch.linalg.qr(torch.randn(dim, len(variances), generator=g, dtype=torch.float64))
    raw = torch.randn(patches, len(variances), generator=g, dtype=torch.float64)
    white, _ = torch.linalg.qr(raw - raw.mean(dim=0))  # centred, orthonormal columns: covariance exactly I / P
    coords = math.sqrt(patches) * white * torch.tensor(variances, dtype=torch.float64).sqrt()
    return OFFSET + torch.randn(dim, generator=g, dtype=torch.float64) + coords @ directions.T


def numpy_pcs(x: np.ndarray, fraction: float = 0.99) -> int:
    """Fewest eigenvalues of the covariance of the rows of x, largest first, adding up to ``fraction`` of the trace."""
    eigenvalues = np.linalg.eigh(np.cov(x, rowvar=False, bias=True))[0][::-1].clip(min=0)
    cumulative = np.cumsum(eigenvalues)
    return int(np.argmax(cumulative >= fraction * cumulative[-1])) + 1


# shares 50, 80, 90, 95, 98, 99.5, 100 %: 6 components; 40, 70, 90, 100 %: 4; 99.5, 100 %: 1
SPECTRA = ([50.0, 30.0, 10.0, 5.0, 3.0, 1.5, 0.5], [4.0, 3.0, 2.0, 1.0], [99.5, 0.5])


@pytest.mark.parametrize("patches", [24, 8])  # more patches than dimensions, and fewer (the Gram matrix path)
def test_spectral_decay_counts_known_spectra_per_image_and_numpys_pooled(patches):
    dim = 10
    x = torch.stack([image_with_spectrum(v, patches, dim, seed) for seed, v in enumerate(SPECTRA)])
    result = patch_spectral_decay(x)
    assert result["pcs99_per_image"] == pytest.approx((6 + 4 + 1) / 3)
    assert [numpy_pcs(image.numpy()) for image in x] == [6, 4, 1]  # the construction, checked by numpy
    pooled = numpy_pcs(x.reshape(-1, dim).numpy())
    assert result["pcs99_patches"] == pooled and pooled > 6  # the images' means and directions differ
    assert patch_spectral_decay(x, fraction=0.85)["pcs99_per_image"] == pytest.approx((3 + 3 + 1) / 3)


def test_spectral_decay_of_random_tokens_matches_numpy_image_by_image():
    x = torch.randn(5, 30, 12, generator=torch.Generator().manual_seed(3), dtype=torch.float64) * torch.linspace(
        0.1, 3.0, 12, dtype=torch.float64)
    for fraction in (0.5, 0.9, 0.99):
        result = patch_spectral_decay(x, fraction)
        assert result["pcs99_per_image"] == pytest.approx(np.mean([numpy_pcs(i.numpy(), fraction) for i in x]))
        assert result["pcs99_patches"] == numpy_pcs(x.reshape(-1, 12).numpy(), fraction)


def random_images(seed=0, count=7, patches=16, dim=6):
    """Random images whose spectra decay faster image after image (so their component counts differ)."""
    g = torch.Generator().manual_seed(seed)
    decay = torch.arange(1, count + 1, dtype=torch.float64)[:, None, None]
    scales = torch.linspace(0.05, 1.0, dim, dtype=torch.float64) ** decay  # (count, 1, dim)
    return OFFSET + torch.randn(count, patches, dim, generator=g, dtype=torch.float64) * scales


def test_spectrum_accumulator_streams_merges_and_ships_as_the_one_shot_function():
    x = random_images()
    expected = patch_spectral_decay(x)
    counts = [numpy_pcs(image.numpy()) for image in x]
    assert len(set(counts)) > 2 and expected["pcs99_per_image"] == pytest.approx(np.mean(counts))
    streamed = PatchSpectrumAccumulator(6)
    for part in (x[:1], x[1:4], x[4:]):
        streamed.update(part.float())
    assert streamed.compute() == pytest.approx(expected)
    first, second = PatchSpectrumAccumulator(6), PatchSpectrumAccumulator(6)
    first.update(x[:3])
    second.update(x[3:])
    shipped = PatchSpectrumAccumulator.from_state_dict(second.state_dict())
    assert first.merge(shipped).compute() == pytest.approx(expected)
    with pytest.raises(ValueError):
        first.merge(PatchSpectrumAccumulator(6, fraction=0.9))


def spectrum_worker(rank, init_file, out_file):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    acc = PatchSpectrumAccumulator(6)
    acc.update(random_images()[:2] if rank == 0 else random_images()[2:])
    acc.all_reduce_()
    if rank == 1:
        torch.save(acc.compute(), out_file)
    dist.destroy_process_group()


def test_spectrum_accumulator_all_reduce_over_two_gloo_workers_equals_one_shot(tmp_path):
    out_file = tmp_path / "rank1.pt"
    mp.spawn(spectrum_worker, args=(str(tmp_path / "init"), str(out_file)), nprocs=2, join=True)
    assert torch.load(out_file) == pytest.approx(patch_spectral_decay(random_images()))


def test_pca_picture_recovers_a_known_three_component_structure():
    # Patch grid 4 x 6. Three patterns over the grid, centred and orthogonal to each other: the column index, the
    # row index and a checkerboard (both sides even), with variances 3^2 * 35/12, 2^2 * 5/4 and 1: the top three
    # principal components are their directions u_c, in that order. Image 1 carries the first pattern mirrored and
    # halved (a narrower range of red than image 0's, so scaling over the set and per image differ).
    rows, cols = np.meshgrid(np.arange(4.0), np.arange(6.0), indexing="ij")
    patterns = np.stack([3 * (cols - 2.5), 2 * (rows - 1.5), (-1.0) ** (rows + cols)], axis=-1)  # (4, 6, 3)
    mirrored = patterns * np.array([-0.5, 1.0, 1.0])
    coefficients = np.stack([patterns, mirrored])  # (2, 4, 6, 3)
    rng = np.random.default_rng(0)
    directions = np.linalg.qr(rng.normal(size=(8, 3)))[0]  # (8, 3) orthonormal
    mean = rng.normal(size=8) * 10
    tokens = torch.from_numpy(mean + coefficients.reshape(2, 24, 3) @ directions.T)  # (2, 24, 8)

    # the components are +-u_c, signed so that their largest entry is positive
    signs = np.sign(directions[np.abs(directions).argmax(axis=0), np.arange(3)])
    projected = coefficients * signs
    low, high = projected.min(axis=(0, 1, 2)), projected.max(axis=(0, 1, 2))
    np.testing.assert_allclose(patch_pca_rgb(tokens, grid=(4, 6)), (projected - low) / (high - low), atol=1e-9)

    per_image = patch_pca_rgb(tokens, grid=(4, 6), per_image=True)
    low, high = projected.min(axis=(1, 2), keepdims=True), projected.max(axis=(1, 2), keepdims=True)
    np.testing.assert_allclose(per_image, (projected - low) / (high - low), atol=1e-9)
    with pytest.raises(ValueError):
        patch_pca_rgb(tokens)  # 24 patches are no square grid
