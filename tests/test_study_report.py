"""A study with replicates, a baseline and geometry, its driver killed mid-way and resumed; then what the study
promises a researcher: every configuration at every seed, one MLflow run per trial under one study run, replicates
grouped by `status` and `export`, and a report that a real browser renders with every figure, whose summary numbers
match an independent computation from Ray's records. (The geometry of trials ASHA stops is checked in
test_study_e2e.py: with replicates a space runs every seed to the end.)"""

from __future__ import annotations

import math
import os
import shutil
from types import SimpleNamespace

import numpy as np
import pytest
import yaml
from scipy import stats

from fault_fixtures import (
    kill_study_when,
    mlflow_runs,
    private_ray_tmp,
    resume_study,
    run_lapstudy,
    study_env,
    study_run,
    tiny_space,
    tune_results,
    write_space,
)

pytestmark = pytest.mark.slow(seconds=100)

EPOCHS = 4
BASELINE, GOOD, BAD = {"lr": 3.0e-3, "k": 0}, {"lr": 3.0e-3, "k": 2}, {"lr": 1.0e-6, "k": 2}
SPACE = tiny_space(
    name="replicated", epochs=EPOCHS, num_samples=3, replicates=2, baseline=BASELINE,
    sampler={"kind": "tpe", "n_startup_trials": 3}, early_stopping="none",
    geometry={"max_batches": 2, "pca_points": 100},
    parameters={"lr": {"type": "log_float", "low": 1.0e-6, "high": 1.0e-2}, "k": {"type": "int", "low": 0, "high": 4}},
    points_to_evaluate=[GOOD, BAD],
)
FIGURES = {"metrics_vs_parameters.png", "geometry_vs_parameters.png", "metric_vs_geometry.png"}
# The interactive figures (plotly), by the id of their <div>'s figure: title.
INTERACTIVE = {"Each configuration against the baseline", "Geometry over the epochs", "Optimisation history", "Slices",
               "Parallel coordinates", "Contour", "Parameter importance"} | {
    f"{name} per layer" for name in ("between_class_frac", "between_class_var", "nc1", "within_class_var",
                                     "within_seq_var")}


@pytest.fixture(scope="module")
def study(tmp_path_factory):
    root = tmp_path_factory.mktemp("replicated")
    write_space(root / "replicated.yaml", SPACE)
    args = ["run", "replicated.yaml", "--storage", "studies", "--max-concurrent", "1"]
    state = SimpleNamespace(root=root, dir=root / "studies" / "replicated")
    with private_ray_tmp("lsr") as ray_tmp:
        env = study_env(ray_tmp)
        def two_trials_done():
            return sum(1 for rows in tune_results(state.dir).values() if rows[-1]["epoch"] == EPOCHS) >= 2
        kill_study_when(args, env, root, two_trials_done, "the baseline's two replicates to finish")
        state.log = resume_study(args, env, root)
        state.env = env
        state.status = run_lapstudy(["status", "studies/replicated"], env, timeout=120, cwd=root)
        state.export = run_lapstudy(["export", "studies/replicated", "--top", "1", "--out", "best"], env,
                                    timeout=120, cwd=root)
    state.rows = tune_results(state.dir)
    state.mlflow = mlflow_runs(f"sqlite:///{state.dir / 'mlflow.db'}", "replicated")
    return state


def _configurations(rows: dict[str, list[dict]]) -> dict[str, dict]:
    """Ray's records grouped by configuration, computed here: values, and the final metric of each seed whose run
    reached the last epoch."""
    found: dict[str, dict] = {}
    for trial, trial_rows in rows.items():
        config = trial_rows[0]["config"]
        group = found.setdefault(config["config_id"], {"id": config["config_id"], "trials": {}, "final": {},
                                                       "values": {"lr": config["lr"], "k": config["k"]}})
        group["trials"][config["seed"]] = trial
        if trial_rows[-1]["epoch"] == EPOCHS:
            group["final"][config["seed"]] = trial_rows[-1]
    return found


def _which(configurations: dict, values: dict) -> dict:
    [group] = [g for g in configurations.values() if all(math.isclose(g["values"][k], v) for k, v in values.items())]
    return group


def test_every_configuration_ran_once_at_every_seed(study):
    configurations = _configurations(study.rows)
    assert len(study.rows) == 3 * 2 and len(configurations) == 3
    for group in configurations.values():
        assert sorted(group["trials"]) == [0, 1]
    assert all(sorted(group["final"]) == [0, 1] for group in configurations.values())


