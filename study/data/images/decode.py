"""Decoding source cells to PIL images and the crops of the supervised recipe: the random resized crop's boxes
(torchvision's algorithm), the crop resized bicubic, and DeiT's evaluation resize and centre crop (deit
datasets.py), each as Pillow computes it, on whole uint8 levels."""

from __future__ import annotations

import io
import math
import zlib
from dataclasses import dataclass

import numpy as np
from PIL import Image


@dataclass(frozen=True)
class ImageSpec:
    """Everything a map task needs to turn source rows into model-ready uint8 images."""

    image_size: int
    in_chans: int
    augment: str = "none"  # none | basic | three_augment
    crop_scale: tuple[float, float] = (0.08, 1.0)
    crop_ratio: tuple[float, float] = (3 / 4, 4 / 3)
    hflip: bool = True
    color_jitter: float = 0.3
    eval_crop_pct: float = 1.0
    image_column: str = "image"
    label_column: str = "label"

    @property
    def mode(self) -> str:
        return "L" if self.in_chans == 1 else "RGB"

    @property
    def eval_resize(self) -> int:
        return int(math.floor(self.image_size / self.eval_crop_pct))


def encoded_bytes(value) -> bytes | None:
    """The encoded file inside a cell: raw bytes, or a Hugging Face Image struct {"bytes": ..., "path": ...}."""
    if isinstance(value, (bytes, bytearray, memoryview)):
        return bytes(value)
    if isinstance(value, dict):
        return value.get("bytes")
    return None


def to_pil(value, mode: str) -> Image.Image:
    data = encoded_bytes(value)
    if data is not None:
        image = Image.open(io.BytesIO(data))
    else:
        array = np.asarray(value)
        if array.ndim == 3 and array.shape[-1] == 1:
            array = array[..., 0]
        image = Image.fromarray(array.astype(np.uint8, copy=False))
    return image if image.mode == mode else image.convert(mode)


def batch_crc(values) -> int:
    crc = 0
    for value in values:
        data = encoded_bytes(value)
        crc = zlib.crc32(data if data is not None else np.ascontiguousarray(value).tobytes(), crc)
    return crc


def random_resized_boxes(rng: np.random.Generator, sizes: np.ndarray, scale, ratio, attempts: int = 10) -> np.ndarray:
    """Crop boxes (left, top, right, bottom) of the random resized crop for images of sizes (B, 2) = (W, H).

    The torchvision algorithm, vectorised: up to `attempts` draws of area and log-aspect per image, the first that
    fits wins, otherwise a centre crop with the aspect ratio clamped to `ratio`."""
    width, height = sizes[:, 0:1].astype(np.float64), sizes[:, 1:2].astype(np.float64)
    count = len(sizes)
    area = width * height * rng.uniform(scale[0], scale[1], (count, attempts))
    aspect = np.exp(rng.uniform(math.log(ratio[0]), math.log(ratio[1]), (count, attempts)))
    w = np.round(np.sqrt(area * aspect))
    h = np.round(np.sqrt(area / aspect))
    fits = (w > 0) & (h > 0) & (w <= width) & (h <= height)
    u_top, u_left = rng.random((count, attempts)), rng.random((count, attempts))
    first = np.argmax(fits, axis=1)
    rows = np.arange(count)
    ok = fits[rows, first]
    w, h = w[rows, first], h[rows, first]
    top = np.floor(u_top[rows, first] * (height[:, 0] - h + 1))
    left = np.floor(u_left[rows, first] * (width[:, 0] - w + 1))
    # fallback: the whole image, cropped centrally to the nearest allowed aspect ratio
    in_ratio = width[:, 0] / height[:, 0]
    fw = np.where(in_ratio < ratio[0], width[:, 0],
                  np.where(in_ratio > ratio[1], np.round(height[:, 0] * ratio[1]), width[:, 0]))
    fh = np.where(in_ratio < ratio[0], np.round(width[:, 0] / ratio[0]), height[:, 0])
    w, h = np.where(ok, w, fw), np.where(ok, h, fh)
    top = np.where(ok, top, (height[:, 0] - h) // 2)
    left = np.where(ok, left, (width[:, 0] - w) // 2)
    return np.stack([left, top, left + w, top + h], axis=1)


def _array(image: Image.Image) -> np.ndarray:
    array = np.asarray(image, dtype=np.uint8)
    return array[..., None] if array.ndim == 2 else array


def crop_resize(image: Image.Image, box, size: int) -> np.ndarray:
    """The crop `box` (left, top, right, bottom; whole pixels) resized bicubic to size x size, (S, S, C) uint8.

    timm's RandomResizedCropAndInterpolation as 3-Augment uses it (deit augment.py:96, :105): crop first, then
    resize the crop, so no pixel outside the box enters (PIL's resize(box=...) would read past the box's edges)."""
    left, top, right, bottom = (int(v) for v in box)
    if (left, top, right, bottom) != (0, 0, *image.size):
        image = image.crop((left, top, right, bottom))
    return _array(image if image.size == (size, size) else image.resize((size, size), Image.BICUBIC))


def center_crop_resize(image: Image.Image, resize: int, size: int) -> np.ndarray:
    """DeiT's evaluation transform (deit datasets.py:101-105): torchvision's Resize(resize, bicubic), the short side
    to `resize` and the long side to int(resize * long / short), then CenterCrop(size), offsets int(round(...))."""
    width, height = image.size
    short, long = min(width, height), max(width, height)
    if short != resize:
        new_long = int(resize * long / short)
        image = image.resize((resize, new_long) if width <= height else (new_long, resize), Image.BICUBIC)
        width, height = image.size
    if (width, height) != (size, size):
        top, left = int(round((height - size) / 2.0)), int(round((width - size) / 2.0))
        image = image.crop((left, top, left + size, top + size))
    return _array(image)


def eval_images(values, spec: ImageSpec) -> np.ndarray:
    """Resize the short side to spec.eval_resize and centre crop spec.image_size: (B, S, S, C) uint8."""
    out = np.empty((len(values), spec.image_size, spec.image_size, spec.in_chans), dtype=np.uint8)
    for i, value in enumerate(values):
        out[i] = center_crop_resize(to_pil(value, spec.mode), spec.eval_resize, spec.image_size)
    return out
