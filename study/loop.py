"""The Ray Train loop every trial (and `lapstudy train`) runs on each data-parallel worker.

Per epoch: train on this worker's Ray Data shard (seeded by (seed, epoch, rank), so a run restarted from a
checkpoint repeats exactly what an uninterrupted run would have done), evaluate on the validation shard (every row
once over all workers), at geometry epochs accumulate the token geometry of `models.geometry` in the same pass, then
rank 0 logs the epoch to MLflow (step = epoch) and every worker calls `ray.train.report` with rank 0's checkpoint.
"""

from __future__ import annotations

import math
import os
import random
import tempfile
import time
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import ray.train
import ray.train.torch
import torch
import torch.distributed as dist
import torch.nn.functional as F

import models
from models.geometry import GeometryAccumulator, most_frequent_targets
from study.plots import pca_plot, variance_plot
from study.runspec import RunSpec, TrainConfig, slow_lr_scale
from study.tracking import RunLogger, flat_params
from study.yamlio import dump_yaml

CHECKPOINT_FILE = "state.pt"


@dataclass(frozen=True)
class TrackingTarget:
    """Where the rank-0 worker logs: the MLflow store, the study's experiment, and the trial's identity."""

    tracking_uri: str
    experiment_id: str
    run_name: str
    trial_id: str | None  # None for `lapstudy train`: always a new run
    study: str | None


@dataclass(frozen=True)
class LoopPlan:
    """Sizes the trial driver worked out before starting the workers."""

    steps_per_epoch: int
    batch_per_worker: int


