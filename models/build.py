"""One way to build any model of the package from a flat config dict (what a study trial passes)."""

from __future__ import annotations

from collections.abc import Mapping
from contextlib import nullcontext
from dataclasses import fields

import torch
from torch import nn

from models.config import config_from_flat
from models.encdec import EncDecConfig, EncoderDecoder
from models.errors import ConfigError
from models.gpt import GPT, GPTConfig
from models.keys import renamed_key_problem
from models.mixers import mixer_keys
from models.presets import DEFAULT_PRESET, PRESETS
from models.vit import ViT, ViTConfig

FAMILIES: dict[str, tuple[type, type]] = {"vit": (ViTConfig, ViT), "gpt": (GPTConfig, GPT),
                                          "encdec": (EncDecConfig, EncoderDecoder)}


def model_keys() -> frozenset[str]:
    """Every flat-config key `build_model` understands (the study splits trial configs with it)."""
    own = {f.name for cfg, _ in FAMILIES.values() for f in fields(cfg)} - {"mixer_options"}
    return frozenset(own | {"model", "preset"} | mixer_keys())


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
    config_cls = FAMILIES[family][0]
    allowed = {f.name for f in fields(config_cls)} - {"mixer_options"} | {"model", "preset"} | mixer_keys()
    for key in resolved:
        if renamed_key_problem(key):
            raise ConfigError(key, renamed_key_problem(key))
        if key not in allowed:
            owners = [name for name, (cfg, _) in FAMILIES.items() if key in {f.name for f in fields(cfg)}]
            hint = f" (it belongs to model {' or '.join(map(repr, owners))})" if owners else ""
            raise ConfigError(key, f"is not a config key of model {family!r}{hint}; see docs/config.md")
    return resolved


def build_config(config: Mapping) -> ViTConfig | GPTConfig | EncDecConfig:
    resolved = resolve_config(config)
    config_cls = FAMILIES[resolved["model"]][0]
    return config_from_flat(config_cls, {k: v for k, v in resolved.items() if k not in ("model", "preset")})


def build_model(config: Mapping, device: torch.device | str | None = None) -> nn.Module:
    """Build and initialise a model from a flat config (docs/config.md); every value is validated first.

    ``device="meta"`` builds the model without allocating it (for parameter counts of large presets).
    """
    model_config = build_config(config)
    model_cls = next(model for cfg, model in FAMILIES.values() if type(model_config) is cfg)
    with torch.device(device) if device is not None else nullcontext():
        return model_cls(model_config)

