"""A trial of two stages (train, then fine-tune from the trained weights at a lower learning rate), its study driver
killed during the second stage and resumed: the second stage resumes where it was, the first is not trained again,
the stages' metrics go to the one MLflow run of the trial under their names, and the second stage started from the
weights the first carried forward."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from fault_fixtures import (
    kill_study_when,
    mlflow_runs,
    private_ray_tmp,
    resume_study,
    study_env,
    tiny_space,
    tune_results,
    write_space,
)

pytestmark = pytest.mark.slow(seconds=90)

FIRST, SECOND = 3, 6
# A wider, deeper ViT than the other fault tests' (about 2 s an epoch): the kill waits for Tune's copy of its records
# into the study folder, which can lag its staging folder by seconds, and the second stage must still be going then.
SPACE = tiny_space(
    name="staged", epochs=FIRST, num_samples=1, metric="finetune/val_acc", mode="max",
    points_to_evaluate=[{"lr": 5.0e-3, "k": 0}], fixed={**tiny_space()["fixed"], "dim": 128, "depth": 4},
    stages=[{"name": "finetune", "task": "classification", "epochs": SECOND,
             "hyperparameters": {"lr": 1.0e-4, "warmup_epochs": 0}}],
)


@pytest.fixture(scope="module")
def staged(tmp_path_factory):
    root = tmp_path_factory.mktemp("staged")
    write_space(root / "staged.yaml", SPACE)
    args = ["run", "staged.yaml", "--storage", "studies"]
    state = SimpleNamespace(root=root, dir=root / "studies" / "staged")
    with private_ray_tmp("lsg") as ray_tmp:
        env = study_env(ray_tmp)
        def in_the_second_stage():  # as a resume will see it: in the study folder
            return any(r["epoch"] > FIRST for rows in tune_results(state.dir).values() for r in rows)
        kill_study_when(args, env, root, in_the_second_stage, "the second stage's first epoch")
        state.at_kill = tune_results(state.dir)
        resume_study(args, env, root)
    [(state.trial, state.rows)] = tune_results(state.dir).items()
    (state.run,) = mlflow_runs(f"sqlite:///{state.dir / 'mlflow.db'}", "staged")[state.trial]
    return state


def test_the_trial_ran_both_stages_to_the_end(staged):
    final = staged.rows[-1]
    assert final["epoch"] == FIRST + SECOND and final["stage"] == "finetune"
    assert "finetune/val_acc" in final and "val_acc" in final  # the first stage's result is reported along
    assert staged.run["tags"]["lapstudy.status"] == "completed"
    assert sorted(p.name for p in (staged.dir / "train").iterdir()) == [f"trial_{staged.trial}",
                                                                        f"trial_{staged.trial}_finetune"]


def test_the_second_stage_resumed_where_it_was_and_the_first_was_not_trained_again(staged):
    before = staged.at_kill[staged.trial]
    after_the_resume = [r for r in staged.rows if r not in before]
    # the first stage, restarted, found its last checkpoint and only handed its final result back
    assert all(r["resumed_from_epoch"] == FIRST for r in after_the_resume if r["epoch"] <= FIRST), after_the_resume
    resumed = [r for r in staged.rows if r["epoch"] > FIRST and r["resumed_from_epoch"] > 0]
    assert resumed, "the second stage did not resume from its own checkpoint"
    assert resumed[0]["epoch"] == FIRST + resumed[0]["resumed_from_epoch"] + 1


def test_each_epoch_once_in_mlflow_under_the_stages_names(staged):
    history = staged.run["history"]
    assert [step for step, _ in history["val_acc"]] == list(range(1, FIRST + 1))
    assert [step for step, _ in history["finetune/val_acc"]] == list(range(FIRST + 1, FIRST + SECOND + 1))
    assert [step for step, _ in history["epoch"]] == list(range(1, FIRST + SECOND + 1))


def test_the_second_stage_started_from_the_first_stages_weights(staged):
    """At a learning rate of 1e-4 one epoch from scratch stays near chance (0.1 on ten digits); from the first
    stage's weights the second stage starts where the first ended."""
    history = dict(staged.run["history"]["val_acc"])
    tuned = dict(staged.run["history"]["finetune/val_acc"])
    assert history[FIRST] > 0.25  # well clear of chance, so a fresh start would show
    assert tuned[FIRST + 1] >= history[FIRST] - 0.05
