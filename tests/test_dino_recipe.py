"""search_spaces/dino_vits_imagenet.yaml against the reference it claims: facebookresearch/dino's ViT-S/16 100-epoch
run (README: `main_dino.py --arch vit_small`, everything else at main_dino.py's argparse defaults), its linear
evaluation (eval_linear.py) and the ViT it trains (vision_transformer.py; written out in tests/reference_vits.py). The
reference values are written out here with the lines they come from, so a change to the space that departs from
them fails."""

from pathlib import Path

import numpy as np
import pytest
import torch

from models import build_model, count_parameters
from reference_vits import dino_forward, dino_head_forward, dino_parameter_shapes, project_to_reference
from study.runspec import resolve
from study.space import load_space
from study.tasks.dino import DINO, clip_each_gradient_

SPACE = load_space(Path(__file__).resolve().parents[1] / "search_spaces" / "dino_vits_imagenet.yaml")
GPUS = 8  # the README's single-node command: --nproc_per_node=8

MAIN_DINO = {  # main_dino.py get_args_parser()
    "patch_size": 16,  # :50
    "out_dim": 65536,  # :55
    "norm_last_layer": True,  # :57
    "momentum_teacher": 0.996,  # :61
    "use_bn_in_head": False,  # :64
    "warmup_teacher_temp": 0.04,  # :68
    "teacher_temp": 0.04,  # :71
    "warmup_teacher_temp_epochs": 0,  # :74
    "weight_decay": 0.04,  # :82
    "weight_decay_end": 0.4,  # :84
    "clip_grad": 3.0,  # :87
    "batch_size_per_gpu": 64,  # :90
    "epochs": 100,  # :92
    "freeze_last_layer": 1,  # :93
    "lr": 0.0005,  # :96, per 256 images (linear scaling at :239)
    "warmup_epochs": 10,  # :99
    "min_lr": 1e-6,  # :101
    "optimizer": "adamw",  # :103
    "drop_path_rate": 0.1,  # :105
    "global_crops_scale": (0.4, 1.0),  # :108
    "local_crops_number": 8,  # :112
    "local_crops_scale": (0.05, 0.4),  # :115
}
EVAL_LINEAR = {"n_last_blocks": 4, "avgpool_patchtokens": False, "epochs": 100, "lr": 0.001,  # :256-266
               "batch_size_per_gpu": 128, "momentum": 0.9, "weight_decay": 0.0}  # :270, :103-108
EVAL_KNN = {"nb_knn": 20, "temperature": 0.07}  # eval_knn.py: --nb_knn [10, 20, 100, 200], --temperature 0.07


def test_pretraining_is_main_dinos_vit_small_run():
    fixed, data = SPACE.fixed, SPACE.dataset
    batch = MAIN_DINO["batch_size_per_gpu"] * GPUS
    assert fixed["batch_size"] == batch and SPACE.epochs == MAIN_DINO["epochs"]
    assert fixed["lr"] == pytest.approx(MAIN_DINO["lr"] * batch / 256)
    assert fixed["min_lr_ratio"] == pytest.approx(MAIN_DINO["min_lr"] / fixed["lr"])
    assert fixed["warmup_epochs"] == MAIN_DINO["warmup_epochs"] and fixed["optimizer"] == MAIN_DINO["optimizer"]
    assert fixed["weight_decay"] == MAIN_DINO["weight_decay"]
    assert fixed["dino_weight_decay_end"] == MAIN_DINO["weight_decay_end"]
    assert fixed["grad_clip"] == MAIN_DINO["clip_grad"] and fixed["drop_path"] == MAIN_DINO["drop_path_rate"]
    for key in ("out_dim", "norm_last_layer", "momentum_teacher", "use_bn_in_head", "warmup_teacher_temp",
                "teacher_temp", "warmup_teacher_temp_epochs", "freeze_last_layer"):
        assert fixed[f"dino_{key}"] == MAIN_DINO[key], key
    assert (fixed["dino_knn_k"], fixed["dino_knn_temperature"]) == (EVAL_KNN["nb_knn"], EVAL_KNN["temperature"])
    assert data.augment == "dino_multicrop" and data.image_size == 224 and data.local_size == 96
    assert data.local_crops == MAIN_DINO["local_crops_number"]
    assert tuple(data.global_crop_scale) == MAIN_DINO["global_crops_scale"]
    assert tuple(data.local_crop_scale) == MAIN_DINO["local_crops_scale"]


