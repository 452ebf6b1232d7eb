"""The augmentation and batch-mixing steps against their definitions (no Ray)."""

import io
import math

import numpy as np
import scipy.stats
import torch
from PIL import Image, ImageFilter

from study.data.images import (
    BatchMixer,
    ImageSpec,
    center_crop_resize,
    gaussian_blur,
    random_resized_boxes,
    three_augment,
    transform_batch,
)


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


def test_center_crop_resize_resizes_the_short_side_then_takes_the_centre():
    # 400x300 image, short side to 256: 341x256 (int(256 * 400 / 300)); the centre 224 square starts at
    # (round(58.5), round(16)) = (58, 16): round half to even, as torchvision's CenterCrop rounds
    image = Image.fromarray(np.random.default_rng(0).integers(0, 256, (300, 400, 3), dtype=np.uint8))
    expected = np.asarray(image.resize((341, 256), Image.BICUBIC).crop((58, 16, 58 + 224, 16 + 224)))
    np.testing.assert_array_equal(center_crop_resize(image, 256, 224), expected)
    small = Image.fromarray(np.arange(32 * 32 * 3, dtype=np.uint8).reshape(32, 32, 3))
    np.testing.assert_array_equal(center_crop_resize(small, 32, 32), np.asarray(small))  # native size: as is


def test_gaussian_blur_keeps_constants_and_is_pillows_at_every_pixel():
    x = torch.full((2, 3, 16, 16), 77.0)
    assert torch.equal(gaussian_blur(x, torch.tensor([0.5, 1.7], dtype=torch.float64)), x)
    rng = np.random.default_rng(0)
    # one call, images of different sigmas (as in three_augment's batch); two channels, shapes down to one pixel
    for (height, width), sigmas in (((12, 15), [1.3]), ((12, 15), [0.4, 1.3, 2.0]), ((6, 9), [0.7, 2.0]),
                                    ((1, 7), [0.1, 1.9])):
        img = rng.integers(0, 256, (len(sigmas), height, width, 2), dtype=np.uint8)
        x = torch.from_numpy(img).permute(0, 3, 1, 2).float()
        out = gaussian_blur(x, torch.tensor(sigmas, dtype=torch.float64)).permute(0, 2, 3, 1).numpy()
        for b, sigma in enumerate(sigmas):
            for c in range(2):
                pil = Image.fromarray(img[b, ..., c]).filter(ImageFilter.GaussianBlur(radius=sigma))
                np.testing.assert_array_equal(out[b, ..., c], np.asarray(pil))


