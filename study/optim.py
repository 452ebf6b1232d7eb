"""The optimiser and learning-rate schedule of a run, from its training keys (`TrainConfig`)."""

from __future__ import annotations

import math

import torch
from pytorch_optimizer import Lamb

from study.runspec import TrainConfig


class WarmupCosine:
    """lr factor at optimiser step s: linear warm-up to 1 over `warmup` steps, then cosine to `min_ratio`."""

    def __init__(self, warmup: int, total: int, min_ratio: float):
        self.warmup, self.total, self.min_ratio = warmup, total, min_ratio

    def __call__(self, step: int) -> float:
        if step < self.warmup:
            return (step + 1) / self.warmup
        progress = min(1.0, (step - self.warmup) / max(1, self.total - self.warmup))
        return self.min_ratio + (1 - self.min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def build_optimizer(model, train: TrainConfig, slow_scale: float) -> torch.optim.Optimizer:
    """AdamW (or LAMB) over the model's own parameter groups: decay on matrices only, the mixers' slow parameters
    at `slow_scale` times the learning rate (each group's `lr_scale`)."""
    groups = model.param_groups(train.weight_decay, slow_scale)
    for group in groups:
        group["lr"] = train.lr * group["lr_scale"]
    betas = (train.beta1, train.beta2)
    if train.optimizer == "lamb":
        return Lamb(groups, lr=train.lr, betas=betas, eps=train.eps, weight_decay=train.weight_decay)
    if train.optimizer == "sgd":  # coupled weight decay, as torch's SGD (and eval_linear.py) apply it
        return torch.optim.SGD(groups, lr=train.lr, momentum=train.beta1, weight_decay=train.weight_decay)
    return torch.optim.AdamW(groups, lr=train.lr, betas=betas, eps=train.eps, weight_decay=train.weight_decay)


def build_schedule(optimizer, train: TrainConfig, steps_per_epoch: int, epochs: int):
    """Warm-up then cosine over the whole run, stepped once per optimiser step."""
    schedule = WarmupCosine(round(train.warmup_epochs * steps_per_epoch), steps_per_epoch * epochs, train.min_lr_ratio)
    return torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)


def peak_lr(optimizer: torch.optim.Optimizer) -> float:
    """The schedule's current learning rate for the global batch (what `lr` means in a config)."""
    group = optimizer.param_groups[0]
    return group["lr"] / group["lr_scale"]
