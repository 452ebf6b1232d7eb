"""The supervised ViT and its training recipe against DeiT III ("Revenge of the ViT", Touvron, Cord and Jegou 2022).

Every expected value is written out from the reference and cites where it comes from:

- facebookresearch/deit at 7e160fe: models_v2.py (the architecture; its forward written out in
  tests/reference_vits.py), augment.py (3-Augment), datasets.py (the evaluation transform), main.py (the defaults),
  README_revenge.md (the training commands), and the paper's own settings (the seeds, seed 000 section 3.1), which the
  paper spaces take before the command's;
- the libraries those files call for the operations they name: Pillow at 4e5f09f (ImageOps.solarize, ImageFilter.
  GaussianBlur, ImageEnhance, the RGB -> L conversion), torchvision's transforms.py (ColorJitter.forward, Resize,
  CenterCrop), timm's data/transforms.py at aa4b585 (RandomResizedCropAndInterpolation).

Pillow itself is the reference for the pixel operations here: augment.py hands PIL images to these calls.
"""

from __future__ import annotations

import itertools
import math
import re
from pathlib import Path

import numpy as np
import pytest
import scipy.stats
import torch
import yaml
from PIL import Image, ImageEnhance, ImageFilter, ImageOps
from torch import nn

import models
from models import build_model
from models.layers import LayerScale
from reference_vits import deit3_forward, deit3_parameter_shapes, project_to_reference
from study.data import config as data_config
from study.data.images import ImageSpec, color_jitter, eval_images, gaussian_blur, three_augment, train_images
from study.optim import Lamb, build_optimizer
from study.runspec import TRAIN_KEYS, TrainConfig, resolve
from study.space import load_space

SPACES = Path(__file__).resolve().parents[1] / "search_spaces"
# The ViT presets of the paper's grids: ViT-B/16 (ImageNet-1k), ViT-B/4 at 32x32 (CIFAR), ViT-S/16 (DINO backbone).
PAPER_PRESETS = ("vit_b16", "vit_b4_32", "vit_s16")


def _binomial_ok(count: int, n: int, p: float, sigmas: float = 4.0) -> bool:
    return abs(count - n * p) <= sigmas * math.sqrt(n * p * (1 - p))


# ----------------------------------------------------------------------------------------------------------------
# The architecture (models_v2.py)


@pytest.mark.parametrize("preset", PAPER_PRESETS)
def test_every_block_drops_its_branches_at_the_drop_path_rate(preset):
    # models_v2.py:200 `dpr = [drop_path_rate for i in range(depth)]`: the same rate in every block (not the
    # linear 0 -> drop_path ramp of DeiT I / timm), used by both residual branches (models_v2.py:81-82).
    rate = 0.3
    vit = build_model({"preset": preset, "drop_path": rate}, device="meta")
    ones = torch.ones(20_000, 1, 1)
    for layer, block in enumerate(vit.blocks):
        for branch in (block.drop_path1, block.drop_path2):
            branch.train()
            dropped = int((branch(ones) == 0).sum())  # a dropped sample's branch is zeroed whole
            assert _binomial_ok(dropped, len(ones), rate), (layer, dropped / len(ones))


def test_linear_drop_path_stays_an_option_and_the_gpt_keeps_it():
    # DeiT I / timm's ramp (timm layers/drop.py:219 `torch.linspace(0, drop_path_rate, depth)`).
    vit = build_model({"preset": "vit_tiny", "drop_path": 0.2, "drop_path_by_depth": "linear"}, device="meta")
    ramp = [0.2 * layer / 5 for layer in range(6)]
    assert [block.drop_path1.p for block in vit.blocks] == pytest.approx(ramp)
    gpt = build_model({"preset": "gpt_tiny", "drop_path": 0.3}, device="meta")
    assert [block.drop_path2.p for block in gpt.blocks] == pytest.approx([0.3 * layer / 3 for layer in range(4)])


