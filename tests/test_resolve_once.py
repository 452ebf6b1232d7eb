"""A trial's hyperparameters are resolved once per stage, and `k` reaches the attention heads along one path.

In process, without Ray: a shipped space's sampled values resolved as study/trial.py's trial driver resolves them,
then a stage set up as the trainer (`plan_run`) and the Train loop set it up (its model, task and optimiser).
"""

from __future__ import annotations

import os
import sys
from dataclasses import MISSING, fields
from pathlib import Path

import pytest
import torch

import models.build
from models.config import TransformerConfig
from models.vit import ViTConfig
from study import runspec
from study.optim import build_optimizer
from study.runspec import Resources, TrainConfig, complete_hyperparameters, resolve, slow_lr_scale
from study.space import load_space
from study.tasks import GeometrySpec, task_class
from study.trial import plan_run
from study.worker import Worker

REPO = Path(__file__).resolve().parent.parent
SPACES = REPO / "search_spaces"
K = 3  # Laplacian heads per layer, of the quickstart's 4


class Data:
    """What the trainer's sizing reads of a task's data: the rows each worker trains on, and the model keys the
    data fixes (the digits source's, the toy translation's: study/data)."""

    def __init__(self, model_overrides: dict, num_train: int):
        self.model_overrides, self.num_train = model_overrides, num_train

    def train_rows_per_worker(self, workers: int) -> int:
        return self.num_train // workers


CASES = {
    "quickstart": ({"lr": 3e-3, "laplacian_schedule": "uniform", "k": K}, Data({"num_classes": 10, "image_size": 8,
                                                                       "in_chans": 1}, 1437)),
    "translation_toy": ({"lr": 2e-3, "mixer": "attention"}, Data({"vocab_size": 640, "pad_id": 0,
                                                                   "context_length": 64}, 2000)),
}


@pytest.fixture(autouse=True)
def no_earlier_resolutions(monkeypatch):
    """Every test starts from an empty cache: a resolution another test left would count as none here."""
    monkeypatch.setattr(runspec, "_RESOLVED", {})


def resolved_trial(space, sampled: dict, data: Data):
    """The trial's run config, as the trial driver makes it from its sampled values."""
    hyperparameters = complete_hyperparameters(space.resolve(sampled), data.model_overrides, space.task,
                                               epochs=space.epochs)
    return space.run_spec(hyperparameters, Resources())


def set_up_stage(spec, data: Data) -> None:
    """What a stage's trainer and Train loop read of the resolution before the first step."""
    plan_run(spec, data)
    resolved = spec.resolved
    model = task_class(spec.task).build_model(resolved, None)
    build_optimizer(model, spec.train, slow_lr_scale(resolved))
    task_class(spec.task)(model, Worker(0, 1, torch.device("cpu")), seed=spec.seed, geometry=GeometrySpec(),
                          resolved=resolved)
    assert spec.train.batch_size and spec.model_config_flat["model"]


class Counting:
    """Stands in for a pydantic model's validator and counts the validations (construction or model_validate)."""

    def __init__(self, validator):
        self.validator, self.count = validator, 0

    def __getattr__(self, name):
        return getattr(self.validator, name)

    def validate_python(self, *args, **kwargs):
        self.count += 1
        return self.validator.validate_python(*args, **kwargs)


@pytest.mark.parametrize("name", CASES)
def test_a_stage_validates_its_training_task_and_model_keys_once(name, monkeypatch):
    space = load_space(SPACES / f"{name}.yaml")
    sampled, data = CASES[name]
    options_model = task_class(space.task).options
    train = Counting(TrainConfig.__pydantic_validator__)
    monkeypatch.setattr(TrainConfig, "__pydantic_validator__", train)
    options = None
    if options_model is not None:
        options = Counting(options_model.__pydantic_validator__)
        monkeypatch.setattr(options_model, "__pydantic_validator__", options)
    counts = {"resolve_config": 0, "model config": 0}

    def counted(key, function):
        def wrapper(*args, **kwargs):
            counts[key] += 1
            return function(*args, **kwargs)
        return wrapper

    monkeypatch.setattr(models.build, "resolve_config", counted("resolve_config", models.build.resolve_config))
    # Every check of a model config is made where its dataclass is built (each family's __post_init__ calls it).
    monkeypatch.setattr(TransformerConfig, "__post_init__", counted("model config", TransformerConfig.__post_init__))

    spec = resolved_trial(space, sampled, data)
    for _ in range(3):  # read as often as the trainer and the loop read it: nothing is validated again
        set_up_stage(spec, data)
    again = resolved_trial(space, sampled, data)  # a retried trial resolves the same values

    assert again == spec
    assert train.count == 1
    assert (options.count if options else 0) == (1 if options_model else 0)
    assert counts == {"resolve_config": 1, "model config": 1}


