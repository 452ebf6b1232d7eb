"""The supervised recipe as a Ray Data map function (`transform_batch`): source rows decoded, then for training the
random resized crop, flip and (three_augment) 3-Augment with colour jitter (`train_images`), for evaluation DeiT's
resize and centre crop; with repeated augmentation, several augmented copies of each chosen image."""

from __future__ import annotations

import numpy as np

from study.data.images.colour import three_augment
from study.data.images.decode import (
    ImageSpec,
    batch_crc,
    crop_resize,
    eval_images,
    random_resized_boxes,
    to_pil,
)


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
