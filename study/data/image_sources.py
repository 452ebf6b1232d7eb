"""Image-classification sources: Hugging Face hub datasets, local parquet shards, local image folders.

All three stream encoded images (PNG/JPEG bytes) through Ray Data; decoding and augmentation happen in the
map_batches stage built by `build.image_task`. Training reads go through the files in a seeded random order (an image
folder sorted by class would otherwise fill the workers' local shuffle buffers with one class).
"""

from __future__ import annotations

import glob
import json
import os

import numpy as np
import ray

from study.data.build import image_task
from study.data.config import HubImageConfig, HubPreset, ImageFolderConfig, ParquetImageConfig
from study.data.hub import resolve_parquet_files
from study.data.images import encoded_bytes, to_pil
from study.data.task_data import TaskData
from study.data.text import doc_hash_fraction
from study.errors import UserError


def _seeded_order(items: list, seed: int) -> list:
    """A fixed seeded permutation of the training files: the epochs then differ by the workers' local shuffle
    (seeded by (seed, epoch)), so epoch k is the same whether or not the run was resumed before it."""
    return [items[i] for i in np.random.default_rng(seed).permutation(len(items))]


def _hold_out(batch: dict, column: str, seed: int, fraction: float, keep_val: bool) -> dict:
    """Keep the rows on one side of the seeded hash split of the image bytes (identical images stay together)."""
    keys = [encoded_bytes(v) or np.ascontiguousarray(v).tobytes() for v in batch[column]]
    is_val = doc_hash_fraction(keys, seed) < fraction
    keep = is_val if keep_val else ~is_val
    return {name: values[keep] for name, values in batch.items()}


def _one_side(rows, column: str, seed: int, fraction: float, keep_val: bool):
    kwargs = {"column": column, "seed": seed, "fraction": fraction, "keep_val": keep_val}
    return rows.map_batches(_hold_out, fn_kwargs=kwargs, batch_format="numpy")


def _parquet_metadata(path: str, filesystem):
    import pyarrow.parquet as pq

    return pq.ParquetFile(filesystem.open_input_file(path) if filesystem else path).metadata


def _first_image(files: list[str], filesystem, column: str):
    import pyarrow.parquet as pq

    for path in files:
        parquet = pq.ParquetFile(filesystem.open_input_file(path) if filesystem else path)
        if column not in parquet.schema_arrow.names:
            raise UserError(
                f"dataset.image_column: {column!r} is not a column of {path}; "
                f"columns: {', '.join(parquet.schema_arrow.names)}"
            )
        for group in range(parquet.num_row_groups):
            cells = parquet.read_row_group(group, columns=[column]).column(0).to_pylist()
            if cells:
                value = cells[0]
                return to_pil(value if not isinstance(value, list) else np.asarray(value, dtype=np.uint8), "RGB"), \
                    _native_mode(value)
    raise UserError(f"dataset: no rows in {files[0]}")


def _native_mode(value) -> str:
    import io

    from PIL import Image

    data = encoded_bytes(value)
    if data is not None:
        return Image.open(io.BytesIO(data)).mode
    array = np.asarray(value)
    return "L" if array.ndim == 2 or array.shape[-1] == 1 else "RGB"


def _classes_from_features(features: dict | None, label_column: str) -> int | None:
    spec = (features or {}).get(label_column)
    if isinstance(spec, dict) and spec.get("_type") == "ClassLabel" and spec.get("names"):
        return len(spec["names"])
    return None


def _features_in_schema(path: str, filesystem) -> dict | None:
    metadata = _parquet_metadata(path, filesystem).metadata or {}
    info = metadata.get(b"huggingface")
    if not info:
        return None
    return json.loads(info).get("info", {}).get("features")


def _classes_from_labels(files: list[str], filesystem, label_column: str) -> int:
    import pyarrow.compute as pc
    import pyarrow.dataset as pds

    table = pds.dataset(files, format="parquet", filesystem=filesystem).to_table(columns=[label_column])
    labels = table.column(0)
    if not (labels.type.id in range(2, 10) or str(labels.type).startswith(("int", "uint"))):
        raise UserError(f"dataset.label_column: {label_column!r} must hold integer class indices, found {labels.type}")
    low, high = pc.min(labels).as_py(), pc.max(labels).as_py()
    if low is None or low < 0:
        raise UserError(f"dataset.label_column: {label_column!r} must hold class indices >= 0")
    return int(high) + 1


