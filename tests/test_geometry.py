"""Token-geometry metrics against explicit loops over their definitions, closed forms and exact identities;
the streaming accumulator against the one-shot functions (batched, merged, shipped, all-reduced)."""

import math

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from models.geometry import (
    GeometryAccumulator,
    language_collapse,
    most_frequent_targets,
    neural_collapse,
    pca_projection,
    pcs_for_variance,
    variance_decomposition,
)

OFFSET = 1e3
# Sequences per class 4, 2, none, 3 and 1 (a single sequence): unequal, and class 2 absent (its id sits between
# present ones, so a present-class index mistaken for a class id shows).
LABELS = torch.tensor([0, 4, 1, 0, 3, 0, 1, 3, 0, 3])
NUM_CLASSES = 5


def clustered_tokens(labels, tokens_per_seq=6, dim=4, seed=0):
    """Tokens far from the origin with class, sequence and token structure of very different scales."""
    g = torch.Generator().manual_seed(seed)
    class_centres = 3 * torch.randn(NUM_CLASSES, dim, generator=g, dtype=torch.float64)
    seq_offsets = 0.02 * torch.randn(len(labels), 1, dim, generator=g, dtype=torch.float64)
    noise = 0.001 * torch.randn(len(labels), tokens_per_seq, dim, generator=g, dtype=torch.float64)
    return OFFSET + class_centres[labels][:, None] + seq_offsets + noise


def batches(n, sizes):
    """Consecutive slices of range(n) with the given sizes, cycling until n is covered."""
    start, i = 0, 0
    while start < n:
        yield slice(start, min(start + sizes[i % len(sizes)], n))
        start += sizes[i % len(sizes)]
        i += 1


def assert_metrics_close(actual, expected, rel=1e-9):
    assert actual.keys() >= expected.keys()
    for key, value in expected.items():
        assert actual[key] == pytest.approx(value, rel=rel, abs=1e-12), key


def sq(v):
    return float((v * v).sum())


# ---------------------------------------------------------------------------------------------------------------
# Variance decomposition


def test_variance_decomposition_matches_explicit_loops():
    x = clustered_tokens(LABELS)
    B, T, _ = x.shape
    seq_mean = [sum(x[b, t] for t in range(T)) / T for b in range(B)]
    global_mean = sum(x[b, t] for b in range(B) for t in range(T)) / (B * T)
    members = {c: [b for b in range(B) if LABELS[b] == c] for c in LABELS.tolist()}
    class_mean = {c: sum(seq_mean[b] for b in bs) / len(bs) for c, bs in members.items()}
    within_seq = sum(sq(x[b, t] - seq_mean[b]) for b in range(B) for t in range(T)) / (B * T)
    within_class = sum(sq(seq_mean[b] - class_mean[int(LABELS[b])]) for b in range(B)) / B
    between_class = sum(sq(class_mean[int(LABELS[b])] - global_mean) for b in range(B)) / B
    total = sum(sq(x[b, t] - global_mean) for b in range(B) for t in range(T)) / (B * T)

    got = variance_decomposition(x, LABELS)

    assert got["within_seq_var"] == pytest.approx(within_seq, rel=1e-10)
    assert got["within_class_var"] == pytest.approx(within_class, rel=1e-10)
    assert got["between_class_var"] == pytest.approx(between_class, rel=1e-10)
    assert got["total_var"] == pytest.approx(total, rel=1e-10)
    assert got["between_class_frac"] == pytest.approx(between_class / total, rel=1e-10)
    parts = got["within_seq_var"] + got["within_class_var"] + got["between_class_var"]
    assert parts == pytest.approx(got["total_var"], rel=1e-12)
    # Each part has its own scale, so a mix-up between them could not pass.
    assert within_seq < within_class < between_class


def streamed(x, labels=None, features=None, targets=None, sizes=(1, 3, 2), **kwargs):
    acc = GeometryAccumulator(x.shape[-1], **kwargs)
    for s in batches(len(x), sizes):
        acc.update(
            x[s],
            labels=None if labels is None else labels[s],
            features=None if features is None else features[s],
            targets=None if targets is None else targets[s],
        )
    return acc


