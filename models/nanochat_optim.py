"""nanochat's optimiser split and schedules, torch only.

From karpathy/nanochat at commit e1770a3 (the d20 of docs/nanochat.md): ``GPT.setup_optimizers`` in nanochat/gpt.py,
``Muon`` in nanochat/muon.py, ``get_lr_multiplier`` and ``get_muon_momentum`` in scripts/base_train.py.

- Muon (lr 0.02, momentum 0.95, Nesterov, 5 Newton-Schulz steps) for the 2-D matrices of the blocks.
- AdamW (betas (0.8, 0.95), eps 1e-10, weight decay 0 by default) for the head at 0.004 and the token embedding at
  0.2, both times (dim / 768) ** -0.5 (nanochat tuned them at width 768).
- Every step: every group's lr = its initial lr * ``nanochat_lr_multiplier`` (no warm-up, flat, then a linear
  warm-down to 0 over the last 20% of steps) and Muon's momentum = ``nanochat_muon_momentum`` (0.85 -> 0.95 over
  the first 300 steps). nanochat's base_train clips the global gradient norm at 1.0 (its ``grad_clip``) before
  stepping.

Muon is ``torch.optim.Muon`` with ``weight_decay=0`` and ``adjust_lr_fn="original"``; per step it computes what
nanochat's ``Muon.step`` does: buf <- lerp(buf, g, 1 - momentum); update <- lerp(g, buf, momentum) (Nesterov);
orthogonalise in bfloat16 with the quintic (3.4445, -4.7750, 2.0315) iteration, transposed when rows > cols;
p <- p - lr * sqrt(max(1, rows / cols)) * update. Differences, none of which changes the update beyond bfloat16
rounding: torch scales G by 1 / max(||G||_F, 1e-7) where nanochat uses 1 / (||G||_F + 1e-7); torch skips a
parameter without a gradient where nanochat asserts; nanochat compiles the iteration and, under DDP, shards it
over ranks (DistMuon), the same arithmetic. nanochat also keeps the embedding in bfloat16 on CUDA; here it stays in
the model's dtype.
"""

from __future__ import annotations

import torch
from torch import nn

NANOCHAT_ADAMW = dict(betas=(0.8, 0.95), eps=1e-10)
NANOCHAT_MUON = dict(momentum=0.95, nesterov=True, ns_steps=5)


def nanochat_lr_scale(dim: int) -> float:
    """nanochat's factor on the AdamW learning rates: (dim / 768) ** -0.5."""
    return (dim / 768) ** -0.5


def nanochat_param_groups(model: nn.Module, *, unembedding_lr: float = 0.004, embedding_lr: float = 0.2,
                          matrix_lr: float = 0.02, other_lr: float | None = None,
                          slow_lr_scale: float = 1.0) -> tuple[list[dict], list[dict]]:
    """(AdamW groups, Muon groups) of a GPT, each parameter in exactly one group, each group named.

    AdamW: ``lm_head`` at ``unembedding_lr`` and ``embedding`` at ``embedding_lr``, both times
    ``nanochat_lr_scale(dim)``. Muon: ``matrices``, the real 2-D parameters of the blocks, at ``matrix_lr``.
    Parameters nanochat's GPT does not have (LayerNorm weights of the gpt2 style, STLT's non-matrix parameters)
    go to the AdamW group ``other`` at ``other_lr`` (default: the head's learning rate), the mixers' slow parameters
    (STLT sigma, omega) to ``slow`` at ``slow_lr_scale`` times that. Empty groups are left out.
    """
    scale = nanochat_lr_scale(model.config.dim)
    other_lr = unembedding_lr * scale if other_lr is None else other_lr
    slow = {id(p) for mixer in model._mixers_with("slow_parameters") for p in mixer.slow_parameters()}
    head = [model.lm_head.weight] if model.lm_head.weight is not model.wte.weight else []
    embedding = [model.wte.weight]
    taken = {id(p) for p in head + embedding}
    matrices, others, slow_params = [], [], []
    for p in model.blocks.parameters():
        if id(p) in slow:
            slow_params.append(p)
        elif p.ndim == 2 and not p.is_complex():
            matrices.append(p)
        else:
            others.append(p)
    taken |= {id(p) for p in matrices + others + slow_params}
    others += [p for p in model.parameters() if id(p) not in taken]
    adamw = [
        dict(name="lm_head", params=head, lr=unembedding_lr * scale),
        dict(name="embedding", params=embedding, lr=embedding_lr * scale),
        dict(name="other", params=others, lr=other_lr),
        dict(name="slow", params=slow_params, lr=other_lr * slow_lr_scale),
    ]
    muon = [dict(name="matrices", params=matrices, lr=matrix_lr)]
    adamw, muon = [g for g in adamw if g["params"]], [g for g in muon if g["params"]]
    grouped = [id(p) for g in adamw + muon for p in g["params"]]
    assert len(grouped) == len(set(grouped)) == len(list(model.parameters())), "parameter groups must cover each once"
    return adamw, muon


