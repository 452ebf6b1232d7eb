"""What one kind of training computes, as the task-agnostic Train loop (`study/loop.py`) sees it.

A task is a `Task` subclass in its own module under `study/tasks/`, registered by name in `study/tasks/__init__.py`.
It owns everything that differs between kinds of training: the batch key the model reads, the training loss, the
throughput counters, the evaluation's sums and metrics, the token-geometry accumulator and the metric names it
logs. The loop owns what they share: the optimiser and schedule, checkpoints, reports to Ray and logging to MLflow.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, replace
from typing import Any, Callable, ClassVar, Iterable, Iterator

import numpy as np
import torch
from pydantic import BaseModel, Field

import models
from models.base import MixerModel
from models.geometry import GeometryAccumulator
from study.schema import StrictModel
from study.worker import Worker


class GeometrySpec(StrictModel):
    """When and how much token geometry (models.geometry) each run computes on the validation split."""

    every: int = Field(0, ge=0, description="also compute geometry every N epochs (0: only after the last epoch)")
    at_epochs: tuple[int, ...] = Field((), description="also at these epochs: the study's ASHA rungs, so that a "
                                                       "trial stopped there has its geometry at the epoch it was "
                                                       "judged")
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
    # ViTs judged on patch features: the PCA picture of patch tokens (models.geometry.patch_pca_rgb, (B, h, w, 3))
    # and the images it was computed on ((B, H, W, 3) in [0, 1]); None where a task draws none.
    patch_rgb: np.ndarray | None = None
    images: np.ndarray | None = None


@dataclass(frozen=True)
class StepSettings:
    """What an optimiser step needs besides the state and the batch (the same for a whole epoch)."""

    autocast: Any  # the precision context
    grad_clip: float  # clip the gradients' norm to this (0: off)
    steps_per_epoch: int
    epochs: int  # of this stage: with steps_per_epoch, the length of every schedule


@dataclass(frozen=True)
class Evaluation:
    metrics: dict[str, float]
    pictures: GeometryPictures | None = None  # at geometry epochs


def load_carried(model: torch.nn.Module, carried: dict) -> None:
    """`carried` (what the stage before carried forward) into `model`, which this stage built from its own data: a
    shape that differs means the stages' data disagree, said as such rather than as a bare size mismatch."""
    try:
        model.load_state_dict(carried)
    except RuntimeError as exc:
        mismatch = next((line.strip() for line in str(exc).splitlines() if "size mismatch" in line), str(exc))
        raise ValueError(f"this stage's data shapes the model unlike the stage before ({mismatch}): every stage's "
                         "data must give the same vocab_size, context_length and image keys (for language models, "
                         "`chat_tokens: true` on a pre-training text source keeps the chat tokens in its vocabulary)"
                         ) from None


class NodeCounts:
    """S_eff of every gated layer of `model` (STLT) over the forwards run inside `counting()`, on every worker:
    `metrics()` gives `stlt_s_eff_<layer>` = active (row, node) pairs / rows of those forwards
    (models.MixerModel.counting_active_nodes). Nothing for the wrappers of a frozen backbone or of DINO's networks
    (not MixerModels), whose `mixer_stats` report nothing of their layers either."""

    def __init__(self, model: torch.nn.Module, worker: Worker):
        self.model, self.worker = model, worker
        self.sums: dict[str, torch.Tensor] = {}
        with self.counting():  # every gated layer at zero: a worker whose shard is empty joins the all-reduce too
            pass

    @contextmanager
    def counting(self) -> Iterator[None]:
        if not isinstance(self.model, MixerModel):
            yield
            return
        with self.model.counting_active_nodes() as counts:
            yield
        for name, count in counts.items():
            self.sums[name] = self.sums.get(name, 0) + count

    def metrics(self, suffix: str = "") -> dict[str, float]:
        """S_eff per layer over all workers (an all-reduce: every worker calls it), named with `suffix` after it."""
        if not self.sums:  # the same layers on every worker: all of them join the all-reduce, or none
            return {}
        totals = self.worker.all_reduce(torch.stack(list(self.sums.values())))
        return {f"{name}{suffix}": active / rows if rows else math.nan
                for name, (active, rows) in zip(self.sums, totals.tolist())}


