"""What `lapstudy run` and `lapstudy train` check before they import Ray, MLflow, Optuna or matplotlib: the file,
every configuration it can give under the model's own rules (models/ and the training schema: this imports torch,
nothing heavier), whether its benchmarks would run model-written code the command line did not allow, the study
name and the storage location. A mistake here costs the time of reading the file, not of loading the machinery;
study/preflight.py then checks what needs that machinery, the cluster and the data.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

from study.errors import UserError
from study.evals.spec import check_code_execution
from study.runspec import Resources, RunSpec, check_run_config, load_run_spec
from study.space import SearchSpace, load_space
from study.space_corners import check_configs
from study.storage import check_reachable


@dataclass(frozen=True)
class RunOptions:
    """`lapstudy run`'s command line, paths resolved."""

    space: Path
    storage: str
    name: str | None = None
    num_samples: int | None = None
    max_concurrent: int | None = None
    resources: Resources = Resources()
    address: str | None = None
    tracking_uri: str | None = None
    seed: int | None = None
    resume: bool = False
    max_failures: int = 2
    worker_resources: dict = field(default_factory=dict)
    allow_code_execution: bool = False  # --allow-code-execution: the space's HumanEval may run model-written code


def check_study(options: RunOptions) -> tuple[SearchSpace, str]:
    """(the space, the study's name) of a `lapstudy run`, or the UserError of its first mistake."""
    space = load_space(options.space)
    name = options.name or space.name
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]*", name):
        raise UserError(f"--name {name!r}: use letters, digits, '_', '.' and '-' (it names a folder)")
    check_configs(space, before_data=True)
    check_code_execution(space, options.allow_code_execution, f"search space {options.space}")
    check_reachable(options.storage)
    return space, name


def check_run(path: Path, storage: str, resources: dict, *, allow_code_execution: bool) -> RunSpec:
    """The run config of a `lapstudy train` with the worker settings of the command line (`resources`) over its
    own, or the UserError of its first mistake."""
    spec = load_run_spec(path)
    if resources:
        spec = spec.model_copy(update={"resources": Resources(**{**spec.resources.model_dump(), **resources})})
    check_run_config(spec.hyperparameters, spec.task, where=f"run config {path}: hyperparameters", before_data=True)
    check_code_execution(spec, allow_code_execution, f"run config {path}")
    check_reachable(storage)
    return spec
