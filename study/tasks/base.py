"""What one kind of training computes, as the task-agnostic Train loop (`study/loop.py`) sees it.

A task is a `Task` subclass in its own module under `study/tasks/`, registered by name in `study/tasks/__init__.py`.
It owns everything that differs between kinds of training: the batch key the model reads, the training loss, the
throughput counters, the evaluation's sums and metrics, the token-geometry accumulator and the metric names it
logs. The loop owns what they share: the optimiser and schedule, checkpoints, reports to Ray and logging to MLflow.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Callable, ClassVar, Iterable

import numpy as np
import torch
from pydantic import BaseModel, ConfigDict, Field

from models.geometry import GeometryAccumulator
from study.worker import Worker


class GeometrySpec(BaseModel):
    """When and how much token geometry (models.geometry) each run computes on the validation split."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    every: int = Field(0, ge=0, description="also compute geometry every N epochs (0: only after the last epoch)")
    at_epochs: tuple[int, ...] = Field((), description="also at these epochs: the study's ASHA rungs, so that a "
                                                       "trial stopped there has its geometry at the epoch it was judged")
    max_batches: int | None = Field(None, ge=1, description="validation batches used for geometry (None: all)")
    top_targets: int = Field(32, ge=2, description="language models: tokens grouped by their K most frequent targets")
    pca_points: int = Field(2000, ge=10, description="tokens in the seeded reservoir drawn in geometry/pca.png")

    def due(self, epoch: int, epochs: int) -> bool:
        return epoch == epochs or (self.every > 0 and epoch % self.every == 0) or epoch in self.at_epochs


@dataclass(frozen=True)
class GeometryPictures:
    """What the geometry pictures of one evaluation draw: a token sample on the top two principal components,
    coloured by `label_name`, and the variance split (`parts` add up to `total`)."""

    points: np.ndarray
    labels: np.ndarray
    label_name: str
    parts: dict[str, float]
    total: float


@dataclass(frozen=True)
class Evaluation:
    metrics: dict[str, float]
    pictures: GeometryPictures | None = None  # at geometry epochs