@pytest.mark.parametrize("preset", PAPER_PRESETS)
def test_every_layernorm_of_the_vit_has_eps_1e_6(preset):
    # models_v2.py:284 (ViT-S), :325 (ViT-B): `norm_layer=partial(nn.LayerNorm, eps=1e-6)`, the norm of both
    # branches of every block (models_v2.py:69, :74) and the final norm (models_v2.py:211).
    vit = build_model({"preset": preset}, device="meta")
    norms = [m for m in vit.modules() if isinstance(m, nn.LayerNorm)]
    assert len(norms) == 2 * vit.config.depth + 1
    # What eps does: a token of variance v comes out with standard deviation sqrt(v / (v + eps)); at v = eps = 1e-6
    # that is 1/sqrt(2) (with PyTorch's default 1e-5 it would be 0.30).
    token = torch.tensor([1e-3, -1e-3] * (vit.config.dim // 2), dtype=torch.float64)[None]
    for norm in norms:
        probe = nn.LayerNorm(vit.config.dim, eps=norm.eps, dtype=torch.float64)
        assert probe(token).std(correction=0).item() == pytest.approx(1 / math.sqrt(2), rel=1e-6)


def test_the_gpt_keeps_pytorchs_layernorm_eps():
    gpt = build_model({"preset": "gpt_tiny"}, device="meta")
    assert {m.eps for m in gpt.modules() if isinstance(m, nn.LayerNorm)} == {1e-5}


@pytest.mark.parametrize("preset", PAPER_PRESETS)
def test_layer_scale_sits_on_both_branches_with_the_reference_init(preset):
    # models_v2.py:182 `init_scale=1e-4`, passed to every block (models_v2.py:205; no size-specific override in
    # deit_small/base_patch16_LS, models_v2.py:281-338); models_v2.py:77-78 gamma_1 = gamma_2 = init * ones(dim).
    assert models.build_config({"preset": preset}).layer_scale_init == 1e-4
    vit = build_model({"preset": preset, "depth": 2}).eval()  # real weights; the blocks are those of the preset
    for block in vit.blocks:
        for scale in (block.ls1, block.ls2):
            assert isinstance(scale, LayerScale)
            assert torch.equal(scale.gamma, torch.full((vit.config.dim,), 1e-4))
    # models_v2.py:81-82: x + drop_path(gamma_1 * attn(norm1(x))), then x + drop_path(gamma_2 * mlp(norm2(x))).
    block = vit.blocks[0]
    with torch.no_grad():
        block.ls1.gamma.uniform_(0.5, 1.5)
        block.ls2.gamma.uniform_(0.5, 1.5)
        x = torch.randn(2, vit.config.num_patches + 1, vit.config.dim)
        y = x + block.ls1.gamma * block.mixer(block.norm1(x))
        expected = y + block.ls2.gamma * block.mlp(block.norm2(y))
        torch.testing.assert_close(block(x), expected)


@pytest.mark.parametrize("preset, dim, depth, heads, patch", [
    ("vit_s16", 384, 12, 6, 16),  # models_v2.py:283 deit_small_patch16_LS
    ("vit_b16", 768, 12, 12, 16),  # models_v2.py:324 deit_base_patch16_LS
    ("vit_b4_32", 768, 12, 12, 4),  # ViT-B width and depth, 4x4 patches of 32x32 images (the paper's CIFAR setting)
])
def test_paper_presets_are_the_deit3_models(preset, dim, depth, heads, patch):
    config = models.build_config({"preset": preset})
    assert (config.dim, config.depth, config.num_heads, config.patch_size) == (dim, depth, heads, patch)
    assert config.mlp_ratio == 4 and config.qkv_bias is True  # models_v2.py:283, :324: mlp_ratio=4, qkv_bias=True
    assert config.drop_path_by_depth == "uniform" and config.norm_eps == 1e-6 and config.pool == "cls"


@pytest.mark.parametrize("preset, pixels", [("vit_b16", 224), ("vit_b4_32", 32), ("vit_s16", 224)])
def test_the_vit_is_models_v2s_network_by_weight_transfer(preset, pixels):
    # deit_base/small_patch16_LS (models_v2.py:281-338), and the CIFAR ViT-B/4, written out in tests/reference_vits.py
    # from models_v2.py: the project's weights renamed are exactly its parameters, and its logits the same. Two
    # blocks of the preset's width and heads; every parameter moved off its initial value (LayerScale 1e-4, zero
    # biases and unit norms would hide a misplaced one).
    torch.manual_seed(0)
    vit = build_model({"preset": preset, "depth": 2, "num_classes": 10}).double().eval()
    with torch.no_grad():
        for p in vit.parameters():
            p.add_(0.05 * torch.randn_like(p))
    c = vit.config
    weights = project_to_reference(vit.named_parameters())
    assert {name: tuple(p.shape) for name, p in weights.items()} == deit3_parameter_shapes(
        c.dim, 2, c.patch_size, c.in_chans, c.num_patches, 10)
    images = torch.randn(2, 3, pixels, pixels, dtype=torch.float64)
    with torch.no_grad():
        expected = deit3_forward(weights, images, heads=c.num_heads, patch=c.patch_size)
        torch.testing.assert_close(vit(images), expected, rtol=1e-10, atol=1e-12)


# ----------------------------------------------------------------------------------------------------------------
# 3-Augment (augment.py) and the evaluation transform (datasets.py)


def _noise(count: int, height: int, width: int, seed: int = 0, chans: int = 3) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (count, height, width, chans), dtype=np.uint8)


def test_random_resized_crop_is_a_crop_then_a_bicubic_resize():
    # augment.py:96 `interpolation='bicubic'` and :105-106 RandomResizedCropAndInterpolation, whose __call__ is
    # F.resized_crop (timm data/transforms.py:258): crop the box, then resize the crop (pixels outside the box never
    # enter). With scale (0.25, 0.25) and ratio (1, 1) the box of a 40x40 image is 20x20, at a random place.
    image = _noise(1, 40, 40)[0]
    spec = ImageSpec(image_size=16, in_chans=3, augment="basic", crop_scale=(0.25, 0.25), crop_ratio=(1.0, 1.0),
                     hflip=False)
    pil = Image.fromarray(image)
    candidates = {(left, top): np.asarray(pil.crop((left, top, left + 20, top + 20)).resize((16, 16), Image.BICUBIC))
                  for left in range(21) for top in range(21)}
    for seed in range(5):
        out = train_images([image], spec, np.random.default_rng(seed))[0]
        assert any(np.array_equal(out, c) for c in candidates.values()), seed


def test_evaluation_resizes_the_short_side_bicubic_then_crops_the_centre():
    # datasets.py:101-105: Resize(int(input_size / eval_crop_ratio), interpolation=3) (3 = bicubic), CenterCrop.
    # torchvision Resize(int): the short side to that size, the long side to int(size * long / short); CenterCrop:
    # top = int(round((h - crop) / 2)), left = int(round((w - crop) / 2)).
    image = _noise(1, 200, 300)[0]  # H 200, W 300
    spec = ImageSpec(image_size=64, in_chans=3, eval_crop_pct=0.875)
    resize = int(64 / 0.875)  # 73
    resized = Image.fromarray(image).resize((int(resize * 300 / 200), resize), Image.BICUBIC)  # (109, 73)
    top, left = int(round((73 - 64) / 2.0)), int(round((109 - 64) / 2.0))
    expected = np.asarray(resized.crop((left, top, left + 64, top + 64)))
    np.testing.assert_array_equal(eval_images([image], spec)[0], expected)


def _kinds(images: np.ndarray, out: np.ndarray):
    gray = np.all(out == out[..., :1], axis=(1, 2, 3))
    solarised = np.all(out == np.asarray([np.asarray(ImageOps.solarize(Image.fromarray(i))) for i in images]),
                       axis=(1, 2, 3))
    return gray, solarised, ~gray & ~solarised


def test_three_augment_is_one_of_pils_grayscale_solarize_blur_a_third_of_the_time_each():
    # augment.py:111-113 RandomChoice([gray_scale(p=1.0), Solarization(p=1.0), GaussianBlur(p=1.0)]): one of the
    # three, uniformly. gray_scale is transforms.Grayscale(3) (augment.py:64): PIL's RGB -> L, copied to 3 channels,
    # L = (19595 R + 38470 G + 7471 B + 2^15) >> 16 (Pillow Convert.c:42). Solarization is ImageOps.solarize(img)
    # (augment.py:54): threshold 128, every value >= 128 inverted (Pillow ImageOps.py:674-688).
    images = _noise(3000, 6, 6, seed=1)
    out = three_augment(images, np.random.default_rng(2), jitter=0.0)
    gray, solarised, rest = _kinds(images, out)
    assert not (gray & solarised).any()
    for kind in (gray, solarised, rest):
        assert _binomial_ok(int(kind.sum()), len(images), 1 / 3), (gray.sum(), solarised.sum(), rest.sum())
    pil_gray = np.asarray([np.asarray(Image.fromarray(i).convert("L")) for i in images[gray]])
    np.testing.assert_array_equal(out[gray][..., 0], pil_gray)


def test_gaussian_blur_is_pils_gaussian_blur_at_every_pixel():
    # augment.py:38-42: img.filter(ImageFilter.GaussianBlur(radius=uniform(0.1, 2.0))). Pillow's radius is the
    # standard deviation (ImageFilter.py:189); Pillow blurs with three extended box passes per axis whose border
    # repeats the edge pixel (BoxBlur.c:40-46, :236-332), a few levels off an exact Gaussian, tens of levels off a
    # mirrored border. One call blurs images of different sigmas, as three_augment's batch does.
    rng = np.random.default_rng(3)
    for height, width in ((32, 32), (9, 23), (1, 5), (16, 3)):
        sigmas = [0.1, 0.5, 1.0, 1.37, 2.0, float(rng.uniform(0.1, 2.0))]
        images = _noise(len(sigmas), height, width, seed=height * width)
        x = torch.from_numpy(images).permute(0, 3, 1, 2).float()
        out = gaussian_blur(x, torch.tensor(sigmas, dtype=torch.float64)).permute(0, 2, 3, 1).numpy()
        for image, sigma, ours in zip(images, sigmas, out):
            pil = np.asarray(Image.fromarray(image).filter(ImageFilter.GaussianBlur(radius=sigma)))
            np.testing.assert_array_equal(ours, pil, err_msg=f"{height}x{width}, sigma {sigma}")


OPERATIONS = {"brightness": ImageEnhance.Brightness, "contrast": ImageEnhance.Contrast,
              "saturation": ImageEnhance.Color}


@pytest.mark.parametrize("order", list(itertools.permutations(range(3))))
def test_colour_jitter_is_pils_brightness_contrast_saturation_in_the_given_order(order):
    # augment.py:116 transforms.ColorJitter(cj, cj, cj); on a PIL image torchvision's adjust_brightness,
    # adjust_contrast and adjust_saturation are ImageEnhance.Brightness, .Contrast and .Color: Image.blend of a
    # degenerate image (black; the mean of the L image rounded, ImageEnhance.py:74; the L image) with the image,
    # each result truncated to uint8 (Blend.c:62, :73-80).
    rng = np.random.default_rng(4)
    images = np.concatenate([_noise(24, 9, 7, seed=5), np.full((2, 9, 7, 3), 250, np.uint8)])
    images[-1, :, :3] = 3  # high contrast: clipping at both ends
    factors = rng.uniform(0.7, 1.3, (len(images), 3))
    factors[:4] = [[1.3, 1.3, 1.3], [0.7, 0.7, 0.7], [1.3, 0.7, 1.3], [0.7, 1.3, 0.7]]
    orders = np.tile(order, (len(images), 1))
    out = color_jitter(images, factors, orders)
    ops = list(OPERATIONS.values())
    for image, factor, result in zip(images, factors, out):
        pil = Image.fromarray(image)
        for k in order:
            pil = ops[k](pil).enhance(float(factor[k]))
        assert np.abs(result.astype(int) - np.asarray(pil).astype(int)).max() <= 1


def test_colour_jitter_of_a_grey_image_is_pils():
    images = _noise(6, 8, 8, seed=6, chans=1)
    factors = np.random.default_rng(7).uniform(0.7, 1.3, (6, 3))
    out = color_jitter(images, factors, np.tile([2, 1, 0], (6, 1)))
    for image, factor, result in zip(images, factors, out):
        pil = Image.fromarray(image[..., 0])
        for k in (2, 1, 0):
            pil = list(OPERATIONS.values())[k](pil).enhance(float(factor[k]))
        assert np.abs(result[..., 0].astype(int) - np.asarray(pil).astype(int)).max() <= 1


def test_three_augment_jitters_in_a_random_order_as_colorjitter_does():
    # torchvision ColorJitter.forward: `fn_idx = torch.randperm(4)`, brightness, contrast, saturation (and hue,
    # off here) in a fresh random order for every image, each factor uniform in [1 - cj, 1 + cj].
    # The probe: a grey image, left half 255, right half 0. Grey scale leaves it alone, solarisation turns it black,
    # a blur leaves it alone or adds grey levels in the middle. Jittering the image itself (two levels), brightness
    # before contrast can never lift the sum of the two levels above 257: the mean is half the bright level, so
    # contrast then moves the two levels by the same amount in opposite directions. Contrast first (reducing), then
    # brightness (raising) can. Its share under the reference is measured with Pillow itself.
    step = np.zeros((16, 16, 3), np.uint8)
    step[:, :8] = 255
    rng = np.random.default_rng(8)
    ops = list(OPERATIONS.values())
    above = []
    for _ in range(3000):
        factors = rng.uniform(0.7, 1.3, 3)
        pil = Image.fromarray(step)
        for k in rng.permutation(3):
            pil = ops[k](pil).enhance(float(factors[k]))
        extremes = np.asarray(pil)[0, [0, 15], 0].astype(int)
        above.append(extremes.sum() > 257)
    reference = float(np.mean(above))
    assert 0.08 < reference < 0.14

    out = three_augment(np.repeat(step[None], 3000, axis=0), np.random.default_rng(9), jitter=0.3)
    levels = np.array([len(np.unique(row)) for row in out[:, 0, :, 0]])
    probe = out[levels == 2]  # the image itself jittered: solarised ones are black, blurred ones have more levels
    assert len(probe) > len(out) / 4
    count = int((probe[:, 0, [0, 15], 0].astype(int).sum(axis=1) > 257).sum())
    assert count > 0, "brightness always came before contrast: a fixed order"
    assert _binomial_ok(count, len(probe), reference, sigmas=5), (count / len(probe), reference)


def test_colour_jitter_factors_are_uniform_in_one_plus_minus_the_strength():
    # main.py:96 `--color-jitter` default 0.3; torchvision draws each factor uniformly in [max(0, 1 - cj), 1 + cj].
    # A flat grey image isolates brightness: contrast and saturation leave it alone, brightness scales it.
    images = np.full((4000, 2, 2, 3), 200, np.uint8)
    out = three_augment(images, np.random.default_rng(10), jitter=0.3)
    gray_or_blurred = out[:, 0, 0, 0] > 100  # solarised: 255 - 200 = 55, then scaled to at most 71
    assert _binomial_ok(int(gray_or_blurred.sum()), len(out), 2 / 3)
    factors = out[gray_or_blurred, 0, 0, 0] / 200.0
    factors = factors[factors < 255 / 200]  # 200 * f clips at 255 for f >= 1.275
    assert factors.min() >= 0.7 - 1e-9
    lower = scipy.stats.uniform(0.7, 0.575)  # U(0.7, 1.3) restricted to below 1.275, truncated to 1/200 steps
    assert scipy.stats.kstest(factors + 0.0025, lower.cdf).pvalue > 1e-4


def test_data_defaults_are_deit3s():
    fields = data_config._ImageSource.model_fields
    assert fields["color_jitter"].default == 0.3  # main.py:96 and every DeiT III command: --color-jitter 0.3
    assert fields["crop_scale"].default == (0.08, 1.0)  # augment.py:95 scale=(0.08, 1.0)
    assert fields["crop_ratio"].default == pytest.approx((3 / 4, 4 / 3))  # timm transforms.py:185 ratio default
    assert fields["hflip"].default is True  # augment.py:107 transforms.RandomHorizontalFlip() (p = 0.5)
    assert fields["mix_prob"].default == 1.0  # main.py:134 --mixup-prob 1.0
    assert fields["switch_prob"].default == 0.5  # main.py:136 --mixup-switch-prob 0.5


# ----------------------------------------------------------------------------------------------------------------
# The shipped spaces of the paper's grids


def _space(name: str) -> dict:
    return yaml.safe_load((SPACES / name).read_text())


# The sources, written out. The paper: seed 000, section 3.1 (its CIFAR-10/100 and ImageNet-1k columns), and its 400
# ImageNet epochs. The command: README_revenge.md:412, DeiT III's ViT-B on ImageNet-1k, flag by flag. main.py: the
# argparse defaults of what the command does not pass.
PAPER = {
    "cifar100": {"dataset": "cifar100", "preset": "vit_b4_32", "image_size": 32, "patch_size": 4, "lr": 3e-4,
                 "drop_path": 0.1, "sched": "cosine", "k": [0, 3, 6, 9, 11, 12]},
    "imagenet": {"dataset": "imagenet-1k", "preset": "vit_b16", "image_size": 224, "patch_size": 16, "lr": 3e-3,
                 "drop_path": 0.3, "sched": "cosine", "k": [0, 3, 6, 9, 11, 12], "epochs": 400},
}
COMMAND = {"batch": 256, "ngpus": 8, "nodes": 1, "lr": 3e-3, "epochs": 800, "weight_decay": 0.05, "sched": "cosine",
           "input_size": 192, "eval_crop_ratio": 1.0, "reprob": 0.0, "smoothing": 0.0, "warmup_epochs": 5, "drop": 0.0,
           "seed": 0, "opt": "fusedlamb", "warmup_lr": 1e-6, "mixup": 0.8, "drop_path": 0.2, "cutmix": 1.0,
           "unscale_lr": True, "repeated_aug": True, "bce_loss": True, "color_jitter": 0.3, "ThreeAugment": True}
MAIN_PY = {"min_lr": 1e-5, "opt_eps": 1e-8, "opt_betas": None, "clip_grad": None,  # main.py:81, :58, :60, :62
           "mixup_prob": 1.0, "mixup_switch_prob": 0.5, "src": False}  # :134, :136, :115
FUSED_LAMB = {"betas": (0.9, 0.999), "max_grad_norm": 1.0}  # apex fused_lamb.py:68, :75 (what --opt-betas None keeps)
RA_REPEATS = 3  # samplers.py:16 RASampler(num_repeats=3), what --repeated-aug samples with (main.py:215-217)
IMAGENET_MEAN, IMAGENET_STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)  # augment.py:93, every dataset
SOURCES = ("paper", "command", "main.py", "project")


