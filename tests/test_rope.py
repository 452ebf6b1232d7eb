"""RoPE (models/rope.py) against truths written out independently of it.

- The rotation itself: channel pairs (i, i + d/2) at position m turn by the angle m theta_i, theta_i = base^(-2i/d),
  evaluated here in float64 with a loop over positions and pairs.
- What RoPE is for: the score <R_m q, R_n k> depends on the positions only through m - n, and does depend on it.
- That the GPT uses it: its attention equals attention written out by hand with that rotation on queries and keys
  (not values), and its logits depend on the order of the tokens, which nothing else in it sees.

The module keeps its cos/sin tables in float32, so comparisons with float64 truths allow float32 rounding.
"""

from __future__ import annotations

import cmath
import math

import pytest
import torch

from models import build_model
from models.rope import RotaryEmbedding

TABLE_ATOL = 1e-5  # float32 cos/sin tables applied to O(1) inputs


def rotate_by_formula(x: torch.Tensor, base: float) -> torch.Tensor:
    """(..., N, d) -> the same, pair (i, i + d/2) at position m rotated by m * base^(-2i/d), one number at a time."""
    x = x.double()
    out = torch.empty_like(x)
    n, d = x.shape[-2:]
    half = d // 2
    for m in range(n):
        for i in range(half):
            angle = m * base ** (-2 * i / d)
            c, s = math.cos(angle), math.sin(angle)
            a, b = x[..., m, i], x[..., m, i + half]
            out[..., m, i] = a * c - b * s
            out[..., m, i + half] = b * c + a * s
    return out


@pytest.mark.parametrize(("head_dim", "base"), [(8, 10000.0), (16, 100.0), (2, 10.0)])
def test_rotation_matches_the_formula(head_dim, base):
    n = 37
    rope = RotaryEmbedding(head_dim, max_len=64, base=base)
    x = torch.randn(2, 3, n, head_dim, dtype=torch.float64, generator=torch.Generator().manual_seed(head_dim))
    expected = rotate_by_formula(x, base)
    torch.testing.assert_close(rope(x), expected, rtol=0, atol=TABLE_ATOL)
    torch.testing.assert_close(rope(x.float()), expected.float(), rtol=0, atol=TABLE_ATOL)
    # Not a near-identity: the rotation moves the inputs by O(1) at most positions.
    assert (rope(x) - x)[..., 1:, :].abs().mean() > 0.1


def rotated_scores(q: torch.Tensor, k: torch.Tensor, rope: RotaryEmbedding, n: int) -> torch.Tensor:
    """(n, n) matrix of <R_m q, R_n k>: the same q at every position m, the same k at every position n."""
    rq = rope(q.expand(1, 1, n, -1))[0, 0]
    rk = rope(k.expand(1, 1, n, -1))[0, 0]
    return rq @ rk.T


def score_at_offset(q: torch.Tensor, k: torch.Tensor, offset: int, base: float) -> float:
    """<R_m q, R_n k> for m - n = offset, with pairs as complex numbers z = x_i + i x_{i+d/2}:
    sum_i Re(z_q conj(z_k) e^{i offset theta_i})."""
    d = q.shape[-1]
    half = d // 2
    total = 0.0
    for i in range(half):
        zq, zk = complex(q[i], q[i + half]), complex(k[i], k[i + half])
        total += (zq * zk.conjugate() * cmath.exp(1j * offset * base ** (-2 * i / d))).real
    return total


def test_scores_depend_only_on_the_offset():
    n, d, base = 24, 16, 100.0
    rope = RotaryEmbedding(d, max_len=n, base=base)
    gen = torch.Generator().manual_seed(0)
    q, k = torch.randn(d, dtype=torch.float64, generator=gen), torch.randn(d, dtype=torch.float64, generator=gen)
    scores = rotated_scores(q, k, rope, n)

    per_offset = {}
    for m in range(n):
        for p in range(n):
            per_offset.setdefault(m - p, []).append(scores[m, p].item())
    for offset, values in per_offset.items():
        # The same q and k at several (m, n) pairs with this offset: one score.
        assert max(values) - min(values) < TABLE_ATOL, (offset, values)
        assert values[0] == pytest.approx(score_at_offset(q, k, offset, base), abs=1e-4), offset
    # ... and the offset matters: no two of the 47 offsets share a score (the closest two differ by 3e-3 here).
    distinct = sorted(values[0] for values in per_offset.values())
    assert min(b - a for a, b in zip(distinct, distinct[1:])) > 10 * TABLE_ATOL, distinct
    # Without the rotation every pair would score <q, k>.
    assert (scores - q @ k).abs().max() > 1.0


