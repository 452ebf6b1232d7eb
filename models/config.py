"""Configuration shared by every Transformer of the package, validated where it is made."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields

from models.checks import check_bool, check_int, check_number
from models.errors import ConfigError
from models.mixers import MIXERS, check_laplacian_heads
from models.schedule import laplacian_schedule


@dataclass
class TransformerConfig:
    dim: int = 64
    depth: int = 4
    num_heads: int = 4
    mlp_ratio: float = 4.0
    qkv_bias: bool = False
    drop_path: float = 0.0
    # Laplacian-head schedule (models/schedule.py): which keys apply depends on `laplacian_schedule`.
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
        # The flat-config keys this model reads (what a run records of it): its family's fields, `model`, `preset`
        # and the options of the mixers its layers use (no stlt_* key without an STLT layer).
        self.read_keys = (frozenset(f.name for f in fields(self)) - {"mixer_options"} | {"model", "preset"}
                          | frozenset().union(*(MIXERS[kind].keys for kind in set(self._all_mixer_kinds()))))

    # Hooks a config with more than one stack of layers (models/encdec.py) overrides.

    def _laplacian_counts(self) -> list[int]:
        return laplacian_schedule(self.schedule_spec(), self.depth, self.num_heads)

    def _all_mixer_kinds(self) -> list[str]:
        """The mixer of every layer of the model, whichever stack it is in."""
        return self.mixer_kinds

    def _layer_heads(self) -> list[tuple[str, list[str], list[int]]]:
        """(config key of the mixers, mixer of each layer, Laplacian heads of each layer's self-mixer) per stack."""
        return [("mixer", self.mixer_kinds, self.laplacian_counts)]

    def schedule_spec(self) -> dict:
        names = ("laplacian_schedule", "k", "start_layer", "increment", "max_count", "k_per_layer")
        return {name: getattr(self, name) for name in names if getattr(self, name) is not None}

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

