"""The data contract inside real Ray Train workers: get_dataset_shard, two workers, disjoint shards covering the
data."""

import json
import sys

import pytest
import ray.cloudpickle

from data_fixtures import ray_local  # noqa: F401
from import_probe import imported_with
from study.data import load_task_data, parse_dataset_config

ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # Train workers cannot import test modules


def _worker_loop(config):
    import ray.train

    task_data, steps = config["task_data"], config["steps"]
    rank = ray.train.get_context().get_world_rank()
    seen = {"val": []}
    for epoch in range(2):
        train = list(task_data.train_batches(ray.train.get_dataset_shard("train"), batch_size=16, epoch=epoch, seed=5,
                                             device="cpu", rank=rank))
        if epoch == 0:
            seen["shapes"] = [list(train[0]["image"].shape), str(train[0]["image"].dtype), str(train[0]["label"].dtype)]
            seen["batches"], seen["sizes"] = len(train), sorted({len(b["label"]) for b in train})
            seen["train"] = [img.numpy().tobytes().hex() for b in train[:steps] for img in b["image"]]
            seen["labels"] = [int(y) for b in train[:steps] for y in b["label"]]
    for batch in task_data.val_batches(ray.train.get_dataset_shard("val"), batch_size=50, device="cpu"):
        seen["val"].extend(img.numpy().tobytes().hex() + f":{int(y)}" for img, y in zip(batch["image"], batch["label"]))
    with open(f"{config['out']}/rank{rank}.json", "w") as f:
        json.dump(seen, f)


@ray.remote(num_cpus=0)
class _StateProbe:
    def own_id(self):
        return ray.get_runtime_context().get_actor_id()

    def state_of(self, actor_id):
        from ray.util.state import get_actor

        actor = get_actor(actor_id, timeout=10)
        return actor.state if actor else None


def test_rays_state_api_in_a_worker_answers_for_this_clusters_actors(ray_local):
    """Train's placement-group cleaner asks the State API, from a worker, whether a trial's controller lives, and
    removes its placement group when told no: the shared cluster must answer for its own actors (not a dashboard of
    another cluster on the machine, nor none at all)."""
    probe = _StateProbe.remote()
    try:
        assert ray.get(probe.state_of.remote(ray.get(probe.own_id.remote()))) == "ALIVE"
    finally:
        ray.kill(probe)


@pytest.mark.slow(seconds=25)
def test_two_train_workers_see_disjoint_shards_that_cover_the_data(ray_local, tmp_path):
    """Two Train workers fed as a trial feeds them: every validation row once over both, disjoint training shards,
    and (with `repeated_aug: 3`, a whole-image crop) at least the steps the plan counts on per worker, in batches of
    its share, each image's three copies side by side."""
    from types import SimpleNamespace

    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    from study.trial import plan_run

    config = {"source": "digits", "augment": "basic", "repeated_aug": 3, "crop_scale": [1.0, 1.0],
              "crop_ratio": [1.0, 1.0]}
    task_data = load_task_data(parse_dataset_config(config), seed=5)
    plan = plan_run(SimpleNamespace(resources=SimpleNamespace(workers=2),
                                    train=SimpleNamespace(batch_size=32, steps_per_epoch=None)), task_data)
    assert (plan.batch_per_worker, plan.steps_per_epoch) == (16, 3 * (479 // 2) // 16)
    TorchTrainer(
        _worker_loop,
        train_loop_config={"task_data": task_data, "out": str(tmp_path), "steps": plan.steps_per_epoch},
        scaling_config=ScalingConfig(num_workers=2, resources_per_worker={"CPU": 0.5}),
        datasets=task_data.datasets,
        dataset_config=task_data.data_config(),
        run_config=RunConfig(storage_path=str(tmp_path / "runs"), name="shards"),
    ).fit()
    seen = [json.load(open(tmp_path / f"rank{r}.json")) for r in range(2)]
    assert seen[0]["shapes"] == [[16, 1, 8, 8], "torch.float32", "torch.int64"]
    val = [set(s["val"]) for s in seen]
    assert sum(len(s["val"]) for s in seen) == task_data.num_val == 360  # every validation row once, none dropped
    assert not val[0] & val[1]
    reference = {
        img.numpy().tobytes().hex() + f":{int(y)}"
        for b in task_data.val_batches(task_data.datasets["val"], batch_size=400, device="cpu")
        for img, y in zip(b["image"], b["label"])
    }
    assert val[0] | val[1] == reference
    for worker in seen:
        assert worker["batches"] >= plan.steps_per_epoch and worker["sizes"] == [16]
        # The labels of each run of three agree (mirrored copies differ in bytes, not in label).
        labels = worker["labels"]
        assert all(len(set(labels[i:i + 3])) == 1 for i in range(0, len(labels) - 2, 3))
    # Disjoint training shards (digits has no duplicate images).
    assert not set(seen[0]["train"]) & set(seen[1]["train"])


@pytest.mark.slow(seconds=25)
def test_one_train_worker_reads_every_row_without_a_split(ray_local, tmp_path):
    """One Train worker reads each split itself: every validation row and every training row, and no split
    coordinator (an actor, a process start on the way to every trial's first batch)."""
    from ray._private.state import actors
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    task_data = load_task_data(parse_dataset_config({"source": "digits"}), seed=5)
    before = set(actors())
    TorchTrainer(
        _worker_loop,
        train_loop_config={"task_data": task_data, "out": str(tmp_path), "steps": task_data.num_train // 16},
        scaling_config=ScalingConfig(num_workers=1, resources_per_worker={"CPU": 0.5}),
        datasets=task_data.datasets,
        dataset_config=task_data.data_config(),
        run_config=RunConfig(storage_path=str(tmp_path / "runs"), name="whole"),
    ).fit()
    seen = json.load(open(tmp_path / "rank0.json"))
    assert len(seen["val"]) == len(set(seen["val"])) == task_data.num_val == 360
    assert seen["batches"] == task_data.num_train // 16 and len(set(seen["train"])) == seen["batches"] * 16
    started = {actors()[a]["ActorClassName"] for a in set(actors()) - before}
    assert not any("SplitCoordinator" in name for name in started), started


# The modules holding the functions Ray Data tasks run (map_batches): each task's worker imports one of them, and
# with it the package `study.data`, before its first batch.
BATCH_FUNCTION_MODULES = ("study.data.images", "study.data.text", "study.data.translation", "study.data.chat",
                          "study.data.image_sources", "study.data.text_sources", "study.data.segmentation",
                          "study.data.translation_sources", "study.data.chat_sources")


@pytest.mark.parametrize("module", BATCH_FUNCTION_MODULES)
def test_a_data_task_imports_its_batch_function_without_torch_or_mlflow(module):
    assert imported_with(module, ("torch", "mlflow", "datasets", "study.data.load")) == []
