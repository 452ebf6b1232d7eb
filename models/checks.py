"""Checks of single config values, shared by every config of the package so each message is written once.

A leaf module (it imports only `models.errors`): `models/config.py` imports the mixer registry, which imports
`models/stlt`, so the STLT config could not import its checks from there without a cycle.

Each check returns the value it was given, or raises a `ConfigError` naming the key, what it allows and the value.
Types are strict: an integer key takes no float and no bool; a number key takes ints and floats (numpy scalars
included) but no bool, string or NaN.
"""

from __future__ import annotations

import math
from numbers import Real

from models.errors import ConfigError


def is_number(value) -> bool:
    """A real number that is not a bool (``True`` is an int to Python, never a value a config means)."""
    return isinstance(value, Real) and not isinstance(value, bool)


def int_range(low: int | None = None, high: int | None = None) -> str:
    """'an integer in 1..1024', 'an integer >= 0': what `check_int` allows, for messages that need it alone."""
    if low is not None and high is not None:
        return f"an integer in {low}..{high}"
    if low is not None:
        return f"an integer >= {low}"
    return "an integer" if high is None else f"an integer <= {high}"


def check_int(name: str, value, *, low: int | None = None, high: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or (low is not None and value < low) or (
        high is not None and value > high
    ):
        raise ConfigError(name, f"must be {int_range(low, high)}, got {value!r}")
    return value


def check_number(name: str, value, *, low=None, high=None, low_open: bool = False, high_open: bool = False,
                 note: str = ""):
    """A number within the bounds (open or closed at each end); ``note`` follows the range in the message,
    e.g. " (fraction of training)"."""
    bad = not is_number(value) or math.isnan(value)
    if not bad:
        bad = (low is not None and (value < low or (low_open and value == low))) or (
            high is not None and (value > high or (high_open and value == high))
        )
    if bad:
        if low is not None and high is not None:
            allowed = f" in {'(' if low_open else '['}{low}, {high}{')' if high_open else ']'}"
        elif low is not None:
            allowed = f" > {low}" if low_open else f" >= {low}"
        elif high is not None:
            allowed = f" < {high}" if high_open else f" <= {high}"
        else:
            allowed = ""
        raise ConfigError(name, f"must be a number{allowed}{note}, got {value!r}")
    return value


def check_bool(name: str, value) -> bool:
    if not isinstance(value, bool):
        raise ConfigError(name, f"must be true or false, got {value!r}")
    return value


def check_choice(name: str, value, choices):
    if value not in choices:
        raise ConfigError(name, f"must be one of {', '.join(map(str, choices))}, got {value!r}")
    return value
