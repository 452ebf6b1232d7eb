"""Faults on a multi-node Ray cluster simulated on this machine (`ray.cluster_utils.Cluster`: a head node and two
worker nodes sharing the study storage), with the study driver as a `lapstudy run --address` subprocess:

- a worker node lost while a trial's Train worker, pinned to it by a custom resource, is training (a preempted spot
  machine; the replacement node the autoscaler would start is added by the test); in the same study, the next
  trial's Train worker process is SIGKILLed (an out-of-memory kill, a segfault in a kernel);
- the MLflow tracking server lost mid-study (a real `mlflow server`, SIGKILLed, later back on the same store), with
  credentials in the tracking URI and a hub token in the environment that must not reach any exported file.

One cluster serves both tests (start-up is the expensive part).
"""

from __future__ import annotations

import math
import os
import signal
import time
from types import SimpleNamespace

import pytest

from fault_fixtures import (
    Lapstudy,
    Proc,
    epoch_steps,
    explain,
    free_port,
    live_results,
    lose_node,
    mlflow_runs,
    mlflow_server,
    reported_epochs,
    run_lapstudy,
    simulated_cluster,
    study_records,
    tiny_space,
    tune_results,
    wait_for,
    wait_for_epoch,
    write_space,
)

pytestmark = pytest.mark.slow(seconds=260)

SPOT = "fault_spot"  # the custom resource of the worker node that gets preempted (and of its replacement)
NODE_LOSS_EPOCHS = 6


@pytest.fixture(scope="module")
def cluster():
    """Head (trial drivers: it holds the `lapstudy_driver` resource, as in cluster.yaml), a spot worker node (the
    Train workers' custom resource) and a second worker node (Ray Data and whatever else needs a CPU)."""
    with simulated_cluster("lsc", {"lapstudy_driver": 1}, {SPOT: 1}, {}) as cluster:
        yield SimpleNamespace(cluster=cluster.cluster, spot=cluster.nodes[1], env=cluster.env, ray_tmp=cluster.ray_tmp)


@pytest.fixture(scope="module")
def node_loss(cluster, tmp_path_factory):
    root = tmp_path_factory.mktemp("node_loss")
    space = write_space(root / "nodeloss.yaml", tiny_space(name="nodeloss", epochs=NODE_LOSS_EPOCHS))
    study_dir = root / "studies" / "nodeloss"
    study = Lapstudy(["run", space, "--storage", root / "studies", "--address", cluster.cluster.address,
                      "--max-concurrent", "1", "--worker-resource", f"{SPOT}=1"], cluster.env, root / "study.log")
    state = SimpleNamespace(study_dir=study_dir, tracking_uri=f"sqlite:///{study_dir / 'mlflow.db'}")
    try:
        row = wait_for_epoch(study, cluster.ray_tmp, "nodeloss", 2, "the node was removed")
        state.trial, state.seen = row["trial_id"], row["epoch"]
        state.removed_node_id = cluster.spot.node_id
        state.removed_at = time.time()
        lose_node(cluster.cluster, cluster.spot)
        # The autoscaler's replacement for the preempted machine (same node type, so same custom resource).
        replacement = cluster.cluster.add_node(num_cpus=1, resources={SPOT: 1})
        state.replacement_node_id = replacement.node_id

        row = wait_for_epoch(study, cluster.ray_tmp, "nodeloss", 2, "the worker process was killed",
                             other_than=state.trial)
        state.crashed_trial, state.crash_seen = row["trial_id"], row["epoch"]
        worker = Proc.read(row["worker_pid"])
        assert worker is not None and worker.name.startswith("ray::"), f"rank 0's process: {worker}"
        state.killed_worker = worker
        os.kill(worker.pid, signal.SIGKILL)
        state.code = study.wait(360)
        state.seconds_after_loss = time.time() - state.removed_at
        state.log = study.log(20000)
    finally:
        study.close()
    assert state.code == 0, state.log
    state.tune, state.mlflow = study_records(study_dir, "nodeloss")
    return state


def test_node_loss_trial_restarts_from_its_last_checkpoint(node_loss):
    rows = node_loss.tune[node_loss.trial]
    story = explain(rows, node_loss.log)
    before = [r for r in rows if r["resumed_from_epoch"] == 0]
    after = [r for r in rows if r["resumed_from_epoch"] > 0]
    assert before and after, "the trial never restarted" + story
    assert {r["worker_node_id"] for r in before} == {node_loss.removed_node_id}, "it trained on the removed node"
    assert {r["worker_node_id"] for r in after} == {node_loss.replacement_node_id}
    checkpoint_epoch = after[0]["resumed_from_epoch"]
    last_before = before[-1]["epoch"]
    assert node_loss.seen <= checkpoint_epoch <= last_before + 1, f"Tune had seen epoch {node_loss.seen}" + story
    assert after[0]["epoch"] == checkpoint_epoch + 1, "first epoch after the restart = checkpoint epoch + 1" + story
    # Ray's record of the trial: every epoch once, in order (what the lost worker did not report is re-run).
    assert [r["epoch"] for r in rows] == list(range(1, NODE_LOSS_EPOCHS + 1)), story


