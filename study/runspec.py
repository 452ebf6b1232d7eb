"""What one training run is: the resolved hyperparameters of a trial plus task, data, epochs and seed.

A `RunSpec` is what a study trial trains, what `lapstudy export` writes and what `lapstudy train` re-runs: the same
object, so an exported file carries everything needed to reproduce the trial. Hyperparameters are flat and use the
names of the search space: model keys (`models.MODEL_KEYS`, docs/config.md) go to `models.build_model`, training
keys (`TrainConfig` below) to the training loop.
"""

from __future__ import annotations

import dataclasses
import json
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, Field, field_validator, model_validator

import models
from models.keys import renamed_key_problem
from models.stlt import stlt_config
from study.data import DatasetConfig
from study.errors import UserError, validate
from study.evals.spec import Evaluations, check_evaluation
from study.schema import StrictModel
from study.tasks import TASKS, GeometrySpec, registered_task, task_class
from study.yamlio import load_yaml


class TrainConfig(StrictModel):
    """Training hyperparameters (the keys of a trial config that are not model keys)."""

    optimizer: Literal["adamw", "lamb", "sgd", "nanochat"] = Field(
        "adamw", description="AdamW; LAMB as DeiT III runs it (apex FusedLAMB); SGD with momentum beta1 (Nesterov off) "
                             "as DINO's linear probe trains; nanochat: Muon for the GPT blocks' matrices and AdamW "
                             "for embedding and head at matrix_lr, embedding_lr, unembedding_lr, with nanochat's "
                             "warm-down schedule (docs/nanochat.md; lr, beta1, beta2, eps are then not used)")
    lr: float = Field(1e-3, gt=0, description="peak learning rate for the global batch")
    weight_decay: float = Field(0.05, ge=0, description="decoupled weight decay on matrices "
                                "(not norms, biases, embeddings)")
    beta1: float = Field(0.9, ge=0, lt=1, description="first-moment decay (AdamW, LAMB); SGD's momentum")
    beta2: float = Field(0.999, ge=0, lt=1, description="second-moment decay (AdamW, LAMB)")
    eps: float = Field(1e-8, gt=0, description="added to the second-moment root (AdamW, LAMB)")
    batch_size: int = Field(64, ge=1, description="global batch size (split evenly over the data-parallel workers)")
    warmup_epochs: float = Field(0.0, ge=0, description="linear warm-up length in epochs (fractions allowed)")
    min_lr_ratio: float = Field(0.0, ge=0, le=1, description="cosine decay ends at this fraction of the peak lr")
    lr_decay: Literal["cosine", "inverse_sqrt"] = Field(
        "cosine", description="after the warm-up: cosine to min_lr_ratio at the run's end, or inverse_sqrt: "
                              "lr * sqrt(warm-up steps / step), the Transformer's (Vaswani et al. 2017, 5.3)")
    grad_clip: float = Field(1.0, ge=0, description="clip the global gradient norm to this value (0: off)")
    steps_per_epoch: int | None = Field(
        None, ge=1, description="optimiser steps per epoch (required for streamed data of unknown length)"
    )
    param_data_ratio: float | None = Field(
        None, gt=0, description="language models: training tokens per model parameter, nanochat base_train's "
        "target_param_data_ratio (20): the run's steps are ratio x parameters // (batch_size x context_length), "
        "over its epochs; steps_per_epoch then follows from the model built")
    precision: Literal["auto", "fp32", "bf16"] = Field("auto", description="auto: bf16 autocast on GPU, fp32 on CPU")
    matrix_lr: float = Field(0.02, gt=0, description="nanochat: Muon's learning rate of the blocks' 2-D matrices")
    embedding_lr: float = Field(0.2, gt=0, description="nanochat: AdamW's learning rate of the token embedding, "
                                                       "times (dim / 768) ** -0.5")
    unembedding_lr: float = Field(0.004, gt=0, description="nanochat: AdamW's learning rate of the head (and of "
                                                           "parameters nanochat has not), times (dim / 768) ** -0.5")
    warmdown_ratio: float = Field(0.2, ge=0, le=1, description="nanochat: share of the steps over which the lr "
                                                               "falls linearly to min_lr_ratio "
                                                               "(base_train 0.2, chat_sft 1.0)")
    muon_momentum_warmup: int = Field(300, ge=0, description="nanochat: steps of Muon's momentum ramp 0.85 -> 0.95 "
                                                             "(0: 0.95 throughout, as chat_sft)")
    loss: Literal["ce", "bce"] = Field(
        "ce", description="classification: cross-entropy, or binary cross-entropy on the (mixed) targets > 0 as "
                          "DeiT III trains ImageNet-1k (facebookresearch/deit engine.py, main.py --bce-loss)")

    @model_validator(mode="after")
    def _inverse_sqrt_after_a_warmup(self):
        if self.lr_decay == "inverse_sqrt" and self.warmup_epochs == 0 and self.optimizer != "nanochat":
            raise ValueError("lr_decay: inverse_sqrt decays from the end of the warm-up; set warmup_epochs > 0")
        return self

    def read_keys(self, task: str) -> frozenset[str]:
        """The training keys a run of `task` with these settings reads, so what it records: the loop's, the
        optimiser's and the learning-rate schedule's (study/optim.py), and the task's own (`Task.reads_training`).
        Any other key changes nothing in training."""
        owner = task_class(task)
        keys = {"optimizer", "batch_size", "grad_clip", "steps_per_epoch", "precision", "weight_decay",
                "warmup_epochs", *owner.reads_training}
        if self.param_data_ratio is not None:  # it sets steps_per_epoch
            keys.add("param_data_ratio")
        if self.optimizer == "nanochat":  # its own learning rates, and its warm-down to min_lr_ratio
            return frozenset(keys | {"matrix_lr", "embedding_lr", "unembedding_lr", "warmdown_ratio",
                                     "muon_momentum_warmup", "min_lr_ratio"})
        keys |= {"lr", "beta1"} | ({"beta2", "eps"} if self.optimizer in ("adamw", "lamb") else set())
        if owner.own_lr_schedule or self.lr_decay == "cosine":
            keys.add("min_lr_ratio")
        if not owner.own_lr_schedule:
            keys.add("lr_decay")
        return frozenset(keys)

    def check_set_keys_read(self, task: str, where: str) -> None:
        """UserError for a key set to other than its default that this run does not read (a default changes
        nothing: a config exported with every key still runs), naming the settings that would read it."""
        read = self.read_keys(task)
        for key in sorted(self.model_fields_set - read):
            if getattr(self, key) == TrainConfig.model_fields[key].default:
                continue
            for setting in ("lr_decay", "optimizer"):
                readers = [value for value in typing.get_args(TrainConfig.model_fields[setting].annotation)
                           if key in self.model_copy(update={setting: value}).read_keys(task)]
                if readers:
                    raise UserError(f"{where}.{key}: is read with {setting} {' or '.join(readers)}, not "
                                    f"{getattr(self, setting)} as here (leave it out)", field=key)
            readers = [name for name in TASKS if key in self.read_keys(name)]
            raise UserError(f"{where}.{key}: is read by task {' or '.join(readers)}, not {task} (leave it out)",
                            field=key)


