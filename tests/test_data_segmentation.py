"""Segmentation sources (shapes_segmentation, ade20k) through real Ray Data pipelines: batch shapes, masks that follow
their images through crop and flip (read back from colour-coded pictures), determinism per seed, ADE20K's labels
(reduce_zero_label) from a local copy in the hub repository's layout, and the fast offline failure."""

import time

import numpy as np
import pytest
import torch
from PIL import Image

from data_fixtures import ray_local  # noqa: F401
from study.data import check_dataset, load_task_data, parse_dataset_config
from study.data.hub import MIRROR_ENV, OFFLINE_SOURCES
from study.data.segmentation_sources import render_shapes
from study.errors import UserError

SHAPES = {"source": "shapes_segmentation", "image_size": 32, "num_train": 48, "num_val": 16}


def _load(dataset: dict, seed: int = 0):
    return load_task_data(parse_dataset_config(dataset), seed=seed)


def _train(data, epoch=0, seed=0, batch_size=8):
    return list(data.train_batches(data.datasets["train"], batch_size=batch_size, epoch=epoch, seed=seed, device="cpu"))


def _val(data, batch_size=8):
    return list(data.val_batches(data.datasets["val"], batch_size=batch_size, device="cpu"))


def _pixels(data, images: torch.Tensor) -> np.ndarray:
    """Normalised (B, 3, S, S) back to uint8 levels (B, S, S, 3)."""
    mean = torch.tensor(data.batch_steps.pixels.mean).view(1, 3, 1, 1)
    std = torch.tensor(data.batch_steps.pixels.std).view(1, 3, 1, 1)
    levels = torch.round((images * std + mean) * 255).clamp(0, 255).to(torch.uint8)
    return levels.permute(0, 2, 3, 1).numpy()


def _interior(mask: np.ndarray, radius: int = 3) -> np.ndarray:
    """Pixels whose (2 radius + 1)^2 neighbourhood holds one label only (resampling blends colours at borders)."""
    count, height, width = mask.shape
    padded = np.pad(mask, ((0, 0), (radius, radius), (radius, radius)), mode="edge")
    same = np.ones(mask.shape, dtype=bool)
    for dy in range(2 * radius + 1):
        for dx in range(2 * radius + 1):
            same &= padded[:, dy: dy + height, dx: dx + width] == mask
    return same


# ---- shapes_segmentation ------------------------------------------------------------------------------------------

def test_shapes_batches_and_the_fixed_split(ray_local):
    data = _load(SHAPES)
    assert data.model_overrides == {"num_classes": 4, "image_size": 32, "in_chans": 3}
    assert (data.num_train, data.num_val) == (48, 16) and data.params["ignore_index"] == 255
    train = _train(data)
    assert len(train) == 48 // 8
    for batch in train:
        assert set(batch) == {"image", "mask"}
        assert batch["image"].shape == (8, 3, 32, 32) and batch["image"].dtype == torch.float32
        assert batch["mask"].shape == (8, 32, 32) and batch["mask"].dtype == torch.int64
        assert 0 <= int(batch["mask"].min()) and int(batch["mask"].max()) <= 3
    # validation: pictures 48..63 of split_seed 0, image and mask untouched (the evaluation transform of an image
    # already at image_size is the identity)
    val = _val(data)
    got = {(img.tobytes(), m.tobytes()) for b in val for img, m in zip(_pixels(data, b["image"]), b["mask"].numpy())}
    expected = [render_shapes([0, i], 32) for i in range(48, 64)]
    assert got == {(img.tobytes(), m.astype(np.int64).tobytes()) for img, m in expected}
    assert {k for b in val for k in b["mask"].unique().tolist()} == {0, 1, 2, 3}


