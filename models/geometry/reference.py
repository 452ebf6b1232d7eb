"""Token geometry, the definitions: one-shot functions on tensors held in memory, the reference the streaming
accumulators (streaming.py, patches.py) are tested against.

Definitions (docs/geometry.md). Tokens X are (B, T, d): the last block's output after the final norm,
the same T for every sequence, one label y_b per sequence. mu_seq(b) = mean_t X[b, t], mu_class(c) = mean of mu_seq
over the sequences of class c, mu_global = mean of all tokens::

    WithinSeqVar    = mean_{b,t} ||X[b,t] - mu_seq(b)||^2
    WithinClassVar  = mean_b     ||mu_seq(b) - mu_class(y_b)||^2
    BetweenClassVar = mean_b     ||mu_class(y_b) - mu_global||^2      (weighted by sequences)

and the three add up to the total variance mean_{b,t} ||X[b,t] - mu_global||^2.

Neural collapse follows Papyan, Han & Donoho (2020) on the feature h that the classifier W h + b reads. The seed
write-up (000, section 4.3) states NC1 as a cosine between class means and NC4 as "1 - NCC error"; we use the
standard definitions instead:

- NC1 = (1/C) tr(Sigma_W Sigma_B^+), Sigma_W = (1/n) sum_i (h_i - mu_{y_i})(h_i - mu_{y_i})^T,
  Sigma_B = (1/C) sum_c (mu_c - mu_G)(mu_c - mu_G)^T, mu_G the mean of all h, pseudo-inverse with relative cut-off 1e-6;
- NC2 equinorm = std_c ||mu_c - mu_G|| / mean_c ||mu_c - mu_G||; NC2 equiangle = std over pairs c != c' of the cosine
  between centred class means (both population standard deviations, so two classes give equiangle 0);
- NC3 = || W / ||W||_F - M / ||M||_F ||_F with M the centred class means as rows;
- NC4 = fraction of samples where the classifier's decision argmax_c (W h + b)_c differs from the nearest class
  centre (b: the classifier's bias, zero where it has none).

Classes absent from the data have no mean: every statistic is taken over the classes present (C counts them, W is
restricted to their rows for NC3), except the classifier's own prediction in NC4, which is its argmax over all rows.
With fewer than two classes present NC1-NC3 are NaN.
"""

from __future__ import annotations

import numpy as np
import torch

from models.geometry.finishing import (
    SPECTRAL_FRACTION,
    check_labels,
    check_tokens,
    classifier_centre_mismatches,
    collapse_metrics,
    empty_language_metrics,
    float64_bias,
    nc1,
    pcs_from_covariance,
    ratio,
    reservoir_keys,
    squared_norms,
    target_groups,
    to_float64,
    top_two_components,
)


def variance_decomposition(tokens: torch.Tensor, labels: torch.Tensor) -> dict[str, float]:
    """Three-way split of the token variance. tokens (B, T, d), labels (B,) integer classes."""
    x = to_float64(tokens)
    check_tokens(x)
    if labels.shape != x.shape[:1]:
        raise ValueError(f"labels must have shape ({x.shape[0]},), got {tuple(labels.shape)}")
    classes, y = torch.unique(labels.to(x.device), return_inverse=True)
    seq_mean = x.mean(dim=1)
    global_mean = x.mean(dim=(0, 1))
    counts = torch.bincount(y, minlength=len(classes)).to(x.dtype)
    class_mean = torch.zeros(len(classes), x.shape[-1], dtype=x.dtype, device=x.device).index_add_(0, y, seq_mean)
    class_mean /= counts[:, None]
    total = squared_norms(x - global_mean).mean()
    between = squared_norms(class_mean[y] - global_mean).mean()
    return {
        "within_seq_var": squared_norms(x - seq_mean[:, None]).mean().item(),
        "within_class_var": squared_norms(seq_mean - class_mean[y]).mean().item(),
        "between_class_var": between.item(),
        "total_var": total.item(),
        "between_class_frac": ratio(between, total),
    }


def neural_collapse(
    features: torch.Tensor,
    labels: torch.Tensor,
    classifier_weight: torch.Tensor,
    num_classes: int | None = None,
    classifier_bias: torch.Tensor | None = None,
) -> dict[str, float]:
    """NC1-NC4 of features (n, d) with integer labels (n,) read by a classifier of weight (C, d) and bias (C,) (None:
    none), by the standard definitions (module docstring; not the seed's cosine NC1 and "1 - NCC error" NC4), over
    the classes present."""
    h = to_float64(features)
    if h.ndim != 2 or labels.shape != h.shape[:1] or classifier_weight.shape[1:] != h.shape[1:]:
        raise ValueError(f"need features (n, d), labels (n,), classifier_weight (C, d); got {tuple(h.shape)}, "
                         f"{tuple(labels.shape)}, {tuple(classifier_weight.shape)}")
    weight = to_float64(classifier_weight).to(h.device)
    if num_classes is not None and num_classes != weight.shape[0]:
        raise ValueError(f"num_classes={num_classes} but classifier_weight has {weight.shape[0]} rows")
    bias = float64_bias(classifier_bias, weight)
    labels = labels.to(h.device)
    check_labels(labels, weight.shape[0])
    present, y = torch.unique(labels, return_inverse=True)
    counts = torch.bincount(y, minlength=len(present)).to(h.dtype)
    means = torch.zeros(len(present), h.shape[1], dtype=h.dtype, device=h.device).index_add_(0, y, h)
    means /= counts[:, None]
    deviations = h - means[y]
    metrics = collapse_metrics(means, counts, deviations.T @ deviations, weight[present])
    global_mean = h.mean(dim=0)
    mismatches = classifier_centre_mismatches(h, weight, bias, means, present, global_mean)
    metrics["nc4"] = mismatches.item() / len(h)
    return metrics