class Task(ABC):
    """One kind of training on one Train worker: subclasses set the class attributes and implement the abstract
    methods, and `loss`, `eval_sums` and `eval_metrics` for the `train_step` and `evaluate` they share (a task with
    a step or an evaluation of its own overrides those instead)."""

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
    # The task's own hyperparameters, beside the model and training keys (a pydantic model; None: it has none).
    options: ClassVar[type[BaseModel] | None] = None
    # In a later stage of a run, which starts from the model the stage before carried forward: the model keys this
    # task's data sets anew (a probe's classes), and those the carried model keeps whatever the data says (a frozen
    # backbone's image size: images of another size are read through resized position embeddings).
    data_sets: ClassVar[frozenset[str]] = frozenset()
    carried_sets: ClassVar[frozenset[str]] = frozenset()
    # Also evaluate the untrained model, logged to MLflow at the stage's first step (a self-supervised task's k-NN
    # at initialisation is the baseline its training must beat).
    evaluate_before_training: ClassVar[bool] = False
    # Training keys its own code reads beside those of every run (TrainConfig.read_keys): classification's `loss`.
    reads_training: ClassVar[frozenset[str]] = frozenset()
    # It sets the learning rate itself from `lr`, `warmup_epochs` and `min_lr_ratio` (DINO's cosine), so the
    # run's schedule (`lr_decay`) is not read.
    own_lr_schedule: ClassVar[bool] = False

    @classmethod
    def epoch_metrics(cls, dataset=None) -> tuple[str, ...]:
        """What every epoch reports: the metrics a sampler or ASHA may optimise (with `dataset`, a DatasetConfig,
        also those its data adds)."""
        return (*cls.quality_metrics, "train_loss", *(f"{name}_per_s" for name in cls.throughput), "num_params")

    @classmethod
    def option_values(cls, hyperparameters: dict) -> dict:
        """The task's own keys among `hyperparameters` (checked by the run config's validation)."""
        fields = cls.options.model_fields if cls.options is not None else {}
        return {key: value for key, value in hyperparameters.items() if key in fields}

    @classmethod
    def build_model(cls, resolved, carried: dict | None) -> torch.nn.Module:
        """The module this task trains, from the stage's resolved hyperparameters (study/runspec.py's `Resolved`:
        its model `config`, flat `model` and task `options`, each validated once). `carried`: what the run's
        previous stage carried forward (`carry`), None in a run's first stage."""
        model = models.build_model(resolved.config)
        if carried is not None:
            load_carried(model, carried)
        return model

    def __init__(self, model: torch.nn.Module, worker: Worker, *, seed: int, geometry: GeometrySpec, resolved):
        """`model`: what `build_model` built (unwrapped); `resolved`: the stage's resolved hyperparameters
        (`Resolved`), whose `options` are this task's, validated."""
        self.model, self.worker, self.seed, self.geometry = model, worker, seed, geometry
        self.hyperparameters = resolved.hyperparameters
        self.option = resolved.options

    def carry(self) -> dict:
        """What a next stage of the run starts from: the model's state (a task whose module holds parts the next
        stage does not use carries only the part it does)."""
        return self.model.state_dict()

    def setup(self, eval_batches: Callable[[str], Iterable[dict]]) -> None:
        """Once per worker before the first epoch; `eval_batches(split)` streams this worker's shard of an
        evaluated split ("val", or another its data gives: `eval_batches.names`), as evaluated (study/loop.py's
        EvalSplits)."""

    # ---- training -------------------------------------------------------------------------------------------------

    def loss(self, model: torch.nn.Module, batch: dict) -> torch.Tensor:
        """The training loss of a batch (`model` may be the DDP-wrapped model), for `train_step`."""
        raise NotImplementedError(f"task {self.name}: loss() or a train_step() of its own")

    def train_step(self, state, batch: dict, settings: StepSettings) -> torch.Tensor:
        """One optimiser step on a batch (`state`: the run's TrainState); returns the task loss, detached. This
        one: the task's loss plus the model's own regulariser, backward, gradient-norm clipping, then the
        optimiser and its schedule. A task that trains otherwise (a teacher updated after the step, say) overrides
        it."""
        state.model.set_training_step(state.step, settings.steps_per_epoch * settings.epochs)
        with settings.autocast:
            loss = self.loss(state.trained, batch)
        total = loss + state.model.regularization_loss()
        state.optimizer.zero_grad(set_to_none=True)
        total.backward()
        if settings.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(state.trained.parameters(), settings.grad_clip)
        state.optimizer.step()
        state.scheduler.step()
        state.step += 1
        return loss.detach()

    def count(self, batch: dict) -> dict[str, int]:
        """This batch's share of the throughput counters (`throughput`)."""
        return {"samples": len(batch[self.input_key])}

    # ---- evaluation -----------------------------------------------------------------------------------------------

    def eval_sums(self, logits: torch.Tensor, batch: dict) -> torch.Tensor:
        """This batch's contribution to the evaluation sums, float64 in the order of `sum_names` (for `evaluate`)."""
        raise NotImplementedError(f"task {self.name}: eval_sums() or an evaluate() of its own")

    def eval_metrics(self, sums: dict[str, float]) -> dict[str, float]:
        """The quality metrics from the sums over every validation row of every worker (for `evaluate`)."""
        raise NotImplementedError(f"task {self.name}: eval_metrics() or an evaluate() of its own")

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
        nodes = self.node_counts()
        with torch.no_grad(), nodes.counting():
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
        return self.finish_evaluation({**metrics, **nodes.metrics()}, last, layers)

    def node_counts(self) -> NodeCounts:
        """A count of the gated layers' active nodes over the forwards an evaluation chooses (S_eff)."""
        return NodeCounts(self.model, self.worker)

    def finish_evaluation(self, metrics: dict[str, float], last: GeometryAccumulator | None,
                          layers: list[GeometryAccumulator], patches=None) -> Evaluation:
        """An evaluation pass's `metrics` with, where it gathered geometry (`last` is not None), the last layer's
        and every layer's geometry and the pictures; `patches` (a PatchGeometry) adds the patch spectrum and the
        PCA picture of patch features."""
        if last is None:
            return Evaluation(metrics)
        values, pictures = self.finish_geometry(last)
        if patches is not None:
            spectrum, rgb, images = patches.finish()
            values.update(spectrum)
            pictures = replace(pictures, patch_rgb=rgb, images=images)
        metrics.update({f"geom_{name}": values[name] for name in self.geometry_metrics})
        for layer, accumulator in enumerate(layers):
            values = accumulator.all_reduce_().compute()
            metrics.update({f"geom_l{layer}_{name}": values[name] for name in self.layer_geometry_metrics})
        return Evaluation(metrics, pictures)

    def _reservoir_seed(self) -> int:
        """The PCA picture's token sample: its own stream per worker, the same for every run of this seed."""
        return self.seed * 1000 + self.worker.rank
