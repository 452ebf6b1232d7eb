"""`lapstudy report`: a study's answer on one self-contained HTML page, `report/report.html` in the study folder (its
figures embedded; the PNGs beside it), also logged to the study's MLflow run. Made at the end of every study.

What it holds, all read from Ray's records of the trials (the study's source of truth):
- the best configurations, each metric's mean ± std over the replicates that ran every epoch, and the difference
  to the baseline paired by seed, with a 95% t interval (* where it excludes 0: larger than the seed noise);
- the geometry of every configuration against the baseline, paired the same way;
- the metric against the geometry across trials, and the geometry against each searched parameter, as Spearman
  rank correlations with 95% bootstrap intervals;
- figures: first each configuration's paired difference to the baseline; interactive (plotly, study/interactive.py)
  where trials are compared: the geometry over the epochs, per-layer geometry (layer by trial), and Optuna's history,
  slices, parallel coordinates, contour and PED-ANOVA importance of the sampler's study; as PNGs the metric and the
  geometry against each searched parameter (replicate error bars), the metric against the geometry and, with several
  objectives, the Pareto front. Trials are named by their configuration's values; a parameter no trial sampled gets
  no panel.
"""

from __future__ import annotations

import base64
import logging
import math
from dataclasses import dataclass, field
from datetime import datetime, timezone
from importlib import resources
from pathlib import Path

import numpy as np
import optuna
from jinja2 import Environment
from mlflow.tracking import MlflowClient

from study import figures, interactive
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
TEMPLATE = resources.files("study") / "templates" / "report.html"
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
    """A PNG (`file` beside the page, `data` embedded) or an interactive plotly figure (`html`)."""

    title: str
    caption: str
    file: str = ""
    data: str = ""  # base64 PNG
    html: str = ""


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
    paired: Figure | None = None  # every configuration's paired difference to the baseline, at the top
    figures: list[Figure] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def write_report(folder: StudyFolder) -> Path:
    """Make the report of the study in `folder` (report/report.html and its PNGs), log it to the study's MLflow run
    where the store answers, and return the page's path."""
    space, record = folder.space(), folder.record()
    records = load_records(folder)
    out = folder.path / REPORT_DIR
    out.mkdir(exist_ok=True)
    for stale in out.glob("*.png"):  # a figure an earlier report drew and this one does not (e.g. now interactive)
        stale.unlink()
    report = build(space, records, trial_rows(folder), folder, out)
    report.seeds = record.seeds
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
        trials=len(records), configurations=len(groups), seeds=[],
        baseline=interactive.label(baseline.sampled) if baseline else None,
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
    if baseline is not None:
        compared = [(interactive.label(g.sampled), {m: g.difference(baseline, m) for m in metrics})
                    for g in groups if g is not baseline]
        compared = [(text, d) for text, d in compared if any(math.isfinite(x.mean) for x in d.values())]
        if compared:
            report.paired = Figure(
                "Each configuration against the baseline",
                "The mean difference to the baseline, paired by seed, with its 95% t interval; red where it excludes "
                "0 (beyond the seed noise). Hover for the values; click a legend entry to hide its points.",
                html=interactive.to_html(interactive.paired_differences(compared, metrics), "plot-paired"))
    _figures(report, space, groups, completed, rows, folder, out)
    return report


def _row(group: Configuration, names: list[str], baseline: Configuration | None) -> Row:
    return Row(group.config_id, interactive.label(group.sampled), group is baseline,
               {n: group.summary(n) for n in names},
               {n: group.difference(baseline, n) if baseline is not None and group is not baseline else None
                for n in names})


def searched(space: SearchSpace) -> list[str]:
    """Every parameter the space searches, conditional ones included, in the order the space names them."""
    return [name for name, _ in space.every_parameter()]


def _numeric_parameters(space: SearchSpace, trials: list[TrialRecord]) -> list[str]:
    return [p for p in searched(space)
            if len({t.sampled.get(p) for t in trials if p in t.sampled}) > 1
            and all(isinstance(t.sampled[p], int | float) and not isinstance(t.sampled[p], bool)
                    for t in trials if p in t.sampled)]


