"""Self-supervised DINO (facebookresearch/dino, main_dino.py): a student ViT with the DINO head learns to give, on
every crop of an image, the centred and sharpened output distribution of a teacher on the image's two global crops;
the teacher is the exponential moving average of the student. Laplacian heads, layer schedules and STLT mixers
apply to the backbone exactly as in supervised ViTs (the head is the same whatever the backbone).

The frozen teacher is judged every epoch by DINO's weighted k-NN (eval_knn.py) on its class tokens: the training
images as evaluated are the bank, the validation images the queries. A linear probe and a segmentation probe are
later stages of the run (study/tasks/linear_probe.py, segmentation_probe.py), from the teacher's backbone.

Hyperparameters: the model keys and training keys as for any ViT (`lr` the peak for the global batch, which DINO
scales from 0.0005 per 256 images, on DINO's own schedule: a linear warm-up from 0 over `warmup_epochs`, then a
cosine to `lr` x `min_lr_ratio`, so `lr_decay` is not used; `weight_decay` the start of DINO's weight-decay schedule;
`grad_clip` clips each parameter's gradient norm, DINO's clip_gradients, not the global norm), and
the `dino_*` keys below. The crops (how many local ones, their scales and size) are the dataset's
(`augment: dino_multicrop`, docs/data.md).
"""

from __future__ import annotations

import numpy as np
import torch
import torch.distributed as dist
from pydantic import Field
from torch import nn

import models
from models.dino import DINOHead, DINOLoss, MultiCropForward, cancel_last_layer_gradients, cosine_schedule, ema_update_
from models.geometry import GeometryAccumulator
from models.knn import knn_predict
from study.schema import StrictModel
from study.tasks.base import GeometryPictures, Task
from study.tasks.patches import PatchGeometry


class DINOOptions(StrictModel):
    """main_dino.py's arguments (:60-130) under this project's names; defaults are the reference's."""

    dino_out_dim: int = Field(65536, ge=2, description="output dimension of the DINO head")
    dino_norm_last_layer: bool = Field(True, description="the head's last layer weight-normalised with g frozen at 1")
    dino_use_bn_in_head: bool = Field(False, description="batch norm in the head's MLP")
    dino_momentum_teacher: float = Field(0.996, ge=0, lt=1, description="start of the teacher's EMA momentum, "
                                                                         "which rises to 1 on a cosine")
    dino_warmup_teacher_temp: float = Field(0.04, gt=0, description="teacher temperature at the first epoch")
    dino_teacher_temp: float = Field(0.04, gt=0, description="teacher temperature after the warm-up")
    dino_warmup_teacher_temp_epochs: int = Field(0, ge=0, description="epochs of the linear temperature warm-up")
    dino_weight_decay_end: float = Field(0.4, ge=0, description="end of the cosine weight-decay schedule")
    dino_freeze_last_layer: int = Field(1, ge=0, description="epochs during which the head's last layer is fixed")
    dino_knn_k: int = Field(20, ge=1, description="neighbours of the k-NN evaluation (eval_knn.py)")
    dino_knn_temperature: float = Field(0.07, gt=0, description="temperature of the k-NN vote weights")


class DINOModel(nn.Module):
    """The student and the teacher (a backbone and the DINO head each; the teacher never gets gradients) and the
    loss with its centre, as one module: what the training loop checkpoints, wraps in DDP and asks of a model."""

    def __init__(self, backbone: nn.Module, teacher_backbone: nn.Module, option: DINOOptions):
        super().__init__()
        dim = backbone.config.dim
        self.student = MultiCropForward(backbone, DINOHead(dim, option.dino_out_dim, option.dino_use_bn_in_head,
                                                           option.dino_norm_last_layer))
        self.teacher = MultiCropForward(teacher_backbone, DINOHead(dim, option.dino_out_dim,
                                                                   option.dino_use_bn_in_head))
        self.teacher.load_state_dict(self.student.state_dict())  # main_dino.py:219-220
        self.teacher.requires_grad_(False)
        # The number of crops is the data's: forward sets it from the crops it gets. The temperature is given.
        self.loss = DINOLoss(option.dino_out_dim, ncrops=2)
        self.config = backbone.config

    def forward(self, crops: list[torch.Tensor], teacher_temp: float) -> torch.Tensor:
        """crops: the 2 global crops, then the local ones, each (B, C, S, S) -> the DINO loss (main_dino.py:320-323)."""
        with torch.no_grad():
            teacher_output = self.teacher(crops[:2])  # only the 2 global views pass through the teacher
        student_output = self.student(crops)
        self.loss.ncrops = len(crops)
        return self.loss(student_output, teacher_output, teacher_temp=teacher_temp)

    @property
    def evaluated(self) -> nn.Module:
        """The backbone judged: the teacher's (eval_knn.py's and eval_linear.py's default checkpoint key)."""
        return self.teacher.backbone

    def param_groups(self, weight_decay: float, slow_lr_scale: float = 1.0) -> list[dict]:
        """utils.get_params_groups over the student: biases and 1-d parameters not regularised, the rest under the
        weight-decay schedule (marked `regularized`); the mixers' slow parameters (STLT) at `slow_lr_scale`."""
        slow = {id(p) for mixer in self.student.backbone._mixers_with("slow_parameters")
                for p in mixer.slow_parameters()}
        regularized, plain, slow_params = [], [], []
        for name, p in self.student.named_parameters():
            if not p.requires_grad:
                continue
            if id(p) in slow:
                slow_params.append(p)
            elif name.endswith(".bias") or p.ndim == 1:
                plain.append(p)
            else:
                regularized.append(p)
        groups = [{"params": regularized, "weight_decay": weight_decay, "lr_scale": 1.0, "regularized": True},
                  {"params": plain, "weight_decay": 0.0, "lr_scale": 1.0},
                  {"params": slow_params, "weight_decay": 0.0, "lr_scale": slow_lr_scale}]
        return [g for g in groups if g["params"]]

    def set_training_step(self, step: int, total_steps: int) -> None:
        self.student.backbone.set_training_step(step, total_steps)

    def regularization_loss(self) -> torch.Tensor:
        return self.student.backbone.regularization_loss()

    def mixer_stats(self) -> dict[str, float]:
        return self.student.backbone.mixer_stats()