TRAIN_KEYS: frozenset[str] = frozenset(TrainConfig.model_fields)
# The keys tasks add of their own (study/tasks: `Task.options`), each owned by one task.
OPTION_KEYS: dict[str, str] = {key: name for name, task in TASKS.items() if task.options is not None
                               for key in task.options.model_fields}
HYPERPARAMETER_KEYS: frozenset[str] = TRAIN_KEYS | models.MODEL_KEYS | frozenset(OPTION_KEYS)


class Resources(StrictModel):
    workers: int = Field(1, ge=1, description="data-parallel Ray Train workers")
    cpus_per_worker: float = Field(1.0, gt=0, description="CPUs each worker holds (also its torch threads)")
    gpus_per_worker: float = Field(0.0, ge=0, description="GPUs each worker holds (fractions share one)")

    @property
    def threads(self) -> int:
        """Torch threads per worker: the CPUs it holds, at least one (recorded so re-runs use the same)."""
        return max(1, int(self.cpus_per_worker))


class StageSpec(StrictModel):
    """A later stage of every run: trained after the stage before it, from what that stage carries forward (its
    model, or the backbone it trained), under the run's one MLflow run, its metrics named `<stage>/<metric>`."""

    name: str = Field(pattern=r"^[A-Za-z][A-Za-z0-9_]*$", description="names its metrics, <name>/<metric>")
    task: str = Field(description="a registered task (study/tasks)")
    epochs: int = Field(ge=1, description="epochs of this stage")
    dataset: DatasetConfig | None = Field(None, description="its data (default: the run's)")
    hyperparameters: dict[str, Any] = Field(default_factory=dict, description="over the run's model and training "
                                                                               "keys: what this stage changes")
    geometry: GeometrySpec | None = Field(None, description="its geometry settings (default: the run's)")
    evaluate: Evaluations = Field(default_factory=list, description="benchmarks when the stage ends (language "
                                                                     "models)")

    @field_validator("task")
    @classmethod
    def _task(cls, name):
        return registered_task(name)

    def relative_to(self, base: Path) -> "StageSpec":
        """Its relative paths (data, evaluation task folders) read from `base`."""
        return self.model_copy(update={"dataset": self.dataset.relative_to(base) if self.dataset else None,
                                       "evaluate": [e.relative_to(base) for e in self.evaluate]})


