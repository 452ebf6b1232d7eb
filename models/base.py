"""What every model of the package offers a training loop beyond forward()."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import NamedTuple

import torch
from torch import nn


class ModelOutput(NamedTuple):
    logits: torch.Tensor
    tokens: torch.Tensor  # last-layer token representations after the final norm, (B, T, d)
    feature: torch.Tensor  # what the classifier reads: (B, d) for the ViT, the tokens themselves for the GPT


class MixerModel(nn.Module):
    """Base of the ViT and the GPT: forwards training-loop hooks to the token mixers that implement them.

    Subclasses set ``self.blocks`` (each with a ``.mixer``: models/mixers.py's ``build_blocks``) and
    ``self.mixer_kinds`` (the registry name per layer).
    Mixers may implement ``regularization_loss()``, ``set_training_step(step, total_steps)``, ``stats()``,
    ``slow_parameters()`` and ``start_node_count()`` / ``stop_node_count()``; attention implements none of them.
    Subclasses also have ``norm`` (the final norm) and
    ``pool(tokens)`` (what the classifier or output head reads of the tokens).
    """

    blocks: nn.ModuleList
    mixer_kinds: list[str]

    @contextmanager
    def layer_outputs(self) -> Iterator[list[torch.Tensor]]:
        """Within it, every forward appends each block's output passed through the final norm, (B, T, d) per layer
        in order, to the list it yields: the last one is the forward's own last-layer tokens, the others are the
        same view of the earlier layers (for per-layer geometry)."""
        outputs: list[torch.Tensor] = []
        hooks = [block.register_forward_hook(lambda module, args, out: outputs.append(self.norm(out)))
                 for block in self.blocks]
        try:
            yield outputs
        finally:
            for hook in hooks:
                hook.remove()

    def _mixers_with(self, method: str):
        return [block.mixer for block in self.blocks if hasattr(block.mixer, method)]

    def layer_names(self) -> list[str]:
        """What the per-layer metrics call each block's layer (``l3``), in the order of ``blocks``."""
        return [f"l{layer}" for layer in range(len(self.blocks))]

    def regularization_loss(self) -> torch.Tensor:
        """Mean of the mixers' regularisers over the layers that have one (zero for a pure-attention model): add it
        to the task loss. A mean, not a sum, so that the penalty keeps the scale of one layer's (docs/stlt.md)."""
        total = torch.zeros((), device=next(self.parameters()).device)
        mixers = self._mixers_with("regularization_loss")
        for mixer in mixers:
            total = total + mixer.regularization_loss()
        return total / max(len(mixers), 1)

    def set_training_step(self, step: int, total_steps: int) -> None:
        """Call once per optimiser step: drives schedules inside mixers (temperatures, regulariser start)."""
        for mixer in self._mixers_with("set_training_step"):
            mixer.set_training_step(step, total_steps)

    def mixer_stats(self) -> dict[str, float]:
        """Per-layer statistics of the mixers for logging, e.g. ``{"stlt_T_l3": 8.0}``."""
        stats = {}
        for name, kind, block in zip(self.layer_names(), self.mixer_kinds, self.blocks):
            if hasattr(block.mixer, "stats"):
                stats.update({f"{kind}_{key}_{name}": value for key, value in block.mixer.stats().items()})
        return stats

    @contextmanager
    def counting_active_nodes(self) -> Iterator[dict[str, torch.Tensor]]:
        """Within it, every forward in evaluation mode counts each gated layer's active nodes; on exit the dict it
        yielded holds, per such layer (``stlt_s_eff_l3``), [active (row, node) pairs, rows] (float64) over those
        forwards, so that S_eff = active / rows (a row: a sequence of a bilateral layer, a position of a causal
        one). Sums, so that workers' counts add up."""
        counted = {f"{kind}_s_eff_{name}": block.mixer
                   for name, kind, block in zip(self.layer_names(), self.mixer_kinds, self.blocks)
                   if hasattr(block.mixer, "start_node_count")}
        for mixer in counted.values():
            mixer.start_node_count()
        counts: dict[str, torch.Tensor] = {}
        try:
            yield counts
        finally:
            counts.update({name: mixer.stop_node_count() for name, mixer in counted.items()})

    def no_weight_decay(self) -> set[str]:
        """Names of parameters that never get weight decay besides biases and norms (overridden per model)."""
        return set()

    def param_groups(self, weight_decay: float, slow_lr_scale: float = 1.0) -> list[dict]:
        """Optimiser groups: decay on matrices only; the mixers' slow parameters (STLT sigma/omega) at
        ``slow_lr_scale`` times the learning rate. Each group carries ``lr_scale`` for the scheduler."""
        slow = {id(p) for mixer in self._mixers_with("slow_parameters") for p in mixer.slow_parameters()}
        skip = self.no_weight_decay()
        decay, no_decay, slow_params = [], [], []
        for name, p in self.named_parameters():
            if not p.requires_grad:
                continue
            if id(p) in slow:
                slow_params.append(p)
            elif p.ndim < 2 or name in skip:
                no_decay.append(p)
            else:
                decay.append(p)
        groups = [
            {"params": decay, "weight_decay": weight_decay, "lr_scale": 1.0},
            {"params": no_decay, "weight_decay": 0.0, "lr_scale": 1.0},
            {"params": slow_params, "weight_decay": 0.0, "lr_scale": slow_lr_scale},
        ]
        return [g for g in groups if g["params"]]


def count_parameters(model: nn.Module) -> int:
    """Number of distinct parameters (tied weights counted once); works on the meta device."""
    return sum(p.numel() for p in model.parameters())
