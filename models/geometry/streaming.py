"""Token geometry in streaming form: ``GeometryAccumulator`` gives the definitions of reference.py over a stream
of batches, in one pass and bounded memory, mergeable across data-parallel workers.

Everything is accumulated in float64. Sums are taken around a shift per group (its first batch's mean) and re-based
exactly when shards merge, so features far from the origin (an offset of 1e3, say) keep their variances.

Streaming in data-parallel workers (one accumulator per worker, seeds differing per worker for the reservoir)::

    acc = GeometryAccumulator(dim, num_classes=C, seed=seed + rank, device=device)
    for batch in shard: acc.update(out.tokens, labels=y, features=out.feature)
    acc.all_reduce_()                         # every worker now holds the statistics of all shards
    acc.finalize_means(model.classifier_weight, model.classifier_bias)
    for batch in shard: acc.update_nc4(out.feature)   # NC4 needs the final class centres: a second pass
    acc.all_reduce_()                         # sums the NC4 counts only
    metrics = acc.compute()

For language models pass ``target_ids=most_frequent_targets(...)`` and ``update(tokens, targets=next_tokens)``.
"""

from __future__ import annotations

import copy
import math

import numpy as np
import torch
import torch.distributed as dist

from models.geometry.finishing import (
    SPECTRAL_FRACTION,
    check_labels,
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
    top_two_components,
)


class GroupMoments:
    """First and second moments of vectors split into a fixed number of groups, summed around a shift per group.

    count (G,), shift (G, d), total = sum (x - shift_g) (G, d), sq = sum ||x - shift_g||^2 (G,) and, optionally,
    scatter = sum (x - shift_g)(x - shift_g)^T summed over all groups (d, d). A group's shift is its first batch's
    mean; moving to another shift is exact algebra (``rebased``), which is how shards with different shifts merge.
    """

    FIELDS = ("count", "shift", "total", "sq", "scatter")

    def __init__(self, num_groups: int, dim: int, with_scatter: bool, device: torch.device | str):
        zeros = dict(dtype=torch.float64, device=device)
        self.count = torch.zeros(num_groups, **zeros)
        self.shift = torch.zeros(num_groups, dim, **zeros)
        self.total = torch.zeros(num_groups, dim, **zeros)
        self.sq = torch.zeros(num_groups, **zeros)
        self.scatter = torch.zeros(dim, dim, **zeros) if with_scatter else None

    def update(self, x: torch.Tensor, group: torch.Tensor) -> None:
        num_groups = len(self.count)
        batch_count = torch.bincount(group, minlength=num_groups).to(x.dtype)
        batch_sum = torch.zeros_like(self.total).index_add_(0, group, x)
        first_seen = (self.count == 0) & (batch_count > 0)
        self.shift = torch.where(first_seen[:, None], batch_sum / batch_count.clamp_min(1)[:, None], self.shift)
        shifted = x - self.shift[group]
        self.count += batch_count
        self.total.index_add_(0, group, shifted)
        self.sq.index_add_(0, group, squared_norms(shifted))
        if self.scatter is not None:
            self.scatter += shifted.T @ shifted

    def rebased(self, shift: torch.Tensor) -> GroupMoments:
        """The same moments summed around ``shift`` (G, d): x - new = (x - old) + delta."""
        delta = self.shift - shift
        moved = copy.copy(self)
        moved.count, moved.shift = self.count.clone(), shift.clone()
        moved.total = self.total + self.count[:, None] * delta
        moved.sq = self.sq + 2 * (self.total * delta).sum(dim=1) + self.count * squared_norms(delta)
        if self.scatter is not None:
            cross = self.total.T @ delta
            moved.scatter = self.scatter + cross + cross.T + delta.T @ (self.count[:, None] * delta)
        return moved

    def merge_(self, other: GroupMoments) -> None:
        shift = torch.where((self.count > 0)[:, None], self.shift, other.shift)
        mine, theirs = self.rebased(shift), other.rebased(shift)
        self.count, self.shift = mine.count + theirs.count, shift
        self.total, self.sq = mine.total + theirs.total, mine.sq + theirs.sq
        if self.scatter is not None:
            self.scatter = mine.scatter + theirs.scatter

    def all_reduce_(self, group) -> None:
        # Summing needs one shift everywhere: the count-weighted mean of the workers' shifts stays near the data.
        count = self.count.clone()
        weighted_shift = self.shift * self.count[:, None]
        dist.all_reduce(count, group=group)
        dist.all_reduce(weighted_shift, group=group)
        moved = self.rebased(weighted_shift / count.clamp_min(1)[:, None])
        for tensor in (moved.total, moved.sq) + ((moved.scatter,) if moved.scatter is not None else ()):
            dist.all_reduce(tensor, group=group)
        self.count, self.shift, self.total, self.sq, self.scatter = (
            count, moved.shift, moved.total, moved.sq, moved.scatter
        )

    @property
    def present(self) -> torch.Tensor:
        return self.count > 0

    def means(self) -> torch.Tensor:
        """Means of the present groups, in group order."""
        present = self.present
        return self.shift[present] + self.total[present] / self.count[present, None]

    def within_sq(self) -> torch.Tensor:
        """sum over present groups of sum ||x - mu_g||^2."""
        present = self.present
        return (self.sq[present] - squared_norms(self.total[present]) / self.count[present]).sum()

    def within_scatter(self) -> torch.Tensor:
        """sum over groups of sum (x - mu_g)(x - mu_g)^T."""
        return self.scatter - self.total.T @ (self.total / self.count.clamp_min(1)[:, None])

    def state_dict(self, prefix: str) -> dict[str, torch.Tensor]:
        return {prefix + name: getattr(self, name) for name in self.FIELDS if getattr(self, name) is not None}

    def load_state_dict(self, state: dict[str, torch.Tensor], prefix: str) -> None:
        for name in self.FIELDS:
            if prefix + name in state:
                setattr(self, name, state[prefix + name].to(dtype=torch.float64, device=self.count.device).clone())


