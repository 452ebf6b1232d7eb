"""An encoder-decoder Transformer (Vaswani et al. 2017) whose token mixers are the package's: attention with
Laplacian heads, bilateral STLT in the encoder, causal STLT in the decoder, or a mix per layer (docs/encdec.md).

    encoder   x = dropout(sqrt(D) E[src] + PE);    per layer: mixer (self, with the source padding mask), FFN
    decoder   y = dropout(sqrt(D) E[tgt] + PE);    per layer: causal mixer, cross-attention to the encoder output, FFN
    logits    y E^T (embeddings shared three ways) or y W_out

Each sub-layer sits in a residual branch with dropout on its output, post-norm (x = LN(x + dropout(f(x))), the
paper's) or pre-norm (x = x + dropout(f(LN(x))), then a final LayerNorm on the encoder and on the decoder output).

Incremental decoding: `encode` once, `init_decoder_state`, then `decode_step` one token at a time. Attention layers
cache keys and values; causal STLT layers carry their recurrence state, O(S D) per layer whatever the length; the
cross-attention keys and values of the encoder output are computed once in `init_decoder_state`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import nn

from models.base import MixerModel
from models.checks import check_bool, check_choice, check_int, check_number
from models.config import ALL_SCHEDULE_KEYS, TransformerConfig, laplacian_schedule, resolve_mixer_kinds
from models.encdec_attention import CrossAttention, SelfAttention
from models.errors import ConfigError
from models.layers import DropPath
from models.mixers import LayerContext, build_mixer, drop_path_rates

LAPLACIAN_SITES = ("encoder", "decoder", "cross")
ACTIVATIONS = {"relu": nn.ReLU, "gelu": nn.GELU}


@dataclass
class EncDecConfig(TransformerConfig):
    """The TransformerConfig keys describe the encoder (`depth`, `mixer`); the decoder has its own."""

    vocab_size: int = 1000  # target vocabulary, and the source's too unless src_vocab_size is given
    src_vocab_size: int | None = None  # source vocabulary with separate embeddings (None: vocab_size)
    decoder_depth: int | None = None  # decoder layers (None: depth)
    # Causal self-mixer per decoder layer: a registry name, a list of decoder_depth names, or the list as one string.
    decoder_mixer: str | list[str] = "attention"
    # Where the Laplacian-head schedule applies: a comma-separated subset of encoder, decoder (self-attention),
    # cross, or "none". The schedule is resolved per stack; cross-attention takes the decoder's counts.
    laplacian_sites: str = "encoder,decoder,cross"
    norm_position: str = "post"  # "post" (Vaswani et al.) or "pre" (final norms on both stacks)
    dropout: float = 0.0  # residual dropout on every sub-layer output and on the embeddings + positions
    # "shared": one table for source, target and output (three-way tying, needs one vocabulary); "decoder": the
    # target table is the output layer, the source has its own; "separate": three tables.
    embeddings: str = "shared"
    positions: str = "sinusoidal"  # "sinusoidal" (Vaswani et al.) or "none"
    activation: str = "relu"  # FFN nonlinearity (the paper's ReLU)
    context_length: int = 256  # longest expected sequence: STLT's T_init "auto" reads it
    pad_id: int = 0  # padding token: forward derives the padding masks from it
    qkv_bias: bool = True  # biases on every projection, as fairseq's and tensor2tensor's Transformer

    def __post_init__(self):
        check_int("vocab_size", self.vocab_size, low=2)
        check_choice("embeddings", self.embeddings, ("shared", "decoder", "separate"))
        if self.src_vocab_size is not None:
            check_int("src_vocab_size", self.src_vocab_size, low=2)
            if self.embeddings == "shared" and self.src_vocab_size != self.vocab_size:
                raise ConfigError("src_vocab_size", f"must equal vocab_size ({self.vocab_size}) with shared "
                                                    f"embeddings, got {self.src_vocab_size}")
        check_int("depth", self.depth, low=1)
        if self.decoder_depth is None:
            self.decoder_depth = self.depth
        check_int("decoder_depth", self.decoder_depth, low=1)
        sites = [s.strip() for s in self.laplacian_sites.split(",")] if isinstance(self.laplacian_sites, str) else None
        if sites is None or not (sites == ["none"] or (sites and set(sites) <= set(LAPLACIAN_SITES))):
            raise ConfigError("laplacian_sites", f"must be 'none' or a comma-separated subset of "
                                                 f"{', '.join(LAPLACIAN_SITES)}, got {self.laplacian_sites!r}")
        self.sites = frozenset(sites) - {"none"}
        check_choice("norm_position", self.norm_position, ("post", "pre"))
        check_number("dropout", self.dropout, low=0.0, high=1.0, high_open=True)
        check_choice("positions", self.positions, ("sinusoidal", "none"))
        check_choice("activation", self.activation, tuple(ACTIVATIONS))
        check_int("context_length", self.context_length, low=1)
        check_int("pad_id", self.pad_id, low=0, high=min(self.vocab_size, self.src_vocab_size or self.vocab_size) - 1)
        check_bool("qkv_bias", self.qkv_bias)
        self.decoder_mixer_kinds = resolve_mixer_kinds("decoder_mixer", self.decoder_mixer, self.decoder_depth)
        super().__post_init__()

    def _laplacian_counts(self) -> list[int]:
        """Encoder self-attention counts; the decoder's (self and cross) go to `laplacian_counts_decoder`. A stack
        outside `laplacian_sites` gets zeros, and its depth is not checked against an explicit schedule."""
        spec, heads = self.schedule_spec(), self.num_heads
        if not self.sites and set(spec) - {"laplacian_schedule"}:
            raise ConfigError("laplacian_sites", f"is 'none' but the Laplacian-head schedule sets "
                                                 f"{', '.join(sorted(set(spec) - {'laplacian_schedule'}))}")
        self.laplacian_counts_decoder = (laplacian_schedule(spec, self.decoder_depth, heads)
                                         if self.sites & {"decoder", "cross"} else [0] * self.decoder_depth)
        return laplacian_schedule(spec, self.depth, heads) if "encoder" in self.sites else [0] * self.depth

    def _all_mixer_kinds(self) -> list[str]:
        return self.mixer_kinds + self.decoder_mixer_kinds

    def _unread_keys(self) -> frozenset[str]:
        if not self.sites:  # no stack has Laplacian heads: the schedule's counts are refused
            return ALL_SCHEDULE_KEYS - {"laplacian_schedule"}
        return super()._unread_keys()

    def _layer_heads(self) -> list[tuple[str, list[str], list[int]]]:
        decoder = [count * ("decoder" in self.sites) for count in self.laplacian_counts_decoder]
        return [*super()._layer_heads(), ("decoder_mixer", self.decoder_mixer_kinds, decoder)]

    @property
    def source_vocab_size(self) -> int:
        return self.src_vocab_size or self.vocab_size


def sinusoidal_positions(n: int, dim: int, *, offset: int = 0, device=None, dtype=torch.float32) -> torch.Tensor:
    """(n, dim) positions offset..offset+n-1 as in Vaswani et al. (section 3.5), channels interleaved:
    PE[pos, 2i] = sin(pos / 10000^(2i/dim)), PE[pos, 2i+1] = cos(pos / 10000^(2i/dim)). No parameters."""
    pos = torch.arange(offset, offset + n, device=device, dtype=torch.float64)[:, None]
    inv_freq = 10000.0 ** (-torch.arange(0, dim, 2, device=device, dtype=torch.float64) / dim)
    angles = pos * inv_freq  # (n, ceil(dim / 2))
    pe = torch.stack((angles.sin(), angles.cos()), dim=-1).flatten(1)[:, :dim]
    return pe.to(dtype)


class Memory(NamedTuple):
    """The encoder's output: states (B, Ns, D) and the source padding mask (B, Ns), True at padding."""

    states: torch.Tensor
    padding_mask: torch.Tensor


