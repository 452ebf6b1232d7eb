"""Bad input: every malformed space, config or command line gets exactly one line on stderr that names the field and
what it allows, exit code 2, no traceback, nothing started (Ray is never initialised) and nothing written (an
existing study folder beside it stays byte-for-byte the same).

Most cases run `study.cli.main` in this process (fast); a few go through the installed `lapstudy` command.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import ray
import yaml

from fault_fixtures import LAPSTUDY, free_port, ray_without_dashboard, study_env, tiny_space, tree_digest, write_space
from study import cli

EXISTING = "existing"


@dataclass
class Case:
    id: str
    argv: list  # "{space}", "{storage}", "{existing}", "{port}", "{config}" are filled in
    expect: list[str]  # substrings of the one error line: the field and what it allows
    space: dict | None = None  # the space file written for "{space}" (default: the valid tiny space)
    raw_space: str | None = None  # or this text, written as is
    config: dict | None = None  # the run config written for "{config}"
    tags: list[str] = field(default_factory=list)


def _space(**changes):
    return tiny_space(**changes)


def _params(**parameters):
    return {"lr": {"type": "log_float", "low": 1.0e-4, "high": 1.0e-2}, **parameters}


RUN = ["run", "{space}", "--storage", "{storage}", "--name", "new-study"]

CASES = [
    # ---- search spaces -------------------------------------------------------------------------------------------
    Case("unknown-parameter", RUN, ["parameters.kk", "allowed", "lr"],
         space=_space(parameters=_params(kk=[0, 1]), points_to_evaluate=[])),
    Case("k-above-head-count", RUN, ["k", "0..4"],
         space=_space(parameters=_params(k={"type": "int", "low": 0, "high": 6}), points_to_evaluate=[])),
    # vit_s16 has 6 heads, vit_tiny_digits 4: k up to 6 is fine for one preset and not for the other.
    Case("k-range-against-every-preset", RUN, ["k", "0..4", "vit_tiny_digits"],
         space=_space(fixed={"patch_size": 2, "depth": 2, "batch_size": 64},
                      parameters=_params(preset=["vit_s16", "vit_tiny_digits"], k={"type": "int", "low": 0, "high": 6}),
                      points_to_evaluate=[])),
    Case("ramp-max-count-above-heads", RUN, ["max_count", "0..4"],
         space=_space(fixed={"preset": "vit_tiny_digits", "depth": 2, "batch_size": 64},
                      parameters=_params(laplacian_schedule=["uniform", "ramp"]), points_to_evaluate=[],
                      conditional=[{"when": {"laplacian_schedule": "ramp"}, "fixed": {"increment": 1, "start_layer": 0},
                                    "parameters": {"max_count": {"type": "int", "low": 1, "high": 5}}}])),
    Case("schedule-longer-than-depth", RUN, ["k_per_layer", "depth 2"],
         space=_space(fixed={"preset": "vit_tiny_digits", "depth": 2, "batch_size": 64,
                             "laplacian_schedule": "explicit", "k_per_layer": [1, 1, 1]},
                      parameters=_params(), points_to_evaluate=[])),
    Case("negative-lambda", RUN, ["stlt_lambda_omega", ">= 0"],
         space=_space(fixed={"preset": "vit_tiny_digits", "depth": 2, "batch_size": 64, "mixer": "stlt"},
                      parameters=_params(stlt_lambda_omega={"type": "float", "low": -0.1, "high": 0.1}),
                      points_to_evaluate=[])),
    Case("empty-choice-list", RUN, ["parameters.k", "at least 1"],
         space=_space(parameters=_params(k=[]), points_to_evaluate=[])),
    Case("log-float-non-positive-bound", RUN, ["parameters.lr", "low > 0"],
         space=_space(parameters={"lr": {"type": "log_float", "low": 0.0, "high": 1.0e-2}}, points_to_evaluate=[])),
    Case("int-low-above-high", RUN, ["parameters.k", "low (3) must be <= high (1)"],
         space=_space(parameters=_params(k={"type": "int", "low": 3, "high": 1}), points_to_evaluate=[])),
    Case("unknown-parameter-type", RUN, ["parameters.k", "categorical"],
         space=_space(parameters=_params(k={"type": "uniform", "low": 0, "high": 1}), points_to_evaluate=[])),
    Case("unknown-task", RUN, ["task", "classification", "language_modeling"], space=_space(task="regression")),
    Case("unknown-dataset", RUN, ["dataset", "mnist", "digits"], space=_space(dataset={"source": "mnist"})),
    # Offline (HF_HUB_OFFLINE, set for every test): refused in seconds, naming what works offline, before Ray starts.
    Case("hub-dataset-offline", RUN, ["dataset", "cifar100", "parquet (local shards)", "digits"],
         space=_space(dataset={"source": "hf", "name": "cifar100"})),
    Case("unknown-metric", RUN, ["metric", "accuracy", "val_acc"], space=_space(metric="accuracy")),
    Case("bad-mode", RUN, ["mode", "min", "max"], space=_space(mode="maximise")),
    Case("misspelt-top-level-field", RUN, ["epoch", "epochs"], space={**_space(), "epoch": 3}),
    Case("drop-path-out-of-range", RUN, ["drop_path", "[0.0, 1.0)"],
         space=_space(fixed={"preset": "vit_tiny_digits", "depth": 2, "batch_size": 64, "drop_path": 1.5})),
    Case("negative-learning-rate", RUN, ["lr", "greater than 0"],
         space=_space(fixed={"preset": "vit_tiny_digits", "depth": 2, "lr": -0.1},
                      parameters={"k": {"type": "int", "low": 0, "high": 4}}, points_to_evaluate=[])),
    Case("warm-start-point-outside-space", RUN, ["points_to_evaluate[0].k", "0..4"],
         space=_space(points_to_evaluate=[{"lr": 1.0e-3, "k": 9}])),
    Case("condition-on-unknown-parameter", RUN, ["conditional[0].when.mixer", "allowed"],
         space=_space(conditional=[{"when": {"mixer": "stlt"}, "parameters": {"stlt_nodes": [4, 8]}}])),
    Case("grace-period-beyond-epochs", RUN, ["grace_period", "<= epochs"],
         space=_space(early_stopping={"kind": "asha", "grace_period": 10})),
    Case("several-metrics-with-asha", RUN, ["early_stopping", "none"],
         space=_space(metric=["val_acc", "samples_per_s"], mode=["max", "max"], early_stopping="asha")),
    Case("replicates-with-asha", RUN, ["early_stopping", "replicates", "none"],
         space=_space(replicates=3, early_stopping={"kind": "asha", "grace_period": 1})),
    Case("seeds-twice", RUN, ["seeds", "each seed once"], space=_space(seeds=[0, 1, 0])),
    Case("seeds-and-replicates-disagree", RUN, ["seeds", "replicates"], space=_space(seeds=[0, 1], replicates=3)),
    Case("baseline-incomplete", RUN, ["baseline", "missing k"], space=_space(baseline={"lr": 1.0e-3})),
    Case("baseline-outside-space", RUN, ["baseline.k", "0..4"], space=_space(baseline={"lr": 1.0e-3, "k": 9})),
    Case("bce-with-label-smoothing", RUN, ["loss", "bce", "label_smoothing"],
         space=_space(dataset={"source": "digits", "label_smoothing": 0.1},
                      fixed={"preset": "vit_tiny_digits", "depth": 2, "batch_size": 64, "loss": "bce"})),
    Case("missing-space-file", ["run", "{storage}/nowhere.yaml", "--storage", "{storage}"],
         ["nowhere.yaml", "no such file"]),
    Case("unreadable-yaml", RUN, ["not valid YAML", "line 2"], raw_space="name: [fault\n  task: x\n"),
    Case("space-not-a-mapping", RUN, ["must be a mapping", "name, task"], raw_space="- 1\n- 2\n"),
    # ---- renamed keys: each earlier name refused where it is written, naming the new one (never translated) ------
    Case("renamed-scheduler-section", RUN, ["scheduler: renamed early_stopping", "asha | geometry | none"],
         space={**{k: v for k, v in _space().items() if k != "early_stopping"}, "scheduler": "none"}),
    Case("renamed-schedule-parameter", RUN,
         ["parameters.schedule: renamed laplacian_schedule", "uniform | ramp | explicit"],
         space=_space(parameters=_params(schedule=["uniform", "ramp"]), points_to_evaluate=[])),
    Case("renamed-drop-path-schedule-fixed", RUN,
         ["fixed.drop_path_schedule: renamed drop_path_by_depth", "uniform | linear"],
         space=_space(fixed={"preset": "vit_tiny_digits", "depth": 2, "drop_path_schedule": "linear"})),
    Case("renamed-schedule-in-a-condition", RUN, ["conditional[0].when.schedule: renamed laplacian_schedule"],
         space=_space(parameters=_params(laplacian_schedule=["uniform", "ramp"]), points_to_evaluate=[],
                      conditional=[{"when": {"schedule": "ramp"}, "fixed": {"increment": 1, "start_layer": 0}}])),
    Case("renamed-schedule-in-a-conditional-group", RUN,
         ["conditional[0].fixed.schedule: renamed laplacian_schedule"],
         space=_space(conditional=[{"when": {"preset": "vit_tiny_digits"}, "fixed": {"schedule": "uniform"}}])),
    Case("renamed-schedule-in-a-point", RUN, ["points_to_evaluate[0].schedule: renamed laplacian_schedule"],
         space=_space(parameters=_params(laplacian_schedule=["uniform", "ramp"]),
                      points_to_evaluate=[{"lr": 1.0e-3, "schedule": "uniform"}])),
    Case("renamed-schedule-in-a-stage", RUN, ["stages[0].hyperparameters.schedule: renamed laplacian_schedule"],
         space=_space(stages=[{"name": "again", "task": "classification", "epochs": 1,
                               "hyperparameters": {"schedule": "uniform"}}])),
    # ---- command lines -------------------------------------------------------------------------------------------
    Case("num-samples-zero", [*RUN, "--num-samples", "0"], ["--num-samples", ">= 1"]),
    Case("num-samples-not-a-number", [*RUN, "--num-samples", "many"], ["--num-samples", "invalid int value"]),
    Case("max-concurrent-zero", [*RUN, "--max-concurrent", "0"], ["--max-concurrent", ">= 1"]),
    Case("workers-per-trial-zero", [*RUN, "--workers-per-trial", "0"],
         ["--workers-per-trial", "greater than or equal to 1"]),
    Case("negative-cpus-per-worker", [*RUN, "--cpus-per-worker", "-1"], ["--cpus-per-worker", "greater than 0"]),
    Case("unknown-flag", [*RUN, "--epochs", "3"], ["unrecognized arguments: --epochs", "--help"]),
    Case("abbreviated-flag", [*RUN, "--num-sam", "3"], ["unrecognized arguments: --num-sam", "--help"]),
    Case("worker-resource-malformed", [*RUN, "--worker-resource", "spot"], ["--worker-resource 'spot'", "NAME=AMOUNT"]),
    Case("worker-resource-standard-name", [*RUN, "--worker-resource", "GPU=1"],
         ["--worker-resource", "--*-per-worker"]),
    Case("unknown-command", ["fly", "{space}"], ["invalid choice: 'fly'", "run"]),
    Case("bad-study-name", ["run", "{space}", "--storage", "{storage}", "--name", "my study/1"],
         ["--name", "letters, digits"]),
    Case("existing-study-without-resume", ["run", "{space}", "--storage", "{storage}", "--name", EXISTING],
         ["already exists", "--resume"]),
    Case("resume-without-a-study", [*RUN, "--resume"], ["--resume", "no study to resume"]),
    Case("address-not-an-address", [*RUN, "--address", "my laptop"], ["--address", "auto", "HOST:PORT"]),
    Case("address-nothing-listening", [*RUN, "--address", "127.0.0.1:{port}"],
         ["--address 127.0.0.1:", "cannot connect"]),
    Case("tracking-uri-unreachable", [*RUN, "--tracking-uri", "http://127.0.0.1:{port}"],
         ["--tracking-uri", "127.0.0.1"]),
    Case("tracking-uri-unknown-scheme", [*RUN, "--tracking-uri", "gopher://x"], ["--tracking-uri", "gopher"]),
    # ---- the other commands --------------------------------------------------------------------------------------
    Case("train-missing-config", ["train", "{storage}/missing.yaml", "--storage", "{storage}"],
         ["missing.yaml", "no such file"]),
    Case("train-unknown-hyperparameter", ["train", "{config}", "--storage", "{storage}"],
         ["hyperparameters.kk", "allowed"],
         config={"task": "classification", "dataset": {"source": "digits"}, "epochs": 1, "seed": 0,
                 "hyperparameters": {"preset": "vit_tiny_digits", "kk": 1}}),
    Case("train-k-above-head-count", ["train", "{config}", "--storage", "{storage}"], ["k", "0..4"],
         config={"task": "classification", "dataset": {"source": "digits"}, "epochs": 1, "seed": 0,
                 "hyperparameters": {"preset": "vit_tiny_digits", "k": 5}}),
    Case("train-renamed-hyperparameter", ["train", "{config}", "--storage", "{storage}"],
         ["hyperparameters.schedule: renamed laplacian_schedule", "uniform | ramp | explicit"],
         config={"task": "classification", "dataset": {"source": "digits"}, "epochs": 1, "seed": 0,
                 "hyperparameters": {"preset": "vit_tiny_digits", "schedule": "uniform", "k": 1}}),
    Case("train-renamed-stage-hyperparameter", ["train", "{config}", "--storage", "{storage}"],
         ["stages[0].hyperparameters.drop_path_schedule: renamed drop_path_by_depth"],
         config={"task": "classification", "dataset": {"source": "digits"}, "epochs": 1, "seed": 0,
                 "hyperparameters": {"preset": "vit_tiny_digits"},
                 "stages": [{"name": "again", "task": "classification", "epochs": 1,
                             "hyperparameters": {"drop_path_schedule": "linear"}}]}),
    Case("export-not-a-study", ["export", "{storage}"], ["not a study folder", "lapstudy run"]),
    Case("export-top-zero", ["export", "{existing}", "--top", "0"], ["--top", ">= 1"]),
    Case("status-not-a-study", ["status", "{storage}/nowhere"], ["not a study folder"]),
    Case("sync-not-a-study", ["sync", "{storage}/nowhere"], ["not a study folder"]),
    Case("sync-another-store", ["sync", "{existing}", "--tracking-uri", "http://127.0.0.1:{port}"],
         ["--tracking-uri", "this study logs to sqlite:"]),
    Case("ui-port-out-of-range", ["ui", "{existing}", "--port", "70000"], ["--port", "1..65535"]),
]


@pytest.fixture(scope="module")
def storage(tmp_path_factory) -> Path:
    """A storage folder holding a finished-looking study: its study.json, space, a trial config and a real MLflow
    SQLite store with a run. The cases below must leave all of it exactly as it is."""
    from mlflow.tracking import MlflowClient

    root = tmp_path_factory.mktemp("storage")
    study = root / EXISTING
    (study / "trials").mkdir(parents=True)
    space = tiny_space(name=EXISTING)
    write_space(study / "space.yaml", space)
    tracking_uri = f"sqlite:///{study / 'mlflow.db'}"
    client = MlflowClient(tracking_uri)
    experiment = client.create_experiment(EXISTING, artifact_location=(study / "mlartifacts").as_uri())
    run = client.create_run(experiment, run_name="trial_0", tags={"lapstudy.trial_id": "0"})
    client.log_metric(run.info.run_id, "val_acc", 0.5, step=1)
    client.set_terminated(run.info.run_id)
    (study / "trials" / "0.yaml").write_text(yaml.safe_dump({"task": "classification"}))
    (study / "study.json").write_text(json.dumps({
        "name": EXISTING, "space": str(study / "space.yaml"), "created": "2026-11-30T00:00:00+00:00", "seed": 0,
        "num_samples": 2, "seeds": [0], "max_concurrent": None,
        "resources": {"workers": 1, "cpus_per_worker": 1.0, "gpus_per_worker": 0.0}, "tracking_uri": tracking_uri,
        "experiment_id": experiment, "metric": ["val_acc"], "mode": ["max"]}))
    return root


@pytest.fixture
def no_ray(monkeypatch):
    """Fail the test if anything starts or joins Ray: bad input must be refused before that."""

    def refuse(*args, **kwargs):
        raise AssertionError(f"ray.init called for bad input (args {args}, {kwargs})")

    monkeypatch.setattr(ray, "init", refuse)


def _argv(case: Case, storage: Path, tmp_path: Path) -> list[str]:
    space_path = tmp_path / "space.yaml"
    if case.raw_space is not None:
        space_path.write_text(case.raw_space)
    else:
        write_space(space_path, case.space or tiny_space())
    config_path = tmp_path / "config.yaml"
    if case.config is not None:
        config_path.write_text(yaml.safe_dump(case.config))
    values = {"space": space_path, "storage": storage, "existing": storage / EXISTING, "config": config_path,
              "port": free_port()}
    return [str(a).format(**values) for a in case.argv]


def _check_error_line(stderr: str, expect: list[str]) -> str:
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert len(lines) == 1, f"expected exactly one line on stderr, got {len(lines)}:\n{stderr}"
    line = lines[0]
    assert line.startswith("lapstudy: error: "), line
    assert "Traceback" not in stderr
    for text in expect:
        assert text in line, f"{text!r} missing from the error line: {line}"
    return line


def test_there_are_at_least_twenty_cases():
    assert len(CASES) >= 20
    assert len({c.id for c in CASES}) == len(CASES)


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_bad_input_in_process(case, storage, tmp_path, capfd, no_ray, monkeypatch):
    monkeypatch.chdir(tmp_path)  # nothing may land in the working folder either
    before = tree_digest(storage)
    argv = _argv(case, storage, tmp_path)
    capfd.readouterr()
    try:
        code = cli.main(argv)
    except SystemExit as exit_:  # argparse's own exits (there should be none: see cli._Parser)
        code = exit_.code
    out, err = capfd.readouterr()
    assert code == 2, f"exit code {code}; stderr:\n{err}"
    _check_error_line(err, case.expect)
    assert out == "", f"nothing may be printed on stdout for bad input (no study starts):\n{out}"
    assert tree_digest(storage) == before, "the storage folder (with an existing study) was modified"
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        {"space.yaml"} | ({"config.yaml"} if case.config is not None else set())), \
        "files appeared in the working folder"


# Through the installed command: the real process, its real stderr and exit code. Started together to share the
# interpreter start-up time.
CLI_CASES = ["k-above-head-count", "unreadable-yaml", "address-nothing-listening", "unknown-flag",
             "renamed-scheduler-section"]


def test_bad_input_through_the_command_line(storage, tmp_path):
    before = tree_digest(storage)
    env = study_env(tmp_path / "ray")
    started = []
    for name in CLI_CASES:
        case = next(c for c in CASES if c.id == name)
        folder = tmp_path / name
        folder.mkdir()
        argv = _argv(case, storage, folder)
        started.append((case, subprocess.Popen([str(LAPSTUDY), *argv], env=env, cwd=folder, text=True,
                                               stdout=subprocess.PIPE, stderr=subprocess.PIPE)))
    for case, process in started:
        out, err = process.communicate(timeout=180)
        assert process.returncode == 2, f"{case.id}: exit code {process.returncode}; stderr:\n{err}"
        _check_error_line(err, case.expect)
        assert out == "", f"{case.id}: stdout should be empty:\n{out}"
    assert tree_digest(storage) == before
    assert not (tmp_path / "ray").exists(), "a Ray session folder was created: Ray was started for bad input"


def test_a_cluster_without_a_dashboard_is_refused_before_the_study_starts(tmp_path):
    """Tune and Train free a trial's CPUs only after Ray's State API (the dashboard) says its actors are gone: a
    study joining a cluster without one would leave stopped trials' CPUs held, or (where another cluster's dashboard
    answers on the default port) lose running trials. The one error line says how to start the head."""
    with ray_without_dashboard() as address:
        write_space(tmp_path / "space.yaml", tiny_space())
        run = subprocess.run([str(LAPSTUDY), "run", "space.yaml", "--storage", "studies", "--address", address],
                             env=study_env(tmp_path / "ray", RAY_AUTH_MODE="token"),  # what ray.init sets for its own
                             cwd=tmp_path, text=True, capture_output=True, timeout=180)
    assert run.returncode == 2, run.stderr
    _check_error_line(run.stderr, [f"--address {address}", "State API", "--include-dashboard=true"])
    assert not (tmp_path / "studies").exists(), "a study folder was written"


def test_help_is_not_an_error(capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.main(["run", "--help"])
    assert exit_.value.code == 0
    assert "--resume" in capsys.readouterr().out


def test_existing_study_copy_is_detected_by_the_digest(storage, tmp_path):
    """The digest is what the cases rely on: it must see a one-byte change and a new empty folder."""
    copy = tmp_path / "copy"
    shutil.copytree(storage, copy)
    digest = tree_digest(copy)
    assert digest == tree_digest(copy)
    study_json = copy / EXISTING / "study.json"
    study_json.write_bytes(study_json.read_bytes().replace(b'"seed": 0', b'"seed": 1'))
    assert tree_digest(copy) != digest
    digest = tree_digest(copy)
    (copy / "new-study").mkdir()
    assert tree_digest(copy) != digest
