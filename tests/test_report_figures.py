"""The report's interactive figures without Ray: trials named by their configuration's values, no panel for a
parameter the study never sampled (an in-memory Optuna study with a conditional parameter), and a page that holds
plotly's JavaScript once, from the template shipped in the package."""

from __future__ import annotations

import re
from importlib import resources

import optuna
import pytest

from study import interactive, report
from study.results import Configuration, TrialRecord
from study.stats import paired_difference
from study.status import TrialStatus

# ramp_*: a conditional group (laplacian_schedule=ramp)
SPACE_ORDER = ["laplacian_schedule", "k", "ramp_start", "ramp_cap", "lr"]


def _conditional_study(schedules: list[str]) -> optuna.Study:
    """Define-by-run as study/space.py samples a conditional group: ramp_start only where schedule is ramp; ramp_cap
    is searched too but this objective never reaches it."""
    study = optuna.create_study(direction="maximize", sampler=optuna.samplers.RandomSampler(seed=0))
    for number, schedule in enumerate(schedules):
        study.enqueue_trial({"laplacian_schedule": schedule})
        trial = study.ask()
        trial.suggest_categorical("laplacian_schedule", ["uniform", "ramp"])
        k = trial.suggest_int("k", 0, 4)
        ramp = trial.suggest_int("ramp_start", 0, 3) if schedule == "ramp" else 0
        lr = trial.suggest_float("lr", 1e-4, 1e-2, log=True)
        study.tell(trial, 0.5 + 0.05 * k - 0.01 * ramp + lr + 0.001 * number)
    return study


def test_a_configuration_is_named_by_its_values_in_the_spaces_order():
    values = {"laplacian_schedule": "ramp", "k": 3, "ramp_start": 2, "lr": 0.0031234567}
    assert interactive.label(values) == "laplacian_schedule=ramp, k=3, ramp_start=2, lr=0.003123"
    assert interactive.trial_label(values, 1) == "laplacian_schedule=ramp, k=3, ramp_start=2, lr=0.003123, seed 1"


def test_the_paired_comparison_names_each_configuration_by_its_values():
    baseline = {0: 0.80, 1: 0.82, 2: 0.81}
    rows = [("k=3, ramp_start=2", {"val_acc": paired_difference({0: 0.90, 1: 0.91, 2: 0.905}, baseline)}),
            ("k=1, ramp_start=0", {"val_acc": paired_difference({0: 0.80, 1: 0.83, 2: 0.80}, baseline)})]
    fig = interactive.paired_differences(rows, ["val_acc"])
    points = {y: (x, trace.name) for trace in fig.data for x, y in zip(trace.x, trace.y)}
    assert set(points) == {"k=3, ramp_start=2", "k=1, ramp_start=0"}
    # the first is beyond the noise (differences 0.10, 0.09, 0.095), the second within it (0.0, 0.01, -0.01)
    assert points["k=3, ramp_start=2"] == (pytest.approx(0.095), "beyond the seed noise")
    assert points["k=1, ramp_start=0"] == (pytest.approx(0.0), "within it")
    assert all(trace.hovertemplate.startswith("%{y}<br>") for trace in fig.data)  # the tooltip opens with the label


def test_a_parameter_the_study_never_sampled_gets_no_panel():
    study = _conditional_study(["uniform", "ramp", "uniform", "ramp", "uniform"])
    assert interactive.with_values(SPACE_ORDER, [t.params for t in study.trials]) == [
        "laplacian_schedule", "k", "ramp_start", "lr"]
    figures = {title: fig for title, _, fig in interactive.optuna_figures(study, SPACE_ORDER, "val_acc", None)}
    assert set(figures) == {"Optimisation history", "Slices", "Parallel coordinates", "Contour"}
    assert slice_titles(figures["Slices"]) == {"laplacian_schedule", "k", "ramp_start", "lr"}
    axes = list(figures["Parallel coordinates"].layout.xaxis.ticktext)  # Optuna 5 draws one axis per tick
    # the objective, then the parameters sorted
    assert axes == ["val_acc", "k", "laplacian_schedule", "lr", "ramp_start"]
    # a study that never took the conditional branch: no ramp_start panel either
    uniform = _conditional_study(["uniform"] * 4)
    figures = {title: fig for title, _, fig in interactive.optuna_figures(uniform, SPACE_ORDER, "val_acc", None)}
    assert slice_titles(figures["Slices"]) == {"laplacian_schedule", "k", "lr"}


def slice_titles(fig) -> set[str]:
    """The parameter of each slice panel: its x axis's title."""
    layout = fig.layout.to_plotly_json()
    return {layout[key]["title"]["text"] for key in layout if re.fullmatch(r"xaxis\d*", key)}


def _record(trial_id: str, values: dict, seed: int, status: TrialStatus, accuracy: float | None) -> TrialRecord:
    return TrialRecord(trial_id, trial_id, status, {**values, "config_id": trial_id[:1], "seed": seed}, 4,
                       {} if accuracy is None else {"val_acc": accuracy})


def test_the_parameter_grid_has_no_column_without_points():
    """ramp_start was sampled only by a configuration whose replicates were stopped early: no column for it."""
    done, stopped = TrialStatus.COMPLETED, TrialStatus.EARLY_STOPPED
    uniform_values, other_values = {"laplacian_schedule": "uniform", "k": 2}, {"laplacian_schedule": "uniform", "k": 4}
    uniform = Configuration("a", uniform_values, [_record("a0", uniform_values, 0, done, 0.8)])
    other = Configuration("b", other_values, [_record("b0", other_values, 0, done, 0.9)])
    ramp_values = {"laplacian_schedule": "ramp", "k": 3, "ramp_start": 1}
    ramp = Configuration("c", ramp_values, [_record("c0", ramp_values, 0, stopped, 0.5)])
    panels = report.parameter_panels([uniform, other, ramp], ["laplacian_schedule", "k", "ramp_start", "ramp_cap"],
                                     ["val_acc"], "laplacian_schedule")
    assert list(panels["val_acc"]) == ["laplacian_schedule", "k"]
    assert sorted(p[0] for p in panels["val_acc"]["k"]) == [2, 4]
    assert all(panels["val_acc"][name] for name in panels["val_acc"])


def test_the_page_holds_plotly_once_from_the_packaged_template():
    assert report.TEMPLATE.is_file()
    assert resources.files("study").joinpath("templates/report.html").read_text() == report.TEMPLATE.read_text()
    baseline = {0: 0.8, 1: 0.82}
    rows = [("k=3", {"val_acc": paired_difference({0: 0.9, 1: 0.91}, baseline)})]
    page = report.Report(
        study="s", made="now", description="", metrics=["val_acc"], counts={}, trials=4, configurations=2, seeds=[0, 1],
        baseline="k=0", best=[], geometry_names=[], geometry_rows=[], correlations=[], parameter_trends=[],
        paired=report.Figure("paired", "caption", html=interactive.to_html(
            interactive.paired_differences(rows, ["val_acc"]), "plot-paired")))
    html = report.render(page)
    bundle = interactive.plotly_js()
    assert html.count(bundle) == 1 and len(bundle) > 1_000_000
    assert not re.search(r"<script[^>]+src=", html)  # nothing fetched: the page opens offline
    assert html.index('<section id="paired">') < html.index('id="plot-paired"') < html.index('id="summary-table"')
