"""The STLT mix as a chunked scan: the fast PyTorch path (the CPU default), linear in the sequence length.

Positions are cut in chunks of Q. Within a chunk the mix is a small matrix product (every lag below Q at once);
across chunks each node carries one complex state per channel, so the work is O(B N D (Q + S)) and no tensor holds
more than B N S D / Q numbers:

    intra   y[i] += sum_{j in chunk} K[i-j] x[j]             K[t] = sum_k mask_k Re(C_k a_k^t), |t| < Q
    carry   H_c   = a^Q H_{c-1} + E_c,  E_c = sum_j a^{Q-1-j} x[j]      (one Python step per chunk)
    readout y[i] += sum_k mask_k Re(C_k a_k^{i+1} H_{c-1})              (and the mirror image when bilateral)

- mask (B, S), one per sequence: the node sum moves into the intra-chunk kernel K, a (Q x Q) Toeplitz matrix per
  sequence and channel.
- mask (B, N, S), per position: the intra-chunk part needs each node's own chunk products (B N D per node); nodes go
  a group at a time under activation checkpointing, so backward recomputes them rather than keeping all S.
Powers a^t are only taken for 0 <= t <= Q (never a^{-t}); differentiated by autograd.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable
from torch.utils.checkpoint import checkpoint

# Positions per chunk: the per-position path pays Q per position and node, the per-sequence path only Q per
# position, and both pay one Python step per chunk (measured on CPU at N = 4096, D = 256, S = 32).
CHUNK_PER_SEQUENCE, CHUNK_PER_POSITION = 64, 32


def chunk_size(N: int, S: int, D: int, per_sequence: bool) -> int:
    """Q, capped at sqrt(N min(S, D) / 2) so that the (Q x Q) kernels ((B, D, Q, Q) per sequence, (S, Q, Q) complex
    lag powers) stay below B N S D numbers even for short sequences."""
    preferred = CHUNK_PER_SEQUENCE if per_sequence else CHUNK_PER_POSITION
    return max(1, min(preferred, N, int((N * min(S, D) / 2) ** 0.5)))


def node_group_size(num_nodes: int) -> int:
    """Nodes per group on the per-position-mask path: a group's chunk products hold 2 B N D * group numbers, so
    groups of S/8 keep every tensor well under B N S D."""
    return max(1, num_nodes // 8)


def stlt_mix_chunked(x, sigma, omega, T, C, mask, *, delta: float = 1.0, causal: bool = False,
                     chunk: int | None = None):
    B, N, D = x.shape
    S = sigma.shape[0]
    per_sequence = mask.dim() == 2
    Q = min(chunk, N) if chunk else chunk_size(N, S, D, per_sequence)
    n_chunks = -(-N // Q)
    pad = n_chunks * Q - N  # zeros past the end add nothing
    # Channels first, positions last: every product below is then a plain (batched) matmul on contiguous memory.
    xc = _ChannelsFirst.apply(F.pad(x, (0, 0, 0, pad))).view(B, D, n_chunks, Q)
    t = torch.arange(Q + 1, device=x.device, dtype=x.dtype)
    log_a = torch.complex(-(sigma + 1.0 / T) * delta, -omega * delta)  # (S,)
    powers = torch.exp(t[:, None] * log_a)  # a_k^t, (Q + 1, S)
    m = mask if per_sequence else F.pad(mask, (0, 0, 0, pad)).view(B, n_chunks, Q, S)
    y = (_intra_per_sequence if per_sequence else _intra_per_position)(xc, powers, C, m, causal)
    if n_chunks > 1:
        y = y + _carried(xc, powers, C, m, causal)
    return _ChannelsFirst.apply(y.reshape(B, D, n_chunks * Q))[:, :N]


class _ChannelsFirst(torch.autograd.Function):
    """(B, L, D) <-> (B, D, L) as a contiguous copy both ways, so the gradients reaching the matmuls are contiguous
    too (batched matmuls on strided operands copy every batch element)."""

    @staticmethod
    def forward(ctx, x):
        return x.transpose(1, 2).contiguous()

    @staticmethod
    def backward(ctx, grad):
        return grad.transpose(1, 2).contiguous()


def _carried(xc, powers, C, m, causal: bool):
    """What crosses chunk borders, both directions at once. Left to right, chunk c starts from
    H_c = sum_{c' < c} a^{Q (c-1-c')} E_{c'}, E = sum_j a^{Q-1-j} x_j, and position i reads a^{i+1} H_c; right to left,
    the mirror image: E' = sum_j a^j x_j, and position i reads a^{Q-i} times the state entering from chunk c+1."""
    B, D, n_chunks, Q = xc.shape
    S = powers.shape[1]
    # Columns are the real and imaginary parts of the powers, so one real matmul serves both parts and directions.
    gather = [powers[:Q].flip(0)] + ([] if causal else [powers[:Q]])  # a^{Q-1-j}, a^j: (Q, S) each
    local = xc @ torch.cat([part for p in gather for part in (p.real, p.imag)], dim=1)  # (B, D, n_chunks, 2S|4S)
    across = powers[Q]  # a^Q, (S,)
    incoming = [_carry(torch.complex(local[..., :S], local[..., S:2 * S]), across, reverse=False)]
    if not causal:
        incoming.append(_carry(torch.complex(local[..., 2 * S:3 * S], local[..., 3 * S:]), across, reverse=True))
    weights = C.T[None, :, None, :]  # C_k[d] against states (B, D, n_chunks, S)
    if m.dim() == 2:  # one mask per sequence: fold it into the states
        weights = weights * m[:, None, None, :]
    states = torch.cat([part for h in incoming for part in ((weights * h).real, (weights * h).imag)], dim=-1)
    spread = [powers[1:]] + ([] if causal else [powers[1:].flip(0)])  # a^{i+1}, a^{Q-i}: (Q, S) each
    readout = torch.cat([part for p in spread for part in (p.real, -p.imag)], dim=1)  # (Q, 2S|4S)
    if m.dim() == 2:
        return states @ readout.T  # (B, D, n_chunks, Q)
    # Per-position mask: it weighs each node's term at each position, a different readout per chunk.
    readout = readout * m.repeat(1, 1, 1, readout.shape[-1] // S)  # (B, n_chunks, Q, 2S|4S)
    return (readout @ states.transpose(1, 2).transpose(2, 3)).permute(0, 3, 1, 2)


def _carry(local, across, *, reverse: bool):
    """State entering each chunk (dim -2): H_c = across * H_{c-1} + local_{c-1}, H_0 = 0 (from the other end when
    reverse)."""
    if reverse:
        return _Carry.apply(local.flip(-2), across).flip(-2)
    return _Carry.apply(local, across)


class _Carry(torch.autograd.Function):
    """The chunk-to-chunk recurrence as one autograd node: a Python step per chunk either way, without autograd
    bookkeeping per step. Backward is the adjoint recurrence run from the last chunk:
        lambda_c = g_c + conj(a) lambda_{c+1},   dL/dlocal_{c-1} = lambda_c,   dL/da = sum_c conj(H_{c-1}) lambda_c
    (gradients of complex tensors in PyTorch's convention: the conjugate Wirtinger derivative)."""

    @staticmethod
    def forward(ctx, local, across):
        incoming = torch.zeros_like(local)
        for c in range(1, local.shape[-2]):
            torch.addcmul(local[..., c - 1, :], across, incoming[..., c - 1, :], out=incoming[..., c, :])
        ctx.save_for_backward(incoming, across)
        return incoming

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        incoming, across = ctx.saved_tensors
        grad_local = torch.zeros_like(incoming)
        adjoint = torch.zeros_like(incoming[..., 0, :])
        back = across.conj()
        for c in range(incoming.shape[-2] - 1, 0, -1):
            adjoint = torch.addcmul(grad[..., c, :], back, adjoint)
            grad_local[..., c - 1, :] = adjoint
        grad_across = (incoming.conj() * grad_local).sum(dim=(0, 1, 2))
        return grad_local, grad_across


def _lag_matrix(powers, Q: int, causal: bool):
    """a_k^{|i-j|} for i, j in a chunk, zero above the diagonal when causal: (S, Q, Q) complex."""
    lag = torch.arange(Q, device=powers.device)
    lags = (lag[:, None] - lag[None, :]).abs()
    matrix = powers[lags].permute(2, 0, 1)
    if causal:
        matrix = matrix * (lag[:, None] >= lag[None, :]).to(powers.real.dtype)
    return matrix


def _intra_per_sequence(xc, powers, C, mask, causal: bool):
    """One Toeplitz kernel per sequence and channel: K[b, d, i, j] = sum_k mask[b, k] Re(C[k, d] a_k^{|i-j|})."""
    B, D, n_chunks, Q = xc.shape
    lags = _lag_matrix(powers, Q, causal).flatten(1)  # (S, Q*Q)
    weights = mask[:, :, None] * C  # (B, S, D) complex
    kernel = torch.cat([weights.real, -weights.imag], dim=1).transpose(1, 2) @ torch.cat([lags.real, lags.imag])
    return xc @ kernel.view(B, D, Q, Q).transpose(2, 3)  # y[., c, i] = sum_j x[., c, j] K[i, j]


def _intra_per_position(xc, powers, C, m, causal: bool):
    lags = _lag_matrix(powers, xc.shape[-1], causal)
    S = lags.shape[0]
    step = node_group_size(S)
    y = torch.zeros_like(xc)
    for start in range(0, S, step):
        nodes = slice(start, start + step)
        y = y + checkpoint(_node_group_intra, xc, lags[nodes], C[nodes], m[..., nodes], use_reentrant=False)
    return y


def _node_group_intra(xc, lags, C, m):
    """sum_{k in group} m[b, c, i, k] Re(C_k[d] sum_j a_k^{|i-j|} x[b, d, c, j]): the group's chunk products
    (B, D, n_chunks, g, Q) exist only inside this function."""
    g, Q = lags.shape[:2]
    products = (xc @ torch.cat([lags.real, lags.imag]).flatten(0, 1).T).unflatten(-1, (2, g, Q))
    readout = C.real.T[None, :, None, :, None] * products[..., 0, :, :] - C.imag.T[None, :, None, :, None] * products[..., 1, :, :]
    return (readout * m.permute(0, 1, 3, 2)[:, None]).sum(dim=-2)