def test_shapes_masks_follow_their_images_through_crop_and_flip(ray_local):
    # red discs, green squares, blue triangles on grey: a pixel's class can be read from its colour
    data = _load({**SHAPES, "image_size": 48, "num_train": 64, "palette": "by_class"})
    batches = _train(data, batch_size=16)
    images = np.concatenate([_pixels(data, b["image"]) for b in batches]).astype(np.int64)
    masks = np.concatenate([b["mask"].numpy() for b in batches])
    colour_class = np.where(images.max(-1) - images.min(-1) < 60, 0, images.argmax(-1) + 1)
    inside = _interior(masks)
    assert inside.mean() > 0.5 and (masks[inside] > 0).sum() > 5000  # enough shape pixels to judge by
    assert (colour_class[inside] == masks[inside]).all()
    # and the batches were augmented: not one of them is an untouched picture, some are mirrored crops
    originals = {render_shapes([0, i], 48, palette="by_class")[1].tobytes() for i in range(64)}
    assert not any(m.astype(np.uint8).tobytes() in originals for m in masks)


def test_shapes_are_deterministic_per_seed(ray_local):
    def epoch(data, **kwargs):
        batches = _train(data, **kwargs)
        return torch.cat([b["image"] for b in batches]), torch.cat([b["mask"] for b in batches])

    first = epoch(_load(SHAPES, seed=3), epoch=1, seed=3)
    again = epoch(_load(SHAPES, seed=3), epoch=1, seed=3)  # rebuilt from the config
    assert all(torch.equal(a, b) for a, b in zip(first, again))
    crops = lambda masks: {m.numpy().tobytes() for m in masks}  # noqa: E731  (the crops, whatever the order)
    for other in (epoch(_load(SHAPES, seed=4), epoch=1, seed=4), epoch(_load(SHAPES, seed=3), epoch=2, seed=3)):
        assert len(crops(first[1]) & crops(other[1])) < 5  # another seed or epoch: other crops, not only another order
    # the pictures (and so the split) move with split_seed, not with the trial seed
    val = lambda data: torch.cat([b["mask"] for b in _val(data)])  # noqa: E731
    assert torch.equal(val(_load(SHAPES, seed=0)), val(_load(SHAPES, seed=5)))
    assert not torch.equal(val(_load(SHAPES)), val(_load({**SHAPES, "split_seed": 1})))


# ---- ade20k -------------------------------------------------------------------------------------------------------

