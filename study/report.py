"""`lapstudy report`: a study's answer on one self-contained HTML page, `report/report.html` in the study folder (its
figures embedded; the PNGs beside it), also logged to the study's MLflow run. Made at the end of every study.

What it holds, all read from Ray's records of the trials (the study's source of truth):
- the best configurations, each metric's mean ± std over the replicates that ran every epoch, and the difference
  to the baseline paired by seed, with a 95% t interval (* where it excludes 0: larger than the seed noise);
- the geometry of every configuration against the baseline, paired the same way;
- the metric against the geometry across trials, and the geometry against each searched parameter, as Spearman
  rank correlations with 95% bootstrap intervals;
- figures: the metric and the geometry against each searched parameter (replicate error bars), the geometry over
  the epochs, the metric against the geometry, per-layer geometry (layer by trial), parameter importance (Optuna's
  PED-ANOVA) and, with several objectives, the Pareto front.
"""

from __future__ import annotations

import base64
import logging
import math
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
import optuna
from jinja2 import Environment
from mlflow.tracking import MlflowClient

from study import figures
from study.bookkeeping import TRIAL_IDENTITY
from study.folder import StudyFolder
from study.plots import LAYER_METRIC
from study.results import (
    Configuration,
    TrialRecord,
    baseline_configuration,
    best_configurations,
    configurations,
    load_records,
    metric_value,
    trial_rows,
)
from study.search import JOURNAL_FILE
from study.space import SearchSpace
from study.stats import PairedDifference, RankCorrelation, Summary, rank_correlation
from study.status import TrialStatus
from study.tasks import task_class
from study.tracking.runs import find_study_run
from study.tracking.store import short_error

log = logging.getLogger(__name__)

REPORT_DIR, REPORT_FILE = "report", "report.html"
TOP = 5


@dataclass
class Row:
    """One configuration in a table: its values and, per quantity, its summary and difference to the baseline."""

    config_id: str
    values: str
    baseline: bool
    summaries: dict[str, Summary]
    differences: dict[str, PairedDifference | None]


@dataclass
class Figure:
    title: str
    file: str
    caption: str
    data: str = ""  # base64 PNG


@dataclass
class Report:
    study: str
    made: str
    description: str
    metrics: list[str]
    counts: dict[str, int]
    trials: int
    configurations: int
    seeds: list[int]
    baseline: str | None
    best: list[Row]
    geometry_names: list[str]
    geometry_rows: list[Row]
    correlations: list[tuple[str, str, RankCorrelation]]
    parameter_trends: list[tuple[str, str, RankCorrelation]]
    figures: list[Figure] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def write_report(folder: StudyFolder) -> Path:
    """Make the report of the study in `folder` (report/report.html and its PNGs), log it to the study's MLflow run
    where the store answers, and return the page's path."""
    space, record = folder.space(), folder.record()
    records = load_records(folder)
    out = folder.path / REPORT_DIR
    out.mkdir(exist_ok=True)
    report = build(space, records, trial_rows(folder), folder, out)
    report.seeds = record.seeds or [record.seed]
    page = out / REPORT_FILE
    page.write_text(render(report))
    try:
        client = MlflowClient(record.tracking_uri)
        run_id = find_study_run(client, record.experiment_id)
        if run_id is not None:
            client.log_artifacts(run_id, str(out), REPORT_DIR)
    except Exception as exc:  # noqa: BLE001 - the report is in the study folder whatever MLflow does
        log.warning("MLflow: could not log the report to the study's run: %s", short_error(exc))
    return page


