"""`early_stopping: geometry` (study/geometry_stopper.py), driven through Tune's scheduler API with synthetic reports,
beside Tune's own ASHA fed the same reports: the same decisions until enough trials finished, then the ranking of the
predicted final values, which must be ridge regression on standardised features, written out here in numpy."""

import pickle

import numpy as np
import pytest
from ray.tune.experiment import Trial
from ray.tune.schedulers import ASHAScheduler, TrialScheduler

from study.errors import UserError
from study.geometry_stopper import RIDGE_ALPHA, GeometryStopper
from study.search import make_scheduler
from study.space import parse_space

MAX_T, GRACE, FACTOR = 8, 2, 2  # rungs at epochs 2 and 4 (and 8 = max_t)
RUNG = 2
# Five trials that run to the end, each better at the rungs than the ones before (so ASHA never stops them), whose
# final accuracy is 0.95 - 0.2 * NC1 at epoch 2: the early accuracy does not tell the final, NC1 does.
FINISHED = [  # (val_acc at epoch 2, geom_nc1, geom_between_class_frac at epoch 2)
    (0.45, 0.4, 0.50), (0.50, 0.2, 0.60), (0.55, 0.6, 0.40), (0.60, 1.0, 0.30), (0.65, 0.8, 0.45)]


def final_of(nc1: float) -> float:
    return 0.95 - 0.2 * nc1


def stoppers(min_finished: int = 5):
    settings = dict(time_attr="epoch", metric="val_acc", mode="max", max_t=MAX_T, grace_period=GRACE,
                    reduction_factor=FACTOR)
    return GeometryStopper(**settings, min_finished=min_finished), ASHAScheduler(**settings)


def run_trial(schedulers, acc2: float, nc1: float, frac: float, *, geometry: bool = True) -> list[list[str]]:
    """One trial through every scheduler, epoch by epoch (geometry at the rung epochs, as the loop reports it) until
    one of them stops it or it reaches max_t; each epoch's decisions, one per scheduler."""
    trial = Trial("__fake", stub=True)
    for scheduler in schedulers:
        scheduler.on_trial_add(None, trial)
    decisions = []
    for epoch in range(1, MAX_T + 1):
        acc = acc2 + 0.05 * (epoch - RUNG) if epoch < MAX_T else final_of(nc1)
        result = {"epoch": epoch, "val_acc": acc}
        if geometry and epoch in (2, 4, MAX_T):
            result |= {"geom_nc1": nc1 - 0.01 * epoch, "geom_between_class_frac": frac}
        decisions.append([scheduler.on_trial_result(None, trial, result) for scheduler in schedulers])
        if TrialScheduler.STOP in decisions[-1]:
            break
    for scheduler in schedulers:
        scheduler.on_trial_complete(None, trial, result)
    return decisions


def ridge_predictions(train_x, train_y, x, alpha=RIDGE_ALPHA):
    """Ridge regression on features standardised by the training rows (population deviation), with an intercept:
    w = (Z'Z + alpha I)^-1 Z'(y - mean y), prediction mean y + z w."""
    train_x, x = np.asarray(train_x, float), np.asarray(x, float)
    mean, std = train_x.mean(0), train_x.std(0)
    z = (train_x - mean) / std
    w = np.linalg.solve(z.T @ z + alpha * np.eye(z.shape[1]), z.T @ (np.asarray(train_y) - np.mean(train_y)))
    return np.mean(train_y) + ((x - mean) / std) @ w


def test_decides_as_asha_until_enough_trials_finished():
    geometry, asha = stoppers(min_finished=5)
    for acc2, nc1, frac in FINISHED[:4]:
        assert all(d == [TrialScheduler.CONTINUE] * 2 for d in run_trial([geometry, asha], acc2, nc1, frac)[:-1])
    # Mediocre early, but its NC1 says it ends best: with 4 finished trials the rung still ranks by val_acc.
    decisions = run_trial([geometry, asha], 0.50, 0.1, 0.7)
    assert decisions[RUNG - 1] == [TrialScheduler.STOP, TrialScheduler.STOP]
    assert geometry.predictions(RUNG) is None


def test_keeps_the_trial_its_geometry_predicts_good_and_stops_the_one_it_predicts_poor():
    geometry, asha = stoppers(min_finished=5)
    for acc2, nc1, frac in FINISHED:
        decisions = run_trial([geometry, asha], acc2, nc1, frac)
        assert len(decisions) == MAX_T and decisions[-1] == [TrialScheduler.STOP] * 2  # ran to max_t
    promising = run_trial([geometry, asha], 0.50, 0.1, 0.7)  # below the rung's median val_acc, lowest NC1
    assert promising[RUNG - 1] == [TrialScheduler.CONTINUE, TrialScheduler.STOP]
    poor = run_trial([geometry, asha], 0.70, 1.2, 0.2)  # the best val_acc so far, the worst NC1
    assert poor[RUNG - 1] == [TrialScheduler.STOP, TrialScheduler.CONTINUE]


