"""`optimizer: lamb` (study.optim.Lamb) against the optimiser DeiT III trains with: `--opt fusedlamb` builds apex's
FusedLAMB through timm's create_optimizer. The reference here is written out in float64 from the sources:

- the parameter groups: timm's add_weight_decay (timm v0.3.3 and v0.4.12 optim/optim_factory.py:25-37; DeiT's
  requirements.txt pins timm 0.3.2) with the model's no_weight_decay() (facebookresearch/deit at 7e160fe,
  models_v2.py:229-231: pos_embed and cls_token);
- the step: NVIDIA/apex at 6424da3, apex/optimizers/fused_lamb.py (the global gradient norm, the defaults) and
  csrc/multi_tensor_lamb.cu (the update and the trust ratio), as DeiT III's command sets it (README_revenge.md:412
  --lr 3e-3 --weight-decay 0.05; main.py:58 --opt-eps 1e-8, :60 --opt-betas None, so FusedLAMB's betas).
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from models import build_model
from study.optim import Lamb, build_optimizer
from study.runspec import TrainConfig

LR, WEIGHT_DECAY, EPS = 3e-3, 0.05, 1e-8  # README_revenge.md:412, main.py:58
BETAS = (0.9, 0.999)  # fused_lamb.py:68
MAX_GRAD_NORM = 1.0  # fused_lamb.py:75; DeiT never sets it
# The global gradient norm of each step: above max_grad_norm (clipped) and below it (left alone).
GLOBAL_NORMS = (3.0, 0.4, 12.0, 0.9, 2.0, 0.05)


def timm_groups(named_shapes: dict[str, tuple], weight_decay: float, skip=("pos_embed", "cls_token")):
    """optim_factory.py:25-37 add_weight_decay(model, weight_decay, skip_list=model.no_weight_decay()), as names."""
    decay, no_decay = [], []
    for name, shape in named_shapes.items():
        if len(shape) == 1 or name.endswith(".bias") or name in skip:
            no_decay.append(name)
        else:
            decay.append(name)
    return [(no_decay, 0.0), (decay, weight_decay)]


def apex_fused_lamb(params: dict[str, np.ndarray], steps: list[dict[str, np.ndarray]], groups, lr=LR) -> dict:
    """FusedLAMB.step once per entry of `steps` (each the gradient of every parameter), on float64 copies."""
    params = {name: value.copy() for name, value in params.items()}
    m = {name: np.zeros_like(value) for name, value in params.items()}
    v = {name: np.zeros_like(value) for name, value in params.items()}
    beta1, beta2 = BETAS
    for step, grads in enumerate(steps, start=1):  # fused_lamb.py:169-172: group["step"] counts from 1
        # fused_lamb.py:126-160: one L2 norm of every group's gradients; .cu:53-54 divides by norm / max above it
        global_norm = np.sqrt(sum(np.sum(g * g) for g in grads.values()))
        clipped = global_norm / MAX_GRAD_NORM if global_norm > MAX_GRAD_NORM else 1.0
        beta3 = 1 - beta1  # grad_averaging=True (.cu:288-289)
        correction1, correction2 = 1 - beta1 ** step, 1 - beta2 ** step  # bias_correction=True (.cu:281-285)
        for names, decay in groups:
            for name in names:
                p = params[name]
                param_norm = np.sqrt(np.sum(p * p))  # .cu:295, of the weights before the step
                scaled = grads[name] / clipped
                m[name] = m[name] * beta1 + beta3 * scaled
                v[name] = v[name] * beta2 + (1 - beta2) * scaled * scaled
                denominator = np.sqrt(v[name] / correction2) + EPS
                # adam_w_mode=True: MOMENT_MODE_1 (.cu:111-117); the kernel reads p only where decay != 0 (.cu:90-94)
                update = (m[name] / correction1) / denominator + (decay * p if decay != 0 else 0.0)
                ratio = lr  # LAMBStage2Functor (.cu:210-217): use_nvlamb=False, so only where decay != 0
                if decay != 0:
                    update_norm = np.sqrt(np.sum(update * update))
                    if update_norm != 0 and param_norm != 0:
                        ratio = lr * (param_norm / update_norm)
                params[name] = p - ratio * update
    return params


def _gradients(shapes: dict[str, tuple], seed: int) -> list[dict[str, np.ndarray]]:
    """One gradient per parameter per step, of very different sizes per parameter (so the trust ratios differ),
    scaled to the step's global norm."""
    rng = np.random.default_rng(seed)
    steps = []
    for norm in GLOBAL_NORMS:
        grads = {name: rng.standard_normal(shape) * 10.0 ** rng.uniform(-3, 1) for name, shape in shapes.items()}
        total = np.sqrt(sum(np.sum(g * g) for g in grads.values()))
        steps.append({name: g * (norm / total) for name, g in grads.items()})
    return steps