def build(space: SearchSpace, records: list[TrialRecord], rows: dict[str, list[dict]], folder: StudyFolder,
          out: Path) -> Report:
    task = task_class(space.task)
    metrics = space.metrics
    geometry = [f"geom_{name}" for name in task.report_geometry]
    groups = configurations(records)
    baseline = baseline_configuration(groups, space)
    best = best_configurations(groups, metrics, space.modes)
    shown = best if space.multi_objective else best[:TOP]
    if baseline is not None and baseline not in shown:
        shown = [*shown, baseline]
    completed = [r for r in records if r.status is TrialStatus.COMPLETED]
    report = Report(
        study=folder.name, made=datetime.now(timezone.utc).isoformat(timespec="seconds"),
        description=space.description, metrics=metrics,
        counts={status.value: sum(r.status is status for r in records) for status in TrialStatus if status.finished},
        trials=len(records), configurations=len(groups), seeds=[], baseline=_values(baseline) if baseline else None,
        best=[_row(g, metrics, baseline) for g in shown], geometry_names=geometry,
        geometry_rows=[_row(g, geometry, baseline) for g in groups if baseline is not None],
        correlations=[(m, g, rank_correlation([metric_value(r, g) for r in completed],
                                              [metric_value(r, m) for r in completed]))
                      for m in metrics for g in geometry],
        parameter_trends=[(p, g, rank_correlation([float(r.sampled[p]) for r in completed if p in r.sampled],
                                                  [metric_value(r, g) for r in completed if p in r.sampled]))
                          for p in _numeric_parameters(space, completed) for g in geometry],
    )
    if not best:
        report.notes.append("No configuration has run every epoch of every replicate yet.")
    _figures(report, space, groups, completed, rows, folder, out)
    return report


def _row(group: Configuration, names: list[str], baseline: Configuration | None) -> Row:
    return Row(group.config_id, _values(group), group is baseline,
               {n: group.summary(n) for n in names},
               {n: group.difference(baseline, n) if baseline is not None and group is not baseline else None
                for n in names})


def _values(group: Configuration) -> str:
    return ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in group.sampled.items())


def searched(space: SearchSpace) -> list[str]:
    """Every parameter the space searches, conditional ones included, in the order the space names them."""
    names = list(space.parameters)
    for group in space.conditional:
        names += [name for name in group.parameters if name not in names]
    return names


def _numeric_parameters(space: SearchSpace, trials: list[TrialRecord]) -> list[str]:
    return [p for p in searched(space)
            if len({t.sampled.get(p) for t in trials if p in t.sampled}) > 1
            and all(isinstance(t.sampled[p], int | float) and not isinstance(t.sampled[p], bool)
                    for t in trials if p in t.sampled)]


