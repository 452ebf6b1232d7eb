"""What a run records of its data (trials/<id>.yaml, `lapstudy export`, MLflow's dataset input): the dataset fields
the run reads, defaults included, and none its settings leave unread. "Reads" is found here by running the image
pipeline's pieces (study/data/build.py `image_task`, the map functions it hands Ray Data, the worker's batch mixer)
on specs that note every attribute read from them, not from the rule under test (`read_fields`)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

import study.data.build as build
from study.data.config import DatasetConfig
from study.data.load import parse_dataset_config
from study.errors import UserError, validate
from study.runspec import Resources, complete_hyperparameters, load_run_spec
from study.space import load_space
from study.space_corners import corner_configs
from study.tracking.run_logger import dataset_input
from study.yamlio import dump_yaml

REPO = Path(__file__).resolve().parents[1]
DIGITS = {"num_classes": 10, "image_size": 8, "in_chans": 1}  # what the digits source fixes
MULTICROP = {"local_crops", "local_size", "global_crop_scale", "local_crop_scale"}
# The fields of an image source the pipeline's specs carry, under the names the specs give them.
SPEC_FIELDS = {"crop_scale": "crop_scale", "crop_ratio": "crop_ratio", "hflip": "hflip",
               "color_jitter": "color_jitter", "eval_crop_pct": "eval_crop_pct", "local_size": "local_size",
               "local_crops": "local_crops", "global_scale": "global_crop_scale", "local_scale": "local_crop_scale",
               "mean": "mean", "std": "std", "mixup": "mixup", "cutmix": "cutmix", "mix_prob": "mix_prob",
               "switch_prob": "switch_prob", "label_smoothing": "label_smoothing"}


def noting(cls, read: set):
    """`cls` (a frozen dataclass of the pipeline) noting the names of the attributes read from it."""
    def __getattribute__(self, name):
        read.add(name)
        return object.__getattribute__(self, name)

    return type(f"Noting{cls.__name__}", (cls,), {"__getattribute__": __getattribute__})


class Rows:
    """Stands in for a Ray dataset: keeps the map function and arguments `image_task` hands it."""

    def __init__(self):
        self.context = type("Context", (), {})()
        self.fn = self.kwargs = None

    def map_batches(self, fn, fn_kwargs, **_):
        mapped = Rows()
        mapped.fn, mapped.kwargs = fn, fn_kwargs
        return mapped


def pipeline_reads(config: dict, monkeypatch) -> set[str]:
    """The image source fields the training and evaluation transforms and the batch mixer read for `config`: one
    batch of 16x16 grey images through each, the specs noting what is read after `image_task` built them."""
    read: set[str] = set()
    for name in ("ImageSpec", "MultiCropSpec", "BatchMixer"):
        monkeypatch.setattr(build, name, noting(getattr(build, name), read))
    cfg = parse_dataset_config({"source": "digits", **config})
    task = build.image_task(cfg, Rows(), Rows(), seed=0, native_size=16, in_chans=1, num_classes=10,
                            image_column="image", label_column="label", num_train=4, num_val=4)
    read.clear()  # what image_task passes on is not yet read: what the pieces read of it is
    rng = np.random.default_rng(0)
    batch = {"image": rng.integers(0, 256, (4, 16, 16), dtype=np.uint8), "label": np.arange(4)}
    train, val = task.datasets["train"], task.datasets["val"]
    as_torch = lambda out: {k: torch.from_numpy(v) for k, v in out.items()}  # noqa: E731
    task.batch_steps(as_torch(train.fn(batch, **train.kwargs)), rng)
    task.batch_steps.evaluate(as_torch(val.fn(batch, **val.kwargs)))
    return {SPEC_FIELDS[name] for name in read if name in SPEC_FIELDS}


IMAGE_SETTINGS = [
    {"augment": augment, "mixup": mixup, "cutmix": cutmix}
    for augment in ("none", "basic", "three_augment") for mixup, cutmix in ((0.0, 0.0), (0.8, 0.0), (0.0, 1.0),
                                                                             (0.8, 1.0))
] + [{"augment": "dino_multicrop", "local_size": 8}]


@pytest.mark.parametrize("config", IMAGE_SETTINGS, ids=lambda c: "-".join(str(v) for v in c.values()))
def test_an_image_source_reads_what_its_augmentation_and_mixing_read(config, monkeypatch):
    cfg = parse_dataset_config({"source": "digits", **config})
    assert pipeline_reads(config, monkeypatch) == cfg.read_fields() & set(SPEC_FIELDS.values())


def test_a_digits_quickstart_trial_records_no_augmentation_it_does_not_run(tmp_path):
    space = load_space(REPO / "search_spaces" / "quickstart.yaml")
    sampled, _ = next(corner_configs(space))
    spec = space.run_spec(complete_hyperparameters(space.resolve(sampled), DIGITS, space.task, epochs=space.epochs),
                          Resources())
    recorded = spec.document()["dataset"]
    assert recorded["augment"] == "none"
    assert not (MULTICROP | {"crop_scale", "crop_ratio", "hflip", "color_jitter", "mix_prob", "switch_prob",
                             "repeated_aug"}) & set(recorded), sorted(recorded)
    assert {"mixup", "cutmix", "label_smoothing", "mean", "std", "eval_crop_pct", "split_seed"} <= set(recorded)
    path = tmp_path / "exported.yaml"
    path.write_text(dump_yaml(spec.document()))
    assert load_run_spec(path).dataset == spec.dataset  # the dropped fields were defaults: the same data again


ROUND_TRIPS = [
    {"source": "digits", "augment": "dino_multicrop", "local_crops": 4, "local_size": 4},
    {"source": "digits", "augment": "three_augment", "mixup": 0.8, "cutmix": 1.0, "switch_prob": 0.3},
    {"source": "hf", "name": "cifar100", "val_fraction": 0.1, "split_seed": 2},
    {"source": "parquet", "path": "/data/shards", "val_path": "/data/val"},
    {"source": "pydoc_text", "tokenizer": "nanochat", "bpe": {"vocab_size": 512}},
    {"source": "pydoc_text", "eval_contexts": [64, 256], "eval_stride": 32},
    {"source": "text_files", "path": "/data/text", "val_path": "/data/val"},
    {"source": "fineweb_edu", "tokenizer": "byte"},
    {"source": "ade20k", "augment": "none"},
    {"source": "toy_translation", "tokenizer_file": "/data/bpe.json"},
    {"source": "wmt14"},
    {"source": "chat", "train": [{"name": "smoltalk"}], "val": [{"name": "smoltalk", "split": "test"}]},
]


@pytest.mark.parametrize("config", ROUND_TRIPS, ids=lambda c: c["source"])
def test_a_recorded_dataset_validates_to_the_same_config_and_a_dump_of_every_field_still_loads(config):
    cfg = validate(DatasetConfig, config)
    recorded = cfg.model_dump(mode="json")
    assert set(recorded) == cfg.read_fields()
    assert validate(DatasetConfig, recorded) == cfg
    every_field = {name: getattr(cfg, name) for name in type(cfg).model_fields}  # as records were written before
    assert validate(DatasetConfig, every_field) == cfg
    # MLflow's dataset input: the same digest for the same data, however it was written
    assert dataset_input(validate(DatasetConfig, every_field)).dataset.digest == dataset_input(cfg).dataset.digest


def test_unread_fields_are_left_out_of_records_under_each_source():
    def recorded(config: dict) -> set[str]:
        return set(validate(DatasetConfig, config).model_dump(mode="json"))

    assert not {"crop_scale", "crop_ratio", "hflip"} & recorded({"source": "ade20k", "augment": "none"})
    assert not {"bpe", "tokenizer_file", "eval_stride"} & recorded({"source": "pydoc_text", "tokenizer": "byte"})
    assert not {"bpe", "eval_contexts", "eval_stride"} & recorded(ROUND_TRIPS[-1])
    assert not {"vocab_size"} & recorded({"source": "toy_translation", "tokenizer_file": "/data/bpe.json"})
    assert not {"split_seed", "val_fraction"} & recorded({"source": "parquet", "path": "/p", "val_path": "/v"})
    assert not {"val_split"} & recorded({"source": "hf", "name": "cifar100", "val_fraction": 0.1})
    assert not {"split_seed"} & recorded({"source": "wikitext103"})
    assert not MULTICROP & recorded({"source": "hf", "name": "cifar100", "augment": "three_augment"})


@pytest.mark.parametrize("config, message", [
    ({"source": "digits", "augment": "basic", "local_crops": 4},
     r"dataset: local_crops: is read only with augment: dino_multicrop \(here basic\); leave it out"),
    ({"source": "digits", "color_jitter": 0.4}, r"color_jitter: is read only with augment: three_augment \(here none"),
    ({"source": "digits", "mix_prob": 0.5}, r"mix_prob: is read only with mixup or cutmix > 0"),
    ({"source": "digits", "mixup": 0.8, "switch_prob": 0.2}, r"switch_prob: is read only with mixup and cutmix > 0"),
    ({"source": "digits", "augment": "dino_multicrop", "mixup": 0.8},
     r"mixup: is read only with augment: none or basic or three_augment \(here dino_multicrop\)"),
    ({"source": "pydoc_text", "eval_stride": 8}, r"eval_stride: is read only with eval_contexts"),
    ({"source": "wikitext103", "split_seed": 3}, r"split_seed: is not read by source wikitext103; leave it out"),
    ({"source": "parquet", "path": "/p", "val_path": "/v", "val_fraction": 0.3},
     r"val_fraction: is read only with no val_path \(here /v\)"),
])
def test_a_set_field_the_run_does_not_read_is_refused_naming_what_reads_it(config, message):
    with pytest.raises(UserError, match=message):
        validate(DatasetConfig, config, prefix="dataset")


def test_a_field_set_to_its_default_is_not_refused():
    cfg = validate(DatasetConfig, {"source": "digits", "local_crops": 8, "mix_prob": 1.0, "crop_scale": [0.08, 1]})
    assert cfg == validate(DatasetConfig, {"source": "digits"})


def test_the_rule_names_only_fields_of_its_source():
    for config in ROUND_TRIPS:
        cfg = validate(DatasetConfig, config)
        assert set(cfg.read_when()) <= set(type(cfg).model_fields), type(cfg).__name__
