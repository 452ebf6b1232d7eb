"""Images with per-pixel class masks: decoding, the crop and flip shared by image and mask, and the TaskData.

Per-sample work runs in Ray Data `map_batches` tasks on CPU workers, as for classification (`images`): a training
row gets one random resized crop box (torchvision's algorithm, `images.random_resized_boxes`) and one flip draw, and
both are applied to the image (bilinear, as mmsegmentation resizes images) and to the mask (nearest-neighbour, so no
label is invented at a border); evaluation resizes the short side to the model's side and takes the centre square.
The mask's labels then go through the source's label map (ADE20K: mmseg's reduce_zero_label). Tasks hand over uint8
images (B, C, S, S) and uint8 masks (B, S, S); the worker's batch steps normalise the images and make the masks int64.

Randomness as for classification: a map task draws from a generator seeded by (trial seed, epoch, CRC of the batch's
encoded images), so an epoch's crops depend only on the seed and the data.
"""

from __future__ import annotations

import io
from dataclasses import dataclass

import numpy as np
from PIL import Image

from study.data.build import IMAGE_BLOCK_BYTES, IMAGE_MAP_BATCH
from study.data.epoch import EpochSource
from study.data.images import (
    IMAGENET_MEAN,
    IMAGENET_STD,
    BatchMixer,
    batch_crc,
    encoded_bytes,
    random_resized_boxes,
    to_pil,
)
from study.data.task_data import TaskData
from study.errors import UserError

# The label of unlabelled pixels in every mask a segmentation source delivers (models/probes.py's default ignore
# index; not imported from there, so that the decode tasks start without torch)
IGNORE_INDEX = 255


def reduce_zero_label() -> np.ndarray:
    """mmseg's reduce_zero_label as a lookup table over uint8 labels: 0 ("other") -> 255, k -> k - 1, and 255 stays
    255 (mmseg: label[label == 0] = 255; label -= 1; label[label == 254] = 255)."""
    table = np.arange(256, dtype=np.int64) - 1
    table[0] = IGNORE_INDEX
    table[255] = IGNORE_INDEX
    return table.astype(np.uint8)


@dataclass(frozen=True)
class SegmentationSpec:
    """Everything a map task needs to turn source rows into model-ready uint8 images and masks."""

    image_size: int
    augment: str = "none"  # none | basic
    crop_scale: tuple[float, float] = (0.25, 1.0)
    crop_ratio: tuple[float, float] = (3 / 4, 4 / 3)
    hflip: bool = True
    image_column: str = "image"
    mask_column: str = "mask"
    label_map: tuple[int, ...] | None = None  # 256 entries: the label each uint8 mask value becomes


def decode_mask(value) -> Image.Image:
    """A single-channel mask (an encoded PNG, the hub's {bytes, path} struct, or an integer array) as a PIL image of
    mode L, its pixel values the labels as stored (palette indices, not colours, for a P-mode PNG)."""
    data = encoded_bytes(value)
    array = np.asarray(Image.open(io.BytesIO(data))) if data is not None else np.asarray(value)
    if array.ndim == 3 and array.shape[-1] == 1:
        array = array[..., 0]
    if array.ndim != 2:
        raise UserError(f"dataset.mask_column: masks must have one channel, found shape {array.shape}")
    if array.dtype != np.uint8:
        if array.size and (array.min() < 0 or array.max() > 255):
            raise UserError("dataset.mask_column: mask labels must lie in 0..255")
        array = array.astype(np.uint8)
    return Image.fromarray(np.ascontiguousarray(array))  # 2-D uint8: mode L


def crop_resize(image: Image.Image, box, size: int, resample) -> np.ndarray:
    """The crop `box` (left, top, right, bottom; whole pixels) resized to size x size with `resample`: (S, S) or
    (S, S, C) uint8. The crop is cut first, so no pixel outside the box enters (as `images.crop_resize`)."""
    left, top, right, bottom = (int(v) for v in box)
    if (left, top, right, bottom) != (0, 0, *image.size):
        image = image.crop((left, top, right, bottom))
    return np.asarray(image if image.size == (size, size) else image.resize((size, size), resample))


def short_side_centre_crop(image: Image.Image, size: int, resample) -> np.ndarray:
    """The short side resized to `size` (the long side to int(size * long / short)), then the centre square, offsets
    int(round(...)) as torchvision's CenterCrop: (S, S) or (S, S, C) uint8."""
    width, height = image.size
    short, long = min(width, height), max(width, height)
    if short != size:
        new_long = int(size * long / short)
        image = image.resize((size, new_long) if width <= height else (new_long, size), resample)
        width, height = image.size
    if (width, height) != (size, size):
        top, left = int(round((height - size) / 2.0)), int(round((width - size) / 2.0))
        image = image.crop((left, top, left + size, top + size))
    return np.asarray(image)


