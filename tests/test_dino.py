"""DINO's parts (models/dino.py) and the ViT's resized position embeddings against their definitions: the
reference's formulas written out in float64 loops, identities, and cases with a known answer."""

from __future__ import annotations

import copy
import math

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from models.dino import DINOHead, DINOLoss, MultiCropForward, cancel_last_layer_gradients, cosine_schedule, ema_update_
from models.vit import ViT, ViTConfig

# ---------------------------------------------------------------------------------------------------------------
# DINOHead


def test_head_has_the_reference_layers_and_frozen_unit_norms():
    with torch.device("meta"):  # the paper's sizes without allocating them
        head = DINOHead(384, 65536)
    linears = [m for m in head.mlp if isinstance(m, nn.Linear)]
    assert [(m.in_features, m.out_features) for m in linears] == [(384, 2048), (2048, 2048), (2048, 256)]
    assert [type(m) for m in head.mlp] == [nn.Linear, nn.GELU, nn.Linear, nn.GELU, nn.Linear]
    assert head.last_layer.bias is None and head.last_layer.weight.shape == (65536, 256)
    g = head.last_layer.parametrizations.weight.original0
    assert g.shape == (65536, 1) and not g.requires_grad
    trainable = DINOHead(8, 16, norm_last_layer=False, hidden_dim=32, bottleneck_dim=4)
    assert trainable.last_layer.parametrizations.weight.original0.requires_grad
    with_bn = DINOHead(8, 16, use_bn=True, hidden_dim=32, bottleneck_dim=4)
    assert [type(m) for m in with_bn.mlp] == [nn.Linear, nn.BatchNorm1d, nn.GELU, nn.Linear, nn.BatchNorm1d,
                                              nn.GELU, nn.Linear]


def test_head_initialisation_is_truncated_normal_002_with_zero_bias():
    torch.manual_seed(0)
    head = DINOHead(256, 64, hidden_dim=512, bottleneck_dim=128)
    for m in head.mlp:
        if isinstance(m, nn.Linear):
            assert abs(m.weight.std().item() - 0.02) < 0.001, m
            assert m.weight.abs().max() < 0.02 * 6 and torch.equal(m.bias, torch.zeros_like(m.bias))


def test_last_layer_is_g_times_v_over_its_row_norm_and_stays_unit_after_a_step():
    torch.manual_seed(0)
    head = DINOHead(8, 16, hidden_dim=32, bottleneck_dim=4)
    params = head.last_layer.parametrizations.weight
    g, v = params.original0, params.original1
    assert torch.equal(g, torch.ones_like(g))
    x = torch.randn(5, 4, dtype=torch.float64)
    expected = x @ (v.double() / v.double().norm(dim=1, keepdim=True)).T  # g = 1, rows of v normalised
    torch.testing.assert_close(head.last_layer(x.float()).double(), expected, rtol=1e-5, atol=1e-6)

    # A step moves v but not g: the effective rows keep unit norm (the point of norm_last_layer).
    optimizer = torch.optim.SGD(head.parameters(), lr=1.0)
    head(torch.randn(3, 8)).square().sum().backward()
    assert g.grad is None and v.grad is not None
    optimizer.step()
    torch.testing.assert_close(head.last_layer.weight.norm(dim=1), torch.ones(16))


