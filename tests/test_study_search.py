"""The study's searcher across a resume: Tune restores the sampler's state and the trials from separate files, so a
resumed study can finish a trial that the sampler's restored state never saw; the study goes on, and the trials the
sampler did see are still recorded in its Optuna study."""

import optuna
import pytest
from optuna.storages import JournalStorage
from optuna.storages.journal import JournalFileBackend

from fault_fixtures import tiny_space
from study.search import JOURNAL_FILE, make_searcher
from study.space import parse_space


def test_a_trial_the_restored_sampler_never_saw_completes_and_the_others_still_count(tmp_path):
    space = parse_space(tiny_space(replicates=2, points_to_evaluate=[]))
    searcher = make_searcher(space, seed=0, folder=tmp_path)
    searcher.set_search_properties(None, None, {})
    seen = searcher.suggest("seen")
    searcher.suggest("seen_replicate")
    sampler_state = tmp_path / "sampler.pkl"
    searcher.searcher.save(str(sampler_state))  # the sampler's state as Tune last copied it
    searcher.suggest("unseen")
    searcher.suggest("unseen_replicate")
    wrapper_state = searcher.get_state()  # the wrapper's own state, copied after the two trials above began

    resumed = make_searcher(space, seed=0, folder=tmp_path)
    resumed.set_search_properties(None, None, {})
    resumed.set_state(wrapper_state)
    resumed.searcher.restore(str(sampler_state))
    for trial_id, value in (("unseen", 0.5), ("unseen_replicate", 0.7), ("seen", 0.2), ("seen_replicate", 0.4)):
        resumed.on_trial_complete(trial_id, {"val_acc": value, "epoch": space.total_epochs})

    journal = JournalStorage(JournalFileBackend(str(tmp_path / JOURNAL_FILE)))  # as optuna-dashboard reads it
    study = optuna.load_study(study_name=space.name, storage=journal)
    complete = [t for t in study.trials if t.state == optuna.trial.TrialState.COMPLETE]
    assert [(t.params, t.value) for t in complete] == [({"lr": seen["lr"], "k": seen["k"]}, pytest.approx(0.3))]


def _journal_trials(folder, space) -> list:
    """The study's Optuna trials as optuna-dashboard reads them: from the journal, with Optuna's own API."""
    journal = JournalStorage(JournalFileBackend(str(folder / JOURNAL_FILE)))
    return optuna.load_study(study_name=space.name, storage=journal).trials


def test_a_configuration_with_a_stopped_replicate_is_pruned_and_no_mean_mixes_run_lengths(tmp_path):
    """Driven as Tune drives the searcher: `on_trial_result` for every epoch but the one that ends a trial, which
    comes with `on_trial_complete` only (ASHA's stop, or its max_t at the last epoch). Values are exact in binary,
    so each mean is checked against the arithmetic written out."""
    space = parse_space(tiny_space(replicates=2, points_to_evaluate=[]))
    epochs = space.total_epochs
    assert epochs == 4
    searcher = make_searcher(space, seed=0, folder=tmp_path)
    searcher.set_search_properties(None, None, {})
    curves = {"stopped_0": [0.25, 0.5, 0.625, 0.75], "stopped_1": [0.125, 0.375],  # ASHA stops replicate 1 at 2
              "full_0": [0.5, 0.625, 0.75, 0.875], "full_1": [0.25, 0.5, 0.5, 0.625],
              "failed_0": [0.5, 0.75, 0.75, 0.75], "failed_1": [0.5]}  # replicate 1 fails in its second epoch
    for config in ("stopped", "full", "failed"):
        for replicate in (0, 1):
            trial_id = f"{config}_{replicate}"
            assert searcher.suggest(trial_id)["config_id"] == f"{config}_0"
            *before, last = [{"val_acc": v, "epoch": e, "mlflow_run_id": f"run-{trial_id}"}
                             for e, v in enumerate(curves[trial_id], start=1)]
            for result in before:
                searcher.on_trial_result(trial_id, result)
            if config == "failed" and replicate == 1:
                searcher.on_trial_result(trial_id, last)
                searcher.on_trial_complete(trial_id, error=True)
            else:
                searcher.on_trial_complete(trial_id, last)

    stopped, full, failed = _journal_trials(tmp_path, space)
    TrialState = optuna.trial.TrialState
    assert stopped.state is TrialState.PRUNED
    # the mean at each epoch both replicates reached, and nothing after: replicate 0's epochs 3 and 4 have no partner
    assert stopped.intermediate_values == {1: (0.25 + 0.125) / 2, 2: (0.5 + 0.375) / 2}
    assert stopped.value == (0.5 + 0.375) / 2  # Optuna's value of a pruned trial: its last intermediate value
    assert full.state is TrialState.COMPLETE
    assert full.intermediate_values == {1: (0.5 + 0.25) / 2, 2: (0.625 + 0.5) / 2, 3: (0.75 + 0.5) / 2,
                                        4: (0.875 + 0.625) / 2}
    assert full.value == (0.875 + 0.625) / 2
    assert failed.state is TrialState.FAIL and failed.value is None
    assert failed.intermediate_values == {1: (0.5 + 0.5) / 2}
    for trial, config in zip((stopped, full, failed), ("stopped", "full", "failed")):
        assert trial.user_attrs == {"tune_trial_ids": [f"{config}_0", f"{config}_1"],
                                    "mlflow_run_ids": [f"run-{config}_0", f"run-{config}_1"],
                                    "seeds": space.replicate_seeds(0)}


def test_the_grid_sampler_finishing_its_grid_does_not_end_the_study(tmp_path):
    """Optuna's GridSampler calls study.stop() when its last point is told, which Optuna refuses outside
    study.optimize; every configuration is still told, as COMPLETE."""
    space = parse_space(tiny_space(sampler={"kind": "grid"}, points_to_evaluate=[],
                                   parameters={"k": {"type": "categorical", "choices": [0, 2]}}, fixed={
                                       **tiny_space()["fixed"], "lr": 1.0e-3}))
    searcher = make_searcher(space, seed=0, folder=tmp_path)
    searcher.set_search_properties(None, None, {})
    for trial_id in ("first", "second"):
        config = searcher.suggest(trial_id)
        searcher.on_trial_complete(trial_id, {"val_acc": 0.25 * (1 + config["k"]), "epoch": space.total_epochs})
    trials = _journal_trials(tmp_path, space)
    assert [t.state for t in trials] == [optuna.trial.TrialState.COMPLETE] * 2
    assert sorted((t.params["k"], t.value) for t in trials) == [(0, 0.25), (2, 0.75)]
