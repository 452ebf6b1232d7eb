"""Shared by the study end-to-end tests: one local Ray cluster for a whole test module (started here, joined by the
`lapstudy` subprocesses with --address), the real command line as a subprocess, and readers of Ray's and MLflow's
records that do not go through the code under test."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import yaml

from fault_fixtures import free_port

LAPSTUDY = Path(sys.executable).with_name("lapstudy")


@pytest.fixture(scope="module")
def ray_address():
    """A 2-CPU local cluster with the dashboard on (Tune needs it to clean up the placement groups of trials ASHA
    stops), in a short private temp folder; shut down when the module's tests are done."""
    import ray

    # An in-process Ray instance left by another module's fixture (the data tests share one per session) would
    # make ray.init fail and hold the CPUs these studies need.
    ray.shutdown()
    temp = Path(tempfile.mkdtemp(prefix="lss", dir="/tmp"))
    ray.init(num_cpus=2, include_dashboard=True, dashboard_port=free_port(), _temp_dir=str(temp),
             log_to_driver=False, logging_level="ERROR")
    try:
        yield ray.get_runtime_context().gcs_address
    finally:
        ray.shutdown()
        shutil.rmtree(temp, ignore_errors=True)


def lapstudy(*args, timeout: float = 600, cwd: Path | None = None, home: Path | None = None
             ) -> subprocess.CompletedProcess:
    """The installed `lapstudy` command with `args`, run in `cwd` (relative paths are resolved there) with `home` as
    the home folder (what `~` means)."""
    env = {**os.environ, "MLFLOW_DISABLE_TELEMETRY": "true", "HF_HUB_OFFLINE": "1"}
    if home is not None:
        env["HOME"] = str(home)
        # Ray's token for the test cluster stays where the real home folder keeps it.
        env.setdefault("RAY_AUTH_TOKEN_PATH", os.path.expanduser("~/.ray/auth_token"))
    return subprocess.run([str(LAPSTUDY), *map(str, args)], capture_output=True, text=True, timeout=timeout,
                          env=env, cwd=cwd)


def write_yaml(path: Path, data: dict) -> Path:
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def one_trial_study(root: Path, space: dict, ray_address: str, timeout: float = 900, flags: tuple = ()) -> dict:
    """`lapstudy run` of a one-trial `space` from `root` (relative paths, as a user types them), with `flags`: its
    MLflow store's URI, the trial's rows in Ray's records and its MLflow run."""
    name = space["name"]
    write_yaml(root / f"{name}.yaml", space)
    run = lapstudy("run", f"{name}.yaml", "--storage", "studies", "--address", ray_address, *flags, cwd=root,
                   timeout=timeout)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    study_dir = root / "studies" / name
    uri = f"sqlite:///{study_dir / 'mlflow.db'}"
    [(trial, rows)] = tune_trials(study_dir).items()
    [mlflow_run] = [r for r in mlflow_runs(uri, name) if r.data.tags["lapstudy.trial_id"] == trial]
    return {"uri": uri, "rows": rows, "run": mlflow_run}


def tune_trials(study_dir: Path) -> dict[str, list[dict]]:
    """Every result each trial reported, from the JSON lines Ray Tune writes into the trial folders."""
    trials = {}
    for result_file in sorted(Path(study_dir).glob("trial_*/result.json")):
        rows = [json.loads(line) for line in result_file.read_text().splitlines() if line.strip()]
        if rows:
            trials[rows[0]["trial_id"]] = rows
    return trials


def mlflow_runs(tracking_uri: str, experiment: str, *, study_run: bool = False) -> list:
    """The experiment's trial runs (`study_run`: its study's own run instead, the parent of the trial runs)."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri)
    found = client.get_experiment_by_name(experiment)
    runs = client.search_runs([found.experiment_id]) if found else []
    return [run for run in runs if (run.data.tags.get("lapstudy.study_run") == "true") == study_run]


def metric_history(tracking_uri: str, run_id: str, key: str) -> list[tuple[int, float]]:
    from mlflow.tracking import MlflowClient

    return [(m.step, m.value) for m in MlflowClient(tracking_uri).get_metric_history(run_id, key)]


def searcher_study(study_dir: Path):
    """The Optuna study inside the searcher state Tune saved in the study folder, and its trials by Tune trial id.
    Each driver session writes its own state file and Tune restores the newest by the session timestamp in the name
    (not by mtime: the final sync copies every session's file again, so their mtimes tie)."""
    import pickle

    state_file = max(Path(study_dir).glob("searcher-state-*.pkl"), key=lambda p: p.name)
    state = pickle.loads(state_file.read_bytes())
    searcher = state.get("searcher", state) if isinstance(state, dict) else state
    searcher_state = searcher if isinstance(searcher, dict) else vars(searcher)
    while "_ot_study" not in searcher_state:  # Tune may wrap the OptunaSearch (e.g. in a ConcurrencyLimiter)
        searcher_state = vars(searcher_state["searcher"])
    return searcher_state["_ot_study"], searcher_state["_ot_trials"]