def recipe(paper: dict) -> dict[str, tuple[object, str]]:
    """Every training value of a paper space: (the value its source gives, that source's name). The paper's own
    values first, then the command's, then main.py's; the project's where none of them applies."""
    return {
        "dataset.source": ("hf", "project"),
        "dataset.name": (paper["dataset"], "paper"),
        "dataset.augment": ("three_augment" if COMMAND["ThreeAugment"] else "basic", "command"),
        "dataset.color_jitter": (COMMAND["color_jitter"], "command"),
        "dataset.mixup": (COMMAND["mixup"], "command"),
        "dataset.cutmix": (COMMAND["cutmix"], "command"),
        # BCE's positives are the mixed targets > 0 (engine.py:43-44): smoothed (main.py's 0.1), every class is one
        "dataset.label_smoothing": (COMMAND["smoothing"], "command"),
        "dataset.eval_crop_pct": (COMMAND["eval_crop_ratio"], "command"),
        "dataset.repeated_aug": (RA_REPEATS if COMMAND["repeated_aug"] else 1, "command"),
        "epochs": (paper["epochs"], "paper") if "epochs" in paper else (COMMAND["epochs"], "command"),
        "seed": (COMMAND["seed"], "command"),
        "fixed.preset": (paper["preset"], "paper"),
        "fixed.laplacian_schedule": ("uniform", "paper"),  # k Laplacian heads in every layer
        "fixed.drop_path": (paper["drop_path"], "paper"),
        "fixed.optimizer": ({"fusedlamb": "lamb"}[COMMAND["opt"]], "command"),
        "fixed.lr": (paper["lr"], "paper"),  # for the global batch: --unscale-lr
        "fixed.weight_decay": (COMMAND["weight_decay"], "command"),
        "fixed.batch_size": (COMMAND["batch"] * COMMAND["ngpus"] * COMMAND["nodes"], "command"),
        "fixed.warmup_epochs": (COMMAND["warmup_epochs"], "command"),
        "fixed.min_lr_ratio": (MAIN_PY["min_lr"] / paper["lr"], "main.py"),
        "fixed.grad_clip": (0.0 if MAIN_PY["clip_grad"] is None else MAIN_PY["clip_grad"], "main.py"),
        "fixed.precision": ("bf16", "project"),  # DeiT: fp16 autocast with a loss scaler
        "fixed.loss": ("bce" if COMMAND["bce_loss"] else "ce", "command"),
        "parameters.k": (paper["k"], "paper"),
    }


