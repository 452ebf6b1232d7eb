"""Registry of token mixers, and a model's layers built from it: a new mixer is one module in `models/` plus one entry
here.

Each entry builds the mixer of one layer from the model's shapes and the resolved flat config, and lists the extra
flat-config keys it reads (so `build_model` can tell a typo from a mixer option).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field

from torch import nn

from models.attention import MixedHeadAttention, RotaryQKNormAttention
from models.block import Block
from models.errors import ConfigError
from models.rope import RotaryEmbedding
from models.stlt import STLT_KEYS, STLTMixer, stlt_config, validate_stlt_options


@dataclass(frozen=True)
class LayerContext:
    """What a mixer may need to know about the layer and model it is built for."""

    dim: int
    num_heads: int
    layer: int
    laplacian_heads: int
    causal: bool
    seq_len: int
    qkv_bias: bool
    proj_bias: bool
    rope: RotaryEmbedding | None
    # "gpt2" (fused q/k/v projection) or "nanochat" (separate ones, GQA, QK norm): see models/gpt.py.
    block_style: str = "gpt2"
    num_kv_heads: int | None = None


@dataclass(frozen=True)
class MixerSpec:
    build: Callable[[LayerContext, Mapping], nn.Module]
    keys: frozenset[str] = field(default_factory=frozenset)
    validate: Callable[[Mapping], None] | None = None
    # Its options (`keys`) of a flat config with their defaults, what a run records of it: validated first.
    options_with_defaults: Callable[[Mapping], dict] = lambda options: {}
    # Whether its layers have attention heads, which the Laplacian-head schedule may make Laplacian.
    has_heads: bool = True


def _attention(ctx: LayerContext, options: Mapping) -> nn.Module:
    if ctx.block_style == "nanochat":
        return RotaryQKNormAttention(ctx.dim, ctx.num_heads, ctx.num_kv_heads, laplacian_heads=ctx.laplacian_heads,
                                     causal=ctx.causal, rope=ctx.rope)
    return MixedHeadAttention(
        ctx.dim,
        ctx.num_heads,
        laplacian_heads=ctx.laplacian_heads,
        causal=ctx.causal,
        qkv_bias=ctx.qkv_bias,
        proj_bias=ctx.proj_bias,
        rope=ctx.rope,
    )


def _stlt(ctx: LayerContext, options: Mapping) -> nn.Module:
    return STLTMixer.from_config(stlt_config(options), ctx.dim, causal=ctx.causal, seq_len=ctx.seq_len,
                                 bias=ctx.proj_bias)


MIXERS: dict[str, MixerSpec] = {
    "attention": MixerSpec(build=_attention),
    "stlt": MixerSpec(build=_stlt, keys=STLT_KEYS, validate=validate_stlt_options,
                      options_with_defaults=lambda options: asdict(stlt_config(options)), has_heads=False),
}


def check_laplacian_heads(key: str, kinds: list[str], counts: list[int]) -> None:
    """The Laplacian-head count of each layer (`counts`) fits its mixer (`kinds`, from config key `key`): a mixer
    without heads gets none. Checked with the config, so a configuration no model can build fails before training."""
    for layer, (kind, count) in enumerate(zip(kinds, counts)):
        if count and not MIXERS[kind].has_heads:
            raise ConfigError(key, f"layer {layer} is {kind!r} (no heads) but the Laplacian-head schedule gives it "
                                   f"{count}; {kind} layers must get 0 (laplacian_schedule: explicit)")


def mixer_keys() -> frozenset[str]:
    return frozenset(key for spec in MIXERS.values() for key in spec.keys)


def build_mixer(kind: str, ctx: LayerContext, options: Mapping) -> nn.Module:
    return MIXERS[kind].build(ctx, options)


def build_blocks(config, *, causal: bool, seq_len: int, proj_bias: bool, rope, drop_path_by_depth: str = "linear",
                 block_style: str = "gpt2", num_kv_heads: int | None = None, **block_options) -> nn.ModuleList:
    """One Block per layer of a validated config around the mixer its kind names, told what the layer is (its
    Laplacian head count, causality, sequence length, block style). Stochastic depth: ``config.drop_path`` in every
    layer (``"uniform"``, DeiT III's models_v2.py), or rising linearly from 0 in the first layer to it in the last
    (``"linear"``, DeiT I and timm)."""
    drop_rates = drop_path_rates(config.drop_path, config.depth, drop_path_by_depth)
    blocks = nn.ModuleList()
    for layer, kind in enumerate(config.mixer_kinds):
        context = LayerContext(dim=config.dim, num_heads=config.num_heads, layer=layer,
                               laplacian_heads=config.laplacian_counts[layer], causal=causal, seq_len=seq_len,
                               qkv_bias=config.qkv_bias, proj_bias=proj_bias, rope=rope,
                               block_style=block_style, num_kv_heads=num_kv_heads)
        blocks.append(Block(config.dim, build_mixer(kind, context, config.mixer_options),
                            mlp_ratio=config.mlp_ratio, drop_path=drop_rates[layer], **block_options))
    return blocks


def drop_path_rates(rate: float, depth: int, by_depth: str) -> list[float]:
    """Stochastic-depth rate of each of ``depth`` layers: ``rate`` everywhere (uniform) or 0 -> ``rate`` (linear)."""
    if by_depth == "uniform":
        return [rate] * depth
    return [rate * layer / max(depth - 1, 1) for layer in range(depth)]
