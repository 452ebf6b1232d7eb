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
        resumed.on_trial_complete(trial_id, {"val_acc": value})

    journal = JournalStorage(JournalFileBackend(str(tmp_path / JOURNAL_FILE)))  # as optuna-dashboard reads it
    study = optuna.load_study(study_name=space.name, storage=journal)
    complete = [t for t in study.trials if t.state == optuna.trial.TrialState.COMPLETE]
    assert [(t.params, t.value) for t in complete] == [({"lr": seen["lr"], "k": seen["k"]}, pytest.approx(0.3))]
