"""Segmentation sources: ADE20K (SceneParse150) from the hub's parquet files, and generated shapes (offline).

ADE20K is read as every hub source is (`hub.py`): a local copy (`local_dir`, or `$LAPSTUDY_DATA_DIR/<hub id>`) when
there is one, else the hub, failing within seconds with the offline alternatives when it does not answer; the parquet
files stream through `ray.data.read_parquet` either way. Its files are found by the glob `split_files` rather than by
`datasets`' builder: the benchmark's repository keeps its parquet files on the parquet converter's branch, one folder
per configuration, without a dataset card naming them, and the builder would merge both configurations into one.
"""

from __future__ import annotations

import glob
from urllib.parse import quote

import numpy as np
import ray

from study.data.config import ADE20KConfig, ShapesSegmentationConfig
from study.data.hub import hf_token, local_copy, require_hub
from study.data.image_sources import _check_columns, _parquet_metadata, _seeded_order
from study.data.segmentation import reduce_zero_label, segmentation_task
from study.data.task_data import TaskData
from study.errors import UserError

# SceneParse150's split sizes (the benchmark's training and validation images)
ADE20K_SIZES = {"train": 20_210, "validation": 2_000}


def ade20k_files(cfg: ADE20KConfig) -> tuple[list[str], list[str], object | None, bool]:
    """(training files, validation files, pyarrow filesystem or None for local files, read from a local copy)."""
    local = local_copy(cfg.hub_id, cfg.local_dir)
    if local is None:
        require_hub("ade20k", cfg.hub_id)
        import pyarrow.fs
        from huggingface_hub import HfFileSystem

        hub = HfFileSystem(token=hf_token())
        root = f"datasets/{cfg.hub_id}" + (f"@{quote(cfg.revision, safe='')}" if cfg.revision else "")
        find, where = hub.glob, f"{cfg.hub_id}" + (f" at {cfg.revision}" if cfg.revision else "")
        filesystem = pyarrow.fs.PyFileSystem(pyarrow.fs.FSSpecHandler(hub))
    else:
        root, find, where, filesystem = local, glob.glob, local, None
    splits = []
    for field_name, split in (("train_split", cfg.train_split), ("val_split", cfg.val_split)):
        pattern = cfg.split_files.format(split=split)
        try:
            files = sorted(f for f in find(f"{root}/{pattern}") if f.endswith(".parquet"))
        except FileNotFoundError as error:  # a hub repository or revision that does not exist (or is not visible)
            raise UserError(f"dataset.hub_id: cannot open {where}: {str(error).splitlines()[0]}") from None
        if not files:
            raise UserError(f"dataset.{field_name}: no parquet files match {pattern} in {where}")
        splits.append(files)
    return splits[0], splits[1], filesystem, local is not None


def load_ade20k(cfg: ADE20KConfig, seed: int) -> TaskData:
    train_files, val_files, filesystem, local = ade20k_files(cfg)
    _check_columns(train_files[0], filesystem, {"image_column": cfg.image_column, "mask_column": cfg.mask_column})
    columns = [cfg.image_column, cfg.mask_column]
    read = lambda files: ray.data.read_parquet(files, filesystem=filesystem, columns=columns)  # noqa: E731
    if local:  # parquet footers: exact, and cheap on local files
        rows = lambda files: sum(_parquet_metadata(f, None).num_rows for f in files)  # noqa: E731
        num_train, num_val = rows(train_files), rows(val_files)
    elif cfg.hub_id == ADE20KConfig.model_fields["hub_id"].default:
        num_train, num_val = ADE20K_SIZES.get(cfg.train_split), ADE20K_SIZES.get(cfg.val_split)
    else:
        num_train = num_val = None  # footers of remote files cost a request each
    return segmentation_task(
        cfg, read(_seeded_order(train_files, seed)), read(val_files), seed=seed, num_classes=cfg.num_classes,
        image_column=cfg.image_column, mask_column=cfg.mask_column, num_train=num_train, num_val=num_val,
        label_map=reduce_zero_label() if cfg.reduce_zero_label else None,
        params={"source": "ade20k", "hub_id": cfg.hub_id, "read_from": "local copy" if local else "hub",
                "val_split": cfg.val_split},
    )


# ---- generated shapes -------------------------------------------------------------------------------------------

SHAPE_CLASSES = ("background", "disc", "square", "triangle")
# palette "by_class": saturated primaries, far from the grey background in every channel difference
CLASS_COLOURS = np.array([[0, 0, 0], [220, 30, 30], [30, 200, 30], [30, 30, 220]], dtype=np.uint8)


