"""The study driver SIGKILLed mid-study, then `lapstudy run SPACE --resume`; a trial that diverges on the way; a
trial's own process SIGKILLed.

One study (three trials, one at a time, on the embedded default: local Ray, SQLite MLflow store in the study folder;
one worker per trial, so each trial trains in its own process):
1. a trial at learning rate 1e4: AdamW's decoupled weight decay at that rate multiplies the weights by about -500
   per step, the loss is NaN by the third step (a real configuration, no test knob);
2. a normal trial, during which the driver is SIGKILLed;
3. a normal trial that only exists after the resume, whose process is SIGKILLed mid-way (an OOM kill).
The assertions read Ray's own records (the study folder), the MLflow store and the searcher's saved state.
"""

from __future__ import annotations

import math
import os
import signal
import subprocess
import time
from types import SimpleNamespace

import pytest

from fault_fixtures import (
    LAPSTUDY,
    Lapstudy,
    Proc,
    epoch_steps,
    explain,
    free_port,
    live_results,
    private_ray_tmp,
    process_tree,
    run_lapstudy,
    settled,
    study_env,
    study_records,
    tiny_space,
    tree_digest,
    tune_results,
    wait_for,
    write_space,
)
from study_fixtures import searcher_study

pytestmark = pytest.mark.slow(seconds=130)

EPOCHS = 8  # long enough that the study folder shows epoch 2 of a trial well before its last
DIVERGING, KILLED, AFTER = 1.0e4, 1.0e-3, 2.0e-3
# A wider, deeper ViT than the other fault tests' (about 2 s an epoch): Tune's copy of its state into the study
# folder, which the kill waits for, can lag its staging folder by seconds, and the trial must still be mid-way then.
SPACE = tiny_space(name="crash", epochs=EPOCHS, num_samples=3, points_to_evaluate=[
    {"lr": DIVERGING, "k": 0}, {"lr": KILLED, "k": 0}, {"lr": AFTER, "k": 2}],
    fixed={**tiny_space()["fixed"], "dim": 128, "depth": 4})


def _trial_with_lr(results: dict, lr: float) -> str | None:
    for trial_id, rows in results.items():
        if math.isclose(rows[0]["config"]["lr"], lr):
            return trial_id
    return None


