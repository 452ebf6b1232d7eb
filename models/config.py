"""Configuration shared by every Transformer of the package, validated where it is made, and the Laplacian-head
schedule it resolves to a count per layer.

A schedule is described with the flat-config keys (see docs/config.md), ``laplacian_schedule`` naming its kind:

- ``uniform``: ``k`` heads in every layer;
- ``ramp``: ``k_l = 0`` for ``l < start_layer``, else ``min(max_count, increment * (l - start_layer + 1))``.
  ``start_layer`` is 0-based: the paper's "from layer 4" is index 4;
- ``explicit``: ``k_per_layer`` lists the count of every layer.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields

from models.checks import check_bool, check_int, check_number, int_range
from models.errors import ConfigError
from models.mixers import MIXERS, check_laplacian_heads


@dataclass
class TransformerConfig:
    dim: int = 64
    depth: int = 4
    num_heads: int = 4
    mlp_ratio: float = 4.0
    qkv_bias: bool = False
    drop_path: float = 0.0
    # Laplacian-head schedule (laplacian_schedule, below): which keys apply depends on `laplacian_schedule`.
    laplacian_schedule: str = "uniform"
    k: int | None = None
    start_layer: int | None = None
    increment: int | None = None
    max_count: int | None = None
    k_per_layer: list[int] | None = None
    # Token mixer per layer: one registry name for all layers, or a list with one name per layer.
    mixer: str | list[str] = "attention"
    # Options of non-attention mixers (e.g. the stlt_* keys), validated by their registry entries.
    mixer_options: dict = field(default_factory=dict)

    def __post_init__(self):
        check_int("dim", self.dim, low=1)
        check_int("depth", self.depth, low=1)
        check_int("num_heads", self.num_heads, low=1)
        if self.dim % self.num_heads:
            raise ConfigError("num_heads", f"must divide dim ({self.dim}); got {self.num_heads}")
        check_number("mlp_ratio", self.mlp_ratio, low=0.0, low_open=True)
        check_number("drop_path", self.drop_path, low=0.0, high=1.0, high_open=True)
        check_bool("qkv_bias", self.qkv_bias)
        self.laplacian_counts = self._laplacian_counts()
        self.mixer_kinds = self._resolve_mixers()
        for key, kinds, counts in self._layer_heads():
            check_laplacian_heads(key, kinds, counts)
        self._validate_mixer_options()
        # The flat-config keys this model reads (what a run records of it): its family's fields but those unread
        # with this configuration (another schedule kind's keys, ...), `model`, `preset` and the options of the mixers
        # its layers use (no stlt_* key without an STLT layer).
        self.read_keys = (frozenset(f.name for f in fields(self)) - {"mixer_options"} - self._unread_keys()
                          | {"model", "preset"}
                          | frozenset().union(*(MIXERS[kind].keys for kind in set(self._all_mixer_kinds()))))

    def read_values(self) -> dict:
        """The value of every key it reads but `model` and `preset`, defaults included: a config built from them
        alone is this one."""
        values = {f.name: getattr(self, f.name) for f in fields(self) if f.name in self.read_keys}
        if self.laplacian_schedule == "uniform" and "k" in values and values["k"] is None:
            values["k"] = UNIFORM_DEFAULT_K
        for kind in set(self._all_mixer_kinds()):
            values.update(MIXERS[kind].options_with_defaults(self.mixer_options))
        return values

    # Hooks a config with more than one stack of layers (models/encdec.py) overrides.

    def _laplacian_counts(self) -> list[int]:
        return laplacian_schedule(self.schedule_spec(), self.depth, self.num_heads)

    def _all_mixer_kinds(self) -> list[str]:
        """The mixer of every layer of the model, whichever stack it is in."""
        return self.mixer_kinds

    def _layer_heads(self) -> list[tuple[str, list[str], list[int]]]:
        """(config key of the mixers, mixer of each layer, Laplacian heads of each layer's self-mixer) per stack."""
        return [("mixer", self.mixer_kinds, self.laplacian_counts)]

    def _unread_keys(self) -> frozenset[str]:
        """Its fields that this configuration does not read: the keys of the schedule kinds it does not use."""
        return other_schedule_keys(self.laplacian_schedule)

    def schedule_spec(self) -> dict:
        return {name: getattr(self, name) for name in sorted(ALL_SCHEDULE_KEYS) if getattr(self, name) is not None}

    def _resolve_mixers(self) -> list[str]:
        return resolve_mixer_kinds("mixer", self.mixer, self.depth)

    def _validate_mixer_options(self) -> None:
        used = set(self._all_mixer_kinds())
        for key in self.mixer_options:
            owners = [name for name, spec in MIXERS.items() if key in spec.keys]
            if not owners:
                raise ConfigError(key, "is not a known config key")
            if not used.intersection(owners):
                raise ConfigError(key, f"is only used when some layer's mixer is {owners[0]!r} (mixer: {self.mixer!r})")
        for kind in used:
            if MIXERS[kind].validate is not None:
                MIXERS[kind].validate(self.mixer_options)


def resolve_mixer_kinds(key: str, value, depth: int) -> list[str]:
    """The registry name of each of ``depth`` layers from a `mixer`-style key: one name, a list, or the list as one
    comma-separated string ("stlt,attention,stlt,attention"), so a search space can offer per-layer choices as
    categorical values."""
    per_layer = isinstance(value, str) and "," in value
    kinds = [k.strip() for k in value.split(",")] if per_layer else value
    kinds = [kinds] * depth if isinstance(kinds, str) else kinds
    if not isinstance(kinds, list | tuple) or len(kinds) != depth:
        raise ConfigError(key, f"must be one of {sorted(MIXERS)} or a list (or comma-separated string) of "
                               f"{depth} of them (one per layer), got {value!r}")
    for layer, kind in enumerate(kinds):
        if kind not in MIXERS:
            raise ConfigError(f"{key}[{layer}]" if not isinstance(value, str) or per_layer else key,
                              f"must be one of {sorted(MIXERS)}, got {kind!r}")
    return list(kinds)


def config_from_flat(cls: type[TransformerConfig], flat: Mapping) -> TransformerConfig:
    """Build a config dataclass from flat keys: its own fields, plus any registered mixer option."""
    own = {f.name for f in fields(cls)} - {"mixer_options"}
    kwargs = {key: value for key, value in flat.items() if key in own}
    kwargs["mixer_options"] = {key: value for key, value in flat.items() if key not in own}
    return cls(**kwargs)


SCHEDULE_KINDS = ("uniform", "ramp", "explicit")
SCHEDULE_KEYS = {
    "uniform": ("k",),
    "ramp": ("start_layer", "increment", "max_count"),
    "explicit": ("k_per_layer",),
}
ALL_SCHEDULE_KEYS = frozenset({"laplacian_schedule", *(key for keys in SCHEDULE_KEYS.values() for key in keys)})
UNIFORM_DEFAULT_K = 0  # a uniform schedule without k: no Laplacian heads


def other_schedule_keys(kind: str) -> frozenset[str]:
    """The schedule keys that schedule kind `kind` does not take."""
    return ALL_SCHEDULE_KEYS - {"laplacian_schedule", *SCHEDULE_KEYS.get(kind, ())}


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
    for key in other_schedule_keys(kind):
        if key in spec:
            raise ConfigError(key, f"is not used by laplacian_schedule {kind!r} "
                                   f"(it takes {', '.join(SCHEDULE_KEYS[kind])})")

    if kind == "uniform":
        k = _checked_int(spec.get("k", UNIFORM_DEFAULT_K), "k", low=0, high=num_heads)
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