def test_the_resolution_writes_every_key_out_and_is_what_the_run_reads_back():
    """What MLflow records and `lapstudy export` writes: every key the run reads explicit, the preset expanded, the
    data's keys."""
    space = load_space(SPACES / "quickstart.yaml")
    sampled, data = CASES["quickstart"]
    spec = resolved_trial(space, sampled, data)
    preset = models.build.PRESETS["vit_tiny_digits"]
    train = TrainConfig(lr=3e-3, batch_size=64, weight_decay=0.05, warmup_epochs=1)
    # the ViT's fields with their defaults (a uniform schedule's only), under the preset's, the sampled and the data's
    vit_defaults = {f.name: f.default for f in fields(ViTConfig)
                    if f.default is not MISSING and f.name not in ("start_layer", "increment", "max_count",
                                                                   "k_per_layer")}
    expected = {**vit_defaults, **preset, "preset": "vit_tiny_digits", "laplacian_schedule": "uniform", "k": K,
                **data.model_overrides,
                **{k: v for k, v in train.model_dump().items() if k in train.read_keys("classification")}}
    assert spec.hyperparameters == expected
    assert {"mlp_ratio", "drop_path", "qkv_bias", "layer_scale_init", "norm_eps", "pool"} <= set(expected)
    assert spec.model_config_flat == {key: expected[key] for key in models.build.model_keys() if key in expected}
    resolved = resolve(spec.hyperparameters, spec.task, {}, epochs=spec.epochs)
    assert resolved is spec.resolved and resolved.config.laplacian_counts == [K] * preset["depth"]


class KPath:
    """The project files `k`'s value enters, in order: a call into a project function, from another file, with an
    argument that carries the value (a mapping's "k", an object's `k` or `laplacian_heads`, or an argument of those
    names), up to the first entry into `until`. A file entered again after it was left (no frame of it on the
    stack any more) is a file twice."""

    def __init__(self, value: int, until: str = "models/attention.py"):
        self.value, self.until, self.files, self.twice, self.active = value, until, [], [], {}

    def carries(self, value, names=()) -> bool:
        if isinstance(value, dict):
            return type(value.get("k")) is int and value["k"] == self.value
        if isinstance(value, int) and not isinstance(value, bool):
            return value == self.value and bool({"k", "laplacian_heads"} & set(names))
        if isinstance(value, type) or isinstance(value, torch.Tensor):
            return False
        own = vars(value) if hasattr(value, "__dict__") else {}
        return (type(own.get("k")) is int and own["k"] == self.value) or own.get("laplacian_heads") == self.value \
            or any(self.carries(v) for v in own.values() if isinstance(v, dict))

    def _project(self, frame) -> str | None:
        path = frame.f_code.co_filename
        if not path.startswith(str(REPO)) or f"{os.sep}tests{os.sep}" in path or ".venv" in path:
            return None
        return os.path.relpath(path, REPO)

    def profile(self, frame, event, arg):
        file = self._project(frame)
        if file is None or event not in ("call", "return") or self.until in self.files:
            return
        if event == "return":
            self.active[file] -= 1
            return
        self.active[file] = self.active.get(file, 0) + 1
        caller = frame.f_back and self._project(frame.f_back)
        if caller == file:
            return
        code = frame.f_code
        names = code.co_varnames[:code.co_argcount + code.co_kwonlyargcount]
        if not any(self.carries(frame.f_locals.get(name), (name,)) for name in names):
            return
        if file in self.files and self.active[file] == 1 and self.files[-1] != file:
            self.twice.append(file)
        if not self.files or self.files[-1] != file:
            self.files.append(file)

    def __enter__(self):
        sys.setprofile(self.profile)
        return self

    def __exit__(self, *exc):
        sys.setprofile(None)


def test_k_goes_from_the_space_to_the_attention_heads_through_few_files_each_once():
    """Two descents: the trial's resolution (the space's sampled values to a validated model config, whose
    Laplacian-head schedule is fixed there) and the stage's model built from that resolution down to its attention
    layers. Together they enter at most 8 project files, neither enters a file twice, and the second resolves
    nothing again."""
    space = load_space(SPACES / "quickstart.yaml")
    sampled, data = CASES["quickstart"]
    with KPath(K) as resolution:
        hyperparameters = complete_hyperparameters(space.resolve(sampled), data.model_overrides, space.task,
                                                   epochs=space.epochs)
    spec = space.run_spec(hyperparameters, Resources())
    with KPath(K) as build:
        model = task_class(spec.task).build_model(spec.resolved, None)

    assert resolution.files[:2] == ["study/space.py", "study/runspec.py"]
    assert resolution.files[-1] == "models/config.py"  # k becomes each layer's count of Laplacian heads there
    # The loop reads the trial's resolution: no model config is built or checked again on the way down.
    assert build.files[-1] == "models/attention.py" and "models/config.py" not in build.files
    assert len(set(resolution.files) | set(build.files)) <= 8, (resolution.files, build.files)
    assert not resolution.twice and not build.twice, (resolution.twice, build.twice)
    assert [block.mixer.laplacian_heads for block in model.blocks] == [K] * len(model.blocks)
