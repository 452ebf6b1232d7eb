"""Real studies through the `lapstudy` command line on a local Ray cluster: Ray Tune + Optuna + ASHA, each trial a
Ray Train job over Ray Data, every trial an MLflow run; then status, export and an exact re-run with `train`."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import yaml

from fault_fixtures import ray_without_dashboard, study_run
from study_fixtures import lapstudy, metric_history, mlflow_runs, ray_address, tune_trials, write_yaml  # noqa: F401

pytestmark = pytest.mark.slow(seconds=320)

EPOCHS = 8
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
    # One trial at a time (--max-concurrent 1), the good trial first and the bad one last: at the epoch-2 rung ASHA
    # has the good trial's value and stops the bad one, every time (the second stops there too at 8 epochs).
    "early_stopping": {"kind": "asha", "grace_period": 2, "reduction_factor": 2},
    "geometry": {"max_batches": 2, "pca_points": 200},
    "fixed": {"preset": "vit_tiny_digits", "batch_size": 64, "warmup_epochs": 0.5},
    "parameters": {"lr": {"type": "log_float", "low": 1.0e-6, "high": 1.0e-2},
                   "k": {"type": "int", "low": 0, "high": 4}},
    "points_to_evaluate": [GOOD, SECOND, BAD],
}
CLASSIFICATION_GEOMETRY = ("geom_within_seq_var", "geom_within_class_var", "geom_between_class_var",
                           "geom_between_class_frac", "geom_nc1", "geom_nc2_equinorm", "geom_nc2_equiangle",
                           "geom_nc3", "geom_nc4", "geom_pcs99")
# How far the GOOD trial run with bf16 or with two workers may land from the study's own run of it after 8 epochs
# (docs/study.md, "Exporting and re-running": seed-to-seed noise here is 0.04 of accuracy and 15% of loss).
BF16_ACC_TOLERANCE = 0.05
WORKERS_ACC_TOLERANCE, WORKERS_LOSS_TOLERANCE = 0.06, 0.25
LM_GEOMETRY = ("geom_within_target_var", "geom_between_target_var", "geom_between_target_frac", "geom_target_nc1",
               "geom_pcs99")


@pytest.fixture(scope="module")
def another_ray_instance():
    """A second, idle Ray instance on the machine (another user's study, a notebook): Ray's State API, which frees
    the placement groups of the trials ASHA stops, must still find the study's own cluster, or the trials after a
    stopped one wait for CPUs forever."""
    with ray_without_dashboard():
        yield


@pytest.fixture(scope="module")
def vit_study(tmp_path_factory, ray_address, another_ray_instance):
    root = tmp_path_factory.mktemp("vit")
    write_yaml(root / "space.yaml", VIT_SPACE)
    # Typed as a user types them: relative to the folder they work in, a trailing slash on the storage.
    run = lapstudy("run", "space.yaml", "--storage", "studies/", "--address", ray_address, "--max-concurrent", "1",
                   cwd=root)
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
        for key in ("lr", "k", "preset", "task", "seed", "batch_size", "weight_decay", "optimizer", "depth",
                    "beta2", "eps", "min_lr_ratio"):  # AdamW's and the cosine's defaults too
            assert key in params, key
        # ... and nothing AdamW, the cosine, classification or an attention ViT do not read
        unread = {"matrix_lr", "embedding_lr", "warmdown_ratio", "muon_momentum_warmup", "param_data_ratio",
                  "dino_out_dim", "stlt_nodes", "vocab_size"}
        assert not unread & set(params), sorted(unread & set(params))
        # what the data resolved to: digits' 1797 images, 20% held out
        assert (params["data.num_train"], params["data.num_val"], params["data.source"]) == ("1437", "360", "digits")
        assert math.isclose(float(params["lr"]), rows[0]["config"]["lr"]) and params["preset"] == "vit_tiny_digits"
        epochs_reported = [row["epoch"] for row in rows]
        assert epochs_reported == list(range(1, len(rows) + 1))
        stopped = run.data.tags["lapstudy.status"] == "early_stopped"
        for key in ("epoch", "train_loss", "val_loss", "val_acc", "lr", "samples_per_s"):
            history = metric_history(vit_study["uri"], run.info.run_id, key)
            # Every epoch exactly once, with the numbers Ray recorded. A trial ASHA stopped may also hold the one
            # epoch its worker finished while the stop was on its way, which Tune never took (docs/study.md).
            steps = [step for step, _ in history]
            in_flight = steps[len(rows):]
            assert steps[:len(rows)] == epochs_reported and in_flight in ([], [len(rows) + 1] if stopped else []), key
            assert [v for _, v in history][:len(rows)] == [float(row[key]) for row in rows], key
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
        assert [step for step, _ in metric_history(vit_study["uri"], run.info.run_id, key)] == [2, 4, EPOCHS]
    parts = (run.data.metrics["geom_within_seq_var"] + run.data.metrics["geom_within_class_var"]
             + run.data.metrics["geom_between_class_var"])
    assert math.isclose(parts, run.data.metrics["geom_total_var"], rel_tol=1e-9)  # ANOVA identity, end to end
    pictures = {a.path for a in _artifacts(vit_study["uri"], run.info.run_id, "geometry")}
    layers = {f"geometry/layers_{name}.png" for name in ("within_seq_var", "within_class_var", "between_class_var",
                                                         "between_class_frac", "nc1")}
    rungs = {f"geometry/epoch_{epoch:04d}" for epoch in (2, 4)}  # ASHA's rungs before the last epoch
    assert pictures == {"geometry/pca.png", "geometry/variance.png", *layers, *rungs}
    assert _read_artifact(vit_study["uri"], run.info.run_id, "geometry/pca.png", binary=True)[:4] == b"\x89PNG"


def test_asha_stops_the_bad_trial_early(vit_study):
    bad = _trial_for(vit_study["trials"], BAD)
    rows = vit_study["trials"][bad]
    assert rows[-1]["epoch"] == VIT_SPACE["early_stopping"]["grace_period"] < EPOCHS
    run = _run_of(vit_study, bad)
    assert run.data.tags["lapstudy.status"] == "early_stopped" and run.info.status == "KILLED"
    # its geometry where ASHA judged it, the last layer's and every layer's
    judged = VIT_SPACE["early_stopping"]["grace_period"]
    for key in (*CLASSIFICATION_GEOMETRY, "geom_l0_between_class_frac", "geom_l3_nc1"):
        assert [step for step, _ in metric_history(vit_study["uri"], run.info.run_id, key)] == [judged], key


def test_status_shows_every_trial(vit_study):
    root = vit_study["root"]
    status = lapstudy("status", "studies/e2e/", timeout=120, cwd=root)  # the README's command, relative
    assert status.returncode == 0, status.stderr
    lines = status.stdout.splitlines()
    for trial_id, rows in vit_study["trials"].items():
        line = next(line for line in lines if line.startswith(trial_id))
        assert str(rows[-1]["epoch"]) in line.split()
        assert f"{rows[-1]['val_acc']:.4f}" in line
    bad = _trial_for(vit_study["trials"], BAD)
    assert "early_stopped" in next(line for line in lines if line.startswith(bad))
    assert "completed" in next(line for line in lines if line.startswith(_trial_for(vit_study["trials"], GOOD)))
    elsewhere = lapstudy("status", "~/studies/e2e", timeout=120, cwd=root.parent, home=root)
    assert elsewhere.returncode == 0 and elsewhere.stdout == status.stdout, elsewhere.stderr


def test_status_and_export_answer_in_json_for_scripts(vit_study, tmp_path):
    """`status --json` holds what Ray recorded of every trial (its last row, read here from the trial folders);
    `export --json` names each file written with the trial and value its provenance holds."""
    root = vit_study["root"]
    status = lapstudy("status", "studies/e2e", "--json", timeout=120, cwd=root)
    assert status.returncode == 0, status.stderr
    document = json.loads(status.stdout)
    assert document["study"] == "e2e" and document["metric"] == {"val_acc": "max"}
    trials = {t["trial_id"]: t for t in document["trials"]}
    assert set(trials) == set(vit_study["trials"])
    for trial_id, rows in vit_study["trials"].items():
        assert trials[trial_id]["epochs"] == rows[-1]["epoch"]
        assert trials[trial_id]["metrics"]["val_acc"] == rows[-1]["val_acc"]
        assert trials[trial_id]["params"]["lr"] == rows[0]["config"]["lr"]
    assert trials[_trial_for(vit_study["trials"], BAD)]["status"] == "early_stopped"
    export = lapstudy("export", "studies/e2e", "--top", "2", "--json", "--out", tmp_path, timeout=120, cwd=root)
    assert export.returncode == 0, export.stderr
    written = json.loads(export.stdout)["exported"]
    completed = sorted((rows[-1]["val_acc"], tid) for tid, rows in vit_study["trials"].items()
                       if rows[-1]["epoch"] == EPOCHS)
    assert [(entry["rank"], entry["trial_id"]) for entry in written] == [
        (rank, tid) for rank, (_, tid) in enumerate(reversed(completed[-2:]), start=1)]
    for entry in written:
        provenance = yaml.safe_load(Path(entry["path"]).read_text())["provenance"]
        assert entry["trial_id"] == provenance["trial_id"] and entry["value"] == provenance["value"]
        assert entry["value"]["val_acc"] == vit_study["trials"][entry["trial_id"]][-1]["val_acc"]


def test_the_optuna_journal_shows_what_status_shows(vit_study):
    """What optuna-dashboard shows, read from the study's journal with Optuna's own API: one Optuna trial per Tune
    trial, in the state `lapstudy status` names (the trial ASHA stopped PRUNED, not COMPLETE with its epoch-2 value),
    an intermediate value at every epoch Ray recorded, the final value only for trials that ran every epoch, and the
    Tune trial id and MLflow run id as user attributes."""
    import optuna
    from optuna.storages import JournalStorage
    from optuna.storages.journal import JournalFileBackend

    from study.search import JOURNAL_FILE

    status = lapstudy("status", "studies/e2e", "--json", timeout=120, cwd=vit_study["root"])
    assert status.returncode == 0, status.stderr
    named = {t["trial_id"]: t["status"] for t in json.loads(status.stdout)["trials"]}
    journal = JournalStorage(JournalFileBackend(str(vit_study["dir"] / JOURNAL_FILE)))
    trials = optuna.load_study(study_name="e2e", storage=journal).trials
    by_tune_id = {t.user_attrs["tune_trial_ids"][0]: t for t in trials}
    assert len(trials) == len(by_tune_id) and set(by_tune_id) == set(vit_study["trials"])
    state_of = {"completed": optuna.trial.TrialState.COMPLETE, "early_stopped": optuna.trial.TrialState.PRUNED}
    assert set(named.values()) == set(state_of), named  # GOOD runs to the end, ASHA stops BAD at its first rung
    for trial_id, rows in vit_study["trials"].items():
        trial = by_tune_id[trial_id]
        assert trial.state is state_of[named[trial_id]], (trial_id, trial.state)
        assert trial.params == {k: rows[0]["config"][k] for k in ("lr", "k")}
        assert trial.intermediate_values == {r["epoch"]: r["val_acc"] for r in rows}
        assert trial.value == rows[-1]["val_acc"]  # a pruned trial's value is its last intermediate one
        assert trial.user_attrs["mlflow_run_ids"] == [_run_of(vit_study, trial_id).info.run_id]


def test_the_study_run_holds_the_best_trial_and_links_its_run(vit_study):
    """The study's own MLflow run says what the study found: the best full-length trial's metrics as best/<metric>,
    its trial id and run id as tags, and a link to its run in the run's note (its description in the UI)."""
    parent = study_run(vit_study["uri"], "e2e")
    full_length = {tid: rows[-1] for tid, rows in vit_study["trials"].items() if rows[-1]["epoch"] == EPOCHS}
    best = max(full_length, key=lambda tid: full_length[tid]["val_acc"])
    run = _run_of(vit_study, best)
    assert parent["metrics"]["best/val_acc"] == full_length[best]["val_acc"]
    assert parent["tags"]["lapstudy.best_trial_ids"] == best
    assert parent["tags"]["lapstudy.best_run_ids"] == run.info.run_id
    note = parent["tags"]["mlflow.note.content"]
    assert f"[trial {best}](#/experiments/{run.info.experiment_id}/runs/{run.info.run_id})" in note
    assert f"val_acc {full_length[best]['val_acc']:.4f}" in note
    # and each trial's run names its data as an MLflow dataset input, not as flattened params
    from mlflow.tracking import MlflowClient

    [given] = MlflowClient(vit_study["uri"]).get_run(run.info.run_id).inputs.dataset_inputs
    assert given.dataset.name == "digits" and given.dataset.source_type == "code"
    assert not [key for key in run.data.params if key.startswith("dataset.")], run.data.params


def test_export_registers_the_best_trials_model_which_loads_back_from_the_registry(vit_study, tmp_path):
    """`export --register`: the best trial's model in MLflow's registry under the study's name, logged to that trial's
    run with a signature; loaded back by a fresh process through `models:/e2e/1`, it computes what the trial's last
    checkpoint computes, at any batch size."""
    done = lapstudy("export", "studies/e2e", "--register", "--json", "--out", tmp_path, timeout=300,
                    cwd=vit_study["root"])
    assert done.returncode == 0, done.stderr[-3000:]
    document = json.loads(done.stdout)
    best = document["exported"][0]["trial_id"]
    assert document["registered"] == {"name": "e2e", "version": 1, "run_id": _run_of(vit_study, best).info.run_id,
                                      "uri": "models:/e2e/1"}
    probe = f"""
import sys, mlflow, mlflow.pytorch, torch
from pathlib import Path
from study.evals.load import resolve_run, trained_model
from study.runspec import load_run_spec
mlflow.set_tracking_uri({vit_study["uri"]!r}); mlflow.set_registry_uri({vit_study["uri"]!r})
registered = mlflow.pytorch.load_model("models:/e2e/1")
config, state = resolve_run(Path({str(vit_study["dir"] / "train" / f"trial_{best}")!r}))
checkpoint = trained_model(load_run_spec(config), config, state)
images = torch.randn(5, 1, 8, 8, generator=torch.Generator().manual_seed(0))
print(float((registered(images) - checkpoint(images)).abs().max()))
print(mlflow.models.get_model_info("models:/e2e/1").signature.inputs.to_dict())
"""
    import subprocess
    import sys

    loaded = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300,
                            cwd=vit_study["root"])
    assert loaded.returncode == 0, loaded.stderr[-3000:]
    difference, inputs = loaded.stdout.strip().splitlines()[-2:]
    assert float(difference) == 0.0
    assert "(-1, 1, 8, 8)" in inputs and "float32" in inputs