def pcs_for_variance(tokens: torch.Tensor, fraction: float = SPECTRAL_FRACTION) -> int:
    """Fewest principal components explaining ``fraction`` of the variance of tokens (..., d) (global centring)."""
    x = to_float64(tokens).reshape(-1, tokens.shape[-1])
    centred = x - x.mean(dim=0)
    return pcs_from_covariance(centred.T @ centred / len(x), fraction)


def most_frequent_targets(targets: torch.Tensor, top_k: int = 32) -> torch.Tensor:
    """The ``top_k`` most frequent ids in ``targets`` (any shape), most frequent first, ties to the smaller id."""
    if top_k < 1:
        raise ValueError(f"top_k must be >= 1, got {top_k}")
    ids, counts = torch.unique(targets.reshape(-1), return_counts=True)
    by_frequency = torch.sort(counts, descending=True, stable=True).indices
    return ids[by_frequency[:top_k]]


def language_collapse(
    tokens: torch.Tensor, targets: torch.Tensor, top_k: int = 32, target_ids: torch.Tensor | None = None
) -> dict[str, float]:
    """Tokens (B, L, d) grouped by their next-token target (B, L), over the tokens whose target is among
    ``target_ids`` (default: the ``top_k`` most frequent targets here). mu_G is the mean of that subset."""
    x = to_float64(tokens)
    check_tokens(x)
    if targets.shape != x.shape[:2]:
        raise ValueError(f"targets must have shape {tuple(x.shape[:2])}, got {tuple(targets.shape)}")
    targets = targets.to(x.device).reshape(-1)
    ids = most_frequent_targets(targets, top_k) if target_ids is None else target_ids.to(x.device)
    group, keep = target_groups(targets, torch.unique(ids))
    x = x.reshape(-1, x.shape[-1])[keep]
    if len(x) == 0:
        return empty_language_metrics()
    present, g = torch.unique(group[keep], return_inverse=True)
    counts = torch.bincount(g, minlength=len(present)).to(x.dtype)
    means = torch.zeros(len(present), x.shape[1], dtype=x.dtype, device=x.device).index_add_(0, g, x)
    means /= counts[:, None]
    global_mean = x.mean(dim=0)
    deviations = x - means[g]
    between = squared_norms(means[g] - global_mean).mean()
    total = squared_norms(x - global_mean).mean()
    return {
        "within_target_var": squared_norms(deviations).mean().item(),
        "between_target_var": between.item(),
        "total_var": total.item(),
        "between_target_frac": ratio(between, total),
        "target_nc1": nc1(deviations.T @ deviations / len(x), means - global_mean),
    }


def pca_projection(
    tokens: torch.Tensor, labels: torch.Tensor | None = None, num_points: int = 2048, seed: int = 0
) -> tuple[np.ndarray, np.ndarray]:
    """A seeded sample of ``num_points`` tokens (B, T, d) projected on the top two principal components of all
    tokens. ``labels`` (B,) per sequence or (B, T) per token; -1 where none. Returns points (m, 2), labels (m,)."""
    x = to_float64(tokens)
    check_tokens(x)
    flat = x.reshape(-1, x.shape[-1])
    token_labels = _token_labels(labels, x.shape[:2], x.device)
    mean = flat.mean(dim=0)
    centred = flat - mean
    basis = top_two_components(centred.T @ centred / len(flat))
    keys = reservoir_keys(torch.Generator().manual_seed(seed), len(flat)).to(x.device)
    sample = torch.argsort(keys, stable=True)[:num_points]
    points = (flat[sample] - mean) @ basis
    return points.cpu().numpy(), token_labels[sample].cpu().numpy()


def _token_labels(labels: torch.Tensor | None, shape: torch.Size, device: torch.device) -> torch.Tensor:
    if labels is None:
        return torch.full(shape, -1, dtype=torch.long, device=device).reshape(-1)
    labels = labels.to(device=device, dtype=torch.long)
    if labels.shape == shape[:1]:
        labels = labels[:, None].expand(shape)
    if labels.shape != shape:
        raise ValueError(f"labels must have shape {tuple(shape[:1])} or {tuple(shape)}, got {tuple(labels.shape)}")
    return labels.reshape(-1)
