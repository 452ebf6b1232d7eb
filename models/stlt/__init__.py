"""STLT: the adaptive bilateral short-time Laplace transform token mixer (docs/stlt.md).

- `stlt_mix`: the functional op, with backends "reference" (naive.py, the definition), "torch" (the fastest of
  fftconv.py, chunked.py and matmul.py as measured at each length), "triton" (triton_op.py + triton_kernels.py, fused
  kernels) and "auto".
- `STLTMixer`: the token-mixer module (mixer.py); `STLTConfig` / `stlt_config`: its flat-config keys (config.py).
"""

from models.stlt.config import STLT_KEYS, STLTConfig, stlt_config, validate_stlt_options
from models.stlt.mixer import STLTMixer
from models.stlt.op import BACKENDS, stlt_mix

__all__ = ["BACKENDS", "STLT_KEYS", "STLTConfig", "STLTMixer", "stlt_config", "stlt_mix", "validate_stlt_options"]
