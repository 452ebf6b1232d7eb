"""A study kept in object storage (an S3-compatible server) and tracked by an MLflow server whose runs are in
PostgreSQL and whose artifacts are in the same object store, as on a cluster (docs/cluster.md): its driver is killed
mid-trial, its local copy wiped, and `--resume` continues from what storage holds alone. It ends with exactly the
requested trials, one MLflow run each (in PostgreSQL), Train checkpoints and MLflow artifacts in the bucket, the trial
finished before the kill left as it was, and the one cut short resumed from its checkpoint in storage."""

from __future__ import annotations

import io
import shutil
from contextlib import redirect_stdout
from pathlib import Path
from types import SimpleNamespace

import pyarrow.fs
import pytest

from fault_fixtures import (
    free_port,
    kill_study_when,
    mlflow_runs,
    mlflow_server,
    private_ray_tmp,
    resume_study,
    run_lapstudy,
    study_env,
    study_run,
    tiny_space,
    tune_results,
    write_space,
)
from servers import object_store, postgres_server  # noqa: F401 - object_store: the S3-compatible server
from study import cli
from study.storage import STAGING_VARIABLE, download, filesystem, join

pytestmark = pytest.mark.slow(seconds=150)

EPOCHS = 5
FIRST, CUT = 1.0e-3, 2.0e-3
# The wider, deeper ViT of the resume test (about 2 s an epoch): the kill waits for storage to show the second trial
# mid-way, and Tune's copy there lags its own by seconds.
SPACE = tiny_space(name="stored", epochs=EPOCHS, num_samples=2, fixed={**tiny_space()["fixed"], "dim": 128, "depth": 4},
                   points_to_evaluate=[{"lr": FIRST, "k": 0}, {"lr": CUT, "k": 2}])


def _stored_results(location: str, scratch: Path) -> dict[str, list[dict]]:
    """Tune's records of the study as storage holds them."""
    shutil.rmtree(scratch, ignore_errors=True)
    download(location, scratch, skip=frozenset({"train"}))
    return tune_results(scratch)


def _with_lr(results: dict, lr: float) -> str | None:
    return next((t for t, rows in results.items() if rows[0]["config"]["lr"] == pytest.approx(lr)), None)


def _keys(location: str) -> list[str]:
    fs, path = filesystem(location)
    infos = fs.get_file_info(pyarrow.fs.FileSelector(path, recursive=True, allow_not_found=True))
    return [info.path[len(path) + 1:] for info in infos if info.type == pyarrow.fs.FileType.File]


@pytest.fixture(scope="module")
def stored(object_store, tmp_path_factory):  # noqa: F811 - the fixture imported above
    root = tmp_path_factory.mktemp("stored")
    bucket = object_store.bucket("lapstudy-stored")
    state = SimpleNamespace(root=root, location=join(bucket, "studies", "stored"))
    write_space(root / "stored.yaml", SPACE)
    with postgres_server() as database, mlflow_server(root / "mlflow", free_port(), root / "mlflow.log",
                                                      backend=database, artifacts=join(bucket, "mlartifacts"),
                                                      env=object_store.env) as server, \
            private_ray_tmp("lso") as ray_tmp:
        state.database, state.tracking_uri = database, server.url
        args = ["run", "stored.yaml", "--storage", join(bucket, "studies"), "--tracking-uri", server.url,
                "--max-concurrent", "1"]
        env = study_env(ray_tmp, **{STAGING_VARIABLE: str(root / "staging")})

        def second_trial_mid_way():
            results = _stored_results(state.location, root / "poll")
            trial = _with_lr(results, CUT)
            return trial is not None and max(r["epoch"] for r in results[trial]) >= 2

        kill_study_when(args, env, root, second_trial_mid_way, "storage to show the second trial's epoch 2")
        state.at_kill = _stored_results(state.location, root / "at_kill")
        shutil.rmtree(root / "staging")  # what the resume knows comes from storage
        state.log = resume_study(args, env, root)
        state.results = _stored_results(state.location, root / "final")
        state.runs = mlflow_runs(server.url, "stored")
        state.study_run = study_run(server.url, "stored")
        state.artifacts = _keys(join(bucket, "mlartifacts"))
        # the reading commands, in this process (its pyarrow pointed at the same server)
        with pytest.MonkeyPatch.context() as patch:
            patch.setenv(STAGING_VARIABLE, str(root / "reader"))
            patch.chdir(root)
            with redirect_stdout(io.StringIO()) as printed:
                state.status = (cli.main(["status", state.location]), printed.getvalue())
            with redirect_stdout(io.StringIO()) as printed:
                state.export = (cli.main(["export", state.location, "--out", "best"]), printed.getvalue())
        import sqlalchemy

        engine = sqlalchemy.create_engine(database)
        with engine.connect() as connection:
            state.database_runs = {row[0]: row[1] for row in connection.execute(sqlalchemy.text(
                "SELECT run_uuid, status FROM runs WHERE lifecycle_stage = 'active'"))}
        engine.dispose()
        # The best trial's config retrained with its run kept in the bucket too, as on a cluster.
        (config,) = (root / "best").glob("*.yaml")
        state.retrain_location = join(bucket, "retrain")
        state.retrain = run_lapstudy(["train", config, "--storage", state.retrain_location, "--tracking-uri",
                                      server.url], env, timeout=300, cwd=root)
        state.retrain_runs = mlflow_runs(server.url, "lapstudy-train")
    return state