def test_sync_finds_mlflow_in_order(vit_study):
    done = lapstudy("sync", "./studies/e2e", timeout=120, cwd=vit_study["root"])
    assert done.returncode == 0 and "match Ray's records" in done.stdout, done.stdout + done.stderr


def test_exported_config_retrains_to_the_same_metrics(vit_study):
    root = vit_study["root"]
    export = lapstudy("export", "studies/e2e", "--top", "1", "--out", "exported/", timeout=120, cwd=root)
    assert export.returncode == 0, export.stderr
    [path] = sorted((root / "exported").glob("*.yaml"))
    assert export.stdout.split() == [str(path)]
    exported = yaml.safe_load(path.read_text())
    completed = {tid: rows for tid, rows in vit_study["trials"].items() if rows[-1]["epoch"] == EPOCHS}
    best = max(completed, key=lambda tid: completed[tid][-1]["val_acc"])
    assert exported["provenance"]["trial_id"] == best
    assert exported["provenance"]["value"]["val_acc"] == completed[best][-1]["val_acc"]
    assert exported["hyperparameters"]["lr"] == completed[best][0]["config"]["lr"]
    storage = root / "retrain"
    train = lapstudy("train", f"exported/{path.name}", "--storage", "~/retrain", "--address", vit_study["address"],
                     cwd=root, home=root)
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
        "early_stopping": "none",
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