class _TokenReservoir:
    """A seeded uniform sample of at most ``size`` tokens: the tokens holding the smallest random keys so far.

    Kept sorted by key, padded with key +inf. Two samples merge exactly by keeping the smallest keys of both, so the
    merge does not depend on how the tokens were split among batches or workers (ties go to the earlier token).
    """

    def __init__(self, size: int, dim: int, seed: int, device: torch.device | str):
        self.generator = torch.Generator().manual_seed(seed)
        self.keys = torch.full((size,), math.inf, dtype=torch.float64, device=device)
        self.tokens = torch.zeros(size, dim, dtype=torch.float64, device=device)
        self.labels = torch.full((size,), -1, dtype=torch.long, device=device)

    def update(self, tokens: torch.Tensor, labels: torch.Tensor) -> None:
        keys = reservoir_keys(self.generator, len(tokens)).to(self.keys.device)
        candidates = torch.argsort(keys, stable=True)[: len(self.keys)]
        candidates = candidates[keys[candidates] < self.keys[-1]]
        self._keep_smallest(
            torch.cat([self.keys, keys[candidates]]),
            torch.cat([self.tokens, tokens[candidates]]),
            torch.cat([self.labels, labels[candidates]]),
        )

    def merge_(self, other: _TokenReservoir) -> None:
        self._keep_smallest(
            torch.cat([self.keys, other.keys]),
            torch.cat([self.tokens, other.tokens]),
            torch.cat([self.labels, other.labels]),
        )

    def all_gather_(self, group) -> None:
        world_size = dist.get_world_size(group)
        gathered = []
        for tensor in (self.keys, self.tokens, self.labels):
            parts = [torch.empty_like(tensor) for _ in range(world_size)]
            dist.all_gather(parts, tensor, group=group)
            gathered.append(torch.cat(parts))
        self._keep_smallest(*gathered)

    def _keep_smallest(self, keys: torch.Tensor, tokens: torch.Tensor, labels: torch.Tensor) -> None:
        order = torch.argsort(keys, stable=True)[: len(self.keys)]
        self.keys, self.tokens, self.labels = keys[order], tokens[order], labels[order]

    def sample(self) -> tuple[torch.Tensor, torch.Tensor]:
        filled = torch.isfinite(self.keys)
        return self.tokens[filled], self.labels[filled]


