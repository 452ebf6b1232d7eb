import math

import pytest
import torch

from models.attention import MixedHeadAttention
from models.rope import RotaryEmbedding
from tests.dispatch_audit import ShapeAudit

DIM, HEADS = 48, 4


def make_attention(k, causal, rope=False, seed=0):
    torch.manual_seed(seed)
    rotary = RotaryEmbedding(DIM // HEADS, max_len=64) if rope else None
    return MixedHeadAttention(DIM, HEADS, laplacian_heads=k, causal=causal, qkv_bias=True, rope=rotary).double()


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("k", [0, 1, 3, HEADS])
@pytest.mark.parametrize("rope", [False, True])
def test_fast_path_matches_reference_forward_and_backward(k, causal, rope):
    attn = make_attention(k, causal, rope)
    x = torch.randn(2, 23, DIM, dtype=torch.float64, requires_grad=True)
    grad_out = torch.randn(2, 23, DIM, dtype=torch.float64)

    fast = attn(x)
    fast_grads = torch.autograd.grad(fast, [x, *attn.parameters()], grad_out)
    ref = attn(x, reference=True)
    ref_grads = torch.autograd.grad(ref, [x, *attn.parameters()], grad_out)

    torch.testing.assert_close(fast, ref, rtol=1e-10, atol=1e-10)
    for g_fast, g_ref in zip(fast_grads, ref_grads):
        torch.testing.assert_close(g_fast, g_ref, rtol=1e-9, atol=1e-10)


@pytest.mark.parametrize("causal", [False, True])
def test_laplacian_heads_are_v_minus_softmax_v(causal):
    """With an identity output projection the module returns the heads side by side: check each one against
    V - softmax(QK^T / sqrt(d)) V (Laplacian) or softmax(QK^T / sqrt(d)) V (standard), written out here."""
    k = 2
    attn = make_attention(k, causal)
    with torch.no_grad():
        attn.proj.weight.copy_(torch.eye(DIM, dtype=torch.float64))
        attn.proj.bias.zero_()
    B, N, d = 3, 11, DIM // HEADS
    x = torch.randn(B, N, DIM, dtype=torch.float64)
    out = attn(x)

    qkv = x @ attn.qkv.weight.T + attn.qkv.bias
    q, kk, v = qkv.split(DIM, dim=-1)
    for h in range(HEADS):
        cols = slice(h * d, (h + 1) * d)
        for b in range(B):
            scores = q[b, :, cols] @ kk[b, :, cols].T / math.sqrt(d)
            if causal:
                scores = scores + torch.triu(torch.full((N, N), float("-inf"), dtype=torch.float64), 1)
            p = torch.exp(scores - scores.max(dim=1, keepdim=True).values)
            p = p / p.sum(dim=1, keepdim=True)
            expected = v[b, :, cols] - p @ v[b, :, cols] if h < k else p @ v[b, :, cols]
            torch.testing.assert_close(out[b, :, cols], expected, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("k", [0, 2, HEADS])
def test_fast_path_never_materialises_n_by_n(k, causal):
    N = 61  # equal to no other dimension here, so an N x N tensor is unmistakable
    attn = make_attention(k, causal, rope=causal).float()
    x = torch.randn(2, N, DIM, requires_grad=True)

    def has_n_by_n(audit):
        return any(shape.count(N) >= 2 for _, shape in audit.shapes)

    with ShapeAudit() as audit:
        attn(x).sum().backward()
    assert not has_n_by_n(audit), [s for s in audit.shapes if s[1].count(N) >= 2]

    # The audit does see an N x N tensor when one is made: the reference path must trip it.
    with ShapeAudit() as reference_audit:
        attn(x, reference=True).sum().backward()
    assert has_n_by_n(reference_audit)


def test_attention_maps_are_row_stochastic_and_causal():
    attn = make_attention(2, causal=True)
    _, probs = attn(torch.randn(2, 9, DIM, dtype=torch.float64), return_attention=True)
    assert probs.shape == (2, HEADS, 9, 9)
    torch.testing.assert_close(probs.sum(-1), torch.ones(2, HEADS, 9, dtype=torch.float64))
    assert torch.all(probs.triu(1) == 0)


def test_rejects_bad_head_counts():
    with pytest.raises(ValueError, match="laplacian_heads"):
        MixedHeadAttention(DIM, HEADS, laplacian_heads=HEADS + 1)
    with pytest.raises(ValueError, match="divisible"):
        MixedHeadAttention(50, HEADS)