def _figures(report: Report, space: SearchSpace, groups: list[Configuration], completed: list[TrialRecord],
             rows: dict[str, list[dict]], folder: StudyFolder, out: Path) -> None:
    parameters = [p for p in searched(space) if any(p in g.sampled for g in groups)]
    grouping = next((p for p in ("schedule", "mixer") if p in parameters), None)

    def panels(quantities):
        return {q: {p: [(g.sampled[p], g.summary(q).mean, g.summary(q).std,
                         g.sampled.get(grouping, "") if grouping != p else "")
                        for g in groups if p in g.sampled and g.summary(q).n]
                    for p in parameters} for q in quantities}

    def add(title, file, caption, draw):
        try:
            draw(out / file)
            report.figures.append(Figure(title, file, caption))
        except Exception as exc:  # noqa: BLE001 - one figure that cannot be drawn must not cost the report
            report.notes.append(f"{title}: not drawn ({short_error(exc)})")

    if parameters and completed:
        add("Metrics against the searched parameters", "metrics_vs_parameters.png",
            "Mean over the replicates that ran every epoch; bars: one standard deviation over seeds"
            + (f"; colours: {grouping}" if grouping else "") + ".",
            lambda path: figures.against_parameters(panels(report.metrics), path, "metrics"))
        add("Geometry against the searched parameters", "geometry_vs_parameters.png",
            "Last-layer geometry at the last epoch; mean and standard deviation over seeds.",
            lambda path: figures.against_parameters(panels(report.geometry_names), path, "geometry"))
    series = {g: [(_values_of(rows_of), [r["epoch"] for r in rows_of if g in r],
                   [r[g] for r in rows_of if g in r]) for rows_of in rows.values()]
              for g in report.geometry_names}
    if any(epochs for lines in series.values() for _, epochs, _ in lines):
        add("Geometry over the epochs", "geometry_over_epochs.png",
            "Every trial at every epoch the geometry was computed (the geometry.every epochs, ASHA's rungs, the "
            "last); stopped trials end where they were judged.",
            lambda path: figures.trajectories(series, path, "last-layer geometry during training"))
    if completed:
        metric = report.metrics[0]
        captions = {g: str(c) for m, g, c in report.correlations if m == metric}
        add(f"{metric} against the geometry", "metric_vs_geometry.png",
            "Each point a trial that ran every epoch; Spearman's rho with its 95% bootstrap interval.",
            lambda path: figures.scatter_panels(
                [(g, [metric_value(r, g) for r in completed], [metric_value(r, metric) for r in completed],
                  captions[g]) for g in report.geometry_names], metric, path, f"{metric} against the geometry"))
    for name, (labels, values) in _layer_tables(completed).items():
        add(f"{name} per layer", f"layers_{name}.png",
            "Each block's output through the final norm, at the last epoch, for every trial that ran every epoch.",
            lambda path, v=values, t=labels, n=name: figures.layers_by_trial(v, t, path, f"{n} per layer"))
    importances = _importances(folder, space)
    if isinstance(importances, tuple) and importances[0]:
        importances, used, left_out = importances
        add("Parameter importance", "importance.png",
            "Optuna's PED-ANOVA importance of each parameter for the objective the sampler saw (per configuration: "
            f"the mean over its replicates), from the {used} configurations that ran every epoch of every replicate"
            + (f"; {left_out} stopped early or failed are left out" if left_out else "") + ".",
            lambda path: figures.bars(importances, path, "parameter importance (PED-ANOVA)", "importance"))
    elif isinstance(importances, str):
        report.notes.append(f"Parameter importance: {importances}")
    if space.multi_objective and len(report.metrics) >= 2:
        ranked = {id(g) for g in best_configurations(groups, report.metrics, space.modes)}
        complete = [g for g in groups if g.trials and len(g.completed()) == len(g.trials)]
        points = [(g.summary(report.metrics[0]).mean, g.summary(report.metrics[1]).mean, id(g) in ranked)
                  for g in complete]
        add("Pareto front", "pareto.png", "Configurations' means; the front in red.",
            lambda path: figures.pareto(points, (report.metrics[0], report.metrics[1]), path, "Pareto front"))
    for figure in report.figures:
        figure.data = base64.b64encode((out / figure.file).read_bytes()).decode("ascii")


def _values_of(rows: list[dict]) -> str:
    config = rows[0].get("config", {}) if rows else {}
    return ", ".join(f"{k}={v}" for k, v in config.items() if k not in TRIAL_IDENTITY)


def _layer_tables(trials: list[TrialRecord]) -> dict[str, tuple[list[str], np.ndarray]]:
    """Per-layer geometry at the last epoch: name -> (trial ids, values (layers, trials))."""
    found: dict[str, dict[str, dict[int, float]]] = {}
    for trial in trials:
        for key, value in trial.metrics.items():
            match = LAYER_METRIC.match(key)
            if match:
                found.setdefault(match[2], {}).setdefault(trial.trial_id, {})[int(match[1])] = value
    tables = {}
    for name, by_trial in found.items():
        ids = sorted(by_trial)
        layers = 1 + max(layer for values in by_trial.values() for layer in values)
        tables[name] = (ids, np.array([[by_trial[t].get(layer, math.nan) for t in ids] for layer in range(layers)]))
    return tables