class RunSpec(StrictModel):
    """One run: everything `lapstudy train` needs to repeat a trial."""

    task: str = Field(description=f"a registered task (study/tasks): {', '.join(TASKS)}")
    dataset: DatasetConfig = Field(description="the run's data (a `dataset:` mapping, below)")
    epochs: int = Field(ge=1, description="epochs of the run (its first stage)")
    seed: int = Field(0, description="the run's seed: weights, data order and augmentation")
    hyperparameters: dict[str, Any] = Field(description="the flat config: model, training and task keys")
    geometry: GeometrySpec = Field(GeometrySpec(), description="token-geometry settings")
    resources: Resources = Field(Resources(), description="Ray Train workers and what each holds")
    stages: list[StageSpec] = Field(default_factory=list, description="what the run trains after this, in order")
    evaluate: Evaluations = Field(default_factory=list, description="benchmarks when its first stage ends "
                                                                     "(language models)")
    provenance: dict[str, Any] = Field(default_factory=dict, description="where the run came from (study, trial...)")

    @field_validator("task")
    @classmethod
    def _task(cls, name):
        return registered_task(name)

    @model_validator(mode="after")
    def _check(self):
        check_data_kind(self.task, self.dataset, "dataset")
        check_hyperparameter_names(self.hyperparameters, "hyperparameters")
        check_loss(self.hyperparameters.get("loss", "ce"), self.task, self.dataset, "hyperparameters.loss")
        check_stages(self.stages)
        check_evaluation(self.task, self.evaluate, "evaluate")
        for i, stage in enumerate(self.stages):
            check_data_kind(stage.task, stage.dataset or self.dataset, f"stages[{i}].dataset")
            check_hyperparameter_names(stage.hyperparameters, f"stages[{i}].hyperparameters")
        return self

    @property
    def total_epochs(self) -> int:
        """Epochs of every stage: the last epoch number a run reports."""
        return self.epochs + sum(stage.epochs for stage in self.stages)

    def stage_runs(self) -> list[tuple[str | None, int, "RunSpec"]]:
        """(name, epochs before it, what it trains) of every stage in order; the first is this run itself (name
        None). A later stage keeps the run's model and training keys under its own, except the model keys its
        task lets its data set anew (`Task.data_sets`)."""
        runs = [(None, 0, self.model_copy(update={"stages": []}))]
        offset = self.epochs
        for stage in self.stages:
            # the run's training keys that the stage reads (another optimiser's are not its settings)
            merged = {k: v for k, v in {**self.hyperparameters, **stage.hyperparameters}.items() if k in TRAIN_KEYS}
            training = TrainConfig.model_construct(**merged).read_keys(stage.task)
            kept = {k: v for k, v in self.hyperparameters.items()
                    if (k in models.MODEL_KEYS or k in training) and k not in task_class(stage.task).data_sets}
            runs.append((stage.name, offset, self.model_copy(update={
                "task": stage.task, "epochs": stage.epochs, "dataset": stage.dataset or self.dataset,
                "hyperparameters": {**kept, **stage.hyperparameters}, "geometry": stage.geometry or self.geometry,
                "evaluate": stage.evaluate, "stages": []})))
            offset += stage.epochs
        return runs

    def with_tokenizer_file(self, path: str | None) -> "RunSpec":
        """This run with the BPE its first stage trained (nanochat's, at `path`) named in every dataset that reads
        nanochat's tokenizer without a file: its later stages, `lapstudy eval` and a re-run then read that BPE."""
        if not path:
            return self

        def pinned(dataset):
            if getattr(dataset, "tokenizer", None) == "nanochat" and not dataset.tokenizer_file:
                return dataset.model_copy(update={"tokenizer_file": path})
            return dataset

        return self.model_copy(update={"dataset": pinned(self.dataset), "stages": [
            stage.model_copy(update={"dataset": pinned(stage.dataset)}) if stage.dataset else stage
            for stage in self.stages]})

    @property
    def resolved(self) -> Resolved:
        """Its hyperparameters resolved (`resolve`, cached: the resolution they came from, when they did)."""
        return resolve(self.hyperparameters, self.task, {}, epochs=self.epochs)

    @property
    def train(self) -> TrainConfig:
        return self.resolved.train

    @property
    def model_config_flat(self) -> dict:
        return dict(self.resolved.model)

    def document(self) -> dict:
        """The run as a YAML-ready document (what config.yaml, trials/<id>.yaml and `lapstudy export` hold)."""
        return self.model_dump(mode="json")


