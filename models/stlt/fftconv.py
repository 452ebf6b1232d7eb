"""The STLT mix as an FFT convolution: the torch path for short sequences, and the chunked scan's (chunked.py)
within-chunk products.

Because x is real, Re(C_k L_k) is x convolved with the real kernel h_k[t, d] = Re(C[k, d] a_k^{|t|}), so

    y = x * sum_k mask_k h_k        (convolution over positions, per channel)

- mask (B, S), one per sequence: the node sum moves inside the kernel, h[b] = sum_k mask[b, k] h_k, and the whole mix
  is one convolution per sequence: O(B N D log N + B N S D) time, O(B N D) memory, no per-node tensor at all.
- mask (B, N, S), varying along the sequence: one convolution per node, nodes taken a few at a time so no tensor
  reaches B N S D.

Channels are independent, so they go through in blocks sized to stay in cache (whole-tensor spectra at N = 16k
made every pass memory-bound: 3.4x slower). Convolutions run over the last dimension (positions), where FFTs are
several times faster than over a strided one, with hand-written backwards that stay in real FFTs (autograd's
backward of rfft goes through a full complex FFT). Linear (not circular) convolution needs an FFT length of at least
2N - 1. The bilateral kernel is symmetric in t, so its spectrum is 2 Re(FFT(lags 0..N-1)) - h[0], real. Powers a^t
are only ever taken for t >= 0.
"""

from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable

from models.stlt.naive import decay_log
from models.stlt.subnormal import decay_powers


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


# Numbers per channel block's spectrum, and per node group's convolutions: sized for a core's cache.
CHANNEL_BLOCK_NUMBERS, NODE_GROUP_NUMBERS = 2**18, 2**20