class WarmupCosine:
    """lr factor at optimiser step s: linear warm-up to 1 over `warmup` steps, then cosine to `min_ratio`."""

    def __init__(self, warmup: int, total: int, min_ratio: float):
        self.warmup, self.total, self.min_ratio = warmup, total, min_ratio

    def __call__(self, step: int) -> float:
        if step < self.warmup:
            return (step + 1) / self.warmup
        progress = min(1.0, (step - self.warmup) / max(1, self.total - self.warmup))
        return self.min_ratio + (1 - self.min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def train_loop_per_worker(loop_config: dict) -> None:
    spec: RunSpec = loop_config["spec"]
    task_data = loop_config["task_data"]
    plan: LoopPlan = loop_config["plan"]
    target: TrackingTarget | None = loop_config["tracking"]
    context = ray.train.get_context()
    rank, world = context.get_world_rank(), context.get_world_size()
    torch.set_num_threads(spec.resources.threads)
    device = ray.train.torch.get_device()
    if device.type == "cpu":
        torch.use_deterministic_algorithms(True, warn_only=True)
    train: TrainConfig = spec.train
    lm = spec.task == "language_modeling"

    _seed_everything(spec.seed)  # the same initial weights on every worker
    raw = models.build_model(spec.model_config_flat)
    num_params = models.count_parameters(raw)
    model = ray.train.torch.prepare_model(raw)
    optimizer = _optimizer(raw, train, slow_lr_scale(spec.model_config_flat))
    steps_per_epoch = plan.steps_per_epoch
    total_steps = steps_per_epoch * spec.epochs
    schedule = WarmupCosine(round(train.warmup_epochs * steps_per_epoch), total_steps, train.min_lr_ratio)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
    autocast = _autocast(train.precision, device)

    start_epoch, step, history = 1, 0, []
    checkpoint = ray.train.get_checkpoint()
    if checkpoint is not None:
        with checkpoint.as_directory() as folder:
            state = torch.load(Path(folder) / CHECKPOINT_FILE, map_location=device, weights_only=False)
        raw.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        start_epoch, step, history = state["epoch"] + 1, state["step"], state["history"]
    # Ray's records (not MLflow) say where each report came from: which checkpoint this worker group started from
    # (0: none), on which node and in which process rank 0 runs. That is how a restart after a lost node, worker
    # process or driver shows.
    origin = {"resumed_from_epoch": start_epoch - 1, "worker_node_id": ray.get_runtime_context().get_node_id(),
              "worker_pid": os.getpid()}

    if start_epoch > spec.epochs:  # restarted after the last checkpoint: hand the final result to Tune again
        final = {**history[-1], "mlflow_run_id": state.get("mlflow_run_id", ""), **origin}
        _report(final, raw, optimizer, scheduler, spec.epochs, step, history, rank)
        return

    logger = None
    if rank == 0 and target is not None:
        logger = RunLogger(
            target.tracking_uri, target.experiment_id, trial_id=target.trial_id, run_name=target.run_name,
            study=target.study, params=run_params(spec, num_params, task_data.params),
            config_yaml=dump_yaml(spec_document(spec)),
        )
        for past in history:  # epochs checkpointed but perhaps not yet in MLflow (the tracking server was away)
            logger.log_epoch(past["epoch"], past)
    run_id = logger.run_id if logger is not None and logger.run_id else ""

    train_shard = ray.train.get_dataset_shard("train")
    val_shard = ray.train.get_dataset_shard("val")
    top_targets = _top_targets(task_data, val_shard, spec, device) if lm else None

    for epoch in range(start_epoch, spec.epochs + 1):
        _seed_everything(spec.seed, epoch, rank)
        model.train()
        loss_sum = torch.zeros((), device=device, dtype=torch.float64)
        samples = tokens = batches = 0
        started = time.perf_counter()
        stream = _Timed(task_data.train_batches(
            train_shard, batch_size=plan.batch_per_worker, epoch=epoch, seed=spec.seed, device=device
        ))
        for batch in stream:
            if batches == steps_per_epoch:
                break
            raw.set_training_step(step, total_steps)
            with autocast:
                loss = _task_loss(model, batch, lm)
            total = loss + raw.regularization_loss()
            optimizer.zero_grad(set_to_none=True)
            total.backward()
            if train.grad_clip > 0:
                torch.nn.utils.clip_grad_norm_(model.parameters(), train.grad_clip)
            optimizer.step()
            scheduler.step()
            step += 1
            batches += 1
            loss_sum += loss.detach().double()
            samples += len(batch["input_ids" if lm else "image"])
            tokens += batch["targets"].numel() if lm else 0
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        elapsed = time.perf_counter() - started
        counts = _all_reduce(torch.tensor([loss_sum.item(), batches, samples, tokens], dtype=torch.float64), world)
        train_loss = counts[0].item() / max(counts[1].item(), 1)
        metrics = {
            "epoch": epoch,
            "step": step,
            "train_loss": train_loss,
            "lr": optimizer.param_groups[0]["lr"] / optimizer.param_groups[0]["lr_scale"],
            "samples_per_s": counts[2].item() / elapsed,
            "num_params": num_params,
            "data_wait_s": stream.wait,  # rank 0's time blocked on its data stream while training
        }
        if lm:
            metrics["tokens_per_s"] = counts[3].item() / elapsed
        if not math.isfinite(train_loss):
            # Stop at once: retrying from the checkpoint would diverge the same way. The study marks it failed.
            metrics.update({key: math.nan for key in ("val_loss", "val_bpb" if lm else "val_acc")})
            metrics.update(diverged=1, error=f"training diverged: train_loss is {train_loss} at epoch {epoch}")
            history.append(metrics)
            if logger is not None:
                logger.log_epoch(epoch, metrics)
                logger.set_tags({"lapstudy.error": metrics["error"]})
            reported = {**metrics, "mlflow_run_id": run_id, **origin}
            _report(reported, raw, optimizer, scheduler, epoch, step, history, rank)
            return

        geometry_due = spec.geometry.due(epoch, spec.epochs)
        evaluated = time.perf_counter()
        evaluation = _evaluate(raw, task_data, val_shard, spec, plan, device, autocast, world, rank,
                               geometry=geometry_due, top_targets=top_targets)
        metrics.update(evaluation.metrics)
        metrics.update(train_s=elapsed, eval_s=time.perf_counter() - evaluated)
        metrics.update(raw.mixer_stats())
        history.append(metrics)
        if logger is not None:
            logger.log_epoch(epoch, metrics)
            if evaluation.pictures is not None:
                _log_pictures(logger, evaluation, epoch, spec, lm)
        _report({**metrics, "mlflow_run_id": run_id, **origin}, raw, optimizer, scheduler, epoch, step, history, rank)


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


def _report(reported, raw, optimizer, scheduler, epoch, step, history, rank) -> None:
    """Every worker reports (it is a barrier); rank 0 attaches the checkpoint, so a restart resumes from here."""
    if rank != 0:
        ray.train.report(reported)
        return
    with tempfile.TemporaryDirectory() as folder:
        state = {"model": raw.state_dict(), "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(),
                 "epoch": epoch, "step": step, "history": history, "mlflow_run_id": reported.get("mlflow_run_id", "")}
        torch.save(state, Path(folder) / CHECKPOINT_FILE)
        ray.train.report(reported, checkpoint=ray.train.Checkpoint.from_directory(folder))


@dataclass
class Evaluation:
    metrics: dict
    pictures: tuple | None = None  # (points, labels, variance parts, total) at geometry epochs


def language_model_sums(logits: torch.Tensor, targets: torch.Tensor, target_bytes: torch.Tensor) -> torch.Tensor:
    """[loss summed over all targets, number of targets, loss summed over targets that carry bytes, their bytes].
    val_bpb divides the third by ln 2 times the fourth: end-of-text and other zero-byte targets count in val_loss
    but not in bits per byte, so that val_bpb compares across tokenizers."""
    losses = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), reduction="none").double()
    carries_bytes = target_bytes.flatten() > 0
    return torch.stack([losses.sum(), losses.new_tensor(losses.numel()), losses[carries_bytes].sum(),
                        target_bytes.sum().double()]).cpu()


