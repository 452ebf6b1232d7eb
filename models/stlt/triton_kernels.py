"""Triton kernels of the STLT mix: chunked complex scans with the readout fused in.

Every pass is a first- or second-order linear recurrence along the sequence, per node k and channel d,

    order 1:  P_n = a_k P_{n-1} + v_n            (the scan itself)
    order 2:  Q_n = a_k Q_{n-1} + P_n            (a scan of the scan: gives sum_m |n-m| a^{|n-m|} v_m, the a-gradient)

run left to right (causal) or right to left (anti-causal, REVERSE). Triton has no complex type: real and imaginary
parts are separate tiles of shape (BLOCK_S nodes, BLOCK_D channels). The sequence is cut in chunks of CHUNK positions
so the work spreads over B x D/BLOCK_D x N/CHUNK programs:

    1. _chunk_state_kernel: each chunk's end state from a zero start               (B, n_chunks, 2*ORDER, S, D)
    2. _chunk_carry_kernel: sequential over chunks, turns end states into each chunk's incoming state
    3. _forward_readout_kernel / _backward_readout_kernel: rescan each chunk from its incoming state and reduce the
       states straight into the outputs, so no (N, S, D) tensor is ever written:
         y[n, d]        = sum_k mask[n, k] Re(C[k, d] L[n, k, d])                   (forward)
         dmask[n, k]    = sum_d G[n, d] Re(C[k, d] L[n, k, d])                      (backward, mask gradient)
         dx[n, d]       = sum_k Re(C[k, d] U[n, k, d])                              (backward; U scans mask * G)
         dC[k, d]       = sum_n x[n, d] conj(U[n, k, d])                            (per chunk, summed outside)
         dlog_a[k]      = sum_{n, d} C[k, d] x[n, d] (UU - U)[n, k, d]             (per chunk and channel block)
Powers of a are only ever taken with non-negative exponents (a^CHUNK), never a^{-n}.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _decay(log_r_ptr, theta_ptr, offs_s, S, power):
    """a_k^power as (real, imag) columns (BLOCK_S, 1); padded nodes get a = 0 so their state stays zero."""
    node = offs_s < S
    log_r = tl.load(log_r_ptr + offs_s, mask=node, other=-1.0e4)
    theta = tl.load(theta_ptr + offs_s, mask=node, other=0.0)
    r = tl.exp(log_r * power)
    return (r * tl.cos(theta * power))[:, None], (r * tl.sin(theta * power))[:, None]


@triton.jit
def _position(chunk, j, CHUNK: tl.constexpr, REVERSE: tl.constexpr):
    if REVERSE:
        return chunk * CHUNK + CHUNK - 1 - j
    else:
        return chunk * CHUNK + j


@triton.jit
def _state_offsets(b, chunk, n_chunks, comp, offs_s, offs_d, S, D, NUM_COMP: tl.constexpr):
    base = ((b * n_chunks + chunk) * NUM_COMP + comp).to(tl.int64) * S * D
    return base + offs_s[:, None] * D + offs_d[None, :]


@triton.jit
def _chunk_state_kernel(
    z_ptr, w_ptr, log_r_ptr, theta_ptr, state_ptr,
    N, S, D, n_chunks,
    stride_zb, stride_zn, stride_wb, stride_wn, stride_ws,
    CHUNK: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
    ORDER: tl.constexpr, REVERSE: tl.constexpr, WEIGHTED: tl.constexpr,
):
    """End state of one chunk scanned from zero over inputs v[n, k, d] = w[n, k] * z[n, d] (w = 1 if not WEIGHTED)."""
    chunk = tl.program_id(0)
    pid_d = tl.program_id(1)
    b = tl.program_id(2).to(tl.int64)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
    a_r, a_i = _decay(log_r_ptr, theta_ptr, offs_s, S, 1.0)
    p_r = tl.zeros((BLOCK_S, BLOCK_D), dtype=tl.float32)
    p_i = tl.zeros((BLOCK_S, BLOCK_D), dtype=tl.float32)
    q_r = tl.zeros((BLOCK_S, BLOCK_D), dtype=tl.float32)
    q_i = tl.zeros((BLOCK_S, BLOCK_D), dtype=tl.float32)
    for j in range(CHUNK):
        n = _position(chunk, j, CHUNK, REVERSE)
        in_d = (offs_d < D) & ((offs_d * 0 + n) < N)
        z = tl.load(z_ptr + b * stride_zb + n * stride_zn + offs_d, mask=in_d, other=0.0)
        v = z[None, :]
        if WEIGHTED:
            in_s = (offs_s < S) & ((offs_s * 0 + n) < N)
            w = tl.load(w_ptr + b * stride_wb + n * stride_wn + offs_s * stride_ws, mask=in_s, other=0.0)
            v = w[:, None] * v
        p_r, p_i = a_r * p_r - a_i * p_i + v, a_r * p_i + a_i * p_r
        if ORDER == 2:
            q_r, q_i = a_r * q_r - a_i * q_i + p_r, a_r * q_i + a_i * q_r + p_i
    tile = (offs_s[:, None] < S) & (offs_d[None, :] < D)
    NUM_COMP: tl.constexpr = 2 * ORDER
    tl.store(state_ptr + _state_offsets(b, chunk, n_chunks, 0, offs_s, offs_d, S, D, NUM_COMP), p_r, mask=tile)
    tl.store(state_ptr + _state_offsets(b, chunk, n_chunks, 1, offs_s, offs_d, S, D, NUM_COMP), p_i, mask=tile)
    if ORDER == 2:
        tl.store(state_ptr + _state_offsets(b, chunk, n_chunks, 2, offs_s, offs_d, S, D, NUM_COMP), q_r, mask=tile)
        tl.store(state_ptr + _state_offsets(b, chunk, n_chunks, 3, offs_s, offs_d, S, D, NUM_COMP), q_i, mask=tile)


@triton.jit
def _chunk_carry_kernel(
    state_ptr, log_r_ptr, theta_ptr, S, D, n_chunks,
    CHUNK: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
    ORDER: tl.constexpr, REVERSE: tl.constexpr,
):
    """In place: chunk end states (from zero) -> the state each chunk starts from.

    Crossing a full chunk maps (P, Q) to (a^C P, a^C Q + C a^C P) before its own end state is added. Only the last
    chunk in scan order can be short, and nothing is carried across it."""
    pid_d = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
    tile = (offs_s[:, None] < S) & (offs_d[None, :] < D)
    c_r, c_i = _decay(log_r_ptr, theta_ptr, offs_s, S, CHUNK * 1.0)
    NUM_COMP: tl.constexpr = 2 * ORDER
    p_r = tl.zeros((BLOCK_S, BLOCK_D), dtype=tl.float32)
    p_i = tl.zeros((BLOCK_S, BLOCK_D), dtype=tl.float32)
    q_r = tl.zeros((BLOCK_S, BLOCK_D), dtype=tl.float32)
    q_i = tl.zeros((BLOCK_S, BLOCK_D), dtype=tl.float32)
    for j in range(n_chunks):
        if REVERSE:
            chunk = n_chunks - 1 - j
        else:
            chunk = j
        off_pr = _state_offsets(b, chunk, n_chunks, 0, offs_s, offs_d, S, D, NUM_COMP)
        off_pi = _state_offsets(b, chunk, n_chunks, 1, offs_s, offs_d, S, D, NUM_COMP)
        end_pr = tl.load(state_ptr + off_pr, mask=tile, other=0.0)
        end_pi = tl.load(state_ptr + off_pi, mask=tile, other=0.0)
        tl.store(state_ptr + off_pr, p_r, mask=tile)
        tl.store(state_ptr + off_pi, p_i, mask=tile)
        if ORDER == 2:
            off_qr = _state_offsets(b, chunk, n_chunks, 2, offs_s, offs_d, S, D, NUM_COMP)
            off_qi = _state_offsets(b, chunk, n_chunks, 3, offs_s, offs_d, S, D, NUM_COMP)
            end_qr = tl.load(state_ptr + off_qr, mask=tile, other=0.0)
            end_qi = tl.load(state_ptr + off_qi, mask=tile, other=0.0)
            tl.store(state_ptr + off_qr, q_r, mask=tile)
            tl.store(state_ptr + off_qi, q_i, mask=tile)
            cp_r = c_r * p_r - c_i * p_i
            cp_i = c_r * p_i + c_i * p_r
            q_r, q_i = c_r * q_r - c_i * q_i + CHUNK * cp_r + end_qr, c_r * q_i + c_i * q_r + CHUNK * cp_i + end_qi
        p_r, p_i = c_r * p_r - c_i * p_i + end_pr, c_r * p_i + c_i * p_r + end_pi


@triton.jit
def _readout_program(log_r_ptr, theta_ptr, c_r_ptr, c_i_ptr, S, D, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr):
    """What a readout program (chunk, feature block, batch row) starts from: its ids, its (node, feature) tile, the
    nodes' decays and the readout C on the tile."""
    chunk = tl.program_id(0)
    pid_d = tl.program_id(1)
    b = tl.program_id(2).to(tl.int64)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
    tile = (offs_s[:, None] < S) & (offs_d[None, :] < D)
    a_r, a_i = _decay(log_r_ptr, theta_ptr, offs_s, S, 1.0)
    c_r = tl.load(c_r_ptr + offs_s[:, None] * D + offs_d[None, :], mask=tile, other=0.0)
    c_i = tl.load(c_i_ptr + offs_s[:, None] * D + offs_d[None, :], mask=tile, other=0.0)
    return chunk, pid_d, b, offs_s, offs_d, tile, a_r, a_i, c_r, c_i