def channel_block(B: int, D: int, n_fft: int) -> int:
    """Channels per block: spectra of about CHANNEL_BLOCK_NUMBERS numbers, at least 8 channels."""
    return max(1, min(D, max(8, CHANNEL_BLOCK_NUMBERS // (B * n_fft))))


def node_group_size(B: int, S: int, D: int, block: int, n_fft: int) -> int:
    """Nodes per batch of convolutions on the per-position path: a group's tensors hold about B * group * block *
    n_fft numbers; besides the cache budget, group * block <= S D / 8 keeps them far below B N S D (n_fft < 4N)."""
    return max(1, min(S, NODE_GROUP_NUMBERS // (B * block * n_fft), S * D // (8 * block)))


def _spectrum(h: torch.Tensor, n_fft: int, symmetric: bool) -> torch.Tensor:
    h_hat = torch.fft.rfft(h, n=n_fft)
    return 2.0 * h_hat.real - h[..., :1] if symmetric else h_hat


class FFTConv(torch.autograd.Function):
    """y[..., n] = sum_t h[..., t] x[..., n - t] for n < N (zero outside 0..N-1), over the last dimension.

    h holds lags 0..N-1; `symmetric` also applies them at negative lags (h[-t] = h[t]). x and h broadcast against
    each other (e.g. x (B, 1, D, N) with h (1, g, D, N)); gradients are summed back to their shapes in the frequency
    domain, before the inverse FFT."""

    @staticmethod
    def forward(ctx, x, h, symmetric: bool, n_fft: int):
        x_hat = torch.fft.rfft(x, n=n_fft)
        h_hat = _spectrum(h, n_fft, symmetric)
        ctx.save_for_backward(x_hat, h_hat)
        ctx.symmetric, ctx.n_fft, ctx.N = symmetric, n_fft, x.shape[-1]
        return torch.fft.irfft(x_hat * h_hat, n=n_fft)[..., : x.shape[-1]]

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_y):
        x_hat, h_hat = ctx.saved_tensors
        n_fft, N = ctx.n_fft, ctx.N
        g_hat = torch.fft.rfft(grad_y.contiguous(), n=n_fft)  # a strided FFT input is several times slower
        grad_x = grad_h = None
        if ctx.needs_input_grad[0]:
            # Correlation with h: the adjoint of the convolution.
            grad_x = torch.fft.irfft((g_hat * h_hat.conj()).sum_to_size(x_hat.shape), n=n_fft)[..., :N]
        if ctx.needs_input_grad[1]:
            full = torch.fft.irfft((g_hat * x_hat.conj()).sum_to_size(h_hat.shape[:-1] + x_hat.shape[-1:]), n=n_fft)
            grad_h = _fold_lags(full, N, ctx.symmetric)
        return grad_x, grad_h, None, None


class MaskedFFTMix(torch.autograd.Function):
    """y[b, :, n] = sum_k mask[b, n, k] (x[b] * h[k])[:, n] for per-position masks, nodes a group at a time.

    Each node's convolution L_k (B, D, N) is needed for the mask gradient; rather than keeping all S of them for
    backward (B N S D numbers), backward recomputes them group by group from the saved spectrum of x."""

    @staticmethod
    def forward(ctx, xt, h, mask, symmetric: bool, n_fft: int, group: int):
        B, D, N = xt.shape
        x_hat = torch.fft.rfft(xt, n=n_fft)[:, None]  # (B, 1, D, F)
        y = xt.new_zeros(B, D, N)
        for nodes in _node_groups(h.shape[0], group):
            L = torch.fft.irfft(x_hat * _spectrum(h[nodes], n_fft, symmetric), n=n_fft)[..., :N]  # (B, g, D, N)
            y += (L * mask[:, :, nodes].transpose(1, 2)[:, :, None]).sum(dim=1)
        ctx.save_for_backward(x_hat, h, mask)
        ctx.symmetric, ctx.n_fft, ctx.group = symmetric, n_fft, group
        return y

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_y):
        x_hat, h, mask = ctx.saved_tensors
        n_fft, N = ctx.n_fft, h.shape[-1]
        grad_y = grad_y.contiguous()[:, None]  # (B, 1, D, N)
        grad_x_hat = torch.zeros_like(x_hat[:, 0])
        grad_h, grad_mask = torch.empty_like(h), torch.empty_like(mask)
        for nodes in _node_groups(h.shape[0], ctx.group):
            h_hat = _spectrum(h[nodes], n_fft, ctx.symmetric)
            m = mask[:, :, nodes].transpose(1, 2)[:, :, None]  # (B, g, 1, N)
            L = torch.fft.irfft(x_hat * h_hat, n=n_fft)[..., :N]
            grad_mask[:, :, nodes] = (grad_y * L).sum(dim=2).transpose(1, 2)
            g_hat = torch.fft.rfft(grad_y * m, n=n_fft)  # spectrum of dL/dL_k, (B, g, D, F)
            grad_x_hat += (g_hat * h_hat.conj()).sum(dim=1)
            grad_h[nodes] = _fold_lags(torch.fft.irfft((g_hat * x_hat.conj()).sum(dim=0), n=n_fft), N, ctx.symmetric)
        return torch.fft.irfft(grad_x_hat, n=n_fft)[..., :N], grad_h, grad_mask, None, None, None


def _node_groups(num_nodes: int, group: int):
    return [slice(start, start + group) for start in range(0, num_nodes, group)]


def _fold_lags(full: torch.Tensor, N: int, symmetric: bool) -> torch.Tensor:
    """Gradient of the kernel's lags 0..N-1 from the gradient of its circular form (negative lags wrap around)."""
    lags = full[..., :N]
    if not symmetric:
        return lags
    return torch.cat([lags[..., :1], lags[..., 1:] + full[..., full.shape[-1] - N + 1:].flip(-1)], dim=-1)


def transposed_copy(t: torch.Tensor) -> torch.Tensor:
    """(B, M, K) -> contiguous (B, K, M). On CPU one copy per batch row: torch copies a 2-D transpose in cache-sized
    tiles, while a batched strided copy misses on nearly every write once the tensor outgrows the cache (3-5x slower
    at 16k x 256 floats, a fifth of the whole chunked scan)."""
    if t.device.type != "cpu":
        return t.transpose(1, 2).contiguous()
    out = t.new_empty(t.shape[0], t.shape[2], t.shape[1])
    for row, source in zip(out, t):
        row.copy_(source.t())
    return out


class Transposed(torch.autograd.Function):
    """(B, L, D) <-> (B, D, L) as a contiguous copy both ways, so the gradients coming back are contiguous too (FFTs
    and batched matmuls on strided operands copy them, and elementwise ops on them are several times slower)."""

    @staticmethod
    def forward(ctx, x):
        return transposed_copy(x)

    @staticmethod
    def backward(ctx, grad):
        return transposed_copy(grad)


def stlt_mix_fft(x, sigma, omega, T, C, mask, *, delta: float = 1.0, causal: bool = False):
    yt = fft_mix_channels_first(Transposed.apply(x), sigma, omega, T, C, mask, delta=delta, causal=causal)
    return Transposed.apply(yt)


def fft_mix_channels_first(xt, sigma, omega, T, C, mask, *, delta: float, causal: bool, chunk: int | None = None):
    """The mix of xt (B, D, N), positions last, by FFT convolution. With `chunk` (a divisor of N), positions are cut
    in chunks of that many and only lags within a chunk are applied (every chunk at once, against one kernel of
    `chunk` lags): the chunked scan (chunked.py) adds what crosses chunk borders."""
    B, D, N = xt.shape
    S = sigma.shape[0]
    Q = chunk or N
    n_chunks = N // Q
    assert n_chunks * Q == N, (N, Q)
    n_fft = fft_size(2 * Q - 1)
    t = torch.arange(Q, device=xt.device, dtype=xt.dtype)[None]
    # a_k^t = exp(t log|a_k|) (cos + i sin)(t arg a_k), (S, Q), in real arithmetic (complex exp is much slower).
    log_a = decay_log(sigma, omega, T, delta)[:, None]
    log_r, theta = log_a.real, log_a.imag
    magnitude = decay_powers(log_r, t)
    re_powers, im_powers = magnitude * torch.cos(t * theta), magnitude * torch.sin(t * theta)
    powers = torch.cat([re_powers, im_powers], dim=0)  # (2S, Q)
    if mask.dim() == 3:
        mask = mask.reshape(B * n_chunks, Q, S)  # chunks become sequences of their own
    block = channel_block(B * n_chunks, D, n_fft)
    group = node_group_size(B * n_chunks, S, D, block, n_fft)
    if mask.dim() == 2:
        # h[b, d, t] = sum_k mask[b, k] (C_r[k, d] Re a_k^t - C_i[k, d] Im a_k^t): one matmul over 2S for every
        # channel at once (per channel block, its narrow (block x 2S) @ (2S x Q) products ran several times slower).
        weights = torch.cat([mask[:, :, None] * C.real, -mask[:, :, None] * C.imag], dim=1)
        kernels = (weights.transpose(1, 2) @ powers).split(block, dim=1)  # (B, block, Q), the same for every chunk
    else:
        kernels = [None] * -(-D // block)
    outputs = []
    # split(), not slicing: the backward of a slice zero-fills a whole input-sized gradient per block.
    for x_block, C_block, h in zip(xt.split(block, dim=1), C.split(block, dim=1), kernels):
        chunks = x_block.unflatten(-1, (n_chunks, Q))  # (B, block, n_chunks, Q)
        if mask.dim() == 2:
            outputs.append(FFTConv.apply(chunks, h[:, :, None], not causal, n_fft).flatten(-2))
        else:
            h = C_block.real[:, :, None] * re_powers[:, None] - C_block.imag[:, :, None] * im_powers[:, None]
            sequences = chunks.transpose(1, 2).reshape(B * n_chunks, -1, Q)  # a view when there is one chunk
            y = MaskedFFTMix.apply(sequences, h, mask, not causal, n_fft, group)  # h: (S, block, Q)
            outputs.append(y.view(B, n_chunks, -1, Q).transpose(1, 2).flatten(-2))
    return torch.cat(outputs, dim=1)
