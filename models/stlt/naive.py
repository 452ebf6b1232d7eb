"""The STLT mix written out from its definition: the ground truth every fast path is tested against.

    a_k       = exp(-(sigma_k + 1/T + i omega_k) * delta)
    L[b,n,k,:] = sum_{m in M(n)} a_k^{|n-m|} x[b,m,:]          M(n) = {0..N-1} bilateral, {0..n} causal
    y[b,n,:]  = sum_k mask[b,(n),k] * Re(C[k,:] * L[b,n,k,:])

It builds the (S, N, N) matrix of powers and a (B, N, S, D) complex tensor: O(N^2) work, tests only.
"""

from __future__ import annotations

import torch


def decay_log(sigma: torch.Tensor, omega: torch.Tensor, T: torch.Tensor, delta: float) -> torch.Tensor:
    """log a_k = -(sigma_k + 1/T + i omega_k) * delta, complex (S,)."""
    return torch.complex(-(sigma + 1.0 / T) * delta, -omega * delta)


def stlt_mix_reference(x, sigma, omega, T, C, mask, *, delta: float = 1.0, causal: bool = False):
    N = x.shape[1]
    cdtype = C.dtype
    pos = torch.arange(N, device=x.device)
    lag = pos[:, None] - pos[None, :]  # n - m
    # a^{|n-m|} as exp(|n-m| log a): only non-negative powers, so nothing overflows.
    powers = torch.exp(lag.abs().to(x.dtype)[None] * decay_log(sigma, omega, T, delta)[:, None, None])  # (S, N, N)
    if causal:
        powers = powers * (lag >= 0).to(x.dtype)
    L = torch.einsum("knm,bmd->bnkd", powers, x.to(cdtype))
    readout = (C[None, None] * L).real  # (B, N, S, D)
    weights = mask[:, None, :] if mask.dim() == 2 else mask
    return torch.einsum("bnk,bnkd->bnd", weights, readout)
