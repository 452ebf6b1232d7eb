"""What a run records (MLflow params, trials/<id>.yaml, `lapstudy export`): the keys it reads, defaults included, and
none of another optimiser's, schedule's, task's or model's. "Reads" is found here by running the optimiser and
schedule builders on a TrainConfig that notes every attribute they touch, not from the rule under test."""

from __future__ import annotations

from dataclasses import MISSING, fields
from pathlib import Path

import pytest
import yaml

import models
from models.vit import ViTConfig
from study.errors import UserError
from study.optim import build_optimizer, build_schedule
from study.runspec import (
    TRAIN_KEYS,
    Resources,
    complete_hyperparameters,
    load_run_spec,
    model_part,
    train_config,
)
from study.space import load_space, parse_space
from study.space_corners import check_configs, corner_configs
from study.tasks import TASKS
from study.yamlio import dump_yaml

REPO = Path(__file__).resolve().parents[1]
DIGITS = {"num_classes": 10, "image_size": 8, "in_chans": 1}  # what the digits source fixes
NANOCHAT_ONLY = {"matrix_lr", "embedding_lr", "unembedding_lr", "warmdown_ratio", "muon_momentum_warmup"}
DINO_KEYS = {key for key in TASKS["dino"].options.model_fields} | {"local_crops", "local_size", "global_crop_scale",
                                                                    "local_crop_scale"}
# What the training loop reads of every run beside the optimiser and schedule: the per-worker batch and steps
# (study/trainer.py plan_run), the autocast and the clipping (study/loop.py StepSettings).
LOOP_KEYS = {"batch_size", "steps_per_epoch", "precision", "grad_clip"}


class NotingReads:
    """A TrainConfig that notes the names of the attributes read from it."""

    def __init__(self, train):
        self._train, self.read = train, set()

    def __getattr__(self, name):
        self.read.add(name)
        return getattr(self._train, name)


def optimiser_and_schedule_reads(hyperparameters: dict) -> set[str]:
    """The training keys study/optim.py reads to build this run's optimiser and learning-rate schedule."""
    train = NotingReads(train_config(hyperparameters))
    model_config = model_part(hyperparameters)
    # the slow parameters' factor changes their learning rate, not which training keys are read
    optimizer = build_optimizer(models.build_model(model_config), train, slow_scale=1.0)
    build_schedule(optimizer, train, steps_per_epoch=10, epochs=2)
    return train.read


def recorded_training_keys(hyperparameters: dict) -> set[str]:
    return set(hyperparameters) & TRAIN_KEYS


def quickstart_configs() -> list[dict]:
    space = load_space(REPO / "search_spaces" / "quickstart.yaml")
    return [complete_hyperparameters(space.resolve(sampled), DIGITS, space.task, epochs=space.epochs)
            for sampled, _ in corner_configs(space)]


def test_a_quickstart_trial_records_what_its_adamw_and_cosine_read_and_no_other_optimiser_or_task():
    configs = quickstart_configs()
    assert len(configs) >= 2
    for hyperparameters in configs:
        assert not NANOCHAT_ONLY & set(hyperparameters), sorted(hyperparameters)
        assert not DINO_KEYS & set(hyperparameters)
        assert not [key for key in hyperparameters if key.startswith("stlt_")]
        assert "param_data_ratio" not in hyperparameters  # unset: the run's steps are its data's
        # every key the optimiser and schedule read, the loop's, and the classification loss; nothing else
        assert recorded_training_keys(hyperparameters) == (optimiser_and_schedule_reads(hyperparameters) | LOOP_KEYS
                                                           | {"loss"})
        assert {"lr", "beta1", "beta2", "eps", "weight_decay", "min_lr_ratio", "warmup_epochs"} <= set(hyperparameters)
        assert hyperparameters["warmup_epochs"] == 1 and hyperparameters["beta2"] == 0.999  # set, and a default


@pytest.mark.parametrize("optimizer,lr_decay", [("adamw", "inverse_sqrt"), ("lamb", "cosine"), ("sgd", "cosine"),
                                                ("sgd", "inverse_sqrt")])