# Model keys whose validity depends on the data (the data fixes them, or they are checked against one it fixes):
# a check made before the data is opened leaves them to the full check after.
DATA_SHAPED_KEYS = frozenset({"image_size", "patch_size", "in_chans", "num_classes", "vocab_size", "context_length"})


def check_stages(stages: list[StageSpec]) -> None:
    names = [stage.name for stage in stages]
    if len(set(names)) != len(names):
        raise ValueError(f"stages: each stage name once, got {names}")
    for i, stage in enumerate(stages):
        check_evaluation(stage.task, stage.evaluate, f"stages[{i}].evaluate")


def load_run_spec(path: Path) -> RunSpec:
    """A run config file (exported by a study, or written by hand); its relative paths read from its folder."""
    data = load_yaml(path, "run config")
    if not isinstance(data, dict):
        raise UserError(f"run config {path}: must be a mapping (task, dataset, epochs, seed, hyperparameters, ...)")
    spec = validate(RunSpec, data, prefix=f"run config {path}: ")
    return spec.model_copy(update={"dataset": spec.dataset.relative_to(path.parent),
                                   "evaluate": [e.relative_to(path.parent) for e in spec.evaluate],
                                   "stages": [stage.relative_to(path.parent) for stage in spec.stages]})


def check_data_kind(task: str, dataset, where: str) -> None:
    """The dataset gives what the task reads (images, text, ...)."""
    kind = task_class(task).data_kind
    if dataset.kind != kind:
        readers = [name for name, t in TASKS.items() if t.data_kind == dataset.kind]
        raise ValueError(f"{where}: source {dataset.source!r} gives {dataset.kind}, but task {task} reads {kind} "
                         f"(tasks that read {dataset.kind}: {', '.join(readers) or 'none'})")


def check_loss(loss, task: str, dataset, where: str) -> None:
    """bce is a classification loss, and with label smoothing every target would be positive."""
    if loss != "bce":
        return
    if task != "classification":
        raise ValueError(f"{where}: bce is a classification loss; {task} trains with ce")
    if getattr(dataset, "label_smoothing", 0) > 0:
        raise ValueError(f"{where}: bce needs dataset.label_smoothing 0 (smoothed targets are all > 0; DeiT III "
                         f"trains bce with --smoothing 0.0), got {dataset.label_smoothing}")


def model_part(hyperparameters: dict) -> dict:
    return {k: v for k, v in hyperparameters.items() if k in models.MODEL_KEYS}


def train_config(hyperparameters: dict, where: str = "hyperparameters") -> TrainConfig:
    return validate(TrainConfig, {k: v for k, v in hyperparameters.items() if k in TRAIN_KEYS}, prefix=f"{where}.")


def task_options(hyperparameters: dict, task: str, where: str = "hyperparameters") -> BaseModel | None:
    """The task's own keys of `hyperparameters`, checked, with their defaults (None: the task has none); UserError
    for another task's key."""
    owner = task_class(task)
    for key in hyperparameters:
        if key in OPTION_KEYS and OPTION_KEYS[key] != task:
            raise UserError(f"{where}.{key}: is a key of task {OPTION_KEYS[key]}, not of {task}", field=key)
    if owner.options is None:
        return None
    return validate(owner.options, owner.option_values(hyperparameters), prefix=f"{where}.")


