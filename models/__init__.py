"""Token mixers (Laplacian-head attention, STLT), the ViT and GPT built from them, and token-geometry metrics.

Torch only: nothing here imports Ray, MLflow or the study system.
"""

from models.base import ModelOutput, count_parameters
from models.build import build_config, build_model, model_keys, resolve_config
from models.errors import ConfigError
from models.presets import PRESETS

MODEL_KEYS = model_keys()

__all__ = [
    "MODEL_KEYS",
    "PRESETS",
    "ConfigError",
    "ModelOutput",
    "build_config",
    "build_model",
    "count_parameters",
    "resolve_config",
]