class DINO(Task):
    name = "dino"
    model_family = "vit"
    data_kind = "images"
    input_key = "image"  # of the evaluated splits; training batches carry "crops"
    sum_names = ("hits", "top5_hits", "queries")
    quality_metrics = ("knn_acc", "knn_top5")
    geometry_metrics = ("total_var", "within_seq_var", "within_class_var", "between_class_var",
                        "between_class_frac", "nc1", "nc2_equinorm", "nc2_equiangle", "pcs99", *PatchGeometry.metrics)
    layer_geometry_metrics = ("within_seq_var", "within_class_var", "between_class_var", "between_class_frac",
                              "nc1")
    report_geometry = ("between_class_frac", "nc1", "within_seq_var")
    options = DINOOptions
    evaluate_before_training = True
    own_lr_schedule = True  # train_step: DINO's cosine, not the run's LambdaLR

    @classmethod
    def build_model(cls, resolved, carried):
        student = models.build_model(resolved.config)
        teacher = models.build_model({**resolved.model, "drop_path": 0.0})  # main_dino.py:166: no stochastic depth
        model = DINOModel(student, teacher, resolved.options)
        if carried is not None:
            model.load_state_dict(carried)
        return model

    def carry(self) -> dict:
        return self.model.evaluated.state_dict()

    def count(self, batch: dict) -> dict[str, int]:
        return {"samples": len(batch["label"])}

    def train_step(self, state, batch, settings):
        """main_dino.py:303-350: the learning rate, the weight decay of the regularised parameters and the teacher
        momentum follow DINO's cosine schedules (:238-251), set before the step as DINO sets them (so the run's
        LambdaLR is not stepped), the teacher temperature its warm-up; after the backward, per-parameter gradient
        clipping and, in the first epochs, no update of the head's last layer; after the step, the teacher's EMA
        update."""
        option, step = self.option, state.step
        epoch = step // settings.steps_per_epoch
        if not hasattr(self, "_weight_decay"):
            lr, run = self.hyperparameters["lr"], self.hyperparameters
            self._lr = cosine_schedule(lr, lr * run["min_lr_ratio"], settings.steps_per_epoch * settings.epochs, 1,
                                       round(run["warmup_epochs"] * settings.steps_per_epoch))  # warm-up in steps
            # from the run's keys, not the groups: a resumed optimiser's groups hold the last scheduled decay
            self._weight_decay = cosine_schedule(run["weight_decay"], option.dino_weight_decay_end, settings.epochs,
                                                 settings.steps_per_epoch)
            self._momentum = cosine_schedule(option.dino_momentum_teacher, 1.0, settings.epochs,
                                             settings.steps_per_epoch)
            warm = option.dino_warmup_teacher_temp_epochs
            self._temperature = np.concatenate((
                np.linspace(option.dino_warmup_teacher_temp, option.dino_teacher_temp, warm),
                np.full(max(settings.epochs - warm, 1), option.dino_teacher_temp)))
        for group in state.optimizer.param_groups:
            group["lr"] = float(self._lr[step]) * group["lr_scale"]
            if group.get("regularized"):
                group["weight_decay"] = float(self._weight_decay[step])
        model = state.model
        model.set_training_step(step, settings.steps_per_epoch * settings.epochs)
        with settings.autocast:
            loss = state.trained(batch["crops"], teacher_temp=float(self._temperature[min(epoch, len(
                self._temperature) - 1)]))
        state.optimizer.zero_grad(set_to_none=True)
        (loss + model.regularization_loss()).backward()
        if settings.grad_clip > 0:
            clip_each_gradient_(model.student, settings.grad_clip)
        cancel_last_layer_gradients(model.student.head, epoch, option.dino_freeze_last_layer)
        state.optimizer.step()
        ema_update_(model.teacher, model.student, float(self._momentum[step]))
        state.step += 1
        return loss.detach()

    # ---- evaluation: weighted k-NN on the teacher's class tokens, and their geometry ------------------------------

    def setup(self, eval_batches):
        self.eval_batches = eval_batches

    def evaluate(self, batches, *, autocast, geometry):
        backbone = self.model.evaluated
        backbone.eval()
        bank, bank_labels = self._gathered(*self._features(backbone, self.eval_batches("bank"), autocast))
        last = self.new_accumulator() if geometry else None
        layers = [self.new_accumulator(layer=True) for _ in backbone.blocks] if geometry else []
        patches = PatchGeometry(backbone.config.dim, self.worker.device) if geometry else None
        queries, labels = [], []
        with torch.no_grad():
            for index, batch in enumerate(batches):
                want = geometry and (self.geometry.max_batches is None or index < self.geometry.max_batches)
                with autocast, backbone.layer_outputs() as outputs:
                    out = backbone(batch["image"], return_features=True)
                queries.append(out.feature.float())
                labels.append(batch["label"])
                if want:
                    self.accumulate(last, out.tokens, out.feature, batch, last=True)
                    patches.update(out.tokens, batch["image"])
                    for accumulator, tokens in zip(layers, outputs):
                        self.accumulate(accumulator, tokens, backbone.pool(tokens), batch)
        sums = torch.zeros(3, dtype=torch.float64)
        if queries:
            queries, labels = torch.cat(queries), torch.cat(labels)
            classes, votes = knn_predict(bank, bank_labels, queries, min(self.option.dino_knn_k, len(bank)),
                                         self.option.dino_knn_temperature, num_classes=self.num_classes, top=5)
            hit = (classes == labels[:, None].to(classes.device)) & (votes > 0)
            sums += torch.tensor([hit[:, 0].sum().item(), hit.any(dim=1).sum().item(), len(labels)],
                                 dtype=torch.float64)
        totals = dict(zip(self.sum_names, self.worker.all_reduce(sums).tolist()))
        metrics = {"knn_acc": totals["hits"] / totals["queries"], "knn_top5": totals["top5_hits"] / totals["queries"]}
        return self.finish_evaluation(metrics, last, layers, patches)

    @property
    def num_classes(self) -> int:
        return self.hyperparameters["num_classes"]

    def _features(self, backbone, batches, autocast) -> tuple[torch.Tensor, torch.Tensor]:
        """The class tokens (after the final norm) and labels of a split's batches on this worker."""
        features, labels = [], []
        with torch.no_grad():
            for batch in batches:
                with autocast:
                    out = backbone(batch["image"], return_features=True)
                features.append(out.feature.float())
                labels.append(batch["label"])
        dim = backbone.config.dim
        if not features:
            return torch.zeros(0, dim, device=self.worker.device), torch.zeros(0, dtype=torch.long)
        return torch.cat(features), torch.cat(labels)

    def _gathered(self, features: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Every worker's bank, on every worker (eval_knn.py gathers the training features on each GPU too)."""
        if self.worker.world == 1 or not dist.is_initialized():
            return features, labels.to(features.device)
        counts = self.worker.all_reduce(torch.zeros(self.worker.world).index_fill_(
            0, torch.tensor([self.worker.rank]), float(len(labels))))
        largest = int(counts.max())
        padded = torch.zeros(largest, features.shape[1] + 1, device=features.device)
        padded[:len(labels), :-1], padded[:len(labels), -1] = features, labels.to(features.device).float()
        device = "cuda" if dist.get_backend() == "nccl" else "cpu"
        gathered = [torch.zeros_like(padded, device=device) for _ in range(self.worker.world)]
        dist.all_gather(gathered, padded.to(device))
        rows = torch.cat([g[:int(n)] for g, n in zip(gathered, counts.tolist())]).to(features.device)
        return rows[:, :-1], rows[:, -1].long()

    def new_accumulator(self, layer=False):
        return GeometryAccumulator(self.model.config.dim, num_classes=self.num_classes,
                                   reservoir_size=1 if layer else self.geometry.pca_points,
                                   seed=self._reservoir_seed(), device=self.worker.device)

    def accumulate(self, accumulator, tokens, feature, batch, last=False):
        accumulator.update(tokens, labels=batch["label"], features=feature)

    def finish_geometry(self, accumulator):
        values = accumulator.all_reduce_().compute()  # no classifier: the split, NC1, NC2 and the spectrum
        points, labels = accumulator.pca_projection()
        parts = {"within sequence": values["within_seq_var"], "within class": values["within_class_var"],
                 "between class": values["between_class_var"]}
        return values, GeometryPictures(points, labels, "class", parts, values["total_var"])


@torch.no_grad()
def clip_each_gradient_(module: nn.Module, clip: float) -> None:
    """utils.py:132-141 clip_gradients: scale each parameter's gradient to norm at most `clip` (by clip / (norm +
    1e-6)), separately. The student's parameters are DINO's one for one, the position embedding of the class token
    and of the patches one tensor (`class_pos_embed`), so each is clipped as DINO clips it."""
    for p in module.parameters():
        if p.grad is not None:
            norm = p.grad.norm(2)
            coefficient = clip / (norm + 1e-6)
            if coefficient < 1:
                p.grad.mul_(coefficient)
