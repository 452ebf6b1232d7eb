"""The trial driver: the Ray Tune function trainable every trial of a study runs. It resolves the trial's sampled
values into a complete run config, records it in the study folder, and fits the trial's Ray Train `TorchTrainer`
(or, with one worker, trains in its own process: study/host.py); every epoch reaches Tune, which is what ASHA and the
sampler see."""

from __future__ import annotations

from dataclasses import dataclass, field

from ray import tune

from study.bookkeeping import CONFIG_ID, REPLICATE, SEED
from study.data import load_task_data
from study.folder import StudyFolder
from study.runspec import Resources, complete_hyperparameters
from study.space import SearchSpace
from study.stages import run_stages
from study.tracking.run_logger import TrackingTarget
from study.tracking.runs import TAG_CONFIG, TAG_REPLICATE
from study.trainer import RunSetup
from study.yamlio import dump_yaml


@dataclass(frozen=True)
class StudyContext:
    """What every trial driver needs to know about its study (pickled into the trainable)."""

    folder: StudyFolder
    space: SearchSpace
    seed: int
    resources: Resources
    tracking_uri: str
    experiment_id: str
    study_run_id: str  # the study's MLflow run, parent of the trial runs
    max_failures: int  # retries of a trial's workers after a crash or a lost node
    in_process: bool  # the trial trains in its own process (study/resources.py: trains_in_trial)
    worker_resources: dict = field(default_factory=dict)  # custom Ray resources each Train worker asks for
    allow_code_execution: bool = False  # `lapstudy run --allow-code-execution`: HumanEval may run model-written code


def trial_name(trial) -> str:
    """Tune's name (and folder name) of a trial; also its Train run's and MLflow run's name."""
    return f"trial_{trial.trial_id}"


def trial_driver(config: dict, study: StudyContext) -> None:
    context = tune.get_context()
    trial_id, name = context.get_trial_id(), context.get_trial_name()
    space = study.space
    seed = config.get(SEED, study.seed)  # the replicate's seed (studies started before replicates: the study's)
    replicate = {CONFIG_ID: config.get(CONFIG_ID, trial_id), REPLICATE: config.get(REPLICATE, 0)}
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