# ---- the same trial (GOOD) run again with one thing changed, against the study's own run of it -------------------


def _variant(vit_study, name: str, *flags, **changes) -> dict:
    """The GOOD trial alone, as a study of its own with `changes` to the space and `flags` on the command line;
    its rows in Ray's records, its MLflow run and its run config."""
    root = vit_study["root"]
    space = {**VIT_SPACE, "name": name, "num_samples": 1, "early_stopping": "none", "points_to_evaluate": [GOOD],
             **changes}
    write_yaml(root / f"{name}.yaml", space)
    run = lapstudy("run", f"{name}.yaml", "--storage", "studies", "--address", vit_study["address"], *flags, cwd=root)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    study_dir = root / "studies" / name
    [(trial_id, rows)] = tune_trials(study_dir).items()
    [mlflow_run] = mlflow_runs(f"sqlite:///{study_dir / 'mlflow.db'}", name)
    config = yaml.safe_load((study_dir / "trials" / f"{trial_id}.yaml").read_text())
    return {"dir": study_dir, "rows": rows, "run": mlflow_run, "config": config, "trial_id": trial_id}


def test_seed_flag_reseeds_every_trial(vit_study):
    """`--seed 7` over a space whose seed is 0: recorded everywhere a run is described, and the training differs
    from the same trial at seed 0 from its first epoch on (initial weights, data order, augmentation)."""
    seeded = _variant(vit_study, "seed7", "--seed", "7")
    assert json.loads((seeded["dir"] / "study.json").read_text())["seed"] == 7
    assert seeded["config"]["seed"] == 7 and seeded["run"].data.params["seed"] == "7"
    baseline = vit_study["trials"][_trial_for(vit_study["trials"], GOOD)]
    assert len(seeded["rows"]) == len(baseline) == EPOCHS
    for mine, theirs in zip(seeded["rows"], baseline):
        assert mine["train_loss"] != theirs["train_loss"], mine["epoch"]