class Task(ABC):
    """One kind of training on one Train worker: subclasses set the class attributes and implement the abstract
    methods; `evaluate` is the pass they share."""

    name: ClassVar[str]
    model_family: ClassVar[str]  # the `models` family it trains ("vit", "gpt")
    data_kind: ClassVar[str]  # the kind of data it reads: the `kind` of the dataset sources it accepts
    input_key: ClassVar[str]  # the batch key the model reads
    sum_names: ClassVar[tuple[str, ...]]  # the evaluation's sums, added up over batches and workers
    quality_metrics: ClassVar[tuple[str, ...]]  # the evaluation's metrics (NaN for an epoch whose loss diverged)
    throughput: ClassVar[tuple[str, ...]] = ("samples",)  # counters reported per second, as `<name>_per_s`
    geometry_metrics: ClassVar[tuple[str, ...]]  # what it logs of the geometry, as `geom_<name>`
    layer_geometry_metrics: ClassVar[tuple[str, ...]]  # ... and of each layer's, as `geom_l<layer>_<name>`
    # The geometry a study's report sets against its metric and its parameters (the paper's claim: smoother tokens,
    # a larger between-group share and more collapse go with better accuracy).
    report_geometry: ClassVar[tuple[str, ...]]

    @classmethod
    def epoch_metrics(cls) -> tuple[str, ...]:
        """What every epoch reports: the metrics a sampler or ASHA may optimise."""
        return (*cls.quality_metrics, "train_loss", *(f"{name}_per_s" for name in cls.throughput), "num_params")

    def __init__(self, model: torch.nn.Module, worker: Worker, *, seed: int, geometry: GeometrySpec, loss: str = "ce"):
        """`loss`: the training loss the run config names (a task may offer several)."""
        self.model, self.worker, self.seed, self.geometry, self.loss_kind = model, worker, seed, geometry, loss

    def setup(self, val_batches: Callable[[], Iterable[dict]]) -> None:
        """Once per worker before the first epoch; `val_batches()` streams this worker's validation shard."""

    # ---- training -------------------------------------------------------------------------------------------------

    @abstractmethod
    def loss(self, model: torch.nn.Module, batch: dict) -> torch.Tensor:
        """The training loss of a batch (`model` may be the DDP-wrapped model)."""

    def count(self, batch: dict) -> dict[str, int]:
        """This batch's share of the throughput counters (`throughput`)."""
        return {"samples": len(batch[self.input_key])}

    # ---- evaluation -----------------------------------------------------------------------------------------------

    @abstractmethod
    def eval_sums(self, logits: torch.Tensor, batch: dict) -> torch.Tensor:
        """This batch's contribution to the evaluation sums, float64 in the order of `sum_names`."""

    @abstractmethod
    def eval_metrics(self, sums: dict[str, float]) -> dict[str, float]:
        """The quality metrics from the sums over every validation row of every worker."""

    @abstractmethod
    def new_accumulator(self, layer: bool = False) -> GeometryAccumulator:
        """An empty accumulator for one evaluation (the same configuration on every worker): of the last layer,
        or of one layer (`layer`: only what `layer_geometry_metrics` needs)."""

    @abstractmethod
    def accumulate(self, accumulator: GeometryAccumulator, tokens: torch.Tensor, feature: torch.Tensor,
                   batch: dict, last: bool = False) -> None:
        """Add a batch: a layer's tokens (B, T, d) after the final norm and the feature the classifier would read
        of them; `last`: the last-layer accumulator's."""

    @abstractmethod
    def finish_geometry(self, accumulator: GeometryAccumulator) -> tuple[dict[str, float], GeometryPictures]:
        """All-reduce the accumulator over the workers, then its metrics (the keys of `geometry_metrics`) and
        pictures."""

    def evaluate(self, batches: Iterable[dict], *, autocast, geometry: bool) -> Evaluation:
        """One pass over this worker's validation shard (every row once over all workers): the quality metrics,
        and at geometry epochs, in the same pass, the token geometry of the first `geometry.max_batches` batches:
        of the last layer, and of every layer (each block's output through the final norm)."""
        model = self.model
        model.eval()
        sums = torch.zeros(len(self.sum_names), dtype=torch.float64)
        # Made before the first batch: a worker whose shard is empty still joins the collectives, with zeros.
        last = self.new_accumulator() if geometry else None
        layers = [self.new_accumulator(layer=True) for _ in model.blocks] if geometry else []
        with torch.no_grad():
            for index, batch in enumerate(batches):
                want = geometry and (self.geometry.max_batches is None or index < self.geometry.max_batches)
                with autocast, model.layer_outputs() if want else nullcontext([]) as outputs:
                    out = model(batch[self.input_key], return_features=want)
                sums += self.eval_sums((out.logits if want else out).float(), batch).cpu()
                if want:
                    self.accumulate(last, out.tokens, out.feature, batch, last=True)
                    for accumulator, tokens in zip(layers, outputs):
                        self.accumulate(accumulator, tokens, model.pool(tokens), batch)
        totals = self.worker.all_reduce(sums)
        metrics = self.eval_metrics(dict(zip(self.sum_names, totals.tolist())))
        if not geometry:
            return Evaluation(metrics)
        values, pictures = self.finish_geometry(last)
        metrics.update({f"geom_{name}": values[name] for name in self.geometry_metrics})
        for layer, accumulator in enumerate(layers):
            values = accumulator.all_reduce_().compute()
            metrics.update({f"geom_l{layer}_{name}": values[name] for name in self.layer_geometry_metrics})
        return Evaluation(metrics, pictures)

    def _reservoir_seed(self) -> int:
        """The PCA picture's token sample: its own stream per worker, the same for every run of this seed."""
        return self.seed * 1000 + self.worker.rank
