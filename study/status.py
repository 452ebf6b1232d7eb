"""A trial's status: the one rule that turns what Ray Tune knows about a trial into what `lapstudy` reports.

The same rule names the status in `lapstudy status`, the progress lines, the MLflow tag `lapstudy.status` with the
run's final MLflow status, the state of the configuration's trial in the study's Optuna journal, and the exit code of
`lapstudy train`.
"""

from __future__ import annotations

import re
from enum import Enum


class TrialStatus(str, Enum):
    PENDING = "pending"
    RUNNING = "running"
    COMPLETED = "completed"  # ran every epoch
    EARLY_STOPPED = "early_stopped"  # stopped by the space's early_stopping (ASHA) before the last epoch
    FAILED = "failed"  # an error, or a loss that stopped being finite

    def __str__(self) -> str:
        return self.value

    @property
    def finished(self) -> bool:
        return self in (TrialStatus.COMPLETED, TrialStatus.EARLY_STOPPED, TrialStatus.FAILED)

    @property
    def mlflow_status(self) -> str:
        """The MLflow run status a run of this trial ends with."""
        return {TrialStatus.COMPLETED: "FINISHED", TrialStatus.EARLY_STOPPED: "KILLED"}.get(self, "FAILED")

    @property
    def optuna_state(self) -> str:
        """The name of the Optuna TrialState a configuration of this status has in the study's journal."""
        return {TrialStatus.PENDING: "WAITING", TrialStatus.RUNNING: "RUNNING", TrialStatus.COMPLETED: "COMPLETE",
                TrialStatus.EARLY_STOPPED: "PRUNED", TrialStatus.FAILED: "FAIL"}[self]


def configuration_status(statuses) -> TrialStatus:
    """The status of a configuration from its replicates': failed when one failed, running until all have finished,
    stopped early when early stopping stopped one, completed only when every one ran every epoch. Its value is the
    replicates' mean only when completed: a mean over runs of different lengths would say nothing."""
    statuses = set(statuses)
    if TrialStatus.FAILED in statuses:
        return TrialStatus.FAILED
    if not all(status.finished for status in statuses):
        return TrialStatus.PENDING if statuses == {TrialStatus.PENDING} else TrialStatus.RUNNING
    return TrialStatus.EARLY_STOPPED if TrialStatus.EARLY_STOPPED in statuses else TrialStatus.COMPLETED


def trial_status(tune_status: str, result: dict | None, epochs: int, *, error: str | None = None,
                 finished: bool = False) -> tuple[TrialStatus, str | None]:
    """(status, error message) of a trial from Tune's status of it (PENDING, RUNNING, PAUSED, TERMINATED, ERROR),
    its last reported result and the epochs it was asked to run. `error`: Tune's error text for an ERROR trial.
    `finished`: the trial has just completed (Tune calls `on_trial_complete` before it marks it TERMINATED)."""
    result = result or {}
    if tune_status == "ERROR":
        return TrialStatus.FAILED, error_summary(error)
    if tune_status == "TERMINATED" or finished:
        if result.get("diverged"):
            return TrialStatus.FAILED, result.get("error")
        done = int(result.get("epoch", 0) or 0) >= epochs
        return (TrialStatus.COMPLETED if done else TrialStatus.EARLY_STOPPED), None
    if tune_status in ("RUNNING", "PAUSED"):
        return TrialStatus.RUNNING, None
    return TrialStatus.PENDING, None


def error_summary(text: str | None) -> str:
    """The last `SomeError: message` line of a traceback text (what a person needs in a table)."""
    if not text:
        return "unknown error"
    lines = [line.strip() for line in str(text).splitlines() if line.strip()]
    pattern = re.compile(r"^[\w.]*(Error|Exception|Exit|Interrupt)\b.*")
    for line in reversed(lines):
        if pattern.match(line):
            return line[:500]
    return lines[-1][:500] if lines else "unknown error"
