"""The `stlt_*` keys of the flat config (docs/config.md, "STLT keys"), validated with pydantic.

Every key is optional; absent keys take the defaults below (the write-up's typical settings where it gives them).
A bad value is a `ConfigError` naming the key and what it allows.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from models.errors import ConfigError


def _allowed(text: str) -> dict:
    return {"json_schema_extra": {"allowed": text}}


class STLTConfig(BaseModel):
    """Options of every STLT layer of a model (one set per model; each layer has its own parameters)."""

    model_config = ConfigDict(strict=True, extra="forbid", frozen=True)

    stlt_nodes: int = Field(32, ge=1, le=1024, **_allowed("an integer in 1..1024"))
    stlt_delta: float = Field(1.0, gt=0, **_allowed("a number > 0"))
    stlt_T_init: Literal["auto"] | float = Field(
        "auto", **_allowed("'auto' (max(4, sequence length / 16)) or a number >= 4"))
    stlt_lambda_omega: float = Field(0.01, ge=0, **_allowed("a number >= 0"))
    stlt_lambda_sigma: float = Field(0.1, ge=0, **_allowed("a number >= 0"))
    stlt_lambda_mask: float = Field(0.05, ge=0, **_allowed("a number >= 0"))
    stlt_reg_start_step: int = Field(8000, ge=0, **_allowed("an integer >= 0"))
    stlt_tau_start: float = Field(1.0, gt=0, **_allowed("a number > 0"))
    stlt_tau_end: float = Field(0.2, gt=0, **_allowed("a number > 0"))
    stlt_tau_hold: float = Field(0.1, ge=0, le=1, **_allowed("a number in [0, 1] (fraction of training)"))
    stlt_tau_anneal: float = Field(0.5, ge=0, le=1, **_allowed("a number in [0, 1] (fraction of training)"))
    stlt_lr_scale: float = Field(0.1, gt=0, **_allowed("a number > 0"))
    stlt_backend: Literal["auto", "torch", "triton"] = Field("auto", **_allowed("one of auto, torch, triton"))

    @model_validator(mode="after")
    def _cross_checks(self):
        if self.stlt_T_init != "auto" and not (math.isfinite(self.stlt_T_init) and self.stlt_T_init >= 4):
            raise _FieldError("stlt_T_init")
        if self.stlt_tau_hold + self.stlt_tau_anneal > 1:
            raise _FieldError("stlt_tau_anneal", f"must be at most 1 - stlt_tau_hold = {1 - self.stlt_tau_hold:g} "
                                                 f"(hold and anneal are fractions of one training run)")
        return self

    def T_init_for(self, seq_len: int) -> float:
        return max(4.0, seq_len / 16) if self.stlt_T_init == "auto" else float(self.stlt_T_init)


STLT_KEYS = frozenset(STLTConfig.model_fields)


class _FieldError(ValueError):
    def __init__(self, field: str, message: str | None = None):
        self.field, self.message = field, message
        super().__init__(field)


def stlt_config(options: Mapping) -> STLTConfig:
    """The STLT options of a flat config (other keys ignored), or a ConfigError naming the bad key."""
    given = {key: value for key, value in options.items() if key in STLT_KEYS}
    try:
        return STLTConfig(**given)
    except ValidationError as exc:
        error = exc.errors()[0]
        cause = error.get("ctx", {}).get("error")
        if isinstance(cause, _FieldError):
            field, message = cause.field, cause.message
        else:
            field, message = str(error["loc"][0]), None
        if message is None:
            allowed = STLTConfig.model_fields[field].json_schema_extra["allowed"]
            message = f"must be {allowed}, got {given.get(field)!r}"
        raise ConfigError(field, message) from None


def validate_stlt_options(options: Mapping) -> None:
    stlt_config(options)
