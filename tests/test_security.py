"""Security defaults: the MLflow UI binds to this machine only unless told otherwise; nothing in the project turns
Ray's token authentication off. (Exported configs free of secrets and the dashboard refusing requests without
Ray's token are checked on real studies in test_fault_cluster.py and test_fault_resume.py.)"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from types import SimpleNamespace

import pytest

from study import cli
from study.folder import local_store

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def study_dir(tmp_path) -> Path:
    folder = tmp_path / "quick"
    folder.mkdir()
    tracking_uri, _ = local_store(folder)
    (folder / "study.json").write_text(json.dumps({
        "name": "quick", "space": "quick.yaml", "created": "2026-01-01T00:00:00+00:00", "seed": 0, "num_samples": 1,
        "seeds": [0], "max_concurrent": None,
        "resources": {"workers": 1, "cpus_per_worker": 1.0, "gpus_per_worker": 0.0}, "tracking_uri": tracking_uri,
        "experiment_id": "1", "metric": ["val_acc"], "mode": ["max"]}))
    return folder


def _ui_command(monkeypatch, argv) -> list[str]:
    launched = []

    def execv(path, command):
        launched.append(command)
        raise SystemExit(0)

    monkeypatch.setattr(os, "execv", execv)
    with pytest.raises(SystemExit):
        cli.main(argv)
    (command,) = launched
    return command


def _option(command: list[str], name: str) -> str:
    return command[command.index(name) + 1]


def test_ui_binds_to_localhost_by_default(study_dir, monkeypatch):
    command = _ui_command(monkeypatch, ["ui", str(study_dir)])
    assert command[1:4] == ["-m", "mlflow", "ui"]
    assert _option(command, "--host") == "127.0.0.1"
    assert _option(command, "--backend-store-uri") == local_store(study_dir)[0]


def test_ui_takes_the_study_folder_as_typed(study_dir, monkeypatch):
    """Relative to where it runs, with a trailing slash, or under ~: the same store, named by its absolute path."""
    expected = f"sqlite:///{study_dir.resolve() / 'mlflow.db'}"
    monkeypatch.chdir(study_dir.parent)
    assert _option(_ui_command(monkeypatch, ["ui", f"{study_dir.name}/"]), "--backend-store-uri") == expected
    monkeypatch.setenv("HOME", str(study_dir.parent))
    monkeypatch.chdir("/")
    assert _option(_ui_command(monkeypatch, ["ui", f"~/{study_dir.name}"]), "--backend-store-uri") == expected


def test_ui_binds_elsewhere_only_when_told(study_dir, monkeypatch):
    command = _ui_command(monkeypatch, ["ui", str(study_dir), "--host", "0.0.0.0", "--port", "5055"])
    assert _option(command, "--host") == "0.0.0.0"
    assert _option(command, "--port") == "5055"


def test_nothing_turns_ray_token_authentication_off():
    """Ray 2.60 enables token authentication by default; RAY_AUTH_MODE=disabled (or a config doing the same) must
    appear nowhere in what the project runs."""
    files = [*REPO.glob("study/**/*.py"), *REPO.glob("models/**/*.py"), REPO / "Makefile", REPO / ".ci" / "run",
             REPO / "pyproject.toml", *REPO.glob("search_spaces/*.yaml")]
    cluster = REPO / "cluster.yaml"
    if cluster.exists():
        files.append(cluster)
    # Setting the mode is allowed only to turn it on (cluster.yaml's nodes start with RAY_AUTH_MODE=token).
    offending = re.compile(r"RAY_AUTH_MODE(?!=token\b)|auth_mode\s*=|AUTH_MODE.*disabled")
    for path in files:
        assert not offending.search(path.read_text()), f"{path.relative_to(REPO)} touches Ray's auth mode"
    assert os.environ.get("RAY_AUTH_MODE", "token") != "disabled", "the test environment itself disables it"


def test_run_passes_no_auth_override_to_ray(monkeypatch, tmp_path):
    """What `lapstudy run` hands to ray.init: no auth setting, and only the listed variables go to the workers."""
    import ray

    from study.cluster import connect_ray

    seen = {}

    def init(**kwargs):
        seen.update(kwargs)
        return SimpleNamespace(address_info={"session_dir": str(tmp_path / "session")})

    monkeypatch.setattr(ray, "init", init)
    monkeypatch.setattr("study.cluster.pin_ray_address", lambda: None)  # no cluster to point at or ask here
    monkeypatch.setattr("study.cluster.check_state_api", lambda where: None)
    monkeypatch.setenv("HF_TOKEN", "hf_x")
    monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", "pw")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "aws")
    connect_ray(None, tmp_path)
    env_vars = seen["runtime_env"]["env_vars"]
    assert not any("AUTH" in key.upper() and "RAY" in key.upper() for key in env_vars)
    assert "AWS_SECRET_ACCESS_KEY" not in env_vars
    assert not any("auth" in key.lower() for key in seen if key != "runtime_env")