def test_the_prediction_is_ridge_on_standardised_features_of_the_finished_trials():
    geometry, _ = stoppers(min_finished=5)
    for acc2, nc1, frac in FINISHED:
        run_trial([geometry], acc2, nc1, frac)
    assert len(run_trial([geometry], 0.50, 0.1, 0.7)) == MAX_T  # kept: it finishes and is trained on too
    unfinished = run_trial([geometry], 0.70, 1.2, 0.2)
    assert len(unfinished) == RUNG  # stopped at the rung: predicted, not trained on
    finished = [*FINISHED, (0.50, 0.1, 0.7)]
    rung_features = [(acc2, nc1 - 0.01 * RUNG, frac) for acc2, nc1, frac in [*finished, (0.70, 1.2, 0.2)]]
    expected = ridge_predictions(rung_features[:6], [final_of(nc1) for _, nc1, _ in finished], rung_features)
    predicted = geometry.predictions(RUNG)
    assert list(predicted.values()) == pytest.approx(expected, abs=1e-12)
    # The rung ranks every trial it recorded by the same model (Tune's bracket holds mode-signed values).
    rung_values = dict(geometry._brackets[0]._rungs)[RUNG]
    assert list(rung_values.values()) == pytest.approx(expected, abs=1e-12)


def test_a_run_repeated_exactly_counts_once():
    geometry, asha = stoppers(min_finished=5)
    for acc2, nc1, frac in [*FINISHED[:4], FINISHED[3]]:  # five finished trials, four distinct runs
        run_trial([geometry, asha], acc2, nc1, frac)
    decisions = run_trial([geometry, asha], 0.50, 0.1, 0.7)
    assert decisions[RUNG - 1] == [TrialScheduler.STOP, TrialScheduler.STOP]
    assert geometry.predictions(RUNG) is None


def test_a_trial_without_geometry_is_ranked_as_asha_ranks_it():
    geometry, asha = stoppers(min_finished=5)
    for acc2, nc1, frac in FINISHED:
        run_trial([geometry, asha], acc2, nc1, frac)
    decisions = run_trial([geometry, asha], 0.50, 0.1, 0.7, geometry=False)
    assert decisions[RUNG - 1] == [TrialScheduler.STOP, TrialScheduler.STOP]
    assert geometry.predictions(RUNG) is None


def test_a_pickled_stopper_decides_as_the_original(tmp_path):
    geometry, _ = stoppers(min_finished=5)
    for acc2, nc1, frac in FINISHED:
        run_trial([geometry], acc2, nc1, frac)
    geometry.save(str(tmp_path / "scheduler.pkl"))  # what Tune does for --resume
    restored, _ = stoppers(min_finished=5)
    restored.restore(str(tmp_path / "scheduler.pkl"))
    copied = pickle.loads(pickle.dumps(geometry))
    outcomes = [run_trial([s], 0.50, 0.1, 0.7)[RUNG - 1] for s in (geometry, restored, copied)]
    assert outcomes == [[TrialScheduler.CONTINUE]] * 3


def space_with(early_stopping):
    return {"name": "s", "task": "classification", "dataset": {"source": "digits"}, "metric": "val_acc",
            "mode": "max", "epochs": 10, "early_stopping": early_stopping, "fixed": {"preset": "vit_tiny_digits"},
            "parameters": {"k": [0, 2]}}


def test_the_space_selects_it_with_asha_settings_and_measures_geometry_at_its_rungs():
    space = parse_space(space_with({"kind": "geometry", "grace_period": 2, "reduction_factor": 2, "min_finished": 3}))
    scheduler = make_scheduler(space)
    assert isinstance(scheduler, GeometryStopper) and scheduler.min_finished == 3
    assert [milestone for milestone, _ in scheduler._brackets[0]._rungs] == [8, 4, 2]
    assert space.judged_epochs() == (2, 4, 8)  # the loop measures the geometry where the stopper reads it
    assert make_scheduler(parse_space(space_with("geometry"))).min_finished == 5


@pytest.mark.parametrize("early_stopping, message", [
    ({"kind": "geometry", "min_finished": 1}, "min_finished"),
    ({"kind": "asha", "min_finished": 3}, "min_finished: only for kind geometry"),
    ({"kind": "geometric"}, "'asha', 'geometry' or 'none'"),
])
def test_bad_settings_name_the_field(early_stopping, message):
    with pytest.raises(UserError, match=message):
        parse_space(space_with(early_stopping))


def test_replicates_are_refused_as_with_asha():
    with pytest.raises(UserError, match="early_stopping: geometry judges each seed's trial alone"):
        parse_space({**space_with("geometry"), "replicates": 3})