SPACE_RECIPES = {
    "vit_cifar100_k_grid.yaml": {**recipe(PAPER["cifar100"]), "dataset.mean": (list(IMAGENET_MEAN), "main.py"),
                                 "dataset.std": (list(IMAGENET_STD), "main.py")},
    "vit_imagenet_k.yaml": {**recipe(PAPER["imagenet"]), "dataset.image_size": (PAPER["imagenet"]["image_size"],
                                                                                "paper")},
}
STUDY_KEYS = {"name", "description", "task", "metric", "mode", "sampler", "early_stopping", "geometry"}  # not training


def _training_values(space: dict) -> dict[str, object]:
    values = {key: value for key, value in space.items() if key not in STUDY_KEYS | {"dataset", "fixed", "parameters"}}
    for section in ("dataset", "fixed", "parameters"):
        values.update({f"{section}.{key}": value for key, value in space[section].items()})
    return values


def _comments(path: Path) -> dict[str, str]:
    """The comment on each key's line, by dotted key (the top-level key a section's lines sit under)."""
    comments, section = {}, None
    for line in path.read_text().splitlines():
        match = re.match(r"^(\s*)(\w+):\s*([^#]*?)\s*(?:#\s*(.*))?$", line)
        if not match:
            continue
        indent, key, value, comment = match.groups()
        if not indent:
            section = key if not value else None
        comments[f"{section}.{key}" if indent and section else key] = comment or ""
    return comments