def test_worker_process_crash_restarts_the_trial_from_its_last_checkpoint(node_loss):
    """Ray Train replaces the killed worker group (FailureConfig of the trial's TorchTrainer) on the same node and
    resumes it from the trial's last checkpoint; Tune never sees the trial fail."""
    rows = node_loss.tune[node_loss.crashed_trial]
    story = explain(rows, node_loss.log)
    killed = node_loss.killed_worker
    before = [r for r in rows if r["worker_pid"] == killed.pid]
    after = [r for r in rows if r["worker_pid"] != killed.pid]
    assert before and after, "the trial never restarted" + story
    assert not killed.alive()
    assert {r["resumed_from_epoch"] for r in before} == {0}, story
    checkpoint_epoch = after[0]["resumed_from_epoch"]
    assert node_loss.crash_seen <= checkpoint_epoch <= before[-1]["epoch"] + 1, \
        f"Tune had seen epoch {node_loss.crash_seen}" + story
    assert after[0]["epoch"] == checkpoint_epoch + 1, "first epoch after the restart = checkpoint epoch + 1" + story
    assert {r["resumed_from_epoch"] for r in after} == {checkpoint_epoch}, \
        "one restart, one worker group after it" + story
    assert len({r["pid"] for r in rows}) == 1, \
        "Tune's `pid`: one trial driver throughout, Tune never restarted it" + story
    assert [r["epoch"] for r in rows] == list(range(1, NODE_LOSS_EPOCHS + 1)), story


def test_node_loss_study_finishes_every_trial(node_loss):
    from study.folder import StudyFolder
    from study.results import load_records

    records = load_records(StudyFolder(node_loss.study_dir))
    assert len(records) == 2
    assert [r.status for r in records] == ["completed", "completed"]
    assert all(r.epochs_run == NODE_LOSS_EPOCHS for r in records)


def test_node_loss_one_mlflow_run_per_trial_without_gaps(node_loss):
    assert set(node_loss.mlflow) == set(node_loss.tune)
    for trial, runs in node_loss.mlflow.items():
        assert len(runs) == 1, f"trial {trial}: {len(runs)} MLflow runs"
        (run,) = runs
        for key in ("epoch", "train_loss", "val_loss", "val_acc"):
            assert epoch_steps(run, key) == list(range(1, NODE_LOSS_EPOCHS + 1)), (trial, key, run["history"][key])
        assert run["status"] == "FINISHED" and run["tags"]["lapstudy.status"] == "completed"


# ---- the tracking server lost mid-study -----------------------------------------------------------------------------

TRACKING_EPOCHS = 4
HF_TOKEN = "hf_faultTestToken0123456789"
PASSWORD = "s3cret-fault-pw"


@pytest.fixture(scope="module")
def tracking_lost(cluster, tmp_path_factory):
    """The server is killed after the first trial's first epoch and stays away until the study has ended; then it
    comes back on the same store and `lapstudy sync` sends MLflow what Ray recorded meanwhile."""
    root = tmp_path_factory.mktemp("tracking")
    port = free_port()
    uri = f"http://lapuser:{PASSWORD}@127.0.0.1:{port}"
    space = write_space(root / "tracking.yaml", tiny_space(name="tracking", epochs=TRACKING_EPOCHS))
    study_dir = root / "studies" / "tracking"
    env = {**cluster.env, "HF_TOKEN": HF_TOKEN}
    state = SimpleNamespace(root=root, study_dir=study_dir, env=env)
    with mlflow_server(root / "server", port, root / "server.log") as server:
        study = Lapstudy(["run", space, "--storage", root / "studies", "--address", cluster.cluster.address,
                          "--max-concurrent", "1", "--tracking-uri", uri], env, root / "study.log")
        try:
            def first_epoch():
                assert not study.finished(), "the study ended early:\n" + study.log()
                epochs = reported_epochs(live_results(cluster.ray_tmp, "tracking"))
                return next(iter(epochs)) if epochs else None

            state.first_trial = wait_for(first_epoch, 240, "the first epoch of the first trial")
            # Epochs go on while the server is stopped: what Tune had seen just before the stop and just after it.
            state.seen_before_stop = reported_epochs(live_results(cluster.ray_tmp, "tracking"))[state.first_trial]
            server.stop()
            state.stopped_at_epoch = reported_epochs(live_results(cluster.ray_tmp, "tracking"))[state.first_trial]
            state.mlflow_before = mlflow_runs(f"sqlite:///{root / 'server' / 'mlflow.db'}", "tracking")
            state.code = study.wait(300)
            state.log = study.log(20000)
        finally:
            study.close()
        assert state.code == 0, state.log
        state.tune = tune_results(study_dir)
        server.start()
        state.sync = run_lapstudy(["sync", study_dir, "--tracking-uri", uri], env, timeout=180)
        state.mlflow = mlflow_runs(server.url, "tracking")
    return state


