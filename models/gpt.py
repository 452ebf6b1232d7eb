"""A decoder-only GPT with Laplacian heads, in one of two block styles.

``block_style: "gpt2"``: token embedding, rotary position embedding on queries and keys (no learned positions),
causal pre-LayerNorm blocks without biases, a GELU MLP, a final LayerNorm and an output head, GPT-2's init.

``block_style: "nanochat"``: karpathy/nanochat's GPT (nanochat/gpt.py at commit e1770a3, the ~561M d20 of the
speedrun, which is the paper's language model); docs/nanochat.md lists what it has and where each piece lives here.
RMS norm without parameters after the token embedding, before each branch and at the end; separate q, k, v
projections with RoPE (rotating by -angle, as nanochat does) then RMS-normalised queries and keys; grouped key/value
heads; a ReLU^2 MLP; no biases; an untied head whose logits are soft-capped at 15 by 15 * tanh(logits / 15);
nanochat's init (below).

Both decode incrementally: ``new_cache`` and ``forward(idx, cache=...)`` process only new tokens, ``generate`` samples
with them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from models.attention import RotaryQKNormAttention
from models.base import MixerModel, ModelOutput
from models.checks import check_bool, check_choice, check_int, check_number
from models.config import TransformerConfig
from models.errors import ConfigError
from models.layers import make_norm
from models.mixers import build_blocks
from models.rope import RotaryEmbedding, check_head_dim

BLOCK_STYLES = ("gpt2", "nanochat")
NANOCHAT_SOFTCAP = 15.0  # nanochat/gpt.py: logits = softcap * tanh(logits / softcap), softcap = 15
NANOCHAT_ROPE_SPAN = 10  # nanochat's RoPE table covers 10 x sequence_len positions (room to generate past it)


@dataclass
class GPTConfig(TransformerConfig):
    vocab_size: int = 257
    context_length: int = 256
    tie_embeddings: bool = False
    rope_base: float = 10000.0
    # "gpt2" or "nanochat" (module docstring, docs/nanochat.md).
    block_style: str = "gpt2"
    # Key/value heads shared by groups of query heads (GQA, nanochat style only); None: one per query head.
    num_kv_heads: int | None = None

    def __post_init__(self):
        check_int("vocab_size", self.vocab_size, low=2)
        check_int("context_length", self.context_length, low=1)
        check_bool("tie_embeddings", self.tie_embeddings)
        check_number("rope_base", self.rope_base, low=1.0, low_open=True)
        check_choice("block_style", self.block_style, BLOCK_STYLES)
        super().__post_init__()
        check_head_dim("num_heads", self.dim // self.num_heads)  # the GPT's queries and keys are rotated
        if self.num_kv_heads is not None:
            check_int("num_kv_heads", self.num_kv_heads, low=1, high=self.num_heads)
            if self.num_heads % self.num_kv_heads:
                raise ConfigError("num_kv_heads", f"must divide num_heads ({self.num_heads}), got {self.num_kv_heads}")
            if self.block_style != "nanochat" and self.num_kv_heads != self.num_heads:
                raise ConfigError("num_kv_heads", "grouped key/value heads need block_style: nanochat")
        if self.block_style == "nanochat":
            # nanochat's GPT has neither; its zero-initialised head would zero a tied embedding.
            if self.tie_embeddings:
                raise ConfigError("tie_embeddings", "must be false with block_style: nanochat (its head is untied)")
            if self.qkv_bias:
                raise ConfigError("qkv_bias", "must be false with block_style: nanochat (no biases)")

    def _unread_keys(self) -> frozenset[str]:
        # GQA is nanochat's; its projections have no biases (refused above when set)
        return super()._unread_keys() | ({"qkv_bias"} if self.block_style == "nanochat" else {"num_kv_heads"})


class DecodingCache:
    """A GPT's incremental-decoding state: one entry per layer (what that layer's mixer's ``new_cache`` returned)
    and ``length``, the number of positions processed so far (the position of the next token)."""

    def __init__(self, layers: list):
        self.layers = layers
        self.length = 0


class StepwiseState:
    """Decoding state of a mixer that decodes one position at a time through ``init_state(batch_size, device=,
    dtype=)`` and ``decode_step(x_t, state) -> (y_t, state)`` (the causal STLT): made on the first tokens it sees."""

    def __init__(self):
        self.state = None

    def mix(self, mixer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """x (B, N, D), the new positions -> the mixer's outputs (B, N, D), one decode_step per position."""
        if self.state is None:
            self.state = mixer.init_state(x.shape[0], device=x.device, dtype=x.dtype)
        outputs = []
        for t in range(x.shape[1]):
            y, self.state = mixer.decode_step(x[:, t], self.state)
            outputs.append(y)
        return torch.stack(outputs, dim=1)


