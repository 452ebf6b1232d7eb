"""Done-means of the data issue: the shipped CIFAR-100 space, parsed by the study's own schema and left unchanged,
streams from a local parquet copy of the hub repository, offline, with the shapes the model preset expects."""

import os

import numpy as np
import torch
from PIL import Image

from data_fixtures import ray_local, write_cifar100_mirror  # noqa: F401
from study.data import load_task_data
from study.data.hub import MIRROR_ENV

SPACE = os.path.join(os.path.dirname(__file__), os.pardir, "search_spaces", "vit_cifar100_parquet.yaml")


def test_cifar100_space_streams_from_a_local_parquet_copy_offline(ray_local, tmp_path, monkeypatch):
    from models.presets import PRESETS
    from study.space import load_space

    rng = np.random.default_rng(0)
    rows = lambda n: [(Image.fromarray(rng.integers(0, 256, (32, 32, 3), dtype=np.uint8)), int(y))  # noqa: E731
                      for y in rng.integers(0, 100, n)]
    write_cifar100_mirror(tmp_path, rows(64), rows(24))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv(MIRROR_ENV, str(tmp_path))
    space = load_space(SPACE)
    data = load_task_data(space.dataset, seed=space.seed)
    preset = PRESETS[space.fixed["preset"]]
    assert data.model_overrides == {"num_classes": 100, "image_size": preset["image_size"], "in_chans": 3}
    assert (data.num_train, data.num_val) == (64, 24) and data.params["read_from"] == "local copy"
    batch = next(iter(data.train_batches(data.datasets["train"], batch_size=16, epoch=0, seed=0, device="cpu")))
    assert batch["image"].shape == (16, 3, 32, 32) and batch["soft_label"].shape == (16, 100)
    val = list(data.val_batches(data.datasets["val"], batch_size=10, device="cpu"))
    assert sum(len(b["label"]) for b in val) == 24 and torch.cat([b["label"] for b in val]).max() < 100
