"""One way to build any model of the package from a flat config dict (what a study trial passes)."""

from __future__ import annotations

from collections.abc import Mapping
from contextlib import nullcontext
from dataclasses import fields

import torch
from torch import nn

from models.config import TransformerConfig, config_from_flat
from models.encdec import EncDecConfig, EncoderDecoder
from models.errors import ConfigError
from models.gpt import GPT, GPTConfig
from models.keys import renamed_key_problem
from models.mixers import mixer_keys
from models.presets import DEFAULT_PRESET, PRESETS
from models.vit import ViT, ViTConfig

FAMILIES: dict[str, tuple[type, type]] = {"vit": (ViTConfig, ViT), "gpt": (GPTConfig, GPT),
                                          "encdec": (EncDecConfig, EncoderDecoder)}


def family_keys(family: str) -> frozenset[str]:
    """The flat-config keys of model `family`: its config dataclass's fields (besides `model`, `preset` and the
    options of the mixers its layers use)."""
    return frozenset(f.name for f in fields(FAMILIES[family][0])) - {"mixer_options"}


def model_keys() -> frozenset[str]:
    """Every flat-config key `build_model` understands (the study splits trial configs with it)."""
    return frozenset(set().union(*map(family_keys, FAMILIES)) | {"model", "preset"} | mixer_keys())


def resolve_config(config: Mapping) -> dict:
    """The flat config with its preset expanded: the values the model is actually built from."""
    if not isinstance(config, Mapping):
        raise ConfigError("config", f"must be a mapping of config keys, got {type(config).__name__}")
    family = config.get("model")
    if family is None and "preset" in config:
        family = PRESETS.get(config["preset"], {}).get("model")
    if family not in FAMILIES:
        raise ConfigError("model", f"must be one of {', '.join(FAMILIES)}, got {family!r}")
    preset = config.get("preset", DEFAULT_PRESET[family])
    family_presets = [name for name, p in PRESETS.items() if p["model"] == family]
    if preset not in family_presets:
        raise ConfigError("preset", f"must be one of {', '.join(family_presets)} for model {family!r}, got {preset!r}")
    resolved = {**PRESETS[preset], **config, "model": family, "preset": preset}
    allowed = family_keys(family) | {"model", "preset"} | mixer_keys()
    for key in resolved:
        if renamed_key_problem(key):
            raise ConfigError(key, renamed_key_problem(key))
        if key not in allowed:
            owners = [name for name in FAMILIES if key in family_keys(name)]
            hint = f" (it belongs to model {' or '.join(map(repr, owners))})" if owners else ""
            raise ConfigError(key, f"is not a config key of model {family!r}{hint}; see docs/config.md")
    return resolved


def build_config(config: Mapping) -> ViTConfig | GPTConfig | EncDecConfig:
    return config_from_resolved(resolve_config(config))


def config_from_resolved(resolved: Mapping) -> ViTConfig | GPTConfig | EncDecConfig:
    """The config of a flat config that `resolve_config` returned (its preset expanded), validated."""
    config_cls = FAMILIES[resolved["model"]][0]
    return config_from_flat(config_cls, {k: v for k, v in resolved.items() if k not in ("model", "preset")})


def build_model(config: Mapping | TransformerConfig, device: torch.device | str | None = None) -> nn.Module:
    """Build and initialise a model from a flat config (docs/config.md), every value validated first, or from a
    config `build_config` built (validated then).

    ``device="meta"`` builds the model without allocating it (for parameter counts of large presets).
    """
    model_config = config if isinstance(config, TransformerConfig) else build_config(config)
    model_cls = next(model for cfg, model in FAMILIES.values() if type(model_config) is cfg)
    with torch.device(device) if device is not None else nullcontext():
        return model_cls(model_config)

