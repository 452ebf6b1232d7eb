"""Optuna samplers and Tune schedulers for a search space."""

from __future__ import annotations

import math
import warnings

import optuna
from ray.tune.schedulers import ASHAScheduler, FIFOScheduler
from ray.tune.search.optuna import OptunaSearch

from study.errors import UserError
from study.space import SearchSpace

# Optuna flags multivariate/grouped TPE as experimental; it is what conditional spaces need.
warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)
optuna.logging.set_verbosity(optuna.logging.WARNING)
# A resumed trial restarts Tune's training_iteration, which OptunaSearch uses as the step of intermediate values:
# Optuna then warns on every repeated step (the value the sampler keeps is the trial's final one).
warnings.filterwarnings("ignore", message="The reported value is ignored because this `step", category=UserWarning)
DEFAULT_STARTUP_TRIALS = 10


class DefineByRun:
    """Optuna define-by-run function of a space: top-level parameters first, then each conditional group whose
    condition holds on what was sampled so far (so STLT parameters are only sampled for STLT trials).
    A class, not a closure, so that Tune can pickle the searcher into the study's state for `--resume`."""

    def __init__(self, space: SearchSpace):
        self.space = space

    def __call__(self, trial) -> None:
        values = dict(self.space.fixed)
        for name, parameter in self.space.parameters.items():
            values[name] = parameter.suggest(trial, name)
        for group in self.space.conditional:
            if group.active(values):
                values.update(group.fixed)
                for name, parameter in group.parameters.items():
                    values[name] = parameter.suggest(trial, name)


def make_sampler(space: SearchSpace, seed: int) -> optuna.samplers.BaseSampler:
    spec = space.sampler
    seed = spec.seed if spec.seed is not None else seed
    startup = spec.n_startup_trials if spec.n_startup_trials is not None else DEFAULT_STARTUP_TRIALS
    if spec.kind == "tpe":
        return optuna.samplers.TPESampler(
            seed=seed, n_startup_trials=startup, multivariate=True, group=bool(space.conditional), constant_liar=True
        )
    if spec.kind == "random":
        return optuna.samplers.RandomSampler(seed=seed)
    if spec.kind == "grid":
        return optuna.samplers.GridSampler(space.grid(), seed=seed)
    if spec.kind == "cmaes":
        try:
            import cmaes  # noqa: F401 - optuna's CMA-ES sampler needs it
        except ImportError:
            raise UserError("sampler: cmaes needs the `cmaes` package (pip install cmaes), or use tpe") from None
        return optuna.samplers.CmaEsSampler(seed=seed, n_startup_trials=startup)
    return optuna.samplers.NSGAIISampler(seed=seed, population_size=spec.population_size or 50)


class StudySearch(OptunaSearch):
    """OptunaSearch that tells the sampler a diverged trial (a non-finite objective) FAILED. OptunaSearch would try
    to record NaN as a value, which Optuna refuses, and the trial would stay RUNNING in the sampler's history."""

    def on_trial_complete(self, trial_id: str, result: dict | None = None, error: bool = False):
        metrics = self.metric if isinstance(self.metric, list) else [self.metric]
        values = [(result or {}).get(m) for m in metrics]
        if result and any(isinstance(v, float) and not math.isfinite(v) for v in values):
            return super().on_trial_complete(trial_id, None, error=True)
        return super().on_trial_complete(trial_id, result, error)


def make_searcher(space: SearchSpace, seed: int) -> OptunaSearch:
    multi = space.multi_objective
    return StudySearch(
        space=DefineByRun(space),
        metric=space.metrics if multi else space.metrics[0],
        mode=space.modes if multi else space.modes[0],
        points_to_evaluate=[dict(p) for p in space.points_to_evaluate] or None,
        sampler=make_sampler(space, seed),
    )


def make_scheduler(space: SearchSpace):
    if space.scheduler.kind == "none":
        return FIFOScheduler()
    return ASHAScheduler(
        time_attr="epoch",  # reported explicitly: training_iteration restarts when a trial is restored
        metric=space.metrics[0],
        mode=space.modes[0],
        max_t=space.epochs,
        grace_period=space.scheduler.grace_period,
        reduction_factor=space.scheduler.reduction_factor,
    )
