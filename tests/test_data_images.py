"""Image sources on generated data: a parquet of images, a Hugging Face dataset written as parquet and read through
the hub code path, an image folder; evaluation transform exactness, augmentation determinism, Mixup/CutMix."""

import io
import os

import numpy as np
import pytest
import torch
from PIL import Image

from data_fixtures import ray_local, write_cifar100_mirror  # noqa: F401
from study.data import load_task_data, parse_dataset_config
from study.data.hub import MIRROR_ENV

NUM_CLASSES = 5
SIDE = 32


def _image(label: int, index: int, side: int = SIDE, mode: str = "RGB") -> Image.Image:
    """A reproducible picture: noise whose red channel mean encodes the label."""
    rng = np.random.default_rng(1000 * label + index)
    pixels = rng.integers(0, 256, (side, side, 3), dtype=np.uint8)
    pixels[..., 0] = 40 * label + rng.integers(0, 30, (side, side))
    return Image.fromarray(pixels).convert(mode)


def _png(image: Image.Image) -> bytes:
    out = io.BytesIO()
    image.save(out, format="PNG")
    return out.getvalue()


def _rows(count: int, offset: int = 0):
    return [(_image(i % NUM_CLASSES, offset + i), i % NUM_CLASSES) for i in range(count)]


@pytest.fixture(scope="module")
def parquet_dir(tmp_path_factory):
    import pyarrow as pa
    import pyarrow.parquet as pq

    root = tmp_path_factory.mktemp("pq")
    for name, count, offset in (("train", 60, 0), ("val", 20, 10_000)):
        rows = _rows(count, offset)
        table = pa.table({
            "image": pa.array([{"bytes": _png(img), "path": None} for img, _ in rows],
                              pa.struct([("bytes", pa.binary()), ("path", pa.string())])),
            "label": pa.array([y for _, y in rows], pa.int64()),
        })
        os.makedirs(root / name)
        pq.write_table(table.slice(0, count // 2), root / name / "part-0.parquet", row_group_size=8)
        pq.write_table(table.slice(count // 2), root / name / "part-1.parquet", row_group_size=8)
    return root


@pytest.fixture(scope="module")
def hub_mirror(tmp_path_factory):
    root = tmp_path_factory.mktemp("mirror")
    write_cifar100_mirror(root, [(img, 7 * y) for img, y in _rows(50)], [(img, 7 * y) for img, y in _rows(15, 500)])
    return root


@pytest.fixture(scope="module")
def image_folder(tmp_path_factory):
    root = tmp_path_factory.mktemp("folder")
    for i, (img, y) in enumerate(_rows(40)):
        os.makedirs(root / f"class_{y}", exist_ok=True)
        img.save(root / f"class_{y}" / f"{i:03d}.png")
    return root


def _val(data, batch_size=16):
    return list(data.val_batches(data.datasets["val"], batch_size=batch_size, device="cpu"))


def _train(data, epoch=0, seed=0, batch_size=8):
    return list(data.train_batches(data.datasets["train"], batch_size=batch_size, epoch=epoch, seed=seed, device="cpu"))


def _unnormalise(data, images):
    mean = torch.tensor(data.batch_steps.mean).view(1, -1, 1, 1)
    std = torch.tensor(data.batch_steps.std).view(1, -1, 1, 1)
    return torch.round((images * std + mean) * 255).to(torch.uint8)


def test_parquet_source_shapes_labels_and_exact_evaluation_pixels(ray_local, parquet_dir):
    cfg = parse_dataset_config({"source": "parquet", "path": str(parquet_dir / "train"),
                                "val_path": str(parquet_dir / "val")})
    data = load_task_data(cfg, seed=0)
    assert data.model_overrides == {"num_classes": NUM_CLASSES, "image_size": SIDE, "in_chans": 3}
    assert (data.num_train, data.num_val) == (60, 20)
    val = _val(data)
    assert sum(len(b["label"]) for b in val) == 20
    expected = {np.asarray(img).tobytes(): y for img, y in _rows(20, 10_000)}
    for batch in val:
        assert batch["image"].dtype == torch.float32 and batch["image"].shape[1:] == (3, SIDE, SIDE)
        pixels = _unnormalise(data, batch["image"]).permute(0, 2, 3, 1).numpy()
        for img, y in zip(pixels, batch["label"].tolist()):
            assert expected[img.tobytes()] == y  # decode + resize + centre crop at native size is exact
    train = _train(data)
    assert len(train) == 60 // 8
    labels = torch.cat([b["label"] for b in train])
    assert labels.dtype == torch.int64 and 0 <= int(labels.min()) and int(labels.max()) < NUM_CLASSES


def test_parquet_hold_out_split_is_disjoint_and_covers(ray_local, parquet_dir):
    cfg = {"source": "parquet", "path": str(parquet_dir / "train"), "val_fraction": 0.25, "augment": "none"}
    data = load_task_data(parse_dataset_config(cfg), seed=0)
    train = {img.numpy().tobytes() for b in data.val_batches(data.datasets["train"], batch_size=64, device="cpu")
             for img in b["image"]}
    val = {img.numpy().tobytes() for b in _val(data) for img in b["image"]}
    assert not train & val and len(train) + len(val) == 60
    assert 5 <= len(val) <= 25  # a seeded hash split of 60 rows at 0.25
    again = load_task_data(parse_dataset_config(cfg), seed=3)
    assert {img.numpy().tobytes() for b in _val(again) for img in b["image"]} == val  # split_seed, not the seed


def test_an_epoch_of_parquet_shards_starts_no_actor(ray_local, parquet_dir):
    """Every epoch executes the reads again: Ray Data's parquet reader V2 starts a pool of footer-reading actors (a
    process each) per execution, seconds per epoch and split on a laptop. The study's reads start none."""
    from ray._private.state import actors

    cfg = {"source": "parquet", "path": str(parquet_dir / "train"), "val_fraction": 0.25, "augment": "none"}
    data = load_task_data(parse_dataset_config(cfg), seed=0)
    assert _train(data) and _val(data)  # the first epoch may start Ray Data's own singletons (its stats actor)
    before = set(actors())
    assert _train(data, epoch=1) and _val(data)
    assert set(actors()) == before


def test_hub_code_path_reads_a_local_copy_of_the_repository(ray_local, hub_mirror, monkeypatch):
    monkeypatch.setenv(MIRROR_ENV, str(hub_mirror))
    cfg = parse_dataset_config({"source": "hf", "name": "cifar100", "augment": "three_augment",
                                "mixup": 0.8, "cutmix": 1.0, "label_smoothing": 0.1})
    data = load_task_data(cfg, seed=0)
    assert data.model_overrides == {"num_classes": 100, "image_size": 32, "in_chans": 3}
    assert data.params["read_from"] == "local copy" and data.params["hub_id"] == "uoft-cs/cifar100"
    val = _val(data)
    labels = torch.cat([b["label"] for b in val])
    assert len(labels) == 15 and set(labels.tolist()) <= {0, 7, 14, 21, 28}  # fine_label, the preset's column
    train = _train(data, batch_size=10)
    assert len(train) == 5
    for batch in train:
        assert batch["image"].shape == (10, 3, 32, 32) and batch["soft_label"].shape == (10, 100)
        assert torch.allclose(batch["soft_label"].sum(1), torch.ones(10))
        assert float(batch["soft_label"].min()) >= 0.1 / 100 - 1e-6  # smoothing keeps every class above zero
    # the same code path with an explicit local_dir and the dataset's own split named
    explicit = parse_dataset_config({"source": "hf", "name": "uoft-cs/cifar100", "local_dir":
                                     str(hub_mirror / "uoft-cs" / "cifar100"), "image_column": "img",
                                     "label_column": "fine_label", "val_split": "test"})
    monkeypatch.delenv(MIRROR_ENV)
    other = load_task_data(explicit, seed=0)
    assert other.model_overrides["num_classes"] == 100  # from the ClassLabel feature in the parquet metadata
    assert (other.num_train, other.num_val) == (50, 15)


def test_image_folder_split_sizes_labels_and_classes(ray_local, image_folder):
    cfg = parse_dataset_config({"source": "image_folder", "path": str(image_folder), "val_fraction": 0.25})
    data = load_task_data(cfg, seed=0)
    assert (data.num_train, data.num_val) == (30, 10)
    assert data.model_overrides == {"num_classes": NUM_CLASSES, "image_size": SIDE, "in_chans": 3}
    expected = {np.asarray(img).tobytes(): y for img, y in _rows(40)}
    seen = 0
    for batch in _val(data, batch_size=4):
        for img, y in zip(_unnormalise(data, batch["image"]).permute(0, 2, 3, 1).numpy(), batch["label"].tolist()):
            assert expected[img.tobytes()] == y  # label = index of the sorted class folder
            seen += 1
    assert seen == 10


def test_training_augmentation_is_deterministic_per_seed_and_epoch(ray_local, image_folder):
    cfg = parse_dataset_config({"source": "image_folder", "path": str(image_folder), "augment": "three_augment",
                                "image_size": 24, "mixup": 0.8, "cutmix": 1.0})
    data = load_task_data(cfg, seed=0)
    run = lambda **kw: torch.cat([b["image"] for b in _train(data, **kw)])  # noqa: E731
    first = run(epoch=0, seed=1)
    assert first.shape[1:] == (3, 24, 24)
    assert torch.equal(first, run(epoch=0, seed=1))
    assert not torch.equal(first, run(epoch=1, seed=1))
    assert torch.equal(run(epoch=1, seed=1), run(epoch=1, seed=1))  # epoch order does not matter, only its number
    # evaluation is not augmented: resize 32 -> 27 (crop_pct 0.875 default is 1.0 here: 24/1.0) centre crop 24
    val = _val(data)
    assert all(b["image"].shape[1:] == (3, 24, 24) for b in val) and "soft_label" not in val[0]


def test_grayscale_images_keep_one_channel(ray_local, tmp_path):
    for i in range(12):
        os.makedirs(tmp_path / f"c{i % 3}", exist_ok=True)
        _image(i % 3, i, side=16, mode="L").save(tmp_path / f"c{i % 3}" / f"{i}.png")
    cfg = parse_dataset_config({"source": "image_folder", "path": str(tmp_path), "val_fraction": 0.25})
    data = load_task_data(cfg, seed=0)
    assert data.model_overrides == {"num_classes": 3, "image_size": 16, "in_chans": 1}
    assert _train(data, batch_size=3)[0]["image"].shape == (3, 1, 16, 16)


def test_a_wrong_column_is_a_user_error_naming_the_columns(ray_local, parquet_dir):
    from study.errors import UserError

    cfg = parse_dataset_config({"source": "parquet", "path": str(parquet_dir / "train"), "label_column": "fine"})
    with pytest.raises(UserError, match="dataset.label_column: 'fine' is not a column of .*columns: image, label"):
        load_task_data(cfg, seed=0)
