"""Multi-head self-attention whose first k heads are Laplacian heads.

For head h with P_h = softmax(Q_h K_h^T / sqrt(d_h)) (causally masked in decoders):

    standard head   O_h = P_h V_h
    Laplacian head  O_h = V_h - P_h V_h      ((I - P_h) V_h, the random-walk graph Laplacian of the attention graph)

Heads are interchangeable, so the first ``laplacian_heads`` heads are the Laplacian ones. The module has exactly the
parameters of plain attention whatever k is.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from models.rope import RotaryEmbedding


class MixedHeadAttention(nn.Module):
    def __init__(
        self,
        dim: int,
        num_heads: int,
        laplacian_heads: int = 0,
        causal: bool = False,
        qkv_bias: bool = False,
        proj_bias: bool = True,
        rope: RotaryEmbedding | None = None,
    ):
        super().__init__()
        if dim % num_heads:
            raise ValueError(f"dim ({dim}) must be divisible by num_heads ({num_heads})")
        if not 0 <= laplacian_heads <= num_heads:
            raise ValueError(f"laplacian_heads must be in 0..{num_heads}, got {laplacian_heads}")
        self.num_heads = num_heads
        self.head_dim = dim // num_heads
        self.laplacian_heads = laplacian_heads
        self.causal = causal
        self.qkv = nn.Linear(dim, 3 * dim, bias=qkv_bias)
        self.proj = nn.Linear(dim, dim, bias=proj_bias)
        self.rope = rope

    def forward(self, x: torch.Tensor, *, reference: bool = False, return_attention: bool = False):
        """x: (B, N, D) -> (B, N, D).

        The fast path uses scaled_dot_product_attention and never forms an N x N tensor. ``reference=True`` (implied
        by ``return_attention=True``) materialises P instead; it is the path tests compare against and the one that
        hands attention maps (B, H, N, N) to analysis code.
        """
        B, N, D = x.shape
        q, k, v = self.qkv(x).view(B, N, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        if self.rope is not None:
            q, k = self.rope(q), self.rope(k)
        attention = None
        if reference or return_attention:
            attention = self.attention_probs(q, k)
            o = attention @ v
        else:
            o = F.scaled_dot_product_attention(q, k, v, is_causal=self.causal)
        out = self.proj(self._merge_heads(o, v))
        return (out, attention) if return_attention else out

    def attention_probs(self, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        scores = (q @ k.transpose(-2, -1)) / math.sqrt(self.head_dim)
        if self.causal:
            n = scores.shape[-1]
            future = torch.ones(n, n, dtype=torch.bool, device=scores.device).triu(1)
            scores = scores.masked_fill(future, float("-inf"))
        return scores.softmax(dim=-1)

    def _merge_heads(self, o: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """(B, H, N, d) head outputs -> (B, N, H*d), the first k heads turned into V - PV.

        Works on (B, N, H, d) views so the concatenation writes the contiguous layout the projection reads in one
        pass, and never edits SDPA's output in place (its backward needs it unchanged).
        """
        B, H, N, d = o.shape
        o = o.transpose(1, 2)
        k = self.laplacian_heads
        if k:
            v = v.transpose(1, 2)
            o = torch.cat((v[:, :, :k] - o[:, :, :k], o[:, :, k:]), dim=2)
        return o.reshape(B, N, H * d)