@pytest.fixture(scope="module")
def crash(tmp_path_factory):
    root = tmp_path_factory.mktemp("crash")
    space_path = write_space(root / "crash.yaml", SPACE)
    storage = root / "studies"
    study_dir = storage / "crash"
    args = ["run", space_path, "--storage", storage, "--max-concurrent", "1"]
    state = SimpleNamespace(root=root, space_path=space_path, storage=storage, study_dir=study_dir,
                            tracking_uri=f"sqlite:///{study_dir / 'mlflow.db'}")
    with private_ray_tmp() as ray_tmp:
        env = study_env(ray_tmp)
        state.env = env
        first = Lapstudy(args, env, root / "first.log")
        try:
            # A resume while the study still runs is refused.
            wait_for(lambda: list(study_dir.glob("experiment_state*.json")), 180, "Tune's first experiment state")
            state.resume_while_running = run_lapstudy([*args, "--resume"], env, timeout=180)

            def killed_trial_mid_way():
                # Mid-way in the study folder, not only in Tune's staging folder: Tune copies its state there every
                # few seconds, and a resume restores what it copied (a trial started in the seconds before a kill
                # would be unknown to it; docs/fault-tolerance.md).
                assert not first.finished(), "the study ended before the kill:\n" + first.log()
                results = tune_results(study_dir)
                trial = _trial_with_lr(results, KILLED)
                return trial if trial and max(r["epoch"] for r in results[trial]) >= 2 else None

            state.killed_trial = wait_for(killed_trial_mid_way, 300, "the second trial to report epoch 2")
            state.recorded = process_tree(first.pid)  # the driver and every Ray process it started
            state.seen_at_kill = max(r["epoch"] for r in live_results(ray_tmp, "crash")[state.killed_trial])
            os.kill(first.pid, signal.SIGKILL)
            first.process.wait(30)
        finally:
            first.close()
        # Ray's processes outlive their driver: most exit on their own within moments (a Train worker may still
        # finish an epoch, logged to MLflow, then checkpointed), some never do. What the killed study left is read
        # once that has settled; what never exits is the resume's to end.
        state.left_behind = settled(state.recorded[1:])
        print(f"\nRay processes still alive after the driver's SIGKILL had settled: {state.left_behind}")
        state.tune_at_kill, state.mlflow_at_kill = study_records(study_dir, "crash")
        state.trials_at_kill = {p.name: p.read_bytes() for p in (study_dir / "trials").iterdir()}

        started = time.monotonic()
        resumed = Lapstudy([*args, "--resume"], env, root / "resumed.log")
        try:
            def after_trial_mid_way():
                assert not resumed.finished(), "the study ended before the trial process was killed:\n" + resumed.log()
                results = live_results(ray_tmp, "crash")
                trial = _trial_with_lr(results, AFTER)
                return results[trial][-1] if trial and results[trial][-1]["epoch"] >= 2 else None

            row = wait_for(after_trial_mid_way, 300, "the trial after the resume to report epoch 2")
            state.crashed_trial, state.crash_seen = row["trial_id"], row["epoch"]
            state.killed_process = Proc.read(row["worker_pid"])
            assert state.killed_process is not None, f"the trial's process {row['worker_pid']} was gone already"
            os.kill(state.killed_process.pid, signal.SIGKILL)
            state.resume_code = resumed.wait(400)
            state.resume_log = resumed.log(20000)
        finally:
            resumed.close()
        state.resume_seconds = time.monotonic() - started
    assert state.resume_code == 0, state.resume_log
    state.tune, state.mlflow = study_records(study_dir, "crash")
    return state


def test_resume_finishes_exactly_the_requested_trials(crash):
    from study.folder import StudyFolder
    from study.results import load_records

    records = load_records(StudyFolder(crash.study_dir))
    assert len(records) == 3
    assert sorted(r.params["lr"] for r in records) == sorted([DIVERGING, KILLED, AFTER])
    statuses = {r.params["lr"]: r.status for r in records}
    assert statuses == {DIVERGING: "failed", KILLED: "completed", AFTER: "completed"}
    assert all(r.epochs_run == EPOCHS for r in records if r.status == "completed")


def test_trials_finished_before_the_kill_are_not_rerun(crash):
    finished = [t for t, rows in crash.tune_at_kill.items() if t != crash.killed_trial]
    assert finished, "a trial should have finished before the kill"
    for trial in finished:
        assert crash.tune[trial] == crash.tune_at_kill[trial], f"trial {trial} reported again after the resume"
        assert crash.mlflow[trial] == crash.mlflow_at_kill[trial], f"trial {trial}'s MLflow run changed"
        name = f"{trial}.yaml"
        assert (crash.study_dir / "trials" / name).read_bytes() == crash.trials_at_kill[name]


def test_interrupted_trial_resumes_from_its_checkpoint(crash):
    rows = crash.tune[crash.killed_trial]
    story = explain(rows, crash.resume_log)
    resumed = [r for r in rows if r["resumed_from_epoch"] > 0]
    assert resumed, "the interrupted trial did not resume from a checkpoint" + story
    checkpoint_epoch = resumed[0]["resumed_from_epoch"]
    assert resumed[0]["epoch"] == checkpoint_epoch + 1, "first epoch after the resume = checkpoint epoch + 1" + story
    assert [r["epoch"] for r in resumed] == list(range(checkpoint_epoch + 1, EPOCHS + 1)), story
    # The rank-0 worker logs an epoch to MLflow just before it reports that epoch's checkpoint: the checkpoint the
    # trial resumed from is the last epoch MLflow had when the killed study's processes were gone, or the one before
    # it; and at least what Tune had seen at the kill.
    (run,) = crash.mlflow_at_kill[crash.killed_trial]
    logged = max(epoch_steps(run))
    assert logged < EPOCHS, "the trial had finished before the kill: nothing was interrupted" + story
    assert logged - 1 <= checkpoint_epoch <= logged, f"MLflow had epochs 1-{logged}" + story
    assert checkpoint_epoch >= crash.seen_at_kill >= 2, f"Tune had seen epoch {crash.seen_at_kill}" + story
    # Tune keeps no log of a trial it restarts without a Tune checkpoint: its rows start at the resumed epoch (the
    # epochs before are in MLflow, below, and in the trial's checkpoints).
    assert rows == resumed, story