def test_variance_decomposition_streaming_merging_and_state_dict_agree_with_one_shot():
    x = clustered_tokens(LABELS)
    expected = variance_decomposition(x, LABELS)
    expected["pcs99"] = pcs_for_variance(x)

    assert_metrics_close(streamed(x, LABELS, sizes=(1, 3, 2), num_classes=NUM_CLASSES).compute(), expected)
    assert_metrics_close(streamed(x, LABELS, sizes=(4,), num_classes=NUM_CLASSES).compute(), expected)

    # The second shard holds a class (3) the first never saw, so shifts are taken from either side.
    first = streamed(x[:3], LABELS[:3], sizes=(2,), num_classes=NUM_CLASSES, seed=1)
    second = streamed(x[3:], LABELS[3:], sizes=(3,), num_classes=NUM_CLASSES, seed=2)
    assert_metrics_close(first.merge(second).compute(), expected)

    acc = streamed(x[:4], LABELS[:4], num_classes=NUM_CLASSES)
    shipped = GeometryAccumulator.from_state_dict(acc.state_dict())
    for a in (acc, shipped):  # the copy carries on exactly like the original, reservoir generator included
        a.update(x[4:], labels=LABELS[4:])
    assert shipped.compute() == acc.compute()
    for a, b in zip(shipped.pca_projection(), acc.pca_projection()):
        np.testing.assert_array_equal(a, b)


# ---------------------------------------------------------------------------------------------------------------
# Neural collapse


def simplex_etf_means(num_classes, dim, seed=0):
    """(C, d) class means forming a simplex equiangular tight frame centred at the origin."""
    g = torch.Generator().manual_seed(seed)
    basis, _ = torch.linalg.qr(torch.randn(dim, num_classes, generator=g, dtype=torch.float64))
    etf = math.sqrt(num_classes / (num_classes - 1)) * (torch.eye(num_classes) - 1 / num_classes)
    return (basis @ etf.to(torch.float64)).T


def test_neural_collapse_vanishes_on_a_simplex_etf():
    means = simplex_etf_means(num_classes=4, dim=6)
    labels = torch.arange(4).repeat(3)
    features = means[labels]

    got = neural_collapse(features, labels, classifier_weight=means)

    for key in ("nc1", "nc2_equinorm", "nc2_equiangle", "nc3"):
        assert abs(got[key]) < 1e-6, key
    assert got["nc4"] == 0


def test_neural_collapse_closed_form_two_classes():
    # Class means (-a, 0) and (a, 0); each class has deviations (+-s, 0) and (0, +-t).
    # Sigma_W = diag(s^2/2, t^2/2), Sigma_B = diag(a^2, 0), so NC1 = (1/2) (s^2/2) / a^2 = s^2 / (4 a^2).
    a, s, t = 2.0, 1.0, 3.0
    deviations = torch.tensor([[s, 0], [-s, 0], [0, t], [0, -t]], dtype=torch.float64)
    centres = torch.tensor([[-a, 0], [a, 0]], dtype=torch.float64)
    features = torch.cat([centres[0] + deviations, centres[1] + deviations])
    labels = torch.tensor([0] * 4 + [1] * 4)
    weight = torch.tensor([[-1.0, 0.0], [1.0, 0.0]], dtype=torch.float64)

    # A shift along the second axis leaves the classifier's decisions alone: NC4 stays 0.
    got = neural_collapse(features + torch.tensor([0.0, OFFSET]), labels, weight)
    assert got["nc1"] == pytest.approx(s**2 / (4 * a**2), rel=1e-10)
    assert got["nc2_equinorm"] == pytest.approx(0, abs=1e-12)
    assert got["nc2_equiangle"] == pytest.approx(0, abs=1e-12)
    assert got["nc3"] == pytest.approx(0, abs=1e-12)
    assert got["nc4"] == 0

    # Along the first axis it moves every feature to the side of class 1 for a bias-free classifier, while the
    # nearest class centre moves along: half of the samples disagree.
    assert neural_collapse(features + torch.tensor([OFFSET, 0.0]), labels, weight)["nc4"] == 0.5


def test_neural_collapse_is_clearly_positive_on_random_features():
    g = torch.Generator().manual_seed(0)
    labels = torch.arange(5).repeat(40)
    got = neural_collapse(torch.randn(200, 8, generator=g), labels, torch.randn(5, 8, generator=g))
    assert got["nc1"] > 1
    assert got["nc2_equinorm"] > 0.05
    assert got["nc2_equiangle"] > 0.05
    assert got["nc3"] > 0.5
    assert got["nc4"] > 0.2


