"""`lapstudy train CONFIG.yaml`: one run of an exported (or hand-written) run config through the same Ray Train loop
as a study trial, logged to MLflow; on CPU with one worker and the config's seed it repeats the trial exactly."""

from __future__ import annotations

import math
import time
from pathlib import Path

import ray

from study.data import TaskData, load_task_data
from study.evals.evaluate import check_evaluations
from study.preflight import Request, preflight
from study.resources import trains_in_trial
from study.runspec import RunSpec, complete_hyperparameters
from study.status import TrialStatus, trial_status
from study.storage import is_remote, join, write_text
from study.tasks import task_class
from study.tracking.run_logger import TrackingTarget
from study.tracking.runs import close_run
from study.tracking.store import open_experiment, redact
from study.trial import RunSetup, plan_run, run_stages
from study.yamlio import dump_yaml

EXPERIMENT = "lapstudy-train"


def train_once(path: Path, spec: RunSpec, *, storage: str, tracking_uri: str | None, address: str | None,
               allow_code_execution: bool = False) -> int:
    """`spec`: the run config at `path` as study/precheck.py's check_run found it (the command line's worker
    settings over the config's: an exact reproduction needs the config's own). `storage`: a local folder or a
    location in object storage (then `tracking_uri` is a server: the default SQLite store cannot live there).
    `allow_code_execution`: the command line's --allow-code-execution, which a re-run needs again."""
    where = f"run config {path}: hyperparameters"

    def check_configs(task_data: TaskData | None) -> None:
        if task_data is None:  # the benchmarks' tasks (study/precheck.py checked the keys that need no data)
            check_evaluations(spec)
        else:
            complete = complete_hyperparameters(spec.hyperparameters, task_data.model_overrides, spec.task, where,
                                                epochs=spec.epochs)
            plan_run(spec.model_copy(update={"hyperparameters": complete}), task_data)

    request = Request(task=spec.task, dataset=spec.dataset, seed=spec.seed, resources=spec.resources, storage=storage,
                      experiment=EXPERIMENT, new_experiment=False, tracking_uri=tracking_uri, address=address)
    task_data = preflight(request, check_configs).task_data
    complete = complete_hyperparameters(spec.hyperparameters, task_data.model_overrides, spec.task, where,
                                        epochs=spec.epochs)
    spec = spec.model_copy(update={"hyperparameters": complete}).with_tokenizer_file(
        task_data.params.get("tokenizer_file"))
    if not is_remote(storage):  # the default MLflow store goes in it (preflight refused that for a bucket)
        Path(storage).mkdir(parents=True, exist_ok=True)
    tracking_uri, experiment_id = open_experiment(tracking_uri, Path(storage), EXPERIMENT, must_be_new=False)
    name = f"{path.stem}-{time.strftime('%Y%m%d-%H%M%S')}"
    write_text(join(storage, f"{name}.yaml"), dump_yaml(spec.document()))
    # Its name is also its MLflow run's trial id: every stage finds the one run. One worker trains in this process,
    # as a study's one-worker trial does in its own.
    setup = RunSetup(storage_path=storage, tracking=TrackingTarget(tracking_uri, experiment_id, name, name, None),
                     in_process=trains_in_trial(spec.resources, ray.cluster_resources(), {}),
                     allow_code_execution=allow_code_execution)
    print(f"training {path} as run {name} ({spec.total_epochs} epochs, {spec.resources.workers} worker(s)); "
          f"MLflow experiment {EXPERIMENT!r} at {redact(tracking_uri)}", flush=True)
    try:
        metrics = run_stages(spec, name, setup, task_data,
                             lambda stage, before: load_task_data(stage.dataset, seed=spec.seed,
                                                                  previous=before))
    except Exception as exc:
        status, error = trial_status("ERROR", None, spec.total_epochs, error=str(exc))
        close_run(tracking_uri, experiment_id, run_id=None, trial_id=name, status=status, error=error)
        raise
    run_id = metrics.get("mlflow_run_id") or None
    status, error = trial_status("TERMINATED", metrics, spec.total_epochs)
    close_run(tracking_uri, experiment_id, run_id=run_id, trial_id=name, status=status, error=error,
              checkpoint=metrics.get("checkpoint_path"))
    keys = tuple(f"{prefix}{metric}" for prefix, task in [("", spec.task), *((f"{stage.name}/", stage.task)
                                                                           for stage in spec.stages)]
                 for metric in ("train_loss", *task_class(task).quality_metrics))
    print(comparison(metrics, spec.provenance.get("final_metrics") or {}, keys), flush=True)
    print(f"MLflow run {run_id} in experiment {EXPERIMENT!r}; checkpoints in {join(storage, name)}", flush=True)
    ray.shutdown()
    return 0 if status is TrialStatus.COMPLETED else 1


def comparison(metrics: dict, recorded: dict, keys: tuple[str, ...]) -> str:
    """Final metrics of this run beside the ones the exported trial recorded."""
    lines = ["final metrics" + (" (recorded by the trial -> this run)" if recorded else "") + ":"]
    for key in keys:
        if key not in metrics:
            continue
        value = metrics[key]
        if key in recorded:
            same = "identical" if value == recorded[key] else f"differs by {value - recorded[key]:+.3g}"
            lines.append(f"  {key}: {recorded[key]:.6f} -> {value:.6f} ({same})")
        else:
            lines.append(f"  {key}: {value:.6f}" if isinstance(value, float) and math.isfinite(value)
                         else f"  {key}: {value}")
    return "\n".join(lines)
