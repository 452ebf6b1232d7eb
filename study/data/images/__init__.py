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

The modules, along those seams: decode.py (decoding, crops, the evaluation transform), colour.py (3-Augment, colour
jitter, grey, blur), augment.py (the supervised recipe's map function), multicrop.py (DINO's views and their map
function), mixing.py (normalisation, Mixup/CutMix, label smoothing on the worker). None imports torch on import: the
Ray Data decode tasks of the basic recipe start without it.
"""

from study.data.images.augment import train_images, transform_batch
from study.data.images.colour import color_jitter, gaussian_blur, three_augment
from study.data.images.decode import (
    ImageSpec,
    batch_crc,
    center_crop_resize,
    crop_resize,
    encoded_bytes,
    eval_images,
    random_resized_boxes,
    to_pil,
)
from study.data.images.mixing import IMAGENET_MEAN, IMAGENET_STD, BatchMixer, cutmix
from study.data.images.multicrop import (
    DINO_JITTER,
    DinoView,
    MultiCropSpec,
    apply_dino_view,
    dino_crops,
    dino_views,
    multicrop_batch,
)

__all__ = ["DINO_JITTER", "IMAGENET_MEAN", "IMAGENET_STD", "BatchMixer", "DinoView", "ImageSpec", "MultiCropSpec",
           "apply_dino_view", "batch_crc", "center_crop_resize", "color_jitter", "crop_resize", "cutmix", "dino_crops",
           "dino_views", "encoded_bytes", "eval_images", "gaussian_blur", "multicrop_batch", "random_resized_boxes",
           "three_augment", "to_pil", "train_images", "transform_batch"]
