"""The functional STLT op: the reference against the design's recurrences, gradcheck, the algorithms of the torch
backend (the FFT convolution, the chunked scan, the mix in matrix products) against the reference forward and
backward, their memory audit, the measured choice between them, and input errors (Triton backend:
tests/test_stlt_triton.py)."""

from functools import partial

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from models.stlt import fftconv, matmul, op, stlt_mix
from models.stlt.chunked import stlt_mix_chunked
from models.stlt.fftconv import stlt_mix_fft
from models.stlt.matmul import stlt_mix_matmul
from tests.stlt_fixtures import assert_causal, make_inputs, one_thread  # noqa: F401

pytestmark = pytest.mark.usefixtures("one_thread")


# The torch backend's algorithms, called directly so that each meets every case whatever the measured choice; the
# chunked ones in chunks of 4, so that short test sequences cross many chunk borders and end in a partial chunk, and
# the matrix-product mix also in its default chunks (16: the last one partial, or the whole of a short sequence).
TORCH_ALGORITHMS = {
    "fft": stlt_mix_fft,
    "chunked": lambda *args, **kwargs: stlt_mix_chunked(*args, chunk=4, **kwargs),
    "matmul": lambda *args, **kwargs: stlt_mix_matmul(*args, chunk=4, **kwargs),
    "matmul_default_chunk": stlt_mix_matmul,
}


def mix_and_grads(inputs, grad_out, *, backend, **kwargs):
    fn = TORCH_ALGORITHMS[backend] if backend in TORCH_ALGORITHMS else partial(stlt_mix, backend=backend)
    y = fn(*inputs, **kwargs)
    return y, torch.autograd.grad(y, inputs, grad_out)


def explicit_recurrence(x, sigma, omega, T, C, mask, *, delta, causal):
    """The design's recurrences, one position at a time: f_n = a f_{n-1} + x_n, g_n = a g_{n+1} + x_n,
    L = f + g - x (bilateral) or f (causal), y = sum_k mask Re(C_k L_k)."""
    B, N, D = x.shape
    a = torch.exp(-(sigma + 1 / T + 1j * omega) * delta)[:, None]  # (S, 1)
    xc = x.to(C.dtype)
    f, g = [None] * N, [None] * N
    state = torch.zeros(B, len(sigma), D, dtype=C.dtype)
    for n in range(N):
        state = a * state + xc[:, n, None]
        f[n] = state
    state = torch.zeros_like(state)
    for n in reversed(range(N)):
        state = a * state + xc[:, n, None]
        g[n] = state
    L = torch.stack(f, 1) if causal else torch.stack(f, 1) + torch.stack(g, 1) - xc[:, :, None]
    m = mask[:, None] if mask.dim() == 2 else mask
    return torch.einsum("bnk,bnkd->bnd", m, (C * L).real)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("per_position", [False, True])
def test_reference_is_the_design_recurrence(causal, per_position):
    inputs = [t.detach() for t in make_inputs(2, 9, 3, 4, per_position=per_position)]
    expected = explicit_recurrence(*inputs, delta=0.8, causal=causal)
    got = stlt_mix(*inputs, delta=0.8, causal=causal, backend="reference")
    torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("per_position", [False, True])
def test_reference_gradcheck(causal, per_position):
    inputs = make_inputs(2, 5, 2, 3, per_position=per_position)
    assert torch.autograd.gradcheck(
        lambda *args: stlt_mix(*args, delta=0.7, causal=causal, backend="reference"), inputs, eps=1e-6, atol=1e-6
    )


@pytest.mark.parametrize("algorithm", list(TORCH_ALGORITHMS))
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("per_position", [False, True])
@pytest.mark.parametrize(("N", "S"), [(1, 1), (7, 5), (37, 3), (64, 16), (101, 8)])
def test_torch_algorithms_match_reference_forward_and_backward(algorithm, causal, per_position, N, S):
    inputs = make_inputs(2, N, 6, S, per_position=per_position, seed=N * 100 + S)
    grad_out = torch.randn(2, N, 6, dtype=torch.float64)
    y_ref, g_ref = mix_and_grads(inputs, grad_out, delta=0.9, causal=causal, backend="reference")
    y, grads = mix_and_grads(inputs, grad_out, delta=0.9, causal=causal, backend=algorithm)
    torch.testing.assert_close(y, y_ref, rtol=1e-10, atol=1e-10)
    for name, got, ref in zip(("x", "sigma", "omega", "T", "C", "mask"), grads, g_ref):
        torch.testing.assert_close(got, ref, rtol=1e-9, atol=1e-9, msg=lambda m, name=name: f"d{name}: {m}")