def test_exactly_the_requested_trials_each_once_to_the_end(stored):
    assert len(stored.results) == 2, stored.log
    assert sorted(rows[0]["config"]["lr"] for rows in stored.results.values()) == pytest.approx([FIRST, CUT])
    for trial, rows in stored.results.items():
        assert rows[-1]["epoch"] == EPOCHS and not rows[-1].get("diverged"), (trial, stored.log)


def test_the_resume_continued_from_storage(stored):
    first, cut = _with_lr(stored.at_kill, FIRST), _with_lr(stored.at_kill, CUT)
    assert stored.results[first] == stored.at_kill[first], "the finished trial ran again"
    after = [r for r in stored.results[cut] if r not in stored.at_kill[cut]]
    assert after and after[0]["resumed_from_epoch"] >= 2, after  # from its checkpoint in the bucket
    assert [r["epoch"] for r in after] == list(range(after[0]["resumed_from_epoch"] + 1, EPOCHS + 1))


def test_checkpoints_are_in_the_bucket(stored):
    keys = _keys(stored.location)
    for trial in stored.results:
        states = [k for k in keys if k.startswith(f"train/trial_{trial}/checkpoint_") and k.endswith("/state.pt")]
        assert len(states) == 2, (trial, states)  # the newest two, as Train keeps them


def test_one_mlflow_run_per_trial_in_postgresql_with_artifacts_in_the_bucket(stored):
    assert set(stored.runs) == set(stored.results)
    for trial, runs in stored.runs.items():
        (run,) = runs
        assert run["status"] == "FINISHED" and run["tags"]["mlflow.parentRunId"] == stored.study_run["run_id"]
        assert [step for step, _ in run["history"]["epoch"]] == list(range(1, EPOCHS + 1)), trial
        assert stored.database_runs[run["run_id"]] == "FINISHED"
        assert any(run["run_id"] in key and key.endswith("config.yaml") for key in stored.artifacts), trial
    assert set(stored.database_runs) == {r[0]["run_id"] for r in stored.runs.values()} | {stored.study_run["run_id"]}


def test_status_and_export_read_the_study_from_storage(stored):
    (code, printed) = stored.status
    assert code == 0 and f"({stored.location})" in printed and "2 of 2 trials" in printed, printed
    (code, printed) = stored.export
    exported = sorted((stored.root / "best").glob("*.yaml"))
    assert code == 0 and len(exported) == 1 and "lapstudy train" in exported[0].read_text(), printed


def test_an_exported_config_retrains_with_its_run_in_the_bucket(stored):
    """`lapstudy train --storage s3://...`: the run's config and checkpoints go to the bucket, its MLflow run to the
    server, and on CPU it repeats the trial's final metrics exactly."""
    printed = stored.retrain.stdout + stored.retrain.stderr
    assert stored.retrain.returncode == 0, printed
    keys = _keys(stored.retrain_location)
    (config,) = [k for k in keys if "/" not in k and k.endswith(".yaml")]
    name = config[:-len(".yaml")]
    assert len([k for k in keys if k.startswith(f"{name}/checkpoint_") and k.endswith("/state.pt")]) == 2, keys
    (runs,) = stored.retrain_runs.values()
    assert [run["status"] for run in runs] == ["FINISHED"]
    assert [step for step, _ in runs[0]["history"]["epoch"]] == list(range(1, EPOCHS + 1))
    assert "val_acc" in printed and "(identical)" in printed and "differs" not in printed, printed