def test_one_mlflow_run_per_trial_under_one_study_run(study):
    runs = study.mlflow
    parent = study_run(f"sqlite:///{study.dir / 'mlflow.db'}", "replicated")
    assert parent["status"] == "FINISHED" and "lapstudy.error" not in parent["tags"]
    assert parent["params"]["num_samples"] == "3" and yaml.safe_load(parent["params"]["seeds"]) == [0, 1]
    for package in ("torch", "ray", "optuna", "mlflow"):
        assert parent["tags"][f"lapstudy.version.{package}"], package
    assert set(runs) == set(study.rows)
    for trial, trial_runs in runs.items():
        (run,) = trial_runs
        assert run["tags"]["mlflow.parentRunId"] == parent["run_id"], trial
        assert run["tags"]["lapstudy.config_id"] == study.rows[trial][0]["config"]["config_id"]
        assert any(key.startswith("system/") for key in run["history"]), f"no system metrics in {trial}"
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{study.dir / 'mlflow.db'}")
    experiment = client.get_experiment_by_name("replicated")
    assert experiment.tags["mlflow.experimentKind"] == "custom_model_development"
    reported = {a.path for a in client.list_artifacts(parent["run_id"], "report")}
    assert "report/report.html" in reported and {f"report/{name}" for name in FIGURES} <= reported


def _summary(group: dict, metric: str = "val_acc") -> tuple[float, float, int]:
    values = [row[metric] for row in group["final"].values()]
    return float(np.mean(values)), float(np.std(values, ddof=1)), len(values)


def _paired(group: dict, baseline: dict, metric: str = "val_acc") -> tuple[float, float, float]:
    seeds = sorted(set(group["final"]) & set(baseline["final"]))
    differences = np.array([group["final"][s][metric] - baseline["final"][s][metric] for s in seeds])
    half = stats.t.ppf(0.975, len(seeds) - 1) * differences.std(ddof=1) / math.sqrt(len(seeds))
    return float(differences.mean()), float(differences.mean() - half), float(differences.mean() + half)


def test_the_optuna_journal_holds_each_configurations_replicate_mean(study):
    """The sampler's record, read from the journal with Optuna's own API: one COMPLETE trial per configuration (the
    one the driver's kill cut short included), its value the mean of its seeds' final values in Ray's records, its
    intermediate value at each epoch the mean of the seeds' values at that epoch, its replicates' Tune trial ids as
    a user attribute; and the report's importance says it used those configurations."""
    import optuna
    from optuna.storages import JournalStorage
    from optuna.storages.journal import JournalFileBackend

    from study.search import JOURNAL_FILE

    journal = JournalStorage(JournalFileBackend(str(study.dir / JOURNAL_FILE)))
    trials = optuna.load_study(study_name="replicated", storage=journal).trials
    configurations = _configurations(study.rows)
    for group in configurations.values():
        replicates = [group["trials"][seed] for seed in (0, 1)]
        [trial] = [t for t in trials if t.user_attrs["tune_trial_ids"] == replicates]
        assert trial.state is optuna.trial.TrialState.COMPLETE, (group["values"], trial.state)
        assert trial.params == pytest.approx(group["values"])
        finals = [group["final"][seed]["val_acc"] for seed in (0, 1)]
        assert trial.value == pytest.approx(sum(finals) / 2, abs=1e-12)
        # Every epoch both seeds reported before the sampler's last saved state or after the resume (a result that
        # reached only the killed driver's sampler is not told again); the last always.
        assert EPOCHS in trial.intermediate_values and set(trial.intermediate_values) <= set(range(1, EPOCHS + 1))
        # Ray's local records of a trial the kill cut short start where it resumed; the journal was written live
        by_epoch = [{r["epoch"]: r["val_acc"] for r in study.rows[t]} for t in replicates]
        both = set(by_epoch[0]) & set(by_epoch[1])
        assert EPOCHS in both
        for epoch in both:
            assert trial.intermediate_values[epoch] == pytest.approx(
                (by_epoch[0][epoch] + by_epoch[1][epoch]) / 2, abs=1e-12), epoch
    report = (study.dir / "report" / "report.html").read_text()
    assert f"from the {len(configurations)} configurations that ran every epoch of every replicate." in report