@pytest.mark.parametrize("name", sorted(SPACE_RECIPES))
def test_every_training_value_of_a_paper_space_is_its_sources_and_says_which(name):
    expected, values, comments = SPACE_RECIPES[name], _training_values(_space(name)), _comments(SPACES / name)
    assert set(values) == set(expected), "a value without a source, or a source's value missing"
    for key, (value, source) in expected.items():
        assert values[key] == (pytest.approx(value, rel=1e-4) if isinstance(value, float) else value), key
        assert comments[key].startswith(f"{source}:"), (key, comments[key])


@pytest.mark.parametrize("name", sorted(SPACE_RECIPES))
def test_what_a_paper_space_leaves_to_the_defaults_is_the_sources_too(name):
    space = load_space(SPACES / name)
    paper = PAPER["cifar100" if "cifar" in name else "imagenet"]
    data = space.dataset
    assert (data.mix_prob, data.switch_prob) == (MAIN_PY["mixup_prob"], MAIN_PY["mixup_switch_prob"])
    assert not MAIN_PY["src"] and tuple(data.crop_scale) == (0.08, 1.0)  # augment.py:95 random resized crop
    assert (data.mean or IMAGENET_MEAN, data.std or IMAGENET_STD) == (IMAGENET_MEAN, IMAGENET_STD)
    train = TrainConfig(**{key: value for key, value in space.fixed.items() if key in TRAIN_KEYS})
    assert train.lr_decay == paper["sched"] == COMMAND["sched"]
    assert train.eps == MAIN_PY["opt_eps"] and (train.beta1, train.beta2) == FUSED_LAMB["betas"]
    vit = build_model({"preset": space.fixed["preset"], "drop_path": space.fixed["drop_path"]}, device="meta")
    assert (vit.config.image_size, vit.config.patch_size) == (paper["image_size"], paper["patch_size"])
    assert {b.drop_path1.p for b in vit.blocks} == {b.drop_path2.p for b in vit.blocks} == {paper["drop_path"]}
    optimizer = build_optimizer(build_model({"preset": "vit_tiny"}), train, 1.0)
    assert isinstance(optimizer, Lamb) and optimizer.max_grad_norm == FUSED_LAMB["max_grad_norm"]
    assert all(g["eps"] == MAIN_PY["opt_eps"] and g["betas"] == FUSED_LAMB["betas"] for g in optimizer.param_groups)