def test_each_vit_optimiser_and_schedule_records_exactly_what_it_reads(optimizer, lr_decay):
    hyperparameters = complete_hyperparameters({"preset": "vit_tiny_digits", "optimizer": optimizer,
                                                "lr_decay": lr_decay, "warmup_epochs": 1}, DIGITS, "classification",
                                               epochs=2)
    reads = optimiser_and_schedule_reads(hyperparameters)
    assert recorded_training_keys(hyperparameters) == reads | LOOP_KEYS | {"loss"}
    assert ("beta2" in hyperparameters) is (optimizer != "sgd")
    assert ("min_lr_ratio" in hyperparameters) is (lr_decay == "cosine")


def test_a_nanochat_gpt_records_its_learning_rates_and_warm_down_not_adamws():
    hyperparameters = complete_hyperparameters({"preset": "gpt_tiny", "block_style": "nanochat",
                                                "optimizer": "nanochat", "param_data_ratio": 2},
                                               {}, "language_modeling", epochs=1)
    reads = optimiser_and_schedule_reads(hyperparameters)
    assert NANOCHAT_ONLY <= reads and not {"lr", "beta1", "beta2", "eps", "lr_decay"} & reads
    assert recorded_training_keys(hyperparameters) == reads | LOOP_KEYS | {"param_data_ratio"}
    assert "loss" not in hyperparameters and "patch_size" not in hyperparameters
    assert hyperparameters["steps_per_epoch"] > 0  # derived from param_data_ratio, and recorded


def test_dino_records_the_keys_of_its_own_schedule_not_the_runs():
    space = load_space(REPO / "search_spaces" / "dino_digits.yaml")
    [(sampled, _), *_] = corner_configs(space)
    hyperparameters = complete_hyperparameters(space.resolve(sampled), DIGITS, space.task, epochs=space.epochs)
    assert {"lr", "min_lr_ratio", "warmup_epochs", "weight_decay", "dino_out_dim"} <= set(hyperparameters)
    assert "lr_decay" not in hyperparameters and "loss" not in hyperparameters  # DINO's cosine; no labels
    assert "probe_blocks" not in hyperparameters  # the linear stage's key, not this task's


def test_an_attention_vit_records_no_stlt_key_and_an_stlt_one_all_of_them():
    attention = complete_hyperparameters({"preset": "vit_tiny_digits"}, DIGITS, "classification", epochs=1)
    stlt = complete_hyperparameters({"preset": "vit_tiny_digits", "mixer": "stlt"}, DIGITS, "classification",
                                    epochs=1)
    stlt_keys = {key for key in models.MODEL_KEYS if key.startswith("stlt_")}
    assert not stlt_keys & set(attention) and stlt_keys <= set(stlt)


def test_an_exported_config_reruns_to_the_same_complete_hyperparameters(tmp_path):
    """What `lapstudy train` resolves from the shorter export equals what the trial trained with, and the keys left
    out were defaults: the full training config is the one the trial's own settings give."""
    space = load_space(REPO / "search_spaces" / "quickstart.yaml")
    for sampled, _ in corner_configs(space):
        resolved = space.resolve(sampled)
        complete = complete_hyperparameters(resolved, DIGITS, space.task, epochs=space.epochs)
        path = tmp_path / "exported.yaml"
        path.write_text(dump_yaml(space.run_spec(complete, Resources(), seed=3).document()))
        spec = load_run_spec(path)
        assert complete_hyperparameters(spec.hyperparameters, DIGITS, spec.task, epochs=spec.epochs) == complete
        assert spec.train == train_config(resolved)
        assert (models.build_config(model_part(complete)).read_values()
                == models.build_config(model_part({**resolved, **DIGITS})).read_values())


def _quickstart_with(**fixed) -> dict:
    data = yaml.safe_load((REPO / "search_spaces" / "quickstart.yaml").read_text())
    data["fixed"].update(fixed)
    return data