def _check_columns(path: str, filesystem, columns: dict[str, str]) -> None:
    names = _parquet_metadata(path, filesystem).schema.to_arrow_schema().names
    for field_name, column in columns.items():
        if column not in names:
            raise UserError(f"dataset.{field_name}: {column!r} is not a column of {path}; columns: {', '.join(names)}")


def _parquet_images(cfg, *, seed: int, train_files, val_files, filesystem, image_column, label_column,
                    num_classes, in_chans, native_size, features, counts, preset: HubPreset | None, params) -> TaskData:
    _check_columns(train_files[0], filesystem, {"image_column": image_column, "label_column": label_column})
    if num_classes is None:
        features = features or _features_in_schema(train_files[0], filesystem)
        num_classes = _classes_from_features(features, label_column) or _classes_from_labels(
            train_files + (val_files or []), filesystem, label_column
        )
    if in_chans is None or native_size is None:
        image, mode = _first_image(train_files, filesystem, image_column)
        in_chans = in_chans or (1 if mode in ("L", "1", "I", "I;16", "F") else 3)
        if native_size is None:
            width, height = image.size
            native_size = width if width == height else None
    if native_size is None and cfg.image_size is None:
        raise UserError("dataset.image_size: the images are not square; set image_size (the side fed to the model)")
    columns = [image_column, label_column]
    read = lambda files, **kw: ray.data.read_parquet(files, filesystem=filesystem, columns=columns, **kw)  # noqa: E731
    if val_files is None:
        train = _one_side(read(_seeded_order(train_files, seed)), image_column, cfg.split_seed,
                          cfg.val_fraction, keep_val=False)
        val = _one_side(read(train_files), image_column, cfg.split_seed, cfg.val_fraction, keep_val=True)
        num_train = num_val = None  # a hash split: sizes are known only after a full pass
    else:
        train, val = read(_seeded_order(train_files, seed)), read(val_files)
        num_train, num_val = counts() if counts else (None, None)
    return image_task(
        cfg, train, val, seed=seed, native_size=native_size, in_chans=in_chans, num_classes=num_classes,
        image_column=image_column, label_column=label_column, num_train=num_train, num_val=num_val,
        default_mean=preset.mean if preset else None, default_std=preset.std if preset else None,
        default_crop_pct=preset.crop_pct if preset else 1.0, params=params,
    )


def load_hub_images(cfg: HubImageConfig, seed: int) -> TaskData:
    preset, hub_id = cfg.preset, cfg.hub_id
    image_column = cfg.image_column or (preset.image_column if preset else "image")
    label_column = cfg.label_column or (preset.label_column if preset else "label")
    hub = resolve_parquet_files(hub_id, config_name=cfg.config_name, revision=cfg.revision, local_dir=cfg.local_dir,
                                source="hf", what=hub_id)
    train_files = hub.files(cfg.train_split, "train_split")
    if cfg.val_fraction is not None:
        val_files, val_split = None, None
    else:
        val_split = cfg.val_split or (preset.val_split if preset else next(
            (s for s in ("validation", "valid", "val", "test") if s in hub.splits), None))
        if val_split is None:
            raise UserError(f"dataset.val_split: {hub_id} has only {', '.join(hub.splits)}; "
                            "set val_split or val_fraction")
        val_files = hub.files(val_split, "val_split")

    def counts():
        if hub.local:  # parquet footers: exact, and cheap on local files
            total = lambda files: sum(_parquet_metadata(f, None).num_rows for f in files)  # noqa: E731
            return total(train_files), total(val_files)
        if preset and cfg.train_split == "train" and val_split == preset.val_split:
            return preset.num_train, preset.num_val
        return None, None  # footers of remote files cost a request each

    return _parquet_images(
        cfg, seed=seed, train_files=train_files, val_files=val_files, filesystem=hub.filesystem,
        image_column=image_column, label_column=label_column,
        num_classes=cfg.num_classes or (preset.num_classes if preset else None),
        in_chans=3 if preset else None, native_size=preset.image_size if preset else None,
        features=hub.features, counts=counts, preset=preset,
        params={"source": "hf", "hub_id": hub_id, "read_from": "local copy" if hub.local else "hub",
                "val_split": val_split or f"hold-out {cfg.val_fraction}"},
    )


def _parquet_paths(path: str, field_name: str) -> list[str]:
    path = os.path.expanduser(path)
    if os.path.isdir(path):
        files = sorted(glob.glob(os.path.join(path, "**", "*.parquet"), recursive=True))
    elif any(c in path for c in "*?["):
        files = sorted(glob.glob(path, recursive=True))
    else:
        files = [path] if os.path.isfile(path) else []
    if not files:
        raise UserError(f"dataset.{field_name}: no parquet files at {path}")
    return files


