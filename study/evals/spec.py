"""The rules of benchmark evaluation, in one place: an `evaluate:` entry (`EvaluationSpec`: of a space, a run config,
a stage; `lapstudy eval` checks its flags as one), the project's own tasks, that benchmarks evaluate language models
only, and that HumanEval runs model-written code only where the command line allows it."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated

from pydantic import BeforeValidator, Field, ValidationInfo, field_validator, model_validator

from study.errors import UserError
from study.evals.sandbox import ALLOW_FLAG, require_code_execution
from study.schema import StrictModel
from study.tasks import LanguageModeling

HUMANEVAL = "humaneval"  # study/evals/humaneval.py: generated code run in the sandbox
GSM8K_CHAT = "gsm8k_chat"  # study/evals/gsm8k.py: GSM8K as nanochat scores a chat model
OWN_TASKS = (HUMANEVAL, GSM8K_CHAT)  # not lm_eval's: this project's definitions
HARNESS_EXAMPLES = ("arc_easy", "arc_challenge", "mmlu", "gsm8k")  # lm_eval tasks that messages name
EVALUATED_TASK = LanguageModeling.name  # benchmarks evaluate language models


class EvaluationSpec(StrictModel):
    """Benchmarks a language-model stage is evaluated on when it ends (study/evals: lm-evaluation-harness, and
    HumanEval in the sandbox), logged as eval_<task>_<metric> with the stage's last epoch. HumanEval runs the code
    the model writes: the command line allows it (`--allow-code-execution`), never a file."""

    tasks: list[str] = Field(min_length=1, description=f"lm_eval task names ({', '.join(HARNESS_EXAMPLES)}, ...), "
                                                       f"{' and '.join(OWN_TASKS)}")
    include_path: list[str] = Field(default_factory=list, description="folders of lm_eval task configs (relative: to "
                                                                      "the space or run config), which take precedence")
    limit: int | None = Field(None, ge=1, description="the first N examples of each task (None: all)")
    num_fewshot: int | None = Field(None, ge=0, description="few-shot examples (None: each task's own)")
    chat: bool = Field(False, description="format prompts with the chat template (an SFT model)")
    num_samples: int = Field(1, ge=1, description=f"{' and '.join(OWN_TASKS)} samples per problem (pass@k up to it)")
    temperature: float = Field(0.0, ge=0, validate_default=True, description="their sampling temperature")

    @model_validator(mode="before")
    @classmethod
    def _code_execution_is_a_flag(cls, data):
        if isinstance(data, dict) and "allow_code_execution" in data:
            raise ValueError(f"allow_code_execution: is no longer read from a file; running model-written code is "
                             f"decided on the command line, with {ALLOW_FLAG} (lapstudy run, train, eval)")
        return data

    @field_validator("temperature")
    @classmethod
    def _samples_differ(cls, temperature, info: ValidationInfo):
        num_samples = info.data.get("num_samples", 1)
        if num_samples > 1 and temperature == 0:
            raise ValueError(f"must be > 0 with num_samples {num_samples} (greedy samples are all the same); e.g. 0.8 "
                             "as the Codex paper's pass@10, 1.0 as nanochat's GSM8K pass@k")
        return temperature

    def relative_to(self, base: Path) -> EvaluationSpec:
        return self.model_copy(update={"include_path": [os.path.join(base, os.path.expanduser(p))
                                                        for p in self.include_path]})


def _as_list(value):
    return [] if value is None else [value] if isinstance(value, dict) else value


# `evaluate:` is one entry (a mapping) or a list of them: tasks that need other settings (samples, temperature,
# chat formatting) go in entries of their own.
Evaluations = Annotated[list[EvaluationSpec], BeforeValidator(_as_list)]


def check_evaluated_task(task: str, where: str) -> None:
    """Benchmarks evaluate language models: a UserError naming `where` for a run of any other task."""
    if task != EVALUATED_TASK:
        raise UserError(f"{where}: benchmarks evaluate language models (task {EVALUATED_TASK}), not {task}",
                        field="task")


def check_evaluation(task: str, evaluations: list[EvaluationSpec], where: str) -> None:
    """The `evaluate:` entries of a run or stage of `task` (a schema check: ValueError)."""
    if evaluations:
        try:
            check_evaluated_task(task, where)
        except UserError as exc:
            raise ValueError(str(exc)) from None
    tasks = [name for evaluation in evaluations for name in evaluation.tasks]
    twice = sorted({name for name in tasks if tasks.count(name) > 1})
    if twice:
        raise ValueError(f"{where}: {', '.join(twice)} in more than one entry (each task's metrics are logged once)")


def evaluations(run) -> list:
    """(where it is written, entry) of every `evaluate:` entry of a run config or a space."""
    return [*((f"evaluate[{i}]", e) for i, e in enumerate(run.evaluate)),
            *((f"stages[{s}].evaluate[{i}]", e) for s, stage in enumerate(run.stages)
              for i, e in enumerate(stage.evaluate))]


def check_humaneval_allowed(tasks, allow_code_execution: bool, where: str) -> None:
    """Where `tasks` (written at `where`: "--" on the command line) hold HumanEval, the sandbox's rule for running
    its code (CodeExecutionNotAllowed, SandboxUnavailable), checked before anything starts."""
    if HUMANEVAL in tasks:
        require_code_execution(allow_code_execution, f"{where}tasks {HUMANEVAL}")


def check_code_execution(run, allow_code_execution: bool, where: str) -> None:
    """`check_humaneval_allowed` for every `evaluate:` entry of a run config or a space (`where` names it)."""
    for place, evaluation in evaluations(run):
        check_humaneval_allowed(evaluation.tasks, allow_code_execution, f"{where}: {place}.")