def test_trial_process_crash_restarts_the_trial_from_its_last_checkpoint(crash):
    """A one-worker trial trains in its own process (Ray Train's local mode): when that process dies, Tune retries
    the trial, which finds its checkpoints again under its fixed name and resumes from the last one."""
    rows = crash.tune[crash.crashed_trial]
    story = explain(rows, crash.resume_log)
    killed = crash.killed_process
    assert not killed.alive()
    after = [r for r in rows if r["worker_pid"] != killed.pid]
    assert after, "the trial never restarted" + story
    assert all(r["worker_pid"] == r["pid"] for r in rows), "the trial trained in a Train worker, not its own process"
    before = [r for r in rows if r["worker_pid"] == killed.pid]
    assert {r["resumed_from_epoch"] for r in before} == {0}, story
    checkpoint_epoch = after[0]["resumed_from_epoch"]
    assert crash.crash_seen <= checkpoint_epoch <= before[-1]["epoch"] + 1, \
        f"Tune had seen epoch {crash.crash_seen}" + story
    assert after[0]["epoch"] == checkpoint_epoch + 1, "first epoch after the restart = checkpoint epoch + 1" + story
    assert {r["resumed_from_epoch"] for r in after} == {checkpoint_epoch}, "one restart" + story
    # Tune keeps the rows of a trial it retried within the study: every epoch once, in order.
    assert [r["epoch"] for r in rows] == list(range(1, EPOCHS + 1)), story


def test_one_mlflow_run_per_trial_with_complete_histories(crash):
    assert set(crash.mlflow) == set(crash.tune), "every trial has a run and every run a trial"
    for trial, runs in crash.mlflow.items():
        assert len(runs) == 1, f"trial {trial} has {len(runs)} MLflow runs"
    killed = crash.mlflow[crash.killed_trial][0]
    assert killed["run_id"] == crash.mlflow_at_kill[crash.killed_trial][0]["run_id"], "resume made a new run"
    for trial, (run,) in crash.mlflow.items():
        if math.isclose(float(run["params"]["lr"]), DIVERGING):
            continue
        for key in ("epoch", "train_loss", "val_loss", "val_acc", "lr"):
            assert [s for s, _ in run["history"][key]] == list(range(1, EPOCHS + 1)), (trial, key, run["history"][key])
        assert run["status"] == "FINISHED" and run["tags"]["lapstudy.status"] == "completed"
        # The history the run shows is the one Ray recorded, epoch by epoch (for the resumed trial: from the resume).
        history = dict(run["history"]["val_acc"])
        for row in crash.tune[trial]:
            assert history[row["epoch"]] == pytest.approx(row["val_acc"]), (trial, row["epoch"])


def test_searcher_history_holds_every_completed_trial(crash):
    import optuna

    study, trials_by_tune_id = searcher_study(crash.study_dir)  # the state Tune restores from
    assert set(trials_by_tune_id) == set(crash.tune)
    complete = {t.number: t for t in study.get_trials(states=(optuna.trial.TrialState.COMPLETE,))}
    for tune_id, rows in crash.tune.items():
        final = rows[-1]
        ot_trial = study.trials[trials_by_tune_id[tune_id].number]
        if math.isclose(final["config"]["lr"], DIVERGING):
            assert ot_trial.state == optuna.trial.TrialState.FAIL, "a diverged trial is a failure to the sampler"
            continue
        assert ot_trial.number in complete, f"completed trial {tune_id} missing from the sampler's history"
        assert ot_trial.value == pytest.approx(final["val_acc"])
        assert ot_trial.params == {"lr": final["config"]["lr"], "k": final["config"]["k"]}
    assert len(complete) == 2


