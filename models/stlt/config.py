"""The `stlt_*` keys of the flat config (docs/config.md, "STLT keys"): a frozen dataclass checked where it is made.

Every key is optional; absent keys take the defaults below (the write-up's typical settings where it gives them).
A bad value is a `ConfigError` naming the key and what it allows (the checks of `models/checks.py`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, fields

from models.checks import check_choice, check_int, check_number, is_number
from models.errors import ConfigError

BACKEND_CHOICES = ("auto", "torch", "triton")
EVAL_GATES = ("soft", "hard")  # the evaluation's node mask (models/stlt/mixer.py, STLTMixer._eval_mask)
T_INIT_ALLOWED = "'auto' (max(4, sequence length / 16)) or a number >= 4"
FRACTION = " (fraction of training)"


@dataclass(frozen=True)
class STLTConfig:
    """Options of every STLT layer of a model (one set per model; each layer has its own parameters).

    Number keys accept ints and are stored as floats, so `dataclasses.asdict` gives the values a run used.
    """

    stlt_nodes: int = 32  # S complex nodes s_k = sigma_k + i omega_k per layer, 1..1024
    stlt_delta: float = 1.0  # step Delta (> 0); omega is bounded by pi / Delta
    stlt_T_init: float | str = "auto"  # initial window bandwidth T (>= 4); 'auto': max(4, sequence length / 16)
    stlt_lambda_omega: float = 0.01  # regulariser weight of sum_k |omega_k| m_bar_k
    stlt_lambda_sigma: float = 0.1  # regulariser weight of the sigma smoothness between neighbouring nodes
    stlt_lambda_mask: float = 0.05  # regulariser weight of the node usage sum_k m_bar_k
    stlt_reg_start_step: int = 8000  # optimiser step from which the regulariser counts
    stlt_tau_start: float = 1.0  # relaxed-Bernoulli temperature during the hold
    stlt_tau_end: float = 0.2  # temperature after the anneal
    stlt_tau_hold: float = 0.1  # fraction of training held at tau_start
    stlt_tau_anneal: float = 0.5  # fraction of training annealed geometrically to tau_end (hold + anneal <= 1)
    stlt_lr_scale: float = 0.1  # learning-rate factor of sigma and omega
    stlt_backend: str = "auto"  # stlt_mix backend: auto, torch or triton
    # evaluation's gate: soft (weight alpha, nodes with alpha < 0.01 skipped: the write-up's) or hard (1[alpha > 0.5])
    stlt_eval_gate: str = "soft"

    def __post_init__(self):
        # Field by field in declaration order, then the checks that relate fields: the first bad key is reported.
        check_int("stlt_nodes", self.stlt_nodes, low=1, high=1024)
        self._number("stlt_delta", low=0, low_open=True)
        if not (self.stlt_T_init == "auto" if isinstance(self.stlt_T_init, str) else is_number(self.stlt_T_init)):
            raise self._T_init_error()
        self._number("stlt_lambda_omega", low=0)
        self._number("stlt_lambda_sigma", low=0)
        self._number("stlt_lambda_mask", low=0)
        check_int("stlt_reg_start_step", self.stlt_reg_start_step, low=0)
        self._number("stlt_tau_start", low=0, low_open=True)
        self._number("stlt_tau_end", low=0, low_open=True)
        self._number("stlt_tau_hold", low=0, high=1, note=FRACTION)
        self._number("stlt_tau_anneal", low=0, high=1, note=FRACTION)
        self._number("stlt_lr_scale", low=0, low_open=True)
        check_choice("stlt_backend", self.stlt_backend, BACKEND_CHOICES)
        check_choice("stlt_eval_gate", self.stlt_eval_gate, EVAL_GATES)

        if self.stlt_T_init != "auto":
            if not (math.isfinite(self.stlt_T_init) and self.stlt_T_init >= 4):
                raise self._T_init_error()
            object.__setattr__(self, "stlt_T_init", float(self.stlt_T_init))
        if self.stlt_tau_hold + self.stlt_tau_anneal > 1:
            raise ConfigError("stlt_tau_anneal", f"must be at most 1 - stlt_tau_hold = {1 - self.stlt_tau_hold:g} "
                                                 f"(hold and anneal are fractions of one training run)")

    def _number(self, name: str, **bounds) -> None:
        # object.__setattr__: the documented way for a frozen dataclass to set its own fields in __post_init__.
        object.__setattr__(self, name, float(check_number(name, getattr(self, name), **bounds)))

    def _T_init_error(self) -> ConfigError:
        return ConfigError("stlt_T_init", f"must be {T_INIT_ALLOWED}, got {self.stlt_T_init!r}")

    def T_init_for(self, seq_len: int) -> float:
        return max(4.0, seq_len / 16) if self.stlt_T_init == "auto" else float(self.stlt_T_init)


STLT_KEYS = frozenset(f.name for f in fields(STLTConfig))


def stlt_config(options: Mapping) -> STLTConfig:
    """The STLT options of a flat config (other keys ignored), or a ConfigError naming the bad key."""
    return STLTConfig(**{key: value for key, value in options.items() if key in STLT_KEYS})


def validate_stlt_options(options: Mapping) -> None:
    stlt_config(options)
