"""Real studies through the `lapstudy` command line on a local Ray cluster: Ray Tune + Optuna + ASHA, each trial a
Ray Train job over Ray Data, every trial an MLflow run; then status, export and an exact re-run with `train`."""

from __future__ import annotations

import math

import pytest
import yaml

from study_fixtures import lapstudy, metric_history, mlflow_runs, ray_address, tune_trials, write_yaml  # noqa: F401

pytestmark = pytest.mark.slow

EPOCHS = 4
GOOD, SECOND, BAD = {"lr": 5.0e-3, "k": 0}, {"lr": 5.0e-3, "k": 2}, {"lr": 1.0e-6, "k": 2}
VIT_SPACE = {
    "name": "e2e",
    "task": "classification",
    "dataset": {"source": "digits"},
    "metric": "val_acc",
    "mode": "max",
    "epochs": EPOCHS,
    "seed": 0,
    "num_samples": 3,
    "sampler": {"kind": "tpe", "n_startup_trials": 3},
    # One trial at a time (--max-concurrent 1) and the bad trial last: at the epoch-2 rung ASHA has the good
    # trials' values and stops the bad one, every time.
    "scheduler": {"kind": "asha", "grace_period": 2, "reduction_factor": 2},
    "geometry": {"max_batches": 2, "pca_points": 200},
    "fixed": {"preset": "vit_tiny_digits", "batch_size": 64, "warmup_epochs": 0.5},
    "parameters": {"lr": {"type": "log_float", "low": 1.0e-6, "high": 1.0e-2}, "k": {"type": "int", "low": 0, "high": 4}},
    "points_to_evaluate": [GOOD, SECOND, BAD],
}
CLASSIFICATION_GEOMETRY = ("geom_within_seq_var", "geom_within_class_var", "geom_between_class_var",
                           "geom_between_class_frac", "geom_nc1", "geom_nc2_equinorm", "geom_nc2_equiangle",
                           "geom_nc3", "geom_nc4", "geom_pcs99")
LM_GEOMETRY = ("geom_within_target_var", "geom_between_target_var", "geom_between_target_frac", "geom_target_nc1",
               "geom_pcs99")


@pytest.fixture(scope="module")
def vit_study(tmp_path_factory, ray_address):
    root = tmp_path_factory.mktemp("vit")
    space = write_yaml(root / "space.yaml", VIT_SPACE)
    run = lapstudy("run", space, "--storage", root / "studies", "--address", ray_address, "--max-concurrent", "1")
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    study_dir = root / "studies" / "e2e"
    return {"root": root, "dir": study_dir, "stdout": run.stdout, "uri": f"sqlite:///{study_dir / 'mlflow.db'}",
            "trials": tune_trials(study_dir), "address": ray_address}


def _trial_for(trials: dict, params: dict) -> str:
    found = [tid for tid, rows in trials.items()
             if all(math.isclose(rows[0]["config"][k], v) for k, v in params.items())]
    assert len(found) == 1, (params, {t: r[0]["config"] for t, r in trials.items()})
    return found[0]


