"""One run as a Ray Train `TorchTrainer`: what a study trial fits inside its Tune trial, and `lapstudy train` alone."""

from __future__ import annotations

from dataclasses import dataclass, field

import ray.train
from ray.train.torch import TorchTrainer
from ray.tune.integration.ray_train import TuneReportCallback

from study.errors import UserError
from study.host import CHECKPOINTS_KEPT, InProcessHost, TrainWorkerHost
from study.loop import LoopPlan, StageContext, train_loop_per_worker
from study.runspec import RunSpec
from study.storage import join
from study.tracking.run_logger import TrackingTarget


def plan_run(spec: RunSpec, task_data) -> LoopPlan:
    """Per-worker batch and steps per epoch (which fix the learning-rate schedule); UserError if they cannot work."""
    workers, batch_size = spec.resources.workers, spec.train.batch_size
    if batch_size % workers:
        raise UserError(f"hyperparameters.batch_size: {batch_size} must be a multiple of the workers per trial "
                        f"({workers})")
    per_worker = batch_size // workers
    # Ray splits the training rows equally over the workers and each drops its last partial batch.
    rows = task_data.train_rows_per_worker(workers)
    available = None if rows is None else rows // per_worker
    if spec.train.steps_per_epoch is not None:
        steps = spec.train.steps_per_epoch if available is None else min(spec.train.steps_per_epoch, available)
    elif available is None:
        raise UserError("hyperparameters.steps_per_epoch: the dataset's length is unknown (streamed); "
                        "set steps_per_epoch")
    else:
        steps = available
    if steps < 1:
        raise UserError(
            f"hyperparameters.batch_size: {batch_size} is larger than the training split ({task_data.num_train} rows "
            f"over {workers} worker(s)); use at most {rows * workers}"
        )
    return LoopPlan(steps_per_epoch=steps, batch_per_worker=per_worker)


@dataclass(frozen=True)
class RunSetup:
    """Where and how the trainers of one run (all its stages) run."""

    storage_path: str  # the trainers' runs (checkpoints) go under it, each under its fixed name (a path or URI)
    tracking: TrackingTarget | None  # None: no MLflow
    in_process: bool = False  # train in the calling process (Ray Train's local mode; study/host.py), one worker
    report_to_tune: bool = False  # inside a study's trial: every report reaches Tune
    max_failures: int = 2  # restarts of a worker group after a crash or a lost node (a Train worker group only)
    worker_resources: dict = field(default_factory=dict)  # custom Ray resources each worker asks for (placement)
    allow_code_execution: bool = False  # the command line's --allow-code-execution: HumanEval may run model code


def build_trainer(spec: RunSpec, task_data, name: str, setup: RunSetup, stage: StageContext) -> TorchTrainer:
    """The trainer of one stage of a run. `name` + `setup.storage_path` identify it: a trainer built again with the
    same ones (a restarted trial) resumes from its latest checkpoint."""
    plan = plan_run(spec, task_data)
    task_data.materialize()
    resources = spec.resources
    if setup.in_process:
        # The process already holds the run's one worker's CPUs and GPUs (the trial asked Tune for them).
        host, scaling = InProcessHost(join(setup.storage_path, name), setup.report_to_tune), ray.train.ScalingConfig(
            num_workers=0)
    else:
        per_worker = {"CPU": resources.cpus_per_worker, **setup.worker_resources}
        if resources.gpus_per_worker:
            per_worker["GPU"] = resources.gpus_per_worker
        host, scaling = TrainWorkerHost(), ray.train.ScalingConfig(
            num_workers=resources.workers, use_gpu=resources.gpus_per_worker > 0, resources_per_worker=per_worker)
    return TorchTrainer(
        train_loop_per_worker,
        train_loop_config={"spec": spec, "task_data": task_data, "plan": plan, "tracking": setup.tracking,
                           "stage": stage, "host": host, "allow_code_execution": setup.allow_code_execution},
        scaling_config=scaling,
        run_config=ray.train.RunConfig(
            name=name,
            storage_path=setup.storage_path,
            failure_config=ray.train.FailureConfig(max_failures=setup.max_failures),
            checkpoint_config=ray.train.CheckpointConfig(num_to_keep=CHECKPOINTS_KEPT),
            callbacks=[TuneReportCallback()] if setup.report_to_tune and not setup.in_process else [],
        ),
        datasets=task_data.datasets,
        dataset_config=task_data.data_config(),
    )
