"""The STLT mix in matrix products: the torch path for per-position masks (the causal GPT's gate).

Positions are cut in chunks of Q. A per-position mask weighs every node at every position, so no single convolution
serves all nodes (fftconv.py convolves each node on its own); here every product is a matrix product over nodes or
channels instead:

    within a chunk, lag t = 0..Q-1      V_t = mask @ h_t     (positions x S) @ (S x D),  h_t[k, d] = Re(C[k, d] a_k^t)
                                        y[i] += V_t[i] * x[i - t]      (and x[i + t] when bilateral)
    across chunks (as in chunked.py)    E_c = sum_j a^{Q-1-j} x_j      (D x Q) @ (Q x 2S) per chunk
                                        H_c = a^Q H_{c-1} + E_{c-1}    one Python step per chunk
                                        y[i] += (mask[i] * a^{i+1}) @ (C * H_c)   (Q x 2S) @ (2S x D) per chunk

The mask multiplies after the transform, so it enters as the left factor of V_t and of the readout, never inside a
convolution. Work per position: (Q + 1) / 2 products of S x D within the chunk (Q - 1 more when bilateral) and 4 S D
across chunks (twice when bilateral), forward; about three times that with the backward. No tensor reaches B N S D:
the lag products run over groups of chunks sized to stay in cache (and are recomputed in backward); the chunk states,
kept for backward, are B (N / Q) S D complex numbers per direction (N S D / 8 real numbers at Q = 16). Powers a^t are
only taken for 0 <= t <= Q.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

from models.stlt.naive import decay_log
from models.stlt.subnormal import decay_powers

# Positions per chunk. The lag products cost (Q + 1) / 2 products of S x D per position and grow with Q; the chunk
# states cost 2 S D numbers per chunk, carried one Python step per chunk, and two of their products have Q as inner
# dimension, which matrix-multiply kernels run slowly when it is small. 16 measured fastest of 8, 12, 16, 20, 24 and
# 32 (forward + backward, causal per-position masks, D = 256, S = 32, one thread, 1k-16k positions).
CHUNK = 16
# Numbers in one group's (positions x D) tensors of the lag products: sized for a core's L2 cache.
GROUP_NUMBERS = 2**17
# Complex numbers in one group's chunk states (B x group x D x S) across chunks: also sized for the L2 cache.
CARRY_GROUP_NUMBERS = 2**17


def stlt_mix_matmul(x, sigma, omega, T, C, mask, *, delta: float = 1.0, causal: bool = False,
                    chunk: int | None = None):
    """The mix in matrix products; `chunk` overrides the positions per chunk (tests cut short sequences in many)."""
    B, N, D = x.shape
    S = sigma.shape[0]
    Q = min(chunk or CHUNK, N)
    n_chunks = -(-N // Q)
    pad = n_chunks * Q - N  # zeros past the end add nothing, and their own outputs are dropped
    if mask.dim() == 2:
        mask = mask[:, None, :].expand(B, N, S)  # a view; its gradient sums over positions
    if pad:
        x, mask = F.pad(x, (0, 0, 0, pad)), F.pad(mask, (0, 0, 0, pad))
    x3, m3 = x.reshape(B * n_chunks, Q, D), mask.reshape(B * n_chunks, Q, S)
    t = torch.arange(Q + 1, device=x.device, dtype=x.dtype)
    powers = decay_powers(decay_log(sigma, omega, T, delta), t[:, None])  # a_k^t, (Q + 1, S) complex
    h = (C[None] * powers[:Q, :, None]).real  # h_t[k, d] = Re(C[k, d] a_k^t), (Q, S, D)
    y3 = LagProducts.apply(x3, m3, h.contiguous(), causal)
    if n_chunks > 1:
        y3 = _add_carried(y3, x3.view(B, n_chunks, Q, D), m3.view(B, n_chunks, Q, S), powers, C, causal)
    y = y3.view(B, n_chunks * Q, D)
    return y[:, :N] if pad else y


def _add_carried(y3, x4, m4, powers, C, causal: bool):
    """y3 (B n_chunks, Q, D) plus what crosses chunk borders (`Carried`), its powers of a laid out as real matrices."""
    Q = x4.shape[2]
    # Left to right: E = sum_j a^{Q-1-j} x_j, read as a^{i+1} H; right to left: E' = sum_j a^j x_j, read as a^{Q-i} H'.
    gather = [powers[:Q].flip(0)] + ([] if causal else [powers[:Q]])
    spread = [powers[1:]] + ([] if causal else [powers[1:].flip(0)])
    gather = torch.view_as_real(torch.stack(gather, dim=1)).flatten(1)  # (Q, directions 2S): (real, imag) pairs
    spread = torch.view_as_real(torch.stack(spread, dim=1))  # (Q, directions, S, 2)
    return y3 + Carried.apply(x4, m4, gather, spread, powers[Q], C.T, not causal).flatten(0, 1)


class Carried(torch.autograd.Function):
    """What crosses chunk borders, for x (B, n_chunks, Q, D) and mask (B, n_chunks, Q, S). Per direction p (left to
    right; right to left too when bilateral), with complex numbers as (real, imaginary) pairs along the node dimension
    so that real matrix products serve both parts:

        E[c, d, k]   = sum_j x[c, j, d] g_p[j, k]               (B group D, Q) @ (Q, 2S)
        H[c]         = a^Q H[c -+ 1] + E[c -+ 1]                one Python step per chunk, in scan order
        W            = C * H                                     the readout folded into the states
        y[c, i, d]  += sum_k mask[c, i, k] Re(s_p[i, k] W[c, d, k])    (Q, 2S) @ (2S, D) per chunk

    gather (Q, directions 2S) holds g = a^{Q-1-j}, a^j; spread (Q, directions, S, 2) holds s = a^{i+1}, a^{Q-i}; a^Q
    `across` (S,) and CT = C.T (D, S) are complex. Chunks go through in groups, in scan order, whose states
    (B, group, D, S) stay in cache while each group is carried, read out and (in backward) differentiated; the states
    are kept for backward (recomputing them measured slower).

    Backward runs the groups in reverse scan order, on conjugates (mu = conj(lambda), with PyTorch's complex gradients
    dL/dz = dL/dRe z + i dL/dIm z), so no conjugated tensor is ever materialised: a sign on the imaginary columns of
    the real matrices gives conj(dL/dW) and dL/dx straight from the products, and the adjoint recurrence
    mu_c = conj(dL/dH_c) + a^Q mu_{c +- 1} runs with the forward's own factor."""

    @staticmethod
    def forward(ctx, x4, m4, gather, spread, across, CT, bilateral: bool):
        B, n_chunks, Q, D = x4.shape
        S = m4.shape[-1]
        y = x4.new_zeros(B, n_chunks, Q, D)
        states = []  # per direction, the state entering each chunk
        CT_group = _group_shaped(CT, B, n_chunks)
        across_full = across.expand(B, D, S).contiguous()  # unbroadcast, as CT_group
        for p in range(2 if bilateral else 1):
            state, H_all = x4.new_zeros(B, D, S, dtype=CT.dtype), x4.new_empty(B, n_chunks, D, S, dtype=CT.dtype)
            for chunks in _chunk_groups(n_chunks, B * D * S, reverse=p == 1):
                H, state = _group_states(x4, gather, across_full, p, chunks, state, out=H_all[:, chunks])
                R = _readout(m4[:, chunks], spread[:, p])
                y[:, chunks] += torch.matmul(R, _states(H, CT_group).transpose(-1, -2))
            states.append(H_all)
        ctx.save_for_backward(x4, m4, gather, spread, across, CT, *states)
        return y

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_y):
        x4, m4, gather, spread, across, CT, *states = ctx.saved_tensors
        B, n_chunks, Q, D = x4.shape
        S = m4.shape[-1]
        grad_y = grad_y.contiguous()
        grad_x, grad_m = torch.zeros_like(x4), torch.zeros_like(m4)
        grad_gather, grad_spread = torch.zeros_like(gather), torch.zeros_like(spread)
        grad_across, grad_CT = torch.zeros_like(across), torch.zeros_like(CT)
        sign = torch.tensor([1.0, -1.0], dtype=spread.dtype, device=spread.device)
        CT_group = _group_shaped(CT, B, n_chunks)
        across_full = across.expand(B, D, S).contiguous()
        for p, H_all in enumerate(states):
            g_p = gather[:, 2 * S * p:2 * S * (p + 1)]
            groups = list(_chunk_groups(n_chunks, B * D * S, reverse=p == 1))
            mu = x4.new_zeros(B, D, S, dtype=CT.dtype)  # conj(dL/dH) of the chunk after the group in scan order
            for chunks in reversed(groups):
                H = H_all[:, chunks]
                g = grad_y[:, chunks]  # (B, group, Q, D)
                # Readout: y = R @ W^T per chunk, R[c, i, (k, part)] = mask[c, i, k] (Re s, -Im s)[i, k].
                grad_R = torch.matmul(g, _states(H, CT_group)).unflatten(-1, (S, 2))
                grad_m[:, chunks] += (grad_R * (spread[:, p] * sign)).sum(dim=-1)
                grad_spread[:, p] += (grad_R * m4[:, chunks, :, :, None]).sum(dim=(0, 1)) * sign
                # conj(dL/dW) from R with +Im s: the imaginary parts change sign.
                conj_grad_W = torch.view_as_complex(
                    torch.matmul(g.transpose(-1, -2), _readout(m4[:, chunks], spread[:, p], sign=1.0))
                    .unflatten(-1, (S, 2)))  # (B, group, D, S)
                grad_CT += (H * conj_grad_W).sum(dim=(0, 1))
                conj_grad_H = conj_grad_W.mul_(CT_group[:, :H.shape[1]])
                # mu_E[c] = conj(dL/dE_c) = mu of the chunk after c in scan order.
                mu_E = torch.empty_like(H)
                n = H.shape[1]
                order, step = (range(n - 1), 1) if p == 1 else (range(n - 1, 0, -1), -1)
                mu_E[:, order.start] = mu
                for c in order:
                    torch.addcmul(conj_grad_H[:, c], across_full, mu_E[:, c], out=mu_E[:, c + step])
                mu = torch.addcmul(conj_grad_H[:, order.stop], across_full, mu_E[:, order.stop])
                grad_across += (H * mu_E).sum(dim=(0, 1, 2))
                # Gather: dL/dE = conj(mu_E); as (real, imag) pairs, mu_E with its imaginary parts negated.
                flip = sign.repeat(S)
                mu_real = torch.view_as_real(mu_E).flatten(-2)  # (B, group, D, 2S)
                grad_x[:, chunks] += (mu_real @ (g_p * flip).T).transpose(-1, -2)
                grad_gather[:, 2 * S * p:2 * S * (p + 1)] += (
                    x4[:, chunks].flatten(0, 1).transpose(0, 1).flatten(1) @ mu_real.flatten(0, 2)) * flip
        return grad_x, grad_m, grad_gather, grad_spread, grad_across.conj(), grad_CT.conj(), None


