"""`TaskData`: the Ray Data datasets of a trial plus the worker-side batch iterators.

Built on the trial driver by `load_task_data`; the datasets go to `TorchTrainer(datasets=...)` and the object itself
travels to the Train workers in `train_loop_config` (without the datasets, which stay on the driver: workers read
their shard with `ray.train.get_dataset_shard(name)`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Iterator, Protocol

import numpy as np

if TYPE_CHECKING:
    import torch


class BatchSteps(Protocol):
    """The worker-side steps that turn a Ray Data batch into what the model and the task read (on the training
    device): `study.data.images.BatchMixer` for images, `study.data.text.TokenTargets` for token windows."""

    def __call__(self, batch: dict, rng: np.random.Generator) -> dict:
        """A training batch (random steps such as Mixup draw from `rng`)."""

    def evaluate(self, batch: dict) -> dict:
        """A validation batch (deterministic)."""


CONTEXT_SPLIT = "val_ctx"  # + a length: the split of the validation documents in windows of that many tokens


def context_split(length: int) -> str:
    """The split the data makes for a context length (study/data/build.py: `eval_contexts`), which the language
    modelling task evaluates at that length."""
    return f"{CONTEXT_SPLIT}{length}"


def epoch_seed(seed: int, epoch: int, *more: int) -> int:
    return int(np.random.SeedSequence([seed, epoch, *more]).generate_state(1, np.uint32)[0])


TRAIN = "train"  # the split trained on; every other split is evaluated (each row once over all workers)


@dataclass
class TaskData:
    datasets: dict[str, Any]  # {"train": ..., "val": ..., and what a task may evaluate besides: "bank", ...}
    model_overrides: dict
    num_train: int | None
    num_val: int | None
    batch_steps: BatchSteps
    params: dict = field(default_factory=dict)  # resolved data settings worth logging (tokenizer, split, sizes)
    # text: the Tokenizer it was made with, which a later chat stage with tokenizer: nanochat and the stage's
    # benchmarks (on rank 0) read with too
    tokenizer: Any = field(default=None, repr=False)
    shuffle_buffer: int = 1024
    epoch_clock: Any = field(default=None, repr=False)  # study.data.epoch.EpochSource for random augmentation
    splits: tuple[str, ...] = ()  # the datasets' names (what the workers find as shards)
    # Evaluated splits whose rows are longer than the training rows, read in proportionally fewer rows per batch
    # (about the same tokens per batch): {split: rows per batch relative to the validation batch}.
    eval_batch_scale: dict[str, float] = field(default_factory=dict)
    # Repeated augmentation: each training row holds `repeats` augmented copies of one image (images.transform_batch).
    repeats: int = 1
    # Splits of a small in-memory source whose every epoch is the same: run once, before training (`materialize`).
    deterministic: tuple[str, ...] = ()

    def __post_init__(self):
        self.splits = tuple(self.datasets)

    def __getstate__(self):
        state = dict(self.__dict__)
        state["datasets"] = {}  # the datasets stay on the driver; workers use get_dataset_shard
        return state

    def materialize(self) -> None:
        """Run the deterministic splits once, now, so that the epochs read them from Ray's object store. Only before
        training: the study driver's pre-flight reads nothing but the sizes."""
        for name in self.deterministic:
            self.datasets[name] = self.datasets[name].materialize()
        self.deterministic = ()

    def data_config(self):
        """The `ray.train.DataConfig` to give TorchTrainer(dataset_config=...): training data split equally across
        workers (as Ray's default), every evaluated split without dropping rows so that each row is evaluated exactly
        once (Ray's equal split drops up to world_size - 1 rows). Those shards then differ in length by a few rows:
        accumulate evaluation sums locally and all-reduce once after the loop. One worker gets each dataset whole."""
        from ray.train import DataConfig

        class ExactValidationDataConfig(DataConfig):
            def configure(self, datasets, world_size, worker_handles, worker_node_ids, **kwargs):
                output = [{} for _ in range(world_size)]
                for name, ds in datasets.items():
                    if ds.name is None:
                        ds.set_name(name)
                    ds = ds.copy(ds)
                    ds.context.execution_options = self._resolve_execution_options(name)
                    if world_size == 1:
                        # The one worker reads every row itself: a split would start a coordinator actor (a process)
                        # per dataset on the way to the first batch of every trial.
                        output[0][name] = ds.iterator()
                        continue
                    hints = worker_node_ids if self._enable_shard_locality else None
                    splits = ds.streaming_split(world_size, equal=name == TRAIN, locality_hints=hints)
                    for i, split in enumerate(splits):
                        output[i][name] = split
                return output

        return ExactValidationDataConfig()

    # ---- worker side -------------------------------------------------------------------------------------------

    def train_batches(self, shard, *, batch_size: int, epoch: int, seed: int, device,
                      rank: int = 0) -> Iterator[dict[str, torch.Tensor]]:
        """Reshuffled (seeded by (seed, epoch, the worker's rank)), augmented training batches; the last partial
        batch is dropped. With repeated augmentation the shuffle moves an image's copies together and they sit side by
        side in the batches (a batch boundary may fall between them, as in DeiT's sampler)."""
        if self.epoch_clock is not None:
            self.epoch_clock.set(epoch)
        rows = -(-batch_size // self.repeats)
        batches = shard.iter_torch_batches(
            batch_size=rows,
            drop_last=self.repeats == 1,
            local_shuffle_buffer_size=max(-(-self.shuffle_buffer // self.repeats), rows),
            local_shuffle_seed=epoch_seed(seed, epoch, rank),
            device=device,
            prefetch_batches=2,
        )
        if self.repeats > 1:
            batches = copies_side_by_side(batches, batch_size)
        rng = np.random.default_rng([seed, epoch, rank, 1])
        for batch in batches:
            yield self.batch_steps(batch, rng)

    def train_rows_per_worker(self, workers: int) -> int | None:
        """Training rows (images, copies counted) each of `workers` workers is sure to get in an epoch: Ray's equal
        split gives each the same whole number of rows; with repeated augmentation a row is an image's copies, and
        each augment task keeps at least 1/repeats of its images."""
        if self.num_train is None:
            return None
        return self.repeats * (-(-self.num_train // self.repeats) // workers)

    def val_batches(self, shard, *, batch_size: int, device) -> Iterator[dict[str, torch.Tensor]]:
        """Every row of the shard once, in a fixed order (images: resize + centre crop, done in Ray Data)."""
        for batch in shard.iter_torch_batches(batch_size=batch_size, drop_last=False, device=device,
                                              prefetch_batches=2):
            yield self.batch_steps.evaluate(batch)


def copies_side_by_side(groups, batch_size: int) -> Iterator[dict]:
    """Batches of `batch_size` images from batches of rows that each hold an image's copies ({"image": (k, r, ...),
    "label": (k,)}): the copies of a row next to each other; the last partial batch is dropped."""
    import torch

    images, labels, held = [], [], 0
    for group in groups:
        copies = group["image"].shape[1]
        images.append(group["image"].flatten(0, 1))
        labels.append(group["label"].repeat_interleave(copies))
        held += len(labels[-1])
        while held >= batch_size:
            image, label = torch.cat(images), torch.cat(labels)
            yield {"image": image[:batch_size], "label": label[:batch_size]}
            images, labels, held = [image[batch_size:]], [label[batch_size:]], held - batch_size
