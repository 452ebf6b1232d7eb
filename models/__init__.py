"""Token mixers (Laplacian-head attention, STLT), the ViT and GPT built from them, and token-geometry metrics.

Torch only: nothing here imports Ray, MLflow or the study system.
"""

from importlib import import_module

from models.errors import ConfigError

__all__ = [
    "MODEL_KEYS",
    "PRESETS",
    "ConfigError",
    "ModelOutput",
    "TransformerConfig",
    "build_config",
    "build_model",
    "config_from_resolved",
    "count_parameters",
    "resolve_config",
]
_HOMES = {"ModelOutput": "models.base", "count_parameters": "models.base", "build_config": "models.build",
          "build_model": "models.build", "config_from_resolved": "models.build",
          "model_keys": "models.build", "resolve_config": "models.build",
          "PRESETS": "models.presets", "TransformerConfig": "models.config"}


def __getattr__(name: str):
    # Imported on first use: `from models.errors import ConfigError` (what the command line catches) then costs no
    # torch, and `lapstudy --help` answers at once.
    if name == "MODEL_KEYS":
        globals()[name] = import_module("models.build").model_keys()
        return globals()[name]
    if name in _HOMES:
        return getattr(import_module(_HOMES[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
