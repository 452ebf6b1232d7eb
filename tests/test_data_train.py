"""The data contract inside real Ray Train workers: get_dataset_shard, two workers, disjoint shards covering the data."""

import json
import sys

import pytest
import ray.cloudpickle
from data_fixtures import ray_local  # noqa: F401

from study.data import load_task_data, parse_dataset_config

ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # Train workers cannot import test modules


def _worker_loop(config):
    import ray.train

    task_data = config["task_data"]
    rank = ray.train.get_context().get_world_rank()
    seen = {"train": [], "val": [], "shapes": []}
    for epoch in range(2):
        train = [
            b for b in task_data.train_batches(
                ray.train.get_dataset_shard("train"), batch_size=32, epoch=epoch, seed=5, device="cpu", rank=rank
            )
        ]
        if epoch == 0:
            seen["shapes"] = [list(train[0]["image"].shape), str(train[0]["image"].dtype), str(train[0]["label"].dtype)]
            seen["train"] = [img.numpy().tobytes().hex() for b in train for img in b["image"]]
    for batch in task_data.val_batches(ray.train.get_dataset_shard("val"), batch_size=50, device="cpu"):
        seen["val"].extend(img.numpy().tobytes().hex() + f":{int(y)}" for img, y in zip(batch["image"], batch["label"]))
    with open(f"{config['out']}/rank{rank}.json", "w") as f:
        json.dump(seen, f)


@pytest.mark.slow
def test_two_train_workers_see_disjoint_shards_that_cover_the_data(ray_local, tmp_path):
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    task_data = load_task_data("classification", parse_dataset_config({"source": "digits"}), seed=5)
    trainer = TorchTrainer(
        _worker_loop,
        train_loop_config={"task_data": task_data, "out": str(tmp_path)},
        scaling_config=ScalingConfig(num_workers=2, resources_per_worker={"CPU": 0.5}),
        datasets=task_data.datasets,
        dataset_config=task_data.data_config(),
        run_config=RunConfig(storage_path=str(tmp_path / "runs"), name="shards"),
    )
    trainer.fit()
    seen = [json.load(open(tmp_path / f"rank{r}.json")) for r in range(2)]
    assert seen[0]["shapes"] == [[32, 1, 8, 8], "torch.float32", "torch.int64"]
    val = [set(s["val"]) for s in seen]
    assert sum(len(s["val"]) for s in seen) == task_data.num_val == 360  # every validation row once, none dropped
    assert not val[0] & val[1]
    reference = {
        img.numpy().tobytes().hex() + f":{int(y)}"
        for b in task_data.val_batches(task_data.datasets["val"], batch_size=400, device="cpu")
        for img, y in zip(b["image"], b["label"])
    }
    assert val[0] | val[1] == reference
    train = [s["train"] for s in seen]
    assert not set(train[0]) & set(train[1])  # disjoint training shards (digits has no duplicate images)
    assert len(train[0]) == len(train[1]) == (1437 // 2) // 32 * 32
