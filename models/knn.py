"""DINO's weighted k-nearest-neighbour classifier (facebookresearch/dino eval_knn.py:142-182, knn_classifier).

Features are L2-normalised (eval_knn.py:81-82 does it before the classifier), so similarity is the cosine. For each
test feature: the k training features of highest similarity s_i, each voting for its class with weight
exp(s_i / T); the classes ranked by their summed votes. Defaults k = 20 (eval_knn.py:194-195: "20 is usually working
the best") and T = 0.07 (:196).

Memory stays bounded: test features are taken ``test_chunk`` at a time and, for each chunk, the training features
``train_chunk`` at a time, keeping a running top k, so the largest temporary is test_chunk x (train_chunk + k)
similarities plus test_chunk x num_classes votes, whatever the number of training and test features.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F


class KNNAccuracy(NamedTuple):
    top1: float  # fraction of test features whose class ranks first (eval_knn.py returns percentages)
    top5: float  # ... among the first min(5, k) classes (:178)


@torch.no_grad()
def knn_predict(
    train_features: torch.Tensor,
    train_labels: torch.Tensor,
    test_features: torch.Tensor,
    k: int = 20,
    temperature: float = 0.07,
    num_classes: int | None = None,
    top: int = 5,
    test_chunk: int = 256,
    train_chunk: int = 65536,
) -> tuple[torch.Tensor, torch.Tensor]:
    """train_features (n, d), train_labels (n,) in 0..num_classes-1, test_features (m, d) -> (classes, votes), each
    (m, min(top, num_classes)): per test feature the classes with the highest summed votes sum_i exp(s_i / T) over
    its k nearest training features (s_i the cosine similarity), best first, and those votes. Classes that got no
    vote come last with vote 0; equal votes rank the smaller class first."""
    n, dim = train_features.shape
    if train_labels.shape != (n,) or test_features.ndim != 2 or test_features.shape[1] != dim:
        raise ValueError(f"need train_features (n, d), train_labels (n,), test_features (m, d); got "
                         f"{tuple(train_features.shape)}, {tuple(train_labels.shape)}, {tuple(test_features.shape)}")
    if not 1 <= k <= n:
        raise ValueError(f"k must be in 1..{n} (the number of training features), got {k}")
    num_classes = int(train_labels.max()) + 1 if num_classes is None else num_classes
    top = min(top, num_classes)
    train = F.normalize(train_features.float(), dim=1, p=2)
    labels = train_labels.to(train.device, torch.long)
    classes, votes = [], []
    for start in range(0, len(test_features), test_chunk):
        test = F.normalize(test_features[start:start + test_chunk].to(train.device).float(), dim=1, p=2)
        similarity, neighbour = _top_k_neighbours(test, train, k, train_chunk)  # (b, k) each
        weight = (similarity / temperature).exp()  # eval_knn.py:165
        class_votes = torch.zeros(len(test), num_classes, device=train.device)
        class_votes.scatter_add_(1, labels[neighbour], weight)  # (b, C): eval_knn.py:163-172 without the one-hot
        ranked = torch.sort(class_votes, dim=1, descending=True, stable=True)
        classes.append(ranked.indices[:, :top])
        votes.append(ranked.values[:, :top])
    return torch.cat(classes), torch.cat(votes)


def _top_k_neighbours(test: torch.Tensor, train: torch.Tensor, k: int, train_chunk: int):
    """The k largest similarities of each test row to the training rows and their indices, a chunk at a time."""
    best_sim = best_idx = None
    for start in range(0, len(train), train_chunk):
        sim = test @ train[start:start + train_chunk].T  # (b, chunk)
        idx = torch.arange(start, start + sim.shape[1], device=train.device).expand_as(sim)
        if best_sim is not None:
            sim, idx = torch.cat([best_sim, sim], dim=1), torch.cat([best_idx, idx], dim=1)
        best_sim, where = sim.topk(min(k, sim.shape[1]), dim=1, largest=True, sorted=True)
        best_idx = idx.gather(1, where)
    return best_sim, best_idx


@torch.no_grad()
def knn_classifier(
    train_features: torch.Tensor,
    train_labels: torch.Tensor,
    test_features: torch.Tensor,
    test_labels: torch.Tensor,
    k: int = 20,
    temperature: float = 0.07,
    num_classes: int | None = None,
    test_chunk: int = 256,
    train_chunk: int = 65536,
) -> KNNAccuracy:
    """Top-1 and top-5 accuracy, as fractions, of the weighted k-NN vote (``knn_predict``) on test_labels (m,).
    ``num_classes`` defaults to one more than the largest label of either set. A test label counts in the top 5
    only where its class got a vote (where fewer than 5 classes got votes, the reference's sort places the others
    in an arbitrary order)."""
    if len(test_labels) == 0 or test_labels.shape != test_features.shape[:1]:
        raise ValueError(f"need test_labels of shape ({len(test_features)},) with at least one label, got "
                         f"{tuple(test_labels.shape)}")
    if num_classes is None:
        num_classes = int(max(train_labels.max(), test_labels.max())) + 1
    classes, votes = knn_predict(train_features, train_labels, test_features, k, temperature, num_classes,
                                 top=5, test_chunk=test_chunk, train_chunk=train_chunk)
    hit = (classes == test_labels.to(classes.device)[:, None]) & (votes > 0)
    total = len(test_labels)
    # With k < 5 at most k classes have votes: the reference's narrowing to min(5, k) classes (eval_knn.py:178)
    return KNNAccuracy(top1=hit[:, 0].sum().item() / total, top5=hit.any(dim=1).sum().item() / total)
