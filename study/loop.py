"""The Ray Train loop every trial (and `lapstudy train`) runs on each data-parallel worker; it knows no task by name.

Per epoch: train on this worker's Ray Data shard (seeded by (seed, epoch, rank), so a run restarted from a
checkpoint repeats exactly what an uninterrupted run would have done), evaluate on the validation shard (every row
once over all workers), at geometry epochs with the token geometry in the same pass, then rank 0 logs the epoch to
MLflow (step = epoch) and every worker reports it to Ray, rank 0 with the checkpoint. What differs between kinds of
training (loss, metrics, geometry) is the run's `Task` (study/tasks).
"""

from __future__ import annotations

import math
import os
import tempfile
import time
from collections import Counter
from contextlib import closing, nullcontext
from dataclasses import dataclass, field
from pathlib import Path

import ray
import torch

import models
from study.bookkeeping import BOOKKEEPING
from study.data.task_data import TRAIN
from study.evals.evaluate import evaluate_stage
from study.host import InProcessHost, TrainWorkerHost
from study.optim import build_optimizer, build_schedule, peak_lr
from study.plots import draw_geometry, draw_layer_history
from study.runspec import RunSpec, slow_lr_scale
from study.state import CHECKPOINT_FILE, TrainState
from study.tasks import StepSettings, Task, task_class
from study.tracking.run_logger import RunLogger, TrackingTarget, dataset_input, run_params
from study.worker import seed_everything
from study.yamlio import dump_yaml


@dataclass(frozen=True)
class StageContext:
    """Where a stage stands in its run (study/trial.py: run_stages)."""

    name: str | None = None  # None: the run's first stage, whose metrics keep their names
    epoch_offset: int = 0  # the epochs of the stages before it: its epoch e is the run's epoch offset + e
    carried_from: str | None = None  # path or URI of the previous stage's last checkpoint, whose `carry` it takes
    carried_metrics: dict = field(default_factory=dict)  # the earlier stages' final metrics, reported along

    def named(self, metrics: dict) -> dict:
        """A stage's metrics as the run reports them: `<stage>/<metric>` in a later stage."""
        if self.name is None:
            return metrics
        return {key if key in BOOKKEEPING else f"{self.name}/{key}": value for key, value in metrics.items()}

    def carried(self) -> dict | None:
        if self.carried_from is None:
            return None
        with ray.train.Checkpoint(self.carried_from).as_directory() as folder:  # fetched from object storage
            return torch.load(Path(folder) / CHECKPOINT_FILE, map_location="cpu", weights_only=False)["carry"]


@dataclass(frozen=True)
class LoopPlan:
    """Sizes worked out before the workers start (they fix the learning-rate schedule)."""

    steps_per_epoch: int
    batch_per_worker: int