def test_the_study_run_holds_the_best_configurations_mean_and_links_its_runs(study):
    parent = study_run(f"sqlite:///{study.dir / 'mlflow.db'}", "replicated")
    configurations = _configurations(study.rows)
    means = {g["id"]: float(np.mean([r["val_acc"] for r in g["final"].values()])) for g in configurations.values()}
    best = configurations[max(means, key=means.get)]
    assert parent["metrics"]["best/val_acc"] == pytest.approx(means[best["id"]], abs=1e-12)
    trials = [best["trials"][seed] for seed in (0, 1)]
    assert sorted(parent["tags"]["lapstudy.best_trial_ids"].split(",")) == sorted(trials)
    runs = {r["tags"]["lapstudy.trial_id"]: r["run_id"] for trial_runs in study.mlflow.values() for r in trial_runs}
    assert sorted(parent["tags"]["lapstudy.best_run_ids"].split(",")) == sorted(runs[t] for t in trials)
    assert "(mean of 2 seeds)" in parent["tags"]["mlflow.note.content"]


def test_status_groups_the_replicates(study):
    assert study.status.returncode == 0, study.status.stderr
    text = study.status.stdout
    assert "6 of 6 trials started (3 configurations x 2 seeds)" in text
    table = text[text.index("configurations (mean"):].splitlines()
    for group in _configurations(study.rows).values():
        [line] = [line for line in table if line.split() and line.split()[0] == group["id"]]
        if group["final"]:
            mean, std, n = _summary(group)
            assert f"{mean:.4f} ± {std:.4f} (n={n})" in line, line
        else:
            assert "±" not in line and " - " in f" {line} ", line  # no replicate ran every epoch


def test_export_writes_the_best_configuration_with_its_replicates(study):
    assert study.export.returncode == 0, study.export.stderr
    [path] = sorted((study.root / "best").glob("*.yaml"))
    exported = yaml.safe_load(path.read_text())["provenance"]["configuration"]
    configurations = _configurations(study.rows)
    best = max((g for g in configurations.values() if len(g["final"]) == 2), key=lambda g: _summary(g)[0])
    assert exported["config_id"] == best["id"]
    assert exported["mean"]["val_acc"] == pytest.approx(_summary(best)[0], rel=1e-12)
    assert sorted(r["seed"] for r in exported["replicates"]) == [0, 1]


@pytest.fixture(scope="module")
def browser():
    """Headless Chromium (Debian's, with its chromedriver) through Selenium."""
    chromium, driver = shutil.which("chromium"), shutil.which("chromedriver")
    if not (chromium and driver):
        if os.environ.get("LAPSTUDY_BROWSER_REQUIRED"):
            pytest.fail("chromium and chromedriver are required here (LAPSTUDY_BROWSER_REQUIRED is set)")
        pytest.skip("no chromium/chromedriver on this machine (apt-get install chromium chromium-driver)")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync", "--no-first-run"):
        options.add_argument(flag)
    session = webdriver.Chrome(service=Service(driver), options=options)
    try:
        yield session
    finally:
        session.quit()


def _open_offline(browser, page):
    """The page with the network cut (Chromium's offline emulation): whatever it draws comes from the file itself."""
    browser.set_network_conditions(offline=True, latency=0, download_throughput=0, upload_throughput=0)
    _open(browser, page)


def _open(browser, page):
    """The page, loaded whole. From a blank page first: opening the URL already shown returned once, under load,
    while the old document was being unloaded (its summary table read as empty, the file's rows all there)."""
    from selenium.webdriver.support.ui import WebDriverWait

    browser.get("about:blank")
    browser.get(page.as_uri())
    WebDriverWait(browser, 60).until(lambda b: b.execute_script(
        "return document.readyState === 'complete' && document.URL === arguments[0]", page.as_uri()))


def test_report_renders_every_figure_in_a_browser(study, browser):
    _open_offline(browser, study.dir / "report" / "report.html")
    images = browser.execute_script(
        "return Array.from(document.images).map(i => [i.dataset.file, i.complete, i.naturalWidth, i.naturalHeight])")
    files = {name for name, complete, width, height in images if complete and width > 100 and height > 100}
    assert FIGURES == files, images
    assert len(files) == len(images), f"some figures did not load: {images}"
    assert browser.find_element("id", "summary-table").is_displayed()
    # plotly's JavaScript came with the page; every interactive figure drew its SVG, and no panel of one is empty:
    # each subplot's axes carry a trace with points
    plots = browser.execute_script("""
        if (!window.Plotly) return null;
        return Array.from(document.querySelectorAll('.plotly-graph-div')).map(div => {
            const axes = Object.keys(div._fullLayout).filter(k => /^xaxis\\d*$/.test(k)).map(k => 'x' + k.slice(5));
            const points = t => (t.x || t.z || t.values || []).length + (t.dimensions || []).length;
            const used = new Set(div.data.filter(t => points(t) > 0).map(t => t.xaxis || 'x'));
            return [div.closest('figure').querySelector('figcaption b').textContent.replace(/\\.$/, ''),
                    div.querySelectorAll('svg.main-svg').length, axes.filter(a => !used.has(a))];
        });""")
    assert plots is not None, "plotly's JavaScript did not load from the page"
    assert {title for title, _, _ in plots} == INTERACTIVE, plots
    for title, svgs, empty in plots:
        assert svgs > 0 and not empty, (title, svgs, empty)
    # the paired comparison is the page's first section
    first = browser.execute_script("return document.querySelector('h2').closest('section')?.id")
    assert first == "paired"