def load_parquet_images(cfg: ParquetImageConfig, seed: int) -> TaskData:
    train_files = _parquet_paths(cfg.path, "path")
    val_files = _parquet_paths(cfg.val_path, "val_path") if cfg.val_path else None
    features = _features_in_schema(train_files[0], None)

    def counts():
        total = lambda files: sum(_parquet_metadata(f, None).num_rows for f in files)  # noqa: E731
        return total(train_files), total(val_files)

    return _parquet_images(
        cfg, seed=seed, train_files=train_files, val_files=val_files, filesystem=None,
        image_column=cfg.image_column, label_column=cfg.label_column, num_classes=cfg.num_classes,
        in_chans=cfg.in_chans, native_size=None, features=features, counts=counts, preset=None,
        params={"source": "parquet", "val_split": "val_path" if val_files else f"hold-out {cfg.val_fraction}"},
    )


def _list_class_folder(root: str, extensions, field_name: str) -> dict[str, list[str]]:
    root = os.path.expanduser(root)
    if not os.path.isdir(root):
        raise UserError(f"dataset.{field_name}: {root} is not a folder of class sub-folders")
    classes = sorted(e.name for e in os.scandir(root) if e.is_dir() and not e.name.startswith("."))
    listing = {}
    for name in classes:
        files = sorted(
            os.path.join(dirpath, f)
            for dirpath, _, names in os.walk(os.path.join(root, name))
            for f in names
            if f.lower().endswith(tuple(extensions))
        )
        if files:
            listing[name] = files
    if not listing:
        raise UserError(f"dataset.{field_name}: no images ({', '.join(extensions)}) in class sub-folders of {root}")
    return listing


def _label_from_path(batch: dict, root: str, class_index: dict[str, int]) -> dict:
    """The class of an image is its first folder below the root."""
    labels = [class_index[os.path.relpath(os.path.join(os.sep, p), root).split(os.sep)[0]] for p in batch["path"]]
    return {"image": batch["bytes"], "label": np.asarray(labels, dtype=np.int64)}


def load_image_folder(cfg: ImageFolderConfig, seed: int) -> TaskData:
    train_listing = _list_class_folder(cfg.path, cfg.extensions, "path")
    classes = sorted(train_listing)
    class_index = {name: i for i, name in enumerate(classes)}
    items = [(f, name) for name in classes for f in train_listing[name]]
    if cfg.val_path:
        val_listing = _list_class_folder(cfg.val_path, cfg.extensions, "val_path")
        unknown = sorted(set(val_listing) - set(class_index))
        if unknown:
            raise UserError(f"dataset.val_path: classes {', '.join(unknown[:5])} are not in dataset.path")
        train_items, val_items = items, [(f, name) for name in sorted(val_listing) for f in val_listing[name]]
    else:
        order = np.random.default_rng(cfg.split_seed).permutation(len(items))
        num_val = max(1, int(round(cfg.val_fraction * len(items))))
        val_set = set(order[:num_val].tolist())
        train_items = [item for i, item in enumerate(items) if i not in val_set]
        val_items = [item for i, item in enumerate(items) if i in val_set]
    with open(train_items[0][0], "rb") as f:
        encoded = f.read()
    first, mode = to_pil(encoded, "RGB"), _native_mode(encoded)
    in_chans = cfg.in_chans or (1 if mode in ("L", "1", "I", "I;16", "F") else 3)
    width, height = first.size
    if width != height and cfg.image_size is None:
        raise UserError("dataset.image_size: the images are not square; set image_size (the side fed to the model)")

    def rows(pairs, root):
        ds = ray.data.read_binary_files([os.path.abspath(p) for p, _ in pairs], include_paths=True)
        kwargs = {"root": os.path.abspath(os.path.expanduser(root)), "class_index": class_index}
        return ds.map_batches(_label_from_path, fn_kwargs=kwargs, batch_format="numpy")

    return image_task(
        cfg, rows(_seeded_order(train_items, seed), cfg.path), rows(val_items, cfg.val_path or cfg.path), seed=seed,
        native_size=width, in_chans=in_chans, num_classes=len(classes), image_column="image", label_column="label",
        num_train=len(train_items), num_val=len(val_items),
        params={"source": "image_folder", "classes": len(classes),
                "val_split": "val_path" if cfg.val_path else f"hold-out {cfg.val_fraction}"},
    )