def test_bf16_precision_trains_on_cpu(vit_study):
    """`precision: bf16` autocasts the forward passes on CPU too: the trial learns as the fp32 one does, with
    numbers of its own."""
    bf16 = _variant(vit_study, "bf16", fixed={**VIT_SPACE["fixed"], "precision": "bf16"})
    assert bf16["config"]["hyperparameters"]["precision"] == "bf16" and bf16["run"].data.params["precision"] == "bf16"
    baseline = vit_study["trials"][_trial_for(vit_study["trials"], GOOD)]
    assert all(math.isfinite(row["train_loss"]) and math.isfinite(row["val_loss"]) for row in bf16["rows"])
    assert bf16["rows"][0]["train_loss"] != baseline[0]["train_loss"]  # bf16 matmuls: not the fp32 numbers
    assert abs(bf16["rows"][-1]["val_acc"] - baseline[-1]["val_acc"]) <= BF16_ACC_TOLERANCE
    losses = [row["val_loss"] for row in bf16["rows"]]
    assert losses == sorted(losses, reverse=True) and bf16["rows"][-1]["val_acc"] > 0.4  # it learns (chance: 0.1)


def test_two_workers_per_trial_sum_their_metrics_and_geometry(vit_study):
    """Two data-parallel Train workers (DDP over gloo on CPU), each with half the batch and its own validation
    shard: the metrics and the geometry they report are those of the whole validation split, exactly as one
    process evaluating the trial's final weights finds them; and the training lands where one worker's does,
    within the tolerance docs/study.md gives."""
    two = _variant(vit_study, "workers2", "--workers-per-trial", "2", "--cpus-per-worker", "0.5",
                   geometry={"pca_points": 200})
    assert two["run"].data.params["workers"] == "2" and two["config"]["resources"]["workers"] == 2
    final = two["rows"][-1]
    assert final["epoch"] == EPOCHS
    truth = _evaluate_checkpoint(two["dir"], two["trial_id"], two["config"])
    assert final["val_acc"] == truth["val_acc"]
    assert final["val_loss"] == pytest.approx(truth["val_loss"], rel=1e-6)
    for key in ("within_seq_var", "within_class_var", "between_class_var", "total_var", "between_class_frac", "nc1",
                "nc2_equinorm", "nc2_equiangle", "nc3", "nc4"):
        assert final[f"geom_{key}"] == pytest.approx(truth[key], rel=1e-6, abs=1e-12), key
    baseline = vit_study["trials"][_trial_for(vit_study["trials"], GOOD)][-1]
    assert abs(final["val_acc"] - baseline["val_acc"]) <= WORKERS_ACC_TOLERANCE
    assert abs(final["val_loss"] - baseline["val_loss"]) <= WORKERS_LOSS_TOLERANCE * baseline["val_loss"]


