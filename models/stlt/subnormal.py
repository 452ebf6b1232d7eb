"""Numbers too small to matter, set to exactly zero before they become subnormal floats in the torch paths.

Powers of the decay fall below float32's smallest normal number (1.2e-38) after 87 / (sigma + 1/T) steps: 9 for the
fastest node of the initial spread (sigma = 10); a relaxed-Bernoulli mask falls below it where its logits pass -87.
x86 cores run arithmetic on subnormal operands or results through a microcode assist, tens to hundreds of times
slower than a plain instruction, and the fast paths spent most of their time on such numbers once powers underflowed
(bench/stlt.py, Intel Xeon, one thread: the causal mix at 4k 3x slower, the chunked scan at 16k 3.7x). Entries under
the cube root of the smallest normal number (2.3e-13 in float32, 6e-103 in float64) become zero: a product of up to
three kept factors (a power, C or x, a mask) stays normal, and what is dropped lies far under the dtype's rounding
(float32's 1.2e-7, relative). Neither function ever forms a subnormal number itself.
"""

from __future__ import annotations

import math

import torch


def floor(dtype: torch.dtype) -> float:
    """Magnitudes under this become zero (the real dtype's, for complex)."""
    return torch.finfo(dtype.to_real() if dtype.is_complex else dtype).tiny ** (1 / 3)


def decay_powers(log_a: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """exp(t log_a) (real or complex, broadcast), zero where its magnitude exp(t Re log_a) is under the floor: those
    entries are exp(0) replaced by 0, never computed. Their gradient is zero (at most t times the floor, untracked)."""
    exponent = t * log_a
    under = (exponent.real if exponent.is_complex() else exponent) < math.log(floor(exponent.dtype))
    return torch.exp(exponent.masked_fill(under, 0)).masked_fill(under, 0)


def flush_subnormals(t: torch.Tensor) -> torch.Tensor:
    """Real t with entries of magnitude under the floor set to 0; the gradient passes through unchanged."""
    return _Flush.apply(t)


class _Flush(torch.autograd.Function):
    """Comparisons, not abs(): abs of a subnormal is itself subnormal."""

    @staticmethod
    def forward(ctx, t):
        bound = floor(t.dtype)
        return t.masked_fill((t > -bound) & (t < bound), 0)

    @staticmethod
    def backward(ctx, grad):
        return grad
