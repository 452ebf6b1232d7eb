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
    per_sequence = mask.dim() == 2
    Q = min(chunk, N) if chunk else chunk_size(N, sigma.shape[0], D, per_sequence)
    n_chunks = -(-N // Q)
    xc = F.pad(x, (0, 0, 0, n_chunks * Q - N)).view(B, n_chunks, Q, D)  # zeros past the end add nothing
    t = torch.arange(Q + 1, device=x.device, dtype=x.dtype)
    log_a = torch.complex(-(sigma + 1.0 / T) * delta, -omega * delta)  # (S,)
    powers = torch.exp(t[:, None] * log_a)  # a_k^t, (Q + 1, S)
    m = mask[:, None, None, :] if per_sequence else F.pad(mask, (0, 0, 0, n_chunks * Q - N)).view(B, n_chunks, Q, -1)

    y = _intra_per_sequence(xc, powers, C, mask, causal) if per_sequence else _intra_per_position(xc, powers, C, m, causal)
    # Carried states, left to right: position i of chunk c sees a^{i+1} H_{c-1}.
    y = y + _carried(xc, powers, C, m, Q, reverse=False)
    if not causal:  # right to left: position i sees a^{Q-i} times the state entering from chunk c+1
        y = y + _carried(xc.flip(2), powers, C, m.flip(2) if not per_sequence else m, Q, reverse=True).flip(2)
    return y.reshape(B, n_chunks * Q, D)[:, :N]


def _carried(xc, powers, C, m, Q: int, *, reverse: bool):
    """sum_k m Re(C_k a_k^{i+1} H_{c-1,k}) for the chunks in scan order (reverse: chunks taken right to left, with
    positions already flipped inside each chunk by the caller)."""
    B, n_chunks = xc.shape[:2]
    to_end = powers[:Q].flip(0)  # a^{Q-1-j}: from position j to the chunk's last position
    local = torch.complex(torch.einsum("jk,bcjd->bckd", to_end.real, xc), torch.einsum("jk,bcjd->bckd", to_end.imag, xc))
    order = range(n_chunks - 1, -1, -1) if reverse else range(n_chunks)
    across = powers[Q][:, None]  # a^Q, (S, 1)
    local = local.unbind(1)  # one split, not one (whole-tensor) index backward per chunk
    state = torch.zeros_like(local[0])
    incoming = [None] * n_chunks
    for c in order:
        incoming[c] = state
        state = across * state + local[c]
    weighted = C * torch.stack(incoming, dim=1)  # C_k H_{c-1,k}, (B, n_chunks, S, D)
    into = powers[1:]  # a^{i+1}, (Q, S)
    if m.shape[2] == 1:  # one mask per sequence: fold it into the states
        weighted = weighted * m.squeeze(2)[:, :, :, None].to(weighted.dtype)
        return torch.einsum("ik,bckd->bcid", into.real, weighted.real) - torch.einsum(
            "ik,bckd->bcid", into.imag, weighted.imag)
    return torch.einsum("bcik,bckd->bcid", m * into.real, weighted.real) - torch.einsum(
        "bcik,bckd->bcid", m * into.imag, weighted.imag)


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
    Q = xc.shape[2]
    lags = _lag_matrix(powers, Q, causal)  # (S, Q, Q)
    weights = mask[:, :, None] * C  # (B, S, D) complex
    kernel = torch.einsum("bkd,kij->bdij", weights.real, lags.real) - torch.einsum("bkd,kij->bdij", weights.imag, lags.imag)
    return torch.einsum("bdij,bcjd->bcid", kernel, xc)


def _intra_per_position(xc, powers, C, m, causal: bool):
    lags = _lag_matrix(powers, xc.shape[2], causal)
    S = lags.shape[0]
    step = node_group_size(S)
    y = torch.zeros_like(xc)
    for start in range(0, S, step):
        nodes = slice(start, start + step)
        y = y + checkpoint(_node_group_intra, xc, lags[nodes], C[nodes], m[..., nodes], use_reentrant=False)
    return y


def _node_group_intra(xc, lags, C, m):
    """sum_{k in group} m[., i, k] Re(C_k sum_j a_k^{|i-j|} x_j): the group's chunk products, (B, n_chunks, g, Q, D)."""
    u_r = torch.einsum("kij,bcjd->bckid", lags.real, xc)
    u_i = torch.einsum("kij,bcjd->bckid", lags.imag, xc)
    readout = C.real[:, None, :] * u_r - C.imag[:, None, :] * u_i
    return torch.einsum("bcik,bckid->bcid", m, readout)
