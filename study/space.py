"""Search spaces: the YAML schema (pydantic), its checks, and how a trial's sampled values become a `RunSpec`.

A space names the task and data, the metric(s) and mode(s), the sampler and early stopping, fixed hyperparameters,
searched parameters (categorical, int, float, log-float) and conditional groups whose parameters exist only when an
earlier parameter takes certain values (sampled define-by-run with Optuna). See docs/study.md for the format.
The parameter types and conditional groups are in study/space_parameters.py; the checks that build the configs of
the space's extreme points before a study starts are in study/space_corners.py.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from models.keys import renamed_key_problem
from study.data import DatasetConfig
from study.errors import UserError, validate
from study.evals.spec import Evaluations, check_evaluation
from study.runspec import (
    HYPERPARAMETER_KEYS,
    Resources,
    RunSpec,
    StageSpec,
    check_data_kind,
    check_hyperparameter_names,
    check_loss,
    check_stages,
    complete_hyperparameters,
)
from study.schema import StrictModel
from study.space_parameters import (
    Categorical,
    ConditionalGroup,
    FloatRange,
    Parameter,
    Scalar,
    shorthand_parameters,
)
from study.tasks import TASKS, GeometrySpec, registered_task, task_class
from study.yamlio import load_yaml

MULTI_OBJECTIVE_SAMPLERS = ("tpe", "random", "nsga2", "grid")


class Sampler(StrictModel):
    kind: Literal["tpe", "random", "grid", "cmaes", "nsga2"] = "tpe"
    seed: int | None = Field(None, description="sampler seed (default: the study seed)")
    n_startup_trials: int | None = Field(None, ge=0, description="tpe/cmaes: random trials before modelling starts")
    population_size: int | None = Field(None, ge=2, description="nsga2: population size")


class EarlyStopping(StrictModel):
    """Which trials stop before their last epoch (Tune's ASHA, study/search.py's make_scheduler): not the learning
    rate's decay (`lr_decay`) nor the Laplacian heads per layer (`laplacian_schedule`)."""

    kind: Literal["asha", "geometry", "none"] = "asha"
    grace_period: int = Field(1, ge=1, description="asha, geometry: epochs every trial runs before it can be stopped")
    reduction_factor: float = Field(2.0, gt=1, description="asha, geometry: keep the top 1/reduction_factor at each "
                                                          "rung")
    min_finished: int | None = Field(None, ge=2, description="geometry: finished trials before a rung ranks by "
                                                            "predicted final values (default 5)")

    @model_validator(mode="after")
    def _check(self):
        if self.min_finished is not None and self.kind != "geometry":
            raise ValueError(f"min_finished: only for kind geometry, not {self.kind}")
        return self

    @property
    def stops_trials(self) -> bool:
        """ASHA's rungs, whether it ranks by the objective (asha) or by its prediction (geometry)."""
        return self.kind != "none"


