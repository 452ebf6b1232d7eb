"""How many Laplacian heads each layer gets.

A schedule is described with the flat-config keys (see docs/config.md), ``laplacian_schedule`` naming its kind:

- ``uniform``: ``k`` heads in every layer;
- ``ramp``: ``k_l = 0`` for ``l < start_layer``, else ``min(max_count, increment * (l - start_layer + 1))``.
  ``start_layer`` is 0-based: the paper's "from layer 4" is index 4;
- ``explicit``: ``k_per_layer`` lists the count of every layer.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from models.checks import check_int, int_range
from models.errors import ConfigError

SCHEDULE_KINDS = ("uniform", "ramp", "explicit")
SCHEDULE_KEYS = {
    "uniform": ("k",),
    "ramp": ("start_layer", "increment", "max_count"),
    "explicit": ("k_per_layer",),
}
ALL_SCHEDULE_KEYS = frozenset({"laplacian_schedule", *(key for keys in SCHEDULE_KEYS.values() for key in keys)})


def laplacian_schedule(spec: Mapping | int | Sequence[int], num_layers: int, num_heads: int) -> list[int]:
    """Resolve a schedule to the per-layer Laplacian head counts, validating every value.

    `spec` is a mapping of schedule keys (``{"laplacian_schedule": "ramp", "start_layer": 4, ...}``), an int (uniform k)
    or a list (explicit counts).
    """
    if isinstance(spec, bool):
        check_int("k", spec, low=0, high=num_heads)
    if isinstance(spec, int):
        spec = {"laplacian_schedule": "uniform", "k": spec}
    elif isinstance(spec, Sequence) and not isinstance(spec, str):
        spec = {"laplacian_schedule": "explicit", "k_per_layer": list(spec)}
    kind = spec.get("laplacian_schedule", "uniform")
    if kind not in SCHEDULE_KINDS:
        raise ConfigError("laplacian_schedule", f"must be one of {', '.join(SCHEDULE_KINDS)}; got {kind!r}")
    for key in ALL_SCHEDULE_KEYS - {"laplacian_schedule", *SCHEDULE_KEYS[kind]}:
        if key in spec:
            raise ConfigError(key, f"is not used by laplacian_schedule {kind!r} "
                                   f"(it takes {', '.join(SCHEDULE_KEYS[kind])})")

    if kind == "uniform":
        k = _checked_int(spec.get("k", 0), "k", low=0, high=num_heads)
        counts = [k] * num_layers
    elif kind == "ramp":
        start = _checked_int(spec.get("start_layer"), "start_layer", low=0, high=num_layers - 1)
        increment = _checked_int(spec.get("increment"), "increment", low=1)
        max_count = _checked_int(spec.get("max_count"), "max_count", low=0, high=num_heads)
        counts = [0 if layer < start else min(max_count, increment * (layer - start + 1))
                  for layer in range(num_layers)]
    else:
        counts = spec.get("k_per_layer")
        if not isinstance(counts, Sequence) or isinstance(counts, str):
            raise ConfigError("k_per_layer", f"must be a list of {num_layers} integers (one per layer), got {counts!r}")
        if len(counts) != num_layers:
            raise ConfigError(
                "k_per_layer", f"has {len(counts)} entries but the model has depth {num_layers}: give one per layer"
            )
        counts = [_checked_int(c, f"k_per_layer[{layer}] (layer {layer})", low=0, high=num_heads)
                  for layer, c in enumerate(counts)]
    return counts


def _checked_int(value, field: str, *, low: int, high: int | None = None) -> int:
    if value is None:
        raise ConfigError(field, f"is required; allowed: {int_range(low, high)}")
    return check_int(field, value, low=low, high=high)