@pytest.mark.parametrize("backend", ["reference", "torch", *TORCH_ALGORITHMS])
@pytest.mark.parametrize("per_position", [False, True])
def test_every_cpu_backend_is_causal(backend, per_position):
    """Each backend on its own, not through its agreement with the reference: a causal mix never reads a later
    position, forward or backward."""
    fn = TORCH_ALGORITHMS[backend] if backend in TORCH_ALGORITHMS else partial(stlt_mix, backend=backend)
    assert_causal(fn, per_position=per_position)


@pytest.mark.parametrize("algorithm", ["fft", "chunked", "matmul"])
@pytest.mark.parametrize("per_position", [False, True])
def test_torch_algorithms_in_float32_stay_close_to_float64(algorithm, per_position):
    """300 positions in each algorithm's default chunks (the chunked ones end in a partial chunk)."""
    inputs = make_inputs(2, 300, 8, 6, per_position=per_position)
    y64 = stlt_mix(*inputs, causal=True, backend="reference")
    inputs32 = [t.detach().to(torch.complex64 if t.is_complex() else torch.float32) for t in inputs]
    y32 = op.TORCH_ALGORITHMS[algorithm](*inputs32, causal=True)
    assert y32.dtype == torch.float32
    torch.testing.assert_close(y32.double(), y64, rtol=1e-4, atol=1e-4 * y64.abs().max().item())


@pytest.mark.parametrize("per_position", [False, True])
@pytest.mark.parametrize("causal", [False, True])
def test_torch_backend_takes_the_measured_fastest_algorithm(per_position, causal, monkeypatch):
    """The table of measured winners decides, per mask kind and direction, from each entry's first length on."""
    key = ("position" if per_position else "sequence", "causal" if causal else "bilateral")
    monkeypatch.setitem(op.FASTEST_FROM_N, key, ((1, "matmul"), (5, "fft"), (9, "chunked")))
    called = []
    for name in op.TORCH_ALGORITHMS:
        # Stand-ins that only record the call and the arguments they were given.
        monkeypatch.setitem(op.TORCH_ALGORITHMS, name, lambda x, *args, name=name, **kwargs:
                            called.append((name, kwargs["causal"], args[-1].dim() == 3)) or torch.zeros_like(x))
    for N in (1, 4, 5, 8, 9, 100):
        inputs = [t.detach() for t in make_inputs(1, N, 2, 2, per_position=per_position)]
        stlt_mix(*inputs, causal=causal, backend="torch")
    names = ["matmul", "matmul", "fft", "fft", "chunked", "chunked"]
    assert called == [(name, causal, per_position) for name in names]


def test_measured_table_covers_every_case_from_one_position():
    assert set(op.FASTEST_FROM_N) == {(kind, direction) for kind in ("sequence", "position")
                                      for direction in ("bilateral", "causal")}
    for entries in op.FASTEST_FROM_N.values():
        starts = [start for start, _ in entries]
        assert starts[0] == 1 and starts == sorted(set(starts))
        assert all(name in op.TORCH_ALGORITHMS for _, name in entries)


def test_calibration_puts_boundaries_between_the_measured_winners():
    fastest_from_n = op.fastest_from_n
    rows = {64: {"fft": 1.0, "matmul": 2.0}, 256: {"fft": 1.0, "matmul": 0.5}, 1024: {"fft": 3.0, "matmul": 1.0},
            4096: {"fft": 2.0, "matmul": 3.0}}
    assert fastest_from_n(rows) == ((1, "fft"), (128, "matmul"), (2048, "fft"))
    assert fastest_from_n({64: {"chunked": 1.0}}) == ((1, "chunked"),)
    # A lead within the margin of noise does not switch; an algorithm no longer timed (too slow) does.
    assert fastest_from_n({64: {"fft": 1.0, "chunked": 1.05}, 256: {"fft": 1.0, "chunked": 0.95}}) == ((1, "fft"),)
    assert fastest_from_n({64: {"fft": 1.0, "chunked": 1.5}, 256: {"chunked": 2.0}}) == ((1, "fft"), (128, "chunked"))


def test_auto_backend_on_cpu_is_the_torch_path():
    inputs = [t.detach() for t in make_inputs(1, 10, 3, 2, per_position=False)]
    assert torch.equal(stlt_mix(*inputs), stlt_mix(*inputs, backend="torch"))