@pytest.mark.parametrize("clockwise", [False, True])
def test_positions_past_the_table_rotate_as_a_longer_table_would(clockwise):
    """A long-context evaluation reads past the trained context: those rows get the rotation of a longer table."""
    x = torch.randn(2, 3, 24, 8)
    short, long = RotaryEmbedding(8, max_len=16, clockwise=clockwise), RotaryEmbedding(8, 64, clockwise=clockwise)
    assert torch.equal(short(x), long(x))
    assert torch.equal(short(x, offset=10), long(x, offset=10))  # a decoding cache that crosses the table's end
    assert torch.equal(short(x[:, :, :16]), long(x[:, :, :16]))


# The GPT. Float64 so that "equal" can mean equal to rounding, and one layer so the attention's input is the
# normalised token embedding.


def small_gpt(**overrides):
    torch.manual_seed(0)
    config = {"preset": "gpt_tiny", "depth": 1, "dim": 32, "num_heads": 2, "vocab_size": 50, "context_length": 16,
              **overrides}
    return build_model(config).double().eval()


def attention_by_hand(mixer, x: torch.Tensor, base: float) -> torch.Tensor:
    """Causal multi-head attention of x (B, N, D) with the mixer's weights, RoPE from `rotate_by_formula` on queries
    and keys only, and its first `laplacian_heads` heads Laplacian (V - PV)."""
    B, N, D = x.shape
    H, d = mixer.num_heads, mixer.head_dim
    q, k, v = (x @ mixer.qkv.weight.T).split(D, dim=-1)
    q, k, v = (t.reshape(B, N, H, d).transpose(1, 2) for t in (q, k, v))  # (B, H, N, d)
    q, k = rotate_by_formula(q, base), rotate_by_formula(k, base)
    scores = q @ k.transpose(-2, -1) / math.sqrt(d)
    scores = scores.masked_fill(torch.ones(N, N, dtype=torch.bool).triu(1), float("-inf"))
    heads = scores.softmax(dim=-1) @ v
    heads[:, : mixer.laplacian_heads] = v[:, : mixer.laplacian_heads] - heads[:, : mixer.laplacian_heads]
    return heads.transpose(1, 2).reshape(B, N, D) @ mixer.proj.weight.T


def test_gpt_attention_rotates_queries_and_keys():
    base = 50.0  # not the default: the config's rope_base must reach the attention
    gpt = small_gpt(rope_base=base, k=1)
    mixer = gpt.blocks[0].mixer
    with torch.no_grad():  # sharper attention than the 0.02 init, so the rotation moves the weights visibly
        mixer.qkv.weight.normal_(0.0, 0.3)
    seen = {}
    mixer.register_forward_hook(lambda module, args, out: seen.update(x=args[0], out=out))
    with torch.no_grad():
        gpt(torch.randint(0, 50, (2, 16), generator=torch.Generator().manual_seed(1)))
        expected = attention_by_hand(mixer, seen["x"], base)
    torch.testing.assert_close(seen["out"], expected, rtol=1e-4, atol=1e-4 * expected.abs().max().item())


def test_gpt_logits_see_token_order_only_through_rope(monkeypatch):
    """Swapping two earlier tokens changes the last position's logits; with the rotation turned off, the same model
    cannot tell (causal attention over an unordered set, no other position signal)."""
    gpt = small_gpt()
    with torch.no_grad():
        gpt.blocks[0].mixer.qkv.weight.normal_(0.0, 0.3)
    tokens = torch.tensor([[3, 17, 8, 42, 5, 29, 11, 8]])
    swapped = tokens[:, [1, 0, 2, 3, 4, 5, 6, 7]]  # the same tokens, the first two exchanged

    def last_logits_change():
        with torch.no_grad():
            return (gpt(tokens)[0, -1] - gpt(swapped)[0, -1]).abs().max().item()

    with_rope = last_logits_change()
    monkeypatch.setattr(RotaryEmbedding, "forward", lambda self, x, offset=0: x)
    without_rope = last_logits_change()
    assert without_rope < 1e-12, without_rope
    assert with_rope > 1e-3, with_rope
