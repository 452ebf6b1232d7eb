"""`stlt_mix`: the public functional STLT op and its backend choice."""

from __future__ import annotations

import os

import torch

from models.stlt.chunked import stlt_mix_chunked
from models.stlt.fftconv import stlt_mix_fft
from models.stlt.naive import stlt_mix_reference

BACKENDS = ("auto", "reference", "torch", "triton")

# Sequence lengths from which the torch backend takes the chunked scan (linear in N) over the whole-sequence FFT
# convolution (N log N, and its spectra outgrow the caches). Measured forward + backward at bench/stlt.py's shapes
# (B = 1, D = 256, S = 32, float32, one thread) on the 2-core development machine:
# - one mask per sequence: the FFT is 1.3-2x faster up to N = 4096, they tie at 8192, the chunked scan is ~1.4x
#   faster at 12288 and 16384;
# - per-position masks: the chunked scan is already ~1.4x faster at 128 and 2.5-3.5x faster at 512-4096 (the FFT
#   path convolves each node over the whole sequence).
CHUNKED_FROM_N_PER_SEQUENCE_MASK, CHUNKED_FROM_N_PER_POSITION_MASK = 8192, 128


def stlt_mix(x, sigma, omega, T, C, mask, *, delta: float = 1.0, causal: bool = False, backend: str = "auto"):
    """y[b,n,:] = sum_k mask[b,(n),k] * Re(C[k,:] * sum_{m in M(n)} a_k^{|n-m|} x[b,m,:]),
    a_k = exp(-(sigma_k + 1/T + i omega_k) * delta), M(n) = all positions (bilateral) or {0..n} (causal).

    x: real (B, N, D); sigma, omega: real (S,) effective values; T: real scalar (tensor or number); C: complex (S, D);
    mask: real (B, S) (one per sequence) or (B, N, S) (per position). Returns y, real (B, N, D), in x's dtype.

    backend: "reference" (the O(N^2) definition, tests only), "torch" (any device: an FFT convolution, fftconv.py, for
    short sequences, a chunked scan, chunked.py, from CHUNKED_FROM_N_* positions), "triton" (fused kernels, CUDA, or
    the CPU interpreter with TRITON_INTERPRET=1), "auto" (triton on CUDA tensors, torch otherwise).
    All backends are differentiable in every argument and agree with each other.
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend: must be one of {', '.join(BACKENDS)}, got {backend!r}")
    T = _check_inputs(x, sigma, omega, T, C, mask, delta)
    if backend == "auto":
        backend = "triton" if x.is_cuda else "torch"
    if backend == "triton":
        if not x.is_cuda and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError("backend: 'triton' needs CUDA tensors (or TRITON_INTERPRET=1, Triton's CPU interpreter)")
        from models.stlt.triton_op import stlt_mix_triton

        return stlt_mix_triton(x, sigma, omega, T, C, mask, delta=delta, causal=causal)
    # The scan's dynamic range wants float32 at least (bf16/fp16 inputs are computed in float32).
    dtype = torch.float64 if x.dtype == torch.float64 else torch.float32
    cdtype = torch.complex128 if dtype == torch.float64 else torch.complex64
    args = (x.to(dtype), sigma.to(dtype), omega.to(dtype), T.to(dtype), C.to(cdtype), mask.to(dtype))
    fn = stlt_mix_reference if backend == "reference" else torch_algorithm(x.shape[1], per_position=mask.dim() == 3)
    return fn(*args, delta=delta, causal=causal).to(x.dtype)


def torch_algorithm(N: int, *, per_position: bool):
    """The torch backend's implementation for sequences of N positions."""
    threshold = CHUNKED_FROM_N_PER_POSITION_MASK if per_position else CHUNKED_FROM_N_PER_SEQUENCE_MASK
    return stlt_mix_chunked if N >= threshold else stlt_mix_fft


def _check_inputs(x, sigma, omega, T, C, mask, delta) -> torch.Tensor:
    if not isinstance(x, torch.Tensor) or x.dim() != 3 or not x.is_floating_point():
        raise ValueError(f"x: must be a real floating tensor (B, N, D), got {_describe(x)}")
    B, N, D = x.shape
    for name, value in (("sigma", sigma), ("omega", omega)):
        if not isinstance(value, torch.Tensor) or value.dim() != 1 or not value.is_floating_point():
            raise ValueError(f"{name}: must be a real floating tensor (S,), got {_describe(value)}")
    S = sigma.shape[0]
    if omega.shape[0] != S:
        raise ValueError(f"omega: must have the S={S} entries of sigma, got {tuple(omega.shape)}")
    if not isinstance(T, torch.Tensor):
        T = torch.tensor(float(T), device=x.device, dtype=x.dtype)
    if T.numel() != 1 or T.is_complex():
        raise ValueError(f"T: must be a real scalar, got {_describe(T)}")
    T = T.reshape(())
    if not isinstance(C, torch.Tensor) or not C.is_complex() or tuple(C.shape) != (S, D):
        raise ValueError(f"C: must be a complex tensor (S, D) = ({S}, {D}), got {_describe(C)}")
    if not isinstance(mask, torch.Tensor) or tuple(mask.shape) not in ((B, S), (B, N, S)) or mask.is_complex():
        raise ValueError(f"mask: must be a real tensor (B, S) = ({B}, {S}) or (B, N, S) = ({B}, {N}, {S}), "
                         f"got {_describe(mask)}")
    if not delta > 0:
        raise ValueError(f"delta: must be > 0, got {delta!r}")
    return T


def _describe(value) -> str:
    if isinstance(value, torch.Tensor):
        return f"{value.dtype} tensor of shape {tuple(value.shape)}"
    return repr(value)