class GeometryAccumulator:
    """All token-geometry statistics of a stream of batches, in one pass and bounded memory.

    Memory is O(d^2 + C d + K d + reservoir_size d): d x d scatter matrices for the tokens, the features and the
    language-model target groups, per-class and per-target sums, and the token sample for the PCA picture.

    - ``dim``: token width d. ``num_classes``: enables the variance decomposition and neural collapse (labels must
      then be given in every batch). ``feature_dim``: width of the classifier's input (default ``dim``).
    - ``target_ids``: next-token targets whose tokens form the language-collapse groups. The top-K targets of a
      stream are only known at its end, and per-target sums over a whole vocabulary do not fit, so the groups are
      fixed up front: use ``most_frequent_targets`` on the evaluation targets (ids only, cheap) or on a frequency
      sample; ``language_collapse(..., target_ids=ids)`` gives the same numbers on data held in memory.
    - ``reservoir_size``, ``seed``: the PCA picture's token sample. Give each data-parallel worker its own seed.
    - ``device``: where the statistics live (a CUDA device for NCCL process groups).

    NC4 compares the classifier with the nearest class centre, and the centres are only known once every feature
    has been seen; per-sample features are not kept, so NC4 takes a second pass: ``finalize_means`` freezes the
    statistics, then ``update_nc4`` over the same features counts the disagreements exactly.
    """

    def __init__(
        self,
        dim: int,
        num_classes: int | None = None,
        *,
        feature_dim: int | None = None,
        target_ids: torch.Tensor | None = None,
        reservoir_size: int = 2048,
        seed: int = 0,
        device: torch.device | str = "cpu",
    ):
        self.dim = dim
        self.num_classes = num_classes
        self.device = torch.device(device)
        self.tokens = GroupMoments(1, dim, with_scatter=True, device=device)
        self.within_seq_sum = torch.zeros((), dtype=torch.float64, device=device)
        self.num_sequences = torch.zeros((), dtype=torch.float64, device=device)
        self.sequence_means = self.features = None
        if num_classes is not None:
            self.sequence_means = GroupMoments(num_classes, dim, with_scatter=False, device=device)
            self.features = GroupMoments(num_classes, feature_dim or dim, with_scatter=True, device=device)
        self.target_ids = self.targets = None
        if target_ids is not None:
            self.target_ids = torch.unique(target_ids.to(device=device, dtype=torch.long))
            self.targets = GroupMoments(len(self.target_ids), dim, with_scatter=True, device=device)
        self.reservoir = _TokenReservoir(reservoir_size, dim, seed, device)
        self.classifier_weight = None  # set by finalize_means: the second (NC4) pass has begun
        self.classifier_bias = None  # set with it (zeros for a classifier without one)
        self.nc4_counts = torch.zeros(2, dtype=torch.float64, device=device)  # disagreements, samples
        self._reduced_pass = None  # "statistics" or "nc4" once that pass was all-reduced

    # -- first pass ---------------------------------------------------------------------------------------------

    def update(
        self,
        tokens: torch.Tensor,
        labels: torch.Tensor | None = None,
        features: torch.Tensor | None = None,
        targets: torch.Tensor | None = None,
    ) -> None:
        """Add a batch: tokens (B, T, d); sequence labels (B,); classifier features (B, feature_dim); next-token
        targets (B, T). The reservoir colours tokens by label, else by target, else -1."""
        if self.classifier_weight is not None or self._reduced_pass is not None:
            raise RuntimeError("update() after finalize_means() or all_reduce_(): the statistics are final")
        x = tokens.detach().to(device=self.device, dtype=torch.float64)
        if x.ndim != 3 or x.shape[-1] != self.dim:
            raise ValueError(f"tokens must have shape (B, T, {self.dim}), got {tuple(x.shape)}")
        flat = x.reshape(-1, self.dim)
        self.tokens.update(flat, torch.zeros(len(flat), dtype=torch.long, device=self.device))
        seq_mean = x.mean(dim=1)
        self.within_seq_sum += squared_norms(x - seq_mean[:, None]).sum()
        self.num_sequences += len(x)
        token_labels = None
        if labels is not None:
            y = self._class_labels(labels, len(x))
            self.sequence_means.update(seq_mean, y)
            token_labels = y.repeat_interleave(x.shape[1])
        if features is not None:
            if labels is None:
                raise ValueError("update(features=...) needs the labels of the same batch")
            self.features.update(self._features(features, len(x)), y)
        if targets is not None:
            if self.targets is None:
                raise ValueError("update(targets=...) needs target_ids: build the accumulator with "
                                 "target_ids=most_frequent_targets(eval_targets, top_k)")
            if targets.shape != x.shape[:2]:
                raise ValueError(f"targets must have shape {tuple(x.shape[:2])}, got {tuple(targets.shape)}")
            targets = targets.to(self.device).reshape(-1)
            group, keep = target_groups(targets, self.target_ids)
            self.targets.update(flat[keep], group[keep])
            token_labels = targets if token_labels is None else token_labels
        if token_labels is None:
            token_labels = torch.full((len(flat),), -1, dtype=torch.long, device=self.device)
        self.reservoir.update(flat, token_labels)

    # -- second pass (NC4) --------------------------------------------------------------------------------------

    @property
    def needs_second_pass(self) -> bool:
        """True while NC4 is still to be counted: features were accumulated and finalize_means() not yet called."""
        return self.features is not None and bool(self.features.count.sum() > 0) and self.classifier_weight is None

    def finalize_means(self, classifier_weight: torch.Tensor, classifier_bias: torch.Tensor | None = None) -> None:
        """Freeze the first-pass statistics (all-reduced first, in data-parallel runs) and start the NC4 pass, which
        compares the decisions of the classifier W h + b (``classifier_bias`` None: b = 0) with the class centres."""
        if self.features is None or not self.features.count.sum() > 0:
            raise ValueError("finalize_means() needs features: pass update(features=..., labels=...) first")
        weight = classifier_weight.detach().to(device=self.device, dtype=torch.float64)
        expected = (self.num_classes, self.features.shift.shape[1])
        if tuple(weight.shape) != expected:
            raise ValueError(f"classifier_weight must have shape {expected}, got {tuple(weight.shape)}")
        self.classifier_bias = float64_bias(classifier_bias, weight)
        self.classifier_weight = weight
        self._reduced_pass = None

    def update_nc4(self, features: torch.Tensor) -> None:
        """Second pass: count where the classifier's decision and the nearest class centre disagree."""
        if self.classifier_weight is None:
            raise RuntimeError("update_nc4() before finalize_means()")
        if self._reduced_pass == "nc4":
            raise RuntimeError("update_nc4() after the NC4 counts were all-reduced")
        h = self._features(features, len(features))
        centres = self.features.means()
        mismatches = classifier_centre_mismatches(
            h, self.classifier_weight, self.classifier_bias, centres, self._present_classes(), self._feature_mean()
        )
        self.nc4_counts += torch.stack([mismatches.to(torch.float64), torch.tensor(float(len(h)), device=h.device)])

    # -- merging ------------------------------------------------------------------------------------------------

    def merge(self, other: GeometryAccumulator) -> GeometryAccumulator:
        """Add another worker's accumulator (same configuration, same pass) into this one; returns self."""
        if (self.classifier_weight is None) != (other.classifier_weight is None):
            raise ValueError("merge(): one accumulator is in the NC4 pass and the other is not")
        if self.classifier_weight is not None:
            if not torch.equal(self.features.means(), other.features.means().to(self.device)):
                raise ValueError("merge(): NC4 passes must share the same (all-reduced) class centres")
            self.nc4_counts += other.nc4_counts.to(self.device)
            return self
        other = other if other.device == self.device else GeometryAccumulator.from_state_dict(
            other.state_dict(), device=self.device
        )
        for mine, theirs in self._moments_pairs(other):
            mine.merge_(theirs)
        self.within_seq_sum += other.within_seq_sum
        self.num_sequences += other.num_sequences
        self.reservoir.merge_(other.reservoir)
        return self

    def all_reduce_(self, group=None) -> GeometryAccumulator:
        """Sum this pass over the process group (a no-op without torch.distributed): the first-pass statistics
        before finalize_means(), the NC4 counts after it. Every worker ends up with the same accumulator."""
        if not (dist.is_available() and dist.is_initialized()):
            return self
        current_pass = "statistics" if self.classifier_weight is None else "nc4"
        if self._reduced_pass == current_pass:
            raise RuntimeError(f"all_reduce_() twice on the {current_pass} pass would count every worker again")
        if current_pass == "nc4":
            dist.all_reduce(self.nc4_counts, group=group)
        else:
            for moments in self._moments():
                moments.all_reduce_(group)
            sums = torch.stack([self.within_seq_sum, self.num_sequences])
            dist.all_reduce(sums, group=group)
            self.within_seq_sum, self.num_sequences = sums[0].clone(), sums[1].clone()
            self.reservoir.all_gather_(group)
        self._reduced_pass = current_pass
        return self

    # -- results ------------------------------------------------------------------------------------------------

    def compute(self, classifier_weight: torch.Tensor | None = None) -> dict[str, float]:
        """The one-shot numbers over everything accumulated: total_var, within_seq_var, pcs99; with labels the
        class split; with features NC1-NC2 (NC3 with a classifier weight, NC4 after the second pass); with
        targets the language collapse, its subset total named ``target_total_var``."""
        num_tokens = self.tokens.count[0]
        if num_tokens == 0:
            raise ValueError("compute() before any update()")
        global_mean = self.tokens.means()[0]
        total = self.tokens.within_sq() / num_tokens
        metrics = {
            "total_var": total.item(),
            "within_seq_var": (self.within_seq_sum / num_tokens).item(),
            "pcs99": self.pcs_for_variance(SPECTRAL_FRACTION),
        }
        if self.sequence_means is not None and self.sequence_means.count.sum() > 0:
            metrics.update(self._class_split(global_mean, total))
        if self.features is not None and self.features.count.sum() > 0:
            metrics.update(self._collapse(classifier_weight))
        if self.targets is not None:
            metrics.update(self._language_collapse())
        return metrics

    def pcs_for_variance(self, fraction: float = SPECTRAL_FRACTION) -> int:
        return pcs_from_covariance(self._token_covariance(), fraction)

    def pca_projection(self) -> tuple[np.ndarray, np.ndarray]:
        """The reservoir's tokens projected on the top two principal components of all tokens: points (m, 2),
        labels (m,), in the order of ``pca_projection(tokens, labels, reservoir_size, seed)``."""
        basis = top_two_components(self._token_covariance())
        tokens, labels = self.reservoir.sample()
        points = (tokens - self.tokens.means()[0]) @ basis
        return points.cpu().numpy(), labels.cpu().numpy()

    # -- shipping between processes -----------------------------------------------------------------------------

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Plain tensors (the configuration is read back from their shapes)."""
        state = {"within_seq_sum": self.within_seq_sum, "num_sequences": self.num_sequences}
        state.update(self.tokens.state_dict("tokens."))
        if self.sequence_means is not None:
            state.update(self.sequence_means.state_dict("sequence_means."))
            state.update(self.features.state_dict("features."))
        if self.targets is not None:
            state["target_ids"] = self.target_ids
            state.update(self.targets.state_dict("targets."))
        state.update({
            "reservoir.keys": self.reservoir.keys,
            "reservoir.tokens": self.reservoir.tokens,
            "reservoir.labels": self.reservoir.labels,
            "reservoir.generator": self.reservoir.generator.get_state(),
        })
        if self.classifier_weight is not None:
            state["classifier_weight"] = self.classifier_weight
            state["classifier_bias"] = self.classifier_bias
            state["nc4_counts"] = self.nc4_counts
        return {name: tensor.detach().clone() for name, tensor in state.items()}

    @classmethod
    def from_state_dict(
        cls, state: dict[str, torch.Tensor], device: torch.device | str | None = None
    ) -> GeometryAccumulator:
        device = state["tokens.count"].device if device is None else device
        num_classes = len(state["sequence_means.count"]) if "sequence_means.count" in state else None
        acc = cls(
            dim=state["tokens.scatter"].shape[0],
            num_classes=num_classes,
            feature_dim=state["features.scatter"].shape[0] if num_classes is not None else None,
            target_ids=state.get("target_ids"),
            reservoir_size=len(state["reservoir.keys"]),
            device=device,
        )
        acc.within_seq_sum = state["within_seq_sum"].to(device).clone()
        acc.num_sequences = state["num_sequences"].to(device).clone()
        for prefix, moments in (("tokens.", acc.tokens), ("sequence_means.", acc.sequence_means),
                                ("features.", acc.features), ("targets.", acc.targets)):
            if moments is not None:
                moments.load_state_dict(state, prefix)
        acc.reservoir.keys = state["reservoir.keys"].to(device).clone()
        acc.reservoir.tokens = state["reservoir.tokens"].to(device).clone()
        acc.reservoir.labels = state["reservoir.labels"].to(device).clone()
        acc.reservoir.generator.set_state(state["reservoir.generator"].cpu())
        if "classifier_weight" in state:
            acc.classifier_weight = state["classifier_weight"].to(device).clone()
            acc.classifier_bias = float64_bias(state.get("classifier_bias"), acc.classifier_weight)
            acc.nc4_counts = state["nc4_counts"].to(device).clone()
        return acc

    # -- internals ----------------------------------------------------------------------------------------------

    def _moments(self) -> list[GroupMoments]:
        return [m for m in (self.tokens, self.sequence_means, self.features, self.targets) if m is not None]

    def _moments_pairs(self, other: GeometryAccumulator) -> list[tuple[GroupMoments, GroupMoments]]:
        mine, theirs = self._moments(), other._moments()
        if [m.shift.shape for m in mine] != [m.shift.shape for m in theirs]:
            raise ValueError("merge(): accumulators were built with different dim/num_classes/target_ids")
        if self.targets is not None and not torch.equal(self.target_ids, other.target_ids):
            raise ValueError("merge(): accumulators were built with different target_ids")
        return list(zip(mine, theirs))

    def _class_labels(self, labels: torch.Tensor, batch_size: int) -> torch.Tensor:
        if self.num_classes is None:
            raise ValueError("update(labels=...) needs num_classes in GeometryAccumulator(...)")
        labels = labels.to(device=self.device, dtype=torch.long)
        if labels.shape != (batch_size,):
            raise ValueError(f"labels must have shape ({batch_size},), got {tuple(labels.shape)}")
        check_labels(labels, self.num_classes)
        return labels

    def _features(self, features: torch.Tensor, batch_size: int) -> torch.Tensor:
        h = features.detach().to(device=self.device, dtype=torch.float64)
        feature_dim = self.features.shift.shape[1]
        if h.shape != (batch_size, feature_dim):
            raise ValueError(f"features must have shape ({batch_size}, {feature_dim}), got {tuple(h.shape)}")
        return h

    def _present_classes(self) -> torch.Tensor:
        return torch.nonzero(self.features.present).flatten()

    def _feature_mean(self) -> torch.Tensor:
        counts = self.features.count[self.features.present]
        return (counts[:, None] * self.features.means()).sum(dim=0) / counts.sum()

    def _token_covariance(self) -> torch.Tensor:
        return self.tokens.within_scatter() / self.tokens.count[0]

    def _class_split(self, global_mean: torch.Tensor, total: torch.Tensor) -> dict[str, float]:
        seqs = self.sequence_means
        if seqs.count.sum() != self.num_sequences:
            raise ValueError("labels were given for some batches only: give them with every update()")
        counts = seqs.count[seqs.present]
        between = (counts * squared_norms(seqs.means() - global_mean)).sum() / self.num_sequences
        return {
            "within_class_var": (seqs.within_sq() / self.num_sequences).item(),
            "between_class_var": between.item(),
            "between_class_frac": ratio(between, total),
        }

    def _collapse(self, classifier_weight: torch.Tensor | None) -> dict[str, float]:
        weight = self.classifier_weight
        if classifier_weight is not None:
            given = classifier_weight.detach().to(device=self.device, dtype=torch.float64)
            if weight is not None and not torch.equal(given, weight):
                raise ValueError("compute(classifier_weight=...) differs from the one given to finalize_means()")
            weight = given
        feats = self.features
        present = self._present_classes()
        metrics = collapse_metrics(
            feats.means(), feats.count[present], feats.within_scatter(), None if weight is None else weight[present]
        )
        if self.classifier_weight is not None:
            mismatches, samples = self.nc4_counts.tolist()
            if samples != feats.count.sum().item():
                raise ValueError(f"the NC4 pass saw {samples:.0f} features, the first pass "
                                 f"{feats.count.sum().item():.0f}: update_nc4() must see the same samples")
            metrics["nc4"] = mismatches / samples
        return metrics

    def _language_collapse(self) -> dict[str, float]:
        groups = self.targets
        n = groups.count.sum()
        if n == 0:
            return {("target_total_var" if k == "total_var" else k): v for k, v in empty_language_metrics().items()}
        means = groups.means()
        counts = groups.count[groups.present]
        global_mean = (counts[:, None] * means).sum(dim=0) / n
        between = (counts * squared_norms(means - global_mean)).sum() / n
        # The subset total straight from the sums, re-based on the subset mean (not as within + between).
        total = groups.rebased(global_mean.expand_as(groups.shift)).sq.sum() / n
        return {
            "within_target_var": (groups.within_sq() / n).item(),
            "between_target_var": between.item(),
            "target_total_var": total.item(),
            "between_target_frac": ratio(between, total),
            "target_nc1": nc1(groups.within_scatter() / n, means - global_mean),
        }
