"""The colour operations of the recipes, each computing what Pillow computes on whole uint8 levels: DeiT III's
3-Augment (facebookresearch/deit augment.py: grey scale, solarisation at 128, Gaussian blur, then brightness,
contrast and saturation as Pillow's blends in a random order per image), torchvision's ColorJitter with hue
(Pillow's HSV conversion), PIL's grey level and Pillow's own Gaussian blur."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
from PIL import Image, ImageFilter

if TYPE_CHECKING:
    import torch

# torch is imported where it is used: the Ray Data decode tasks of the basic recipe then start without it


def three_augment(images: np.ndarray, rng: np.random.Generator, jitter: float) -> np.ndarray:
    """DeiT III 3-Augment after the crop and flip (deit augment.py:111-116) on (B, H, W, C) uint8: each image gets
    one of grey scale, solarisation, Gaussian blur (sigma uniform in [0.1, 2]), chosen uniformly, then (jitter > 0)
    brightness, contrast and saturation by factors uniform in [1 - jitter, 1 + jitter] in a random order per image,
    as torchvision's ColorJitter(jitter, jitter, jitter) draws them."""
    import torch

    count = len(images)
    x = torch.from_numpy(images).permute(0, 3, 1, 2).float()  # B, C, H, W in 0..255, whole levels throughout
    choice = rng.integers(0, 3, count)
    x = torch.where(torch.from_numpy(choice == 0)[:, None, None, None], _gray(x).expand_as(x), x)
    solar = torch.from_numpy(choice == 1)[:, None, None, None]
    x = torch.where(solar & (x >= 128), 255.0 - x, x)  # ImageOps.solarize: threshold 128
    blurred = torch.from_numpy(np.flatnonzero(choice == 2))
    if len(blurred):
        sigma = torch.from_numpy(rng.uniform(0.1, 2.0, len(blurred)))
        x[blurred] = gaussian_blur(x[blurred], sigma)
    if jitter > 0:
        factors = rng.uniform(max(0.0, 1 - jitter), 1 + jitter, (count, 3))
        order = rng.permuted(np.tile(np.arange(3), (count, 1)), axis=1)
        x = _jitter(x, torch.from_numpy(factors).float(), torch.from_numpy(order))
    return x.to(torch.uint8).permute(0, 2, 3, 1).contiguous().numpy()


def color_jitter(images: np.ndarray, factors: np.ndarray, order: np.ndarray) -> np.ndarray:
    """torchvision's ColorJitter(b, c, s) on PIL images, with its random draws given: images (B, H, W, C) uint8;
    factors (B, 3) for brightness, contrast, saturation; order (B, 3), each row a permutation of 0, 1, 2 (the
    operations in the order applied). With a fourth column in both, hue too (ColorJitter(b, c, s, h)): factors
    (B, 4), orders permutations of 0..3. Returns (B, H, W, C) uint8."""
    import torch

    x = torch.from_numpy(np.ascontiguousarray(images)).permute(0, 3, 1, 2).float()
    x = _jitter(x, torch.as_tensor(factors, dtype=torch.float32), torch.as_tensor(order))
    return x.to(torch.uint8).permute(0, 2, 3, 1).contiguous().numpy()


