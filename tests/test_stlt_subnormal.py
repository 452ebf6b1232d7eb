"""The torch paths of the STLT mix never compute with subnormal floats, whose arithmetic x86 cores run several times
slower (models/stlt/subnormal.py): not with the initial spread of decays (sigma up to 10, whose powers underflow
float32 within 9 steps), nor with masks that underflowed themselves. What they drop leaves the mix and its gradients
at the float64 definition's values, and a flushed mask entry still gets its exact gradient."""

import math
from functools import partial

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from models.stlt import op, stlt_mix
from models.stlt.chunked import stlt_mix_chunked
from models.stlt.fftconv import stlt_mix_fft
from models.stlt.matmul import stlt_mix_matmul
from models.stlt.subnormal import decay_powers, flush_subnormals
from tests.stlt_fixtures import one_thread  # noqa: F401

pytestmark = pytest.mark.usefixtures("one_thread")

ALGORITHMS = {
    "fft": stlt_mix_fft,
    "chunked": partial(stlt_mix_chunked, chunk=64),  # 4 chunks of 64: states carried across 3 borders
    "matmul": stlt_mix_matmul,  # chunks of 16
}


def subnormals(t: torch.Tensor) -> int:
    real = torch.view_as_real(t.resolve_conj()) if t.is_complex() else t
    return int(((real != 0) & (real.abs() < torch.finfo(real.dtype).tiny)).sum())


class SubnormalAudit(TorchDispatchMode):
    """Every op that computes a floating output holding subnormal numbers, forward and backward. Views and
    uninitialised allocations compute nothing (what they show is written, and audited, elsewhere)."""

    UNINITIALISED = {"empty", "new_empty", "empty_like", "empty_strided"}

    def __init__(self):
        super().__init__()
        self.found = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.is_view or func.overloadpacket.__name__ in self.UNINITIALISED:
            return out
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and (t.is_floating_point() or t.is_complex()):
                count = subnormals(t)
                if count:
                    self.found[str(func)] = self.found.get(str(func), 0) + count
        return out


def initial_spread_inputs(per_position: bool, *, B=2, N=256, D=8, S=16, seed=0):
    """float32 inputs with the mixer's initial decays (sigma log-spaced over [1e-3, 10]) and masks of which some
    entries are subnormal (logits past -87) and some tiny but normal."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, N, D, generator=g)
    sigma = torch.logspace(-3, 1, S)
    omega = torch.rand(S, generator=g) * math.pi
    T = torch.tensor(16.0)
    C = torch.complex(torch.randn(S, D, generator=g), torch.randn(S, D, generator=g)) / S
    mask = torch.rand((B, N, S) if per_position else (B, S), generator=g)
    picks = torch.rand(mask.shape, generator=g)
    mask = torch.where(picks < 0.1, 1e-41, torch.where(picks < 0.2, 1e-30, mask))
    assert subnormals(mask) > 0
    return [t.requires_grad_() for t in (x, sigma, omega, T, C, mask)]


@pytest.mark.parametrize("algorithm", list(ALGORITHMS))
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("per_position", [False, True])
def test_torch_paths_form_no_subnormal_number(algorithm, causal, per_position, monkeypatch):
    monkeypatch.setattr(op, "torch_algorithm", lambda N, **kwargs: algorithm)
    monkeypatch.setitem(op.TORCH_ALGORITHMS, algorithm, ALGORITHMS[algorithm])
    inputs = initial_spread_inputs(per_position)
    grad_out = torch.randn(2, 256, 8, generator=torch.Generator().manual_seed(1))
    with SubnormalAudit() as audit:
        y = stlt_mix(*inputs, causal=causal, backend="torch")
        grads = torch.autograd.grad(y, inputs, grad_out)
    assert audit.found == {}
    # What was dropped is under float32's rounding: the float64 definition, on the unflushed inputs, agrees.
    inputs64 = [t.detach().to(torch.complex128 if t.is_complex() else torch.float64).requires_grad_()
                for t in inputs]
    y64 = stlt_mix(*inputs64, causal=causal, backend="reference")
    grads64 = torch.autograd.grad(y64, inputs64, grad_out.double())
    torch.testing.assert_close(y.double(), y64, rtol=1e-4, atol=1e-5 * y64.abs().max().item())
    for name, got, ref in zip(("x", "sigma", "omega", "T", "C", "mask"), grads, grads64):
        torch.testing.assert_close(got.to(ref.dtype), ref, rtol=1e-3, atol=1e-4 * ref.abs().max().item(),
                                   msg=lambda m, name=name: f"d{name}: {m}")


def test_the_audit_sees_subnormal_numbers():
    """Unflushed powers of the initial spread do form them: the audit above can fail."""
    log_a = -(torch.logspace(-3, 1, 16) + 1 / 16)
    with SubnormalAudit() as audit:
        torch.exp(torch.arange(17.0)[:, None] * log_a)
    assert audit.found


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_decay_powers_are_the_powers_down_to_the_floor_then_zero(dtype):
    floor = torch.finfo(dtype).tiny ** (1 / 3)
    log_a = torch.complex(-torch.logspace(-3, 1, 16, dtype=dtype), torch.linspace(0, math.pi, 16, dtype=dtype))
    t = torch.arange(200, dtype=dtype)[:, None]
    with SubnormalAudit() as audit:
        powers = decay_powers(log_a, t)
    assert audit.found == {}
    plain = torch.exp(t * log_a)
    kept = torch.exp(t * log_a.real) >= floor
    assert (~kept).any() and kept.any() and subnormals(plain[~kept]) > 0
    assert torch.equal(powers[kept], plain[kept])  # the same numbers, where kept
    assert not powers[~kept].any()


def test_flushed_mask_entries_keep_their_exact_gradient():
    mask = torch.tensor([1e-41, -1e-41, 1e-30, 1e-12, 0.5, -3.0], requires_grad=True)
    with SubnormalAudit() as audit:
        flushed = flush_subnormals(mask)
        (grad,) = torch.autograd.grad(flushed, mask, torch.arange(1.0, 7.0))
    assert audit.found == {}
    assert flushed.tolist() == [0.0, 0.0, 0.0, pytest.approx(1e-12), 0.5, -3.0]
    assert grad.tolist() == [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]