def _importances(folder: StudyFolder, space: SearchSpace) -> tuple[dict[str, float], int, int] | str:
    """Optuna's importances over the journal's COMPLETE trials (configurations that ran every epoch), how many those
    are and how many finished otherwise; or why there are none."""
    journal = folder.path / JOURNAL_FILE
    if not journal.is_file():
        return "no Optuna journal in the study folder (a study started before it was kept)"
    if space.multi_objective:
        return "shown for single-objective studies only"
    try:
        storage = optuna.storages.JournalStorage(optuna.storages.journal.JournalFileBackend(str(journal)))
        study = optuna.load_study(study_name=space.name, storage=storage)
        states = [t.state for t in study.trials]
        finished_otherwise = sum(s in (optuna.trial.TrialState.PRUNED, optuna.trial.TrialState.FAIL) for s in states)
        return (dict(optuna.importance.get_param_importances(study)),
                states.count(optuna.trial.TrialState.COMPLETE), finished_otherwise)
    except Exception as exc:  # noqa: BLE001 - too few configurations, a single value per parameter, ...
        return f"not computed ({short_error(exc)})"


def render(report: Report) -> str:
    environment = Environment(autoescape=True, trim_blocks=True, lstrip_blocks=True)
    environment.filters["number"] = lambda v: "-" if v is None or not math.isfinite(v) else f"{v:.4f}"
    environment.filters["exact"] = lambda v: "nan" if v is None or not math.isfinite(v) else repr(float(v))
    return environment.from_string(TEMPLATE).render(r=report)


