"""Image decoding and the DeiT-III training recipe on numpy/PIL/torch (no torchvision), plus worker-side batch steps.

Per-sample work (decode, random resized crop, flip, 3-Augment, colour jitter; evaluation resize + centre crop) runs
in Ray Data `map_batches` tasks on CPU workers and hands uint8 (B, C, S, S) images to the train workers. Batch-level
work that needs the shuffled training batch (normalisation, Mixup/CutMix, label smoothing) runs in the worker's batch
iterator on the training device, as timm does.

The reference is facebookresearch/deit: augment.py (3-Augment) and datasets.py (evaluation). Its operations are
torchvision's on PIL images, so each one here computes what Pillow computes, on whole uint8 levels after every step:
bicubic resampling of the crop alone, PIL's grey level, solarisation at 128, Pillow's own Gaussian blur, and
brightness/contrast/saturation as Pillow's blends, in a random order per image.

DINO's multi-crop augmentation (facebookresearch/dino main_dino.py:419-464, `dino_crops`) is made of the same
operations, plus torchvision's hue jitter (Pillow's HSV conversion).

Randomness: a map task draws from a generator seeded by (trial seed, epoch, CRC of the batch's encoded images), so an
epoch's augmentations depend only on the seed and the data, never on which task or process ran them.
"""

from __future__ import annotations

import io
import math
import zlib
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
from PIL import Image, ImageFilter

if TYPE_CHECKING:
    import torch

# torch is imported where it is used: the Ray Data decode tasks of the basic recipe then start without it

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


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


def train_images(values, spec: ImageSpec, rng: np.random.Generator) -> np.ndarray:
    """Random resized crop, flip, and (three_augment) 3-Augment + colour jitter: (B, S, S, C) uint8."""
    if spec.augment == "none":
        return eval_images(values, spec)
    images = [to_pil(value, spec.mode) for value in values]
    sizes = np.array([image.size for image in images])
    boxes = random_resized_boxes(rng, sizes, spec.crop_scale, spec.crop_ratio)
    out = np.stack([crop_resize(image, box, spec.image_size) for image, box in zip(images, boxes)])
    if spec.hflip:
        flip = rng.random(len(out)) < 0.5
        out[flip] = out[flip, :, ::-1]
    if spec.augment == "three_augment":
        out = three_augment(out, rng, spec.color_jitter)
    return out


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


DINO_JITTER = (0.4, 0.4, 0.2, 0.1)  # ColorJitter(brightness, contrast, saturation, hue), main_dino.py:424


@dataclass(frozen=True)
class DinoView:
    """One view of DINO's multi-crop augmentation for a batch of B images, its random draws made
    (DataAugmentationDINO, main_dino.py:419-456): crop, flip, colour jitter, grey scale, blur, solarisation."""

    size: int  # output side S
    boxes: np.ndarray  # (B, 4) crop boxes (left, top, right, bottom)
    flip: np.ndarray  # (B,) bool: horizontal flip
    jitter: np.ndarray  # (B,) bool: colour jitter applied
    factors: np.ndarray  # (B, 4) brightness, contrast, saturation and hue factors
    order: np.ndarray  # (B, 4) the jitter's operations (numbered as factors' columns) in the order applied
    gray: np.ndarray  # (B,) bool: grey scale
    blur: np.ndarray  # (B,) Gaussian blur radius, 0 where none
    solarize: np.ndarray  # (B,) bool


def dino_views(rng: np.random.Generator, sizes: np.ndarray, global_size: int = 224, local_size: int = 96,
               local_crops: int = 8, global_scale: tuple[float, float] = (0.4, 1.0),
               local_scale: tuple[float, float] = (0.05, 0.4)) -> list[DinoView]:
    """The random draws of DINO's 2 + local_crops views of images of sizes (B, 2) = (W, H): two global views of side
    ``global_size`` (the first always blurred, the second blurred with p 0.1 and solarised with p 0.2), then the
    local views of side ``local_size`` (blurred with p 0.5). The defaults are main_dino.py's (:108-117, :436,
    :452)."""
    views = [_dino_view(rng, sizes, global_size, global_scale, blur=1.0, solarize=0.0),  # :435-440
             _dino_view(rng, sizes, global_size, global_scale, blur=0.1, solarize=0.2)]  # :442-448
    views += [_dino_view(rng, sizes, local_size, local_scale, blur=0.5, solarize=0.0)  # :451-456
              for _ in range(local_crops)]
    return views


