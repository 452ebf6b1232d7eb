"""Shared helpers of the STLT tests: random op inputs, and one intra-op thread for their small tensors."""

import math

import pytest
import torch


@pytest.fixture
def one_thread():
    # Tensors this small gain nothing from intra-op threads, and on a busy machine the thread hand-offs cost ~10x.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def make_inputs(B, N, D, S, *, per_position, dtype=torch.float64, seed=0):
    """Random op inputs with decays from fast to slow (|a| up to ~0.99) and frequencies up to Nyquist."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, N, D, generator=g, dtype=dtype)
    sigma = torch.rand(S, generator=g, dtype=dtype) * 0.5 + 1e-3
    omega = (torch.rand(S, generator=g, dtype=dtype) * 2 - 1) * math.pi
    T = torch.tensor(12.0, dtype=dtype)
    C = torch.randn(S, D, generator=g, dtype=dtype) + 1j * torch.randn(S, D, generator=g, dtype=dtype)
    mask_shape = (B, N, S) if per_position else (B, S)
    mask = torch.rand(mask_shape, generator=g, dtype=dtype)
    return [t.requires_grad_() for t in (x, sigma, omega, T, C, mask)]


def assert_causal(mix, *, per_position, dtype=torch.float64, atol=1e-12, device="cpu"):
    """`mix(x, sigma, omega, T, C, mask, causal)` -> y: changing the inputs and mask entries after position t leaves
    a causal mix's outputs at <= t unchanged, in value and in the gradient they send back to positions <= t, while
    the later outputs, and a bilateral mix's earlier ones, do change."""
    B, N, D, S, t = 2, 23, 4, 5, 9
    inputs = [v.detach().to(device=device, dtype=v.dtype if v.is_complex() else dtype)
              for v in make_inputs(B, N, D, S, per_position=per_position, seed=3)]
    x, mask = inputs[0], inputs[5]
    changed_x, changed_mask = x.clone(), mask.clone()
    changed_x[:, t + 1:] = changed_x[:, t + 1:] * 5 + 1
    if per_position:
        changed_mask[:, t + 1:] = 1 - changed_mask[:, t + 1:]
    outputs = {}
    for causal in (True, False):
        for name, (xs, ms) in {"x": (x, mask), "changed": (changed_x, changed_mask)}.items():
            xs = xs.clone().requires_grad_()
            y = mix(xs, *inputs[1:5], ms, causal=causal)
            (grad,) = torch.autograd.grad(y[:, : t + 1].sum(), xs)
            outputs[causal, name] = (y.detach().cpu(), grad.cpu())
    (y, grad), (y_changed, grad_changed) = outputs[True, "x"], outputs[True, "changed"]
    torch.testing.assert_close(y_changed[:, : t + 1], y[:, : t + 1], rtol=0, atol=atol)
    torch.testing.assert_close(grad_changed, grad, rtol=0, atol=atol)
    assert grad[:, t + 1:].abs().max() <= atol  # no early output depends on a later input (FFT rounding aside)
    assert (y_changed[:, t + 1:] - y[:, t + 1:]).abs().max() > 1e-2
    bilateral, bilateral_changed = outputs[False, "x"][0], outputs[False, "changed"][0]
    assert (bilateral_changed[:, : t + 1] - bilateral[:, : t + 1]).abs().max() > 1e-2