def test_study_finishes_with_one_mlflow_run_per_trial(vit_study):
    trials = vit_study["trials"]
    assert len(trials) == 3
    assert "best 3 by val_acc" in vit_study["stdout"] or "best" in vit_study["stdout"]
    assert "lapstudy ui" in vit_study["stdout"]
    runs = mlflow_runs(vit_study["uri"], "e2e")
    by_trial = {}
    for run in runs:
        by_trial.setdefault(run.data.tags["lapstudy.trial_id"], []).append(run)
    assert sorted(by_trial) == sorted(trials) and all(len(v) == 1 for v in by_trial.values())
    for trial_id, rows in trials.items():
        run = by_trial[trial_id][0]
        assert run.info.run_name == f"trial_{trial_id}"
        assert run.info.status in ("FINISHED", "KILLED")
        params = run.data.params
        for key in ("lr", "k", "preset", "task", "seed", "batch_size", "weight_decay", "optimizer", "depth"):
            assert key in params, key
        # what the data resolved to: digits' 1797 images, 20% held out
        assert (params["data.num_train"], params["data.num_val"], params["data.source"]) == ("1437", "360", "digits")
        assert math.isclose(float(params["lr"]), rows[0]["config"]["lr"]) and params["preset"] == "vit_tiny_digits"
        epochs_reported = [row["epoch"] for row in rows]
        for key in ("train_loss", "val_loss", "val_acc", "lr", "samples_per_s"):
            history = metric_history(vit_study["uri"], run.info.run_id, key)
            assert [step for step, _ in history][: len(epochs_reported)] == epochs_reported, key
            assert [v for _, v in history][: len(rows)] == [row[key] for row in rows], key  # the same numbers
        artifacts = {a.path for a in _artifacts(vit_study["uri"], run.info.run_id)}
        assert "config.yaml" in artifacts
        config = yaml.safe_load(_read_artifact(vit_study["uri"], run.info.run_id, "config.yaml"))
        assert config["hyperparameters"]["k"] == rows[0]["config"]["k"] and config["epochs"] == EPOCHS


def test_completed_trials_record_geometry_and_pictures(vit_study):
    first = _trial_for(vit_study["trials"], GOOD)
    run = _run_of(vit_study, first)
    assert run.data.tags["lapstudy.status"] == "completed" and run.info.status == "FINISHED"
    for key in CLASSIFICATION_GEOMETRY:
        assert key in run.data.metrics, key
        assert metric_history(vit_study["uri"], run.info.run_id, key)[-1][0] == EPOCHS
    parts = (run.data.metrics["geom_within_seq_var"] + run.data.metrics["geom_within_class_var"]
             + run.data.metrics["geom_between_class_var"])
    assert math.isclose(parts, run.data.metrics["geom_total_var"], rel_tol=1e-9)  # ANOVA identity, end to end
    pictures = {a.path for a in _artifacts(vit_study["uri"], run.info.run_id, "geometry")}
    assert pictures == {"geometry/pca.png", "geometry/variance.png"}
    assert _read_artifact(vit_study["uri"], run.info.run_id, "geometry/pca.png", binary=True)[:4] == b"\x89PNG"


def test_asha_stops_the_bad_trial_early(vit_study):
    bad = _trial_for(vit_study["trials"], BAD)
    rows = vit_study["trials"][bad]
    assert rows[-1]["epoch"] == VIT_SPACE["scheduler"]["grace_period"] < EPOCHS
    run = _run_of(vit_study, bad)
    assert run.data.tags["lapstudy.status"] == "early_stopped" and run.info.status == "KILLED"


def test_status_shows_every_trial(vit_study):
    status = lapstudy("status", vit_study["dir"], timeout=120)
    assert status.returncode == 0, status.stderr
    lines = status.stdout.splitlines()
    for trial_id, rows in vit_study["trials"].items():
        line = next(line for line in lines if line.startswith(trial_id))
        assert str(rows[-1]["epoch"]) in line.split()
        assert f"{rows[-1]['val_acc']:.4f}" in line
    bad = _trial_for(vit_study["trials"], BAD)
    assert "early_stopped" in next(line for line in lines if line.startswith(bad))
    assert "completed" in next(line for line in lines if line.startswith(_trial_for(vit_study["trials"], GOOD)))


