"""The Triton STLT kernels against the reference, forward and backward, on small shapes.

On a machine without a GPU they run through Triton's interpreter: TRITON_INTERPRET must be set before the kernel
module is imported (it is imported lazily, on the first triton call), which this module and conftest both ensure.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from models.stlt import stlt_mix  # noqa: E402
from models.stlt.triton_op import stlt_mix_triton  # noqa: E402
from tests.stlt_fixtures import assert_causal, make_inputs, one_thread  # noqa: E402, F401

pytestmark = [pytest.mark.triton, pytest.mark.usefixtures("one_thread")]
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
NAMES = ("x", "sigma", "omega", "T", "C", "mask")


def compare_with_reference(B, N, D, S, *, causal, per_position, seed=0, **launch):
    inputs = make_inputs(B, N, D, S, per_position=per_position, seed=seed)
    grad_out = torch.randn(B, N, D, dtype=torch.float64, generator=torch.Generator().manual_seed(seed + 1))
    y_ref = stlt_mix(*inputs, delta=0.9, causal=causal, backend="reference")
    g_ref = torch.autograd.grad(y_ref, inputs, grad_out)
    on_device = [t.detach().to(DEVICE).requires_grad_() for t in inputs]
    if launch:
        y = stlt_mix_triton(*on_device, delta=0.9, causal=causal, **launch)
    else:
        y = stlt_mix(*on_device, delta=0.9, causal=causal, backend="triton")
    grads = torch.autograd.grad(y, on_device, grad_out.to(DEVICE))
    # The kernels compute in float32: compare with the float64 reference at float32 accuracy.
    torch.testing.assert_close(y.cpu(), y_ref, rtol=1e-4, atol=1e-5 * y_ref.abs().max().item())
    for name, got, ref in zip(NAMES, grads, g_ref):
        torch.testing.assert_close(got.cpu(), ref, rtol=1e-4, atol=1e-5 * ref.abs().max().item(),
                                   msg=lambda m, name=name: f"d{name}: {m}")


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("per_position", [False, True])
def test_triton_matches_reference_across_chunks(causal, per_position):
    """13 positions in chunks of 4: three full chunks and a partial one, carried in both directions."""
    compare_with_reference(2, 13, 6, 3, causal=causal, per_position=per_position, chunk=4)


@pytest.mark.parametrize("causal", [False, True])
def test_triton_matches_reference_with_padded_node_and_channel_blocks(causal):
    """S = 5 pads to 8 nodes; D = 20 in blocks of 16 leaves a partial channel block; N = 9 in chunks of 8."""
    compare_with_reference(1, 9, 20, 5, causal=causal, per_position=True, seed=3, chunk=8, block_d=16)


def test_triton_public_op_with_default_geometry():
    """Through stlt_mix(backend="triton"): 70 positions = one full default chunk of 64 and a partial one."""
    compare_with_reference(1, 70, 4, 2, causal=False, per_position=False, seed=5)


@pytest.mark.parametrize("causal", [False, True])
def test_triton_single_position_and_node(causal):
    compare_with_reference(2, 1, 3, 1, causal=causal, per_position=False, seed=7)


@pytest.mark.parametrize("per_position", [False, True])
def test_triton_is_causal(per_position):
    """The kernels on their own (float32, chunks of 4 so that the change crosses chunk borders): a causal mix never
    reads a later position, forward or backward."""
    assert_causal(lambda *args, causal: stlt_mix_triton(*args, delta=1.0, causal=causal, chunk=4),
                  per_position=per_position, dtype=torch.float32, atol=1e-6, device=DEVICE)


class LaunchCounter:
    """Stands in for a kernel object and counts `kernel[grid](...)` launches."""

    def __init__(self, kernel, counts, name):
        self.kernel, self.counts, self.name = kernel, counts, name

    def __getitem__(self, grid):
        self.counts[self.name] = self.counts.get(self.name, 0) + 1
        return self.kernel[grid]


def test_triton_runs_in_forward_and_backward(monkeypatch):
    from models.stlt import op, triton_kernels

    def forbidden(*args, **kwargs):
        raise AssertionError("the triton backend fell back to a torch path")

    monkeypatch.setattr(op, "stlt_mix_fft", forbidden)
    monkeypatch.setattr(op, "stlt_mix_reference", forbidden)
    counts = {}
    names = ["_chunk_state_kernel", "_chunk_carry_kernel", "_forward_readout_kernel", "_backward_readout_kernel"]
    for name in names:
        monkeypatch.setattr(triton_kernels, name, LaunchCounter(getattr(triton_kernels, name), counts, name))

    inputs = [t.detach().to(DEVICE).requires_grad_() for t in make_inputs(1, 6, 3, 2, per_position=True)]
    y = stlt_mix(*inputs, causal=True, backend="triton")
    forward = dict(counts)
    counts.clear()
    y.backward(torch.ones_like(y))
    backward = dict(counts)

    # Forward: one causal scan (chunk states, carry, fused readout). Backward: the anti-causal order-2 scan of the
    # adjoint (dx, dC, d log a) and, since the mask needs a gradient, a causal rescan for dmask.
    assert forward == {"_chunk_state_kernel": 1, "_chunk_carry_kernel": 1, "_forward_readout_kernel": 1}
    assert backward == {"_chunk_state_kernel": 2, "_chunk_carry_kernel": 2, "_forward_readout_kernel": 1,
                        "_backward_readout_kernel": 1}
    assert all(t.grad is not None and torch.isfinite(t.grad).all() for t in inputs)
