"""DINO's multi-crop augmentation (study/data/images/multicrop.py: dino_crops) against DataAugmentationDINO
(facebookresearch/dino main_dino.py:419-464, utils.py:36-68) and the torchvision/Pillow calls it makes: the crop
sizes, every operation's rate, each crop recomputed image by image with Pillow, and the seeding."""

from __future__ import annotations

import math

import numpy as np
import pytest
from PIL import Image, ImageEnhance, ImageFilter, ImageOps

from study.data.images import DinoView, apply_dino_view, color_jitter, dino_crops, dino_views


def binomial_ok(count: int, n: int, p: float, sigmas: float = 4.0) -> bool:
    return abs(count - n * p) <= sigmas * math.sqrt(n * p * (1 - p))


def photos(count: int, seed: int, mode: str = "RGB", size=(48, 36)) -> list[Image.Image]:
    """Smooth colour fields with noise (saturated colours and grey levels both present), as PIL images."""
    rng = np.random.default_rng(seed)
    width, height = size
    yy, xx = np.mgrid[0:height, 0:width] / max(width, height)
    out = []
    for _ in range(count):
        phase = rng.uniform(0, 2 * np.pi, 3)
        field = 127.5 + 110 * np.sin(3 * xx[..., None] + 2 * yy[..., None] + phase)
        array = np.clip(field + rng.normal(0, 12, field.shape), 0, 255).astype(np.uint8)
        image = Image.fromarray(array)
        out.append(image if mode == "RGB" else image.convert(mode))
    return out


# ---------------------------------------------------------------------------------------------------------------
# Sizes and seeding


def test_two_global_then_local_crops_of_the_configured_sizes_and_seeded():
    images = photos(3, seed=0)
    crops = dino_crops(images, np.random.default_rng(5), global_size=32, local_size=12, local_crops=4)
    assert [c.shape for c in crops] == [(3, 32, 32, 3)] * 2 + [(3, 12, 12, 3)] * 4
    assert all(c.dtype == np.uint8 for c in crops)
    again = dino_crops(images, np.random.default_rng(5), global_size=32, local_size=12, local_crops=4)
    assert all(np.array_equal(a, b) for a, b in zip(crops, again))
    other = dino_crops(images, np.random.default_rng(6), global_size=32, local_size=12, local_crops=4)
    assert not any(np.array_equal(a, b) for a, b in zip(crops, other))
    grey = dino_crops(photos(2, seed=1, mode="L"), np.random.default_rng(5), global_size=16, local_size=8,
                      local_crops=1)
    assert [c.shape for c in grey] == [(2, 16, 16, 1)] * 2 + [(2, 8, 8, 1)]


def test_defaults_are_main_dino_defaults():
    # main_dino.py:108 global_crops_scale (0.4, 1.), :112 local_crops_number 8, :115 local_crops_scale (0.05, 0.4),
    # :436 and :443 RandomResizedCrop(224), :452 RandomResizedCrop(96)
    views = dino_views(np.random.default_rng(0), np.array([[500, 400]] * 2000))
    assert [v.size for v in views] == [224, 224] + [96] * 8
    for view, (low, high) in zip(views, [(0.4, 1.0)] * 2 + [(0.05, 0.4)] * 8):
        left, top, right, bottom = view.boxes.T
        area = (right - left) * (bottom - top) / (500 * 400)
        assert np.mean((area >= low - 0.005) & (area <= high + 0.005)) > 0.99
        assert area.min() < low + 0.05 and area.max() > high - 0.05  # the whole range is used


# ---------------------------------------------------------------------------------------------------------------
# Rates of the operations


def test_every_operation_happens_at_the_reference_rate():
    n = 6000
    sizes = np.random.default_rng(1).integers(64, 600, (n, 2))
    views = dino_views(np.random.default_rng(2), sizes, local_crops=3)
    # DataAugmentationDINO: flip 0.5 and jitter 0.8 and grey 0.2 everywhere (:421-428); blur 1.0, 0.1, 0.5
    # (:438, :445, :454); solarisation only on the second global crop, 0.2 (:446)
    blur_rates = [1.0, 0.1, 0.5, 0.5, 0.5]
    solarize_rates = [0.0, 0.2, 0.0, 0.0, 0.0]
    for view, blur, solarize in zip(views, blur_rates, solarize_rates):
        assert binomial_ok(view.flip.sum(), n, 0.5)
        assert binomial_ok(view.jitter.sum(), n, 0.8)
        assert binomial_ok(view.gray.sum(), n, 0.2)
        blurred = int((view.blur > 0).sum())
        assert blurred == n if blur == 1.0 else binomial_ok(blurred, n, blur)
        assert view.solarize.sum() == 0 if solarize == 0.0 else binomial_ok(view.solarize.sum(), n, solarize)
        # the operations are drawn independently of each other: flip and grey together at 0.5 * 0.2
        assert binomial_ok((view.flip & view.gray).sum(), n, 0.1)
        # ColorJitter(0.4, 0.4, 0.2, 0.1) (:424): brightness and contrast in [0.6, 1.4], saturation in [0.8, 1.2],
        # hue in [-0.1, 0.1], each uniform, in a random order (torch.randperm(4))
        for column, (low, high) in enumerate([(0.6, 1.4), (0.6, 1.4), (0.8, 1.2), (-0.1, 0.1)]):
            values = view.factors[:, column]
            assert values.min() >= low and values.max() <= high
            assert abs(values.mean() - (low + high) / 2) < 0.01
            assert abs(values.std() - (high - low) / math.sqrt(12)) < 0.01
        assert (np.sort(view.order, axis=1) == np.arange(4)).all()
        assert binomial_ok((view.order[:, 0] == 3).sum(), n, 0.25)  # hue first in a quarter of the images
        radius = view.blur[view.blur > 0]  # utils.py:40: radius uniform in [0.1, 2.0]
        assert radius.min() >= 0.1 and radius.max() <= 2.0 and abs(radius.mean() - 1.05) < 0.05