def train_loop_per_worker(loop_config: dict) -> dict:
    """Train one stage; returns its last report (rank 0's is what `TorchTrainer.fit()` hands back)."""
    spec: RunSpec = loop_config["spec"]
    task_data = loop_config["task_data"]
    plan: LoopPlan = loop_config["plan"]
    target: TrackingTarget | None = loop_config["tracking"]
    stage: StageContext = loop_config["stage"]
    host: TrainWorkerHost | InProcessHost = loop_config["host"]
    allow_code_execution: bool = loop_config["allow_code_execution"]  # what the command line allowed
    worker = host.worker()
    torch.set_num_threads(spec.resources.threads)
    if worker.device.type == "cpu":
        torch.use_deterministic_algorithms(True, warn_only=True)

    seed_everything(spec.seed)  # the same initial weights on every worker
    task_type, resolved = task_class(spec.task), spec.resolved  # the stage's hyperparameters, validated once
    model = task_type.build_model(resolved, stage.carried())
    num_params = models.count_parameters(model)
    wrapped = host.prepare_model(model)
    optimizer = build_optimizer(model, spec.train, slow_lr_scale(resolved))
    state = TrainState(model, wrapped, optimizer,
                       build_schedule(optimizer, spec.train, plan.steps_per_epoch, spec.epochs))
    state.restore(host.latest_checkpoint(), worker.device)
    # Ray's records (not MLflow) say where each report came from: which checkpoint this worker group started from
    # (0: none), on which node and in which process rank 0 runs. That is how a restart after a lost node, worker
    # process or driver shows.
    origin = {"resumed_from_epoch": state.epoch, "worker_node_id": ray.get_runtime_context().get_node_id(),
              "worker_pid": os.getpid()}
    # Restarted after the last checkpoint, or after the epoch that diverged (a resumed study whose driver died before
    # Tune recorded the end): hand that final result to Tune again rather than train on from it.
    if state.epoch >= spec.epochs or (state.history and state.history[-1].get("diverged")):
        return _report(host, state, worker.rank,
                       {**stage.carried_metrics, **state.history[-1], "mlflow_run_id": state.mlflow_run_id, **origin})

    logger = _open_run(target, spec, num_params, task_data.params, state) if worker.rank == 0 else None
    task = task_type(model, worker, seed=spec.seed, geometry=spec.geometry, resolved=resolved)
    shards = {split: ray.train.get_dataset_shard(split) for split in task_data.splits}
    train_shard = shards["train"]
    eval_batches = EvalSplits(task_data, shards, 2 * plan.batch_per_worker, worker.device)
    task.setup(eval_batches)
    with closing(logger) if logger is not None else nullcontext():  # closing stops its system-metrics monitor
        if task.evaluate_before_training and state.epoch == 0:  # MLflow only: Tune's rows are epochs trained
            at_start = task.evaluate(eval_batches(), autocast=worker.autocast(spec.train.precision), geometry=False)
            if logger is not None:
                logger.log_epoch(stage.epoch_offset, stage.named(at_start.metrics))
        for epoch in range(state.epoch + 1, spec.epochs + 1):
            seed_everything(spec.seed, epoch, worker.rank)
            batches = task_data.train_batches(train_shard, batch_size=plan.batch_per_worker, epoch=epoch,
                                              seed=spec.seed, device=worker.device, rank=worker.rank)
            metrics = train_epoch(state, task, batches, spec, plan)
            metrics.update(epoch=epoch, num_params=num_params)
            pictures = None
            if math.isfinite(metrics["train_loss"]):
                evaluated = time.perf_counter()
                evaluation = task.evaluate(eval_batches(), autocast=worker.autocast(spec.train.precision),
                                           geometry=spec.geometry.due(epoch, spec.epochs))
                metrics.update(evaluation.metrics, eval_s=time.perf_counter() - evaluated, **model.mixer_stats())
                pictures = evaluation.pictures
                if epoch == spec.epochs and spec.evaluate and worker.rank == 0:
                    # The stage's benchmarks on the model it ended with (rank 0: the others wait at the report).
                    evaluated = time.perf_counter()
                    for evaluation in spec.evaluate:
                        metrics.update(evaluate_stage(model, evaluation, spec.dataset, seed=spec.seed,
                                                      allow_code_execution=allow_code_execution,
                                                      tokenizer=task_data.tokenizer))
                    metrics["benchmark_s"] = time.perf_counter() - evaluated
            else:
                # Stop at once: retrying from the checkpoint would diverge the same way. The study marks it failed.
                metrics.update({name: math.nan for name in task.quality_metrics}, diverged=1,
                               error=f"training diverged: train_loss is {metrics['train_loss']} at epoch {epoch}")
            state.epoch = epoch
            named = stage.named({**metrics, "epoch": stage.epoch_offset + epoch})
            state.history.append(named)
            if logger is not None:
                logger.log_epoch(named["epoch"], named)
                if "error" in metrics:
                    logger.set_tags({"lapstudy.error": metrics["error"]})
                if pictures is not None:
                    _log_pictures(logger, pictures, state.history, spec, stage)
            last = epoch == spec.epochs
            report = _report(host, state, worker.rank, {**stage.carried_metrics, **named, "stage": stage.name or "",
                                                        "mlflow_run_id": state.mlflow_run_id, **origin},
                             carry=task.carry() if last else None)
            if "diverged" in metrics:
                break
    return report


def _report(host: TrainWorkerHost | InProcessHost, state: TrainState, rank: int, metrics: dict,
            carry: dict | None = None) -> dict:
    """Report `metrics` (a barrier: every worker calls it); rank 0 attaches the checkpoint, so that a restart
    resumes from here."""
    if rank != 0:
        host.report(metrics)
        return metrics
    with tempfile.TemporaryDirectory() as folder:
        state.save(Path(folder), carry)
        host.report(metrics, Path(folder))
    return metrics


