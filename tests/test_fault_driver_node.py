"""The node under a trial *driver* lost mid-trial, on a cluster whose trial drivers do not run on the head.

cluster.yaml keeps trial drivers on the on-demand head (the `lapstudy_driver` resource), so there this fault only
comes with the head, i.e. with the whole cluster (`--resume` covers that: test_fault_resume.py). A cluster set up
otherwise can lose the node under a trial driver: here a worker node holds `lapstudy_driver` (so every trial driver
runs on it) and a second worker node holds the Train workers. The driver node is removed while the trial trains and
the autoscaler's replacement is added by the test. Tune retries the trial (its FailureConfig); the new trial driver
builds the TorchTrainer again under the same name, which finds the trial's Train checkpoints and resumes from them.
"""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest

from fault_fixtures import (
    Lapstudy,
    Proc,
    epoch_steps,
    explain,
    lose_node,
    mlflow_runs,
    simulated_cluster,
    study_records,
    tiny_space,
    wait_for_epoch,
    write_space,
)

pytestmark = pytest.mark.slow(seconds=100)

DRIVER = "lapstudy_driver"  # study.resources.DRIVER_NODE_RESOURCE: trial drivers go where it is
TRAIN = "fault_train"  # the Train workers' node
EPOCHS = 6


@pytest.fixture(scope="module")
def driver_loss(tmp_path_factory):
    root = tmp_path_factory.mktemp("driver_loss")
    space = write_space(root / "driverloss.yaml", tiny_space(name="driverloss", epochs=EPOCHS, num_samples=1,
                                                             points_to_evaluate=[{"lr": 1.0e-3, "k": 2}]))
    study_dir = root / "studies" / "driverloss"
    state = SimpleNamespace(study_dir=study_dir)
    with simulated_cluster("lsd", {}, {DRIVER: 1}, {TRAIN: 1}) as cluster:
        driver_node = cluster.nodes[1]
        study = Lapstudy(["run", space, "--storage", root / "studies", "--address", cluster.address,
                          "--worker-resource", f"{TRAIN}=1"], cluster.env, root / "study.log")
        try:
            row = wait_for_epoch(study, cluster.ray_tmp, "driverloss", 2, "the driver's node was removed")
            state.trial, state.seen = row["trial_id"], row["epoch"]
            state.driver = Proc.read(row["pid"])  # Tune's `pid`: the trial driver's process
            assert state.driver is not None, "the trial driver's process"
            state.driver_node_id, state.train_node_id = driver_node.node_id, row["worker_node_id"]
            lose_node(cluster.cluster, driver_node)  # at once: an epoch takes under a second here
            state.removed_at = time.time()
            # The first driver's run (its retry needs far longer than this read to start).
            state.mlflow_at_loss = mlflow_runs(f"sqlite:///{study_dir / 'mlflow.db'}", "driverloss")
            cluster.cluster.add_node(num_cpus=1, resources={DRIVER: 1})  # the autoscaler's replacement
            state.code = study.wait(360)
            state.seconds_after_loss = time.time() - state.removed_at
            state.log = study.log(20000)
        finally:
            study.close()
    assert state.code == 0, state.log
    state.tune, state.mlflow = study_records(study_dir, "driverloss")
    return state


def story(state) -> str:
    return explain(state.tune.get(state.trial, []), state.log)


def test_driver_node_loss_resumes_the_trial_from_its_train_checkpoint(driver_loss):
    print(f"\nthe study finished {driver_loss.seconds_after_loss:.0f} s after the driver's node was removed")
    assert not driver_loss.driver.alive(), "the trial driver went with its node"
    rows = driver_loss.tune[driver_loss.trial]
    after = [r for r in rows if r["resumed_from_epoch"] > 0]
    assert after, "the trial never resumed from a checkpoint" + story(driver_loss)
    assert {r["pid"] for r in after}.isdisjoint({driver_loss.driver.pid}), "a new trial driver reported them"
    checkpoint_epoch = after[0]["resumed_from_epoch"]
    assert checkpoint_epoch >= driver_loss.seen >= 2
    assert [r["epoch"] for r in after] == list(range(checkpoint_epoch + 1, EPOCHS + 1)), story(driver_loss)
    from study.folder import StudyFolder
    from study.results import load_records

    (record,) = load_records(StudyFolder(driver_loss.study_dir))
    assert record.status == "completed" and record.epochs_run == EPOCHS


def test_driver_node_loss_keeps_one_mlflow_run_without_gaps(driver_loss):
    (before,) = driver_loss.mlflow_at_loss[driver_loss.trial]
    (run,) = driver_loss.mlflow[driver_loss.trial]
    assert set(driver_loss.mlflow) == {driver_loss.trial}
    assert run["run_id"] == before["run_id"], "the restarted trial found its MLflow run again"
    for key in ("epoch", "train_loss", "val_loss", "val_acc"):
        assert epoch_steps(run, key) == list(range(1, EPOCHS + 1)), (key, run["history"][key], story(driver_loss))
    assert run["status"] == "FINISHED" and run["tags"]["lapstudy.status"] == "completed"