def check_hyperparameter_names(names, where: str) -> None:
    for name in names:
        if renamed_key_problem(name):
            raise UserError(f"{where}.{name}: {renamed_key_problem(name)}", field=name)
        if name not in HYPERPARAMETER_KEYS:
            tasks = f"; task keys {', '.join(sorted(OPTION_KEYS))}" if OPTION_KEYS else ""
            raise UserError(
                f"{where}.{name}: is not a hyperparameter; allowed: model keys "
                f"{', '.join(sorted(models.MODEL_KEYS))} (docs/config.md), training keys "
                f"{', '.join(sorted(TRAIN_KEYS))}{tasks}"
            )


def apply_data_overrides(hyperparameters: dict, overrides: dict, where: str = "hyperparameters") -> dict:
    """The model keys the data fixes (num_classes, image_size, ...) win; a space that sets them differently is wrong."""
    for key, value in overrides.items():
        if key in hyperparameters and hyperparameters[key] != value:
            raise UserError(
                f"{where}.{key}: the dataset fixes it to {value!r}, got {hyperparameters[key]!r} "
                "(change the dataset's options instead, or leave the key out)"
            )
    return {**hyperparameters, **overrides}


def check_run_config(hyperparameters: dict, task: str, where: str = "hyperparameters", *,
                     before_data: bool = False) -> dict | None:
    """Validate a complete set of hyperparameters (model and training); returns the model config with its preset
    expanded (what the model is built from). Raises UserError naming the field. `before_data=True` is the check
    made before the data is opened: a problem with a key the data shapes (DATA_SHAPED_KEYS) waits for the full
    check after, and None is returned."""
    try:
        return _validated(hyperparameters, task, where).model
    except UserError as exc:
        if before_data and exc.field in DATA_SHAPED_KEYS:
            return None
        raise


@dataclass(frozen=True)
class Resolved:
    """One stage's flat hyperparameters resolved: each part validated once (the cached result of `resolve`; read
    it, never change it)."""

    task: str
    model: dict  # the flat model config: every key the model reads (TransformerConfig.read_values), preset expanded
    config: models.TransformerConfig  # what `model` builds (models.build_config): each layer's mixer and heads
    train: TrainConfig  # the training keys with their defaults (steps_per_epoch derived from param_data_ratio)
    options: BaseModel | None  # the task's own keys with their defaults (`Task.options`; None: it has none)

    @property
    def hyperparameters(self) -> dict:
        """Every hyperparameter the run reads, explicitly, flat: what MLflow records and `lapstudy export` writes.
        Left out: the model keys its family and mixers do not read (TransformerConfig.read_keys) and the training
        keys its optimiser, schedule and task do not (TrainConfig.read_keys); those are defaults (a set one is
        refused), so a re-run of the rest is the same run."""
        complete = {**self.model, **self.train.model_dump(), **(self.options.model_dump() if self.options else {})}
        read = self.config.read_keys | self.train.read_keys(self.task)
        return {k: v for k, v in complete.items() if k in read or k in OPTION_KEYS}


def _validated(hyperparameters: dict, task: str, where: str) -> Resolved:
    """The training keys, the task's keys and the model config of `hyperparameters`, each validated once; the model
    fits the task (steps_per_epoch is not derived yet)."""
    train = train_config(hyperparameters, where)
    train.check_set_keys_read(task, where)
    options = task_options(hyperparameters, task, where)
    family = task_class(task).model_family
    flat = model_part(hyperparameters)
    if "model" not in flat and "preset" not in flat:
        flat = {"model": family, **flat}
    try:
        expanded = models.resolve_config(flat)
        config = models.config_from_resolved(expanded)
    except models.ConfigError as exc:
        raise UserError(f"{where}.{exc.field}: {str(exc).removeprefix(exc.field + ': ')}", field=exc.field) from None
    if train.optimizer == "nanochat" and family != "gpt":
        raise UserError(f"{where}.optimizer: nanochat splits a GPT's parameters (Muon for the blocks, AdamW for "
                        f"embedding and head); task {task} trains {family!r}: use adamw, lamb or sgd",
                        field="optimizer")
    if expanded["model"] != family:
        raise UserError(
            f"{where}.model: task {task} trains model {family!r}, got {expanded['model']!r}",
            field="model",
        )
    model = {"model": family, "preset": expanded["preset"], **config.read_values()}
    return Resolved(task, model, config, train, options)