@dataclass
class DecoderState:
    """What incremental decoding carries between steps. ``memory_kv`` (per layer, the cross-attention keys and
    values of the encoder output) and ``memory_padding_mask`` are fixed for a source; ``layers`` holds each layer's
    self-mixer state (attention: the K/V cache; causal STLT: its recurrence state); ``position`` counts the tokens
    fed so far."""

    memory_kv: list[tuple[torch.Tensor, torch.Tensor]]
    memory_padding_mask: torch.Tensor
    layers: list[dict]
    position: int = 0


class FeedForward(nn.Module):
    """The position-wise FFN, fc2(act(fc1(x))) (the paper's ReLU by default)."""

    def __init__(self, dim: int, hidden: int, activation: type[nn.Module], bias: bool = True):
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden, bias=bias)
        self.act = activation()
        self.fc2 = nn.Linear(hidden, dim, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class Residual(nn.Module):
    """One sub-layer in its residual branch: post-norm LN(x + drop(f(x))) or pre-norm x + drop(f(LN(x)))."""

    def __init__(self, dim: int, pre_norm: bool, dropout: float, drop_path: float):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.pre_norm = pre_norm
        self.dropout = nn.Dropout(dropout)
        self.drop_path = DropPath(drop_path)

    def forward(self, x: torch.Tensor, fn, *args, **kwargs) -> torch.Tensor:
        if self.pre_norm:
            return x + self.drop_path(self.dropout(fn(self.norm(x), *args, **kwargs)))
        return self.norm(x + self.drop_path(self.dropout(fn(x, *args, **kwargs))))


class EncoderLayer(nn.Module):
    def __init__(self, dim: int, mixer: nn.Module, hidden: int, activation, *, pre_norm: bool, dropout: float,
                 drop_path: float, bias: bool):
        super().__init__()
        self.mixer = mixer
        self.mlp = FeedForward(dim, hidden, activation, bias=bias)
        self.res1 = Residual(dim, pre_norm, dropout, drop_path)
        self.res2 = Residual(dim, pre_norm, dropout, drop_path)

    def forward(self, x: torch.Tensor, padding_mask: torch.Tensor | None) -> torch.Tensor:
        x = self.res1(x, self.mixer, padding_mask=padding_mask)
        return self.res2(x, self.mlp)


class DecoderLayer(nn.Module):
    def __init__(self, dim: int, mixer: nn.Module, cross: CrossAttention, hidden: int, activation, *,
                 pre_norm: bool, dropout: float, drop_path: float, bias: bool):
        super().__init__()
        self.mixer = mixer
        self.cross = cross
        self.mlp = FeedForward(dim, hidden, activation, bias=bias)
        self.res1 = Residual(dim, pre_norm, dropout, drop_path)
        self.res2 = Residual(dim, pre_norm, dropout, drop_path)
        self.res3 = Residual(dim, pre_norm, dropout, drop_path)

    def forward(self, y, memory_kv, memory_padding_mask, padding_mask=None) -> torch.Tensor:
        y = self.res1(y, self.mixer, padding_mask=padding_mask)
        y = self.res2(y, self.cross, memory_kv, memory_padding_mask)
        return self.res3(y, self.mlp)

    def decode_step(self, y_t, state: dict, memory_kv, memory_padding_mask) -> tuple[torch.Tensor, dict]:
        """y_t (B, D) -> (B, D) and the self-mixer's next state; the same residual wiring as forward."""
        new_state = {}

        def mix(h):
            out, new_state["s"] = self.mixer.decode_step(h, state)
            return out

        y_t = self.res1(y_t, mix)
        y_t = self.res2(y_t[:, None], self.cross, memory_kv, memory_padding_mask)[:, 0]
        return self.res3(y_t, self.mlp), new_state["s"]


class EncoderDecoder(MixerModel):
    """Source tokens (B, Ns) and target tokens (B, Nt) -> next-token logits (B, Nt, vocab) (module docstring)."""

    def __init__(self, config: EncDecConfig):
        super().__init__()
        self.config = c = config
        self.embed_scale = math.sqrt(c.dim)
        self.tgt_embed = nn.Embedding(c.vocab_size, c.dim)
        self.src_embed = self.tgt_embed if c.embeddings == "shared" else nn.Embedding(c.source_vocab_size, c.dim)
        self.out_proj = None if c.embeddings != "separate" else nn.Linear(c.dim, c.vocab_size, bias=False)
        self.dropout = nn.Dropout(c.dropout)
        pre_norm, act, hidden = c.norm_position == "pre", ACTIVATIONS[c.activation], int(c.dim * c.mlp_ratio)
        rates = drop_path_rates(c.drop_path, c.depth + c.decoder_depth, "linear")
        common = dict(pre_norm=pre_norm, dropout=c.dropout, bias=True)
        self.encoder_layers = nn.ModuleList(
            EncoderLayer(c.dim, self._mixer(kind, layer, c.laplacian_counts[layer], causal=False), hidden, act,
                         drop_path=rates[layer], **common)
            for layer, kind in enumerate(c.mixer_kinds))
        self.decoder_layers = nn.ModuleList(
            DecoderLayer(c.dim, self._mixer(kind, layer, c.laplacian_counts_decoder[layer] * ("decoder" in c.sites),
                                            causal=True),
                         CrossAttention(c.dim, c.num_heads, c.laplacian_counts_decoder[layer] * ("cross" in c.sites),
                                        qkv_bias=c.qkv_bias),
                         hidden, act, drop_path=rates[c.depth + layer], **common)
            for layer, kind in enumerate(c.decoder_mixer_kinds))
        self.encoder_norm = nn.LayerNorm(c.dim) if pre_norm else nn.Identity()
        self.decoder_norm = nn.LayerNorm(c.dim) if pre_norm else nn.Identity()
        self.mixer_kinds = c.mixer_kinds + c.decoder_mixer_kinds
        self.reset_parameters()

    def _mixer(self, kind: str, layer: int, laplacian_heads: int, *, causal: bool) -> nn.Module:
        """Layer ``layer``'s self-mixer. Attention is the registry's plus padding masks and a K/V cache; any other
        kind comes from the registry and must take ``padding_mask`` (and, in the decoder, decode step by step)."""
        c = self.config
        if kind == "attention":
            return SelfAttention(c.dim, c.num_heads, laplacian_heads, causal=causal, qkv_bias=c.qkv_bias)
        ctx = LayerContext(dim=c.dim, num_heads=c.num_heads, layer=layer, laplacian_heads=laplacian_heads,
                           causal=causal, seq_len=c.context_length, qkv_bias=c.qkv_bias, proj_bias=True, rope=None)
        mixer = build_mixer(kind, ctx, c.mixer_options)
        if causal and not hasattr(mixer, "decode_step"):
            raise ConfigError("decoder_mixer", f"mixer {kind!r} has no decode_step, so it cannot decode")
        return mixer

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """fairseq's Transformer: Xavier-uniform projections with zero biases, embeddings N(0, 1/D) (unit variance
        once scaled by sqrt(D)). STLT mixers keep their own node, readout and gate initialisation."""
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.xavier_uniform_(module.weight)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, nn.Embedding):
                nn.init.normal_(module.weight, mean=0.0, std=self.config.dim ** -0.5)

    # The blocks the MixerModel hooks (regulariser, tau schedule, stats, slow parameters) visit: every layer with a
    # `.mixer`, encoder first. A property, so the layers have one owner in the state dict.
    @property
    def blocks(self) -> list[nn.Module]:
        return [*self.encoder_layers, *self.decoder_layers]

    def layer_names(self) -> list[str]:
        """``enc0 ... dec0 ...``: per layer of each stack, in the order of ``blocks``."""
        return [f"enc{layer}" for layer in range(len(self.encoder_layers))] + [
            f"dec{layer}" for layer in range(len(self.decoder_layers))]

    def _embed(self, table: nn.Embedding, tokens: torch.Tensor, offset: int = 0) -> torch.Tensor:
        x = table(tokens) * self.embed_scale
        if self.config.positions == "sinusoidal":
            x = x + sinusoidal_positions(tokens.shape[1], self.config.dim, offset=offset, device=x.device,
                                         dtype=x.dtype)
        return self.dropout(x)

    def _logits(self, y: torch.Tensor) -> torch.Tensor:
        return self.out_proj(y) if self.out_proj is not None else y @ self.tgt_embed.weight.T

    def encode(self, src_tokens: torch.Tensor, src_padding_mask: torch.Tensor | None = None) -> Memory:
        """src_tokens (B, Ns), right-padded with pad_id -> Memory (states (B, Ns, D), padding mask (B, Ns))."""
        if src_padding_mask is None:
            src_padding_mask = src_tokens == self.config.pad_id
        x = self._embed(self.src_embed, src_tokens)
        for layer in self.encoder_layers:
            x = layer(x, src_padding_mask)
        return Memory(self.encoder_norm(x), src_padding_mask)

    def decode(self, tgt_tokens: torch.Tensor, memory: Memory,
               tgt_padding_mask: torch.Tensor | None = None) -> torch.Tensor:
        """tgt_tokens (B, Nt) (the decoder input: BOS then the target shifted right) -> logits (B, Nt, vocab),
        position n predicting the token after tgt_tokens[:, n] from tokens 0..n only."""
        if tgt_padding_mask is None:
            tgt_padding_mask = tgt_tokens == self.config.pad_id
        y = self._embed(self.tgt_embed, tgt_tokens)
        for layer in self.decoder_layers:
            y = layer(y, layer.cross.memory_kv(memory.states), memory.padding_mask, tgt_padding_mask)
        return self._logits(self.decoder_norm(y))

    def forward(self, src_tokens: torch.Tensor, tgt_tokens: torch.Tensor,
                src_padding_mask: torch.Tensor | None = None,
                tgt_padding_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Teacher-forced logits (B, Nt, vocab); masks default to ``tokens == pad_id``."""
        return self.decode(tgt_tokens, self.encode(src_tokens, src_padding_mask), tgt_padding_mask)

    # Incremental decoding.

    def init_decoder_state(self, memory: Memory) -> DecoderState:
        """The state before the first target token: the cross-attention keys and values of the encoder output
        (computed here, once) and an empty self-mixer state per layer."""
        B, dtype = memory.states.shape[0], memory.states.dtype
        return DecoderState(
            memory_kv=[layer.cross.memory_kv(memory.states) for layer in self.decoder_layers],
            memory_padding_mask=memory.padding_mask,
            layers=[layer.mixer.init_state(B, device=memory.states.device, dtype=dtype)
                    for layer in self.decoder_layers])

    def decode_step(self, tokens: torch.Tensor, state: DecoderState) -> tuple[torch.Tensor, DecoderState]:
        """tokens (B,), the decoder input at position ``state.position`` -> (logits (B, vocab) for the next token,
        the next state). Feeding a target's tokens one by one gives `decode`'s logits position by position."""
        y = self._embed(self.tgt_embed, tokens[:, None], offset=state.position)[:, 0]
        layers = []
        for layer, layer_state, kv in zip(self.decoder_layers, state.layers, state.memory_kv):
            y, new = layer.decode_step(y, layer_state, kv, state.memory_padding_mask)
            layers.append(new)
        logits = self._logits(self.decoder_norm(y))
        return logits, DecoderState(state.memory_kv, state.memory_padding_mask, layers, state.position + 1)

    @staticmethod
    def reorder_decoder_state(state: DecoderState, index: torch.Tensor) -> DecoderState:
        """Row i of the new state is row index[i] of the old (beam search keeping its best hypotheses). Only the
        per-step states move: the rows of ``index`` must share their source (the beams of one sentence do), so the
        encoder's keys and values stay as they are."""
        layers = [{key: value.index_select(0, index) for key, value in layer.items()} for layer in state.layers]
        return DecoderState(state.memory_kv, state.memory_padding_mask, layers, state.position)

    @staticmethod
    def repeat_memory(memory: Memory, times: int) -> Memory:
        """Each source row repeated ``times`` times in a row (B * times rows): the beams of a sentence."""
        return Memory(memory.states.repeat_interleave(times, dim=0),
                      memory.padding_mask.repeat_interleave(times, dim=0))