def test_head_forward_is_mlp_then_l2_normalise_then_last_layer():
    torch.manual_seed(0)
    head = DINOHead(6, 10, hidden_dim=12, bottleneck_dim=5)
    x = torch.randn(4, 6, dtype=torch.float64)
    layers = [m for m in head.mlp if isinstance(m, nn.Linear)]
    h = x
    for i, layer in enumerate(layers):
        h = h @ layer.weight.double().T + layer.bias.double()
        if i < len(layers) - 1:
            h = 0.5 * h * (1 + torch.erf(h / math.sqrt(2)))  # exact GELU
    h = h / h.norm(dim=1, keepdim=True)
    v = head.last_layer.parametrizations.weight.original1.double()
    expected = h @ (v / v.norm(dim=1, keepdim=True)).T
    torch.testing.assert_close(head(x.float()).double(), expected, rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------------------------------------------------------
# DINOLoss


def loss_by_loops(student, teacher, center, ncrops, teacher_temp, student_temp=0.1):
    """main_dino.py:380-404 sample by sample in float64: mean over pairs (teacher crop iq, student crop v != iq) of
    the mean over images of -sum_k q_k log p_k."""
    s, t, c = (np.asarray(a, dtype=np.float64) for a in (student, teacher, center))
    batch = len(t) // 2
    pair_losses = []
    for iq in range(2):
        for v in range(ncrops):
            if v == iq:
                continue
            per_image = []
            for b in range(batch):
                logits_t = (t[iq * batch + b] - c[0]) / teacher_temp
                q = np.exp(logits_t - logits_t.max())
                q /= q.sum()
                logits_s = s[v * batch + b] / student_temp
                log_p = logits_s - logits_s.max() - np.log(np.exp(logits_s - logits_s.max()).sum())
                per_image.append(-(q * log_p).sum())
            pair_losses.append(np.mean(per_image))
    return np.mean(pair_losses)


@pytest.mark.parametrize("ncrops", [2, 5])
def test_loss_is_the_cross_entropy_of_every_other_view_and_the_center_moves_by_ema(ncrops):
    torch.manual_seed(0)
    batch, out_dim = 3, 7
    loss_fn = DINOLoss(out_dim, ncrops, warmup_teacher_temp=0.04, teacher_temp=0.07, warmup_teacher_temp_epochs=3,
                       nepochs=5)
    center = torch.randn(1, out_dim) * 0.1
    loss_fn.center = center.clone()
    student = torch.randn(ncrops * batch, out_dim, requires_grad=True)
    teacher = torch.randn(2 * batch, out_dim)
    loss = loss_fn(student, teacher, epoch=1)
    expected = loss_by_loops(student.detach(), teacher, center, ncrops, teacher_temp=0.055)  # halfway: 0.04 -> 0.07
    assert loss.item() == pytest.approx(expected, rel=1e-5)
    expected_center = 0.9 * center.double() + 0.1 * teacher.double().mean(dim=0, keepdim=True)
    torch.testing.assert_close(loss_fn.center.double(), expected_center, rtol=1e-6, atol=1e-7)
    assert "center" in loss_fn.state_dict()  # checkpointed with the loss (main_dino.py:284)

    # An explicit temperature gives the same as the epoch whose temperature it is.
    loss_fn.center = center.clone()
    assert loss_fn(student, teacher, teacher_temp=0.055).item() == pytest.approx(expected, rel=1e-5)


def test_loss_gradient_reaches_the_student_only():
    torch.manual_seed(0)
    loss_fn = DINOLoss(6, 4)
    student = torch.randn(8, 6, requires_grad=True)
    teacher = torch.randn(4, 6, requires_grad=True)
    loss_fn(student, teacher, epoch=0).backward()
    assert student.grad is not None and student.grad.abs().sum() > 0
    assert teacher.grad is None


def test_loss_with_a_flat_teacher_is_logsumexp_minus_mean():
    # Known answer: a teacher output equal to the center gives q uniform, and -sum_k (1/K) log softmax(s)_k is
    # logsumexp(s) - mean(s) for each student row.
    torch.manual_seed(0)
    loss_fn = DINOLoss(5, 2)
    student = torch.randn(4, 5)
    loss = loss_fn(student, torch.zeros(4, 5), teacher_temp=0.04)
    s = student.double() / 0.1
    per_row = torch.logsumexp(s, dim=1) - s.mean(dim=1)
    # pairs (teacher 0, student 1) and (teacher 1, student 0): every student row counts once
    assert loss.item() == pytest.approx(per_row.mean().item(), rel=1e-6)


def test_teacher_temperature_warms_up_linearly_then_stays():
    loss_fn = DINOLoss(4, 2, warmup_teacher_temp=0.04, teacher_temp=0.07, warmup_teacher_temp_epochs=30,
                       nepochs=100)
    temps = [loss_fn.teacher_temperature(e) for e in range(100)]
    for epoch in range(30):  # np.linspace over 30 points: epoch 29 is already 0.07
        assert temps[epoch] == pytest.approx(0.04 + 0.03 * epoch / 29)
    assert temps[30:] == [pytest.approx(0.07)] * 70
    with pytest.raises(ValueError):
        loss_fn.teacher_temperature(100)
    with pytest.raises(ValueError):
        loss_fn(torch.zeros(4, 4), torch.zeros(4, 4))  # neither epoch nor temperature


def center_worker(rank, init_file, out_file):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    loss_fn = DINOLoss(3, 2, center_momentum=0.9)
    teacher = torch.arange(6, dtype=torch.float32).reshape(2, 3) + 10 * rank  # rank 1's rows are 10 higher
    loss_fn(torch.zeros(2, 3), teacher, epoch=0)
    if rank == 0:
        torch.save(loss_fn.center, out_file)
    dist.destroy_process_group()


def test_center_averages_the_teacher_output_over_workers(tmp_path):
    out_file = tmp_path / "center.pt"
    mp.spawn(center_worker, args=(str(tmp_path / "init"), str(out_file)), nprocs=2, join=True)
    # all four rows: [0,1,2], [3,4,5], [10,11,12], [13,14,15]; their mean [6.5, 7.5, 8.5]; the center was 0
    torch.testing.assert_close(torch.load(out_file), 0.1 * torch.tensor([[6.5, 7.5, 8.5]]))


# ---------------------------------------------------------------------------------------------------------------
# Schedules, EMA, frozen last layer


def test_cosine_schedule_is_the_reference_warmup_then_cosine():
    base, final, epochs, steps, warmup, start = 5e-4, 1e-6, 7, 3, 2, 1e-5
    schedule = cosine_schedule(base, final, epochs, steps, warmup_epochs=warmup, start_warmup_value=start)
    assert schedule.shape == (21,)
    warm = warmup * steps
    for i in range(warm):
        assert schedule[i] == pytest.approx(start + (base - start) * i / (warm - 1))
    n = epochs * steps - warm
    for i in range(n):
        assert schedule[warm + i] == pytest.approx(final + 0.5 * (base - final) * (1 + math.cos(math.pi * i / n)))
    # teacher momentum (main_dino.py:250): from 0.996 up towards 1, never past it
    momentum = cosine_schedule(0.996, 1, 100, 10)
    assert momentum[0] == 0.996 and np.all(np.diff(momentum) > 0) and momentum[-1] < 1
    with pytest.raises(ValueError):
        cosine_schedule(1.0, 0.0, 2, 3, warmup_epochs=3)


def test_ema_update_is_the_convex_mix_of_parameters_without_gradient():
    torch.manual_seed(0)
    student = nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3))
    teacher = copy.deepcopy(student)
    for p in teacher.parameters():
        p.data.normal_()
        p.requires_grad = False
    teacher[1].running_mean.fill_(5.0)
    before = [p.detach().double().clone() for p in teacher.parameters()]
    ema_update_(teacher, student, 0.9)
    for k0, k, q in zip(before, teacher.parameters(), student.parameters()):
        torch.testing.assert_close(k.double(), 0.9 * k0 + 0.1 * q.detach().double(), rtol=1e-6, atol=1e-7)
        assert k.grad_fn is None and not k.requires_grad
    assert torch.equal(teacher[1].running_mean, torch.full((3,), 5.0))  # buffers are not averaged
    with pytest.raises(ValueError):
        ema_update_(teacher, nn.Linear(4, 3), 0.9)