def test_diverged_trial_fails_at_once_with_its_reason(crash):
    trial = _trial_with_lr(crash.tune, DIVERGING)
    rows = crash.tune[trial]
    assert [r["epoch"] for r in rows] == [1], "a diverged trial stops after the epoch whose loss is not finite"
    assert not math.isfinite(rows[-1]["train_loss"])
    (run,) = crash.mlflow[trial]
    assert run["status"] == "FAILED"
    assert run["tags"]["lapstudy.status"] == "failed"
    assert "diverged" in run["tags"]["lapstudy.error"] and "nan" in run["tags"]["lapstudy.error"].lower()
    status = run_lapstudy(["status", crash.study_dir], crash.env, timeout=120)
    assert status.returncode == 0, status.stderr
    assert "failed" in status.stdout and "diverged" in status.stdout


def test_export_never_returns_the_diverged_trial(crash, tmp_path):
    diverged = _trial_with_lr(crash.tune, DIVERGING)
    out = tmp_path / "exported"
    done = run_lapstudy(["export", crash.study_dir, "--top", "3", "--out", out], crash.env, timeout=120)
    assert done.returncode == 0, done.stderr
    names = sorted(p.name for p in out.iterdir())
    assert len(names) == 2 and not any(diverged in name for name in names), names


def test_resume_ends_what_the_killed_driver_left_running(crash):
    """Some of a killed driver's Ray processes never exit on their own (Ray's agents, among others): `--resume` ends
    them, and says so; nothing of the old session is alive once the resumed study is done."""
    assert len(crash.recorded) > 5, "the driver's Ray processes were recorded before the kill"
    assert crash.left_behind, "nothing of the killed session was left running: this test would prove nothing"
    alive = [process for process in crash.recorded if process.alive()]
    assert not alive, f"left running after the resume: {alive}"
    said = [line for line in crash.resume_log.splitlines() if "the stopped study's Ray session left running" in line]
    assert len(said) == 1 and all(f"[{p.pid}]" in said[0] for p in crash.left_behind), (said, crash.left_behind)


def test_resume_of_a_running_study_is_refused(crash):
    refused = crash.resume_while_running
    lines = refused.stderr.strip().splitlines()
    assert refused.returncode == 2 and len(lines) == 1 and "still running" in lines[0], refused.stderr


def test_bad_resume_leaves_the_study_untouched(crash, tmp_path):
    """Resume mistakes are refused before anything is touched: wrong space, a different sample count, another
    tracking store, a flag that does not exist."""
    before = tree_digest(crash.study_dir)
    changed_space = write_space(tmp_path / "crash.yaml", {**SPACE, "epochs": EPOCHS + 1})
    base = ["run", crash.space_path, "--storage", crash.storage, "--resume"]
    cases = {
        "space": (["run", changed_space, "--storage", crash.storage, "--resume"], ["--resume", "differs"]),
        "num-samples": ([*base, "--num-samples", "5"], ["--num-samples", "3"]),
        "tracking": ([*base, "--tracking-uri", f"http://127.0.0.1:{free_port()}"], ["--tracking-uri"]),
        "flag": ([*base, "--resum"], ["unrecognized arguments", "--help"]),
    }
    started = {name: subprocess.Popen([str(LAPSTUDY), *map(str, argv)], env=crash.env, text=True,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE)
               for name, (argv, _) in cases.items()}
    for name, process in started.items():
        out, err = process.communicate(timeout=180)
        lines = err.strip().splitlines()
        assert process.returncode == 2 and len(lines) == 1, (name, process.returncode, err)
        assert all(text in lines[0] for text in cases[name][1]), (name, lines[0])
        assert "Traceback" not in err and out == ""
    assert tree_digest(crash.study_dir) == before
