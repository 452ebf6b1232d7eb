"""The STLT mix as a chunked scan: the torch path for long sequences, linear in the sequence length.

Positions are cut in chunks of Q. Within a chunk the mix is an FFT convolution of Q lags (fftconv.py, every chunk at
once); across chunks each node carries one complex state per channel. The work is O(B N D (log Q + S)), against the
full FFT convolution's O(B N D log N), and its spectra stay Q long, so cache misses do not grow with N either:

    intra   y[i] += sum_{j in chunk} K[i-j] x[j]             K[t] = sum_k mask_k Re(C_k a_k^t), |t| < Q
    carry   H_c   = a^Q H_{c-1} + E_c,  E_c = sum_j a^{Q-1-j} x[j]      (one Python step per chunk)
    readout y[i] += sum_k mask_k Re(C_k a_k^{i+1} H_{c-1})              (and the mirror image when bilateral)

With a per-position mask the readout weighs each node's term at each position: a (B, N, 4S) readout against
(B, N/Q, 4S, D) states, far below B N S D. Powers a^t are only taken for 0 <= t <= Q (never a^{-t}).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

from models.stlt.fftconv import Transposed, fft_mix_channels_first
from models.stlt.naive import decay_log
from models.stlt.subnormal import decay_powers

# Positions per chunk. The carry costs the same per position whatever Q (O(S)), while the per-chunk Python steps fall
# and the intra-chunk FFTs grow (log Q, and their spectra must stay in cache) with Q; per-position masks also pay
# each node's convolution per chunk. Measured at D = 256, S = 32, one thread: 512 and 1024 within noise per sequence
# (2048 slower), 32 and 64 per position (256 1.5x slower).
CHUNK_PER_SEQUENCE, CHUNK_PER_POSITION = 512, 64


def stlt_mix_chunked(x, sigma, omega, T, C, mask, *, delta: float = 1.0, causal: bool = False,
                     chunk: int | None = None):
    """The mix as a chunked scan; `chunk` overrides the positions per chunk (tests cut short sequences in many)."""
    B, N, D = x.shape
    Q = min(chunk or (CHUNK_PER_SEQUENCE if mask.dim() == 2 else CHUNK_PER_POSITION), N)
    n_chunks = -(-N // Q)
    pad = n_chunks * Q - N  # zeros past the end add nothing, and their own outputs are dropped
    # Channels first, positions last, for the whole op: FFTs run over the last dimension and every product below is a
    # plain (batched) matmul on contiguous memory; (B, N, D) <-> (B, D, N) copies are paid once each way.
    xt = Transposed.apply(x)  # (B, D, n_chunks Q)
    if pad:
        xt = F.pad(xt, (0, pad))
        mask = F.pad(mask, (0, 0, 0, pad)) if mask.dim() == 3 else mask
    y = fft_mix_channels_first(xt, sigma, omega, T, C, mask, delta=delta, causal=causal, chunk=Q)
    if n_chunks > 1:
        t = torch.arange(Q + 1, device=x.device, dtype=x.dtype)
        powers = decay_powers(decay_log(sigma, omega, T, delta), t[:, None])  # a_k^t, (Q + 1, S)
        m = mask if mask.dim() == 2 else mask.view(B, n_chunks, Q, -1)
        y = _add_carried(y.view(B, D, n_chunks, Q), xt.view(B, D, n_chunks, Q), powers, C, m, causal)
    y = Transposed.apply(y.view(B, D, n_chunks * Q))
    return y[:, :N] if pad else y


def _add_carried(y, xc, powers, C, m, causal: bool):
    """y (B, D, n_chunks, Q) plus what crosses chunk borders, both directions at once. Left to right, chunk c starts
    from H_c = sum_{c' < c} a^{Q (c-1-c')} E_{c'}, E = sum_j a^{Q-1-j} x_j, and position i reads a^{i+1} H_c; right to
    left, the mirror image: E' = sum_j a^j x_j, and position i reads a^{Q-i} times the state entering from chunk c+1."""
    B, D, n_chunks, Q = xc.shape
    S = powers.shape[1]
    # Columns are (real, imag) pairs of the powers, so one real matmul serves both parts and directions, and its
    # result is a complex tensor as it stands.
    gather = [powers[:Q].flip(0)] + ([] if causal else [powers[:Q]])  # a^{Q-1-j}, a^j: (Q, S) each
    local = xc @ torch.view_as_real(torch.cat(gather, dim=1)).flatten(1)  # (B, D, n_chunks, 2S|4S)
    across = powers[Q]  # a^Q, (S,)
    weights = C.T[None, :, None, :]  # C_k[d] against states (B, D, n_chunks, S)
    if m.dim() == 2:  # one mask per sequence: fold it into the states
        weights = weights * m[:, None, None, :]
    states = torch.cat([torch.view_as_real(weights * _Carry.apply(
        torch.view_as_complex(part.unflatten(-1, (S, 2))), across, reverse)).flatten(-2)
        for reverse, part in zip((False, True), local.split(2 * S, dim=-1))], dim=-1)  # (B, D, n_chunks, 2S|4S)
    spread = [powers[1:]] + ([] if causal else [powers[1:].flip(0)])  # a^{i+1}, a^{Q-i}: (Q, S) each
    readout = torch.view_as_real(torch.cat(spread, dim=1).conj().resolve_conj()).flatten(1)  # (Re, -Im): (Q, 2S|4S)
    if m.dim() == 2:  # y + states @ readout.T in one matmul
        return torch.addmm(y.view(-1, Q), states.view(-1, states.shape[-1]), readout.T).view(y.shape)
    # Per-position mask: it weighs each node's term at each position, a different readout per chunk.
    readout = readout * m.repeat_interleave(2, dim=-1).repeat(1, 1, 1, readout.shape[-1] // (2 * S))
    return y + (readout @ states.transpose(1, 2).transpose(2, 3)).permute(0, 3, 1, 2)


class _Carry(torch.autograd.Function):
    """State entering each chunk (dim -2): H_c = across * H_{c-1} + local_{c-1}, H_0 = 0; from the last chunk, with
    c + 1, when reverse. One Python step per chunk either way, without autograd bookkeeping per step. Backward is the
    adjoint recurrence run from the other end:
        lambda_c = g_c + conj(a) lambda_{c+1},   dL/dlocal_{c-1} = lambda_c,   dL/da = sum_c conj(H_{c-1}) lambda_c
    (gradients of complex tensors in PyTorch's convention: the conjugate Wirtinger derivative)."""

    @staticmethod
    def forward(ctx, local, across, reverse: bool):
        incoming = torch.zeros_like(local)
        n = local.shape[-2]
        order, source = (range(n - 2, -1, -1), 1) if reverse else (range(1, n), -1)
        for c in order:
            torch.addcmul(local[..., c + source, :], across, incoming[..., c + source, :], out=incoming[..., c, :])
        ctx.save_for_backward(incoming, across)
        ctx.reverse = reverse
        return incoming

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        incoming, across = ctx.saved_tensors
        n = incoming.shape[-2]
        grad_local = torch.zeros_like(incoming)
        adjoint = torch.zeros_like(incoming[..., 0, :])
        back = across.conj()
        order, source = (range(0, n - 1), 1) if ctx.reverse else (range(n - 1, 0, -1), -1)
        for c in order:
            adjoint = torch.addcmul(grad[..., c, :], back, adjoint)
            grad_local[..., c + source, :] = adjoint
        grad_across = (incoming.conj() * grad_local).sum(dim=(0, 1, 2))
        return grad_local, grad_across, None