def test_last_layer_gradients_are_dropped_only_while_frozen():
    torch.manual_seed(0)
    head = DINOHead(4, 6, norm_last_layer=False, hidden_dim=8, bottleneck_dim=3)

    def grads_after(epoch):
        head.zero_grad(set_to_none=True)
        head(torch.randn(5, 4)).square().sum().backward()
        cancel_last_layer_gradients(head, epoch, freeze_last_layer=1)
        return {name: p.grad for name, p in head.named_parameters()}

    frozen = grads_after(0)
    assert [n for n, g in frozen.items() if g is None] == [
        "last_layer.parametrizations.weight.original0", "last_layer.parametrizations.weight.original1"]
    assert all(g is not None for g in grads_after(1).values())


# ---------------------------------------------------------------------------------------------------------------
# Position embeddings at another size, and the multi-crop forward


def tiny_vit(**options) -> ViT:
    config = dict(image_size=16, patch_size=4, in_chans=3, num_classes=5, dim=16, depth=2, num_heads=2)
    torch.manual_seed(0)
    return ViT(ViTConfig(**{**config, **options})).eval()


def bicubic_matrix(n_in: int, n_out: int, scale_factor: float) -> np.ndarray:
    """torch's 1-D bicubic (align_corners=False, a scale factor given): output i reads input x = (i + 0.5) /
    scale_factor - 0.5 with Keys' cubic convolution, A = -0.75, indices clamped at the borders. (n_out, n_in)."""
    a = -0.75

    def kernel(t):
        t = abs(t)
        if t <= 1:
            return (a + 2) * t**3 - (a + 3) * t**2 + 1
        if t < 2:
            return a * t**3 - 5 * a * t**2 + 8 * a * t - 4 * a
        return 0.0

    m = np.zeros((n_out, n_in))
    for i in range(n_out):
        x = (i + 0.5) / scale_factor - 0.5
        x0 = math.floor(x)
        for j in range(x0 - 1, x0 + 3):
            m[i, min(max(j, 0), n_in - 1)] += kernel(x - j)
    return m