# Resolutions by (hyperparameters, data overrides, task, epochs), each also under its own complete hyperparameters:
# a run built from a resolution and read again (RunSpec.resolved) finds it instead of validating anew.
_RESOLVED: dict[tuple, Resolved] = {}
_RESOLVED_KEPT = 256


def _resolution_key(hyperparameters: dict, data_overrides: dict, task: str, epochs: int) -> tuple:
    return *(json.dumps(d, sort_keys=True, default=repr) for d in (hyperparameters, data_overrides)), task, epochs


def resolve(hyperparameters: dict, task: str, data_overrides: dict, *, epochs: int,
            where: str = "hyperparameters") -> Resolved:
    """Every hyperparameter a stage of `epochs` epochs uses, explicitly: the data's model keys applied, the model
    preset expanded, the training defaults filled in and steps_per_epoch derived from param_data_ratio. Training
    keys, task keys and model config are each validated once per process; a resolution's own complete
    hyperparameters resolve to it without a second validation."""
    key = _resolution_key(hyperparameters, data_overrides, task, epochs)
    if key in _RESOLVED:
        return _RESOLVED[key]
    resolved = _validated(apply_data_overrides(hyperparameters, data_overrides, where), task, where)
    if resolved.train.param_data_ratio is not None:
        steps = ratio_steps_per_epoch(resolved, epochs, where)
        resolved = dataclasses.replace(resolved, train=resolved.train.model_copy(update={"steps_per_epoch": steps}))
    if len(_RESOLVED) >= _RESOLVED_KEPT:
        _RESOLVED.clear()
    _RESOLVED[key] = _RESOLVED[_resolution_key(resolved.hyperparameters, {}, task, epochs)] = resolved
    return resolved


def complete_hyperparameters(hyperparameters: dict, data_overrides: dict, task: str, where: str = "hyperparameters",
                             *, epochs: int) -> dict:
    """`resolve`'s hyperparameters, all of them flat: what MLflow records and `lapstudy export` writes."""
    return resolve(hyperparameters, task, data_overrides, epochs=epochs, where=where).hyperparameters


def ratio_steps_per_epoch(resolved: Resolved, epochs: int, where: str = "hyperparameters") -> int:
    """nanochat base_train's horizon: num_iterations = target_param_data_ratio x num_params // total_batch_size,
    num_params counted on the model this config builds, total_batch_size = batch_size x context_length tokens; the
    steps split evenly over the epochs."""
    model_config, training = resolved.model, resolved.train.model_dump()
    if "context_length" not in model_config:
        raise UserError(f"{where}.param_data_ratio: counts tokens per step (batch_size x context_length), for "
                        f"language models; model {model_config['model']!r} has no context_length",
                        field="param_data_ratio")
    num_params = models.count_parameters(models.build_model(resolved.config, device="meta"))
    tokens_per_step = training["batch_size"] * model_config["context_length"]
    total = int(training["param_data_ratio"] * num_params) // tokens_per_step
    if total < epochs or total % epochs:
        raise UserError(f"{where}.param_data_ratio: {training['param_data_ratio']} x {num_params:,} parameters // "
                        f"{tokens_per_step:,} tokens per step = {total:,} steps, which {epochs} epochs do not split "
                        f"evenly; choose epochs that divide {total:,}", field="param_data_ratio")
    given = training["steps_per_epoch"]
    if given is not None and given != total // epochs:
        raise UserError(f"{where}.steps_per_epoch: param_data_ratio {training['param_data_ratio']} gives "
                        f"{total // epochs:,} steps per epoch ({total:,} over {epochs} epochs), got {given:,}; leave "
                        f"steps_per_epoch out, or set param_data_ratio: null", field="steps_per_epoch")
    return total // epochs


def slow_lr_scale(resolved: Resolved) -> float:
    """Learning-rate factor of the mixers' slow parameters (STLT sigma/omega: `stlt_lr_scale`)."""
    if "stlt" in resolved.config.mixer_kinds:
        return stlt_config(resolved.model).stlt_lr_scale
    return 1.0