def _jitter(x: torch.Tensor, factors: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    """x (B, C, H, W) float of whole levels; step k applies to each image the operation order[:, k] names
    (0 brightness, 1 contrast, 2 saturation, 3 hue: torchvision's ColorJitter numbering)."""
    import torch

    adjust = (_brightness, _contrast, _saturation, _hue)
    for step in range(order.shape[1]):
        for op, fn in enumerate(adjust):
            rows = torch.nonzero(order[:, step] == op).flatten()
            if len(rows):
                x[rows] = fn(x[rows], factors[rows, op][:, None, None, None])
    return x


def _blend(degenerate: torch.Tensor, x: torch.Tensor, factor: torch.Tensor) -> torch.Tensor:
    """Pillow's ImageEnhance: Image.blend(degenerate, image, factor) = degenerate + factor (image - degenerate) in
    float32, clipped to 0..255 and truncated to uint8 (Blend.c:62, :73-80)."""
    return (degenerate + factor * (x - degenerate)).clamp(0, 255).floor()


def _brightness(x: torch.Tensor, factor: torch.Tensor) -> torch.Tensor:
    import torch

    return _blend(torch.zeros_like(x), x, factor)  # ImageEnhance.Brightness: a black image


def _contrast(x: torch.Tensor, factor: torch.Tensor) -> torch.Tensor:
    import torch

    # ImageEnhance.Contrast: a flat image at the mean grey level, rounded to a whole level (ImageEnhance.py:74)
    mean = torch.floor(_gray(x).double().mean(dim=(1, 2, 3), keepdim=True) + 0.5).float()
    return _blend(mean, x, factor)


def _saturation(x: torch.Tensor, factor: torch.Tensor) -> torch.Tensor:
    # ImageEnhance.Color: the grey image; a grey (L) image is its own grey image, left alone
    return x if x.shape[1] == 1 else _blend(_gray(x), x, factor)


def _hue(x: torch.Tensor, factor: torch.Tensor) -> torch.Tensor:
    """torchvision's adjust_hue on a PIL image (transforms/_functional_pil.py): Pillow's RGB -> HSV, the hue band
    shifted by np.int32(factor * 255) levels modulo 256, HSV -> RGB; a grey (L) image is left alone. x (B, C, H, W)
    whole levels, factor (B, 1, 1, 1) in [-0.5, 0.5]. Pillow's own conversions, one image at a time, for exactness."""
    import torch

    if x.shape[1] == 1:
        return x
    images = x.to(torch.uint8).permute(0, 2, 3, 1).numpy()
    out = np.empty_like(images)
    for i, (image, f) in enumerate(zip(images, factor.flatten().tolist())):
        h, s, v = Image.fromarray(np.ascontiguousarray(image)).convert("HSV").split()
        shift = np.uint8(int(f * 255) % 256)  # int() truncates toward zero as np.int32 does; uint8 wraps around
        hue = Image.fromarray(np.asarray(h, dtype=np.uint8) + shift, "L")
        out[i] = np.asarray(Image.merge("HSV", (hue, s, v)).convert("RGB"))
    return torch.from_numpy(out).permute(0, 3, 1, 2).to(x.dtype)


def _gray(x: torch.Tensor) -> torch.Tensor:
    """PIL's RGB -> L on whole levels: (19595 R + 38470 G + 7471 B + 2^15) >> 16 (Pillow Convert.c:42), (B, 1, H, W)."""
    import torch

    if x.shape[1] == 1:
        return x
    rgb = x.to(torch.int64)
    return ((19595 * rgb[:, 0:1] + 38470 * rgb[:, 1:2] + 7471 * rgb[:, 2:3] + 0x8000) >> 16).to(x.dtype)


def gaussian_blur(x: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
    """Pillow's ImageFilter.GaussianBlur(radius=sigma), the call augment.py:38-42 makes, on each image of (B, C, H, W)
    whole levels with its own sigma; whole levels again.

    Pillow's radius is the standard deviation (ImageFilter.py:189); it approximates that Gaussian by three box blurs
    per axis whose border repeats the edge pixel, rounding to whole levels after each (BoxBlur.c:40-46, :236-332).
    The reference's call is made as it is: a convolution reproducing all of that exactly is slower than Pillow."""
    import torch

    images = x.to(torch.uint8).permute(0, 2, 3, 1).numpy()
    out = np.empty_like(images)
    for i, (image, s) in enumerate(zip(images, sigma.tolist())):
        blur = ImageFilter.GaussianBlur(radius=s)
        if image.shape[-1] == 3:
            out[i] = np.asarray(Image.fromarray(image).filter(blur))
        else:  # one band at a time (Pillow blurs every band alike)
            for c in range(image.shape[-1]):
                out[i, ..., c] = np.asarray(Image.fromarray(np.ascontiguousarray(image[..., c])).filter(blur))
    return torch.from_numpy(out).permute(0, 3, 1, 2).to(x.dtype)
