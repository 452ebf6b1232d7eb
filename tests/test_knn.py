"""DINO's weighted k-NN classifier (models/knn.py) against the vote counted by hand, test point by test point."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from models.knn import knn_classifier, knn_predict


def knn_by_loops(train, train_labels, test, test_labels, k, temperature, num_classes):
    """eval_knn.py:142-182 one test point at a time in float64: cosine similarity to every training point, the k most
    similar, votes exp(s / T) summed per class, classes ranked by votes (equal votes: smaller class first)."""
    train, test = np.asarray(train, np.float64), np.asarray(test, np.float64)
    top1 = top5 = 0
    ranks = []
    for x, y in zip(test, np.asarray(test_labels)):
        similarity = [float(x @ t / (np.linalg.norm(x) * np.linalg.norm(t))) for t in train]
        nearest = sorted(range(len(train)), key=lambda j: -similarity[j])[:k]
        votes = [0.0] * num_classes
        for j in nearest:
            votes[int(train_labels[j])] += np.exp(similarity[j] / temperature)
        ranked = sorted(range(num_classes), key=lambda c: (-votes[c], c))
        voted = [c for c in ranked if votes[c] > 0]
        top1 += voted[0] == y
        top5 += y in voted[: min(5, k)]
        ranks.append(ranked[: min(5, num_classes)])
    return top1 / len(test), top5 / len(test), np.array(ranks)


def clustered(seed, num_classes, n_train, n_test, dim, spread):
    g = torch.Generator().manual_seed(seed)
    centres = torch.randn(num_classes, dim, generator=g)
    train_labels = torch.randint(0, num_classes, (n_train,), generator=g)
    test_labels = torch.randint(0, num_classes, (n_test,), generator=g)
    train = centres[train_labels] + spread * torch.randn(n_train, dim, generator=g)
    test = centres[test_labels] + spread * torch.randn(n_test, dim, generator=g)
    return train, train_labels, test, test_labels


@pytest.mark.parametrize("k, temperature, chunks", [(20, 0.07, (7, 13)), (3, 0.5, (50, 1000)), (1, 0.07, (1, 5))])
def test_knn_equals_the_vote_counted_point_by_point(k, temperature, chunks):
    # overlapping clusters: accuracies well inside (0, 1), so a wrong vote shows
    train, train_labels, test, test_labels = clustered(0, 8, 150, 60, 12, spread=1.2)
    top1, top5, ranks = knn_by_loops(train, train_labels, test, test_labels, k, temperature, 8)
    assert 0.2 < top1 < 0.95
    test_chunk, train_chunk = chunks
    result = knn_classifier(train, train_labels, test, test_labels, k=k, temperature=temperature,
                            test_chunk=test_chunk, train_chunk=train_chunk)
    assert result.top1 == pytest.approx(top1) and result.top5 == pytest.approx(top5)
    classes, votes = knn_predict(train, train_labels, test, k=k, temperature=temperature, num_classes=8,
                                 test_chunk=test_chunk, train_chunk=train_chunk)
    np.testing.assert_array_equal(classes.numpy(), ranks)
    # the ranked classes' votes share k neighbours' weights, each at most exp(1 / T)
    assert (votes.sum(dim=1) <= k * np.exp(1 / temperature) * (1 + 1e-5)).all()


def test_knn_on_well_separated_clusters_is_always_right():
    train, train_labels, test, test_labels = clustered(1, 10, 300, 100, 32, spread=0.01)
    result = knn_classifier(train, train_labels, test, test_labels)
    assert result == (1.0, 1.0)


def test_knn_is_scale_invariant_and_checks_its_arguments():
    train, train_labels, test, test_labels = clustered(2, 5, 80, 30, 6, spread=1.0)
    assert knn_classifier(train * 7.0, train_labels, test * 0.1, test_labels) == knn_classifier(
        train, train_labels, test, test_labels)
    with pytest.raises(ValueError):
        knn_classifier(train, train_labels, test, test_labels, k=81)
    with pytest.raises(ValueError):
        knn_classifier(train, train_labels[:-1], test, test_labels)
