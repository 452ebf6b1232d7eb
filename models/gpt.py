"""A GPT-2-style decoder with Laplacian heads.

Token embedding, rotary position embedding on queries and keys (no learned positions), causal pre-norm blocks
without biases, a final norm and an output head (untied by default, as in the paper's ~561M setting).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from models.base import MixerModel, ModelOutput
from models.checks import check_bool, check_int, check_number
from models.config import TransformerConfig
from models.rope import RotaryEmbedding


@dataclass
class GPTConfig(TransformerConfig):
    vocab_size: int = 257
    context_length: int = 256
    tie_embeddings: bool = False
    rope_base: float = 10000.0

    def __post_init__(self):
        check_int("vocab_size", self.vocab_size, low=2)
        check_int("context_length", self.context_length, low=1)
        check_bool("tie_embeddings", self.tie_embeddings)
        check_number("rope_base", self.rope_base, low=1.0, low_open=True)
        super().__post_init__()


class GPT(MixerModel):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.config = c = config
        self.wte = nn.Embedding(c.vocab_size, c.dim)
        # One table shared by all layers: RoPE has no parameters, so it costs nothing in the parameter count.
        self.rope = RotaryEmbedding(c.dim // c.num_heads, c.context_length, c.rope_base)
        self._build_blocks(c, causal=True, seq_len=c.context_length, proj_bias=False, rope=self.rope, bias=False)
        self.norm = nn.LayerNorm(c.dim, bias=False)
        self.lm_head = nn.Linear(c.dim, c.vocab_size, bias=False)
        if c.tie_embeddings:
            self.lm_head.weight = self.wte.weight
        self.apply(_init_weights)
        # GPT-2: scale the init of the projections that write into the residual stream by 1/sqrt(2 * depth).
        for name, p in self.named_parameters():
            if name.endswith(("proj.weight", "fc2.weight")):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * c.depth))

    def forward(self, idx: torch.Tensor, return_features: bool = False):
        """idx (B, L) token ids -> logits (B, L, vocab), or ModelOutput whose tokens and feature are both the
        last-layer representations after the final norm (B, L, d): the output head reads every position."""
        x = self.wte(idx)
        for block in self.blocks:
            x = block(x)
        tokens = self.norm(x)
        logits = self.lm_head(tokens)
        return ModelOutput(logits, tokens, tokens) if return_features else logits

    def pool(self, tokens: torch.Tensor) -> torch.Tensor:
        """The output head reads every position: the feature is the tokens themselves."""
        return tokens

    @property
    def classifier_weight(self) -> torch.Tensor:
        return self.lm_head.weight

    @property
    def classifier_bias(self) -> torch.Tensor | None:
        return self.lm_head.bias  # None: the output head has no bias


def _init_weights(module: nn.Module) -> None:
    if isinstance(module, nn.Linear | nn.Embedding):
        nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if getattr(module, "bias", None) is not None:
            nn.init.zeros_(module.bias)
