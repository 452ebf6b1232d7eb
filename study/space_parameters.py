"""A search space's parameter types (categorical, int, float, log-float ranges) and its conditional groups: what each
can sample, contain and extend to (its corners, its grid)."""

from __future__ import annotations

import math
from typing import Annotated, Any, Literal, Union

from pydantic import Field, field_validator, model_validator

from study.errors import UserError
from study.schema import StrictModel

Scalar = Union[bool, int, float, str, None]


class Categorical(StrictModel):
    type: Literal["categorical"]
    choices: list[Scalar] = Field(
        min_length=1, description="the values to choose from (numbers, strings, booleans, null)"
    )

    @field_validator("choices")
    @classmethod
    def _distinct(cls, choices):
        keyed = [(type(c).__name__, c) for c in choices]
        if len(set(keyed)) != len(keyed):
            raise ValueError(f"choices must be distinct, got {choices}")
        return choices

    def suggest(self, trial, name):
        return trial.suggest_categorical(name, self.choices)

    def contains(self, value) -> bool:
        return any(type(value) is type(c) and value == c for c in self.choices)

    def corners(self) -> list:
        return list(self.choices)

    def grid(self) -> list:
        return list(self.choices)

    def describe(self) -> str:
        return f"one of {self.choices}"


class IntRange(StrictModel):
    type: Literal["int"]
    low: int = Field(description="smallest value")
    high: int = Field(description="largest value (included)")
    step: int = Field(1, ge=1, description="spacing of the values from low")
    log: bool = Field(False, description="sample on a log scale")

    @model_validator(mode="after")
    def _check(self):
        if self.low > self.high:
            raise ValueError(f"low ({self.low}) must be <= high ({self.high})")
        if self.log and (self.low < 1 or self.step != 1):
            raise ValueError("log: true needs low >= 1 and step 1")
        if (self.high - self.low) % self.step:
            raise ValueError(f"high - low ({self.high - self.low}) must be a multiple of step ({self.step})")
        return self

    def suggest(self, trial, name):
        return trial.suggest_int(name, self.low, self.high, step=self.step, log=self.log)

    def contains(self, value) -> bool:
        return (
            isinstance(value, int) and not isinstance(value, bool) and self.low <= value <= self.high
            and (value - self.low) % self.step == 0
        )

    def corners(self) -> list:
        return sorted({self.low, self.high})

    def grid(self) -> list:
        return list(range(self.low, self.high + 1, self.step))

    def describe(self) -> str:
        return f"an integer in {self.low}..{self.high}" + (f" in steps of {self.step}" if self.step > 1 else "")


class FloatRange(StrictModel):
    type: Literal["float", "log_float"]
    low: float = Field(description="smallest value (log_float: > 0)")
    high: float = Field(description="largest value")
    step: float | None = Field(None, gt=0, description="spacing of the values from low (None: continuous)")

    @model_validator(mode="after")
    def _check(self):
        if not (math.isfinite(self.low) and math.isfinite(self.high)) or self.low > self.high:
            raise ValueError(f"low ({self.low}) must be <= high ({self.high}), both finite")
        if self.type == "log_float":
            if self.low <= 0:
                raise ValueError(f"log_float needs low > 0, got {self.low}")
            if self.step is not None:
                raise ValueError("log_float takes no step")
        return self

    def suggest(self, trial, name):
        return trial.suggest_float(name, self.low, self.high, step=self.step, log=self.type == "log_float")

    def contains(self, value) -> bool:
        return isinstance(value, int | float) and not isinstance(value, bool) and self.low <= value <= self.high

    def corners(self) -> list:
        return sorted({self.low, self.high})

    def grid(self) -> list:
        raise UserError("sampler grid: float parameters have no grid; make them categorical")

    def describe(self) -> str:
        return f"a number in [{self.low}, {self.high}]" + (" (log scale)" if self.type == "log_float" else "")


Parameter = Annotated[Union[Categorical, IntRange, FloatRange], Field(discriminator="type")]


def shorthand_parameters(value):
    """``k: [0, 3, 6]`` is short for ``k: {type: categorical, choices: [0, 3, 6]}``."""
    if isinstance(value, dict):
        return {k: {"type": "categorical", "choices": v} if isinstance(v, list) else v for k, v in value.items()}
    return value


class ConditionalGroup(StrictModel):
    """Parameters (and fixed values) that exist only when earlier parameters take the listed values."""

    when: dict[str, Scalar | list[Scalar]] = Field(
        min_length=1, description="parameter values (one, or a list of them) under which the group applies"
    )
    parameters: dict[str, Parameter] = Field(
        default_factory=dict, description="parameters sampled only when the group applies"
    )
    fixed: dict[str, Any] = Field(default_factory=dict, description="values set only when the group applies")

    @field_validator("parameters", mode="before")
    @classmethod
    def _shorthand(cls, value):
        return shorthand_parameters(value)

    def admits(self, name: str, value) -> bool:
        """Whether `value`, taken by the earlier parameter `name`, is one the group's condition lists for it (of the
        same type: ``true`` is not ``1``)."""
        allowed = self.when[name]
        return any(type(value) is type(option) and value == option
                   for option in (allowed if isinstance(allowed, list) else [allowed]))
