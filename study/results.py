"""A study's trials as read back from Ray Tune's records in the study folder: status tables, the best trials and the
Pareto set. Ray's records are the source of truth (they hold every reported metric even when the MLflow server was
away); MLflow run ids come along in the reported metrics.

The records are read as plain JSON, without Ray: Tune's `ExperimentAnalysis` imports Ray Tune and unpickles every
trial (its trainable's module included: torch, the training loop), which made `lapstudy status` take seconds
before it read a line, and would run whatever pickles a study folder in a shared bucket holds."""

from __future__ import annotations

import io
import json
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path

from rich import box
from rich.console import Console
from rich.table import Table

from study.bookkeeping import CONFIG_ID, REPLICATE, SEED, TRIAL_IDENTITY
from study.errors import UserError
from study.folder import StudyFolder
from study.stats import PairedDifference, Summary, paired_difference, summarize
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

    @property
    def config_id(self) -> str:
        """The configuration this trial is a replicate of (the study's searcher names it in every trial's config)."""
        return str(self.params[CONFIG_ID])

    @property
    def seed(self) -> int:
        return self.params[SEED]

    @property
    def sampled(self) -> dict:
        """The values the sampler chose (what the configuration is), without the replicate's bookkeeping."""
        return {k: v for k, v in self.params.items() if k not in TRIAL_IDENTITY}


@dataclass
class Configuration:
    """The replicates of one sampled configuration (one trial per seed)."""

    config_id: str
    sampled: dict
    trials: list[TrialRecord]

    def completed(self) -> list[TrialRecord]:
        return [t for t in self.trials if t.status is TrialStatus.COMPLETED]

    def summary(self, metric: str) -> Summary:
        """Mean ± std over the replicates that ran every epoch."""
        return summarize([metric_value(t, metric) for t in self.completed()])

    def by_seed(self, metric: str) -> dict[int, float]:
        return {t.seed: metric_value(t, metric) for t in self.completed()}

    def difference(self, baseline: "Configuration", metric: str) -> PairedDifference:
        return paired_difference(self.by_seed(metric), baseline.by_seed(metric))


def configurations(records: list[TrialRecord]) -> list[Configuration]:
    """Trials grouped by configuration, in the order the configurations were first proposed."""
    grouped: dict[str, Configuration] = {}
    for record in sorted(records, key=lambda r: (r.trial_id, r.params[REPLICATE])):
        configuration = grouped.setdefault(record.config_id, Configuration(record.config_id, record.sampled, []))
        configuration.trials.append(record)
    return list(grouped.values())


def best_configurations(groups: list[Configuration], metrics: list[str], modes: list[str]) -> list[Configuration]:
    """Configurations every replicate of which ran every epoch: by their mean, best first (one metric), or their
    Pareto set on the means (several)."""
    complete = [g for g in groups if g.trials and len(g.completed()) == len(g.trials)]
    return _rank(complete, lambda g: [g.summary(m).mean for m in metrics], modes)


@dataclass(frozen=True)
class StudyBest:
    """What a study found, for its MLflow run: the best configuration's values and metrics (with replicates, the
    means over seeds that ran every epoch), its trials and how many replicates the means are over."""

    sampled: dict
    metrics: dict[str, float]
    trials: list[TrialRecord]
    replicates: int


def study_best(records: list[TrialRecord], metrics: list[str], modes: list[str]) -> StudyBest | None:
    """The best configuration by the first metric (a Pareto set's first, with several), from full-length runs only;
    None while nothing ran every epoch."""
    groups = configurations(records)
    if any(len(g.trials) > 1 for g in groups):
        best = best_configurations(groups, metrics, modes)
        if not best:
            return None
        group = best[0]
        return StudyBest(group.sampled, {m: group.summary(m).mean for m in metrics}, group.completed(),
                         len(group.completed()))
    best = best_records(records, metrics, modes)
    if not best:
        return None
    return StudyBest(best[0].sampled, {m: metric_value(best[0], m) for m in metrics}, [best[0]], 1)


def baseline_configuration(groups: list[Configuration], space) -> Configuration | None:
    return next((g for g in groups if space.is_baseline(g.sampled)), None)


def record_from_trial(trial, epochs: int, *, finished: bool = False) -> TrialRecord:
    """A Tune `Trial` (live, in callbacks, or restored from the experiment state) as a TrialRecord. `finished`:
    the trial has just completed (Tune calls `on_trial_complete` before it marks the trial TERMINATED)."""
    result = dict(trial.last_result or {})
    error = trial.get_error() if trial.status == "ERROR" else None
    status, error = trial_status(trial.status, result, epochs, error=error, finished=finished)
    return TrialRecord(trial.trial_id, str(trial), status, dict(trial.config or {}), int(result.get("epoch", 0) or 0),
                       result, error)


