"""`early_stopping: geometry`: ASHA that judges a trial at each rung by a prediction of its final objective.

Ray Tune's ASHA (AsyncHyperBandScheduler) keeps, at each rung, the value every trial had when it reached it, and
stops a trial whose value is below the rung's 1 - 1/reduction_factor quantile. This scheduler is that scheduler,
rungs and cut-off included; only the value it ranks by changes. At a rung it predicts each trial's final objective
from what the trial reported there (the objective and the last layer's token geometry, docs/geometry.md: the
study's loop measures the geometry at every rung) with a ridge regression on standardised features, fitted on the
trials that already ran to the end (their features at that rung against their final objective). Every trial the
rung has recorded is re-ranked by the current model, so the cut-off compares predictions with predictions. Until
`min_finished` distinct runs have finished with features at a rung (a run repeated exactly counts once), that rung
ranks by the objective itself: ASHA's rule.
A trial that lacks a feature at a rung (a task that reports no such geometry) is ranked by its objective there, and
that rung falls back to ASHA's rule for every trial, so that raw values and predictions are never compared.

The model is refitted from the recorded features at every decision (a handful of trials, a few features: cheap), so
the scheduler's state is plain data and pickles with it (Tune saves the scheduler for `--resume`).
"""

from __future__ import annotations

import math

import numpy as np
from ray.tune.schedulers import AsyncHyperBandScheduler, TrialScheduler
from sklearn.linear_model import Ridge
from sklearn.pipeline import make_pipeline
from sklearn.preprocessing import StandardScaler

# The geometry a rung's prediction reads, where the task reports it: classification's NC1 and between-class share,
# a language model's over its next-token targets (docs/geometry.md).
GEOMETRY_FEATURES = ("geom_nc1", "geom_between_class_frac", "geom_target_nc1", "geom_between_target_frac")
RIDGE_ALPHA = 1.0  # on standardised features: shrinks toward the mean final value when few trials have finished


class GeometryStopper(AsyncHyperBandScheduler):
    def __init__(self, *, time_attr: str, metric: str, mode: str, max_t: int, grace_period: int,
                 reduction_factor: float, min_finished: int, features: tuple[str, ...] = GEOMETRY_FEATURES,
                 alpha: float = RIDGE_ALPHA):
        super().__init__(time_attr=time_attr, metric=metric, mode=mode, max_t=max_t, grace_period=grace_period,
                         reduction_factor=reduction_factor, brackets=1)
        self.min_finished, self.features, self.alpha = min_finished, tuple(features), alpha
        self._bracket = self._brackets[0]
        self._at_rung: dict[float, dict[str, tuple | None]] = {  # milestone -> trial id -> its features
            milestone: {} for milestone, _ in self._bracket._rungs}
        self._final: dict[str, float] = {}  # trial id -> its objective at max_t

    def on_trial_result(self, tune_controller, trial, result: dict) -> str:
        if self._time_attr not in result or self._metric not in result:
            return TrialScheduler.CONTINUE
        now = result[self._time_attr]
        if now >= self._max_t:
            self._final[trial.trial_id] = float(result[self._metric])
            return super().on_trial_result(tune_controller, trial, result)
        rung = self._rung_reached(trial.trial_id, now)
        if rung is None:
            return super().on_trial_result(tune_controller, trial, result)
        self._at_rung[rung][trial.trial_id] = self._feature_vector(result)
        predicted = self.predictions(rung)
        if predicted is None:
            return super().on_trial_result(tune_controller, trial, result)
        recorded = dict(self._bracket._rungs)[rung]
        recorded.update({tid: self._metric_op * value for tid, value in predicted.items()
                         if tid in recorded})  # the trials judged here before: ranked by the same model
        return super().on_trial_result(tune_controller, trial, {**result, self._metric: predicted[trial.trial_id]})

    def on_trial_complete(self, tune_controller, trial, result: dict):
        if result and self._time_attr in result and self._metric in result:
            if result[self._time_attr] >= self._max_t:
                self._final[trial.trial_id] = float(result[self._metric])
            rung = self._rung_reached(trial.trial_id, result[self._time_attr])
            if rung is not None:  # a rung's result that reached the scheduler only now: ASHA records it raw
                self._at_rung[rung][trial.trial_id] = self._feature_vector(result)
        super().on_trial_complete(tune_controller, trial, result)

    def _rung_reached(self, trial_id: str, now: float) -> float | None:
        """The rung this result is judged at (the one `_Bracket.on_result` would record it in), if any."""
        for milestone, recorded in self._bracket._rungs:  # highest first, walked as the bracket walks them
            if now >= milestone and trial_id not in recorded:
                return milestone
        return None

    def _feature_vector(self, result: dict) -> tuple[tuple[str, ...], list[float]] | None:
        """The objective and the geometry features the result holds (their names, their values); None if one is
        not a finite number."""
        names = (self._metric, *(name for name in self.features if name in result))
        values = [result[name] for name in names]
        if not all(isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v) for v in values):
            return None
        return names, [float(v) for v in values]

    def predictions(self, rung: float) -> dict[str, float] | None:
        """Each trial recorded at `rung` -> its predicted final objective; None while the rung uses ASHA's rule
        (fewer than `min_finished` distinct finished runs with features there, or features that differ between
        trials)."""
        seen = self._at_rung[rung]
        if any(v is None for v in seen.values()) or len({names for names, _ in seen.values()}) != 1:
            return None
        # A configuration run again at the same seed repeats its run exactly (a sampler re-proposing its best does
        # that): one observation, however often it ran.
        trained = list({(*seen[tid][1], self._final[tid]) for tid in seen if tid in self._final})
        if len(trained) < self.min_finished:
            return None
        model = make_pipeline(StandardScaler(), Ridge(alpha=self.alpha))
        model.fit(np.array([row[:-1] for row in trained]), np.array([row[-1] for row in trained]))
        ids = list(seen)
        return dict(zip(ids, model.predict(np.array([seen[tid][1] for tid in ids])).tolist()))

    def debug_string(self) -> str:
        return super().debug_string().replace("AsyncHyperBand", "GeometryStopper (ASHA on predicted finals)", 1)


DEFAULT_MIN_FINISHED = 5


def geometry_stopper(space) -> GeometryStopper:
    """The stopper of a space whose `early_stopping.kind` is geometry (study/space.py), on ASHA's settings of
    study/search.py's make_scheduler."""
    settings = space.early_stopping
    return GeometryStopper(
        time_attr="epoch", metric=space.metrics[0], mode=space.modes[0], max_t=space.total_epochs,
        grace_period=settings.grace_period, reduction_factor=settings.reduction_factor,
        min_finished=settings.min_finished if settings.min_finished is not None else DEFAULT_MIN_FINISHED)