def _evaluate_checkpoint(study_dir, trial_id: str, config: dict) -> dict:
    """The trial's final checkpoint evaluated in this one process on every validation row: accuracy and loss by
    plain torch, the geometry by models.geometry's in-memory definitions."""
    import torch
    import torch.nn.functional as F

    import models
    from models.geometry import neural_collapse, variance_decomposition
    from study.data import load_task_data

    [checkpoint] = sorted((study_dir / "train" / f"trial_{trial_id}").glob("checkpoint_*/state.pt"))[-1:]
    state = torch.load(checkpoint, map_location="cpu", weights_only=False)
    assert state["epoch"] == config["epochs"]
    hyperparameters = config["hyperparameters"]
    model = models.build_model({k: v for k, v in hyperparameters.items() if k in models.MODEL_KEYS}).eval()
    model.load_state_dict(state["model"])
    data = load_task_data(config["dataset"], seed=config["seed"])
    tokens, features, logits, labels = [], [], [], []
    with torch.no_grad():
        for batch in data.datasets["val"].iter_torch_batches(batch_size=128):
            batch = data.batch_steps.evaluate(batch)
            out = model(batch["image"], return_features=True)
            tokens.append(out.tokens), features.append(out.feature), logits.append(out.logits)
            labels.append(batch["label"])
    tokens, features, logits, labels = map(torch.cat, (tokens, features, logits, labels))
    assert len(labels) == 360  # every validation row once
    return {"val_acc": (logits.argmax(1) == labels).double().mean().item(),
            "val_loss": F.cross_entropy(logits.double(), labels).item(),
            **variance_decomposition(tokens, labels),
            **neural_collapse(features, labels, model.classifier_weight)}