def test_the_backbone_is_dinos_vit_small():
    """vision_transformer.py vit_small: patch 16, dim 384, depth 12, 6 heads, mlp 4, qkv_bias, LayerNorm eps 1e-6,
    no LayerScale, a position embedding for the class token as for every patch, stochastic depth rising linearly
    from 0 to drop_path_rate (dpr = linspace); 21.7M parameters without a classifier head (DINO's table: 21M)."""
    config = {**{k: v for k, v in SPACE.fixed.items() if not k.startswith("dino_")}, "k": 0}
    vit = build_model({key: config[key] for key in ("preset", "layer_scale_init", "drop_path", "drop_path_by_depth",
                                                    "class_pos_embed", "k")}, device="meta")
    c = vit.config
    assert (c.patch_size, c.dim, c.depth, c.num_heads, c.mlp_ratio, c.qkv_bias) == (16, 384, 12, 6, 4.0, True)
    assert all(m.eps == 1e-6 for m in vit.modules() if isinstance(m, torch.nn.LayerNorm))
    assert c.layer_scale_init == 0.0
    assert [b.drop_path1.p for b in vit.blocks] == pytest.approx([0.1 * i / 11 for i in range(12)])
    d, tokens = 384, 1 + (224 // 16) ** 2
    block = 2 * 2 * d + (3 * d * d + 3 * d) + (d * d + d) + (4 * d * d + 4 * d) + (4 * d * d + d)
    backbone = (3 * 16 * 16 * d + d) + d + tokens * d + 12 * block + 2 * d
    head = sum(p.numel() for p in vit.head.parameters())
    assert count_parameters(vit) - head == backbone == 21_665_664


def test_the_probes_are_eval_linear_and_dinov2s_linear_decoder():
    linear, segmentation = SPACE.stages
    hp = linear.hyperparameters
    batch = EVAL_LINEAR["batch_size_per_gpu"] * GPUS
    assert linear.task == "linear_probe" and linear.epochs == EVAL_LINEAR["epochs"] and hp["batch_size"] == batch
    assert hp["optimizer"] == "sgd" and hp["lr"] == pytest.approx(EVAL_LINEAR["lr"] * batch / 256)
    assert hp["weight_decay"] == EVAL_LINEAR["weight_decay"] and hp["min_lr_ratio"] == 0.0  # cosine to eta_min 0
    assert hp.get("beta1", 0.9) == EVAL_LINEAR["momentum"] and hp["warmup_epochs"] == 0
    assert (hp["probe_blocks"], hp["probe_avgpool"]) == (EVAL_LINEAR["n_last_blocks"],
                                                         EVAL_LINEAR["avgpool_patchtokens"])
    assert linear.dataset.augment == "basic"  # RandomResizedCrop(224) + horizontal flip
    # DINOv2 configs/eval/vits14_ade20k_linear_config (mmseg): AdamW 1e-3, wd 1e-4, 40k iterations of batch 16
    seg = segmentation.hyperparameters
    assert segmentation.task == "segmentation_probe" and segmentation.dataset.source == "ade20k"
    assert (seg["optimizer"], seg["lr"], seg["weight_decay"], seg["batch_size"]) == ("adamw", 1e-3, 1e-4, 16)
    assert segmentation.epochs == round(40_000 * 16 / 20_210)
    assert (seg["seg_blocks"], seg["seg_cls_token"], seg["seg_batch_norm"]) == (1, True, True)


def test_the_grid_keeps_fewer_laplacian_heads_than_vit_small_has():
    grid = SPACE.parameters["k"].choices
    assert SPACE.metric == "linear/val_acc" and {0, 5} <= set(grid) and max(grid) < 6  # the paper's 0 and 5 of 6


# ----------------------------------------------------------------------------------------------------------------
# The student DINO trains, by weight transfer, and DINO's gradient clipping on its tensors


def _student(depth=2, out_dim=300):
    """The space's student (ViT-S/16 backbone and DINO head), `depth` blocks, in float64 with every parameter moved
    off its initial value (zero biases, unit norms and g = 1 would hide a misplaced one)."""
    keys = ("preset", "layer_scale_init", "drop_path", "drop_path_by_depth", "class_pos_embed")
    config = {**{key: SPACE.fixed[key] for key in keys}, "depth": depth, "k": 0}
    torch.manual_seed(0)
    model = DINO.build_model(resolve({**config, "dino_out_dim": out_dim}, "dino", {}, epochs=1), None).double()
    with torch.no_grad():
        for p in model.student.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return model.student.eval()


def test_the_student_is_dinos_vit_small_and_head_by_weight_transfer():
    student = _student()
    weights = project_to_reference(student.named_parameters())
    assert {name: tuple(p.shape) for name, p in weights.items()} == dino_parameter_shapes(
        384, 2, 16, 3, (224 // 16) ** 2, 300)
    backbone = {name.removeprefix("backbone."): p for name, p in weights.items() if name.startswith("backbone.")}
    head = {name.removeprefix("head."): p for name, p in weights.items() if name.startswith("head.")}
    torch.manual_seed(1)
    crops = [torch.randn(2, 3, 224, 224, dtype=torch.float64) for _ in range(2)] + \
        [torch.randn(2, 3, 96, 96, dtype=torch.float64) for _ in range(2)]  # main_dino.py: 224 global, 96 local
    with torch.no_grad():
        expected = torch.cat([dino_head_forward(head, dino_forward(backbone, c, heads=6, patch=16)) for c in crops])
        torch.testing.assert_close(student(crops), expected, rtol=1e-10, atol=1e-12)


def dino_clip_gradients(grads: dict[str, np.ndarray], clip: float) -> dict[str, np.ndarray]:
    """utils.py:132-141: every parameter with a gradient, its norm n, multiplied by clip / (n + 1e-6) where < 1."""
    clipped = {}
    for name, grad in grads.items():
        coefficient = clip / (np.linalg.norm(grad) + 1e-6)
        clipped[name] = grad * coefficient if coefficient < 1 else grad
    return clipped


def test_gradient_clipping_is_dinos_clip_gradients_on_dinos_tensors():
    # main_dino.py:331-332 clips the student's gradients with utils.clip_gradients(student, --clip_grad 3.0): each
    # parameter of DINO's student on its own, pos_embed (the class token's row and the patches') one of them.
    student, clip = _student(depth=1), MAIN_DINO["clip_grad"]
    rng = np.random.default_rng(2)
    for name, p in student.named_parameters():
        if p.requires_grad:  # the head's g is frozen (norm_last_layer): no gradient, as in DINO
            grad = rng.standard_normal(tuple(p.shape))
            p.grad = torch.from_numpy(grad * rng.uniform(0.3, 3.0) * clip / np.linalg.norm(grad))
    with torch.no_grad():  # the class token's row and the patches' rows of norm 0.75 clip each: under the clip
        grad = student.backbone.pos_embed.grad[0]  # apart, over it together (1.06 clip)
        grad[:1].mul_(0.75 * clip / grad[:1].norm())
        grad[1:].mul_(0.75 * clip / grad[1:].norm())
    grads = {name: p.grad.numpy().copy() for name, p in project_to_reference(student.named_parameters()).items()
             if p.grad is not None}
    shapes = dino_parameter_shapes(384, 1, 16, 3, (224 // 16) ** 2, 300)
    assert {name: g.shape for name, g in grads.items()} == {n: s for n, s in shapes.items() if "weight_g" not in n}
    expected = dino_clip_gradients(grads, clip)
    assert np.linalg.norm(expected["backbone.pos_embed"]) == pytest.approx(clip, rel=1e-6)
    clip_each_gradient_(student, clip)
    for name, p in project_to_reference(student.named_parameters()).items():
        if p.grad is not None:
            np.testing.assert_allclose(p.grad.numpy(), expected[name], rtol=1e-12, atol=0, err_msg=name)


# ----------------------------------------------------------------------------------------------------------------
# Training steps: the DINO task's against main_dino.py's train_one_epoch, written out on DINO's tensors


def dino_cosine_scheduler(base, final, epochs, niter_per_ep, warmup_epochs=0, start_warmup_value=0.0):
    """utils.py:187-198 cosine_scheduler."""
    warmup = np.linspace(start_warmup_value, base, warmup_epochs * niter_per_ep) if warmup_epochs > 0 else np.array([])
    iters = np.arange(epochs * niter_per_ep - warmup_epochs * niter_per_ep)
    return np.concatenate((warmup, final + 0.5 * (base - final) * (1 + np.cos(np.pi * iters / len(iters)))))


def dino_loss(student_output, teacher_output, center, temp, ncrops, student_temp=0.1, center_momentum=0.9):
    """main_dino.py:380-416 DINOLoss.forward on one process: the loss and the new centre."""
    student_out = (student_output / student_temp).chunk(ncrops)
    teacher_out = torch.softmax((teacher_output - center) / temp, dim=-1).detach().chunk(2)
    total, terms = 0, 0
    for iq, q in enumerate(teacher_out):
        for v in range(len(student_out)):
            if v != iq:
                total += torch.sum(-q * torch.log_softmax(student_out[v], dim=-1), dim=-1).mean()
                terms += 1
    batch_center = torch.sum(teacher_output, dim=0, keepdim=True) / len(teacher_output)
    return total / terms, center * center_momentum + batch_center.detach() * (1 - center_momentum)


# A small ViT of DINO's kind (one pos_embed over the class token and the patches, no LayerScale), 32-pixel global and
# 16-pixel local crops (so the position embeddings are resized), 2 epochs of 3 steps: the lr warms up over the first,
# the head's last layer stays fixed in it (freeze_last_layer 1), the teacher temperature warms up.
SMALL = {"preset": "vit_s16", "image_size": 32, "patch_size": 8, "dim": 48, "depth": 2, "num_heads": 3,
         "layer_scale_init": 0.0, "class_pos_embed": True, "drop_path": 0.0, "k": 0, "num_classes": 10}
SMALL_OPTIONS = {"dino_out_dim": 64, "dino_momentum_teacher": 0.9, "dino_freeze_last_layer": 1,
                 "dino_warmup_teacher_temp": 0.04, "dino_teacher_temp": 0.07, "dino_warmup_teacher_temp_epochs": 1,
                 "dino_weight_decay_end": 0.4}
SMALL_TRAIN = {"lr": 5e-3, "min_lr_ratio": 0.1, "warmup_epochs": 1, "weight_decay": 0.04, "grad_clip": 0.05}
STEPS_PER_EPOCH, EPOCHS = 3, 2


def _small_dino():
    torch.manual_seed(0)
    model = DINO.build_model(resolve({**SMALL, **SMALL_OPTIONS}, "dino", {}, epochs=EPOCHS), None).double()
    g = torch.Generator().manual_seed(1)
    batches = [[torch.randn(4, 3, size, size, generator=g, dtype=torch.float64) for size in (32, 32, 16, 16)]
               for _ in range(STEPS_PER_EPOCH * EPOCHS)]
    return model, batches


def _project_steps(model, batches, state=None):
    """The DINO task's train_step on each batch, as the loop calls it (a fresh task, as in a resumed run)."""
    from contextlib import nullcontext

    from study.optim import build_optimizer, build_schedule
    from study.runspec import TrainConfig
    from study.state import TrainState
    from study.tasks import GeometrySpec, StepSettings
    from study.worker import Worker

    train = TrainConfig(**SMALL_TRAIN)
    if state is None:
        optimizer = build_optimizer(model, train, 1.0)
        state = TrainState(model, model, optimizer, build_schedule(optimizer, train, STEPS_PER_EPOCH, EPOCHS))
    task = DINO(model, Worker(0, 1, torch.device("cpu")), seed=0, geometry=GeometrySpec(),
                resolved=resolve({**SMALL, **SMALL_OPTIONS, **SMALL_TRAIN}, "dino", {}, epochs=EPOCHS))
    for crops in batches:
        task.train_step(state, {"crops": crops, "label": torch.arange(4)},
                        StepSettings(nullcontext(), train.grad_clip, STEPS_PER_EPOCH, EPOCHS))
    return state


def test_six_training_steps_are_main_dinos_train_one_epoch():
    from study.runspec import TrainConfig

    options, train = SMALL_OPTIONS, TrainConfig(**SMALL_TRAIN)
    steps_per_epoch, epochs, ncrops = STEPS_PER_EPOCH, EPOCHS, 4
    model, batches = _small_dino()
    student = project_to_reference(model.student.named_parameters())
    S = {name: p.detach().clone().requires_grad_(p.requires_grad) for name, p in student.items()}
    T = {name: p.detach().clone() for name, p in project_to_reference(model.teacher.named_parameters()).items()}
    assert all(torch.equal(S[name], T[name]) for name in S)  # main_dino.py:208

    # The reference: main_dino.py:225-251 (groups, AdamW, schedules), train_one_epoch (:306-350).
    regularized = [n for n, p in S.items() if p.requires_grad and not (n.endswith(".bias") or p.ndim == 1)]
    plain = [n for n, p in S.items() if p.requires_grad and (n.endswith(".bias") or p.ndim == 1)]
    optimizer = torch.optim.AdamW([{"params": [S[n] for n in regularized]},  # utils.py:632-643
                                   {"params": [S[n] for n in plain], "weight_decay": 0.0}])
    lr_schedule = dino_cosine_scheduler(train.lr, train.lr * train.min_lr_ratio, epochs, steps_per_epoch,
                                        warmup_epochs=int(train.warmup_epochs))  # an int in DINO
    wd_schedule = dino_cosine_scheduler(train.weight_decay, options["dino_weight_decay_end"], epochs, steps_per_epoch)
    momentum_schedule = dino_cosine_scheduler(options["dino_momentum_teacher"], 1, epochs, steps_per_epoch)
    temps = np.concatenate((np.linspace(0.04, 0.07, 1), np.ones(epochs - 1) * 0.07))  # main_dino.py:374-378
    center = torch.zeros(1, options["dino_out_dim"], dtype=torch.float64)

    def forward(weights, crops):  # utils.py:609-629 MultiCropWrapper: backbone, then the head
        backbone = {n.removeprefix("backbone."): p for n, p in weights.items() if n.startswith("backbone.")}
        head = {n.removeprefix("head."): p for n, p in weights.items() if n.startswith("head.")}
        return dino_head_forward(head, torch.cat([dino_forward(backbone, c, heads=3, patch=8) for c in crops]))

    for it, crops in enumerate(batches):
        epoch = it // steps_per_epoch
        for i, group in enumerate(optimizer.param_groups):
            group["lr"] = lr_schedule[it]
            if i == 0:
                group["weight_decay"] = wd_schedule[it]
        with torch.no_grad():
            teacher_output = forward(T, crops[:2])
        loss, center = dino_loss(forward(S, crops), teacher_output, center, temps[epoch], ncrops)
        optimizer.zero_grad()
        loss.backward()
        grads = dino_clip_gradients({n: p.grad.numpy() for n, p in S.items() if p.grad is not None}, train.grad_clip)
        for n, grad in grads.items():
            S[n].grad = torch.from_numpy(grad)
        if epoch < options["dino_freeze_last_layer"]:  # utils.py:144-149
            for n in S:
                if "last_layer" in n:
                    S[n].grad = None
        optimizer.step()
        with torch.no_grad():
            for n in T:
                T[n] = T[n] * momentum_schedule[it] + (1 - momentum_schedule[it]) * S[n].detach()

    _project_steps(model, batches)
    for ours, theirs in ((model.student, S), (model.teacher, T)):
        for name, p in project_to_reference(ours.named_parameters()).items():
            torch.testing.assert_close(p.detach(), theirs[name].detach(), rtol=1e-9, atol=1e-12, msg=name)
    torch.testing.assert_close(model.loss.center, center, rtol=1e-9, atol=1e-12)
    moved = [name for name in S if not torch.equal(S[name], student[name].detach())]
    assert "head.last_layer.weight_v" in moved and "backbone.pos_embed" in moved


def test_a_resumed_run_trains_on_as_if_never_stopped():
    # The loop restores the model and the optimiser (whose groups hold the last scheduled weight decay) into a fresh
    # task: DINO's schedules must start from the run's keys and the step count, not from those groups.
    import copy

    model, batches = _small_dino()
    resumed = copy.deepcopy(model)
    _project_steps(model, batches)
    state = _project_steps(resumed, batches[:4])
    saved = copy.deepcopy({"model": resumed.state_dict(), "optimizer": state.optimizer.state_dict()})
    fresh, _ = _small_dino()
    state_after = _project_steps(fresh, [])
    fresh.load_state_dict(saved["model"])
    state_after.optimizer.load_state_dict(saved["optimizer"])
    state_after.step = 4
    _project_steps(fresh, batches[4:], state_after)
    for (name, p), q in zip(model.state_dict().items(), fresh.state_dict().values()):
        assert torch.equal(p, q), name