def test_a_set_key_the_run_does_not_read_is_refused_naming_what_reads_it():
    with pytest.raises(UserError, match=r"fixed.matrix_lr: is read with optimizer nanochat, not adamw"):
        check_configs(parse_space(_quickstart_with(matrix_lr=0.05)), DIGITS)
    with pytest.raises(UserError, match=r"fixed.beta2: is read with optimizer adamw or lamb, not sgd"):
        check_configs(parse_space(_quickstart_with(optimizer="sgd", beta2=0.99)), DIGITS)
    with pytest.raises(UserError, match=r"min_lr_ratio: is read with lr_decay cosine, not inverse_sqrt"):
        complete_hyperparameters({"preset": "vit_tiny_digits", "lr_decay": "inverse_sqrt", "warmup_epochs": 1,
                                  "min_lr_ratio": 0.1}, DIGITS, "classification", epochs=1)
    with pytest.raises(UserError, match=r"lr_decay: is read by task .*classification.*, not dino"):
        complete_hyperparameters({"preset": "vit_tiny_digits", "lr_decay": "inverse_sqrt", "warmup_epochs": 1},
                                 DIGITS, "dino", epochs=1)
    # a default changes nothing, so a config written with every key (as exports were) still runs
    space = parse_space(_quickstart_with(matrix_lr=0.02, param_data_ratio=None))
    assert check_configs(space, DIGITS) >= 2
    sampled = {"lr": 3e-3, "laplacian_schedule": "uniform", "k": 0}
    assert "matrix_lr" not in complete_hyperparameters(space.resolve(sampled), DIGITS, space.task, epochs=space.epochs)


def test_a_later_stage_keeps_only_the_training_keys_it_reads():
    """DINO pre-trains with AdamW at beta2 0.95; its linear probe trains with SGD, which has no beta2: the probe
    neither inherits it nor is refused for it."""
    data = yaml.safe_load((REPO / "search_spaces" / "dino_digits.yaml").read_text())
    data["fixed"]["beta2"] = 0.95
    space = parse_space(data)
    check_configs(space, DIGITS)
    run = space.run_spec(space.resolve({"k": 0}), Resources())
    (_, _, first), (_, _, linear), (_, _, segmentation) = run.stage_runs()
    assert first.hyperparameters["beta2"] == 0.95 and segmentation.hyperparameters["beta2"] == 0.95  # AdamW again
    assert "beta2" not in linear.hyperparameters and linear.hyperparameters["optimizer"] == "sgd"


def recorded_model(hyperparameters: dict, task: str, data: dict = DIGITS) -> dict:
    return model_part(complete_hyperparameters(hyperparameters, data, task, epochs=1))


def test_a_vit_records_its_defaults_and_only_its_own_schedule_kinds_keys():
    uniform = recorded_model({"preset": "vit_tiny_digits"}, "classification")
    defaults = {f.name: f.default for f in fields(ViTConfig) if f.default is not MISSING}
    for key in ("mlp_ratio", "qkv_bias", "drop_path", "pool", "layer_scale_init", "norm_eps", "class_pos_embed"):
        assert uniform[key] == defaults[key], key  # not in the preset: the dataclass's default
    assert uniform["k"] == 0 and not {"start_layer", "increment", "max_count", "k_per_layer"} & set(uniform)
    ramp = recorded_model({"preset": "vit_tiny_digits", "laplacian_schedule": "ramp", "start_layer": 1,
                           "increment": 1, "max_count": 2}, "classification")
    assert {"start_layer", "increment", "max_count"} <= set(ramp) and not {"k", "k_per_layer"} & set(ramp)
    # what was recorded builds the same model, and records itself again
    for recorded in (uniform, ramp):
        assert recorded_model(recorded, "classification") == recorded
        assert models.build_config(recorded).laplacian_counts == models.build_config(
            {key: recorded[key] for key in recorded if key not in defaults or recorded[key] != defaults[key]}
        ).laplacian_counts


def test_a_gpt_records_grouped_key_value_heads_only_in_nanochat_blocks():
    gpt2 = recorded_model({"preset": "gpt_tiny"}, "language_modeling", {})
    nanochat = recorded_model({"preset": "gpt_tiny", "block_style": "nanochat"}, "language_modeling", {})
    assert "num_kv_heads" not in gpt2 and gpt2["qkv_bias"] is False
    assert "num_kv_heads" in nanochat and "qkv_bias" not in nanochat  # nanochat's projections have no biases
    assert {"rope_base", "tie_embeddings", "block_style"} <= set(gpt2) & set(nanochat)


def test_a_translation_model_without_laplacian_sites_records_no_head_count():
    data = {"vocab_size": 640, "pad_id": 0, "context_length": 64}
    none = recorded_model({"laplacian_sites": "none"}, "translation", data)
    assert none["laplacian_schedule"] == "uniform" and "k" not in none
    assert recorded_model(none, "translation", data) == none
    both = recorded_model({}, "translation", data)
    assert both["k"] == 0 and both["decoder_depth"] == both["depth"]