def random_classification(seed=0):
    x = clustered_tokens(LABELS, seed=seed)
    g = torch.Generator().manual_seed(seed + 100)
    features = x[:, 0] + 0.01 * torch.randn(len(LABELS), x.shape[-1], generator=g, dtype=torch.float64)
    weight = torch.randn(NUM_CLASSES, x.shape[-1], generator=g, dtype=torch.float64)
    # Rows orthogonal to the common offset, so the bias-free classifier's decisions are not all the same class.
    return x, features, weight - weight.mean(dim=1, keepdim=True)


def run_nc4_pass(acc, features, weight, sizes=(3,), bias=None):
    acc.finalize_means(weight, bias)
    for s in batches(len(features), sizes):
        acc.update_nc4(features[s])
    return acc


def test_neural_collapse_with_an_absent_class_matches_explicit_loops():
    _, features, weight = random_classification()
    h, w = features.numpy(), weight.numpy()
    present = sorted(set(LABELS.tolist()))
    assert present == [0, 1, 3, 4]
    members = {c: [i for i in range(len(h)) if LABELS[i] == c] for c in present}
    mean = {c: sum(h[i] for i in members[c]) / len(members[c]) for c in present}
    global_mean = sum(h) / len(h)
    sigma_w = sum(np.outer(h[i] - mean[int(LABELS[i])], h[i] - mean[int(LABELS[i])]) for i in range(len(h))) / len(h)
    centred = np.stack([mean[c] - global_mean for c in present])
    sigma_b = centred.T @ centred / len(present)
    nc1 = np.trace(sigma_w @ np.linalg.pinv(sigma_b, rcond=1e-6, hermitian=True)) / len(present)
    norms = [np.linalg.norm(m) for m in centred]
    cosines = [centred[i] @ centred[j] / (norms[i] * norms[j]) for i in range(4) for j in range(4) if i != j]
    rows = w[present]
    nc3 = np.linalg.norm(rows / np.linalg.norm(rows) - centred / np.linalg.norm(centred))
    disagree = 0
    for i in range(len(h)):
        classifier = max(range(NUM_CLASSES), key=lambda c: w[c] @ h[i])
        nearest = min(present, key=lambda c: np.linalg.norm(h[i] - mean[c]))
        disagree += classifier != nearest

    got = neural_collapse(features, LABELS, weight)

    assert got["nc1"] == pytest.approx(nc1, rel=1e-8)
    assert got["nc2_equinorm"] == pytest.approx(np.std(norms) / np.mean(norms), rel=1e-10)
    assert got["nc2_equiangle"] == pytest.approx(np.std(cosines), rel=1e-10)
    assert got["nc3"] == pytest.approx(nc3, rel=1e-10)
    assert got["nc4"] == disagree / len(h)
    assert 0 < got["nc4"] < 1


def test_neural_collapse_streaming_agrees_with_one_shot():
    x, features, weight = random_classification()
    expected = neural_collapse(features, LABELS, weight, num_classes=NUM_CLASSES)
    assert 0 < expected["nc4"] < 1

    acc = streamed(x, LABELS, features, sizes=(2, 1, 4), num_classes=NUM_CLASSES)
    assert acc.needs_second_pass
    without_nc4 = acc.compute(weight)
    assert "nc4" not in without_nc4
    assert_metrics_close(without_nc4, {k: v for k, v in expected.items() if k != "nc4"})
    assert_metrics_close(run_nc4_pass(acc, features, weight).compute(), expected)
    assert not acc.needs_second_pass

    merged = streamed(x[:3], LABELS[:3], features[:3], num_classes=NUM_CLASSES, seed=1)
    merged.merge(streamed(x[3:], LABELS[3:], features[3:], num_classes=NUM_CLASSES, seed=2))
    assert_metrics_close(run_nc4_pass(merged, features, weight, sizes=(4,)).compute(), expected)


def deciding_bias(features, weight, seed=0):
    """A classifier bias (C,) that changes the decision argmax(W h + b) of some features but not all."""
    g = torch.Generator().manual_seed(seed)
    logits = features @ weight.T
    bias = 0.6 * logits.std() * torch.randn(weight.shape[0], generator=g, dtype=torch.float64)
    flipped = (logits + bias).argmax(dim=1) != logits.argmax(dim=1)
    assert flipped.any() and not flipped.all()
    return bias