def parameter_panels(groups: list[Configuration], parameters: list[str], quantities: list[str],
                     grouping: str | None) -> dict[str, dict[str, list[tuple]]]:
    """Per quantity, per parameter: (value, mean, std, group) of each configuration that holds the parameter and
    has replicates that ran every epoch. Only parameters with points in every quantity's row get a column: a
    conditional parameter the study never sampled (or sampled only in configurations stopped early) gets no empty
    panel."""
    points = {q: {p: [(g.sampled[p], g.summary(q).mean, g.summary(q).std,
                       g.sampled.get(grouping, "") if grouping != p else "")
                      for g in groups if p in g.sampled and g.summary(q).n]
                  for p in parameters} for q in quantities}
    shown = [p for p in parameters if all(points[q][p] for q in quantities)]
    return {q: {p: points[q][p] for p in shown} for q in quantities}


def _figures(report: Report, space: SearchSpace, groups: list[Configuration], completed: list[TrialRecord],
             rows: dict[str, list[dict]], folder: StudyFolder, out: Path) -> None:
    parameters = interactive.with_values(searched(space), [g.sampled for g in groups])
    grouping = next((p for p in ("laplacian_schedule", "mixer") if p in parameters), None)

    def add(title, caption, draw, file=""):
        """A PNG drawn into `file`, or (no file) a plotly figure from `draw()`."""
        try:
            if file:
                draw(out / file)
                report.figures.append(Figure(title, caption, file=file))
            else:
                html = interactive.to_html(draw(), f"plot-{len(report.figures) + 1}")
                report.figures.append(Figure(title, caption, html=html))
        except Exception as exc:  # noqa: BLE001 - one figure that cannot be drawn must not cost the report
            report.notes.append(f"{title}: not drawn ({short_error(exc)})")

    trials = {t.trial_id: t for g in groups for t in g.trials}
    series = {g: [(interactive.label(trials[t].sampled), interactive.trial_label(trials[t].sampled, trials[t].seed),
                   [r["epoch"] for r in rows_of if g in r], [r[g] for r in rows_of if g in r])
                  for t, rows_of in rows.items() if t in trials]
              for g in report.geometry_names}
    if any(epochs for lines in series.values() for _, _, epochs, _ in lines):
        add("Geometry over the epochs",
            "Every trial at every epoch the geometry was computed (the geometry.every epochs, ASHA's rungs, the "
            "last); stopped trials end where they were judged. One colour per configuration: click its legend "
            "entry to hide its replicates, double-click to show it alone.",
            lambda: interactive.trajectories(series))
    for name, (labels, values) in _layer_tables(completed, groups).items():
        add(f"{name} per layer",
            "Each block's output through the final norm, at the last epoch, for every trial that ran every epoch.",
            lambda v=values, t=labels, n=name: interactive.layers_by_trial(v, t, n))
    _optuna_figures(report, space, folder, parameters, add)
    if parameters and completed:
        metric_panels = parameter_panels(groups, parameters, report.metrics, grouping)
        if next(iter(metric_panels.values())):
            add("Metrics against the searched parameters",
                "Mean over the replicates that ran every epoch; bars: one standard deviation over seeds"
                + (f"; colours: {grouping}" if grouping else "") + ".",
                lambda path: figures.against_parameters(metric_panels, path, "metrics"), "metrics_vs_parameters.png")
        geometry_panels = parameter_panels(groups, parameters, report.geometry_names, grouping)
        if next(iter(geometry_panels.values()), None):
            add("Geometry against the searched parameters",
                "Last-layer geometry at the last epoch; mean and standard deviation over seeds.",
                lambda path: figures.against_parameters(geometry_panels, path, "geometry"),
                "geometry_vs_parameters.png")
    if completed:
        metric = report.metrics[0]
        captions = {g: str(c) for m, g, c in report.correlations if m == metric}
        add(f"{metric} against the geometry",
            "Each point a trial that ran every epoch; Spearman's rho with its 95% bootstrap interval.",
            lambda path: figures.scatter_panels(
                [(g, [metric_value(r, g) for r in completed], [metric_value(r, metric) for r in completed],
                  captions[g]) for g in report.geometry_names], metric, path, f"{metric} against the geometry"),
            "metric_vs_geometry.png")
    if space.multi_objective and len(report.metrics) >= 2:
        ranked = {id(g) for g in best_configurations(groups, report.metrics, space.modes)}
        complete = [g for g in groups if g.trials and len(g.completed()) == len(g.trials)]
        points = [(g.summary(report.metrics[0]).mean, g.summary(report.metrics[1]).mean, id(g) in ranked)
                  for g in complete]
        add("Pareto front", "Configurations' means; the front in red.",
            lambda path: figures.pareto(points, (report.metrics[0], report.metrics[1]), path, "Pareto front"),
            "pareto.png")
    for figure in report.figures:
        if figure.file:
            figure.data = base64.b64encode((out / figure.file).read_bytes()).decode("ascii")


