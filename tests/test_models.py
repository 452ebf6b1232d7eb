import pytest
import torch

import models
from digits_training import train_on_digits
from models import ConfigError, build_model, count_parameters
from models.keys import RENAMED_MODEL_KEYS


def n_params(config):
    return count_parameters(build_model(config, device="meta"))


@pytest.mark.parametrize("preset", ["vit_tiny_digits", "vit_tiny", "vit_b16", "gpt_tiny", "gpt_d20"])
def test_parameter_count_is_identical_for_every_k_and_schedule(preset):
    heads = models.PRESETS[preset]["num_heads"]
    depth = models.PRESETS[preset]["depth"]
    baseline = n_params({"preset": preset})
    variants = [{"k": k} for k in range(heads + 1)] + [
        {"laplacian_schedule": "ramp", "start_layer": 1, "increment": 1, "max_count": heads},
        {"laplacian_schedule": "explicit", "k_per_layer": [layer % (heads + 1) for layer in range(depth)]},
    ]
    for variant in variants:
        assert n_params({"preset": preset, **variant}) == baseline, variant


def test_paper_sized_presets():
    # The paper's GPT: 20 layers, width 1280, 10 heads, vocabulary 65,536, untied: ~561M parameters.
    gpt = build_model({"preset": "gpt_d20"}, device="meta")
    assert gpt.lm_head.weight is not gpt.wte.weight
    assert 560e6 < count_parameters(gpt) < 562e6
    vit_b = build_model({"preset": "vit_b16"}, device="meta")
    assert 86e6 < count_parameters(vit_b) < 87e6  # ViT-B/16: 86.6M


def test_weight_tying_shares_the_embedding():
    tied = build_model({"preset": "gpt_tiny", "tie_embeddings": True})
    untied = build_model({"preset": "gpt_tiny"})
    assert tied.lm_head.weight is tied.wte.weight
    assert count_parameters(untied) - count_parameters(tied) == 257 * 64


def test_vit_returns_tokens_and_the_feature_its_classifier_reads():
    for pool in ("cls", "mean"):
        vit = build_model({"preset": "vit_tiny_digits", "k": 2, "pool": pool}).eval()
        out = vit(torch.randn(5, 1, 8, 8), return_features=True)
        assert out.tokens.shape == (5, 1 + 16, 64) and out.feature.shape == (5, 64)
        expected = out.tokens[:, 0] if pool == "cls" else out.tokens[:, 1:].mean(1)
        torch.testing.assert_close(out.feature, expected)
        torch.testing.assert_close(out.logits, out.feature @ vit.classifier_weight.T + vit.head.bias)
        # tokens come after the final norm: zero mean and unit variance per token before the affine part
        assert torch.allclose(out.tokens.mean(-1), vit.norm.bias.mean().expand(5, 17), atol=1e-5)


def test_gpt_is_causal_with_laplacian_heads():
    gpt = build_model({"preset": "gpt_tiny", "k": 2}).eval()
    idx = torch.randint(0, 257, (2, 20))
    changed = idx.clone()
    changed[:, 12:] = torch.randint(0, 257, (2, 8))
    with torch.no_grad():
        a, b = gpt(idx), gpt(changed)
    torch.testing.assert_close(a[:, :12], b[:, :12])
    assert not torch.allclose(a[:, 12:], b[:, 12:])
    out = gpt(idx, return_features=True)
    torch.testing.assert_close(out.logits, out.tokens @ gpt.classifier_weight.T)


@pytest.mark.parametrize(
    "config, field",
    [
        ({"model": "vit", "k": 5}, "k"),  # vit_tiny has 4 heads
        ({"preset": "vit_b16", "laplacian_schedule": "explicit", "k_per_layer": [1] * 13}, "k_per_layer"),
        ({"model": "vit", "patch_size": 5}, "patch_size"),
        ({"model": "vit", "num_heads": 5}, "num_heads"),
        ({"model": "vit", "drop_path": 1.0}, "drop_path"),
        ({"model": "vit", "pool": "max"}, "pool"),
        ({"model": "vit", "context_length": 64}, "context_length"),
        ({"model": "gpt", "lr": 0.1}, "lr"),
        ({"model": "gpt", "preset": "vit_b16"}, "preset"),
        ({"model": "transformer"}, "model"),
        ({"model": "gpt", "mixer": ["attention"] * 3}, "mixer"),
        ({"model": "gpt", "tie_embeddings": "yes"}, "tie_embeddings"),
    ],
)
def test_bad_configs_name_the_field(config, field):
    with pytest.raises(ConfigError) as info:
        build_model(config)
    assert info.value.field == field
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("config, new", [
    ({"model": "vit", "schedule": "ramp", "start_layer": 0, "increment": 1, "max_count": 2}, "laplacian_schedule"),
    ({"model": "gpt", "schedule": "uniform"}, "laplacian_schedule"),
    ({"model": "vit", "drop_path_schedule": "linear"}, "drop_path_by_depth"),
])
def test_a_renamed_key_is_refused_naming_the_new_one(config, new):
    old = next(key for key in config if key in RENAMED_MODEL_KEYS)
    with pytest.raises(ConfigError) as info:
        build_model(config, device="meta")
    assert info.value.field == old and str(info.value).startswith(f"{old}: renamed {new} (")
    build_model({**{k: v for k, v in config.items() if k != old}, new: config[old]}, device="meta")  # the new one works


def test_preset_alone_picks_the_family_and_resolves():
    resolved = models.resolve_config({"preset": "gpt_d20", "k": 3})
    assert resolved["model"] == "gpt" and resolved["dim"] == 1280 and resolved["k"] == 3
    assert set(resolved) <= models.MODEL_KEYS


def test_param_groups_cover_every_parameter_once():
    vit = build_model({"preset": "vit_tiny_digits"})
    groups = vit.param_groups(weight_decay=0.05)
    ids = [id(p) for g in groups for p in g["params"]]
    assert len(ids) == len(set(ids)) == len(list(vit.parameters()))
    decayed = {id(p) for g in groups if g["weight_decay"] > 0 for p in g["params"]}
    assert id(vit.pos_embed) not in decayed and id(vit.head.weight) in decayed
    assert vit.regularization_loss().item() == 0.0 and vit.mixer_stats() == {}


def test_tiny_vit_with_laplacian_heads_learns_digits():
    """8x8 scikit-learn digits, a tiny ViT with 2 of 4 heads Laplacian in every layer: >= 90% validation accuracy
    within 25 epochs on CPU."""
    torch.manual_seed(0)
    model = build_model({"preset": "vit_tiny_digits", "k": 2})
    optimizer = torch.optim.AdamW(model.param_groups(weight_decay=0.05), lr=2e-3)
    best, epochs = train_on_digits(model, optimizer, epochs=25, target=0.9)
    assert best >= 0.9, f"best validation accuracy {best:.3f} after {epochs} epochs"


def test_config_error_survives_pickling():
    """Errors raised inside Ray workers are pickled on their way to the driver."""
    import pickle

    error = pickle.loads(pickle.dumps(ConfigError("k", "must be an integer in 0..4, got 5")))
    assert error.field == "k" and str(error) == "k: must be an integer in 0..4, got 5"
