"""Optuna samplers and Tune schedulers for a search space, and the replicates of every configuration.

The sampler proposes configurations; `ReplicatedSearch` runs each once per seed, as separate Tune trials that share
the configuration's id, and tells the sampler one Optuna trial per configuration: the mean over its replicates at
every epoch, and its state by the study's status rule (COMPLETE only when every replicate ran every epoch, PRUNED when
the scheduler stopped one, FAIL when one failed). Optuna holds one value per trial and objective, and TPE, CMA-ES and
NSGA-II all model that value; the mean of N seeds has 1/sqrt(N) of one run's seed noise, which is what replicates are
for. TPE ranks a pruned trial by its intermediate values below the complete ones, rather than taking a value an early
stop left as final. Its Optuna study lives in a journal file in the study folder (`optuna-dashboard optuna.journal`
opens it); each trial there carries its replicates' Tune trial ids and MLflow run ids as user attributes.
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

from study.bookkeeping import CONFIG_ID, REPLICATE, SEED
from study.errors import UserError
from study.geometry_stopper import geometry_stopper
from study.space import SearchSpace
from study.status import TrialStatus, configuration_status, trial_status

# Optuna flags multivariate/grouped TPE as experimental; it is what conditional spaces need.
warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)
optuna.logging.set_verbosity(optuna.logging.WARNING)
# A trial restored from a checkpoint older than its last report repeats epochs, the steps of its intermediate values:
# Optuna warns on every repeated step and keeps the first value.
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
        values: dict = {}
        for parameters in self.space.parameters_to_sample(values):
            for name, parameter in parameters.items():
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
    """OptunaSearch told, per configuration, what the study's status rule (study/status.py) says of its trials, by
    ReplicatedSearch: an intermediate value at every epoch (the epoch as the step), then COMPLETE with the value only
    for a configuration that ran every epoch, PRUNED for one the scheduler stopped (its last intermediate value is
    its value), FAIL for an error or a non-finite objective. Tune itself tells a searcher nothing of why a trial
    ended: the scheduler's stop and a trial's last epoch both reach `on_trial_complete` with the last result, which
    OptunaSearch records as COMPLETE whatever its epoch (and its intermediate values take Tune's training_iteration
    as the step, which restarts when a trial is restored). A resumed study may finish a trial its restored state
    never saw: Tune copies the sampler's state and the trials' to the study folder as separate files, so a study
    stopped between two copies resumes trials the sampler's older state does not know; they are left out of the
    Optuna study (Tune and MLflow keep them)."""

    def report(self, config_id: str, value: float, epoch: int) -> None:
        trial = self._ot_trials.get(config_id)
        if trial is not None:
            trial.report(value, epoch)

    def set_user_attr(self, config_id: str, key: str, value) -> None:
        trial = self._ot_trials.get(config_id)
        if trial is not None:
            trial.set_user_attr(key, value)

    def tell(self, config_id: str, state: optuna.trial.TrialState, values: list[float] | None = None) -> None:
        trial = self._ot_trials.get(config_id)
        if trial is None:
            logger.warning("trial %s: the sampler's saved state predates it, so the sampler goes on without its "
                           "result (Tune and MLflow keep it)", config_id)
            return
        if state is optuna.trial.TrialState.COMPLETE and not all(math.isfinite(v) for v in values):
            state, values = optuna.trial.TrialState.FAIL, None  # Optuna refuses NaN: the trial would stay RUNNING
        try:
            self._ot_study.tell(trial, values if state is optuna.trial.TrialState.COMPLETE else None, state=state)
        except RuntimeError as exc:
            # The grid sampler calls study.stop() once its grid is used up, which Optuna allows only inside
            # study.optimize; the trial's state is stored first. Tune's num_samples ends the study instead.
            if "Study.stop" not in str(exc):
                raise
        self._completed_trials.add(config_id)


JOURNAL_FILE = "optuna.journal"
# The user attributes of each Optuna trial (a configuration): its replicates' Tune trial ids and MLflow run ids, in
# the order of its seeds.
TUNE_TRIAL_IDS, MLFLOW_RUN_IDS, SEEDS = "tune_trial_ids", "mlflow_run_ids", "seeds"


class ReplicatedSearch(Searcher):
    """Runs every configuration the wrapped searcher proposes once per seed, and tells the wrapped searcher what the
    replicates together show. A configuration's id is the Tune trial id of its first replicate (so with one seed,
    the wrapped searcher sees Tune's own ids). Its intermediate value at an epoch is the mean over its replicates
    once all of them have reported that epoch; when all have finished, its state is study/status.py's
    configuration_status of theirs: FAIL if one failed, PRUNED if one was stopped before the last epoch (its means
    stop at the last epoch they all reached), else COMPLETE with the mean of their final values. No mean mixes runs
    of different lengths."""

    def __init__(self, searcher: StudySearch, seeds: list[int], epochs: int):
        super().__init__(metric=searcher.metric, mode=searcher.mode)
        self.searcher, self.seeds, self.epochs = searcher, list(seeds), epochs
        self._queue: list[tuple[str, dict, int]] = []  # (configuration id, its values, replicate) still to hand out
        self._config_of: dict[str, str] = {}  # Tune trial id -> configuration id
        self._replicate_of: dict[str, int] = {}  # Tune trial id -> replicate
        self._attrs: dict[str, dict[str, list]] = {}  # configuration id -> user attribute -> one entry per replicate
        self._values: dict[str, dict[int, dict[str, float]]] = {}  # config id -> epoch -> trial id -> objective
        self._reported: dict[str, list[int]] = {}  # configuration id -> the epochs told to the wrapped searcher
        self._finished: dict[str, dict[str, tuple[TrialStatus, dict]]] = {}  # config id -> trial id -> how it ended

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
            self.searcher.set_user_attr(config_id, SEEDS, self.seeds)
        self._config_of[trial_id], self._replicate_of[trial_id] = config_id, replicate
        self._set_attr(trial_id, TUNE_TRIAL_IDS, trial_id)
        return {**values, CONFIG_ID: config_id, REPLICATE: replicate, SEED: self.seeds[replicate]}

    def on_trial_result(self, trial_id: str, result: dict) -> None:
        if trial_id in self._config_of:
            self._record(trial_id, result)

    def on_trial_complete(self, trial_id: str, result: dict | None = None, error: bool = False) -> None:
        # Tune calls this without on_trial_result for the result that ends a trial (the scheduler's stop, or the
        # last epoch, where ASHA's max_t stops it too).
        config_id = self._config_of.get(trial_id)
        if config_id is None:
            return
        result = result or {}
        if not error:
            self._record(trial_id, result)
        status = TrialStatus.FAILED if error else trial_status("TERMINATED", result, self.epochs, finished=True)[0]
        finished = self._finished.setdefault(config_id, {})
        finished[trial_id] = (status, result)
        if len(finished) < len(self.seeds):
            return
        state = optuna.trial.TrialState[configuration_status(s for s, _ in finished.values()).optuna_state]
        metrics = self.metric if isinstance(self.metric, list) else [self.metric]
        self.searcher.tell(config_id, state, [_mean([r.get(m) for _, r in finished.values()]) for m in metrics]
                           if state is optuna.trial.TrialState.COMPLETE else None)

    def _record(self, trial_id: str, result: dict) -> None:
        """A replicate's result: its MLflow run id, and its objective at its epoch, told as the configuration's
        intermediate value at each epoch every replicate has now reported."""
        config_id = self._config_of[trial_id]
        if result.get("mlflow_run_id"):
            self._set_attr(trial_id, MLFLOW_RUN_IDS, result["mlflow_run_id"])
        if isinstance(self.metric, list):  # Optuna keeps no intermediate values of several objectives
            return
        value, epoch = _number(result.get(self.metric)), result.get("epoch")
        if not isinstance(epoch, int) or not math.isfinite(value):  # the metric of a later stage, or diverged
            return
        by_epoch = self._values.setdefault(config_id, {})
        by_epoch.setdefault(epoch, {})[trial_id] = value
        reported = self._reported.setdefault(config_id, [])
        for step, values in sorted(by_epoch.items()):
            if step not in reported and len(values) == len(self.seeds):
                self.searcher.report(config_id, _mean(list(values.values())), step)
                reported.append(step)

    def _set_attr(self, trial_id: str, key: str, value) -> None:
        config_id = self._config_of[trial_id]
        entries = self._attrs.setdefault(config_id, {}).setdefault(key, [None] * len(self.seeds))
        if entries[self._replicate_of[trial_id]] != value:
            entries[self._replicate_of[trial_id]] = value
            self.searcher.set_user_attr(config_id, key, entries)

    # Tune saves a wrapper's own state through get_state/set_state, and the wrapped searcher with its own save.
    def get_state(self) -> dict:
        return copy.deepcopy({key: value for key, value in self.__dict__.items() if key != "searcher"})

    def set_state(self, state: dict) -> None:
        self.__dict__.update(state)


def _number(value) -> float:
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else math.nan


def _mean(values: list) -> float:
    numbers = [_number(v) for v in values]
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
    return ReplicatedSearch(optuna_search, space.replicate_seeds(seed), space.total_epochs)


def make_scheduler(space: SearchSpace):
    """Tune's trial scheduler (what Tune calls the object that stops trials) for the space's `early_stopping:`."""
    if space.early_stopping.kind == "none":
        return FIFOScheduler()
    if space.early_stopping.kind == "geometry":
        return geometry_stopper(space)
    return ASHAScheduler(
        time_attr="epoch",  # reported explicitly: training_iteration restarts when a trial is restored
        metric=space.metrics[0],
        mode=space.modes[0],
        max_t=space.total_epochs,  # the trial runs its later stages too: ASHA must not stop it at their start
        grace_period=space.early_stopping.grace_period,
        reduction_factor=space.early_stopping.reduction_factor,
    )