def test_nc4_compares_the_decisions_of_the_classifier_with_its_bias():
    # NC4 (Papyan, Han and Donoho): the share of samples where the network's classifier, W h + b, decides otherwise
    # than the nearest class centre. Written out with loops over classes and samples.
    _, features, weight = random_classification()
    bias = deciding_bias(features, weight)
    h, w, b = features.numpy(), weight.numpy(), bias.numpy()
    present = sorted(set(LABELS.tolist()))
    mean = {c: h[LABELS.numpy() == c].mean(axis=0) for c in present}
    nearest = [min(present, key=lambda c: np.linalg.norm(h[i] - mean[c])) for i in range(len(h))]
    with_bias = [max(range(NUM_CLASSES), key=lambda c: w[c] @ h[i] + b[c]) for i in range(len(h))]
    without = [max(range(NUM_CLASSES), key=lambda c: w[c] @ h[i]) for i in range(len(h))]
    expected = np.mean([d != n for d, n in zip(with_bias, nearest)])
    assert expected != np.mean([d != n for d, n in zip(without, nearest)])  # the bias matters to NC4 here

    got = neural_collapse(features, LABELS, weight, classifier_bias=bias)
    assert got["nc4"] == expected
    assert neural_collapse(features, LABELS, weight)["nc4"] == np.mean([d != n for d, n in zip(without, nearest)])
    no_nc4 = {k: v for k, v in got.items() if k != "nc4"}
    assert no_nc4 == {k: v for k, v in neural_collapse(features, LABELS, weight).items() if k != "nc4"}
    with pytest.raises(ValueError, match="classifier_bias must have shape"):
        neural_collapse(features, LABELS, weight, classifier_bias=bias[:-1])


def test_nc4_with_a_bias_streams_merges_and_ships_as_the_one_shot_function():
    x, features, weight = random_classification()
    bias = deciding_bias(features, weight)
    expected = neural_collapse(features, LABELS, weight, num_classes=NUM_CLASSES, classifier_bias=bias)
    assert expected["nc4"] != neural_collapse(features, LABELS, weight)["nc4"]

    acc = run_nc4_pass(streamed(x, LABELS, features, sizes=(2, 1, 4), num_classes=NUM_CLASSES), features, weight,
                       bias=bias)
    got = acc.compute()
    assert got["nc4"] == expected["nc4"]  # a count over the same samples: exactly equal
    assert_metrics_close(got, expected)
    # shipped to another process between finalize_means and the counting: the classifier travels with it
    started = streamed(x, LABELS, features, num_classes=NUM_CLASSES)
    started.finalize_means(weight, bias)
    shipped = GeometryAccumulator.from_state_dict(started.state_dict())
    shipped.update_nc4(features)
    assert shipped.compute()["nc4"] == expected["nc4"]

    # two workers: the first pass merged, then each counts its own shard against the merged centres
    first = streamed(x[:3], LABELS[:3], features[:3], num_classes=NUM_CLASSES, seed=1)
    first.merge(streamed(x[3:], LABELS[3:], features[3:], num_classes=NUM_CLASSES, seed=2))
    second = GeometryAccumulator.from_state_dict(first.state_dict())
    run_nc4_pass(first, features[:3], weight, bias=bias)
    run_nc4_pass(second, features[3:], weight, bias=bias)
    assert first.merge(second).compute()["nc4"] == expected["nc4"]


def test_nc4_pass_refuses_mismatched_use():
    x, features, weight = random_classification()
    acc = streamed(x, LABELS, features, num_classes=NUM_CLASSES)
    acc.finalize_means(weight)
    with pytest.raises(RuntimeError, match="statistics are final"):
        acc.update(x, labels=LABELS)
    acc.update_nc4(features[:4])
    with pytest.raises(ValueError, match="same samples"):
        acc.compute()


# ---------------------------------------------------------------------------------------------------------------
# Spectral decay