def _carry_group(n_chunks: int, state_numbers: int) -> int:
    """Chunks per group: their states hold about CARRY_GROUP_NUMBERS numbers."""
    return min(n_chunks, max(1, CARRY_GROUP_NUMBERS // state_numbers))


def _chunk_groups(n_chunks: int, state_numbers: int, *, reverse: bool):
    """Slices of consecutive chunks in groups of _carry_group, in scan order."""
    group = _carry_group(n_chunks, state_numbers)
    starts = range(0, n_chunks, group)
    for start in reversed(starts) if reverse else starts:
        yield slice(start, min(start + group, n_chunks))


def _group_states(x4, gather, across, p: int, chunks: slice, state, out=None):
    """States H (B, group, D, S) entering each chunk of the group in direction p (0: left to right, 1: right to
    left), from the state entering the group, and the state leaving it; across = a^Q (B, D, S)."""
    S = across.shape[-1]
    xT = x4[:, chunks].transpose(-1, -2)  # (B, group, D, Q)
    E = torch.view_as_complex((xT @ gather[:, 2 * S * p:2 * S * (p + 1)]).unflatten(-1, (S, 2)))
    H = torch.empty_like(E) if out is None else out
    n = E.shape[1]
    order, step = (range(n - 1, 0, -1), -1) if p == 1 else (range(n - 1), 1)
    H[:, order.start] = state
    for c in order:
        torch.addcmul(E[:, c], across, H[:, c], out=H[:, c + step])
    last = order.stop
    return H, torch.addcmul(E[:, last], across, H[:, last])


def _group_shaped(CT, B: int, n_chunks: int):
    """C.T repeated to the shape of a group's states (B, group, D, S): torch multiplies complex tensors of one shape
    several times faster than when one of them broadcasts."""
    return CT.expand(B, _carry_group(n_chunks, B * CT.numel()), *CT.shape).contiguous()


def _states(H, CT_group):
    """W = C * H as real (B, group, D, 2S): (real, imag) pairs."""
    return torch.view_as_real(H * CT_group[:, :H.shape[1]]).flatten(-2)


def _readout(m, spread, sign: float = -1.0):
    """R (..., Q, 2S) = mask[..., i, k] (Re s, sign Im s)[i, k] for spread s (Q, S, 2)."""
    parts = spread if sign == 1.0 else spread * torch.tensor([1.0, sign], dtype=spread.dtype, device=spread.device)
    return (m[..., None] * parts).flatten(-2)


class LagProducts(torch.autograd.Function):
    """Within-chunk lags: y[c, i, :] = sum_t (m[c, i, :] @ h[t]) * x[c, i - t, :] over 0 <= t <= i, plus
    x[c, i + t, :] for 1 <= t < Q - i when bilateral. x (n_chunks, Q, D), m (n_chunks, Q, S), h (Q, S, D).

    Chunks go through in groups whose (Q x group x D) tensors stay in cache, transposed to (position in chunk, chunk,
    channel) so that the rows at least t positions into their chunk are one contiguous block: each lag is one
    matrix product and one fused multiply-add. Backward recomputes V_t = m @ h[t] rather than keep Q of them:
        dx[i - t] += G[i] * V_t[i],   dV_t = G[i] * x[i - t],   dm[i] += dV_t @ h[t]^T,   dh[t] += m[i]^T @ dV_t"""

    @staticmethod
    def forward(ctx, x, m, h, causal: bool):
        y = torch.empty_like(x)
        for chunks, xg, mg in _groups(x, m):
            Q, g, D = xg.shape
            yg = torch.mm(mg.view(-1, mg.shape[-1]), h[0]).view(Q, g, D).mul_(xg)
            buffer = xg.new_empty(Q * g * D)
            for out, src, t in _lags(Q, causal):
                v = torch.mm(mg[out].flatten(0, 1), h[t], out=buffer[: (Q - t) * g * D].view(-1, D))
                yg[out].addcmul_(v.view(Q - t, g, D), xg[src])
            y[chunks] = yg.transpose(0, 1)
        ctx.save_for_backward(x, m, h)
        ctx.causal = causal
        return y

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_y):
        x, m, h = ctx.saved_tensors
        grad_x, grad_m, grad_h = torch.empty_like(x), torch.empty_like(m), torch.zeros_like(h)
        for chunks, xg, mg, gg in _groups(x, m, grad_y.contiguous()):
            Q, g, D = xg.shape
            S = mg.shape[-1]
            v = torch.mm(mg.view(-1, S), h[0]).view(Q, g, D)
            dxg = gg * v
            dv = gg * xg
            dmg = torch.mm(dv.view(-1, D), h[0].T).view(Q, g, S)
            grad_h[0].addmm_(mg.view(-1, S).T, dv.view(-1, D))
            v_buffer, dv_buffer = xg.new_empty(Q * g * D), xg.new_empty(Q * g * D)
            for out, src, t in _lags(Q, ctx.causal):
                rows = mg[out].flatten(0, 1)  # ((Q - t) g, S)
                v = torch.mm(rows, h[t], out=v_buffer[: (Q - t) * g * D].view(-1, D)).view(Q - t, g, D)
                dxg[src].addcmul_(gg[out], v)
                dv = torch.mul(gg[out], xg[src], out=dv_buffer[: (Q - t) * g * D].view(Q - t, g, D)).view(-1, D)
                dmg[out].view(-1, S).addmm_(dv, h[t].T)
                grad_h[t].addmm_(rows.T, dv)
            grad_x[chunks] = dxg.transpose(0, 1)
            grad_m[chunks] = dmg.transpose(0, 1)
        return grad_x, grad_m, grad_h, None


def _groups(x, *others):
    """(chunk slice, then x and each of `others` for those chunks as contiguous (Q, group, ...) tensors) per group."""
    n_chunks, Q, D = x.shape
    group = max(1, GROUP_NUMBERS // (Q * D))
    for start in range(0, n_chunks, group):
        chunks = slice(start, start + group)
        yield (chunks,) + tuple(t[chunks].transpose(0, 1).contiguous() for t in (x, *others))


def _lags(Q: int, causal: bool):
    """(output rows, source rows, lag) of every nonzero lag: i reads i - t, and i + t when bilateral."""
    for t in range(1, Q):
        yield slice(t, Q), slice(0, Q - t), t
        if not causal:
            yield slice(0, Q - t), slice(t, Q), t
