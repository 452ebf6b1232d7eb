"""Multi-head self-attention whose first k heads are Laplacian heads.

For head h with P_h = softmax(Q_h K_h^T / sqrt(d_h)) (causally masked in decoders):

    standard head   O_h = P_h V_h
    Laplacian head  O_h = V_h - P_h V_h      ((I - P_h) V_h, the random-walk graph Laplacian of the attention graph)

Heads are interchangeable, so the first ``laplacian_heads`` heads are the Laplacian ones. The module has exactly the
parameters of plain attention whatever k is.

Two projection styles share that mechanism: ``MixedHeadAttention`` (one fused q/k/v matrix, RoPE, the GPT-2-style
blocks and the ViT) and ``RotaryQKNormAttention`` (nanochat's: separate q, k, v matrices, grouped key/value heads,
RoPE then a parameter-free RMS norm of queries and keys). Both decode incrementally with an ``AttentionCache``.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from models.rope import RotaryEmbedding


class AttentionCache:
    """Keys and values, (B, H_kv, T, d), of the positions one causal attention layer has seen while decoding.

    Storage is allocated on the first ``append`` (with the keys' dtype and device) for ``capacity`` positions and
    doubles when outgrown. ``length`` is also the RoPE position of the next token.
    """

    def __init__(self, capacity: int = 0):
        self.capacity = capacity
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None
        self.length = 0

    def append(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store k, v (B, H_kv, T_new, d) after the cached positions; return every cached position's (B, H_kv, T, d)."""
        t0, t1 = self.length, self.length + k.shape[-2]
        if self.k is None or t1 > self.k.shape[-2]:
            old = 0 if self.k is None else self.k.shape[-2]
            size = max(t1, self.capacity, 2 * old)
            new_k, new_v = k.new_empty(*k.shape[:-2], size, k.shape[-1]), v.new_empty(*v.shape[:-2], size, v.shape[-1])
            if old:
                new_k[..., :t0, :], new_v[..., :t0, :] = self.k[..., :t0, :], self.v[..., :t0, :]
            self.k, self.v = new_k, new_v
        self.k[..., t0:t1, :], self.v[..., t0:t1, :] = k, v
        self.length = t1
        return self.k[..., :t1, :], self.v[..., :t1, :]

    def mix(self, mixer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """The layer's output for the new positions x (B, N, D): the attention with this cache."""
        return mixer(x, cache=self)


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
        self._init_heads(dim, num_heads, num_heads, laplacian_heads, causal, rope)
        self.qkv = nn.Linear(dim, 3 * dim, bias=qkv_bias)
        self.proj = nn.Linear(dim, dim, bias=proj_bias)

    def _init_heads(self, dim, num_heads, num_kv_heads, laplacian_heads, causal, rope) -> None:
        nn.Module.__init__(self)
        if dim % num_heads:
            raise ValueError(f"dim ({dim}) must be divisible by num_heads ({num_heads})")
        if num_kv_heads < 1 or num_heads % num_kv_heads:
            raise ValueError(f"num_kv_heads must divide num_heads ({num_heads}), got {num_kv_heads}")
        if not 0 <= laplacian_heads <= num_heads:
            raise ValueError(f"laplacian_heads must be in 0..{num_heads}, got {laplacian_heads}")
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = dim // num_heads
        self.laplacian_heads = laplacian_heads
        self.causal = causal
        self.rope = rope

    def project(self, x: torch.Tensor, offset: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x (B, N, D) at positions offset.. -> q (B, H, N, d), k and v (B, H_kv, N, d), positions encoded."""
        B, N, D = x.shape
        q, k, v = self.qkv(x).view(B, N, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        if self.rope is not None:
            q, k = self.rope(q, offset), self.rope(k, offset)
        return q, k, v

    def forward(self, x: torch.Tensor, *, reference: bool = False, return_attention: bool = False,
                cache: AttentionCache | None = None):
        """x: (B, N, D) -> (B, N, D).

        The fast path uses scaled_dot_product_attention and never forms an N x N tensor. ``reference=True`` (implied
        by ``return_attention=True``) materialises P instead; it is the path tests compare against and the one that
        hands attention maps (B, H, N, N) to analysis code.

        With a ``cache`` (causal only), x holds the N tokens after the ``cache.length`` already seen: they attend
        to those and to each other causally, and their keys and values join the cache. A Laplacian head's output at
        position t is still V_t - sum_{s<=t} P_ts V_s, V_t being the new token's own value.
        """
        if cache is not None and not self.causal:
            raise ValueError("a decoding cache needs causal attention")
        q, k, v = self.project(x, 0 if cache is None else cache.length)
        v_new = v
        if cache is not None:
            k, v = cache.append(k, v)
        attention = None
        if reference or return_attention:
            attention = self.attention_probs(q, self._expand_kv(k))
            o = attention @ self._expand_kv(v)
        else:
            o = self._sdpa(q, k, v)
        out = self.proj(self._merge_heads(o, self._expand_kv(v_new)))
        return (out, attention) if return_attention else out

    def new_cache(self, capacity: int = 0) -> AttentionCache:
        """An empty decoding cache for this layer (storage for ``capacity`` positions, allocated on first use)."""
        if not self.causal:
            raise ValueError("a decoding cache needs causal attention")
        return AttentionCache(capacity)

    def _sdpa(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """P V for every head, (B, H, Nq, d). With a cache Nq < Nk: query i sits at position Nk - Nq + i."""
        nq, nk = q.shape[-2], k.shape[-2]
        gqa = {"enable_gqa": True} if self.num_kv_heads != self.num_heads else {}
        if not self.causal or nq == 1:  # one new token attends to every cached one
            return F.scaled_dot_product_attention(q, k, v, **gqa)
        if nq == nk:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, **gqa)
        # SDPA's is_causal aligns the mask top-left; a chunk after a cached prefix needs it bottom-right.
        return F.scaled_dot_product_attention(q, k, v, attn_mask=~_future(nq, nk, q.device), **gqa)

    def attention_probs(self, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        """q (B, H, Nq, d), k (B, H, Nk, d) -> P (B, H, Nq, Nk); causal rows end at position Nk - Nq + i."""
        scores = (q @ k.transpose(-2, -1)) / math.sqrt(self.head_dim)
        if self.causal:
            scores = scores.masked_fill(_future(scores.shape[-2], scores.shape[-1], scores.device), float("-inf"))
        return scores.softmax(dim=-1)

    def _expand_kv(self, t: torch.Tensor) -> torch.Tensor:
        """(B, H_kv, N, d) -> (B, H, N, d): query head h reads key/value head h // (H / H_kv), as SDPA's GQA does."""
        groups = self.num_heads // self.num_kv_heads
        return t if groups == 1 else t.repeat_interleave(groups, dim=1)

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


class RotaryQKNormAttention(MixedHeadAttention):
    """nanochat's causal self-attention (nanochat/gpt.py, CausalSelfAttention) with the first k heads Laplacian.

    Separate bias-free q, k, v projections (Muon orthogonalises each matrix on its own), ``num_kv_heads`` key/value
    heads shared by groups of query heads (GQA), RoPE and then RMS-normalised queries and keys per head
    (``F.rms_norm`` without a weight, nanochat's order), scores scaled by 1/sqrt(head_dim) as SDPA's default.
    """

    def __init__(self, dim: int, num_heads: int, num_kv_heads: int | None = None, laplacian_heads: int = 0,
                 causal: bool = True, rope: RotaryEmbedding | None = None):
        num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        self._init_heads(dim, num_heads, num_kv_heads, laplacian_heads, causal, rope)
        kv_dim = num_kv_heads * self.head_dim
        self.q_proj = nn.Linear(dim, dim, bias=False)
        self.k_proj = nn.Linear(dim, kv_dim, bias=False)
        self.v_proj = nn.Linear(dim, kv_dim, bias=False)
        self.proj = nn.Linear(dim, dim, bias=False)

    def project(self, x: torch.Tensor, offset: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        B, N, D = x.shape
        q = self.q_proj(x).view(B, N, self.num_heads, self.head_dim).transpose(1, 2)  # (B, H, N, d)
        k = self.k_proj(x).view(B, N, self.num_kv_heads, self.head_dim).transpose(1, 2)  # (B, H_kv, N, d)
        v = self.v_proj(x).view(B, N, self.num_kv_heads, self.head_dim).transpose(1, 2)
        if self.rope is not None:
            q, k = self.rope(q, offset), self.rope(k, offset)
        return rms_norm(q), rms_norm(k), v


def rms_norm(x: torch.Tensor) -> torch.Tensor:
    """Parameter-free RMS norm over the last dimension (nanochat's ``norm``: eps is the dtype's machine epsilon)."""
    return F.rms_norm(x, (x.shape[-1],))


def _future(nq: int, nk: int, device) -> torch.Tensor:
    """(nq, nk) bool, True where key j lies after query i, the queries being the last nq of nk positions."""
    return torch.ones(nq, nk, dtype=torch.bool, device=device).triu(nk - nq + 1)