def _dino_view(rng: np.random.Generator, sizes: np.ndarray, size: int, scale, blur: float,
               solarize: float) -> DinoView:
    count = len(sizes)
    boxes = random_resized_boxes(rng, sizes, scale, (3 / 4, 4 / 3))  # RandomResizedCrop's default ratio
    flip = rng.random(count) < 0.5  # RandomHorizontalFlip(p=0.5), main_dino.py:422
    jitter = rng.random(count) < 0.8  # RandomApply([ColorJitter(...)], p=0.8), :423-426
    b, c, s, h = DINO_JITTER  # ColorJitter's ranges: [max(0, 1 - x), 1 + x]; hue [-h, h]
    factors = rng.uniform([max(0.0, 1 - b), max(0.0, 1 - c), max(0.0, 1 - s), -h], [1 + b, 1 + c, 1 + s, h],
                          (count, 4))
    order = rng.permuted(np.tile(np.arange(4), (count, 1)), axis=1)  # ColorJitter: torch.randperm(4)
    gray = rng.random(count) < 0.2  # RandomGrayscale(p=0.2), :427
    blurred = rng.random(count) <= blur  # utils.py:46: `random.random() <= self.prob`
    radius = np.where(blurred, rng.uniform(0.1, 2.0, count), 0.0)  # utils.py:40, :52
    solar = rng.random(count) < solarize  # utils.py:65
    return DinoView(size, boxes, flip, jitter, factors, order, gray, radius, solar)


def apply_dino_view(images: list[Image.Image], view: DinoView) -> np.ndarray:
    """One DINO view of PIL images (all of one mode): the crop resized bicubic to view.size, then the flip, the
    colour jitter, grey scale, Gaussian blur and solarisation (threshold 128) where drawn, in that order, each as
    Pillow computes it. Returns (B, S, S, C) uint8."""
    import torch

    out = np.stack([crop_resize(image, box, view.size) for image, box in zip(images, view.boxes)])
    out[view.flip] = out[view.flip, :, ::-1]
    x = torch.from_numpy(out).permute(0, 3, 1, 2).float()  # B, C, S, S in 0..255, whole levels throughout
    rows = torch.from_numpy(np.flatnonzero(view.jitter))
    if len(rows):
        factors = torch.from_numpy(view.factors[view.jitter]).float()
        x[rows] = _jitter(x[rows], factors, torch.from_numpy(view.order[view.jitter]))
    x = torch.where(torch.from_numpy(view.gray)[:, None, None, None], _gray(x).expand_as(x), x)
    blurred = torch.from_numpy(np.flatnonzero(view.blur > 0))
    if len(blurred):
        x[blurred] = gaussian_blur(x[blurred], torch.from_numpy(view.blur[blurred.numpy()]))
    solar = torch.from_numpy(view.solarize)[:, None, None, None]
    x = torch.where(solar & (x >= 128), 255.0 - x, x)  # ImageOps.solarize: threshold 128
    return x.to(torch.uint8).permute(0, 2, 3, 1).contiguous().numpy()


def dino_crops(images: list[Image.Image], rng: np.random.Generator, global_size: int = 224, local_size: int = 96,
               local_crops: int = 8, global_scale: tuple[float, float] = (0.4, 1.0),
               local_scale: tuple[float, float] = (0.05, 0.4)) -> list[np.ndarray]:
    """DINO's multi-crop augmentation (DataAugmentationDINO, main_dino.py:419-464) of PIL images (decode with
    ``to_pil``): 2 global crops (B, G, G, C) then ``local_crops`` local crops (B, L, L, C), uint8, normalisation
    left to the worker (``BatchMixer.normalize``). The draws are ``dino_views(rng, ...)``'s."""
    sizes = np.array([image.size for image in images])
    views = dino_views(rng, sizes, global_size, local_size, local_crops, global_scale, local_scale)
    return [apply_dino_view(images, view) for view in views]


