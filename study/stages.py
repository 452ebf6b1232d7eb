"""A run's stages, in order: each a Ray Train run of its own, under a fixed name (so that a restarted trial resumes
in the stage it was in; a finished stage hands its final result back at once), each started from what the stage
before it carried forward, all logging into the run's one MLflow run."""

from __future__ import annotations

from typing import Callable

from study.bookkeeping import BOOKKEEPING
from study.data import TaskData
from study.host import newest_checkpoint
from study.loop import StageContext
from study.runspec import RunSpec, complete_hyperparameters
from study.storage import join
from study.tasks import task_class
from study.trainer import RunSetup, build_trainer


def run_stages(spec: RunSpec, name: str, setup: RunSetup, first_data: TaskData,
               load_data: Callable[[RunSpec, TaskData], TaskData]) -> dict:
    """Train every stage of `spec` (the first on `first_data`, each later one on `load_data(its spec, the data of
    the stage before)`: a chat stage reads with the tokenizer its pre-training trained); the
    final metrics of the last stage that ran (a diverged stage ends the run), with its newest checkpoint's path as
    `checkpoint_path`."""
    stage, final, previous = StageContext(), {}, None
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
        previous = name if stage_name is None else f"{name}_{stage_name}"
        result = build_trainer(stage_spec, data, previous, setup, stage).fit()
        final = {**result.return_value, "checkpoint_path": newest_checkpoint(join(setup.storage_path, previous))}
        if final.get("diverged"):
            break
    return final