# Tune's experiment state in the study folder: one file per driver session, named by its start time
# (ray.tune TuneController.CKPT_FILE_TMPL); Tune restores the newest name, and so do we.
EXPERIMENT_STATE_GLOB = "experiment_state-*.json"


def load_records(folder: StudyFolder) -> list[TrialRecord]:
    """Every trial of the study, as Tune's newest experiment state records it (what `ExperimentAnalysis` reads)."""
    folder.record()  # a clear error when the folder is not a study
    epochs = folder.space().total_epochs
    states = sorted(folder.path.glob(EXPERIMENT_STATE_GLOB), key=lambda path: path.name)
    try:
        trial_data = json.loads(states[-1].read_text())["trial_data"]
        records = [_record(json.loads(state), json.loads(metadata), folder.path, epochs)
                   for state, metadata in trial_data]
    except (IndexError, OSError, ValueError, KeyError, TypeError) as exc:  # none, or not Tune's state
        raise UserError(f"{folder.location}: no Ray Tune experiment state to read ({type(exc).__name__}); "
                        "has the study started?") from None
    return sorted(records, key=lambda r: r.trial_id)


def _record(state: dict, metadata: dict, study_dir: Path, epochs: int) -> TrialRecord:
    """A trial from its entry in Tune's experiment state: the JSON of its state (`Trial.get_json_state`) and of its
    run metadata (`_TrainingRunMetadata`); its error text from the file that metadata names in the trial's folder."""
    result = dict(metadata.get("last_result") or {"trial_id": state["trial_id"]})  # Trial.last_result's default
    error = None
    if state["status"] == "ERROR" and metadata.get("error_filename"):
        error_file = study_dir / state["relative_logdir"] / metadata["error_filename"]
        error = error_file.read_text(errors="replace") if error_file.is_file() else None
    status, error = trial_status(state["status"], result, epochs, error=error)
    name = state.get("custom_trial_name") or f"{state['trainable_name']}_{state['trial_id']}"
    return TrialRecord(state["trial_id"], name, status, dict(state.get("config") or {}),
                       int(result.get("epoch", 0) or 0), result, error)


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
    pool = [r for r in records if r.status in allowed]
    return _rank(pool, lambda r: [metric_value(r, m) for m in metrics], modes)


def _rank(items: list, values, modes: list[str]) -> list:
    """The items whose `values(item)` are all finite: best first by the one value, or, with several, their Pareto
    set (no other item at least as good in every value and better in one), by the first value."""
    signs = [1.0 if mode == "max" else -1.0 for mode in modes]
    scores = {id(item): [s * v for s, v in zip(signs, values(item))] for item in items}
    pool = [item for item in items if all(math.isfinite(v) for v in scores[id(item)])]
    if len(modes) > 1:
        def dominated(a):
            return any(all(x >= y for x, y in zip(scores[id(b)], scores[id(a)]))
                       and any(x > y for x, y in zip(scores[id(b)], scores[id(a)])) for b in pool)

        pool = [item for item in pool if not dominated(item)]
    return sorted(pool, key=lambda item: -scores[id(item)][0])


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
    """Trials as a table (rich): id, status, epochs, metrics, params (and the configuration and seed of
    replicates); then the errors of failed trials."""
    replicated = any(r.params[REPLICATE] for r in records)
    names = sorted({k for r in records for k in r.sampled})
    grid = _grid("trial", *(("config", "seed") if replicated else ()), "status", "epochs", *metrics, *names)
    for r in records:
        grid.add_row(r.trial_id, *((r.config_id, str(r.seed)) if replicated else ()), r.status.value,
                     str(r.epochs_run), *(f"{metric_value(r, m):.4f}" if m in r.metrics else "-" for m in metrics),
                     *(_short(r.sampled[n]) if n in r.sampled else "-" for n in names))
    errors = [f"  {r.trial_id}: {r.error}" for r in records if r.error]
    return "\n".join(_render(grid) + (["errors:"] + errors if errors else []))


def configuration_table(groups: list[Configuration], metrics: list[str], baseline: Configuration | None) -> str:
    """Configurations as a table: their values, each metric's mean ± std over the replicates that ran every epoch,
    and its difference to the baseline paired by seed (95% interval; * where it excludes 0)."""
    names = sorted({k for g in groups for k in g.sampled})
    vs = [f"{m} - baseline" for m in metrics] if baseline is not None else []
    grid = _grid("config", "trials", *names, *metrics, *vs)
    for g in groups:
        differences = [("baseline" if g is baseline else str(g.difference(baseline, m))) for m in metrics] \
            if baseline is not None else []
        grid.add_row(g.config_id, str(len(g.trials)), *(_short(g.sampled[n]) if n in g.sampled else "-" for n in names),
                     *(str(g.summary(m)) for m in metrics), *differences)
    return "\n".join(_render(grid))


