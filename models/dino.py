"""DINO self-distillation (Caron et al., "Emerging Properties in Self-Supervised Vision Transformers", ICCV 2021): the
projection head, the loss, the schedules, the teacher's EMA and the multi-crop forward.

Each part follows facebookresearch/dino at commit 7c446df (files cited as file:line): vision_transformer.py
(DINOHead), main_dino.py (DINOLoss, the training step), utils.py (cosine_scheduler, MultiCropWrapper,
cancel_gradients_last_layer). One training step, as main_dino.py:306-350 runs it::

    teacher_out = teacher(crops[:2])             # MultiCropForward; only the two global crops reach the teacher
    student_out = student(crops)                 # every crop, global and local
    loss = dino_loss(student_out, teacher_out, epoch)
    loss.backward()
    cancel_last_layer_gradients(student, epoch, freeze_last_layer)
    optimizer.step()
    ema_update_(teacher, student, momentum_schedule[step])
"""

from __future__ import annotations

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.utils.parametrizations import weight_norm


class DINOHead(nn.Module):
    """vision_transformer.py:257-291. An MLP in_dim -> hidden_dim (-> hidden_dim)* -> bottleneck_dim with GELU (and
    BatchNorm after each hidden linear layer with ``use_bn``), L2 normalisation, then a weight-normalised linear layer
    bottleneck_dim -> out_dim without bias whose norms g start at 1 (and stay 1, frozen, with ``norm_last_layer``).

    The MLP's linear layers are initialised truncated-normal with std 0.02 and zero bias (:275, :281-285); the last
    layer is built after that initialisation, so it keeps nn.Linear's own (:276), as in the reference.

    The reference wraps the last layer with the deprecated ``nn.utils.weight_norm`` (parameters ``weight_g``,
    ``weight_v``); here it is ``torch.nn.utils.parametrizations.weight_norm``, the same function of the same two
    parameters, stored as ``last_layer.parametrizations.weight.original0`` (g, (out_dim, 1)) and ``original1`` (v).
    """

    def __init__(self, in_dim: int, out_dim: int, use_bn: bool = False, norm_last_layer: bool = True,
                 nlayers: int = 3, hidden_dim: int = 2048, bottleneck_dim: int = 256):
        super().__init__()
        nlayers = max(nlayers, 1)
        if nlayers == 1:
            self.mlp = nn.Linear(in_dim, bottleneck_dim)
        else:
            layers = [nn.Linear(in_dim, hidden_dim)]
            if use_bn:
                layers.append(nn.BatchNorm1d(hidden_dim))
            layers.append(nn.GELU())
            for _ in range(nlayers - 2):
                layers.append(nn.Linear(hidden_dim, hidden_dim))
                if use_bn:
                    layers.append(nn.BatchNorm1d(hidden_dim))
                layers.append(nn.GELU())
            layers.append(nn.Linear(hidden_dim, bottleneck_dim))
            self.mlp = nn.Sequential(*layers)
        self.apply(_init_weights)
        self.last_layer = weight_norm(nn.Linear(bottleneck_dim, out_dim, bias=False))
        g = self.last_layer.parametrizations.weight.original0
        with torch.no_grad():
            g.fill_(1)
        g.requires_grad = not norm_last_layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x (B, in_dim) -> (B, out_dim)."""
        x = self.mlp(x)
        x = F.normalize(x, dim=-1, p=2)
        return self.last_layer(x)


def _init_weights(module: nn.Module) -> None:
    if isinstance(module, nn.Linear):
        nn.init.trunc_normal_(module.weight, std=0.02)
        if module.bias is not None:
            nn.init.zeros_(module.bias)


class DINOLoss(nn.Module):
    """main_dino.py:363-416: cross-entropy between the sharpened, centred teacher distribution of each global crop
    and the student's distribution of every other crop, averaged over the pairs (a crop is never compared with
    itself).

    - ``ncrops``: crops per image in the student's output (2 global + the local ones); the teacher sees the 2
      global crops. Rows are crop-major: crop 0 of every image, then crop 1, ... (what MultiCropForward returns).
    - The teacher temperature rises linearly from ``warmup_teacher_temp`` to ``teacher_temp`` over
      ``warmup_teacher_temp_epochs`` epochs (np.linspace, so the last warm-up epoch already has ``teacher_temp``),
      then stays there (:374-378). The defaults are main_dino.py's arguments (:68-75, :92): 0.04, 0.04, 0, 100.
    - ``center`` (1, out_dim) is a buffer (saved with the state dict, as the reference checkpoints ``dino_loss``,
      :284): after each forward it moves to ``center_momentum * center + (1 - center_momentum) * mean`` of the teacher
      output over the batch and over the data-parallel workers (:406-416).
    """

    center: torch.Tensor

    def __init__(self, out_dim: int, ncrops: int, warmup_teacher_temp: float = 0.04, teacher_temp: float = 0.04,
                 warmup_teacher_temp_epochs: int = 0, nepochs: int = 100, student_temp: float = 0.1,
                 center_momentum: float = 0.9):
        super().__init__()
        if ncrops < 2:
            raise ValueError(f"ncrops counts the 2 global crops and the local ones: at least 2, got {ncrops}")
        if not 0 <= warmup_teacher_temp_epochs <= nepochs:
            raise ValueError(f"warmup_teacher_temp_epochs must be in 0..nepochs={nepochs}, "
                             f"got {warmup_teacher_temp_epochs}")
        self.student_temp = student_temp
        self.center_momentum = center_momentum
        self.ncrops = ncrops
        self.register_buffer("center", torch.zeros(1, out_dim))
        self.teacher_temp_schedule = np.concatenate((
            np.linspace(warmup_teacher_temp, teacher_temp, warmup_teacher_temp_epochs),
            np.ones(nepochs - warmup_teacher_temp_epochs) * teacher_temp,
        ))

    def teacher_temperature(self, epoch: int) -> float:
        """The teacher's temperature during ``epoch`` (0-based)."""
        if not 0 <= epoch < len(self.teacher_temp_schedule):
            raise ValueError(f"epoch must be in 0..{len(self.teacher_temp_schedule) - 1}, got {epoch}")
        return float(self.teacher_temp_schedule[epoch])

    def forward(self, student_output: torch.Tensor, teacher_output: torch.Tensor, epoch: int | None = None, *,
                teacher_temp: float | None = None) -> torch.Tensor:
        """student_output (ncrops * B, out_dim), teacher_output (2 * B, out_dim), crop-major; the teacher's
        temperature from ``epoch`` (the schedule) or given as ``teacher_temp``, exactly one of them. Returns the
        scalar loss (gradients reach the student only) and updates ``center`` from the teacher output."""
        if (epoch is None) == (teacher_temp is None):
            raise ValueError("give exactly one of epoch (the schedule's temperature) and teacher_temp")
        if len(student_output) % self.ncrops or 2 * len(student_output) != self.ncrops * len(teacher_output):
            raise ValueError(f"need student_output ({self.ncrops} * B, K) and teacher_output (2 * B, K); got "
                             f"{tuple(student_output.shape)} and {tuple(teacher_output.shape)}")
        temp = self.teacher_temperature(epoch) if teacher_temp is None else teacher_temp
        student_out = (student_output / self.student_temp).chunk(self.ncrops)
        teacher_out = F.softmax((teacher_output - self.center) / temp, dim=-1).detach().chunk(2)
        total_loss = 0
        n_loss_terms = 0
        for iq, q in enumerate(teacher_out):
            for v in range(len(student_out)):
                if v == iq:  # the same view seen by the teacher and the student (:396-398)
                    continue
                total_loss += torch.sum(-q * F.log_softmax(student_out[v], dim=-1), dim=-1).mean()
                n_loss_terms += 1
        total_loss /= n_loss_terms
        self.update_center(teacher_output)
        return total_loss

    @torch.no_grad()
    def update_center(self, teacher_output: torch.Tensor) -> None:
        """center <- m * center + (1 - m) * (mean of teacher_output over its rows and every worker's rows).
        The reference all-reduces unconditionally (:412); without torch.distributed this is the local mean."""
        batch_center = torch.sum(teacher_output, dim=0, keepdim=True)
        world_size = 1
        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(batch_center)
            world_size = dist.get_world_size()
        batch_center = batch_center / (len(teacher_output) * world_size)
        self.center = self.center * self.center_momentum + batch_center * (1 - self.center_momentum)