def build_nanochat_optimizers(model: nn.Module, *, weight_decay: float = 0.0,
                              **lrs) -> tuple[torch.optim.AdamW, torch.optim.Muon]:
    """nanochat's two optimisers over ``nanochat_param_groups(model, **lrs)``: AdamW with its betas and eps and
    ``weight_decay`` (base_train's default 0.0), Muon without weight decay. Every group records ``initial_lr``;
    call ``set_nanochat_schedule`` before each step. Step both (nanochat steps AdamW first, then Muon)."""
    adamw_groups, muon_groups = nanochat_param_groups(model, **lrs)
    adamw = torch.optim.AdamW(adamw_groups, weight_decay=weight_decay, **NANOCHAT_ADAMW)
    muon = torch.optim.Muon(muon_groups, weight_decay=0.0, adjust_lr_fn="original", **NANOCHAT_MUON)
    for optimizer in (adamw, muon):
        for group in optimizer.param_groups:
            group["initial_lr"] = group["lr"]
    return adamw, muon


def nanochat_lr_multiplier(step: int, total_steps: int, warmup_ratio: float = 0.0, warmdown_ratio: float = 0.2,
                           final_lr_frac: float = 0.0) -> float:
    """Learning-rate factor at optimiser step ``step`` (0-based) of ``total_steps``: base_train's
    ``get_lr_multiplier``. Linear warm-up over round(warmup_ratio * total) steps, 1 until the last
    round(warmdown_ratio * total) steps, then linear down to ``final_lr_frac`` at step ``total_steps``."""
    if not 0 <= step <= total_steps:
        raise ValueError(f"step must be in 0..{total_steps}, got {step}")
    warmup = round(warmup_ratio * total_steps)
    warmdown = round(warmdown_ratio * total_steps)
    if step < warmup:
        return (step + 1) / warmup
    if step <= total_steps - warmdown:
        return 1.0
    progress = (total_steps - step) / warmdown
    return progress * 1.0 + (1 - progress) * final_lr_frac


def nanochat_muon_momentum(step: int, warmup: int = 300) -> float:
    """Muon's momentum at optimiser step ``step``: base_train's (and mid_train's) ``get_muon_momentum``,
    0.85 -> 0.95 linearly over the first ``warmup`` (300) steps, then 0.95. ``warmup=0``: 0.95 throughout
    (chat_sft.py keeps Muon's momentum at 0.95)."""
    frac = min(step / warmup, 1) if warmup > 0 else 1
    return (1 - frac) * 0.85 + frac * 0.95


def set_nanochat_schedule(optimizers, step: int, total_steps: int, momentum_warmup: int = 300, **schedule) -> float:
    """What base_train does before each step: every group's lr = initial_lr * the multiplier, and every Muon group's
    momentum per ``nanochat_muon_momentum(step, momentum_warmup)``. ``schedule``: ``nanochat_lr_multiplier``'s
    ratios. Returns the multiplier."""
    multiplier = nanochat_lr_multiplier(step, total_steps, **schedule)
    for optimizer in optimizers:
        for group in optimizer.param_groups:
            group["lr"] = group["initial_lr"] * multiplier
            if isinstance(optimizer, torch.optim.Muon):
                group["momentum"] = nanochat_muon_momentum(step, momentum_warmup)
    return multiplier
