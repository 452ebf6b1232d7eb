"""The Triton STLT mix as an autograd.Function: fused forward and backward kernels (models/stlt/triton_kernels.py).

The function works on the decay in log form, log a_k = log_r_k + i theta_k, and on C split into real and imaginary
parts; torch autograd carries the gradients on to sigma, omega, T and the complex C outside it.

Backward (G = dL/dy, u = mask * G, K the scan operator, K^T its adjoint: anti-causal for a causal K, K itself when
bilateral):
    dx         = sum_k Re(C_k U_k),               U = K^T u
    dC         = sum_{b,n} x conj(U)
    dL/dlog a  = sum_{b,n,d} C x sum_m |n-m| a^{|n-m|} u_m,   and sum_{m>=n} (m-n) a^{m-n} u_m = (UU - U)_n
                 with UU the same scan applied to U (a second-order recurrence in the same pass)
    dmask      = sum_d G Re(C L)                  (needs L: one more forward-direction pass, skipped if not needed)
State memory is B * N/chunk * S * D per component, not B * N * S * D.
"""

from __future__ import annotations

import importlib
from contextlib import contextmanager, nullcontext

import torch

from models.stlt.naive import decay_log

DEFAULT_CHUNK = 64
# Numbers in one program's (nodes x channels) fp32 tiles: the forward passes hold about 6 such tiles in registers,
# the backward readout 10; at most MAX_BLOCK_D channels. Nodes all sit in one program (the readout sums over them),
# so the node count is bounded. Compiled for sm_90 at 4 warps (tests/test_stlt_compile.py checks every launch
# variant): 128 nodes spill in the backward pass's chunk carry (128 x 16 tiles), and blocks of 128 channels or more
# in the chunk-state and backward-readout kernels; within these bounds nothing spills.
FORWARD_TILE, BACKWARD_TILE, MAX_BLOCK_D, MAX_NODES = 2048, 1024, 64, 64

_kernel_module = None  # a stand-in while launch_variants() records the launches


def _kernels():
    # Imported on first use so that importing models never imports triton (TRITON_INTERPRET must be set before the
    # kernels are defined, and a CPU-only install may lack a driver).
    return _kernel_module or importlib.import_module("models.stlt.triton_kernels")


def _next_pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