def test_report_figures_answer_hover_and_legend_clicks(study, browser):
    """A hover over the paired comparison names the configuration by its values; a click on a legend entry of the
    geometry over the epochs hides that configuration's lines."""
    from selenium.webdriver.common.action_chains import ActionChains
    from selenium.webdriver.support.ui import WebDriverWait

    _open_offline(browser, study.dir / "report" / "report.html")
    label = browser.execute_script("""
        const div = document.getElementById('plot-paired');
        Plotly.Fx.hover(div, [{curveNumber: 0, pointNumber: 0}]);
        const text = div.querySelector('.hoverlayer .hovertext');
        return text ? text.textContent : null;""")
    configurations = _configurations(study.rows)
    compared = [g for g in configurations.values() if g["values"] != _which(configurations, BASELINE)["values"]]
    names = [f"lr={g['values']['lr']:.4g}, k={g['values']['k']}" for g in compared]
    assert label and any(label.startswith(name) for name in names), (label, names)
    assert not any(trial in label for g in compared for trial in g["trials"].values()), label
    [div] = [d for d in browser.find_elements("css selector", ".plotly-graph-div")
             if d.find_element("xpath", "./ancestor::figure//figcaption/b").text.startswith("Geometry over")]
    entry = div.find_elements("css selector", ".legend .traces")[0]
    name = entry.find_element("css selector", ".legendtext").text
    browser.execute_script("arguments[0].scrollIntoView({block: 'center'})", div)
    ActionChains(browser).move_to_element(entry.find_element("css selector", ".legendtoggle")).click().perform()
    # plotly applies a single click once its double-click window (300 ms) has passed
    WebDriverWait(browser, 10).until(lambda b: b.execute_script(
        "return arguments[0].data.some(t => t.visible === 'legendonly')", div))
    visible = browser.execute_script("return arguments[0].data.map(t => [t.name, t.visible])", div)
    assert {v for n, v in visible if n == name} == {"legendonly"}, visible
    assert all(v is None or v is True for n, v in visible if n != name), visible


def test_report_summary_numbers_match_an_independent_computation(study, browser):
    _open(browser, study.dir / "report" / "report.html")
    cells = browser.execute_script("""
        return Array.from(document.querySelectorAll('#summary-table tbody tr')).map(row => [row.dataset.config,
            Array.from(row.querySelectorAll('td[data-field]')).map(cell => [cell.dataset.metric, cell.dataset.field,
                cell.dataset.value, cell.dataset.low, cell.dataset.high])])""")
    configurations = _configurations(study.rows)
    by_id = {}
    for group in configurations.values():
        for trial in group["trials"].values():
            by_id[trial] = group
    baseline = _which(configurations, BASELINE)
    shown = {config for config, _ in cells}
    complete = [g for g in configurations.values() if len(g["final"]) == 2]
    assert {by_id[c]["values"]["k"] for c in shown} == {g["values"]["k"] for g in complete}
    checked = 0
    for config, row in cells:
        group = by_id[config]
        mean, std, n = _summary(group)
        fields = {field: (value, low, high) for metric, field, value, low, high in row if metric == "val_acc"}
        assert float(fields["mean"][0]) == pytest.approx(mean, rel=1e-12)
        assert float(fields["std"][0]) == pytest.approx(std, rel=1e-9)
        assert int(fields["n"][0]) == n == 2
        if group is baseline:
            assert "difference" not in fields
            continue
        difference, low, high = _paired(group, baseline)
        assert float(fields["difference"][0]) == pytest.approx(difference, abs=1e-12)
        assert float(fields["interval"][1]) == pytest.approx(low, rel=1e-9)
        assert float(fields["interval"][2]) == pytest.approx(high, rel=1e-9)
        assert fields["beyond"][0] == ("yes" if low > 0 or high < 0 else "no")
        checked += 1
    assert checked >= 1
