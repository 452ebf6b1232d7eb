"""Kinds of training, one module each, registered by name: the `task` of a search space or run config.

Adding a task is one module with a `Task` subclass (see `base.py` and docs/tasks.md) and one line below; where it
needs data of a new shape, one data adapter in `study/data/`.
"""

from study.errors import UserError
from study.tasks.base import Evaluation, GeometryPictures, GeometrySpec, StepSettings, Task
from study.tasks.classification import Classification
from study.tasks.dino import DINO
from study.tasks.language_modeling import LanguageModeling
from study.tasks.linear_probe import LinearProbe
from study.tasks.segmentation_probe import SegmentationProbe
from study.tasks.translation import Translation

TASKS: dict[str, type[Task]] = {task.name: task for task in (Classification, LanguageModeling, DINO, LinearProbe,
                                                               SegmentationProbe, Translation)}


def task_class(name: str) -> type[Task]:
    """The task registered under `name`; a UserError naming the registered ones otherwise."""
    if name not in TASKS:
        raise UserError(f"task: {name!r} is not one of {', '.join(TASKS)}", field="task")
    return TASKS[name]


def registered_task(name: str) -> str:
    """A pydantic field validator of task names (a ValueError, which pydantic places at the field)."""
    if name not in TASKS:
        raise ValueError(f"{name!r} is not one of {', '.join(TASKS)}")
    return name


__all__ = ["TASKS", "Evaluation", "GeometryPictures", "GeometrySpec", "StepSettings", "Task", "registered_task",
           "task_class"]
