"""The encoder-decoder's attention: self-attention with padding masks and a K/V cache, and cross-attention.

Both are `MixedHeadAttention` (models/attention.py) with the same parameters (one fused (3D, D) input projection and
the output projection) and the same Laplacian heads, so a model with any Laplacian-head count has the parameters of
the one with none:

- `SelfAttention` adds a key padding mask (encoder and decoder) and step-by-step decoding: `init_state` /
  `decode_step` keep the keys and values of the positions decoded so far.
- `CrossAttention` reads queries from the decoder and keys and values from the encoder output (the rows of the fused
  projection: q from the first D, k and v from the rest), computed once per source (`memory_kv`). A Laplacian head
  outputs W_v x_n - sum_m P_nm W_v e_m: the decoder token's own value (the value projection applied to it) minus
  the attention average of the source values. P is not square here, so (I - P) V has no literal meaning; this is the
  same "own value minus neighbourhood average" with the values of both sides made by one map, zero extra parameters.
  In self-attention it is exactly (I - P) V.

Masks: ``padding_mask`` (B, N) is True at padding. A query attends to no padded key; rows that would have no key
at all (a sequence made only of padding) attend to every key instead, so nothing is NaN (their outputs are padding
and meaningless either way). Decoder self-attention always lets a position attend to itself.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from models.attention import MixedHeadAttention


def allowed_keys(padding_mask: torch.Tensor | None, n_queries: int, *, causal: bool) -> torch.Tensor | None:
    """Boolean (B, 1, Nq, Nk) or (B, 1, 1, Nk) mask, True where a query may attend to a key (what
    scaled_dot_product_attention takes), or None when nothing is masked beyond plain causality."""
    if padding_mask is None:
        return None
    keep = ~padding_mask
    keep = keep | ~keep.any(dim=-1, keepdim=True)  # a row of padding only: attend to all, avoid NaN
    allowed = keep[:, None, None, :]  # (B, 1, 1, Nk)
    if causal:
        n = padding_mask.shape[-1]
        past = torch.ones(n_queries, n, dtype=torch.bool, device=padding_mask.device).tril()
        allowed = (allowed & past) | torch.eye(n_queries, n, dtype=torch.bool, device=padding_mask.device)
    return allowed


def attend(q, k, v, allowed: torch.Tensor | None, *, causal: bool, reference: bool) -> torch.Tensor:
    """P V per head, (B, H, Nq, d). The fast path is scaled_dot_product_attention; ``reference=True`` forms
    P = softmax(Q K^T / sqrt(d)) with the mask written out, the path tests compare against."""
    if not reference:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, is_causal=causal and allowed is None)
    scores = (q @ k.transpose(-2, -1)) / math.sqrt(q.shape[-1])
    if allowed is None and causal:
        nq, nk = scores.shape[-2:]
        allowed = torch.ones(nq, nk, dtype=torch.bool, device=q.device).tril()
    if allowed is not None:
        scores = scores.masked_fill(~allowed, float("-inf"))
    return scores.softmax(dim=-1) @ v


class SelfAttention(MixedHeadAttention):
    """Laplacian-head self-attention with a key padding mask and a K/V cache for decoding."""

    def _heads(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        B, N, _ = x.shape
        return self.qkv(x).view(B, N, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)  # 3 x (B, H, N, d)

    def forward(self, x: torch.Tensor, padding_mask: torch.Tensor | None = None, *, reference: bool = False):
        """x (B, N, D) -> (B, N, D); ``padding_mask`` (B, N), True at padding."""
        q, k, v = self._heads(x)
        o = attend(q, k, v, allowed_keys(padding_mask, x.shape[1], causal=self.causal), causal=self.causal,
                   reference=reference)
        return self.proj(self._merge_heads(o, v))

    def init_state(self, batch_size: int, *, device=None, dtype: torch.dtype = torch.float32) -> dict:
        """An empty cache: keys and values (B, H, 0, d) that grow by one position per step."""
        if not self.causal:
            raise ValueError("only causal self-attention decodes step by step")
        device = self.qkv.weight.device if device is None else device
        empty = torch.zeros(batch_size, self.num_heads, 0, self.head_dim, device=device, dtype=dtype)
        return {"k": empty, "v": empty}

    def decode_step(self, x_t: torch.Tensor, state: dict) -> tuple[torch.Tensor, dict]:
        """x_t (B, D), the next position -> (its output (B, D), the cache with its key and value appended). Every
        cached position is earlier, so no mask is needed."""
        q, k, v = self._heads(x_t[:, None])  # (B, H, 1, d) each
        keys, values = torch.cat((state["k"], k), dim=2), torch.cat((state["v"], v), dim=2)
        o = F.scaled_dot_product_attention(q, keys, values)
        return self.proj(self._merge_heads(o, v))[:, 0], {"k": keys, "v": values}


class CrossAttention(MixedHeadAttention):
    """Decoder-to-encoder attention with Laplacian heads (module docstring); never causal, no RoPE."""

    def __init__(self, dim: int, num_heads: int, laplacian_heads: int = 0, qkv_bias: bool = False,
                 proj_bias: bool = True):
        super().__init__(dim, num_heads, laplacian_heads, causal=False, qkv_bias=qkv_bias, proj_bias=proj_bias)

    def _project(self, x: torch.Tensor, part: slice) -> torch.Tensor:
        """Rows ``part`` of the fused projection applied to x (B, N, D) -> (B, N, rows)."""
        bias = None if self.qkv.bias is None else self.qkv.bias[part]
        return F.linear(x, self.qkv.weight[part], bias)

    def _split(self, x: torch.Tensor) -> torch.Tensor:
        B, N, _ = x.shape
        return x.view(B, N, -1, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)  # (parts, B, H, N, d)

    def memory_kv(self, memory: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of the encoder output (B, Ns, D): two (B, H, Ns, d), computed once per source."""
        D = memory.shape[-1]
        k, v = self._split(self._project(memory, slice(D, 3 * D)))
        return k, v

    def forward(self, x: torch.Tensor, memory_kv: tuple[torch.Tensor, torch.Tensor],
                memory_padding_mask: torch.Tensor | None = None, *, reference: bool = False) -> torch.Tensor:
        """x (B, Nt, D) decoder states, ``memory_kv`` from `memory_kv`, ``memory_padding_mask`` (B, Ns) True at
        source padding -> (B, Nt, D)."""
        D = x.shape[-1]
        q = self._split(self._project(x, slice(0, D)))[0]
        k, v = memory_kv
        o = attend(q, k, v, allowed_keys(memory_padding_mask, x.shape[1], causal=False), causal=False,
                   reference=reference)
        # Laplacian heads subtract from each query token's own value (the value rows applied to the decoder token).
        own = self._split(self._project(x, slice(2 * D, 3 * D)))[0] if self.laplacian_heads else o
        return self.proj(self._merge_heads(o, own))