def _evaluate(raw, task_data, val_shard, spec, plan, device, autocast, world, rank, *, geometry, top_targets):
    lm = spec.task == "language_modeling"
    raw.eval()
    # classification: loss (nats), predictions, correct; language: loss, tokens, loss on byte-carrying targets, bytes
    sums = torch.zeros(4 if lm else 3, dtype=torch.float64)
    accumulator = cached_features = None
    max_batches = spec.geometry.max_batches
    with torch.no_grad():
        for index, batch in enumerate(task_data.val_batches(val_shard, batch_size=2 * plan.batch_per_worker,
                                                             device=device)):
            want = geometry and (max_batches is None or index < max_batches)
            with autocast:
                out = raw(batch["input_ids" if lm else "image"], return_features=want)
            logits = (out.logits if want else out).float()
            if lm:
                sums += language_model_sums(logits, batch["targets"], batch["target_bytes"])
            else:
                labels = batch["label"]
                sums += torch.tensor([F.cross_entropy(logits, labels, reduction="sum").item(), len(labels),
                                      (logits.argmax(dim=1) == labels).sum().item()], dtype=torch.float64)
            if want:
                if accumulator is None:
                    accumulator = GeometryAccumulator(
                        out.tokens.shape[-1],
                        num_classes=None if lm else raw.classifier_weight.shape[0],
                        feature_dim=None if lm else out.feature.shape[-1],
                        target_ids=top_targets, reservoir_size=spec.geometry.pca_points,
                        seed=spec.seed * 1000 + rank, device=device)
                    cached_features = []
                if lm:
                    accumulator.update(out.tokens, targets=batch["targets"])
                else:
                    accumulator.update(out.tokens, labels=batch["label"], features=out.feature)
                    cached_features.append(out.feature)
    sums = _all_reduce(sums, world)
    metrics = {"val_loss": sums[0].item() / sums[1].item()}
    if lm:
        metrics["val_bpb"] = sums[2].item() / (math.log(2) * sums[3].item())
    else:
        metrics["val_acc"] = sums[2].item() / sums[1].item()
    if not geometry:
        return Evaluation(metrics)
    if accumulator is None:  # this worker's validation shard was empty: join the collective with zeros
        accumulator = _empty_accumulator(raw, spec, lm, top_targets, rank, device)
        cached_features = []
    accumulator.all_reduce_()
    if not lm:
        # NC4 needs the final class centres: a second pass over the features kept from the first.
        accumulator.finalize_means(raw.classifier_weight)
        for features in cached_features:
            accumulator.update_nc4(features)
        accumulator.all_reduce_()
    values = accumulator.compute(None if lm else raw.classifier_weight)
    metrics.update({f"geom_{key}": value for key, value in values.items()})
    points, labels = accumulator.pca_projection()
    if lm:
        parts = {"within target": values["within_target_var"], "between target": values["between_target_var"]}
        total = values["target_total_var"]
    else:
        parts = {"within sequence": values["within_seq_var"], "within class": values["within_class_var"],
                 "between class": values["between_class_var"]}
        total = values["total_var"]
    return Evaluation(metrics, (points, labels, parts, total))