class ByteAudit(TorchDispatchMode):
    """Largest tensor (in bytes) any op creates, forward and backward."""

    def __init__(self):
        super().__init__()
        self.largest, self.largest_op = 0, None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.numel() * t.element_size() > self.largest:
                self.largest, self.largest_op = t.numel() * t.element_size(), str(func)
        return out


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("per_position", [False, True])
def test_torch_algorithms_never_materialise_B_N_S_D(causal, per_position):
    B, N, D, S = 2, 512, 8, 16
    inputs = make_inputs(B, N, D, S, per_position=per_position)
    limit = B * N * S * D * inputs[0].element_size()
    chunked = partial(stlt_mix_chunked, chunk=64)  # 8 chunks, each direction carried across 7 borders
    fits = (stlt_mix_fft, chunked, stlt_mix_matmul)  # the matrix products in 32 chunks of 16
    for fn, should_fit in [(fn, True) for fn in fits] + [(partial(stlt_mix, backend="reference"), False)]:
        with ByteAudit() as audit:
            y = fn(*inputs, causal=causal)
            torch.autograd.grad(y, inputs, torch.ones_like(y))
        # The reference must trip the audit, or the audit proves nothing.
        assert (audit.largest < limit) == should_fit, (fn, audit.largest, audit.largest_op, limit)


@pytest.mark.parametrize("algorithm", list(TORCH_ALGORITHMS))
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("per_position", [False, True])
def test_torch_algorithms_in_channel_blocks_and_node_groups(algorithm, causal, per_position, monkeypatch):
    """Cache budgets small enough to split 10 channels in blocks of 8 (one partial) and 23 nodes in groups of 3 (the
    FFT convolutions), and chunks in groups of 3 and 2 (the matrix products: lags, and states across chunks)."""
    monkeypatch.setattr(fftconv, "CHANNEL_BLOCK_NUMBERS", 1)
    monkeypatch.setattr(fftconv, "NODE_GROUP_NUMBERS", 2 * 8 * 32 * 3)
    assert fftconv.channel_block(2, 10, 32) == 8 and fftconv.node_group_size(2, 23, 10, 8, 32) == 3
    monkeypatch.setattr(matmul, "GROUP_NUMBERS", 3 * 4 * 10)  # 3 chunks of 4 positions by 10 channels
    monkeypatch.setattr(matmul, "CARRY_GROUP_NUMBERS", 2 * 2 * 10 * 23)  # 2 chunks of B = 2 by 10 channels by 23 nodes
    inputs = make_inputs(2, 13, 10, 23, per_position=per_position, seed=11)
    grad_out = torch.randn(2, 13, 10, dtype=torch.float64)
    y_ref, g_ref = mix_and_grads(inputs, grad_out, causal=causal, backend="reference")
    y, grads = mix_and_grads(inputs, grad_out, causal=causal, backend=algorithm)
    torch.testing.assert_close(y, y_ref, rtol=1e-10, atol=1e-10)
    for got, ref in zip(grads, g_ref):
        torch.testing.assert_close(got, ref, rtol=1e-9, atol=1e-9)


def test_fft_size_is_smallest_5_smooth_at_least_n():
    def smooth(m):
        for p in (2, 3, 5):
            while m % p == 0:
                m //= p
        return m == 1

    for n in range(1, 400):
        size = fftconv.fft_size(n)
        assert size >= n and smooth(size) and not any(smooth(m) for m in range(n, size))


@pytest.mark.parametrize(
    ("change", "argument"),
    [
        (lambda a: a.update(x=a["x"][0]), "x"),
        (lambda a: a.update(sigma=a["sigma"][:, None]), "sigma"),
        (lambda a: a.update(omega=a["omega"][:-1]), "omega"),
        (lambda a: a.update(T=torch.ones(2)), "T"),
        (lambda a: a.update(C=a["C"].real), "C"),
        (lambda a: a.update(C=a["C"][:, :-1]), "C"),
        (lambda a: a.update(mask=a["mask"][:, :-1]), "mask"),
        (lambda a: a.update(delta=0.0), "delta"),
        (lambda a: a.update(backend="cuda"), "backend"),
    ],
)
def test_bad_inputs_name_the_argument(change, argument):
    x, sigma, omega, T, C, mask = (t.detach() for t in make_inputs(2, 5, 3, 4, per_position=False))
    args = dict(x=x, sigma=sigma, omega=omega, T=T, C=C, mask=mask, delta=1.0, backend="auto")
    change(args)
    with pytest.raises(ValueError, match=f"^{argument}:"):
        stlt_mix(args.pop("x"), args.pop("sigma"), args.pop("omega"), args.pop("T"), args.pop("C"), args.pop("mask"),
                 **args)