@triton.jit
def _forward_readout_kernel(
    x_ptr, mask_ptr, g_ptr, c_r_ptr, c_i_ptr, log_r_ptr, theta_ptr, state_ptr, out_ptr,
    N, S, D, n_chunks,
    stride_xb, stride_xn, stride_mb, stride_mn, stride_ms,
    CHUNK: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr, REVERSE: tl.constexpr,
    MASK_GRAD: tl.constexpr, SUBTRACT_INPUT: tl.constexpr, ACCUMULATE: tl.constexpr,
):
    """Rescan a chunk of the order-1 scan of x from its incoming state and fuse the readout.

    MASK_GRAD = False: y[n, :] (+)= sum_k mask[n, k] Re(C_k L_n)   into out (B, N, D)
    MASK_GRAD = True:  out[pid_d, n, k] (+)= sum_{d in block} G[n, d] Re(C_k L_n)   into out (D blocks, B, N, S)
    with L_n the scan state, minus x_n if SUBTRACT_INPUT (the bilateral sum counts x_n twice)."""
    chunk, pid_d, b, offs_s, offs_d, tile, a_r, a_i, c_r, c_i = _readout_program(
        log_r_ptr, theta_ptr, c_r_ptr, c_i_ptr, S, D, BLOCK_S, BLOCK_D)
    p_r = tl.load(state_ptr + _state_offsets(b, chunk, n_chunks, 0, offs_s, offs_d, S, D, 2), mask=tile, other=0.0)
    p_i = tl.load(state_ptr + _state_offsets(b, chunk, n_chunks, 1, offs_s, offs_d, S, D, 2), mask=tile, other=0.0)
    for j in range(CHUNK):
        n = _position(chunk, j, CHUNK, REVERSE)
        in_d = (offs_d < D) & ((offs_d * 0 + n) < N)
        in_s = (offs_s < S) & ((offs_s * 0 + n) < N)
        x = tl.load(x_ptr + b * stride_xb + n * stride_xn + offs_d, mask=in_d, other=0.0)
        p_r, p_i = a_r * p_r - a_i * p_i + x[None, :], a_r * p_i + a_i * p_r
        l_r = p_r
        if SUBTRACT_INPUT:
            l_r = p_r - x[None, :]
        readout = c_r * l_r - c_i * p_i  # Re(C L), (BLOCK_S, BLOCK_D)
        if MASK_GRAD:
            g = tl.load(g_ptr + b * stride_xb + n * stride_xn + offs_d, mask=in_d, other=0.0)
            dmask = tl.sum(readout * g[None, :], axis=1)
            out_off = ((pid_d * tl.num_programs(2) + b) * N + n) * S + offs_s
            if ACCUMULATE:
                dmask += tl.load(out_ptr + out_off, mask=in_s, other=0.0)
            tl.store(out_ptr + out_off, dmask, mask=in_s)
        else:
            m = tl.load(mask_ptr + b * stride_mb + n * stride_mn + offs_s * stride_ms, mask=in_s, other=0.0)
            y = tl.sum(m[:, None] * readout, axis=0)
            out_off = b * stride_xb + n * stride_xn + offs_d
            if ACCUMULATE:
                y += tl.load(out_ptr + out_off, mask=in_d, other=0.0)
            tl.store(out_ptr + out_off, y, mask=in_d)