def cosine_schedule(base: float, final: float, epochs: int, steps_per_epoch: int, warmup_epochs: int = 0,
                    start_warmup_value: float = 0) -> np.ndarray:
    """utils.py:187-198 (cosine_scheduler): one value per step, (epochs * steps_per_epoch,). A linear warm-up from
    ``start_warmup_value`` to ``base`` over ``warmup_epochs`` epochs (np.linspace: its last step is ``base``), then
    final + (base - final) (1 + cos(pi i / n)) / 2 for i = 0..n-1 over the n remaining steps (so the last value is
    just above ``final``, as in the reference). DINO builds its learning rate (main_dino.py:238-243), weight decay
    (:244-248) and teacher momentum (:250-251, base 0.996 to 1) from it."""
    warmup_iters = warmup_epochs * steps_per_epoch
    warmup = np.linspace(start_warmup_value, base, warmup_iters) if warmup_epochs > 0 else np.array([])
    iters = np.arange(epochs * steps_per_epoch - warmup_iters)
    schedule = final + 0.5 * (base - final) * (1 + np.cos(np.pi * iters / len(iters)))
    schedule = np.concatenate((warmup, schedule))
    if len(schedule) != epochs * steps_per_epoch:
        raise ValueError(f"warmup_epochs ({warmup_epochs}) must not exceed epochs ({epochs})")
    return schedule


