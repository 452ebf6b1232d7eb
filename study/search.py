"""Optuna samplers and Tune schedulers for a search space, and the replicates of every configuration.

The sampler proposes configurations; `ReplicatedSearch` runs each once per seed, as separate Tune trials that share
the configuration's id, and tells the sampler one value per configuration: the mean over its replicates. Optuna holds
one value per trial and objective, and TPE, CMA-ES and NSGA-II all model that value; the mean of N seeds has 1/sqrt(N)
of one run's seed noise, which is what replicates are for. Its Optuna study lives in a journal file in the study
folder (`optuna-dashboard optuna.journal` opens it).
"""

from __future__ import annotations

import copy
import logging
import math
import threading
import warnings
from pathlib import Path

import optuna
from optuna.storages import JournalStorage
from optuna.storages.journal import JournalFileBackend
from ray.tune.schedulers import ASHAScheduler, FIFOScheduler
from ray.tune.search import Searcher
from ray.tune.search.optuna import OptunaSearch

from study.errors import UserError
from study.geometry_stopper import geometry_stopper
from study.space import CONFIG_ID, REPLICATE, SEED, SearchSpace

# Optuna flags multivariate/grouped TPE as experimental; it is what conditional spaces need.
warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)
optuna.logging.set_verbosity(optuna.logging.WARNING)
# A resumed trial restarts Tune's training_iteration, which OptunaSearch uses as the step of intermediate values:
# Optuna then warns on every repeated step (the value the sampler keeps is the trial's final one).
warnings.filterwarnings("ignore", message="The reported value is ignored because this `step", category=UserWarning)
DEFAULT_STARTUP_TRIALS = 10
logger = logging.getLogger(__name__)


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
    return NSGAIISampler(seed=seed, population_size=spec.population_size or 50)


_LOCK = type(threading.Lock())


class NSGAIISampler(optuna.samplers.NSGAIISampler):
    """Optuna's NSGA-II sampler, picklable under every supported Optuna. Since Optuna 5.1 its base class
    (BaseGASampler) guards its cache of generations with a threading lock, which cannot be pickled, and Ray Tune
    pickles the searcher when the Tuner is built and into the study's state for `--resume`. A lock only orders the
    threads of one process, so the pickle leaves out every lock attribute and the copy gets fresh ones: what Optuna's
    own InMemoryStorage does with its lock. The attributes are found by type, not by their private names. The class
    keeps Optuna's name: a GA sampler's trial attributes are keyed by its class name (NSGAIISampler:generation)."""

    def __getstate__(self) -> dict:
        locks = [name for name, value in self.__dict__.items() if isinstance(value, _LOCK)]
        return {"attributes": {k: v for k, v in self.__dict__.items() if k not in locks}, "locks": locks}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state["attributes"])
        self.__dict__.update({name: threading.Lock() for name in state["locks"]})


class StudySearch(OptunaSearch):
    """OptunaSearch that tells the sampler a diverged trial (a non-finite objective) FAILED, and lets a resumed study
    finish a trial its restored state never saw. OptunaSearch would try to record NaN as a value, which Optuna
    refuses, and the trial would stay RUNNING in the sampler's history; and Tune copies the sampler's state and the
    trials' to the study folder as separate files, so a study stopped between two copies resumes trials that the
    sampler's older state does not know, whose completion OptunaSearch would answer with a KeyError that ends the
    study."""

    def on_trial_complete(self, trial_id: str, result: dict | None = None, error: bool = False):
        if trial_id not in self._ot_trials:
            logger.warning("trial %s: the sampler's saved state predates it, so the sampler goes on without its "
                           "result (Tune and MLflow keep it)", trial_id)
            return
        metrics = self.metric if isinstance(self.metric, list) else [self.metric]
        values = [(result or {}).get(m) for m in metrics]
        if result and any(isinstance(v, float) and not math.isfinite(v) for v in values):
            return super().on_trial_complete(trial_id, None, error=True)
        return super().on_trial_complete(trial_id, result, error)


JOURNAL_FILE = "optuna.journal"


