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


class Lamb(torch.optim.Optimizer):
    """LAMB as DeiT III trains with it (`--opt fusedlamb`): apex's FusedLAMB as timm's create_optimizer builds it,
    its arithmetic in PyTorch (NVIDIA/apex at 6424da3: apex/optimizers/fused_lamb.py, csrc/multi_tensor_lamb.cu;
    timm's optim/lamb.py is the same update). One step, t the group's step count (from 1)::

        c = max(1, ||g||_global / max_grad_norm)     every group's gradients clipped as one vector (fused_lamb.py:
                                                      126-160; the kernel's clipped_global_grad_norm, .cu:53-54)
        m = beta1 m + (1 - beta1) g / c;   v = beta2 v + (1 - beta2) (g / c)^2
        u = (m / (1 - beta1^t)) / (sqrt(v / (1 - beta2^t)) + eps) + weight_decay p      (.cu:111-117)
        p = p - lr r u,  r = ||p|| / ||u|| where weight_decay != 0 and both norms are > 0, else 1   (.cu:210-217)

    FusedLAMB's settings as DeiT leaves them (fused_lamb.py:63-77): bias correction, gradient averaging, the decay
    inside the update and so inside the trust ratio (adam_w_mode), no trust ratio on groups without decay
    (use_nvlamb off), global clipping at max_grad_norm 1.0, the trust ratio not clamped. DeiT passes lr, eps
    (--opt-eps, 1e-8) and the groups' weight decay; its --clip-grad (the loop's `grad_clip`) is off."""

    def __init__(self, params, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-6,
                 weight_decay: float = 0.01, max_grad_norm: float = 1.0):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))
        self.max_grad_norm = max_grad_norm

    @torch.no_grad()
    def step(self) -> None:
        grads = [p.grad for group in self.param_groups for p in group["params"] if p.grad is not None]
        if not grads:
            return
        global_norm = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads)))
        clip = torch.clamp(global_norm / self.max_grad_norm, min=1.0)  # stays on the device: no sync
        for group in self.param_groups:
            group["step"] = group.get("step", 0) + 1  # one count per group, as FusedLAMB keeps it
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            for p in params:
                if not self.state[p]:
                    self.state[p] = {"exp_avg": torch.zeros_like(p), "exp_avg_sq": torch.zeros_like(p)}
            exp_avg = [self.state[p]["exp_avg"] for p in params]
            exp_avg_sq = [self.state[p]["exp_avg_sq"] for p in params]
            beta1, beta2 = group["betas"]
            grads = torch._foreach_div([p.grad for p in params], clip)
            torch._foreach_mul_(exp_avg, beta1)
            torch._foreach_add_(exp_avg, grads, alpha=1 - beta1)
            torch._foreach_mul_(exp_avg_sq, beta2)
            torch._foreach_addcmul_(exp_avg_sq, grads, grads, value=1 - beta2)
            denominator = torch._foreach_div(exp_avg_sq, 1 - beta2 ** group["step"])
            torch._foreach_sqrt_(denominator)
            torch._foreach_add_(denominator, group["eps"])
            update = torch._foreach_div(exp_avg, 1 - beta1 ** group["step"])
            torch._foreach_div_(update, denominator)
            if group["weight_decay"] != 0:
                param_norms = torch.stack(torch._foreach_norm(params))  # of the weights before this step
                torch._foreach_add_(update, params, alpha=group["weight_decay"])
                update_norms = torch.stack(torch._foreach_norm(update))
                trust = torch.where((param_norms > 0) & (update_norms > 0), param_norms / update_norms, 1.0)
                torch._foreach_mul_(update, list(trust.unbind()))
            torch._foreach_add_(params, update, alpha=-group["lr"])


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
    """AdamW (or LAMB, or SGD) over the model's own parameter groups: decay on matrices only, the mixers' slow
    parameters at `slow_scale` times the learning rate (each group's `lr_scale`). `nanochat`: nanochat's split of a GPT
    (`NanochatOptimizer`), its own learning rates, weight decay on its AdamW groups as nanochat applies it."""
    if train.optimizer == "nanochat":
        return NanochatOptimizer(*build_nanochat_optimizers(
            model, weight_decay=train.weight_decay, unembedding_lr=train.unembedding_lr,
            embedding_lr=train.embedding_lr, matrix_lr=train.matrix_lr, slow_lr_scale=slow_scale))
    groups = model.param_groups(train.weight_decay, slow_scale)
    for group in groups:
        group["lr"] = train.lr * group["lr_scale"]
    if train.optimizer == "sgd":  # coupled weight decay, as torch's SGD (and eval_linear.py) apply it
        return torch.optim.SGD(groups, lr=train.lr, momentum=train.beta1, weight_decay=train.weight_decay)
    betas = (train.beta1, train.beta2)
    if train.optimizer == "lamb":  # DeiT III's FusedLAMB: each group's decay also decides its trust ratio
        return Lamb(groups, lr=train.lr, betas=betas, eps=train.eps, weight_decay=train.weight_decay)
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