def test_exported_config_retrains_to_the_same_metrics(vit_study):
    out = vit_study["root"] / "exported"
    export = lapstudy("export", vit_study["dir"], "--top", "1", "--out", out, timeout=120)
    assert export.returncode == 0, export.stderr
    [path] = sorted(out.glob("*.yaml"))
    exported = yaml.safe_load(path.read_text())
    completed = {tid: rows for tid, rows in vit_study["trials"].items() if rows[-1]["epoch"] == EPOCHS}
    best = max(completed, key=lambda tid: completed[tid][-1]["val_acc"])
    assert exported["provenance"]["trial_id"] == best
    assert exported["provenance"]["value"]["val_acc"] == completed[best][-1]["val_acc"]
    assert exported["hyperparameters"]["lr"] == completed[best][0]["config"]["lr"]
    storage = vit_study["root"] / "retrain"
    train = lapstudy("train", path, "--storage", storage, "--address", vit_study["address"])
    assert train.returncode == 0, train.stdout[-3000:] + train.stderr[-3000:]
    assert "identical" in train.stdout and "differs" not in train.stdout
    [rerun] = mlflow_runs(f"sqlite:///{storage / 'mlflow.db'}", "lapstudy-train")
    assert rerun.data.tags["lapstudy.status"] == "completed"
    original = _run_of(vit_study, best)
    for key in ("train_loss", "val_loss", "val_acc"):
        assert (metric_history(f"sqlite:///{storage / 'mlflow.db'}", rerun.info.run_id, key)
                == metric_history(vit_study["uri"], original.info.run_id, key)), key


def test_multi_objective_language_model_study_exports_its_pareto_set(tmp_path, ray_address):
    space = {
        "name": "pareto",
        "task": "language_modeling",
        "dataset": {"source": "pydoc_text", "seq_len": 64},
        "metric": ["val_bpb", "tokens_per_s"],
        "mode": ["min", "max"],
        "epochs": 2,
        "num_samples": 3,
        "sampler": {"kind": "nsga2", "population_size": 4},
        "scheduler": "none",
        "geometry": {"max_batches": 2, "top_targets": 8, "pca_points": 100},
        "fixed": {"preset": "gpt_tiny", "batch_size": 16, "steps_per_epoch": 8},
        "parameters": {"lr": {"type": "log_float", "low": 1.0e-3, "high": 1.0e-2}, "depth": [1, 2, 4]},
    }
    path = write_yaml(tmp_path / "space.yaml", space)
    run = lapstudy("run", path, "--storage", tmp_path / "studies", "--address", ray_address, "--max-concurrent", "1")
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    study_dir = tmp_path / "studies" / "pareto"
    finals = {tid: rows[-1] for tid, rows in tune_trials(study_dir).items()}
    assert len(finals) == 3 and all(row["epoch"] == 2 for row in finals.values())

    def dominates(a, b):
        return (a["val_bpb"] <= b["val_bpb"] and a["tokens_per_s"] >= b["tokens_per_s"]
                and (a["val_bpb"] < b["val_bpb"] or a["tokens_per_s"] > b["tokens_per_s"]))

    front = {tid for tid, row in finals.items() if not any(dominates(o, row) for o in finals.values())}
    export = lapstudy("export", study_dir, "--out", tmp_path / "exported", timeout=120)
    assert export.returncode == 0, export.stderr
    exported = [yaml.safe_load(p.read_text()) for p in sorted((tmp_path / "exported").glob("pareto*.yaml"))]
    assert {e["provenance"]["trial_id"] for e in exported} == front
    assert all(e["provenance"]["pareto"] for e in exported)
    uri = f"sqlite:///{study_dir / 'mlflow.db'}"
    runs = mlflow_runs(uri, "pareto")
    assert len(runs) == 3 and all(r.data.tags["lapstudy.status"] == "completed" for r in runs)
    for r in runs:
        for key in LM_GEOMETRY + ("val_bpb", "tokens_per_s"):
            assert key in r.data.metrics, key
        assert r.data.params["depth"] in ("1", "2", "4") and r.data.params["task"] == "language_modeling"


def _run_of(study, trial_id):
    [run] = [r for r in mlflow_runs(study["uri"], "e2e") if r.data.tags["lapstudy.trial_id"] == trial_id]
    return run


def _artifacts(uri, run_id, path=None):
    from mlflow.tracking import MlflowClient

    return MlflowClient(uri).list_artifacts(run_id, path)


def _read_artifact(uri, run_id, path, binary=False):
    from mlflow.tracking import MlflowClient

    local = MlflowClient(uri).download_artifacts(run_id, path)
    with open(local, "rb" if binary else "r") as handle:
        return handle.read()
