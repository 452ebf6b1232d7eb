"""Finishing steps shared by the definitions (reference.py) and the accumulators (streaming.py, patches.py):
NC1-NC3 from class means, the classifier's NC4 mismatches, principal-component counts, the PCA basis, the
reservoir's keys, and the float64 and shape checks every entry point applies."""

from __future__ import annotations

import math

import torch

PINV_RTOL = 1e-6
SPECTRAL_FRACTION = 0.99


def collapse_metrics(
    means: torch.Tensor, counts: torch.Tensor, within_scatter: torch.Tensor, weight: torch.Tensor | None
) -> dict[str, float]:
    """NC1-NC3 from the present classes' means (C, d), sizes (C,) and sum_i (h_i - mu_yi)(h_i - mu_yi)^T."""
    keys = ("nc1", "nc2_equinorm", "nc2_equiangle") + (("nc3",) if weight is not None else ())
    if len(means) < 2:
        return dict.fromkeys(keys, math.nan)
    n = counts.sum()
    global_mean = (counts[:, None] * means).sum(dim=0) / n
    centred = means - global_mean
    norms = centred.norm(dim=1)
    unit = centred / norms[:, None]
    off_diagonal = ~torch.eye(len(means), dtype=torch.bool, device=means.device)
    metrics = {
        "nc1": nc1(within_scatter / n, centred),
        "nc2_equinorm": (norms.std(correction=0) / norms.mean()).item(),
        "nc2_equiangle": (unit @ unit.T)[off_diagonal].std(correction=0).item(),
    }
    if weight is not None:
        metrics["nc3"] = (weight / weight.norm() - centred / centred.norm()).norm().item()
    return metrics


def nc1(sigma_w: torch.Tensor, centred_means: torch.Tensor) -> float:
    num_groups = len(centred_means)
    if num_groups < 2:
        return math.nan
    sigma_b = centred_means.T @ centred_means / num_groups
    return (torch.trace(sigma_w @ torch.linalg.pinv(sigma_b, rtol=PINV_RTOL, hermitian=True)) / num_groups).item()


def float64_bias(bias: torch.Tensor | None, weight: torch.Tensor) -> torch.Tensor:
    """The classifier's bias as float64 (C,) beside its weight (C, d) (zeros: a classifier without one)."""
    if bias is None:
        return torch.zeros(weight.shape[0], dtype=torch.float64, device=weight.device)
    bias = bias.detach().to(device=weight.device, dtype=torch.float64)
    if bias.shape != weight.shape[:1]:
        raise ValueError(f"classifier_bias must have shape ({weight.shape[0]},), got {tuple(bias.shape)}")
    return bias


def classifier_centre_mismatches(
    h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, centres: torch.Tensor, centre_classes: torch.Tensor,
    origin: torch.Tensor,
) -> torch.Tensor:
    """How many rows of h the classifier's decision argmax (W h + b) assigns to another class than the nearest
    centre does."""
    classifier = (h @ weight.T + bias).argmax(dim=1)
    # Distances are translation invariant: measure them from the feature mean so the expansion loses no digits.
    h0, c0 = h - origin, centres - origin
    squared_distances = squared_norms(c0)[None, :] - 2 * h0 @ c0.T
    nearest = centre_classes[squared_distances.argmin(dim=1)]
    return (classifier != nearest).sum()


def pcs_from_covariance(covariance: torch.Tensor, fraction: float) -> int:
    return int(pcs_from_eigenvalues(torch.linalg.eigvalsh(covariance), fraction))


def pcs_from_eigenvalues(eigenvalues: torch.Tensor, fraction: float) -> torch.Tensor:
    """Fewest of the eigenvalues (..., n) (any order, negative rounding clamped to 0) whose sum reaches ``fraction``
    of their total, per leading index (...); 0 where all are 0."""
    if not 0 < fraction <= 1:
        raise ValueError(f"fraction must be in (0, 1], got {fraction}")
    explained = eigenvalues.clamp_min(0).sort(dim=-1, descending=True).values.cumsum(-1)
    total = explained[..., -1:]
    count = ((explained < fraction * total).sum(dim=-1) + 1).clamp_max(explained.shape[-1])
    return torch.where(total[..., 0] > 0, count, 0)


def top_two_components(covariance: torch.Tensor) -> torch.Tensor:
    return top_components(covariance, 2)


def top_components(covariance: torch.Tensor, count: int) -> torch.Tensor:
    """(d, count) leading eigenvectors, each signed so its largest entry is positive (stable pictures run to run)."""
    _, vectors = torch.linalg.eigh(covariance)
    top = vectors.flip(1)[:, :count]
    largest = top.abs().argmax(dim=0)
    return top * torch.sign(top[largest, torch.arange(count, device=top.device)])


def reservoir_keys(generator: torch.Generator, n: int) -> torch.Tensor:
    """One uniform key per token; a sample keeps the smallest keys, so samples merge by keeping the smallest of
    the union. The CPU generator yields the same sequence however the tokens are split into batches."""
    return torch.rand(n, generator=generator, dtype=torch.float64)


def target_groups(targets: torch.Tensor, sorted_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Index into ``sorted_ids`` of each target and whether the target is there at all."""
    position = torch.searchsorted(sorted_ids, targets).clamp(max=len(sorted_ids) - 1)
    return position, sorted_ids[position] == targets


def empty_language_metrics() -> dict[str, float]:
    keys = ("within_target_var", "between_target_var", "total_var", "between_target_frac", "target_nc1")
    return dict.fromkeys(keys, math.nan)


def squared_norms(x: torch.Tensor) -> torch.Tensor:
    return x.square().sum(dim=-1)


def ratio(part: torch.Tensor, total: torch.Tensor) -> float:
    return (part / total).item() if total > 0 else math.nan


def to_float64(x: torch.Tensor) -> torch.Tensor:
    return x.detach().to(torch.float64)


def check_tokens(x: torch.Tensor) -> None:
    if x.ndim != 3:
        raise ValueError(f"tokens must have shape (B, T, d), got {tuple(x.shape)}")


def check_labels(labels: torch.Tensor, num_classes: int) -> None:
    if labels.numel() and (labels.min() < 0 or labels.max() >= num_classes):
        raise ValueError(f"labels must be in [0, {num_classes}), got values in [{labels.min()}, {labels.max()}]")