def transform_segmentation_batch(batch: dict, spec: SegmentationSpec, train: bool, seed: int = 0,
                                 epoch_clock=None) -> dict:
    """Ray Data map_batches function: source rows -> {"image": uint8 (B, 3, S, S), "mask": uint8 (B, S, S)}."""
    values, masks = batch[spec.image_column], batch[spec.mask_column]
    size, count = spec.image_size, len(values)
    images = [to_pil(value, "RGB") for value in values]
    labels = [decode_mask(value) for value in masks]
    for image, mask in zip(images, labels):
        if image.size != mask.size:
            raise UserError(f"dataset.mask_column: a mask of {mask.size[0]}x{mask.size[1]} pixels belongs to an image "
                            f"of {image.size[0]}x{image.size[1]}")
    out_images = np.empty((count, size, size, 3), dtype=np.uint8)
    out_masks = np.empty((count, size, size), dtype=np.uint8)
    if train and spec.augment != "none":
        epoch = epoch_clock.epoch() if epoch_clock is not None else 0
        rng = np.random.default_rng([seed, epoch, batch_crc(values)])
        boxes = random_resized_boxes(rng, np.array([image.size for image in images]), spec.crop_scale, spec.crop_ratio)
        flip = (rng.random(count) < 0.5) if spec.hflip else np.zeros(count, dtype=bool)
        for i, (image, mask, box) in enumerate(zip(images, labels, boxes)):
            out_images[i] = crop_resize(image, box, size, Image.BILINEAR)
            out_masks[i] = crop_resize(mask, box, size, Image.NEAREST)
        out_images[flip] = out_images[flip, :, ::-1]  # (B, H, W, C): the width axis
        out_masks[flip] = out_masks[flip, :, ::-1]
    else:
        for i, (image, mask) in enumerate(zip(images, labels)):
            out_images[i] = short_side_centre_crop(image, size, Image.BILINEAR)
            out_masks[i] = short_side_centre_crop(mask, size, Image.NEAREST)
    if spec.label_map is not None:
        out_masks = np.asarray(spec.label_map, dtype=np.uint8)[out_masks]
    return {"image": np.ascontiguousarray(out_images.transpose(0, 3, 1, 2)), "mask": out_masks}


@dataclass(frozen=True)
class SegmentationBatch:
    """Worker-side steps: normalise the images (BatchMixer's rule), masks to int64. Nothing random happens here: a
    mask has no soft-label form for Mixup or CutMix to mix."""

    pixels: BatchMixer

    def evaluate(self, batch: dict) -> dict:
        return {"image": self.pixels.normalize(batch["image"]), "mask": batch["mask"].long()}

    def __call__(self, batch: dict, rng: np.random.Generator) -> dict:
        return self.evaluate(batch)


def segmentation_task(cfg, train_rows, val_rows, *, seed: int, num_classes: int, image_column: str, mask_column: str,
                      num_train: int | None, num_val: int | None, label_map: np.ndarray | None = None,
                      materialize: bool = False, params: dict | None = None) -> TaskData:
    """Decode + crop/flip (train) and decode + resize + centre crop (val) of images and masks in Ray Data tasks.

    materialize: for small in-memory sources, run the deterministic stages once now instead of every epoch."""
    spec = SegmentationSpec(
        image_size=cfg.image_size, augment=cfg.augment, crop_scale=tuple(cfg.crop_scale),
        crop_ratio=tuple(cfg.crop_ratio), hflip=cfg.hflip, image_column=image_column, mask_column=mask_column,
        label_map=tuple(int(v) for v in label_map) if label_map is not None else None,
    )
    random_train = cfg.augment != "none"
    clock = EpochSource() if random_train else None
    train = train_rows.map_batches(
        transform_segmentation_batch, fn_kwargs={"spec": spec, "train": True, "seed": seed, "epoch_clock": clock},
        batch_size=IMAGE_MAP_BATCH, batch_format="numpy",
    )
    val = val_rows.map_batches(
        transform_segmentation_batch, fn_kwargs={"spec": spec, "train": False}, batch_size=IMAGE_MAP_BATCH,
        batch_format="numpy",
    )
    for ds in (train, val):
        ds.context.target_max_block_size = IMAGE_BLOCK_BYTES
    if materialize:
        val = val.materialize()
        if not random_train:
            train = train.materialize()
    pixels = BatchMixer(num_classes=num_classes, mean=tuple(cfg.mean or IMAGENET_MEAN),
                        std=tuple(cfg.std or IMAGENET_STD))
    if len(pixels.mean) != 3:
        raise UserError(f"dataset.mean/std: need 3 values (one per channel), got {len(pixels.mean)}")
    return TaskData(
        datasets={"train": train, "val": val},
        model_overrides={"num_classes": num_classes, "image_size": cfg.image_size, "in_chans": 3},
        num_train=num_train,
        num_val=num_val,
        batch_steps=SegmentationBatch(pixels),
        params={**(params or {}), "num_train": num_train, "num_val": num_val, "ignore_index": IGNORE_INDEX},
        shuffle_buffer=cfg.shuffle_buffer,
        epoch_clock=clock,
    )
