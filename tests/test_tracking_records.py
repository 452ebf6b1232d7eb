"""What MLflow holds of a run and of a study, read back through MLflow's own client from a real SQLite store: the
dataset as a run input (name, source, digest) rather than flattened params, and the study run's best configuration
with links to its runs; and which configuration is best (full-length runs only)."""

from __future__ import annotations

import hashlib
import json
import os

import pytest
from mlflow.tracking import MlflowClient

from study.data.config import DatasetConfig
from study.errors import validate
from study.results import TrialRecord, study_best
from study.status import TrialStatus
from study.tracking.run_logger import RunLogger, TrackingTarget, dataset_input
from study.tracking.runs import record_study_best
from study.tracking.store import ensure_experiment

DIGITS = {"source": "digits"}


def _config(dataset: dict):
    return validate(DatasetConfig, dataset)


def _digest(dataset: dict) -> str:
    described = _config(dataset).model_dump(mode="json")  # the dataset as configured, defaults included
    return hashlib.sha256(json.dumps(described, sort_keys=True, default=str).encode()).hexdigest()[:12]


@pytest.fixture
def store(tmp_path):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    return uri, ensure_experiment(uri, "records", None, must_be_new=True)


def test_each_kind_of_source_is_named_by_what_mlflow_knows_of_it(tmp_path):
    built_in, local, hub, preset = (dataset_input(_config(d)).dataset for d in (
        DIGITS, {"source": "parquet", "path": str(tmp_path / "shards")},
        {"source": "wikitext103", "hub_id": "Salesforce/wikitext", "config_name": "wikitext-103-raw-v1"},
        {"source": "hf", "name": "cifar100"}))
    assert (built_in.name, built_in.source_type, json.loads(built_in.source)) == (
        "digits", "code", {"tags": {"lapstudy.source": "digits"}})
    assert (local.name, local.source_type) == ("parquet:shards", "local")
    assert json.loads(local.source)["uri"].endswith(str(tmp_path / "shards"))
    assert (hub.name, hub.source_type) == ("wikitext103:Salesforce/wikitext", "hugging_face")
    assert json.loads(hub.source)["path"] == "Salesforce/wikitext"
    assert json.loads(hub.source)["config_name"] == "wikitext-103-raw-v1"
    assert (preset.name, json.loads(preset.source)["path"]) == ("hf:uoft-cs/cifar100", "uoft-cs/cifar100")
    assert built_in.digest == _digest(DIGITS)
    assert dataset_input(_config({**DIGITS, "split_seed": 1})).dataset.digest != built_in.digest


def test_a_trial_run_records_its_dataset_as_an_input_not_as_params(store):
    uri, experiment = store
    logger = RunLogger(TrackingTarget(uri, experiment, "trial_t1", "t1", "records"),
                       {"lr": "0.001", "data.train": "1437"},
                       "lr: 0.001\n", datasets=[dataset_input(_config(DIGITS))])
    logger.close()
    run = MlflowClient(uri).get_run(logger.run_id)
    [given] = run.inputs.dataset_inputs
    assert (given.dataset.name, given.dataset.digest) == ("digits", _digest(DIGITS))
    assert {(t.key, t.value) for t in given.tags} == {("mlflow.data.context", "training")}
    assert run.data.params == {"lr": "0.001", "data.train": "1437"}


def _record(trial_id: str, config_id: str, seed: int, value: float, *, status=TrialStatus.COMPLETED, epochs=4):
    params = {"lr": {"a": 0.1, "b": 0.2, "c": 0.3}[config_id], "config_id": config_id, "replicate": seed, "seed": seed}
    return TrialRecord(trial_id, trial_id, status, params, epochs,
                       {"val_acc": value, "mlflow_run_id": f"run-{trial_id}"})


def test_the_best_configuration_is_the_best_mean_of_full_length_replicates():
    records = [_record("a0", "a", 0, 0.5), _record("a1", "a", 1, 0.75),
               _record("b0", "b", 0, 0.875), _record("b1", "b", 1, 0.5),
               # the highest values, but a replicate stopped early: never the best, its mean would mix lengths
               _record("c0", "c", 0, 0.9375),
               _record("c1", "c", 1, 0.96875, status=TrialStatus.EARLY_STOPPED, epochs=2)]
    best = study_best(records, ["val_acc"], ["max"])
    assert best.sampled == {"lr": 0.2} and best.metrics == {"val_acc": (0.875 + 0.5) / 2} and best.replicates == 2
    assert [t.trial_id for t in best.trials] == ["b0", "b1"]
    assert study_best([_record("a0", "a", 0, 0.5, status=TrialStatus.EARLY_STOPPED, epochs=2)],
                      ["val_acc"], ["max"]) is None


def test_the_study_run_holds_the_best_metrics_and_links_each_best_run(store):
    uri, experiment = store
    client = MlflowClient(uri)
    study_run = client.create_run(experiment).info.run_id
    record_study_best(uri, experiment, study_run, {"val_acc": 0.5625}, {"b0": "r0", "b1": "r1"},
                      "lr=0.2: val_acc 0.5625")
    run = client.get_run(study_run)
    assert run.data.metrics == {"best/val_acc": 0.5625}
    assert run.data.tags["lapstudy.best_trial_ids"] == "b0,b1" and run.data.tags["lapstudy.best_run_ids"] == "r0,r1"
    note = run.data.tags["mlflow.note.content"]
    assert note.startswith("Best: lr=0.2: val_acc 0.5625")
    assert f"[trial b0](#/experiments/{experiment}/runs/r0)" in note and f"(#/experiments/{experiment}/runs/r1)" in note


def test_a_run_logger_keeps_credentials_out_of_the_uri_mlflow_quotes(monkeypatch, caplog):
    """Basic-auth credentials written into the tracking URI reach MLflow through its variables, not the URL it quotes
    in its warnings (a Train worker's warnings reach the driver's output and `ray job logs`)."""
    import logging
    import socket

    from study.tracking.store import credentials_to_environment

    for name in ("MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD"):
        monkeypatch.setenv(name, "")  # recorded, so that what the logger sets is undone after the test
        monkeypatch.delenv(name)
    assert credentials_to_environment("http://lap%40user:s3cret%2Fpw@example.org:5000") == "http://example.org:5000"
    assert os.environ["MLFLOW_TRACKING_USERNAME"] == "lap@user"
    assert os.environ["MLFLOW_TRACKING_PASSWORD"] == "s3cret/pw"
    assert credentials_to_environment("sqlite:///x/mlflow.db") == "sqlite:///x/mlflow.db"

    with socket.socket() as probe:  # a port nothing listens on: every call fails, and MLflow says so
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    caplog.set_level(logging.DEBUG)
    logger = RunLogger(TrackingTarget(f"http://lapuser:hunter2-pw@127.0.0.1:{port}", "0", "trial_t", "t", "s"),
                       {"lr": "0.1"}, "lr: 0.1\n")
    assert logger.run_id is None and logger.tracking_uri == f"http://127.0.0.1:{port}"
    assert logger._client.tracking_uri == logger.tracking_uri  # what every call of the logger and its monitor uses
    assert caplog.records and "hunter2-pw" not in caplog.text
