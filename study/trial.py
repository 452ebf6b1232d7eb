"""One trial: its config, its stages, each a Ray Train `TorchTrainer`.

Read top to bottom as a Ray Tune example's main: `trial_driver` is the Tune function trainable every trial of a study
runs. It resolves the trial's sampled values into a complete run config, records it in the study folder and trains
the run's stages in order (`run_stages`), each stage a `TorchTrainer` of its own (`build_trainer`; with one worker it
trains in the trial's own process: study/host.py) sized by `plan_run`; every epoch reaches Tune, which is what ASHA
and the sampler see. `lapstudy train` (study/train.py) runs the same `run_stages` without Tune.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import ray.train
from ray import tune
from ray.train.torch import TorchTrainer
from ray.tune.integration.ray_train import TuneReportCallback

from study.bookkeeping import BOOKKEEPING, CONFIG_ID, REPLICATE, SEED
from study.data import TaskData, load_task_data
from study.errors import UserError
from study.folder import StudyFolder
from study.host import CHECKPOINTS_KEPT, InProcessHost, TrainWorkerHost, newest_checkpoint
from study.loop import LoopPlan, StageContext, train_loop_per_worker
from study.runspec import Resources, RunSpec, complete_hyperparameters
from study.space import SearchSpace
from study.storage import join
from study.tasks import task_class
from study.tracking.run_logger import TrackingTarget
from study.tracking.runs import TAG_CONFIG, TAG_REPLICATE
from study.yamlio import dump_yaml


@dataclass(frozen=True)
class StudyContext:
    """What every trial driver needs to know about its study (pickled into the trainable)."""

    folder: StudyFolder
    space: SearchSpace
    resources: Resources
    tracking_uri: str
    experiment_id: str
    study_run_id: str  # the study's MLflow run, parent of the trial runs
    max_failures: int  # retries of a trial's workers after a crash or a lost node
    in_process: bool  # the trial trains in its own process (study/resources.py: trains_in_trial)
    worker_resources: dict = field(default_factory=dict)  # custom Ray resources each Train worker asks for
    allow_code_execution: bool = False  # `lapstudy run --allow-code-execution`: HumanEval may run model-written code


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


def trial_name(trial) -> str:
    """Tune's name (and folder name) of a trial; also its Train run's and MLflow run's name."""
    return f"trial_{trial.trial_id}"


def trial_driver(config: dict, study: StudyContext) -> None:
    """The Tune function trainable: one trial of the study, from its sampled values (`config`)."""
    context = tune.get_context()
    trial_id, name = context.get_trial_id(), context.get_trial_name()
    space = study.space
    seed = config[SEED]  # the replicate's seed: the study's searcher (study/search.py) names it in every config
    replicate = {CONFIG_ID: config[CONFIG_ID], REPLICATE: config[REPLICATE]}
    task_data = load_task_data(space.dataset, seed=seed)
    hyperparameters = complete_hyperparameters(space.resolve(config), task_data.model_overrides, space.task,
                                               epochs=space.epochs)
    spec = space.run_spec(hyperparameters, study.resources, seed=seed,
                          provenance={"study": study.folder.name, "trial_id": trial_id, "trial_name": name,
                                      **replicate}).with_tokenizer_file(task_data.params.get("tokenizer_file"))
    study.folder.write_trial_config(trial_id, dump_yaml(spec.document()))
    tags = {TAG_CONFIG: replicate[CONFIG_ID], TAG_REPLICATE: str(replicate[REPLICATE])}
    setup = RunSetup(storage_path=study.folder.train_location,
                     tracking=TrackingTarget(study.tracking_uri, study.experiment_id, name, trial_id,
                                             study.folder.name, parent_run_id=study.study_run_id, tags=tags),
                     in_process=study.in_process, report_to_tune=True, max_failures=study.max_failures,
                     worker_resources=study.worker_resources, allow_code_execution=study.allow_code_execution)
    # The trial's name names its stages' Train runs: a restarted trial finds their checkpoints again.
    run_stages(spec, name, setup, task_data,
               lambda stage, before: load_task_data(stage.dataset, seed=seed, previous=before))


def run_stages(spec: RunSpec, name: str, setup: RunSetup, first_data: TaskData,
               load_data: Callable[[RunSpec, TaskData], TaskData]) -> dict:
    """Train every stage of `spec` in order, each a Ray Train run of its own under a fixed name (a restarted trial
    resumes in the stage it was in; a finished stage hands its final result back at once), each started from what
    the stage before it carried forward, all logging into the run's one MLflow run. The first stage trains on
    `first_data`, each later one on `load_data(its spec, the data of the stage before)` (a chat stage reads with
    the tokenizer its pre-training trained). Returns the final metrics of the last stage that ran (a diverged stage
    ends the run), with its newest checkpoint's path as `checkpoint_path`."""
    stage, final = StageContext(), {}
    data = first_data
    for stage_name, offset, stage_spec in spec.stage_runs():
        if stage_name is not None:
            data = load_data(stage_spec, data)
            where = f"stages.{stage_name}.hyperparameters"
            overrides = {k: v for k, v in data.model_overrides.items()
                         if k not in task_class(stage_spec.task).carried_sets}
            stage_spec = stage_spec.model_copy(update={"hyperparameters": complete_hyperparameters(
                stage_spec.hyperparameters, overrides, stage_spec.task, where, epochs=stage_spec.epochs)})
            stage = StageContext(stage_name, offset, final["checkpoint_path"],
                                 {k: v for k, v in final.items() if k not in BOOKKEEPING})
        run_name = name if stage_name is None else f"{name}_{stage_name}"
        result = build_trainer(stage_spec, data, run_name, setup, stage).fit()
        final = {**result.return_value, "checkpoint_path": newest_checkpoint(join(setup.storage_path, run_name))}
        if final.get("diverged"):
            break
    return final


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
