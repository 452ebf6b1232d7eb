"""Rotary position embedding (RoPE) for the GPT's queries and keys."""

from __future__ import annotations

import torch
from torch import nn

from models.errors import ConfigError


def check_head_dim(key: str, head_dim: int) -> None:
    """RoPE turns channels in pairs: a ConfigError naming config key `key` for an odd head dimension."""
    if head_dim % 2:
        raise ConfigError(key, f"RoPE needs an even head dimension (dim / num_heads), got {head_dim}")


class RotaryEmbedding(nn.Module):
    """Rotates pairs of channels (i, i + d/2) of each head by position-dependent angles.

    The cos/sin tables are non-persistent buffers: RoPE adds no parameters, so parameter counts stay honest.
    ``clockwise=True`` turns every pair by -angle instead of +angle, as nanochat's ``apply_rotary_emb`` does (the
    transpose of the textbook rotation: the same model family, but a given set of weights scores pairs differently).
    """

    def __init__(self, head_dim: int, max_len: int, base: float = 10000.0, clockwise: bool = False):
        super().__init__()
        check_head_dim("head_dim", head_dim)
        self.head_dim, self.base, self.clockwise = head_dim, base, clockwise
        cos, sin = self._table(0, max_len)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)
        self.max_len = max_len

    def _table(self, start: int, stop: int, device=None) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin of the angles of positions start..stop-1 (float64 angles, float32 tables)."""
        inv_freq = self.base ** (-torch.arange(0, self.head_dim, 2, dtype=torch.float64, device=device)
                                 / self.head_dim)
        angles = torch.outer(torch.arange(start, stop, dtype=torch.float64, device=device), inv_freq)
        if self.clockwise:
            angles = -angles
        return angles.cos().float(), angles.sin().float()

    def forward(self, x: torch.Tensor, offset: int = 0) -> torch.Tensor:
        """x: (B, H, N, head_dim) -> same shape, position ``offset + n`` rotating row n (offset: tokens already in a
        decoding cache)."""
        n = x.shape[-2]
        if offset + n <= self.max_len:
            cos, sin = self.cos[offset:offset + n], self.sin[offset:offset + n]
        else:  # past the trained context (a long-context evaluation): the same rotation, computed for these rows
            cos, sin = self._table(offset, offset + n, x.device)
        cos, sin = cos.to(x.dtype), sin.to(x.dtype)
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