class ReplicatedSearch(Searcher):
    """Runs every configuration the wrapped searcher proposes once per seed. A configuration's id is the Tune trial
    id of its first replicate (so with one seed, the wrapped searcher sees Tune's own ids); the wrapped searcher is
    told the replicates' mean once all of them have finished, and a failure if any of them failed."""

    def __init__(self, searcher: OptunaSearch, seeds: list[int]):
        super().__init__(metric=searcher.metric, mode=searcher.mode)
        self.searcher, self.seeds = searcher, list(seeds)
        self._queue: list[tuple[str, dict, int]] = []  # (configuration id, its values, replicate) still to hand out
        self._config_of: dict[str, str] = {}  # Tune trial id -> configuration id
        self._finished: dict[str, dict[str, dict | None]] = {}  # configuration id -> trial id -> result (None: failed)

    def set_search_properties(self, metric, mode, config, **spec) -> bool:
        return self.searcher.set_search_properties(metric, mode, config, **spec)

    def suggest(self, trial_id: str) -> dict | None:
        if self._queue:
            config_id, values, replicate = self._queue.pop(0)
        else:
            values = self.searcher.suggest(trial_id)
            if values is None or values == Searcher.FINISHED:
                return values
            config_id, replicate = trial_id, 0
            self._queue += [(trial_id, values, r) for r in range(1, len(self.seeds))]
        self._config_of[trial_id] = config_id
        return {**values, CONFIG_ID: config_id, REPLICATE: replicate, SEED: self.seeds[replicate]}

    def on_trial_complete(self, trial_id: str, result: dict | None = None, error: bool = False) -> None:
        config_id = self._config_of.get(trial_id)
        if config_id is None:
            return
        finished = self._finished.setdefault(config_id, {})
        finished[trial_id] = None if error else (result or {})
        if len(finished) < len(self.seeds):
            return
        if any(r is None for r in finished.values()):
            self.searcher.on_trial_complete(config_id, None, error=True)
            return
        metrics = self.metric if isinstance(self.metric, list) else [self.metric]
        mean = {m: _mean([r.get(m) for r in finished.values()]) for m in metrics}
        self.searcher.on_trial_complete(config_id, mean)

    # Tune saves a wrapper's own state through get_state/set_state, and the wrapped searcher with its own save.
    def get_state(self) -> dict:
        return copy.deepcopy({key: value for key, value in self.__dict__.items() if key != "searcher"})

    def set_state(self, state: dict) -> None:
        self.__dict__.update(state)


def _mean(values: list) -> float:
    numbers = [float(v) if isinstance(v, int | float) and not isinstance(v, bool) else math.nan for v in values]
    return sum(numbers) / len(numbers)  # NaN if any replicate has no finite value: the sampler sees a failure


def make_searcher(space: SearchSpace, seed: int, folder: Path) -> ReplicatedSearch:
    """The study's searcher: the space's sampler (its Optuna study kept in `folder`), each configuration replicated
    at the space's seeds."""
    multi = space.multi_objective
    optuna_search = StudySearch(
        space=DefineByRun(space),
        metric=space.metrics if multi else space.metrics[0],
        mode=space.modes if multi else space.modes[0],
        points_to_evaluate=space.warm_start_points() or None,
        sampler=make_sampler(space, seed),
        storage=JournalStorage(JournalFileBackend(str(folder / JOURNAL_FILE))),
        study_name=space.name,
    )
    return ReplicatedSearch(optuna_search, space.replicate_seeds(seed))


def make_scheduler(space: SearchSpace):
    if space.scheduler.kind == "none":
        return FIFOScheduler()
    if space.scheduler.kind == "geometry":
        return geometry_stopper(space)
    return ASHAScheduler(
        time_attr="epoch",  # reported explicitly: training_iteration restarts when a trial is restored
        metric=space.metrics[0],
        mode=space.modes[0],
        max_t=space.total_epochs,  # the trial runs its later stages too: ASHA must not stop it at their start
        grace_period=space.scheduler.grace_period,
        reduction_factor=space.scheduler.reduction_factor,
    )