TEMPLATE = """<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<title>lapstudy report: {{ r.study }}</title>
<style>
body { font-family: system-ui, sans-serif; margin: 2em auto; max-width: 1200px; color: #222; }
table { border-collapse: collapse; margin: 1em 0; font-size: 0.9em; }
th, td { border-bottom: 1px solid #ddd; padding: 0.3em 0.7em; text-align: left; }
td.number { text-align: right; font-variant-numeric: tabular-nums; }
tr.baseline { background: #f4f4f4; }
.beyond { font-weight: bold; }
figure { margin: 2em 0; }
figure img { max-width: 100%; border: 1px solid #eee; }
.note { color: #a33; }
</style>
</head>
<body>
<h1>Study {{ r.study }}</h1>
<p>{{ r.description }}</p>
<p>{{ r.trials }} trials: {{ r.configurations }} configurations{% if r.seeds|length > 1 %} at {{ r.seeds|length }}
seeds ({{ r.seeds|join(", ") }}){% endif %};
{% for status, n in r.counts.items() %}{{ n }} {{ status.replace("_", " ") }}
{%- if not loop.last %}, {% endif %}{% endfor %}.
{% if r.baseline %}Baseline: {{ r.baseline }}.{% endif %} Made {{ r.made }}.</p>
{% for note in r.notes %}<p class="note">{{ note }}</p>{% endfor %}

<h2 id="summary">The best configurations</h2>
<p>Mean ± standard deviation over the replicates that ran every epoch (n of them).
{% if r.baseline %}The difference to the baseline is paired by seed: its mean and 95% t interval; <b>bold</b>
where the interval excludes 0, that is where the difference is larger than the seed-to-seed noise.{% endif %}</p>
<table id="summary-table">
<thead><tr><th>configuration</th><th>values</th>
{% for m in r.metrics %}<th>{{ m }} mean</th><th>std</th><th>n</th>
{% if r.baseline %}<th>{{ m }} − baseline</th><th>95% interval</th><th>beyond noise</th>{% endif %}
{% endfor %}</tr></thead>
<tbody>
{% for row in r.best %}
<tr class="{{ 'baseline' if row.baseline else '' }}" data-config="{{ row.config_id }}">
<td>{{ row.config_id }}{% if row.baseline %} (baseline){% endif %}</td><td>{{ row.values }}</td>
{% for m in r.metrics %}{% set s = row.summaries[m] %}{% set d = row.differences[m] %}
<td class="number" data-metric="{{ m }}" data-field="mean" data-value="{{ s.mean|exact }}">
{{- s.mean|number }}</td>
<td class="number" data-metric="{{ m }}" data-field="std" data-value="{{ s.std|exact }}">{{ s.std|number }}</td>
<td class="number" data-metric="{{ m }}" data-field="n" data-value="{{ s.n }}">{{ s.n }}</td>
{% if r.baseline %}{% if d %}
<td class="number{{ ' beyond' if d.beyond_noise else '' }}" data-metric="{{ m }}" data-field="difference"
    data-value="{{ d.mean|exact }}">{{ d.mean|number }}</td>
<td class="number" data-metric="{{ m }}" data-field="interval" data-low="{{ d.low|exact }}"
    data-high="{{ d.high|exact }}">[{{ d.low|number }}, {{ d.high|number }}]</td>
<td data-metric="{{ m }}" data-field="beyond" data-value="{{ 'yes' if d.beyond_noise else 'no' }}">
{{- "yes" if d.beyond_noise else "no" }}</td>
{% else %}<td></td><td></td><td></td>{% endif %}{% endif %}
{% endfor %}</tr>
{% endfor %}
</tbody></table>

{% if r.geometry_rows %}
<h2 id="geometry-vs-baseline">Geometry against the baseline</h2>
<p>Last-layer geometry at the last epoch, each configuration minus the baseline, paired by seed (95% t interval;
<b>bold</b> where it excludes 0).</p>
<table id="geometry-table">
<thead><tr><th>configuration</th><th>values</th>
{% for g in r.geometry_names %}<th>{{ g }} mean</th><th>− baseline [95%]</th>{% endfor %}</tr></thead>
<tbody>
{% for row in r.geometry_rows %}
<tr class="{{ 'baseline' if row.baseline else '' }}">
<td>{{ row.config_id }}{% if row.baseline %} (baseline){% endif %}</td><td>{{ row.values }}</td>
{% for g in r.geometry_names %}{% set s = row.summaries[g] %}{% set d = row.differences[g] %}
<td class="number">{{ s.mean|number }}</td>
<td class="number{{ ' beyond' if d and d.beyond_noise else '' }}">
{%- if d %}{{ d.mean|number }} [{{ d.low|number }}, {{ d.high|number }}]{% endif %}</td>
{% endfor %}</tr>
{% endfor %}
</tbody></table>
{% endif %}

<h2 id="correlations">The metric against the geometry</h2>
<p>Spearman's rank correlation across the trials that ran every epoch, with a 95% bootstrap interval: the paper's
claim, tested on this study's own data.</p>
<table id="correlation-table">
<thead><tr><th>metric</th><th>geometry</th><th>rho</th><th>95% interval</th><th>n</th></tr></thead>
<tbody>{% for m, g, c in r.correlations %}
<tr><td>{{ m }}</td><td>{{ g }}</td><td class="number">{{ c.rho|number }}</td>
<td class="number">[{{ c.low|number }}, {{ c.high|number }}]</td><td class="number">{{ c.n }}</td></tr>
{% endfor %}</tbody></table>

{% if r.parameter_trends %}
<h2 id="trends">The geometry against the searched parameters</h2>
<table id="trend-table">
<thead><tr><th>parameter</th><th>geometry</th><th>rho</th><th>95% interval</th><th>n</th></tr></thead>
<tbody>{% for p, g, c in r.parameter_trends %}
<tr><td>{{ p }}</td><td>{{ g }}</td><td class="number">{{ c.rho|number }}</td>
<td class="number">[{{ c.low|number }}, {{ c.high|number }}]</td><td class="number">{{ c.n }}</td></tr>
{% endfor %}</tbody></table>
{% endif %}

<h2 id="figures">Figures</h2>
{% for f in r.figures %}
<figure id="figure-{{ loop.index }}"><figcaption><b>{{ f.title }}.</b> {{ f.caption }}</figcaption>
<img src="data:image/png;base64,{{ f.data }}" alt="{{ f.title }}" data-file="{{ f.file }}"></figure>
{% endfor %}
</body>
</html>
"""