class _Plan:
    """Launch geometry shared by the passes of one call. It depends on the number of nodes alone (and on `chunk` and
    `block_d` when a test sets them), so the kernels are specialised for few geometries, all of which
    launch_variants() finds: short sequences step over empty positions in their one chunk, and few channels leave
    lanes of their one channel block idle, rather than compile a variant of their own."""

    def __init__(self, x: torch.Tensor, num_nodes: int, chunk: int, tile: int, block_d: int | None):
        self.B, self.N, self.D = x.shape
        self.S = num_nodes
        self.chunk = chunk
        self.n_chunks = triton_cdiv(self.N, self.chunk)
        self.block_s = _next_pow2(num_nodes)
        # One program holds a few (nodes x channels) fp32 tiles in registers: about `tile` numbers each.
        self.block_d = block_d or max(16, min(MAX_BLOCK_D, tile // self.block_s))
        self.n_dblocks = triton_cdiv(self.D, self.block_d)

    @property
    def chunk_grid(self):
        return (self.n_chunks, self.n_dblocks, self.B)


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _scan_states(plan, z, w, log_r, theta, *, order: int, reverse: bool):
    """Incoming state of every chunk for the order-1/2 scan of v = w * z (w None: v = z)."""
    k = _kernels()
    state = z.new_empty(plan.B, plan.n_chunks, 2 * order, plan.S, plan.D)
    weighted = w is not None
    w_arg = w if weighted else z
    w_strides = w.stride() if weighted else (0, 0, 0)
    k._chunk_state_kernel[plan.chunk_grid](
        z, w_arg, log_r, theta, state,
        plan.N, plan.S, plan.D, plan.n_chunks,
        z.stride(0), z.stride(1), *w_strides,
        CHUNK=plan.chunk, BLOCK_S=plan.block_s, BLOCK_D=plan.block_d,
        ORDER=order, REVERSE=reverse, WEIGHTED=weighted,
    )
    k._chunk_carry_kernel[(plan.n_dblocks, plan.B)](
        state, log_r, theta, plan.S, plan.D, plan.n_chunks,
        CHUNK=plan.chunk, BLOCK_S=plan.block_s, BLOCK_D=plan.block_d, ORDER=order, REVERSE=reverse,
    )
    return state


def _forward_readout(plan, x, mask, g, c_r, c_i, log_r, theta, out, *, reverse, mask_grad, first):
    state = _scan_states(plan, x, None, log_r, theta, order=1, reverse=reverse)
    _kernels()._forward_readout_kernel[plan.chunk_grid](
        x, mask, g if mask_grad else x, c_r, c_i, log_r, theta, state, out,
        plan.N, plan.S, plan.D, plan.n_chunks,
        x.stride(0), x.stride(1), *mask.stride(),
        CHUNK=plan.chunk, BLOCK_S=plan.block_s, BLOCK_D=plan.block_d, REVERSE=reverse,
        MASK_GRAD=mask_grad, SUBTRACT_INPUT=not first, ACCUMULATE=not first,
    )


def _mix_or_mask_grad(plan, x, mask, g, c_r, c_i, log_r, theta, out, *, causal, mask_grad):
    """y (mask_grad False) or the per-D-block mask gradient (True): the causal scan, plus the anti-causal one minus x
    when bilateral (L = f + g - x)."""
    _forward_readout(plan, x, mask, g, c_r, c_i, log_r, theta, out, reverse=False, mask_grad=mask_grad, first=True)
    if not causal:
        _forward_readout(plan, x, mask, g, c_r, c_i, log_r, theta, out, reverse=True, mask_grad=mask_grad, first=False)


class STLTMixTriton(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, log_r, theta, c_r, c_i, mask, causal: bool, chunk: int, block_d: int | None):
        plan = _Plan(x, log_r.shape[0], chunk, tile=FORWARD_TILE, block_d=block_d)
        y = torch.empty_like(x)
        _mix_or_mask_grad(plan, x, mask, None, c_r, c_i, log_r, theta, y, causal=causal, mask_grad=False)
        ctx.save_for_backward(x, log_r, theta, c_r, c_i, mask)
        ctx.causal, ctx.chunk, ctx.block_d = causal, chunk, block_d
        return y

    @staticmethod
    def backward(ctx, grad_y):
        x, log_r, theta, c_r, c_i, mask = ctx.saved_tensors
        g = grad_y.contiguous().float()
        k = _kernels()
        plan = _Plan(x, log_r.shape[0], ctx.chunk, tile=BACKWARD_TILE, block_d=ctx.block_d)
        dx = torch.empty_like(x)
        dc = torch.zeros(2, plan.S, plan.D, device=x.device, dtype=torch.float32)
        dlog_a = torch.zeros(2, plan.S, device=x.device, dtype=torch.float32)
        # The adjoint of the causal scan runs right to left; the bilateral one adds the left-to-right scan minus u.
        directions = [True] if ctx.causal else [True, False]
        for first, reverse in zip([True, False], directions):
            state = _scan_states(plan, g, mask, log_r, theta, order=2, reverse=reverse)
            dc_part = x.new_empty(plan.B, plan.n_chunks, 2, plan.S, plan.D)
            dlog_a_part = x.new_empty(plan.B, plan.n_chunks, plan.n_dblocks, 2, plan.S)
            k._backward_readout_kernel[plan.chunk_grid](
                x, mask, g, c_r, c_i, log_r, theta, state, dx, dc_part, dlog_a_part,
                plan.N, plan.S, plan.D, plan.n_chunks,
                x.stride(0), x.stride(1), *mask.stride(),
                CHUNK=plan.chunk, BLOCK_S=plan.block_s, BLOCK_D=plan.block_d, REVERSE=reverse,
                SUBTRACT_INPUT=not first, ACCUMULATE=not first,
            )
            dc += dc_part.sum(dim=(0, 1))
            dlog_a += dlog_a_part.sum(dim=(0, 1, 2))
        dmask = None
        if ctx.needs_input_grad[5]:
            partial = x.new_empty(plan.n_dblocks, plan.B, plan.N, plan.S)
            _mix_or_mask_grad(plan, x, mask, g, c_r, c_i, log_r, theta, partial, causal=ctx.causal, mask_grad=True)
            dmask = partial.sum(dim=0)
        # dL = Re(W d(log a)) with log a = log_r + i theta: dL/dlog_r = Re W, dL/dtheta = -Im W.
        return dx, dlog_a[0], -dlog_a[1], dc[0], dc[1], dmask, None, None, None


def stlt_mix_triton(x, sigma, omega, T, C, mask, *, delta: float = 1.0, causal: bool = False,
                    chunk: int = DEFAULT_CHUNK, block_d: int | None = None):
    """The STLT mix on Triton kernels; same contract as `models.stlt.stlt_mix`, for up to MAX_NODES nodes. Computes in
    float32. `chunk` (positions per program) and `block_d` (channels per program, a power of two) override the launch
    geometry: tests use them to cross chunk and channel-block borders on small inputs."""
    B, N, _ = x.shape
    S = sigma.shape[0]
    if S > MAX_NODES:
        raise ValueError(f"sigma: the triton backend takes up to {MAX_NODES} nodes, got {S}")
    log_a = decay_log(sigma, omega, T, delta)
    log_r, theta = log_a.real.float().contiguous(), log_a.imag.float().contiguous()
    c_r = C.real.float().contiguous()
    c_i = C.imag.float().contiguous()
    # A per-sequence mask becomes a (B, N, S) view with stride 0 along positions: the kernels read it by strides.
    weights = mask.float()[:, None, :].expand(B, N, S) if mask.dim() == 2 else mask.float()
    with torch.cuda.device(x.device) if x.is_cuda else nullcontext():
        y = STLTMixTriton.apply(x.float().contiguous(), log_r, theta, c_r, c_i, weights, causal, chunk, block_d)
    return y.to(x.dtype)


def launch_variants() -> list[dict]:
    """Every kernel specialisation the op launches, found by running its own forward and backward (mask gradient
    included) for each node block size and direction under recorded_launches(): the geometry depends on nothing else
    (_Plan). Each variant: kernel name, signature of its positional arguments ("*fp32" tensors, "i32" integers),
    constexprs and num_warps."""
    with recorded_launches() as variants:
        for block_s in (1 << i for i in range(MAX_NODES.bit_length())):
            for causal in (False, True):
                run_forward_and_backward(1, 2, 1, block_s, causal=causal)
    return list(variants.values())


@contextmanager
def recorded_launches():
    """Within it the op's kernels run nothing and record their launches, by specialisation, into the dict yielded."""
    global _kernel_module
    recorder = _LaunchRecorder()
    _kernel_module = recorder
    try:
        yield recorder.variants
    finally:
        _kernel_module = None


def run_forward_and_backward(B: int, N: int, D: int, S: int, *, causal: bool, **launch):
    """One forward and backward of the op (every input needing a gradient) on random float32 CPU tensors."""
    x, sigma, omega, C, mask = (torch.rand(B, N, D), torch.rand(S), torch.rand(S),
                                torch.rand(S, D, dtype=torch.complex64), torch.rand(B, N, S))
    inputs = [t.requires_grad_() for t in (x, sigma, omega, C, mask)]
    y = stlt_mix_triton(x, sigma, omega, torch.tensor(8.0), C, mask, causal=causal, **launch)
    torch.autograd.grad(y, inputs, torch.ones_like(y))


class _LaunchRecorder:
    """Stands in for the kernel module: `kernel[grid](*args, **constexprs)` records the specialisation, runs nothing."""

    def __init__(self):
        self.variants = {}

    def __getattr__(self, name):
        return _RecordingKernel(name, self.variants)


class _RecordingKernel:
    def __init__(self, name, variants):
        self.name, self.variants = name, variants

    def __getitem__(self, grid):
        return self._launch

    def _launch(self, *args, **constexprs):
        num_warps = constexprs.pop("num_warps", 4)
        signature = []
        for arg in args:
            if isinstance(arg, torch.Tensor):
                assert arg.dtype == torch.float32, (self.name, arg.dtype)
                signature.append("*fp32")
            else:
                assert isinstance(arg, int), (self.name, arg)
                signature.append("i32")
        key = (self.name, tuple(sorted(constexprs.items())), num_warps)
        self.variants.setdefault(key, {"kernel": self.name, "signature": signature,
                                       "constexprs": dict(sorted(constexprs.items())), "num_warps": num_warps})
