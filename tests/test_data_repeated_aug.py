"""Repeated augmentation (`repeated_aug`, DeiT's --repeated-aug) against DeiT's RASampler (facebookresearch/deit
samplers.py): each epoch a random third of the training images, each three times with augmentations of its own, the
copies side by side, and as many images per epoch as the split holds. Digits through real Ray Data pipelines, with a
crop of the whole image so that each copy must be its source image or that image mirrored."""

import math

import numpy as np
import pytest
import torch

from data_fixtures import ray_local  # noqa: F401
from study.data import TaskData, check_dataset, load_task_data, parse_dataset_config
from study.data.images import ImageSpec, transform_batch
from study.errors import UserError
from study.trial import plan_run

WHOLE_IMAGE = {"crop_scale": [1.0, 1.0], "crop_ratio": [1.0, 1.0]}  # the crop is the image: copies differ by a flip


class FixedEpoch:
    def __init__(self, epoch: int):
        self.value = epoch

    def epoch(self) -> int:
        return self.value


def _digits(n: int = 40):
    from sklearn.datasets import load_digits

    digits = load_digits()
    images = np.round(digits.images[:n] * 255 / 16).astype(np.uint8)[..., None]
    return {"image": images, "label": digits.target[:n].astype(np.int64)}


def _source_of(image: np.ndarray, sources: dict[bytes, int]) -> int:
    """Index of the source image that `image` (C, S, S) is, as it is or mirrored; KeyError if neither."""
    plain = image[0]
    return sources.get(plain.tobytes(), sources.get(np.ascontiguousarray(plain[:, ::-1]).tobytes()))


def test_a_map_batch_keeps_a_third_of_its_images_each_three_times_augmented_on_its_own():
    batch = _digits(40)
    sources = {img[..., 0].tobytes(): i for i, img in enumerate(batch["image"])}
    spec = ImageSpec(image_size=8, in_chans=1, augment="basic", crop_scale=(1.0, 1.0), crop_ratio=(1.0, 1.0))
    out = transform_batch(batch, spec, train=True, seed=0, epoch_clock=FixedEpoch(1), repeats=3)
    assert out["image"].shape == (14, 3, 1, 8, 8) and out["image"].dtype == np.uint8  # ceil(40 / 3) images
    chosen = [_source_of(group[0], sources) for group in out["image"]]
    assert len(set(chosen)) == 14 and out["label"].tolist() == batch["label"][chosen].tolist()
    for index, group in zip(chosen, out["image"]):
        assert [_source_of(copy, sources) for copy in group] == [index] * 3
    # Each copy draws its own flip: some images come out both ways (P(no image mirrored differently) = (1/4)^14).
    assert any(len({copy.tobytes() for copy in group}) > 1 for group in out["image"])
    # Another epoch, another third; the same epoch and seed, the same images and draws.
    again = transform_batch(batch, spec, train=True, seed=0, epoch_clock=FixedEpoch(1), repeats=3)
    assert np.array_equal(again["image"], out["image"])
    other = transform_batch(batch, spec, train=True, seed=0, epoch_clock=FixedEpoch(2), repeats=3)
    assert {_source_of(group[0], sources) for group in other["image"]} != set(chosen)
    # Evaluation is untouched: every row once, no copies.
    assert transform_batch(batch, spec, train=False, repeats=3)["image"].shape == (40, 1, 8, 8)


def test_an_epoch_holds_each_chosen_image_three_times_side_by_side_and_as_many_images_as_the_split(ray_local):
    config = {"source": "digits", "augment": "basic", "repeated_aug": 3, **WHOLE_IMAGE}
    data = load_task_data(parse_dataset_config(config), seed=0)
    plain = load_task_data(parse_dataset_config({"source": "digits"}), seed=0)
    mean, std = data.batch_steps.mean[0], data.batch_steps.std[0]

    def pixels(batch):
        return np.round((batch["image"].numpy() * std + mean) * 255).astype(np.uint8)

    sources = {img.tobytes(): i for i, img in enumerate(np.concatenate(
        [pixels(b)[:, 0] for b in plain.val_batches(plain.datasets["train"], batch_size=2000, device="cpu")]))}
    assert len(sources) == data.num_train == 1437
    batch_size = 32
    plan = plan_run(_spec(batch_size), data)
    assert plan.steps_per_epoch == 3 * math.ceil(1437 / 3) // batch_size == 44  # as many as without repeats
    chosen = []
    for epoch in (1, 2):
        batches = list(data.train_batches(data.datasets["train"], batch_size=batch_size, epoch=epoch, seed=0,
                                          device="cpu"))
        assert len(batches) >= plan.steps_per_epoch
        assert all(b["image"].shape == (batch_size, 1, 8, 8) for b in batches)
        images = np.concatenate([pixels(b) for b in batches])
        labels = torch.cat([b["label"] for b in batches]).numpy()
        stream = [_source_of(image, sources) for image in images]
        # The copies of an image next to each other (the last run may be cut by the dropped partial batch).
        runs = [stream[i:i + 3] for i in range(0, len(stream) - len(stream) % 3, 3)]
        assert all(len(set(run)) == 1 for run in runs)
        assert all(len(set(labels[i:i + 3])) == 1 for i in range(0, len(runs) * 3, 3))
        picked = [run[0] for run in runs]
        assert len(set(picked)) == len(picked)  # an image once per epoch (as three copies)
        # Each augment task keeps ceil(rows / 3) of its rows: about a third of the split, at least a third of it.
        assert 1437 / 3 - batch_size <= len(picked) <= 1437 / 3 + 20
        chosen.append(set(picked))
    # Independent thirds: the two epochs share about a third of their images.
    shared = len(chosen[0] & chosen[1]) / len(chosen[0])
    assert 0.2 < shared < 0.47, shared


def _spec(batch_size: int, workers: int = 1):
    from types import SimpleNamespace

    return SimpleNamespace(resources=SimpleNamespace(workers=workers),
                           train=SimpleNamespace(batch_size=batch_size, steps_per_epoch=None))


def test_the_plan_counts_only_the_images_every_worker_is_sure_to_get():
    data = TaskData(datasets={}, model_overrides={}, num_train=1437, num_val=0, batch_steps=None, repeats=3)
    # 479 rows of three copies, 239 per worker under Ray's equal split: 717 images each.
    assert data.train_rows_per_worker(2) == 717
    assert plan_run(_spec(64, workers=2), data).steps_per_epoch == 717 // 32
    single = TaskData(datasets={}, model_overrides={}, num_train=1437, num_val=0, batch_steps=None)
    assert single.train_rows_per_worker(2) == 718 and plan_run(_spec(64, 2), single).steps_per_epoch == 22


@pytest.mark.parametrize("augment", ["none", "dino_multicrop"])
def test_repeated_aug_needs_a_random_augmentation(augment):
    with pytest.raises(UserError, match=rf"dataset.*repeated_aug: is read only with augment: basic or three_augment "
                                        rf"\(here {augment}\)"):
        check_dataset({"source": "digits", "augment": augment, "repeated_aug": 3})