def render_shapes(seed, size: int, shapes_per_image: tuple[int, int] = (1, 4),
                  palette: str = "random") -> tuple[np.ndarray, np.ndarray]:
    """One picture: image (S, S, 3) uint8 and mask (S, S) uint8 (0 background, 1 disc, 2 square, 3 triangle).

    The background is a base colour plus two plane waves of random direction, frequency and phase, plus pixel noise
    (grey in every channel alike for palette "by_class"). Shapes have a random centre (anywhere in the image, so
    some leave it), circumradius 0.12-0.3 of the side and rotation; a later shape covers an earlier one, in the image
    and the mask alike. `seed`: anything np.random.default_rng takes."""
    rng = np.random.default_rng(seed)
    centres = np.arange(size) + 0.5
    y, x = np.meshgrid(centres, centres, indexing="ij")  # (S, S) pixel centres
    texture = np.zeros((size, size))
    for _ in range(2):
        frequency, angle, phase = rng.uniform(1, 4) * 2 * np.pi / size, rng.uniform(0, np.pi), rng.uniform(0, 2 * np.pi)
        texture += rng.uniform(5, 20) * np.sin(frequency * (x * np.cos(angle) + y * np.sin(angle)) + phase)
    if palette == "by_class":
        image = rng.uniform(90, 160) + texture[..., None] + rng.normal(0, 4, (size, size, 1))  # grey
        image = np.repeat(image, 3, axis=2)
    else:
        colour, strength = rng.uniform(40, 215, 3), rng.uniform(0.5, 1.0, 3)  # per channel
        image = colour + texture[..., None] * strength + rng.normal(0, 6, (size, size, 3))
    image = np.clip(np.round(image), 0, 255).astype(np.uint8)
    mask = np.zeros((size, size), dtype=np.uint8)
    for _ in range(int(rng.integers(shapes_per_image[0], shapes_per_image[1] + 1))):
        kind = int(rng.integers(1, len(SHAPE_CLASSES)))
        radius = rng.uniform(0.12, 0.3) * size
        cx, cy = rng.uniform(0, size, 2)
        angle = rng.uniform(0, 2 * np.pi)
        colour = CLASS_COLOURS[kind] if palette == "by_class" else rng.integers(0, 256, 3)
        dx, dy = x - cx, y - cy
        if kind == 1:
            inside = dx ** 2 + dy ** 2 <= radius ** 2
        elif kind == 2:
            u, v = dx * np.cos(angle) + dy * np.sin(angle), -dx * np.sin(angle) + dy * np.cos(angle)
            half = radius / np.sqrt(2)
            inside = (np.abs(u) <= half) & (np.abs(v) <= half)
        else:
            corners = [(radius * np.cos(angle + 2 * np.pi * k / 3), radius * np.sin(angle + 2 * np.pi * k / 3))
                       for k in range(3)]
            # the same side of all three edges (the corners go round in one direction)
            sides = [(bx - ax) * (dy - ay) - (by - ay) * (dx - ax)
                     for (ax, ay), (bx, by) in zip(corners, corners[1:] + corners[:1])]
            inside = np.all([s >= 0 for s in sides], axis=0) | np.all([s <= 0 for s in sides], axis=0)
        image[inside] = colour
        mask[inside] = kind
    return image, mask


def load_shapes_segmentation(cfg: ShapesSegmentationConfig, seed: int) -> TaskData:
    """Pictures 0..num_train-1 (each drawn from (split_seed, its index)) train, the next num_val validate: the split
    and the pictures are fixed by split_seed; the trial seed drives shuffling and augmentation only."""
    total = cfg.num_train + cfg.num_val
    pictures = [render_shapes([cfg.split_seed, i], cfg.image_size, cfg.shapes_per_image, cfg.palette)
                for i in range(total)]

    def rows(start, stop):
        items = [{"image": pictures[i][0], "mask": pictures[i][1]} for i in range(start, stop)]
        return ray.data.from_items(items, override_num_blocks=max(1, min(8, len(items) // 64)))

    return segmentation_task(
        cfg, rows(0, cfg.num_train), rows(cfg.num_train, total), seed=seed, num_classes=len(SHAPE_CLASSES),
        image_column="image", mask_column="mask", num_train=cfg.num_train, num_val=cfg.num_val, materialize=True,
        params={"source": "shapes_segmentation", "palette": cfg.palette},
    )
