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