def _three_augment_kinds(images: np.ndarray, out: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Which images came out grey, which solarised, and the rest (the blurred third), for jitter 0."""
    gray = np.all(out == out[..., :1], axis=(1, 2, 3))
    solarised = np.all(out == np.where(images >= 128, 255 - images, images), axis=(1, 2, 3))
    return gray, solarised, ~gray & ~solarised


def _binomial_ok(count: int, n: int, p: float) -> bool:
    return abs(count - n * p) <= 4 * math.sqrt(n * p * (1 - p))


def test_three_augment_picks_each_operation_a_third_of_the_time():
    rng = np.random.default_rng(1)
    images = rng.integers(0, 256, (3000, 6, 6, 3), dtype=np.uint8)  # noise: none grey or solarisation-proof by chance
    out = three_augment(images, np.random.default_rng(2), jitter=0.0)
    assert out.shape == images.shape and out.dtype == np.uint8
    gray, solarised, rest = _three_augment_kinds(images, out)
    assert not (gray & solarised).any()
    for kind in (gray, solarised, rest):
        assert _binomial_ok(int(kind.sum()), len(images), 1 / 3), (gray.sum(), solarised.sum(), rest.sum())
    luma = images[gray].astype(np.float64) @ np.array([0.299, 0.587, 0.114])  # ITU-R 601 luma
    assert np.abs(out[gray][..., 0] - np.round(luma)).max() <= 1
    jittered = three_augment(images[:64], np.random.default_rng(2), jitter=0.3)
    assert not np.array_equal(jittered, out[:64])


def test_three_augment_blurs_the_rest_with_a_sigma_in_the_documented_range():
    rng = np.random.default_rng(1)
    images = rng.integers(0, 256, (240, 16, 16, 3), dtype=np.uint8)
    out = three_augment(images, np.random.default_rng(2), jitter=0.0)
    _, _, blurred = _three_augment_kinds(images, out)
    assert blurred.sum() > 50
    # steps of 0.001: the blur moves by at most a level between neighbouring sigmas of the grid
    grid = torch.linspace(0.1, 2.0, 1901, dtype=torch.float64)
    best_error, best_sigma = [], []
    for i in np.flatnonzero(blurred):
        original = torch.from_numpy(images[i]).permute(2, 0, 1).float()
        candidates = gaussian_blur(original.expand(len(grid), -1, -1, -1).contiguous(), grid)
        candidates = candidates.permute(0, 2, 3, 1).numpy()
        error = np.abs(candidates - out[i]).max(axis=(1, 2, 3))
        best_error.append(error.min())
        best_sigma.append(float(grid[error.argmin()]))
    best_error, best_sigma = np.array(best_error), np.array(best_sigma)
    assert best_error.max() <= 1, "an image is neither grey, solarised nor a blur with sigma in [0.1, 2]"
    # sigma ~ U(0.1, 2): blur of noise changes the image unless sigma is below ~0.3 (a 10% chance)
    changed = np.any(out[blurred] != images[blurred], axis=(1, 2, 3))
    assert changed.mean() >= 0.8
    # and about half the sigmas lie above the midpoint 1.05, where the fit identifies sigma well
    assert _binomial_ok(int((best_sigma > 1.05).sum()), len(best_sigma), 0.5), np.sort(best_sigma)


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


def test_label_smoothing():
    images = torch.randint(0, 256, (8, 3, 4, 4), dtype=torch.uint8)
    labels = torch.arange(8) % 4
    smooth = BatchMixer(num_classes=4, mean=(0.5,) * 3, std=(0.5,) * 3, label_smoothing=0.2)
    out = smooth({"image": images, "label": labels}, np.random.default_rng(0))
    expected = torch.full((8, 4), 0.05)
    expected[torch.arange(8), labels] = 0.85
    assert torch.allclose(out["soft_label"], expected)
    assert torch.allclose(out["image"], (images.float() / 255 - 0.5) / 0.5)


def _smoothed(labels: torch.Tensor, num_classes: int, smoothing: float) -> torch.Tensor:
    return torch.nn.functional.one_hot(labels, num_classes).float() * (1 - smoothing) + smoothing / num_classes


# Batches whose flipped partner differs at every pixel (image i draws from its own band of grey levels), so a pixel
# taken from the flipped batch, or a blend of the two, is always visible; H != W to catch a swapped axis.
_BANDS = torch.arange(8)[:, None, None, None] * 32
MIX_IMAGES = (_BANDS + torch.randint(0, 30, (8, 3, 12, 20), generator=torch.Generator().manual_seed(0))).to(torch.uint8)
MIX_LABELS = torch.tensor([0, 1, 2, 3, 4, 0, 1, 2])


def _mix(mixer: BatchMixer, seed: int) -> dict:
    return mixer({"image": MIX_IMAGES, "label": MIX_LABELS}, np.random.default_rng(seed))


def test_mixup_blends_images_and_labels_with_one_beta_distributed_lambda():
    alpha, smoothing = 0.8, 0.1
    mixer = BatchMixer(num_classes=5, mean=(0.0,) * 3, std=(1.0,) * 3, mixup=alpha, label_smoothing=smoothing)
    x = MIX_IMAGES.float() / 255
    targets = _smoothed(MIX_LABELS, 5, smoothing)
    lams = []
    for seed in range(500):
        out = _mix(mixer, seed)
        # lambda from the labels (least squares), then images and labels must be that blend exactly
        d = targets - targets.flip(0)
        lam = float(((out["soft_label"] - targets.flip(0)) * d).sum() / (d * d).sum())
        assert torch.allclose(out["soft_label"], lam * targets + (1 - lam) * targets.flip(0), atol=1e-6)
        assert torch.allclose(out["image"], lam * x + (1 - lam) * x.flip(0), atol=1e-5)
        lams.append(lam)
    lams = np.array(lams)
    assert ((lams > 1e-6) & (lams < 1 - 1e-6)).all() and len(np.unique(lams)) == len(lams)
    # Beta(alpha, alpha): KS at 500 draws (critical value ~0.061 at 5%), and the mean 1/2, variance 1/(4(2 alpha+1))
    assert scipy.stats.kstest(lams, scipy.stats.beta(alpha, alpha).cdf).pvalue > 0.01
    sd = math.sqrt(1 / (4 * (2 * alpha + 1)))
    assert abs(lams.mean() - 0.5) <= 4 * sd / math.sqrt(len(lams))
    assert abs(lams.std() - sd) <= 0.15 * sd


def _cutmix_box(out_image: torch.Tensor) -> torch.Tensor:
    """The (H, W) mask of pixels taken from the flipped batch, checked to be one box shared by the whole batch."""
    x = MIX_IMAGES.float() / 255
    taken = out_image != x
    assert torch.equal(out_image, torch.where(taken, x.flip(0), x)), "pixels neither kept nor from the flipped batch"
    mask = taken[0, 0]
    assert (taken == mask).all(), "the box differs between images or channels"
    rows, cols = mask.any(dim=1), mask.any(dim=0)
    assert torch.equal(mask, rows[:, None] & cols[None, :]), "not an axis-aligned rectangle"
    for line in (rows, cols):
        where = torch.nonzero(line).flatten()
        assert len(where) == 0 or where[-1] - where[0] + 1 == len(where), "box not contiguous"
    return mask


def test_cutmix_pastes_one_box_from_the_flipped_batch_and_labels_by_the_area_kept():
    mixer = BatchMixer(num_classes=5, mean=(0.0,) * 3, std=(1.0,) * 3, cutmix=1.0)
    onehot = _smoothed(MIX_LABELS, 5, 0.0)
    pasted = []
    for seed in range(300):
        out = _mix(mixer, seed)
        mask = _cutmix_box(out["image"])
        kept = 1 - float(mask.float().mean())
        assert torch.allclose(out["soft_label"], kept * onehot + (1 - kept) * onehot.flip(0), atol=1e-6)
        pasted.append(1 - kept)
    pasted = np.array(pasted)
    # lambda ~ U(0, 1) asks for a box of area 1 - lambda, centred anywhere and clipped at the borders
    assert (pasted > 0).mean() >= 0.9 and len(np.unique(pasted)) > 30
    assert 0.15 <= pasted.mean() <= 0.5 and pasted.max() >= 0.6


def test_mix_prob_sets_the_share_of_mixed_batches():
    onehot = _smoothed(MIX_LABELS, 5, 0.0)
    never = BatchMixer(num_classes=5, mean=(0.0,) * 3, std=(1.0,) * 3, mixup=0.8, cutmix=1.0, mix_prob=0.0)
    for seed in range(100):
        out = _mix(never, seed)
        assert torch.equal(out["image"], MIX_IMAGES.float() / 255) and torch.equal(out["soft_label"], onehot)
    sometimes = BatchMixer(num_classes=5, mean=(0.0,) * 3, std=(1.0,) * 3, mixup=1.0, mix_prob=0.3)
    mixed = sum(not torch.equal(_mix(sometimes, seed)["image"], MIX_IMAGES.float() / 255) for seed in range(1000))
    assert _binomial_ok(mixed, 1000, 0.3), mixed


def test_switch_prob_sets_the_share_of_cutmix_when_both_are_on():
    mixer = BatchMixer(num_classes=5, mean=(0.0,) * 3, std=(1.0,) * 3, mixup=1.0, cutmix=1.0, switch_prob=0.3)
    x = MIX_IMAGES.float() / 255
    cutmixed = 0
    for seed in range(1000):
        image = _mix(mixer, seed)["image"]
        is_cutmix = bool(((image == x) | (image == x.flip(0))).all())  # every pixel kept or pasted
        is_mixup = bool(((image != x) & (image != x.flip(0))).all())  # every pixel a blend
        assert is_cutmix != is_mixup
        cutmixed += is_cutmix
    assert _binomial_ok(cutmixed, 1000, 0.3), cutmixed