def _empty_accumulator(raw, spec, lm, top_targets, rank, device):
    dim = raw.config.dim
    return GeometryAccumulator(dim, num_classes=None if lm else raw.classifier_weight.shape[0], target_ids=top_targets,
                               reservoir_size=spec.geometry.pca_points, seed=spec.seed * 1000 + rank, device=device)


def _top_targets(task_data, val_shard, spec, device) -> torch.Tensor:
    """The K most frequent next-token targets of the validation split (all workers): the language-collapse groups."""
    vocab = models.build_config(spec.model_config_flat).vocab_size
    counts = torch.zeros(vocab, dtype=torch.float64)
    for batch in task_data.val_batches(val_shard, batch_size=256, device="cpu"):
        counts += torch.bincount(batch["targets"].flatten(), minlength=vocab).double()
    counts = _all_reduce(counts, ray.train.get_context().get_world_size())
    ids = torch.repeat_interleave(torch.arange(vocab), counts.long())
    return most_frequent_targets(ids, spec.geometry.top_targets).to(device)


def _log_pictures(logger: RunLogger, evaluation: Evaluation, epoch: int, spec: RunSpec, lm: bool) -> None:
    points, labels, parts, total = evaluation.pictures
    k = spec.hyperparameters.get("k")
    title = f"epoch {epoch}" + (f", k={k}" if k is not None else "")
    with tempfile.TemporaryDirectory() as folder:
        pca_plot(points, labels, Path(folder) / "pca.png", f"last-layer tokens on the top two PCs ({title})",
                 label_name="next token" if lm else "class")
        variance_plot(parts, total, Path(folder) / "variance.png", f"token variance decomposition ({title})")
        logger.log_artifacts(folder, "geometry")
        if spec.geometry.every:
            logger.log_artifacts(folder, f"geometry/epoch_{epoch:04d}")


def _task_loss(model, batch, lm: bool) -> torch.Tensor:
    if lm:
        logits = model(batch["input_ids"])
        return F.cross_entropy(logits.float().flatten(0, 1), batch["targets"].flatten())
    logits = model(batch["image"]).float()
    if "soft_label" in batch:
        return torch.sum(-batch["soft_label"] * F.log_softmax(logits, dim=-1), dim=-1).mean()
    return F.cross_entropy(logits, batch["label"])


def _optimizer(raw, train: TrainConfig, slow_scale: float) -> torch.optim.Optimizer:
    groups = raw.param_groups(train.weight_decay, slow_scale)
    for group in groups:
        group["lr"] = train.lr * group["lr_scale"]
    betas = (train.beta1, train.beta2)
    if train.optimizer == "lamb":
        from pytorch_optimizer import Lamb

        return Lamb(groups, lr=train.lr, betas=betas, eps=train.eps, weight_decay=train.weight_decay)
    return torch.optim.AdamW(groups, lr=train.lr, betas=betas, eps=train.eps, weight_decay=train.weight_decay)


def _autocast(precision: str, device: torch.device):
    if precision == "bf16" or (precision == "auto" and device.type == "cuda"):
        return torch.autocast(device_type=device.type, dtype=torch.bfloat16)
    return nullcontext()


def _all_reduce(tensor: torch.Tensor, world: int) -> torch.Tensor:
    if world > 1 and dist.is_initialized():
        backend_device = "cuda" if dist.get_backend() == "nccl" else "cpu"
        moved = tensor.to(backend_device)
        dist.all_reduce(moved)
        return moved.cpu()
    return tensor


def _seed_everything(seed: int, *more: int) -> None:
    value = int(np.random.SeedSequence([seed, *more]).generate_state(1, np.uint32)[0])
    random.seed(value)
    np.random.seed(value)
    torch.manual_seed(value)


def run_params(spec: RunSpec, num_params: int, data: dict | None = None) -> dict[str, str]:
    """MLflow params: every resolved hyperparameter under its space name, plus task, seed, epochs, the dataset as
    configured and, from the trial itself, what the data resolved to (`data.*`: split sizes, tokenizer, ...)."""
    extra = {"task": spec.task, "seed": spec.seed, "epochs": spec.epochs, "num_params": num_params,
             "workers": spec.resources.workers, "dataset": spec.dataset.model_dump(mode="json")}
    if data:
        extra["data"] = data
    return flat_params(spec.hyperparameters, extra)


def spec_document(spec: RunSpec) -> dict:
    """The run as a YAML-ready document (what config.yaml and `lapstudy export` hold)."""
    return spec.model_dump(mode="json")

