"""A study's trials as read back from Ray Tune's records in the study folder: status tables, the best trials and the
Pareto set. Ray's records are the source of truth (they hold every reported metric even when the MLflow server was
away); MLflow run ids come along in the reported metrics."""

from __future__ import annotations

import io
import json
import math
import sys
from dataclasses import dataclass, field

from ray.tune import ExperimentAnalysis
from rich import box
from rich.console import Console
from rich.table import Table

from study.errors import UserError
from study.folder import StudyFolder
from study.status import TrialStatus, trial_status


@dataclass
class TrialRecord:
    trial_id: str
    name: str
    status: TrialStatus
    params: dict
    epochs_run: int
    metrics: dict = field(default_factory=dict)  # the last reported result
    error: str | None = None

    @property
    def mlflow_run_id(self) -> str | None:
        return self.metrics.get("mlflow_run_id") or None


def record_from_trial(trial, epochs: int, *, finished: bool = False) -> TrialRecord:
    """A Tune `Trial` (live, in callbacks, or restored from the experiment state) as a TrialRecord. `finished`:
    the trial has just completed (Tune calls `on_trial_complete` before it marks the trial TERMINATED)."""
    result = dict(trial.last_result or {})
    error = trial.get_error() if trial.status == "ERROR" else None
    status, error = trial_status(trial.status, result, epochs, error=error, finished=finished)
    return TrialRecord(trial.trial_id, str(trial), status, dict(trial.config or {}), int(result.get("epoch", 0) or 0),
                       result, error)


def load_records(folder: StudyFolder) -> list[TrialRecord]:
    folder.record()  # a clear error when the folder is not a study
    epochs = folder.space().epochs
    try:
        analysis = ExperimentAnalysis(str(folder.path))
    except Exception as exc:  # noqa: BLE001 - no (readable) experiment state
        raise UserError(f"{folder.path}: no Ray Tune experiment state to read ({type(exc).__name__}); "
                        "has the study started?") from None
    return sorted((record_from_trial(t, epochs) for t in analysis.trials), key=lambda r: r.trial_id)


def trial_rows(folder: StudyFolder) -> dict[str, list[dict]]:
    """Every result each trial reported, in order: the JSON lines Ray Tune keeps in each trial's folder.

    Read here rather than through `ExperimentAnalysis.trial_dataframes`, which parses each file whole: one line
    cut short by a killed driver (a resumed trial's file keeps it, then goes on) costs it the trial's entire
    history, where this reader skips that line only."""
    trials: dict[str, list[dict]] = {}
    for path in sorted(folder.path.glob("*/result.json")):
        rows = []
        for line in path.read_text().splitlines():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                continue
        if rows:
            trials.setdefault(rows[0]["trial_id"], []).extend(rows)
    return trials


def metric_value(record: TrialRecord, metric: str) -> float:
    value = record.metrics.get(metric)
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else math.nan


def best_records(records, metrics: list[str], modes: list[str], *, include_running=False) -> list[TrialRecord]:
    """Single objective: trials that ran every epoch, best first. Several: their Pareto set (non-dominated)."""
    allowed = {TrialStatus.COMPLETED}
    if include_running:
        allowed |= {TrialStatus.RUNNING, TrialStatus.EARLY_STOPPED}
    pool = [r for r in records if r.status in allowed and all(math.isfinite(metric_value(r, m)) for m in metrics)]
    signs = [1.0 if mode == "max" else -1.0 for mode in modes]
    if len(metrics) == 1:
        return sorted(pool, key=lambda r: -signs[0] * metric_value(r, metrics[0]))
    scores = {r.trial_id: [s * metric_value(r, m) for s, m in zip(signs, metrics)] for r in pool}

    def dominated(a):
        return any(all(x >= y for x, y in zip(scores[b.trial_id], scores[a.trial_id]))
                   and any(x > y for x, y in zip(scores[b.trial_id], scores[a.trial_id])) for b in pool)

    return sorted([r for r in pool if not dominated(r)], key=lambda r: -scores[r.trial_id][0])


def count_statuses(records: list[TrialRecord]) -> dict[TrialStatus, int]:
    return {status: sum(r.status == status for r in records) for status in TrialStatus}


def format_params(params: dict) -> str:
    return ", ".join(f"{k}={_short(v)}" for k, v in params.items())


def format_metrics(record: TrialRecord, metrics: list[str]) -> str:
    parts = [f"{m} {metric_value(record, m):.4f}" for m in metrics if m in record.metrics]
    return ", ".join(parts + [f"{record.epochs_run} epochs"])


def _short(value) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def table(records: list[TrialRecord], metrics: list[str]) -> str:
    """Trials as a table (rich): id, status, epochs, metrics, params; then the errors of failed trials."""
    names = sorted({k for r in records for k in r.params})
    grid = Table(box=box.SIMPLE_HEAD, pad_edge=False, show_edge=False)
    for column in ("trial", "status", "epochs", *metrics, *names):
        grid.add_column(column)
    for r in records:
        grid.add_row(r.trial_id, r.status.value, str(r.epochs_run),
                     *(f"{metric_value(r, m):.4f}" if m in r.metrics else "-" for m in metrics),
                     *(_short(r.params[n]) if n in r.params else "-" for n in names))
    text = io.StringIO()
    # A terminal gets a table that fits it; a pipe or file one line per trial, however wide.
    Console(file=text, width=None if sys.stdout.isatty() else 100_000, no_color=True, highlight=False).print(grid)
    lines = [line.rstrip() for line in text.getvalue().splitlines()]
    errors = [f"  {r.trial_id}: {r.error}" for r in records if r.error]
    return "\n".join(lines + (["errors:"] + errors if errors else []))


def summary(records: list[TrialRecord], space, folder: StudyFolder, top: int = 5) -> str:
    counts = count_statuses(records)
    best = best_records(records, space.metrics, space.modes)
    title = "Pareto set" if space.multi_objective else f"best {min(top, len(best))} by {space.metrics[0]}"
    lines = [f"\nstudy {folder.name}: {len(records)} trials, {counts[TrialStatus.COMPLETED]} completed, "
             f"{counts[TrialStatus.EARLY_STOPPED]} stopped early, {counts[TrialStatus.FAILED]} failed"]
    if best:
        lines += [f"{title}:", table(best if space.multi_objective else best[:top], space.metrics)]
    else:
        lines.append("no trial completed every epoch")
    where = folder.path
    lines += ["next:", f"  lapstudy status {where}", f"  lapstudy export {where} --top 3",
              f"  lapstudy ui {where}      (MLflow UI: compare trials on {', '.join(space.metrics)} and geometry)"]
    return "\n".join(lines)