@pytest.mark.parametrize("name", sorted(p.name for p in SPACES.glob("vit_*.yaml")))
def test_vit_spaces_keep_3_augments_crop(name):
    # augment.py:95: scale=(0.08, 1.0) in every 3-Augment run; a space that claims DeiT III style keeps it.
    data = _space(name)["dataset"]
    assert data.get("augment") == "three_augment"
    assert tuple(data.get("crop_scale", (0.08, 1.0))) == (0.08, 1.0), name


# ----------------------------------------------------------------------------------------------------------------
# NC4 as the network decides: the classification task's geom_nc4 with the ViT's classifier bias


def test_classification_nc4_compares_the_vits_own_predictions_with_the_nearest_centre():
    from contextlib import nullcontext

    from study.tasks import GeometrySpec, task_class
    from study.worker import Worker

    torch.manual_seed(0)
    vit = build_model({"preset": "vit_tiny_digits", "depth": 2}).double().eval()
    with torch.no_grad():
        vit.head.bias.copy_(0.1 * torch.randn(10, dtype=torch.float64))  # a bias that changes some decisions
    assert vit.classifier_bias is vit.head.bias
    assert build_model({"preset": "gpt_tiny"}, device="meta").classifier_bias is None  # its head has no bias
    batches = [{"image": torch.randn(40, 1, 8, 8, dtype=torch.float64), "label": torch.arange(40) % 4}
               for _ in range(2)]
    task = task_class("classification")(vit, Worker(0, 1, torch.device("cpu")), seed=0,
                                        geometry=GeometrySpec(pca_points=20),
                                        resolved=resolve({}, "classification", {}, epochs=1))
    metrics = task.evaluate(batches, autocast=nullcontext(), geometry=True).metrics

    images, labels = torch.cat([b["image"] for b in batches]), torch.cat([b["label"] for b in batches])
    with torch.no_grad():
        out = vit(images, return_features=True)
    centres = torch.stack([out.feature[labels == c].mean(dim=0) for c in range(4)])
    nearest = torch.cdist(out.feature, centres).argmin(dim=1)
    decided = out.logits.argmax(dim=1)  # what the network predicts, bias included
    without_bias = (out.feature @ vit.classifier_weight.T).argmax(dim=1)
    assert (decided != without_bias).any()
    assert metrics["geom_nc4"] == pytest.approx((decided != nearest).double().mean().item(), abs=1e-12)
    assert metrics["geom_nc4"] != pytest.approx((without_bias != nearest).double().mean().item(), abs=1e-12)
