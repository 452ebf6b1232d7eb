"""The augmentation and batch-mixing steps against their definitions (no Ray)."""

import io
import math

import numpy as np
import pytest
import torch
from PIL import Image

from study.data.images import BatchMixer, ImageSpec, center_box, gaussian_blur, random_resized_boxes, \
    three_augment, transform_batch


def test_random_resized_boxes_stay_inside_with_area_and_aspect_in_range():
    rng = np.random.default_rng(0)
    sizes = np.array([[32, 32], [64, 48], [500, 375], [17, 90]] * 250)
    boxes = random_resized_boxes(rng, sizes, (0.08, 1.0), (3 / 4, 4 / 3))
    left, top, right, bottom = boxes.T
    assert (left >= 0).all() and (top >= 0).all()
    assert (right <= sizes[:, 0]).all() and (bottom <= sizes[:, 1]).all()
    w, h = right - left, bottom - top
    assert (w >= 1).all() and (h >= 1).all()
    area = w * h / (sizes[:, 0] * sizes[:, 1])
    tall = sizes[:, 1] / sizes[:, 0] > 4  # 17x90: the fallback centre crop clamps the aspect ratio
    assert area[~tall].max() <= 1.0 + 1e-9 and np.quantile(area[~tall], 0.01) >= 0.06
    aspect = w / h
    assert np.quantile(aspect[~tall], 0.02) >= 0.7 and np.quantile(aspect[~tall], 0.98) <= 1.4
    assert len(np.unique(left)) > 10  # positions vary


def test_center_box_matches_resize_then_centre_crop():
    # 400x300 image, resize short side to 256 (scale 256/300), centre crop 224 -> a 262.5 px square in the source
    left, top, right, bottom = center_box(400, 300, 256, 224)
    assert right - left == pytest.approx(224 * 300 / 256) and bottom - top == pytest.approx(224 * 300 / 256)
    assert (left + right) / 2 == 200 and (top + bottom) / 2 == 150
    assert center_box(32, 32, 32, 32) is None  # native size: no resampling at all


def test_gaussian_blur_keeps_constants_and_mean_and_matches_a_direct_sum():
    x = torch.full((2, 3, 16, 16), 77.0)
    assert torch.allclose(gaussian_blur(x, torch.tensor([0.5, 1.7], dtype=torch.float64)), x)
    rng = torch.Generator().manual_seed(0)
    img = torch.rand(1, 1, 12, 12, generator=rng) * 255
    sigma = 1.3
    out = gaussian_blur(img, torch.tensor([sigma], dtype=torch.float64))
    radius = math.ceil(3 * sigma)
    k = torch.exp(-0.5 * (torch.arange(-radius, radius + 1, dtype=torch.float64) / sigma) ** 2)
    k = k / k.sum()
    padded = torch.nn.functional.pad(img.double(), (radius,) * 4, mode="reflect")[0, 0]
    i, j = 6, 5  # an interior pixel, by the definition sum_uv k_u k_v x[i+u, j+v]
    direct = sum(k[u] * k[v] * padded[i + u, j + v] for u in range(2 * radius + 1) for v in range(2 * radius + 1))
    assert float(out[0, 0, i, j]) == pytest.approx(float(direct), rel=1e-5)


def test_three_augment_shapes_and_each_operation():
    rng = np.random.default_rng(1)
    images = rng.integers(0, 256, (64, 20, 20, 3), dtype=np.uint8)
    out = three_augment(images, np.random.default_rng(2), jitter=0.0)
    assert out.shape == images.shape and out.dtype == np.uint8
    gray = np.all(out[..., 0] == out[..., 1], axis=(1, 2)) & np.all(out[..., 1] == out[..., 2], axis=(1, 2))
    solarized = np.all(out == np.where(images >= 128, 255 - images, images), axis=(1, 2, 3))
    assert gray.sum() > 10 and solarized.sum() > 10  # each image got one of the three operations
    assert gray.sum() + solarized.sum() < 64  # the rest were blurred
    jittered = three_augment(images, np.random.default_rng(2), jitter=0.3)
    assert not np.array_equal(jittered, out)


def test_transform_batch_decodes_png_and_struct_cells_and_seeds_by_content():
    pictures = [np.random.default_rng(i).integers(0, 256, (40, 30, 3), dtype=np.uint8) for i in range(6)]
    encoded = []
    for p in pictures:
        buf = io.BytesIO()
        Image.fromarray(p).save(buf, format="PNG")
        encoded.append({"bytes": buf.getvalue(), "path": None})
    batch = {"image": np.array(encoded, dtype=object), "label": np.arange(6)}
    spec = ImageSpec(image_size=24, in_chans=3, augment="basic")
    a = transform_batch(batch, spec, train=True, seed=3)
    b = transform_batch(batch, spec, train=True, seed=3)
    c = transform_batch(batch, spec, train=True, seed=4)
    assert a["image"].shape == (6, 3, 24, 24) and a["image"].dtype == np.uint8 and a["label"].dtype == np.int64
    assert np.array_equal(a["image"], b["image"]) and not np.array_equal(a["image"], c["image"])
    evaluation = transform_batch(batch, ImageSpec(image_size=30, in_chans=1), train=False)
    assert evaluation["image"].shape == (6, 1, 30, 30)  # 40x30 -> centre 30x30, converted to one channel


def test_label_smoothing_and_mixup_targets():
    images = torch.randint(0, 256, (8, 3, 4, 4), dtype=torch.uint8)
    labels = torch.arange(8) % 4
    smooth = BatchMixer(num_classes=4, mean=(0.5,) * 3, std=(0.5,) * 3, label_smoothing=0.2)
    out = smooth({"image": images, "label": labels}, np.random.default_rng(0))
    expected = torch.full((8, 4), 0.05)
    expected[torch.arange(8), labels] = 0.85
    assert torch.allclose(out["soft_label"], expected)
    assert torch.allclose(out["image"], (images.float() / 255 - 0.5) / 0.5)
    mix = BatchMixer(num_classes=4, mean=(0.0,) * 3, std=(1.0,) * 3, mixup=0.8)
    out = mix({"image": images, "label": labels}, np.random.default_rng(1))
    x = images.float() / 255
    lam = float((out["image"][0] - x.flip(0)[0]).flatten()[0] / (x[0] - x.flip(0)[0]).flatten()[0])
    assert torch.allclose(out["image"], lam * x + (1 - lam) * x.flip(0), atol=1e-5)
    onehot = torch.nn.functional.one_hot(labels, 4).float()
    assert torch.allclose(out["soft_label"], lam * onehot + (1 - lam) * onehot.flip(0), atol=1e-5)


def test_cutmix_lambda_is_the_area_actually_kept():
    images = torch.zeros(4, 1, 10, 10)
    images[1::2] = 1.0  # flipping the batch pairs 0<->3, 1<->2: pasted pixels differ from the originals
    mixer = BatchMixer(num_classes=2, mean=(0.0,), std=(1.0,), cutmix=1.0)
    for seed in range(10):
        out = mixer({"image": (images * 255).to(torch.uint8), "label": torch.tensor([0, 1, 0, 1])},
                    np.random.default_rng(seed))
        kept = float((out["image"][0] == 0).float().mean())  # image 0 is zeros; pasted pixels are ones
        assert float(out["soft_label"][0, 0]) == pytest.approx(kept, abs=1e-6)