def test_ade20k_offline_fails_within_seconds_naming_the_alternatives(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.delenv(MIRROR_ENV, raising=False)
    start = time.monotonic()
    with pytest.raises(UserError) as error:
        check_dataset(parse_dataset_config({"source": "ade20k"}))
    assert time.monotonic() - start < 5
    message = str(error.value)
    assert "\n" not in message and message.startswith("dataset.source: ade20k")
    assert "zhoubolei/scene_parse_150" in message and OFFLINE_SOURCES in message and "shapes_segmentation" in message
    assert "dataset.local_dir" in message


LABELS = (0, 1, 7, 150)  # ADE20K's "other", and classes 1, 7, 150 (0, 6, 149 after reduce_zero_label)


def _ade_picture(index: int, width: int = 40, height: int = 30):
    """A non-square picture of vertical bands; a band's red level is its ADE20K label (green: 255 - label)."""
    rng = np.random.default_rng(index)
    edges = np.array([width // 4, width // 2, 3 * width // 4]) + rng.integers(-2, 3, 3)  # bands of 6-14 columns
    labels = rng.permutation(LABELS)
    column_label = labels[np.searchsorted(edges, np.arange(width), side="right")]
    mask = np.repeat(column_label[None, :], height, axis=0).astype(np.uint8)
    image = np.stack([mask, 255 - mask, np.full_like(mask, 100)], axis=-1)
    return Image.fromarray(image), Image.fromarray(mask)


def _write_ade20k_copy(root, train: int, val: int):
    """A local copy of the zhoubolei/scene_parse_150 repository's parquet branch, written by `datasets` with its
    features (Image, Image, ClassLabel) under root/zhoubolei/scene_parse_150/scene_parsing/<split>/0000.parquet."""
    import datasets

    repo = root / "zhoubolei" / "scene_parse_150"
    features = datasets.Features({"image": datasets.Image(), "annotation": datasets.Image(),
                                  "scene_category": datasets.ClassLabel(num_classes=1055)})
    for split, indices in (("train", range(train)), ("validation", range(1000, 1000 + val))):
        pictures = [_ade_picture(i) for i in indices]
        ds = datasets.Dataset.from_dict({"image": [p[0] for p in pictures], "annotation": [p[1] for p in pictures],
                                         "scene_category": [0] * len(pictures)}, features=features)
        (repo / "scene_parsing" / split).mkdir(parents=True)
        ds.to_parquet(str(repo / "scene_parsing" / split / "0000.parquet"))
    return repo


@pytest.fixture(scope="module")
def ade20k_mirror(tmp_path_factory):
    root = tmp_path_factory.mktemp("ade_mirror")
    _write_ade20k_copy(root, train=24, val=8)
    return root


def _check_labels_follow_colours(data, batches):
    """Interior pixels: the mask is reduce_zero_label of the red level (0 -> 255, k -> k - 1), the green 255 - red."""
    images = np.concatenate([_pixels(data, b["image"]) for b in batches]).astype(np.int64)
    masks = np.concatenate([b["mask"].numpy() for b in batches])
    assert set(np.unique(masks)) <= {255, 0, 6, 149}  # nearest-neighbour: no label made up at a border
    inside = _interior(masks, radius=2)  # narrow bands: resampling reaches at most 2 pixels across a border here
    red, green = images[..., 0][inside], images[..., 1][inside]
    assert inside.mean() > 0.3 and set(np.unique(masks[inside])) == {255, 0, 6, 149}
    assert (green == 255 - red).all()
    assert (masks[inside] == np.where(red == 0, 255, red - 1)).all()


def test_ade20k_from_a_local_copy_in_the_hub_layout(ray_local, ade20k_mirror, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # a local copy needs no hub
    monkeypatch.setenv(MIRROR_ENV, str(ade20k_mirror))
    data = _load({"source": "ade20k", "image_size": 24})
    assert data.params["read_from"] == "local copy" and (data.num_train, data.num_val) == (24, 8)
    assert data.model_overrides == {"num_classes": 150, "image_size": 24, "in_chans": 3}
    val = _val(data)
    assert sum(len(b["mask"]) for b in val) == 8
    for batch in val:
        assert batch["image"].shape[1:] == (3, 24, 24) and batch["mask"].shape[1:] == (24, 24)
        assert batch["mask"].dtype == torch.int64
    _check_labels_follow_colours(data, val)
    # the evaluation transform: short side 30 -> 24 (40 -> 32), centre 24 columns (offset 4), mask nearest-neighbour
    first = _ade_picture(1000)[1].resize((32, 24), Image.NEAREST)
    expected = np.asarray(first)[:, 4:28].astype(np.int64)
    expected = np.where(expected == 0, 255, expected - 1)
    assert any(np.array_equal(m, expected) for b in val for m in b["mask"].numpy())
    # training crops and flips: the labels still follow the colours
    _check_labels_follow_colours(data, _train(data, batch_size=8))


def test_ade20k_local_dir_and_columns(ray_local, ade20k_mirror, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.delenv(MIRROR_ENV, raising=False)
    local = str(ade20k_mirror / "zhoubolei" / "scene_parse_150")
    data = _load({"source": "ade20k", "image_size": 24, "local_dir": local, "augment": "none"})
    assert data.params["read_from"] == "local copy"
    _check_labels_follow_colours(data, _train(data))
    with pytest.raises(UserError, match="dataset.mask_column: 'segmentation' is not a column"):
        _load({"source": "ade20k", "local_dir": local, "mask_column": "segmentation"})
    with pytest.raises(UserError, match="dataset.val_split: no parquet files match scene_parsing/val/"):
        _load({"source": "ade20k", "local_dir": local, "val_split": "val"})
    with pytest.raises(UserError, match="dataset.split_files"):
        parse_dataset_config({"source": "ade20k", "split_files": "scene_parsing/train/*.parquet"})