@torch.no_grad()
def ema_update_(teacher: nn.Module, student: nn.Module, momentum: float) -> None:
    """main_dino.py:346-350: param_k <- m * param_k + (1 - m) * param_q for every parameter of the teacher (k) and of
    the student (q), in ``parameters()`` order; buffers are left alone, as in the reference. Pass the student
    without its DistributedDataParallel wrapper (``student.module``)."""
    teacher_params, student_params = list(teacher.parameters()), list(student.parameters())
    if len(teacher_params) != len(student_params) or any(
        k.shape != q.shape for k, q in zip(teacher_params, student_params)
    ):
        raise ValueError("teacher and student must have the same parameters, in the same order")
    torch._foreach_mul_(teacher_params, momentum)
    torch._foreach_add_(teacher_params, [q.detach() for q in student_params], alpha=1 - momentum)


def cancel_last_layer_gradients(head: nn.Module, epoch: int, freeze_last_layer: int) -> None:
    """utils.py:144-149: during the first ``freeze_last_layer`` epochs, drop the gradients of every parameter whose
    name contains ``last_layer`` (the DINO head's output layer), so the optimiser leaves it unchanged. ``head``: the
    head, the MultiCropForward or the whole student; call it between backward() and the optimiser step."""
    if epoch >= freeze_last_layer:
        return
    for name, p in head.named_parameters():
        if "last_layer" in name:
            p.grad = None


class MultiCropForward(nn.Module):
    """utils.py:594-629 (MultiCropWrapper): the backbone once per run of consecutive crops of the same size (each
    run concatenated along the batch), its features concatenated, then the head once.

    The backbone's own classifier is replaced by ``nn.Identity()`` (``head`` and ``fc`` attributes, :605-606), so
    the backbone returns the feature its classifier would read: the class token after the final norm for this
    project's ViT with ``pool="cls"`` (DINO's choice, vision_transformer.py:214). The ViT interpolates its position
    embeddings for crops of another size (``ViT.position_embedding``).
    """

    def __init__(self, backbone: nn.Module, head: nn.Module):
        super().__init__()
        backbone.fc, backbone.head = nn.Identity(), nn.Identity()
        self.backbone = backbone
        self.head = head

    def forward(self, crops: list[torch.Tensor] | torch.Tensor) -> torch.Tensor:
        """crops: a list of n_crops tensors (B, C, H_i, W_i), or one tensor -> (n_crops * B, out_dim), crop-major."""
        if not isinstance(crops, (list, tuple)):
            crops = [crops]
        outputs, start = [], 0
        while start < len(crops):
            end = start + 1
            while end < len(crops) and crops[end].shape[-2:] == crops[start].shape[-2:]:
                end += 1
            out = self.backbone(torch.cat(list(crops[start:end])))
            outputs.append(out[0] if isinstance(out, tuple) else out)  # XCiT returns a tuple (utils.py:621-624)
            start = end
        return self.head(torch.cat(outputs))