def _vit():
    torch.manual_seed(0)  # ViT-B/4's shapes (the CIFAR grid's model), one block: every kind of parameter it has
    return build_model({"preset": "vit_b4_32", "depth": 1, "num_classes": 100}).double()


def _train(model, optimizer, steps) -> None:
    for grads in steps:
        for name, p in model.named_parameters():
            p.grad = torch.from_numpy(grads[name].copy())
        optimizer.step()


@pytest.fixture(scope="module")
def trained():
    model = _vit()
    start = {name: p.detach().numpy().copy() for name, p in model.named_parameters()}
    shapes = {name: value.shape for name, value in start.items()}
    steps = _gradients(shapes, seed=1)
    optimizer = build_optimizer(model, TrainConfig(optimizer="lamb", lr=LR, weight_decay=WEIGHT_DECAY), 1.0)
    _train(model, optimizer, steps)
    expected = apex_fused_lamb(start, steps, timm_groups(shapes, WEIGHT_DECAY))
    return model, optimizer, start, expected


@pytest.mark.parametrize("name", ["blocks.0.mixer.qkv.weight", "blocks.0.ls1.gamma", "blocks.0.ls2.gamma",
                                  "pos_embed", "cls_token", "blocks.0.mixer.qkv.bias", "blocks.0.mlp.fc2.bias",
                                  "blocks.0.norm1.weight", "patch_embed.weight", "head.weight", "head.bias"])
def test_six_steps_equal_apex_fused_lamb(trained, name):
    model, _, start, expected = trained
    got = dict(model.named_parameters())[name].detach().numpy()
    assert not np.array_equal(got, start[name])
    np.testing.assert_allclose(got, expected[name], rtol=1e-12, atol=1e-15)


def test_every_parameter_equals_apex_and_the_groups_are_timms(trained):
    model, optimizer, _, expected = trained
    for name, p in model.named_parameters():
        np.testing.assert_allclose(p.detach().numpy(), expected[name], rtol=1e-12, atol=1e-15, err_msg=name)
    assert isinstance(optimizer, Lamb) and optimizer.max_grad_norm == MAX_GRAD_NORM
    names = {id(p): name for name, p in model.named_parameters()}
    decayed = {names[id(p)] for g in optimizer.param_groups if g["weight_decay"] for p in g["params"]}
    shapes = {name: tuple(p.shape) for name, p in model.named_parameters()}
    (_, _), (timm_decayed, _) = timm_groups(shapes, WEIGHT_DECAY)
    assert decayed == set(timm_decayed)
    assert {g["weight_decay"] for g in optimizer.param_groups} == {0.0, WEIGHT_DECAY}
    assert all(g["betas"] == BETAS and g["eps"] == EPS and g["step"] == len(GLOBAL_NORMS)
               for g in optimizer.param_groups)


def test_a_resumed_optimizer_continues_as_if_never_stopped():
    # The loop checkpoints the optimiser's state_dict: moments and each group's step count (bias correction).
    torch.manual_seed(0)
    model = build_model({"preset": "vit_tiny"}).double()
    shapes = {name: tuple(p.shape) for name, p in model.named_parameters()}
    steps = _gradients(shapes, seed=2)[:4]
    resumed = copy.deepcopy(model)
    train = TrainConfig(optimizer="lamb", lr=LR, weight_decay=WEIGHT_DECAY)
    straight = build_optimizer(model, train, 1.0)
    _train(model, straight, steps)
    first = build_optimizer(resumed, train, 1.0)
    _train(resumed, first, steps[:2])
    second = build_optimizer(resumed, train, 1.0)
    second.load_state_dict(copy.deepcopy(first.state_dict()))
    _train(resumed, second, steps[2:])
    for (name, p), q in zip(model.named_parameters(), resumed.parameters()):
        assert torch.equal(p, q), name


def test_parameters_without_a_gradient_are_left_alone_and_out_of_the_global_norm():
    # fused_lamb.py:129 and :179: a parameter whose grad is None is neither clipped with the others nor stepped
    # (DINO drops its head's last-layer gradients in the first epoch, models/dino.py cancel_last_layer_gradients).
    a = torch.nn.Parameter(torch.ones(3, 2, dtype=torch.float64))
    b = torch.nn.Parameter(torch.ones(4, dtype=torch.float64))
    optimizer = Lamb([{"params": [a], "weight_decay": 0.1}, {"params": [b], "weight_decay": 0.0}], lr=0.1, eps=EPS)
    a.grad = torch.full_like(a, 0.5)  # global norm sqrt(6) / 2 > 1: clipped to 1
    optimizer.step()
    assert torch.equal(b, torch.ones(4, dtype=torch.float64))
    expected = apex_fused_lamb({"a": np.ones((3, 2))}, [{"a": np.full((3, 2), 0.5)}], [(["a"], 0.1)],
                               lr=0.1)
    np.testing.assert_allclose(a.detach().numpy(), expected["a"], rtol=1e-12)