class SearchSpace(StrictModel):
    name: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$", description="study name (default folder and experiment)")
    description: str = Field("", description="free text, recorded with the study")
    task: str = Field(description=f"a registered task (study/tasks): {', '.join(TASKS)}")
    dataset: DatasetConfig = Field(description="the study's data (a `dataset:` mapping, below)")
    metric: str | list[str] = Field(description="the metric to optimise, or a list of them (multi-objective)")
    mode: Literal["min", "max"] | list[Literal["min", "max"]] = Field(description="min or max, one per metric")
    epochs: int = Field(ge=1, description="epochs of every trial (its first stage)")
    seed: int = Field(0, description="study seed: the sampler's and the first replicate's")
    num_samples: int | None = Field(None, ge=1, description="configurations to run (default: the grid size for grid, "
                                    "else 10); each runs once per replicate")
    replicates: int = Field(1, ge=1, description="runs of every configuration, at seeds seed, seed + 1, ...")
    seeds: list[int] | None = Field(None, min_length=1, description="the replicates' seeds, instead of replicates")
    baseline: dict[str, Scalar] | None = Field(None, description="the configuration the others are compared with, "
                                               "paired by seed: a value for each of its searched parameters")
    sampler: Sampler = Field(Sampler(), description="Optuna sampler")
    early_stopping: EarlyStopping = Field(EarlyStopping(), description="early stopping of trials (ASHA) or none")
    geometry: GeometrySpec = Field(GeometrySpec(), description="token-geometry settings")
    fixed: dict[str, Any] = Field(default_factory=dict, description="flat-config values every trial uses")
    parameters: dict[str, Parameter] = Field(
        default_factory=dict, description="the searched flat-config keys and their ranges"
    )
    conditional: list[ConditionalGroup] = Field(
        default_factory=list, description="parameters and values that apply only under a condition on other parameters"
    )
    points_to_evaluate: list[dict[str, Scalar]] = Field(
        default_factory=list, description="configurations the sampler tries first"
    )
    stages: list[StageSpec] = Field(default_factory=list, description="what every trial trains after its first "
                                                                      "stage, in order (docs/study.md, stages)")
    evaluate: Evaluations = Field(default_factory=list, description="benchmarks when the first stage ends "
                                                                     "(language models; a later stage has its own)")

    @field_validator("parameters", mode="before")
    @classmethod
    def _shorthand(cls, value):
        return shorthand_parameters(value)

    @field_validator("sampler", "early_stopping", mode="before")
    @classmethod
    def _kind_shorthand(cls, value):
        """`sampler: tpe` is short for `sampler: {kind: tpe}` (and so for early_stopping)."""
        return {"kind": value} if isinstance(value, str) else value

    @field_validator("task")
    @classmethod
    def _task(cls, name):
        return registered_task(name)

    @model_validator(mode="before")
    @classmethod
    def _refuse_renamed(cls, data):
        # Renamed so that a reader cannot take it for the Laplacian heads' `laplacian_schedule` or the learning
        # rate's `lr_decay`; refused, not translated, as the renamed model keys are (models/keys.py).
        if isinstance(data, dict) and "scheduler" in data:
            raise ValueError("scheduler: renamed early_stopping (stopping trials early: kind asha | geometry | none)")
        return data

    @model_validator(mode="after")
    def _check(self):
        self._check_objectives()
        self._check_names()
        self._check_conditions()
        self._check_sampler()
        for i, point in enumerate(self.points_to_evaluate):
            self._check_point(point, f"points_to_evaluate[{i}]")
        self._check_replicates()
        losses = self._values_of("loss")
        for loss in losses:
            check_loss(loss, self.task, self.dataset, self.defined_at().get("loss", "fixed.loss"))
        return self

    def _values_of(self, name: str) -> list:
        """Every value the space can give `name` (its fixed value or its choices); [] for a range or no such name."""
        found = [self.fixed[name]] if name in self.fixed else []
        found += [choice for named, p in self.every_parameter() if named == name and isinstance(p, Categorical)
                  for choice in p.choices]
        found += [group.fixed[name] for group in self.conditional if name in group.fixed]
        return found

    # ---- replicates and the baseline -----------------------------------------------------------------------------

    def _check_replicates(self):
        if self.seeds is not None:
            if self.replicates not in (1, len(self.seeds)):
                raise ValueError(f"seeds: {len(self.seeds)} seeds but replicates: {self.replicates}; give one of them")
            if len(set(self.seeds)) != len(self.seeds):
                raise ValueError(f"seeds: each seed once, got {self.seeds}")
        if len(self.seeds or range(self.replicates)) > 1 and self.early_stopping.kind != "none":
            # ASHA judges every trial on its own: it would stop a configuration's unlucky seeds and keep its lucky
            # ones, and the mean over the survivors would flatter it.
            raise ValueError(f"early_stopping: {self.early_stopping.kind} judges each seed's trial alone, which biases "
                             "a configuration's mean over its replicates; with replicates use early_stopping: none")
        if self.baseline is not None:
            self._check_point(self.baseline, "baseline")
            missing = [name for name in self._walk_with(self.baseline)[1] if name not in self.baseline]
            if missing:
                raise ValueError(f"baseline: give every parameter searched for it; missing {', '.join(missing)}")

    def replicate_seeds(self, study_seed: int) -> list[int]:
        """The seeds every configuration runs at: the space's `seeds`, else `replicates` seeds from the study's."""
        return list(self.seeds) if self.seeds is not None else [study_seed + i for i in range(self.replicates)]

    def warm_start_points(self) -> list[dict]:
        """What the sampler evaluates first: the baseline (unless the grid covers it, or it is listed), then the
        space's points_to_evaluate."""
        points = [dict(p) for p in self.points_to_evaluate]
        if self.baseline is not None and self.sampler.kind != "grid" and self.baseline not in points:
            points.insert(0, dict(self.baseline))
        return points

    def is_baseline(self, sampled: dict) -> bool:
        """Whether a trial's sampled values are the baseline configuration's."""
        return self.baseline is not None and all(
            k in sampled and sampled[k] == v and isinstance(sampled[k], bool) == isinstance(v, bool)
            for k, v in self.baseline.items())

    # ---- objectives ---------------------------------------------------------------------------------------------

    @property
    def metrics(self) -> list[str]:
        return self.metric if isinstance(self.metric, list) else [self.metric]

    @property
    def modes(self) -> list[str]:
        return self.mode if isinstance(self.mode, list) else [self.mode]

    @property
    def multi_objective(self) -> bool:
        return isinstance(self.metric, list) and len(self.metric) > 1

    @property
    def total_epochs(self) -> int:
        """Epochs of every stage: the last epoch number a trial reports."""
        return self.epochs + sum(stage.epochs for stage in self.stages)

    def epoch_metrics(self) -> tuple[str, ...]:
        """What a sampler or ASHA may optimise: the first stage's epoch metrics, and each later stage's as
        <stage>/<metric>."""
        later = (f"{stage.name}/{m}" for stage in self.stages
                 for m in task_class(stage.task).epoch_metrics(stage.dataset or self.dataset))
        return (*task_class(self.task).epoch_metrics(self.dataset), *later)

    def final_metric_prefixes(self) -> tuple[str, ...]:
        """The benchmarks of the last stage (its `evaluate:`), reported with the trial's final result only, as
        eval_<task>_<metric> (under <stage>/ for a later stage): what a sampler may also optimise."""
        last = self.stages[-1] if self.stages else None
        prefix = f"{last.name}/" if last else ""
        return tuple(f"{prefix}eval_{task}_" for evaluation in (last.evaluate if last else self.evaluate)
                     for task in evaluation.tasks)

    def reported_every_epoch(self) -> bool:
        """Every metric is in every report from the first (Tune checks that, unless told not to)."""
        return all(name in task_class(self.task).epoch_metrics(self.dataset) for name in self.metrics)

    def _check_objectives(self):
        allowed = self.epoch_metrics()
        if not self.metrics:
            raise ValueError(f"metric: give at least one of {', '.join(allowed)}")
        final = self.final_metric_prefixes()
        for name in self.metrics:
            benchmark = name.startswith(final) if final else False
            if benchmark and self.early_stopping.kind != "none":
                raise ValueError(f"metric: {name!r} is reported at the trial's end only, after ASHA would judge it: "
                                 "use early_stopping: none")
            if name not in allowed and not benchmark:
                final_names = ", ".join(f"{p}<metric>" for p in final)
                raise ValueError(f"metric: {name!r} is not reported every epoch for {self.task}; allowed: "
                                 f"{', '.join(allowed)}" + (f", or the last stage's benchmarks ({final_names})"
                                                            if final else ""))
        if len(set(self.metrics)) != len(self.metrics):
            raise ValueError(f"metric: each metric once, got {self.metrics}")
        if isinstance(self.metric, list) != isinstance(self.mode, list) or len(self.metrics) != len(self.modes):
            raise ValueError(f"mode: one mode (min or max) per metric, got metric {self.metric} and mode {self.mode}")
        if self.multi_objective and self.early_stopping.kind != "none":
            raise ValueError(f"early_stopping: {self.early_stopping.kind} stops trials on one metric; with several "
                             "metrics use early_stopping: none")
        check_stages(self.stages)
        check_evaluation(self.task, self.evaluate, "evaluate")
        if self.early_stopping.stops_trials and "/" in self.metrics[0]:
            raise ValueError(f"early_stopping: {self.early_stopping.kind} judges trials during their first stage; "
                             f"{self.metrics[0]} is reported by a later one: use early_stopping: none")
        for i, stage in enumerate(self.stages):
            check_data_kind(stage.task, stage.dataset or self.dataset, f"stages[{i}].dataset")
            check_hyperparameter_names(stage.hyperparameters, f"stages[{i}].hyperparameters")
        check_data_kind(self.task, self.dataset, "dataset")
        if self.early_stopping.stops_trials and self.early_stopping.grace_period > self.epochs:
            raise ValueError(f"early_stopping.grace_period: must be <= epochs ({self.epochs}), "
                             f"got {self.early_stopping.grace_period}")

    # ---- names and conditions -----------------------------------------------------------------------------------

    def defined_at(self) -> dict[str, str]:
        """Every hyperparameter name -> where the space defines it (for messages); names are defined once."""
        where: dict[str, str] = {}

        def define(name, location):
            if name in where:
                raise ValueError(f"{location}: {name!r} is already defined at {where[name]}; define each name once")
            where[name] = location

        for name in self.fixed:
            define(name, f"fixed.{name}")
        for name in self.parameters:
            define(name, f"parameters.{name}")
        for i, group in enumerate(self.conditional):
            for name in group.fixed:
                define(name, f"conditional[{i}].fixed.{name}")
            for name in group.parameters:
                define(name, f"conditional[{i}].parameters.{name}")
        return where

    def _check_names(self):
        for name, location in self.defined_at().items():
            if name not in HYPERPARAMETER_KEYS:
                try:
                    check_hyperparameter_names([name], location.rsplit(".", 1)[0])
                except UserError as exc:
                    raise ValueError(str(exc)) from None

    def _check_conditions(self):
        known: dict[str, list] = {name: [value] for name, value in self.fixed.items()}
        known.update({name: p.corners() if isinstance(p, Categorical) else None for name, p in self.parameters.items()})
        for i, group in enumerate(self.conditional):
            for name, allowed in group.when.items():
                _refuse_renamed_key(name, f"conditional[{i}].when")
                if name not in known:
                    raise ValueError(
                        f"conditional[{i}].when.{name}: not a parameter or fixed value defined before this group; "
                        f"allowed: {', '.join(known) or 'none'}"
                    )
                if known[name] is None:
                    raise ValueError(f"conditional[{i}].when.{name}: conditions need a categorical parameter "
                                     "or fixed value")
                for option in allowed if isinstance(allowed, list) else [allowed]:
                    if not any(type(option) is type(v) and option == v for v in known[name]):
                        raise ValueError(f"conditional[{i}].when.{name}: {option!r} is not one of {known[name]}")
            known.update({name: [value] for name, value in group.fixed.items()})
            known.update({name: p.corners() if isinstance(p, Categorical) else None
                          for name, p in group.parameters.items()})

    def _check_sampler(self):
        kind = self.sampler.kind
        if self.multi_objective and kind not in MULTI_OBJECTIVE_SAMPLERS:
            raise ValueError(
                f"sampler: {kind} optimises one metric; "
                f"with several metrics use one of {', '.join(MULTI_OBJECTIVE_SAMPLERS)}"
            )
        if kind == "grid":
            if self.conditional:
                raise ValueError("sampler: grid needs a space without conditional groups "
                                 "(list the combinations instead)")
            for name, p in self.parameters.items():
                if isinstance(p, FloatRange):
                    raise ValueError(f"parameters.{name}: sampler grid needs categorical or int parameters")
        if not self.parameters and not self.conditional:
            raise ValueError("parameters: a search space needs at least one parameter")

    def _check_point(self, point: dict, where: str):
        active = self._walk_with(point)[1]
        for name, value in point.items():
            _refuse_renamed_key(name, where)
            if name not in active:
                raise ValueError(
                    f"{where}.{name}: not a parameter that is sampled for this point; "
                    f"sampled: {', '.join(active) or 'none'}"
                )
            if not active[name].contains(value):
                raise ValueError(f"{where}.{name}: {value!r} is outside the space; must be {active[name].describe()}")

    # ---- the walk of the conditional groups ---------------------------------------------------------------------

    def parameters_to_sample(self, values: dict) -> Iterator[dict[str, Parameter]]:
        """The one walk of the space, define-by-run as Optuna samples it: the top-level parameters, then those of each
        conditional group, in order, whose condition holds on `values`. The walk writes the fixed values (the space's,
        then each applying group's) into `values`; the caller writes each yielded parameter's value there before it
        asks for the next, so that a group's condition reads what was sampled before it."""
        values.update(self.fixed)
        yield self.parameters
        for group in self.conditional:
            if all(name in values and group.admits(name, values[name]) for name in group.when):
                values.update(group.fixed)
                yield group.parameters

    def every_parameter(self) -> Iterator[tuple[str, Parameter]]:
        """Every parameter the space searches, top-level ones then each conditional group's, in the order the space
        names them."""
        yield from self.parameters.items()
        for group in self.conditional:
            yield from group.parameters.items()

    def _walk_with(self, sampled: dict) -> tuple[dict, dict[str, Parameter]]:
        """The walk with `sampled`'s values (those of the parameters it reaches; a missing one is left out): the
        fixed values plus those values, and the parameters reached."""
        values: dict = {}
        reached: dict[str, Parameter] = {}
        for parameters in self.parameters_to_sample(values):
            reached.update(parameters)
            values.update({k: v for k, v in sampled.items() if k in parameters})
        return values, reached

    # ---- use ----------------------------------------------------------------------------------------------------

    def grid(self) -> dict[str, list]:
        return {name: p.grid() for name, p in self.parameters.items()}

    def default_num_samples(self) -> int:
        if self.num_samples is not None:
            return self.num_samples
        if self.sampler.kind == "grid":
            return math.prod(len(v) for v in self.grid().values())
        return 10

    def resolve(self, sampled: dict) -> dict:
        """Fixed values plus a trial's sampled values, conditional groups applied: the trial's hyperparameters."""
        values, reached = self._walk_with(sampled)
        missing = [name for name in reached if name not in sampled]
        if missing:
            raise UserError(f"trial config: no value for {', '.join(missing)}")
        return values

    def judged_epochs(self) -> tuple[int, ...]:
        """The epochs at which ASHA judges a trial (its rungs: grace_period * reduction_factor^k up to epochs, the
        first epoch at or after each); none without ASHA."""
        if not self.early_stopping.stops_trials:
            return ()
        grace, factor = self.early_stopping.grace_period, self.early_stopping.reduction_factor
        rungs = int(math.log(self.epochs / grace) / math.log(factor) + 1)  # as Ray's ASHA bracket counts them
        return tuple(sorted({math.ceil(grace * factor ** k) for k in range(rungs)} - {self.epochs}))

    def run_spec(self, hyperparameters: dict, resources: Resources, seed: int | None = None,
                 provenance=None) -> RunSpec:
        return RunSpec(
            task=self.task,
            dataset=self.dataset,
            epochs=self.epochs,
            seed=self.seed if seed is None else seed,
            hyperparameters=hyperparameters,
            geometry=self.geometry.model_copy(update={"at_epochs": self.judged_epochs()}),
            stages=self.stages,
            evaluate=self.evaluate,
            resources=resources,
            provenance=provenance or {},
        )

    def planned_stages(self, hyperparameters: dict) -> list[tuple[str | None, RunSpec]]:
        """(stage name, what it trains) of a trial with these hyperparameters (`resolve`), each stage's
        hyperparameters completed as its trial completes them, with the model keys its data is known to fix before
        it is read (a source's `model_keys`: the context length, the vocabulary of nanochat's BPE, GPT-2's or
        bytes'); steps_per_epoch from param_data_ratio on the model built. The first stage's name is None."""
        first = self.run_spec(hyperparameters, Resources())
        planned = []
        for name, _, stage in first.stage_runs():
            known = stage.dataset.model_keys() if hasattr(stage.dataset, "model_keys") else {}
            if getattr(stage.dataset, "tokenizer", None) == "nanochat" and "vocab_size" not in known and planned:
                known["vocab_size"] = planned[-1][1].hyperparameters["vocab_size"]  # it reads the BPE before it
            if name is None:
                where = "hyperparameters"
            else:  # as study/trial.py's run_stages: the keys the stage carries forward are not the data's to set
                known = {k: v for k, v in known.items() if k not in task_class(stage.task).carried_sets}
                where = f"stages.{name}.hyperparameters"
            complete = complete_hyperparameters(stage.hyperparameters, known, stage.task, where, epochs=stage.epochs)
            if name is None:  # the later stages keep the first one's completed keys, as in a trial
                first = first.model_copy(update={"hyperparameters": complete})
                stage = first.model_copy(update={"stages": []})
                planned.append((name, stage))
                continue
            planned.append((name, stage.model_copy(update={"hyperparameters": complete})))
        return planned


def _refuse_renamed_key(name: str, where: str) -> None:
    """A renamed model key where a space names a hyperparameter outside its definitions (a condition, a point)."""
    if renamed_key_problem(name):
        raise ValueError(f"{where}.{name}: {renamed_key_problem(name)}")


def parse_space(data: Any, where: str = "search space") -> SearchSpace:
    if not isinstance(data, dict):
        raise UserError(f"{where}: must be a mapping of fields (name, task, dataset, metric, ...), "
                        f"got {type(data).__name__}")
    return validate(SearchSpace, data, prefix=f"{where}: ")


def load_space(path: Path, base: Path | None = None) -> SearchSpace:
    """The space in the YAML file at `path`; relative dataset paths are read from `base` (default: the file's folder,
    so a space works from wherever lapstudy runs)."""
    space = parse_space(load_yaml(path, "search space"), f"search space {path}")
    base = base or Path(path).parent
    return space.model_copy(update={"dataset": space.dataset.relative_to(base),
                                    "evaluate": [e.relative_to(base) for e in space.evaluate],
                                    "stages": [stage.relative_to(base) for stage in space.stages]})
