"""A trial's MLflow logging across an outage of a real `mlflow server` (no Ray needed): the worker's logger keeps
what it could not send and sends it once the server answers again, so a run ends with every epoch exactly once."""

from __future__ import annotations

import time

import pytest

from fault_fixtures import epoch_steps, free_port, mlflow_runs, mlflow_server

pytestmark = pytest.mark.slow(seconds=15)


def test_worker_logger_sends_what_it_kept_when_the_server_is_back(tmp_path):
    from study.tracking.run_logger import RunLogger, TrackingTarget
    from study.tracking.store import ensure_experiment

    port = free_port()
    with mlflow_server(tmp_path / "store", port, tmp_path / "server.log") as server:
        experiment = ensure_experiment(server.url, "outage", None, must_be_new=True)
        logger = RunLogger(TrackingTarget(server.url, experiment, "trial_t1", "t1", "outage"), {"lr": "0.001"},
                           "hyperparameters: {lr: 0.001}\n")
        logger.log_epoch(1, {"epoch": 1, "val_acc": 0.5, "train_loss": 1.0})
        server.stop()
        started = time.monotonic()
        logger.log_epoch(2, {"epoch": 2, "val_acc": 0.6, "train_loss": 0.9})  # refused: kept for later
        waited = time.monotonic() - started
        assert logger._pending, "the epoch the server missed must be kept"
        # Known to be away: the next call costs a refused connection, not MLflow's retries and back-off.
        started = time.monotonic()
        logger.log_epoch(3, {"epoch": 3, "val_acc": 0.65, "train_loss": 0.85})
        waited_again = time.monotonic() - started
        assert len({m.step for m in logger._pending}) == 2
        server.start()
        logger.log_epoch(4, {"epoch": 4, "val_acc": 0.7, "train_loss": 0.8})
        (run,) = mlflow_runs(server.url, "outage")["t1"]
    assert not logger._pending
    assert run["run_id"] == logger.run_id
    for key in ("epoch", "val_acc", "train_loss"):
        assert epoch_steps(run, key) == [1, 2, 3, 4], key
    assert dict(run["history"]["val_acc"]) == pytest.approx({1: 0.5, 2: 0.6, 3: 0.65, 4: 0.7})
    assert run["params"] == {"lr": "0.001"}
    assert waited < 20, f"a logging call waited {waited:.0f} s on a dead server"
    assert waited_again < 1, f"a logging call waited {waited_again:.1f} s on a server known to be away"