def transform_batch(batch: dict, spec: ImageSpec, train: bool, seed: int = 0, epoch_clock=None,
                    repeats: int = 1) -> dict:
    """Ray Data map_batches function: source rows -> {"image": uint8 (B, C, S, S), "label": int64 (B,)}.

    Repeated augmentation (training, `repeats` r > 1, DeiT's RASampler): a random ceil(B / r) of the batch's rows,
    each r times with augmentations of its own, as {"image": uint8 (k, r, C, S, S), "label": (k,)}: the copies of
    an image travel as one row, so the worker's shuffle keeps them together (TaskData.train_batches lays them out
    side by side), and an epoch still holds at least as many images as the split."""
    values = batch[spec.image_column]
    labels = np.asarray(batch[spec.label_column], dtype=np.int64)
    if train and spec.augment != "none":
        epoch = epoch_clock.epoch() if epoch_clock is not None else 0
        rng = np.random.default_rng([seed, epoch, batch_crc(values)])
        if repeats > 1:
            chosen = rng.permutation(len(values))[: -(-len(values) // repeats)]
            images = train_images(np.repeat(values[chosen], repeats, axis=0), spec, rng)
            return {"image": np.ascontiguousarray(images.transpose(0, 3, 1, 2)).reshape(
                        len(chosen), repeats, spec.in_chans, spec.image_size, spec.image_size),
                    "label": labels[chosen]}
        images = train_images(values, spec, rng)
    else:
        images = eval_images(values, spec)
    return {"image": np.ascontiguousarray(images.transpose(0, 3, 1, 2)), "label": labels}


@dataclass(frozen=True)
class MultiCropSpec:
    """DINO's views of an image: 2 global ones of `global_size` and `local_crops` local ones of `local_size`."""

    global_size: int
    local_size: int
    local_crops: int
    global_scale: tuple[float, float]
    local_scale: tuple[float, float]


def multicrop_batch(batch: dict, spec: ImageSpec, train: bool, views: MultiCropSpec, seed: int = 0,
                    epoch_clock=None) -> dict:
    """Ray Data map_batches function for self-supervised training: source rows -> {"view_0": the first global
    view, uint8 (B, C, G, G), "view_1": the second, "view_2"...: the local views (B, C, L, L), "label": int64 (B,)},
    drawn as DINO draws them (`dino_crops`), seeded by (seed, epoch, the batch's content) as `transform_batch`."""
    values = batch[spec.image_column]
    epoch = epoch_clock.epoch() if epoch_clock is not None else 0
    rng = np.random.default_rng([seed, epoch, batch_crc(values)])
    crops = dino_crops([to_pil(value, spec.mode) for value in values], rng, views.global_size, views.local_size,
                       views.local_crops, views.global_scale, views.local_scale)
    out = {f"view_{i}": np.ascontiguousarray(crop.transpose(0, 3, 1, 2)) for i, crop in enumerate(crops)}
    out["label"] = np.asarray(batch[spec.label_column], dtype=np.int64)
    return out


@dataclass(frozen=True)
class BatchMixer:
    """Worker-side steps on a training batch: normalisation, then Mixup/CutMix and label smoothing (timm's rules)."""

    num_classes: int
    mean: tuple[float, ...]
    std: tuple[float, ...]
    mixup: float = 0.0
    cutmix: float = 0.0
    mix_prob: float = 1.0
    switch_prob: float = 0.5
    label_smoothing: float = 0.0
    views: int = 0  # multi-crop training batches: their views, normalised, as the list "crops" (no mixing)

    @property
    def soft(self) -> bool:
        return self.mixup > 0 or self.cutmix > 0 or self.label_smoothing > 0

    def normalize(self, images: torch.Tensor) -> torch.Tensor:
        import torch

        mean = torch.tensor(self.mean, device=images.device, dtype=torch.float32).view(1, -1, 1, 1)
        std = torch.tensor(self.std, device=images.device, dtype=torch.float32).view(1, -1, 1, 1)
        return (images.float() / 255.0 - mean) / std

    def evaluate(self, batch: dict) -> dict:
        return {"image": self.normalize(batch["image"]), "label": batch["label"].long()}

    def __call__(self, batch: dict, rng: np.random.Generator) -> dict:
        import torch

        labels = batch["label"].long()
        if self.views:
            return {"crops": [self.normalize(batch[f"view_{i}"]) for i in range(self.views)], "label": labels}
        images = self.normalize(batch["image"])
        out = {"image": images, "label": labels}
        if not self.soft:
            return out
        off = self.label_smoothing / self.num_classes
        targets = torch.full((len(labels), self.num_classes), off, device=images.device)
        targets.scatter_(1, labels[:, None], 1.0 - self.label_smoothing + off)
        if (self.mixup > 0 or self.cutmix > 0) and rng.random() < self.mix_prob:
            use_cutmix = self.cutmix > 0 and (self.mixup == 0 or rng.random() < self.switch_prob)
            alpha = self.cutmix if use_cutmix else self.mixup
            lam = float(rng.beta(alpha, alpha))
            flipped = images.flip(0)
            if use_cutmix:
                images, lam = cutmix(images, flipped, lam, rng)
            else:
                images = images * lam + flipped * (1 - lam)
            targets = targets * lam + targets.flip(0) * (1 - lam)
            out["image"] = images
        out["soft_label"] = targets
        return out


def cutmix(images: torch.Tensor, flipped: torch.Tensor, lam: float, rng: np.random.Generator):
    """Paste a box of area ~(1 - lam) from the flipped batch; lam is corrected to the box actually pasted."""
    height, width = images.shape[-2:]
    cut = math.sqrt(1 - lam)
    ch, cw = int(height * cut), int(width * cut)
    cy, cx = int(rng.integers(0, height)), int(rng.integers(0, width))
    y0, y1 = max(cy - ch // 2, 0), min(cy + ch // 2, height)
    x0, x1 = max(cx - cw // 2, 0), min(cx + cw // 2, width)
    images = images.clone()
    images[..., y0:y1, x0:x1] = flipped[..., y0:y1, x0:x1]
    return images, 1 - (y1 - y0) * (x1 - x0) / (height * width)
