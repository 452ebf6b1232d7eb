"""DINO's multi-crop augmentation (facebookresearch/dino main_dino.py:419-464, `dino_crops`): its random draws per
view (`dino_views`), their application as Pillow computes each operation (`apply_dino_view`: the crops and colour
operations of decode.py and colour.py), and the Ray Data map function of self-supervised training
(`multicrop_batch`)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from PIL import Image

from study.data.images.colour import _gray, _jitter, gaussian_blur
from study.data.images.decode import ImageSpec, batch_crc, crop_resize, random_resized_boxes, to_pil

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