def _optuna_figures(report: Report, space: SearchSpace, folder: StudyFolder, parameters: list[str], add) -> None:
    """Optuna's visualisations of the sampler's study and the parameters' PED-ANOVA importance, from its journal."""
    study = _optuna_study(folder, space)
    if isinstance(study, str):
        report.notes.append(f"Optuna's figures and the parameter importance: {study}")
        return
    states = [t.state for t in study.trials]
    used = states.count(optuna.trial.TrialState.COMPLETE)
    left_out = sum(s in (optuna.trial.TrialState.PRUNED, optuna.trial.TrialState.FAIL) for s in states)
    try:
        importances = dict(optuna.importance.get_param_importances(study))
    except Exception as exc:  # noqa: BLE001 - too few configurations, a single value per parameter, ...
        importances = None
        report.notes.append(f"Parameter importance: not computed ({short_error(exc)})")
    from_complete = (f"from the {used} configurations that ran every epoch of every replicate"
                     + (f"; {left_out} stopped early or failed are left out" if left_out else "") + ".")
    try:
        found = interactive.optuna_figures(study, parameters, report.metrics[0], importances)
    except Exception as exc:  # noqa: BLE001 - Optuna's figures must not cost the report
        report.notes.append(f"Optuna's figures: not drawn ({short_error(exc)})")
        found = []
    for title, caption, fig in found:
        add(title, f"Optuna's figure of the sampler's study (per configuration: the mean over its replicates), "
            f"{from_complete} {caption}", lambda f=fig: f)
    if importances:
        add("Parameter importance",
            "Optuna's PED-ANOVA importance of each parameter for the objective the sampler saw (per configuration: "
            f"the mean over its replicates), {from_complete}", lambda: interactive.importance_figure(importances))


def _layer_tables(trials: list[TrialRecord], groups: list[Configuration]) -> dict[str, tuple[list[str], np.ndarray]]:
    """Per-layer geometry at the last epoch: name -> (the trials' labels, values (layers, trials)), the trials in
    their configurations' order."""
    order = {t.trial_id: index for index, t in enumerate(t for g in groups for t in g.trials)}
    found: dict[str, dict[str, dict[int, float]]] = {}
    for trial in sorted(trials, key=lambda t: order.get(t.trial_id, len(order))):
        for key, value in trial.metrics.items():
            match = LAYER_METRIC.match(key)
            if match:
                text = interactive.trial_label(trial.sampled, trial.seed)
                found.setdefault(match[2], {}).setdefault(text, {})[int(match[1])] = value
    tables = {}
    for name, by_trial in found.items():
        labels = list(by_trial)
        layers = 1 + max(layer for values in by_trial.values() for layer in values)
        tables[name] = (labels, np.array([[by_trial[t].get(layer, math.nan) for t in labels]
                                          for layer in range(layers)]))
    return tables


def _optuna_study(folder: StudyFolder, space: SearchSpace) -> optuna.Study | str:
    """The sampler's Optuna study, read from the study folder's journal; or why there is none to show."""
    journal = folder.path / JOURNAL_FILE
    if not journal.is_file():
        return "no Optuna journal in the study folder (a study started before it was kept)"
    if space.multi_objective:
        return "shown for single-objective studies only"
    try:
        storage = optuna.storages.JournalStorage(optuna.storages.journal.JournalFileBackend(str(journal)))
        return optuna.load_study(study_name=space.name, storage=storage)
    except Exception as exc:  # noqa: BLE001 - an unreadable journal must not cost the report
        return f"the journal could not be read ({short_error(exc)})"


def render(report: Report) -> str:
    """The page, from the package's template (study/templates/report.html); plotly's JavaScript embedded once where
    any figure is interactive."""
    environment = Environment(autoescape=True, trim_blocks=True, lstrip_blocks=True)
    environment.filters["number"] = lambda v: "-" if v is None or not math.isfinite(v) else f"{v:.4f}"
    environment.filters["exact"] = lambda v: "nan" if v is None or not math.isfinite(v) else repr(float(v))
    template = environment.from_string(TEMPLATE.read_text(encoding="utf-8"))
    interactive_js = interactive.plotly_js() if any(f.html for f in [report.paired, *report.figures] if f) else ""
    return template.render(r=report, plotly_js=interactive_js)
