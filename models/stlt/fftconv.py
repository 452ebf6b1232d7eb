"""The STLT mix as an FFT convolution: the fast PyTorch path (CPU default), differentiated by autograd.

Because x is real, Re(C_k L_k) is x convolved with the real kernel h_k[t, d] = Re(C[k, d] a_k^{|t|}), so

    y = x * sum_k mask_k h_k        (convolution over positions, per channel)

- mask (B, S), one per sequence: the node sum moves inside the kernel, h[b] = sum_k mask[b, k] h_k, and the whole mix
  is one convolution per sequence: O(B N D log N + B N S D) time, O(B N D) memory, no per-node tensor at all.
- mask (B, N, S), varying along the sequence: one convolution per node, nodes taken a few at a time so no tensor
  reaches B N S D.

Linear (not circular) convolution needs an FFT length of at least 2N - 1. The bilateral kernel is symmetric in t,
so its spectrum is 2 Re(FFT(causal half)) - h[0], real; powers a^t are only ever taken for t >= 0.
"""

from __future__ import annotations

import torch

from models.stlt.naive import decay_log


def fft_size(n: int) -> int:
    """Smallest 5-smooth integer >= n (the sizes FFT libraries are fastest at)."""
    best = 1 << max(n - 1, 0).bit_length()
    p5 = 1
    while p5 < best:
        p35 = p5
        while p35 < best:
            size = p35
            while size < n:
                size *= 2
            best = min(best, size)
            p35 *= 3
        p5 *= 5
    return best


def node_group_size(num_nodes: int) -> int:
    """Nodes per convolution batch on the per-position-mask path: a per-group tensor holds about B * 2N * group * D
    numbers, so groups of S/8 keep every tensor well under B * N * S * D."""
    return max(1, num_nodes // 8)


def _kernel_powers(sigma, omega, T, delta, N):
    """Re and Im of a_k^t for t = 0..N-1, each (S, N)."""
    t = torch.arange(N, device=sigma.device, dtype=sigma.dtype)
    powers = torch.exp(t[None] * decay_log(sigma, omega, T, delta)[:, None])
    return powers.real, powers.imag


def _spectrum(h: torch.Tensor, n_fft: int, causal: bool) -> torch.Tensor:
    """FFT over dim -2 (positions) of the kernel whose lags 0..N-1 are h; the bilateral kernel mirrors them."""
    h_hat = torch.fft.rfft(h, n=n_fft, dim=-2)
    if causal:
        return h_hat
    return 2.0 * h_hat.real - h[..., :1, :]


def stlt_mix_fft(x, sigma, omega, T, C, mask, *, delta: float = 1.0, causal: bool = False):
    B, N, D = x.shape
    S = sigma.shape[0]
    n_fft = fft_size(2 * N - 1)
    pw_r, pw_i = _kernel_powers(sigma, omega, T, delta, N)
    x_hat = torch.fft.rfft(x, n=n_fft, dim=1)  # (B, F, D)
    if mask.dim() == 2:
        # h[b, t, d] = sum_k mask[b, k] (C_r[k, d] Re a_k^t - C_i[k, d] Im a_k^t): one matmul over 2S.
        powers = torch.cat([pw_r, -pw_i], dim=0).T  # (N, 2S)
        weights = torch.cat([mask[:, :, None] * C.real, mask[:, :, None] * C.imag], dim=1)  # (B, 2S, D)
        h = torch.matmul(powers, weights)  # (B, N, D)
        return torch.fft.irfft(x_hat * _spectrum(h, n_fft, causal), n=n_fft, dim=1)[:, :N]
    y = x.new_zeros(B, N, D)
    step = node_group_size(S)
    for start in range(0, S, step):
        nodes = slice(start, start + step)
        h = pw_r[nodes, :, None] * C.real[nodes, None, :] - pw_i[nodes, :, None] * C.imag[nodes, None, :]  # (g, N, D)
        L = torch.fft.irfft(x_hat[:, None] * _spectrum(h, n_fft, causal), n=n_fft, dim=2)[:, :, :N]  # (B, g, N, D)
        y = y + torch.einsum("bgnd,bng->bnd", L, mask[:, :, nodes])
    return y