@dataclass(frozen=True)
class EvalSplits:
    """This worker's shards of the evaluated splits, as batches: `eval_splits(split)`; "val" by default, the others
    (`names`) for tasks that evaluate more than it."""

    task_data: object  # study.data.TaskData
    shards: dict
    batch_size: int  # validation rows per batch
    device: torch.device

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(name for name in self.shards if name != TRAIN)

    def __call__(self, split: str = "val"):
        rows = max(1, int(self.batch_size * self.task_data.eval_batch_scale.get(split, 1.0)))
        return self.task_data.val_batches(self.shards[split], batch_size=rows, device=self.device)


def train_epoch(state: TrainState, task: Task, batches, spec: RunSpec, plan: LoopPlan) -> dict:
    """One epoch of optimiser steps over this worker's training batches; its training metrics over all workers."""
    worker = task.worker
    settings = StepSettings(worker.autocast(spec.train.precision), spec.train.grad_clip, plan.steps_per_epoch,
                            spec.epochs)
    state.trained.train()
    loss_sum = torch.zeros((), device=worker.device, dtype=torch.float64)
    counts: Counter = Counter()
    done = 0
    started = time.perf_counter()
    stream = _Timed(batches)
    for batch in stream:
        if done == plan.steps_per_epoch:
            break
        loss = task.train_step(state, batch, settings)
        done += 1
        loss_sum += loss.double()
        counts.update(task.count(batch))
    if worker.device.type == "cuda":
        torch.cuda.synchronize(worker.device)
    elapsed = time.perf_counter() - started
    totals = worker.all_reduce(torch.tensor([loss_sum.item(), done, *(counts[c] for c in task.throughput)],
                                            dtype=torch.float64)).tolist()
    return {
        "step": state.step,
        "train_loss": totals[0] / max(totals[1], 1),
        "lr": peak_lr(state.optimizer),
        **{f"{name}_per_s": value / elapsed for name, value in zip(task.throughput, totals[2:])},
        "train_s": elapsed,
        "data_wait_s": stream.wait,  # this worker's time blocked on its data stream while training
    }


class _Timed:
    """An iterator that adds up the time spent waiting for its next item."""

    def __init__(self, iterable):
        self.iterator, self.wait = iter(iterable), 0.0

    def __iter__(self):
        return self

    def __next__(self):
        started = time.perf_counter()
        try:
            return next(self.iterator)
        finally:
            self.wait += time.perf_counter() - started


def _open_run(target: TrackingTarget | None, spec: RunSpec, num_params: int, data_params: dict,
              state: TrainState) -> RunLogger | None:
    """Rank 0's MLflow run, found again by its trial id after a restart; epochs the checkpoint holds but MLflow
    may lack (the tracking server was away) are sent again (the logger skips those it has)."""
    if target is None:
        return None
    logger = RunLogger(target, run_params(spec, num_params, data_params), dump_yaml(spec.document()),
                       datasets=[dataset_input(spec.dataset)], system_metrics=True)
    for past in state.history:
        logger.log_epoch(past["epoch"], past)
    state.mlflow_run_id = logger.run_id or state.mlflow_run_id
    return logger


def _log_pictures(logger: RunLogger, pictures, history: list[dict], spec: RunSpec, stage: StageContext) -> None:
    """The last epoch's pictures (as geometry/*.png, and under geometry/epoch_<n>/ at every geometry epoch but the
    last; a later stage's under <stage>/geometry/), and every layer's geometry over the epochs so far."""
    epoch, k = history[-1]["epoch"], spec.hyperparameters.get("k")
    where = "geometry" if stage.name is None else f"{stage.name}/geometry"
    with tempfile.TemporaryDirectory() as folder:
        draw_geometry(pictures, Path(folder), f"epoch {epoch}" + (f", k={k}" if k is not None else ""))
        logger.log_artifacts(folder, where)
        if epoch < stage.epoch_offset + spec.epochs:
            logger.log_artifacts(folder, f"{where}/epoch_{epoch:04d}")
    with tempfile.TemporaryDirectory() as folder:
        draw_layer_history(history, Path(folder), f"k={k}" if k is not None else "")
        logger.log_artifacts(folder, where)