def test_position_embedding_at_the_native_size_is_the_learned_one_and_the_forward_unchanged():
    vit = tiny_vit()
    assert vit.position_embedding(4, 4) is vit.pos_embed
    images = torch.randn(3, 3, 16, 16)
    # the forward as it was before resizing existed: patches + pos_embed, class token, blocks, norm, head
    x = vit.patch_embed(images).flatten(2).transpose(1, 2) + vit.pos_embed
    x = torch.cat((vit.cls_token.expand(3, -1, -1), x), dim=1)
    for block in vit.blocks:
        x = block(x)
    expected = vit.head(vit.norm(x)[:, 0])
    assert torch.equal(vit(images), expected)


@pytest.mark.parametrize("grid", [(2, 2), (6, 6), (3, 5)])
def test_position_embedding_at_another_size_is_the_bicubic_resize_written_out(grid):
    vit = tiny_vit()
    side, dim = 4, 16
    table = vit.pos_embed.detach().double().reshape(side, side, dim).numpy()
    rows = bicubic_matrix(side, grid[0], (grid[0] + 0.1) / side)
    cols = bicubic_matrix(side, grid[1], (grid[1] + 0.1) / side)
    expected = np.einsum("ai,ijd,bj->abd", rows, table, cols).reshape(1, grid[0] * grid[1], dim)
    np.testing.assert_allclose(vit.position_embedding(*grid).detach().double().numpy(), expected, atol=1e-6)
    images = torch.randn(2, 3, 4 * grid[0], 4 * grid[1])
    out = vit(images, return_features=True)
    assert out.tokens.shape == (2, 1 + grid[0] * grid[1], dim)


def test_multicrop_forward_runs_the_backbone_once_per_size_run_and_equals_crop_by_crop():
    vit = tiny_vit()
    reference = copy.deepcopy(vit)  # keeps its classifier: its feature is the class token the wrapper must return
    head = DINOHead(16, 9, hidden_dim=20, bottleneck_dim=6)
    model = MultiCropForward(vit, head).eval()
    assert isinstance(vit.head, nn.Identity)
    calls = []
    vit.register_forward_hook(lambda module, args, out: calls.append(args[0].shape))
    torch.manual_seed(1)
    crops = [torch.randn(2, 3, 16, 16) for _ in range(2)] + [torch.randn(2, 3, 8, 8) for _ in range(3)]
    out = model(crops)
    assert out.shape == (10, 9)
    assert calls == [(4, 3, 16, 16), (6, 3, 8, 8)]
    expected = head(torch.cat([reference(c, return_features=True).tokens[:, 0] for c in crops]))
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)

    calls.clear()
    model([crops[0], crops[2], crops[1]])  # sizes 16, 8, 16: three runs, the order kept
    assert calls == [(2, 3, 16, 16), (2, 3, 8, 8), (2, 3, 16, 16)]