# ---------------------------------------------------------------------------------------------------------------
# Each crop is the reference's chain of Pillow operations


def adjust_hue(image: Image.Image, hue_factor: float) -> Image.Image:
    """torchvision transforms/_functional_pil.py adjust_hue, written out."""
    if image.mode == "L":
        return image
    h, s, v = image.convert("HSV").split()
    np_h = np.array(h, dtype=np.uint8)
    np_h += np.int32(hue_factor * 255).astype(np.uint8)
    return Image.merge("HSV", (Image.fromarray(np_h, "L"), s, v)).convert(image.mode)


def reference_view(image: Image.Image, view: DinoView, i: int) -> np.ndarray:
    """main_dino.py:435-456 for one image with the view's draws: RandomResizedCrop (torchvision's resized_crop on PIL:
    crop, then resize bicubic), flip, ColorJitter (torch draws the factors as float32), RandomGrayscale (to_grayscale
    with as many channels as the image), GaussianBlur, Solarization."""
    img = image.crop(tuple(int(v) for v in view.boxes[i])).resize((view.size, view.size), Image.BICUBIC)
    if view.flip[i]:
        img = img.transpose(Image.FLIP_LEFT_RIGHT)
    if view.jitter[i]:
        enhancers = (ImageEnhance.Brightness, ImageEnhance.Contrast, ImageEnhance.Color)
        for op in view.order[i]:
            factor = float(np.float32(view.factors[i, op]))
            img = adjust_hue(img, factor) if op == 3 else enhancers[op](img).enhance(factor)
    if view.gray[i] and img.mode == "RGB":
        img = Image.merge("RGB", [img.convert("L")] * 3)
    if view.blur[i] > 0:
        img = img.filter(ImageFilter.GaussianBlur(radius=float(view.blur[i])))
    if view.solarize[i]:
        img = ImageOps.solarize(img)
    array = np.asarray(img)
    return array[..., None] if array.ndim == 2 else array


@pytest.mark.parametrize("mode", ["RGB", "L"])
def test_each_crop_is_the_reference_chain_of_pillow_operations(mode):
    images = photos(16, seed=3, mode=mode)
    seed, kwargs = 11, dict(global_size=20, local_size=10, local_crops=2)
    views = dino_views(np.random.default_rng(seed), np.array([im.size for im in images]), **kwargs)
    crops = dino_crops(images, np.random.default_rng(seed), **kwargs)  # the same draws as the views
    assert any(v.jitter.any() and v.gray.any() and (v.blur > 0).any() for v in views)
    assert views[1].solarize.any()
    for view, crop in zip(views, crops):
        np.testing.assert_array_equal(apply_dino_view(images, view), crop)
        for i, image in enumerate(images):  # with the factors as float32 as torch draws them: level for level
            np.testing.assert_array_equal(crop[i], reference_view(image, view, i), err_msg=f"{view.size}, {i}")


def test_hue_turns_red_into_green_and_leaves_grey_alone():
    # hue +1/3: Pillow's hue band moves by int(255 / 3) = 85 levels, from 0 (red) to 85 (120 degrees, green)
    image = np.zeros((2, 3, 4, 3), np.uint8)
    image[0, ..., 0] = 255  # red
    image[1] = 90  # grey: no saturation, no hue
    identity = [1.0, 1.0, 1.0]
    out = color_jitter(image, np.array([identity + [1 / 3]] * 2), np.array([[3, 0, 1, 2]] * 2))
    assert (out[0] == [0, 255, 0]).all()
    np.testing.assert_array_equal(out[1], image[1])
    grey_mode = image[:1, ..., :1]
    np.testing.assert_array_equal(color_jitter(grey_mode, np.array([identity + [0.3]]), np.array([[3, 0, 1, 2]])),
                                  grey_mode)