def _grid(*columns: str) -> Table:
    grid = Table(box=box.SIMPLE_HEAD, pad_edge=False, show_edge=False)
    for column in columns:
        grid.add_column(column)
    return grid


def _render(grid: Table) -> list[str]:
    text = io.StringIO()
    # A terminal gets a table that fits it; a pipe or file one line per row, however wide.
    Console(file=text, width=None if sys.stdout.isatty() else 100_000, no_color=True, highlight=False).print(grid)
    return [line.rstrip() for line in text.getvalue().splitlines()]


def status(folder: StudyFolder) -> str:
    """`lapstudy status`: every trial, and with replicates every configuration (mean ± std, difference to the
    baseline)."""
    record, space = folder.record(), folder.space()
    records = load_records(folder)
    seeds = record.seeds
    lines = [f"study {record.name} ({folder.location}): {len(records)} of {record.num_samples * len(seeds)} trials "
             "started" + (f" ({record.num_samples} configurations x {len(seeds)} seeds)" if len(seeds) > 1 else ""),
             table(records, record.metric)]
    groups = configurations(records)
    if len(seeds) > 1:
        lines += ["configurations (mean ± std over the replicates that ran every epoch):",
                  configuration_table(groups, record.metric, baseline_configuration(groups, space))]
    return "\n".join(lines)


def status_document(folder: StudyFolder) -> dict:
    """`lapstudy status --json`: what the table shows, for scripts; a value no trial reported (or NaN) is null."""
    record, space = folder.record(), folder.space()
    records = load_records(folder)
    seeds = record.seeds
    groups = configurations(records)
    baseline = baseline_configuration(groups, space)
    document = {
        "study": record.name, "location": folder.location, "trials_planned": record.num_samples * len(seeds),
        "metric": dict(zip(record.metric, record.mode)),
        "trials": [{"trial_id": r.trial_id, "name": r.name, "status": r.status.value, "epochs": r.epochs_run,
                    "config_id": r.config_id, "seed": r.seed, "params": r.sampled,
                    "metrics": {m: json_number(metric_value(r, m)) for m in record.metric}, "error": r.error}
                   for r in records],
    }
    if len(seeds) > 1:
        def summary_of(summary) -> dict:
            return {"mean": json_number(summary.mean), "std": json_number(summary.std), "n": summary.n}

        document["configurations"] = [
            {"config_id": g.config_id, "params": g.sampled, "trials": [t.trial_id for t in g.trials],
             "metrics": {m: summary_of(g.summary(m)) for m in record.metric},
             **({"minus_baseline": {m: summary_of(g.difference(baseline, m)) for m in record.metric}}
                if baseline is not None and g is not baseline else {})}
            for g in groups]
    return document


def json_number(value):
    """A metric value as JSON has it: a finite number, else null (JSON has no NaN)."""
    return value if isinstance(value, int | float) and math.isfinite(value) else None


def summary(records: list[TrialRecord], space, folder: StudyFolder, top: int = 5) -> str:
    counts = count_statuses(records)
    lines = [f"\nstudy {folder.name}: {len(records)} trials, {counts[TrialStatus.COMPLETED]} completed, "
             f"{counts[TrialStatus.EARLY_STOPPED]} stopped early, {counts[TrialStatus.FAILED]} failed"]
    groups = configurations(records)
    if any(len(g.trials) > 1 for g in groups):
        best = best_configurations(groups, space.metrics, space.modes)
        shown = best if space.multi_objective else best[:top]
        title = ("Pareto set" if space.multi_objective
                 else f"best {len(shown)} configurations by mean {space.metrics[0]}")
        if best:
            lines += [f"{title}:", configuration_table(shown, space.metrics, baseline_configuration(groups, space))]
        else:
            lines.append("no configuration completed every epoch of every replicate")
    else:
        best = best_records(records, space.metrics, space.modes)
        title = "Pareto set" if space.multi_objective else f"best {min(top, len(best))} by {space.metrics[0]}"
        if best:
            lines += [f"{title}:", table(best if space.multi_objective else best[:top], space.metrics)]
        else:
            lines.append("no trial completed every epoch")
    where = folder.location
    lines += ["next:", f"  lapstudy status {where}", f"  lapstudy export {where} --top 3",
              f"  lapstudy report {where}    (the study's report: {folder.path / 'report' / 'report.html'})",
              f"  lapstudy ui {where}      (MLflow UI: compare trials on {', '.join(space.metrics)} and geometry)"
              if not folder.remote else f"  MLflow UI: {folder.record().tracking_uri}"]
    return "\n".join(lines)
