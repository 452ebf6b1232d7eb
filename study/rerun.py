"""`lapstudy train CONFIG.yaml`: one run of an exported (or hand-written) run config through the same Ray Train loop
as a study trial, logged to MLflow; on CPU with one worker and the config's seed it repeats the trial exactly."""

from __future__ import annotations

import math
import time
from pathlib import Path

import ray
from pydantic import ValidationError

from study.data import load_task_data, preflight
from study.errors import UserError, describe_validation_error
from study.loop import TrackingTarget, spec_document
from study.runspec import Resources, RunSpec, check_run_config, complete_hyperparameters
from study.tracking import STATUS_COMPLETED, STATUS_FAILED, check_store, close_run, ensure_experiment, local_store
from study.trainer import build_trainer, plan_run
from study.resources import trial_concurrency
from study.tuning import check_address, connect_ray
from study.yamlio import dump_yaml, load_yaml

EXPERIMENT = "lapstudy-train"


def load_run_spec(path: Path) -> RunSpec:
    data = load_yaml(path, "run config")
    if not isinstance(data, dict):
        raise UserError(f"run config {path}: must be a mapping (task, dataset, epochs, seed, hyperparameters, ...)")
    try:
        return RunSpec.model_validate(data)
    except ValidationError as exc:
        raise UserError(describe_validation_error(exc, data, prefix=f"run config {path}: ", model=RunSpec)) from None


def train_once(config: str, *, storage: str | None, tracking_uri: str | None, address: str | None,
               workers: int | None, cpus_per_worker: float | None, gpus_per_worker: float | None) -> int:
    path = Path(config)
    spec = load_run_spec(path)
    changes = {k: v for k, v in (("workers", workers), ("cpus_per_worker", cpus_per_worker),
                                  ("gpus_per_worker", gpus_per_worker)) if v is not None}
    if changes:
        try:
            spec = spec.model_copy(update={"resources": Resources(**{**spec.resources.model_dump(), **changes})})
        except ValidationError as exc:
            raise UserError(describe_validation_error(exc, changes, prefix="--")) from None
    # the model and training keys need no data: check them before Ray starts
    check_run_config(spec.hyperparameters, spec.task, where=f"run config {path}: hyperparameters", before_data=True)
    if tracking_uri:
        check_store(tracking_uri, EXPERIMENT, must_be_new=False)
    check_address(address)
    preflight(spec.task, spec.dataset)  # a wrong or offline dataset fails in seconds, before Ray starts
    storage_dir = Path(storage or "studies/train").expanduser().resolve()
    connect_ray(address, storage_dir)
    # The config's workers must fit on this cluster, or Ray Train would wait for them forever.
    trial_concurrency(spec.resources, ray.cluster_resources(), [n["Resources"] for n in ray.nodes() if n["Alive"]], None)
    task_data = load_task_data(spec.task, spec.dataset, seed=spec.seed)
    hyperparameters = complete_hyperparameters(spec.hyperparameters, task_data.model_overrides, spec.task)
    spec = spec.model_copy(update={"hyperparameters": hyperparameters})
    plan_run(spec, task_data.num_train)
    if tracking_uri:
        experiment_id = ensure_experiment(tracking_uri, EXPERIMENT, None, must_be_new=False)
    storage_dir.mkdir(parents=True, exist_ok=True)
    if not tracking_uri:
        tracking_uri, artifacts = local_store(storage_dir)
        experiment_id = ensure_experiment(tracking_uri, EXPERIMENT, artifacts, must_be_new=False)
    name = f"{path.stem}-{time.strftime('%Y%m%d-%H%M%S')}"
    (storage_dir / f"{name}.yaml").write_text(dump_yaml(spec_document(spec)))
    trainer = build_trainer(spec, task_data, name=name, storage_path=storage_dir,
                            tracking=TrackingTarget(tracking_uri, experiment_id, name, None, None),
                            callbacks=[], max_failures=2)
    print(f"training {path} as run {name} ({spec.epochs} epochs, {spec.resources.workers} worker(s)); "
          f"MLflow experiment {EXPERIMENT!r} at {tracking_uri}", flush=True)
    try:
        result = trainer.fit()
    except Exception as exc:
        close_run(tracking_uri, experiment_id, run_id=None, trial_id=None, status=STATUS_FAILED, error=str(exc))
        raise
    metrics = result.metrics or {}
    run_id = metrics.get("mlflow_run_id") or None
    diverged = bool(metrics.get("diverged"))
    close_run(tracking_uri, experiment_id, run_id=run_id, trial_id=None,
              status=STATUS_FAILED if diverged else STATUS_COMPLETED, error=metrics.get("error"),
              checkpoint=result.checkpoint.path if result.checkpoint else None)
    print(comparison(metrics, spec.provenance.get("final_metrics") or {}), flush=True)
    print(f"MLflow run {run_id} in experiment {EXPERIMENT!r}; checkpoints in {storage_dir / name}", flush=True)
    ray.shutdown()
    return 1 if diverged else 0


def comparison(metrics: dict, recorded: dict) -> str:
    """Final metrics of this run beside the ones the exported trial recorded."""
    lines = ["final metrics" + (" (recorded by the trial -> this run)" if recorded else "") + ":"]
    for key in ("train_loss", "val_loss", "val_acc", "val_bpb"):
        if key not in metrics:
            continue
        value = metrics[key]
        if key in recorded:
            same = "identical" if value == recorded[key] else f"differs by {value - recorded[key]:+.3g}"
            lines.append(f"  {key}: {recorded[key]:.6f} -> {value:.6f} ({same})")
        else:
            lines.append(f"  {key}: {value:.6f}" if isinstance(value, float) and math.isfinite(value) else f"  {key}: {value}")
    return "\n".join(lines)