class GPT(MixerModel):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.config = c = config
        nanochat = c.block_style == "nanochat"
        self.wte = nn.Embedding(c.vocab_size, c.dim)
        # One table shared by all layers: RoPE has no parameters, so it costs nothing in the parameter count.
        rope_len = c.context_length * (NANOCHAT_ROPE_SPAN if nanochat else 1)
        self.rope = RotaryEmbedding(c.dim // c.num_heads, rope_len, c.rope_base, clockwise=nanochat)
        norm = "rmsnorm" if nanochat else "layernorm"
        self.mixer_kinds = c.mixer_kinds
        self.blocks = build_blocks(c, causal=True, seq_len=c.context_length, proj_bias=False, rope=self.rope,
                                   bias=False, norm=norm, mlp_act="relu2" if nanochat else "gelu",
                                   block_style=c.block_style, num_kv_heads=c.num_kv_heads)
        self.embed_norm = make_norm("rmsnorm", c.dim) if nanochat else nn.Identity()
        self.norm = make_norm(norm, c.dim, bias=False)
        self.lm_head = nn.Linear(c.dim, c.vocab_size, bias=False)
        self.softcap = NANOCHAT_SOFTCAP if nanochat else None
        if c.tie_embeddings:
            self.lm_head.weight = self.wte.weight
        if nanochat:
            self._init_nanochat()
        else:
            self.apply(_init_weights)
            # GPT-2: scale the init of the projections that write into the residual stream by 1/sqrt(2 * depth).
            for name, p in self.named_parameters():
                if name.endswith(("proj.weight", "fc2.weight")):
                    nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * c.depth))

    @torch.no_grad()
    def _init_nanochat(self) -> None:
        """nanochat's ``init_weights``: embedding N(0, 1); every linear N(0, std) with std = min(1, sqrt(fan_out /
        fan_in)) / sqrt(fan_in) (arXiv 2310.17813); then the head and the two projections that write into the
        residual stream (attention output, MLP output) zero. Mixers other than attention keep their own init."""
        nn.init.normal_(self.wte.weight, mean=0.0, std=1.0)
        for block in self.blocks:
            owned = [block.mlp] + ([block.mixer] if isinstance(block.mixer, RotaryQKNormAttention) else [])
            for linear in (m for part in owned for m in part.modules() if isinstance(m, nn.Linear)):
                fan_out, fan_in = linear.weight.shape
                nn.init.normal_(linear.weight, mean=0.0, std=min(1.0, math.sqrt(fan_out / fan_in)) / math.sqrt(fan_in))
            nn.init.zeros_(block.mlp.fc2.weight)
            if isinstance(block.mixer, RotaryQKNormAttention):
                nn.init.zeros_(block.mixer.proj.weight)
        nn.init.zeros_(self.lm_head.weight)

    def forward(self, idx: torch.Tensor, return_features: bool = False, cache: DecodingCache | None = None):
        """idx (B, L) token ids -> logits (B, L, vocab), or ModelOutput whose tokens and feature are both the
        last-layer representations after the final norm (B, L, d): the output head reads every position.

        With a ``cache`` (from ``new_cache``), idx holds the L tokens after the ``cache.length`` already processed;
        their logits equal those a forward over the whole sequence gives at those positions, and the cache
        advances by L. Nanochat-style logits are soft-capped and at least float32, as nanochat returns them.
        """
        x = self.embed_norm(self.wte(idx))
        if cache is None:
            for block in self.blocks:
                x = block(x)
        else:
            for block, state in zip(self.blocks, cache.layers):
                x = block(x, cache=state)
            cache.length += idx.shape[1]
        tokens = self.norm(x)
        logits = self.lm_head(tokens)
        if self.softcap is not None:
            # nanochat switches to float32 for the cap and the loss (a float64 model stays float64).
            logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
            logits = self.softcap * torch.tanh(logits / self.softcap)
        return ModelOutput(logits, tokens, tokens) if return_features else logits

    def new_cache(self, capacity: int = 0) -> DecodingCache:
        """An empty decoding cache; ``capacity`` (positions) pre-sizes attention's. A mixer takes part in incremental
        decoding with ``new_cache(capacity)``, a state whose ``mix(mixer, x)`` runs it on new positions (attention),
        or with ``init_state`` and ``decode_step`` (the causal STLT: ``StepwiseState``)."""
        states = []
        for layer, (kind, block) in enumerate(zip(self.mixer_kinds, self.blocks)):
            if hasattr(block.mixer, "new_cache"):
                states.append(block.mixer.new_cache(capacity))
            elif hasattr(block.mixer, "init_state") and hasattr(block.mixer, "decode_step"):
                states.append(StepwiseState())
            else:
                raise NotImplementedError(
                    f"incremental decoding needs a decoding state in every layer, but layer {layer}'s mixer "
                    f"({kind!r}, {type(block.mixer).__name__}) has none; use forward() on the whole sequence instead")
        return DecodingCache(states)

    @torch.no_grad()
    def generate(self, idx: torch.Tensor, max_new_tokens: int, temperature: float = 0.0, top_k: int | None = None,
                 generator: torch.Generator | None = None) -> torch.Tensor:
        """idx (B, T) -> (B, T + max_new_tokens): idx followed by sampled tokens, with a decoding cache (the prompt
        in one forward, then one token per forward).

        Sampling as nanochat's ``sample_next_token``: keep the ``top_k`` largest logits, then argmax when
        ``temperature`` is 0, else draw from softmax(logits / temperature) with ``generator``. Runs in eval mode
        (no stochastic depth) and restores the previous mode.
        """
        check_int("max_new_tokens", max_new_tokens, low=0)
        check_number("temperature", temperature, low=0.0)
        was_training = self.training
        self.eval()
        try:
            cache = self.new_cache(idx.shape[1] + max_new_tokens)
            out = [idx]
            if max_new_tokens:
                logits = self(idx, cache=cache)[:, -1]
            for step in range(max_new_tokens):
                token = sample_next_token(logits, temperature, top_k, generator)
                out.append(token)
                if step + 1 < max_new_tokens:
                    logits = self(token, cache=cache)[:, -1]
            return torch.cat(out, dim=1)
        finally:
            self.train(was_training)

    def pool(self, tokens: torch.Tensor) -> torch.Tensor:
        """The output head reads every position: the feature is the tokens themselves."""
        return tokens

    @property
    def classifier_weight(self) -> torch.Tensor:
        return self.lm_head.weight

    @property
    def classifier_bias(self) -> torch.Tensor | None:
        return self.lm_head.bias  # None: the output head has no bias


def sample_next_token(logits: torch.Tensor, temperature: float = 0.0, top_k: int | None = None,
                      generator: torch.Generator | None = None) -> torch.Tensor:
    """logits (B, V) -> next token ids (B, 1): top-k filter, then greedy (temperature 0) or a softmax draw."""
    if top_k is not None and top_k > 0:
        kth = torch.topk(logits, min(top_k, logits.shape[-1])).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if temperature == 0:
        return logits.argmax(dim=-1, keepdim=True)
    probs = F.softmax(logits / temperature, dim=-1)
    return torch.multinomial(probs, num_samples=1, generator=generator)


def _init_weights(module: nn.Module) -> None:
    if isinstance(module, nn.Linear | nn.Embedding):
        nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if getattr(module, "bias", None) is not None:
            nn.init.zeros_(module.bias)