def tokens_with_spectrum(variances, dim=10, n=240, seed=0):
    """Tokens (n/6, 6, dim) whose covariance has exactly these eigenvalues (the rest zero), offset far away."""
    g = torch.Generator().manual_seed(seed)
    directions, _ = torch.linalg.qr(torch.randn(dim, len(variances), generator=g, dtype=torch.float64))
    raw = torch.randn(n, len(variances), generator=g, dtype=torch.float64)
    white, _ = torch.linalg.qr(raw - raw.mean(dim=0))  # centred, orthonormal columns: covariance exactly I / n
    coords = math.sqrt(n) * white * torch.tensor(variances, dtype=torch.float64).sqrt()
    return (OFFSET + coords @ directions.T).reshape(n // 6, 6, dim)


def test_pcs_for_variance_counts_directions_of_a_known_spectrum():
    assert pcs_for_variance(tokens_with_spectrum([4.0, 3.0, 2.0, 1.0])) == 4  # rank 4 of 10

    # Cumulative shares 50, 80, 90, 95, 98, 99.5, 100 %.
    x = tokens_with_spectrum([50.0, 30.0, 10.0, 5.0, 3.0, 1.5, 0.5])
    assert pcs_for_variance(x) == 6
    assert pcs_for_variance(x, fraction=0.97) == 5
    assert pcs_for_variance(x, fraction=0.6) == 2
    acc = streamed(x, sizes=(7, 11))
    assert acc.compute()["pcs99"] == 6
    assert acc.pcs_for_variance(0.85) == 3


# ---------------------------------------------------------------------------------------------------------------
# Language collapse


def language_batch(seed=0):
    """Tokens (5, 12, 3) and next-token targets with frequencies 20, 15, 10, 6, ... so the top 3 are 4, 7, 1."""
    g = torch.Generator().manual_seed(seed)
    targets = torch.tensor([4] * 20 + [7] * 15 + [1] * 10 + [9] * 6 + [0] * 5 + [2] * 4)
    targets = targets[torch.randperm(60, generator=g)].reshape(5, 12)
    centres = torch.randn(10, 3, generator=g, dtype=torch.float64)
    return OFFSET + centres[targets] + 0.01 * torch.randn(5, 12, 3, generator=g, dtype=torch.float64), targets


def test_language_collapse_matches_explicit_loops():
    x, targets = language_batch()
    counts = {}
    for t in targets.flatten().tolist():
        counts[t] = counts.get(t, 0) + 1
    top = sorted(counts, key=lambda t: -counts[t])[:3]
    assert sorted(top) == [1, 4, 7]
    subset = [(x[b, i], int(targets[b, i])) for b in range(5) for i in range(12) if int(targets[b, i]) in top]
    n = len(subset)
    mean = {t: sum(v for v, u in subset if u == t) / counts[t] for t in top}
    global_mean = sum(v for v, _ in subset) / n
    within = sum(sq(v - mean[t]) for v, t in subset) / n
    between = sum(sq(mean[t] - global_mean) for _, t in subset) / n
    total = sum(sq(v - global_mean) for v, _ in subset) / n
    sigma_w = sum(np.outer(v - mean[t], v - mean[t]) for v, t in subset) / n
    sigma_b = sum(np.outer(mean[t] - global_mean, mean[t] - global_mean) for t in top) / len(top)
    nc1 = np.trace(sigma_w @ np.linalg.pinv(sigma_b, rcond=1e-6, hermitian=True)) / len(top)

    got = language_collapse(x, targets, top_k=3)

    assert got["within_target_var"] == pytest.approx(within, rel=1e-10)
    assert got["between_target_var"] == pytest.approx(between, rel=1e-10)
    assert got["total_var"] == pytest.approx(total, rel=1e-10)
    assert got["between_target_frac"] == pytest.approx(between / total, rel=1e-10)
    assert got["target_nc1"] == pytest.approx(nc1, rel=1e-8)
    assert got["within_target_var"] + got["between_target_var"] == pytest.approx(got["total_var"], rel=1e-12)


def test_language_collapse_streaming_agrees_with_one_shot():
    x, targets = language_batch()
    top = most_frequent_targets(targets, top_k=3)
    assert top.tolist() == [4, 7, 1]
    expected = {
        ("target_total_var" if key == "total_var" else key): value
        for key, value in language_collapse(x, targets, top_k=3).items()
    }
    assert_metrics_close(streamed(x, targets=targets, sizes=(2, 1), target_ids=top).compute(), expected)
    merged = streamed(x[:2], targets=targets[:2], target_ids=top, seed=1)
    merged.merge(streamed(x[2:], targets=targets[2:], target_ids=top, seed=2))
    assert_metrics_close(merged.compute(), expected)


# ---------------------------------------------------------------------------------------------------------------
# PCA picture


def test_pca_projection_of_a_plane_keeps_distances():
    g = torch.Generator().manual_seed(0)
    plane, _ = torch.linalg.qr(torch.randn(5, 2, generator=g, dtype=torch.float64))
    coords = torch.randn(40, 2, generator=g, dtype=torch.float64) * torch.tensor([3.0, 1.0], dtype=torch.float64)
    x = (OFFSET + coords @ plane.T).reshape(8, 5, 5)
    token_index = torch.arange(40).reshape(8, 5)

    points, labels = pca_projection(x, token_index, num_points=15, seed=3)

    assert points.shape == (15, 2) and len(set(labels.tolist())) == 15
    original = x.reshape(40, 5)[labels].numpy()
    distances = lambda p: np.linalg.norm(p[:, None] - p[None], axis=-1)  # noqa: E731
    np.testing.assert_allclose(distances(points), distances(original), atol=1e-9)


def test_pca_reservoir_is_seeded_and_independent_of_batching():
    x = clustered_tokens(LABELS)
    points, labels = pca_projection(x, LABELS, num_points=20, seed=5)
    again, again_labels = pca_projection(x, LABELS, num_points=20, seed=5)
    np.testing.assert_array_equal(points, again)
    np.testing.assert_array_equal(labels, again_labels)
    assert not np.allclose(pca_projection(x, LABELS, num_points=20, seed=6)[0], points)

    for sizes in ((1,), (3, 4)):
        acc = streamed(x, LABELS, sizes=sizes, num_classes=NUM_CLASSES, reservoir_size=20, seed=5)
        stream_points, stream_labels = acc.pca_projection()
        np.testing.assert_allclose(stream_points, points, rtol=1e-9, atol=1e-9)
        np.testing.assert_array_equal(stream_labels, labels)


# ---------------------------------------------------------------------------------------------------------------
# Data-parallel workers


def everything_data():
    x, features, weight = random_classification(seed=7)
    targets = torch.randint(0, 4, x.shape[:2], generator=torch.Generator().manual_seed(7))
    return x, features, weight, targets


def worker_accumulator(rank):
    x, features, weight, targets = everything_data()
    shard = slice(0, 4) if rank == 0 else slice(4, None)
    return GeometryAccumulator(
        x.shape[-1], NUM_CLASSES, target_ids=torch.tensor([0, 2, 3]), reservoir_size=12, seed=rank
    ), (x[shard], LABELS[shard], features[shard], targets[shard]), weight


def distributed_worker(rank, world_size, init_file, out_file):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    acc, (x, labels, features, targets), weight = worker_accumulator(rank)
    acc.update(x, labels=labels, features=features, targets=targets)
    acc.all_reduce_()
    acc.finalize_means(weight)
    acc.update_nc4(features)
    acc.all_reduce_()
    if rank == 0:
        torch.save({"metrics": acc.compute(), "reservoir": acc.pca_projection()}, out_file)
    dist.destroy_process_group()


def test_all_reduce_over_two_gloo_workers_equals_one_shot(tmp_path):
    out_file = tmp_path / "rank0.pt"
    mp.spawn(distributed_worker, args=(2, str(tmp_path / "init"), str(out_file)), nprocs=2, join=True)
    result = torch.load(out_file, weights_only=False)

    x, features, weight, targets = everything_data()
    expected = variance_decomposition(x, LABELS)
    expected.update(neural_collapse(features, LABELS, weight))
    language = language_collapse(x, targets, target_ids=torch.tensor([0, 2, 3]))
    expected.update({("target_total_var" if k == "total_var" else k): v for k, v in language.items()})
    expected["total_var"] = variance_decomposition(x, LABELS)["total_var"]
    assert_metrics_close(result["metrics"], expected)

    # The gathered reservoir is the one merging the workers' accumulators in-process gives.
    local = []
    for rank in range(2):
        acc, (xs, labels, feats, tgts), _ = worker_accumulator(rank)
        acc.update(xs, labels=labels, features=feats, targets=tgts)
        local.append(acc)
    merged_points, merged_labels = local[0].merge(local[1]).pca_projection()
    np.testing.assert_allclose(result["reservoir"][0], merged_points, rtol=1e-9, atol=1e-9)
    np.testing.assert_array_equal(result["reservoir"][1], merged_labels)
