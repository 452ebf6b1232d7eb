"""The base of the schemas of `study/` (search spaces, run configs, datasets, task options, evaluations)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class StrictModel(BaseModel):
    """A schema that refuses unknown keys (a misspelt one is an error, not ignored) and is immutable."""

    model_config = ConfigDict(extra="forbid", frozen=True)
