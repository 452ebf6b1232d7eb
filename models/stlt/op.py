"""`stlt_mix`: the public functional STLT op and its backend choice."""

from __future__ import annotations

import math
import os

import torch

from models.stlt.chunked import stlt_mix_chunked
from models.stlt.fftconv import stlt_mix_fft
from models.stlt.matmul import stlt_mix_matmul
from models.stlt.naive import stlt_mix_reference
from models.stlt.subnormal import flush_subnormals
from models.stlt.triton_op import MAX_NODES

BACKENDS = ("auto", "reference", "torch", "triton")
TORCH_ALGORITHMS = {"fft": stlt_mix_fft, "chunked": stlt_mix_chunked, "matmul": stlt_mix_matmul}

# The torch backend's fastest algorithm by sequence length, per mask kind and direction: (from N, algorithm) pairs,
# the first from N = 1. Measured, not guessed: `python bench/stlt.py --calibrate --threads 1` times every algorithm
# forward + backward at N = 64 .. 16384 (B = 1, D = 256, S = 32, float32, one thread) and prints its medians and this
# table, as fastest_from_n derives it from them.
FASTEST_FROM_N = {
    ("sequence", "bilateral"): ((1, "chunked"), (725, "fft"), (5793, "chunked")),
    ("sequence", "causal"): ((1, "fft"), (2897, "chunked")),
    ("position", "bilateral"): ((1, "matmul"),),
    ("position", "causal"): ((1, "matmul"),),
}

# How much faster (median over median) another algorithm must be to take over from the one chosen at shorter
# lengths: differences within the machine's noise would otherwise flip the choice back and forth.
SWITCH_MARGIN = 1.1


def fastest_from_n(rows: dict[int, dict[str, float]]) -> tuple:
    """(from N, algorithm) pairs from median seconds per measured N: the fastest at the shortest length, then another
    wherever it is SWITCH_MARGIN times faster than the current one, from the geometric midpoint between that length
    and the one before."""
    lengths = sorted(rows)
    entries = [(1, min(rows[lengths[0]], key=rows[lengths[0]].get))]
    for previous, n in zip(lengths, lengths[1:]):
        current, fastest = entries[-1][1], min(rows[n], key=rows[n].get)
        if current not in rows[n] or rows[n][current] > SWITCH_MARGIN * rows[n][fastest]:
            if fastest != current:
                entries.append((math.ceil(math.sqrt(previous * n)), fastest))
    return tuple(entries)


def stlt_mix(x, sigma, omega, T, C, mask, *, delta: float = 1.0, causal: bool = False, backend: str = "auto"):
    """y[b,n,:] = sum_k mask[b,(n),k] * Re(C[k,:] * sum_{m in M(n)} a_k^{|n-m|} x[b,m,:]),
    a_k = exp(-(sigma_k + 1/T + i omega_k) * delta), M(n) = all positions (bilateral) or {0..n} (causal).

    x: real (B, N, D); sigma, omega: real (S,) effective values; T: real scalar (tensor or number); C: complex (S, D);
    mask: real (B, S) (one per sequence) or (B, N, S) (per position). Returns y, real (B, N, D), in x's dtype.

    backend: "reference" (the O(N^2) definition, tests only), "torch" (any device: the fastest of an FFT convolution,
    fftconv.py, a chunked scan, chunked.py, and the mix in matrix products, matmul.py, as measured: FASTEST_FROM_N),
    "triton" (fused kernels, CUDA, or the CPU interpreter with TRITON_INTERPRET=1; up to MAX_NODES = 64 nodes, beyond
    which its kernels would spill registers), "auto" (triton on CUDA tensors with up to 64 nodes, torch otherwise).
    All backends are differentiable in every argument and agree with each other.
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend: must be one of {', '.join(BACKENDS)}, got {backend!r}")
    T = _check_inputs(x, sigma, omega, T, C, mask, delta)
    if backend == "auto":
        backend = "triton" if x.is_cuda and sigma.shape[0] <= MAX_NODES else "torch"
    if backend == "triton":
        if not x.is_cuda and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError("backend: 'triton' needs CUDA tensors (or TRITON_INTERPRET=1, Triton's CPU interpreter)")
        from models.stlt.triton_op import stlt_mix_triton

        return stlt_mix_triton(x, sigma, omega, T, C, mask, delta=delta, causal=causal)
    # The scan's dynamic range wants float32 at least (bf16/fp16 inputs are computed in float32).
    dtype = torch.float64 if x.dtype == torch.float64 else torch.float32
    cdtype = torch.complex128 if dtype == torch.float64 else torch.complex64
    args = (x.to(dtype), sigma.to(dtype), omega.to(dtype), T.to(dtype), C.to(cdtype))
    if backend == "reference":
        return stlt_mix_reference(*args, mask.to(dtype), delta=delta, causal=causal).to(x.dtype)
    fn = TORCH_ALGORITHMS[torch_algorithm(x.shape[1], per_position=mask.dim() == 3, causal=causal)]
    # A relaxed-Bernoulli mask underflows to subnormal numbers where its logits pass -87 (subnormal.py).
    return fn(*args, flush_subnormals(mask.to(dtype)), delta=delta, causal=causal).to(x.dtype)


def torch_algorithm(N: int, *, per_position: bool, causal: bool) -> str:
    """Name of the torch backend's algorithm for sequences of N positions (FASTEST_FROM_N)."""
    table = FASTEST_FROM_N["position" if per_position else "sequence", "causal" if causal else "bilateral"]
    return [name for start, name in table if N >= start][-1]


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
