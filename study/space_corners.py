"""The corner checks of a search space: before a study starts, the model and training configs of the space's
extreme points (every combination of its parameters' bounds and choices, conditional groups applied) and of its
warm-start points are built, so that a value `models` or the training schema refuses is a UserError naming where
the space sets it, not a failed trial hours in."""

from __future__ import annotations

from typing import TYPE_CHECKING

from study.errors import UserError
from study.runspec import Resources, apply_data_overrides, check_run_config

if TYPE_CHECKING:
    from study.space import SearchSpace

# Validation tries every combination of the parameters' extreme values up to this many, then one at a time.
MAX_CORNER_COMBINATIONS = 4096


def check_configs(space: SearchSpace, data_overrides: dict | None = None, check=None, *,
                  before_data: bool = False) -> int:
    """Build the model and training configs of the extreme points of the space (every combination of the
    parameters' bounds and choices, conditional groups applied) and of the warm-start points; the first that
    `models` or the training schema rejects is a UserError naming the parameter. `check(hyperparameters)` may
    add checks of its own (batch size against the data, say). `before_data=True` is the check made before Ray
    starts and the data is opened: problems with the keys the data shapes (DATA_SHAPED_KEYS) wait for the
    full check. Returns how many were checked."""
    checked = 0
    for sampled, blame in corner_configs(space):
        hyperparameters = space.resolve(sampled)
        _check_stages(space, hyperparameters)
        try:
            if data_overrides:
                hyperparameters = apply_data_overrides(hyperparameters, data_overrides)
            if check_run_config(hyperparameters, space.task, before_data=before_data) is None:
                continue  # a key the data shapes: checked with the data
            if check is not None:
                check(hyperparameters)
        except UserError as exc:
            # A fixed key refused at this corner after others built: the sampled values make it fail.
            message = _blame(space, str(exc), sampled, blame, data_overrides or {}, depends_on_sampled=checked > 0)
            raise UserError(message, field=exc.field) from None
        checked += 1
    return checked


def _check_stages(space: SearchSpace, hyperparameters: dict) -> None:
    """Every later stage's model and training keys (the keys its data shapes wait for its data, which the trial
    opens when the stage starts); where a stage sizes its steps by param_data_ratio, its steps too, on the
    model its data is known to give."""
    run = space.run_spec(hyperparameters, Resources())
    for i, (_, _, stage) in enumerate(run.stage_runs()[1:]):
        check_run_config(stage.hyperparameters, stage.task, f"stages[{i}].hyperparameters", before_data=True)
    if "param_data_ratio" in hyperparameters or any("param_data_ratio" in s.hyperparameters for s in space.stages):
        space.planned_stages(hyperparameters)


def _blame(space: SearchSpace, message: str, sampled: dict, blame: str, data_overrides: dict, *,
           depends_on_sampled: bool = False) -> str:
    """Point the message at where the space defines the faulty key, with the values that make it fail."""
    field, _, detail = message.partition(":")
    field = field.removeprefix("hyperparameters.")
    where = space.defined_at()
    if field in where:
        location = where[field] + (f" = {sampled[field]!r}" if field in sampled else "")
    else:  # a key the space does not set: it came from a preset or from the data
        location = f"{blame}: {field}"
    context = [f"{k}={v!r}" for k, v in sampled.items() if k != field]
    if field not in where and data_overrides:
        context += [f"{k}={v!r} (from the dataset)" for k, v in data_overrides.items()]
    searched = field in sampled or field not in where or depends_on_sampled
    suffix = f" (with {', '.join(context)})" if context and searched else ""
    return f"{location}: {detail.strip()}{suffix}"


def corner_configs(space: SearchSpace):
    """(sampled values, location to blame) for the points a space must be able to build."""
    named = [(point, f"points_to_evaluate[{i}]") for i, point in enumerate(space.points_to_evaluate)]
    if space.baseline is not None:
        named.append((space.baseline, "baseline"))
    for point, where in named:
        sampled = dict(point)
        for name, value in _first_values(space, sampled).items():
            sampled.setdefault(name, value)
        yield sampled, where
    combos = _all_corners(space)
    if combos is None:  # too many: vary one parameter at a time around the first corner
        base = _first_values(space, {})
        for name, p in space.every_parameter():
            for value in p.corners():
                sampled = _first_values(space, {**base, name: value})
                yield {**sampled, name: value}, "parameters"
    else:
        for sampled in combos:
            yield sampled, "parameters"


def _walk_corners(space: SearchSpace, corner_of) -> dict:
    """The sampled values of one walk of the space (`SearchSpace.parameters_to_sample`), each parameter it reaches
    taking `corner_of(name, its corners)`."""
    values: dict = {}
    sampled = {}
    for parameters in space.parameters_to_sample(values):
        for name, p in parameters.items():
            sampled[name] = values[name] = corner_of(name, p.corners())
    return sampled


def _first_values(space: SearchSpace, given: dict) -> dict:
    return _walk_corners(space, lambda name, corners: given.get(name, corners[0]))


def _all_corners(space: SearchSpace) -> list[dict] | None:
    """Every combination of the corners of the parameters a walk reaches (a group's only where its condition holds),
    depth first; None past MAX_CORNER_COMBINATIONS. Each walk picks, for the n-th parameter it reaches, the n-th of
    `indices` (0 past its end); then, as an odometer, the last index with a corner left moves on and those after it
    go: the walk up to a parameter depends only on the values picked before it, so a condition that the move changes
    can only add or drop parameters after it."""
    results: list[dict] = []
    indices: list[int] = []
    counts: list[int] = []  # how many corners each parameter the current walk reached has

    def corner_of(_, corners: list) -> object:
        counts.append(len(corners))
        return corners[indices[len(counts) - 1] if len(counts) <= len(indices) else 0]

    while True:
        counts.clear()
        results.append(_walk_corners(space, corner_of))
        if len(results) > MAX_CORNER_COMBINATIONS:
            return None
        indices += [0] * (len(counts) - len(indices))
        while indices and indices[-1] + 1 == counts[len(indices) - 1]:
            indices.pop()
        if not indices:
            return results
        indices[-1] += 1