@triton.jit
def _backward_readout_kernel(
    x_ptr, mask_ptr, g_ptr, c_r_ptr, c_i_ptr, log_r_ptr, theta_ptr, state_ptr,
    dx_ptr, dc_ptr, dlog_a_ptr,
    N, S, D, n_chunks,
    stride_xb, stride_xn, stride_mb, stride_mn, stride_ms,
    CHUNK: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr, REVERSE: tl.constexpr,
    SUBTRACT_INPUT: tl.constexpr, ACCUMULATE: tl.constexpr,
):
    """Rescan a chunk of the order-2 scan of u = mask * G from its incoming state and reduce it into
    dx (B, N, D) (+=), the chunk's dC partial (B, n_chunks, 2, S, D) and its dlog_a partial
    (B, n_chunks, D blocks, 2, S).
    SUBTRACT_INPUT removes u_n from U_n in dx and dC (the bilateral adjoint counts u_n twice); the a-gradient uses
    UU - U, which already excludes the zero lag."""
    chunk, pid_d, b, offs_s, offs_d, tile, a_r, a_i, c_r, c_i = _readout_program(
        log_r_ptr, theta_ptr, c_r_ptr, c_i_ptr, S, D, BLOCK_S, BLOCK_D)
    p_r = tl.load(state_ptr + _state_offsets(b, chunk, n_chunks, 0, offs_s, offs_d, S, D, 4), mask=tile, other=0.0)
    p_i = tl.load(state_ptr + _state_offsets(b, chunk, n_chunks, 1, offs_s, offs_d, S, D, 4), mask=tile, other=0.0)
    q_r = tl.load(state_ptr + _state_offsets(b, chunk, n_chunks, 2, offs_s, offs_d, S, D, 4), mask=tile, other=0.0)
    q_i = tl.load(state_ptr + _state_offsets(b, chunk, n_chunks, 3, offs_s, offs_d, S, D, 4), mask=tile, other=0.0)
    dc_r = tl.zeros((BLOCK_S, BLOCK_D), dtype=tl.float32)
    dc_i = tl.zeros((BLOCK_S, BLOCK_D), dtype=tl.float32)
    xw_r = tl.zeros((BLOCK_S, BLOCK_D), dtype=tl.float32)  # sum_n x_n (UU - U)_n, times C at the end
    xw_i = tl.zeros((BLOCK_S, BLOCK_D), dtype=tl.float32)
    for j in range(CHUNK):
        n = _position(chunk, j, CHUNK, REVERSE)
        in_d = (offs_d < D) & ((offs_d * 0 + n) < N)
        in_s = (offs_s < S) & ((offs_s * 0 + n) < N)
        x = tl.load(x_ptr + b * stride_xb + n * stride_xn + offs_d, mask=in_d, other=0.0)
        g = tl.load(g_ptr + b * stride_xb + n * stride_xn + offs_d, mask=in_d, other=0.0)
        m = tl.load(mask_ptr + b * stride_mb + n * stride_mn + offs_s * stride_ms, mask=in_s, other=0.0)
        u = m[:, None] * g[None, :]
        p_r, p_i = a_r * p_r - a_i * p_i + u, a_r * p_i + a_i * p_r
        q_r, q_i = a_r * q_r - a_i * q_i + p_r, a_r * q_i + a_i * q_r + p_i
        l_r = p_r
        if SUBTRACT_INPUT:
            l_r = p_r - u
        dx = tl.sum(c_r * l_r - c_i * p_i, axis=0)
        dx_off = b * stride_xb + n * stride_xn + offs_d
        if ACCUMULATE:
            dx += tl.load(dx_ptr + dx_off, mask=in_d, other=0.0)
        tl.store(dx_ptr + dx_off, dx, mask=in_d)
        dc_r += x[None, :] * l_r
        dc_i -= x[None, :] * p_i
        xw_r += x[None, :] * (q_r - p_r)
        xw_i += x[None, :] * (q_i - p_i)
    tl.store(dc_ptr + _state_offsets(b, chunk, n_chunks, 0, offs_s, offs_d, S, D, 2), dc_r, mask=tile)
    tl.store(dc_ptr + _state_offsets(b, chunk, n_chunks, 1, offs_s, offs_d, S, D, 2), dc_i, mask=tile)
    w_r = tl.sum(c_r * xw_r - c_i * xw_i, axis=1)
    w_i = tl.sum(c_r * xw_i + c_i * xw_r, axis=1)
    w_off = (((b * n_chunks + chunk) * tl.num_programs(1) + pid_d) * 2) * S + offs_s
    tl.store(dlog_a_ptr + w_off, w_r, mask=offs_s < S)
    tl.store(dlog_a_ptr + w_off + S, w_i, mask=offs_s < S)