def test_tracking_lost_training_goes_on_and_ray_keeps_every_result(tracking_lost):
    from study.folder import StudyFolder
    from study.results import load_records

    records = load_records(StudyFolder(tracking_lost.study_dir))
    assert [r.status for r in records] == ["completed", "completed"]
    for trial, rows in tracking_lost.tune.items():
        assert [r["epoch"] for r in rows] == list(range(1, TRACKING_EPOCHS + 1))
        assert all(math.isfinite(r["val_acc"]) for r in rows)


def test_study_says_what_mlflow_lacks(tracking_lost):
    assert tracking_lost.stopped_at_epoch < TRACKING_EPOCHS, "the server went away mid-trial"
    assert "did not answer" in tracking_lost.log and "lapstudy sync" in tracking_lost.log
    # What MLflow had when the server died: every epoch Tune had seen before the stop (rank 0 logs an epoch before it
    # reports it), at most one more than Tune had seen just after it (logged, its report still on its way).
    (run,) = tracking_lost.mlflow_before[tracking_lost.first_trial]
    logged = epoch_steps(run)
    assert logged == list(range(1, len(logged) + 1))
    assert tracking_lost.seen_before_stop <= len(logged) <= tracking_lost.stopped_at_epoch + 1


def test_sync_sends_mlflow_what_ray_recorded_while_it_was_away(tracking_lost):
    """The first trial's run gets its missing epochs and its status; the second trial, which ran entirely while the
    server was away, gets its run created (params and config from its run config) with every epoch."""
    assert tracking_lost.sync.returncode == 0, tracking_lost.sync.stderr
    assert PASSWORD not in tracking_lost.sync.stdout + tracking_lost.sync.stderr
    runs = tracking_lost.mlflow
    assert set(runs) == set(tracking_lost.tune)
    assert runs[tracking_lost.first_trial][0]["run_id"] == \
        tracking_lost.mlflow_before[tracking_lost.first_trial][0]["run_id"], "the first trial keeps its run"
    for trial, trial_runs in runs.items():
        assert len(trial_runs) == 1, f"trial {trial}: {len(trial_runs)} runs"
        (run,) = trial_runs
        rows = tracking_lost.tune[trial]
        for key in ("epoch", "train_loss", "val_acc"):
            assert epoch_steps(run, key) == list(range(1, TRACKING_EPOCHS + 1)), (trial, key)
        assert dict(run["history"]["val_acc"]) == pytest.approx({r["epoch"]: r["val_acc"] for r in rows})
        assert run["tags"]["lapstudy.status"] == "completed" and run["status"] == "FINISHED"
        assert float(run["params"]["lr"]) == pytest.approx(rows[0]["config"]["lr"])


def test_tracking_unreachable_at_start_is_refused(cluster, tmp_path):
    space = write_space(tmp_path / "s.yaml", tiny_space(name="unreachable"))
    done = run_lapstudy(["run", space, "--storage", tmp_path / "studies", "--address", cluster.cluster.address,
                         "--tracking-uri", f"http://127.0.0.1:{free_port()}"], cluster.env, timeout=180)
    assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert "--tracking-uri" in done.stderr
    assert not (tmp_path / "studies").exists()


def test_exported_configs_hold_no_secrets(tracking_lost, tmp_path):
    out = tmp_path / "exported"
    done = run_lapstudy(["export", tracking_lost.study_dir, "--top", "2", "--out", out], tracking_lost.env, timeout=120)
    assert done.returncode == 0, done.stderr
    files = list(out.iterdir())
    assert len(files) == 2
    for path in files:
        text = path.read_text()
        assert PASSWORD not in text and HF_TOKEN not in text and "lapuser" not in text, path
    # Nor what the study printed (the log's first line is the harness echoing the command), nor any text file the
    # study wrote (study.json, trial configs, Ray's trial records).
    printed = "\n".join(line for line in tracking_lost.log.splitlines() if not line.startswith("$ lapstudy"))
    assert PASSWORD not in printed and HF_TOKEN not in printed
    for path in tracking_lost.study_dir.rglob("*"):
        if path.is_file() and path.suffix in {".json", ".yaml", ".txt", ".csv"}:
            text = path.read_text(errors="replace")
            assert PASSWORD not in text and HF_TOKEN not in text, path
