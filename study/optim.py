"""The optimiser and learning-rate schedule of a run, from its training keys (`TrainConfig`)."""

from __future__ import annotations

import math

import torch

from models.nanochat_optim import build_nanochat_optimizers, set_nanochat_schedule
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


class WarmupInverseSqrt:
    """lr factor at optimiser step s (step n = s + 1): min(n / warmup, sqrt(warmup / n)), the Transformer's
    d^-0.5 min(n^-0.5, n warmup^-1.5) divided by its peak d^-0.5 warmup^-0.5 (so `lr` is the peak)."""

    def __init__(self, warmup: int):
        self.warmup = max(1, warmup)

    def __call__(self, step: int) -> float:
        n = step + 1
        return min(n / self.warmup, math.sqrt(self.warmup / n))


class NanochatOptimizer:
    """nanochat's two optimisers as the one the training loop steps, zeroes and checkpoints: AdamW (embedding, head)
    then Muon (the blocks' matrices), as base_train.py steps them. Their groups carry `initial_lr` and no `lr_scale`:
    `NanochatSchedule` sets their lr, not a LambdaLR."""

    def __init__(self, adamw: torch.optim.AdamW, muon: torch.optim.Muon):
        self.adamw, self.muon = adamw, muon
        self.optimizers = (adamw, muon)

    @property
    def param_groups(self) -> list[dict]:
        return [group for optimizer in self.optimizers for group in optimizer.param_groups]

    def zero_grad(self, set_to_none: bool = True) -> None:
        for optimizer in self.optimizers:
            optimizer.zero_grad(set_to_none=set_to_none)

    def step(self) -> None:
        for optimizer in self.optimizers:
            optimizer.step()

    def state_dict(self) -> dict:
        return {"adamw": self.adamw.state_dict(), "muon": self.muon.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.adamw.load_state_dict(state["adamw"])
        self.muon.load_state_dict(state["muon"])


class NanochatSchedule:
    """nanochat's schedule, stepped once per optimiser step like a LambdaLR: before optimiser step s every group's
    lr is initial_lr x `nanochat_lr_multiplier(s, total)` and Muon's momentum `nanochat_muon_momentum(s)`
    (models/nanochat_optim.py `set_nanochat_schedule`)."""

    def __init__(self, optimizer: NanochatOptimizer, total: int, *, warmup_ratio: float, warmdown_ratio: float,
                 final_lr_frac: float, momentum_warmup: int):
        self.optimizer, self.total, self.last_step = optimizer, total, 0
        self.ratios = dict(warmup_ratio=warmup_ratio, warmdown_ratio=warmdown_ratio, final_lr_frac=final_lr_frac,
                           momentum_warmup=momentum_warmup)
        self._apply()

    def _apply(self) -> None:
        set_nanochat_schedule(self.optimizer.optimizers, min(self.last_step, self.total), self.total, **self.ratios)

    def step(self) -> None:
        self.last_step += 1
        self._apply()

    def state_dict(self) -> dict:
        return {"last_step": self.last_step}

    def load_state_dict(self, state: dict) -> None:
        self.last_step = state["last_step"]
        self._apply()


def build_optimizer(model, train: TrainConfig, slow_scale: float):
    """AdamW (or LAMB) over the model's own parameter groups: decay on matrices only, the mixers' slow parameters
    at `slow_scale` times the learning rate (each group's `lr_scale`). `nanochat`: nanochat's split of a GPT
    (`NanochatOptimizer`), its own learning rates, weight decay on its AdamW groups as nanochat applies it."""
    if train.optimizer == "nanochat":
        return NanochatOptimizer(*build_nanochat_optimizers(
            model, weight_decay=train.weight_decay, unembedding_lr=train.unembedding_lr,
            embedding_lr=train.embedding_lr, matrix_lr=train.matrix_lr, slow_lr_scale=slow_scale))
    groups = model.param_groups(train.weight_decay, slow_scale)
    for group in groups:
        group["lr"] = train.lr * group["lr_scale"]
    betas = (train.beta1, train.beta2)
    if train.optimizer == "lamb":
        from pytorch_optimizer import Lamb  # it imports torch.distributed.tensor (~0.5 s): only LAMB recipes pay

        return Lamb(groups, lr=train.lr, betas=betas, eps=train.eps, weight_decay=train.weight_decay)
    if train.optimizer == "sgd":  # coupled weight decay, as torch's SGD (and eval_linear.py) apply it
        return torch.optim.SGD(groups, lr=train.lr, momentum=train.beta1, weight_decay=train.weight_decay)
    return torch.optim.AdamW(groups, lr=train.lr, betas=betas, eps=train.eps, weight_decay=train.weight_decay)


def build_schedule(optimizer, train: TrainConfig, steps_per_epoch: int, epochs: int):
    """Warm-up then cosine over the whole run (or `lr_decay: inverse_sqrt`), stepped once per optimiser step;
    nanochat's warm-up, flat, linear
    warm-down (`NanochatSchedule`) for its optimiser, `warmup_epochs` its warm-up, `min_lr_ratio` its final_lr_frac."""
    if isinstance(optimizer, NanochatOptimizer):
        total = steps_per_epoch * epochs
        return NanochatSchedule(optimizer, total, warmup_ratio=train.warmup_epochs * steps_per_epoch / total,
                                warmdown_ratio=train.warmdown_ratio, final_lr_frac=train.min_lr_ratio,
                                momentum_warmup=train.muon_momentum_warmup)
    warmup = round(train.warmup_epochs * steps_per_epoch)
    if train.lr_decay == "inverse_sqrt":
        return torch.optim.lr_scheduler.LambdaLR(optimizer, WarmupInverseSqrt(warmup))
    return torch.optim.lr_scheduler.LambdaLR(optimizer, WarmupCosine(warmup, steps_per_epoch * epochs,
                                                                     train.min_lr_ratio))


def peak_lr(optimizer) -> float:
    """The schedule's current learning rate for the global batch (what `lr` means in a config); nanochat's: Muon's
    (matrix_lr times the multiplier)."""
    if isinstance(optimizer, NanochatOptimizer):
        return optimizer.muon.param_groups[0]["lr"]
    group = optimizer.param_groups[0]
    return group["lr"] / group["lr_scale"]
