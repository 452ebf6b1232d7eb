"""Ray Data image pipeline against a plain torch DataLoader doing the same work on the same data.

32x32 PNG images in local parquet shards (generated, CIFAR-sized), the training transform of `study.data`
(decode, random resized crop, flip; `--augment three_augment` adds 3-Augment) and the worker-side normalisation,
with the same number of CPU workers on both sides. Measured side by side in one run; prints one JSON object:

- ``ray_rows_per_s``: median training rows per second over warm epochs of `TaskData.train_batches` (Ray Data:
  read_parquet -> map_batches decode + augment -> seeded local shuffle buffer -> iter_torch_batches -> normalise).
- ``torch_rows_per_s``: the same work with a DataLoader: its workers read the same parquet row groups (in a seeded
  order) and run the same `transform_batch`; the main process keeps a shuffle buffer of the same size and
  normalises. ``ratio`` = ray / torch; target >= 0.8.
- ``torch_in_memory_rows_per_s``: a DataLoader over the encoded images held in memory (map-style, random sampler,
  the usual CIFAR set-up: no reads at all), and ``ratio_vs_in_memory``.
  The three pipelines alternate epoch by epoch (this machine is shared: alternation keeps load drift out of the
  ratios).
- ``*_first_batch_s``: time from asking for the first epoch to the first batch, cold (Ray Data: executor start,
  fresh task workers importing the transform, one map task's output, the shuffle buffer's fill; DataLoader: spawning
  its persistent workers, which import the same modules), and the median over warm epochs.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import statistics
import tempfile
import time

import numpy as np
import torch


def make_shards(root: str, rows: int, shards: int, seed: int = 0) -> list[bytes]:
    import pyarrow as pa
    import pyarrow.parquet as pq
    from PIL import Image

    rng = np.random.default_rng(seed)
    encoded = []
    for _ in range(rows):
        # smooth-ish content so PNG sizes are CIFAR-like (~2-3 kB), not incompressible noise
        base = rng.integers(0, 256, (8, 8, 3), dtype=np.uint8)
        image = Image.fromarray(base).resize((32, 32), Image.BILINEAR)
        noisy = np.clip(np.asarray(image, dtype=np.int16) + rng.integers(-12, 13, (32, 32, 3)), 0, 255)
        buf = io.BytesIO()
        Image.fromarray(noisy.astype(np.uint8)).save(buf, format="PNG")
        encoded.append(buf.getvalue())
    labels = rng.integers(0, 100, rows)
    per = rows // shards
    for s in range(shards):
        part = slice(s * per, rows if s == shards - 1 else (s + 1) * per)
        pq.write_table(pa.table({"image": encoded[part], "label": labels[part]}), f"{root}/train-{s:03d}.parquet",
                       row_group_size=1000)
    return encoded, labels


def time_epoch(batches) -> tuple[float, float]:
    """(seconds to the first batch, rows per second) of one pass."""
    start = time.perf_counter()
    first, rows = None, 0
    for batch in batches:
        if first is None:
            first = time.perf_counter() - start
        rows += len(batch["label"])
    return first, rows / (time.perf_counter() - start)


class ParquetStream(torch.utils.data.IterableDataset):
    """Row groups of the parquet shards, split across the DataLoader workers, decoded and augmented in chunks."""

    def __init__(self, files, spec, seed, chunk):
        import pyarrow.parquet as pq

        self.units = [(f, g) for f in files for g in range(pq.ParquetFile(f).num_row_groups)]
        self.spec, self.seed, self.chunk, self.epoch = spec, seed, chunk, 0

    def __iter__(self):
        import pyarrow.parquet as pq

        from study.data.images import transform_batch

        info = torch.utils.data.get_worker_info()
        order = np.random.default_rng([self.seed, self.epoch]).permutation(len(self.units))
        self.epoch += 1  # persistent workers keep their copy: count the epochs there
        for index in order[info.id::info.num_workers] if info else order:
            path, group = self.units[index]
            table = pq.ParquetFile(path).read_row_group(group, columns=["image", "label"])
            images = table.column("image").to_numpy(zero_copy_only=False)
            labels = table.column("label").to_numpy()
            for i in range(0, len(labels), self.chunk):
                out = transform_batch({"image": images[i:i + self.chunk], "label": labels[i:i + self.chunk]},
                                      self.spec, train=True, seed=self.seed)
                yield {"image": torch.from_numpy(out["image"]), "label": torch.from_numpy(out["label"])}


def shuffled_batches(parts, buffer_rows: int, batch_size: int, rng: np.random.Generator):
    """A local shuffle buffer like Ray Data's: once it holds buffer_rows rows, emit random batches from it."""
    images, labels = [], []
    held = 0
    for part in parts:
        images.append(part["image"])
        labels.append(part["label"])
        held += len(part["label"])
        while held >= buffer_rows + batch_size:
            all_images, all_labels = torch.cat(images), torch.cat(labels)
            pick = torch.from_numpy(rng.permutation(held))
            take, keep = pick[:batch_size], pick[batch_size:]
            yield {"image": all_images[take], "label": all_labels[take]}
            images, labels, held = [all_images[keep]], [all_labels[keep]], held - batch_size
    all_images, all_labels = torch.cat(images), torch.cat(labels)
    pick = torch.from_numpy(rng.permutation(held))
    for start in range(0, held - batch_size + 1, batch_size):  # drop_last, as train_batches does
        take = pick[start:start + batch_size]
        yield {"image": all_images[take], "label": all_labels[take]}


class EncodedImages(torch.utils.data.Dataset):
    """Batches of encoded images indexed by lists of rows (a BatchSampler), transformed like the Ray pipeline."""

    def __init__(self, encoded, labels, spec, seed):
        self.encoded, self.labels, self.spec, self.seed = np.array(encoded, dtype=object), labels, spec, seed

    def __len__(self):
        return len(self.encoded)

    def __getitem__(self, rows):
        from study.data.images import transform_batch

        batch = {"image": self.encoded[rows], "label": self.labels[rows]}
        out = transform_batch(batch, self.spec, train=True, seed=self.seed)
        return {"image": torch.from_numpy(out["image"]), "label": torch.from_numpy(out["label"])}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=50_000, help="training images (CIFAR: 50 000)")
    parser.add_argument("--workers", type=int, default=2, help="CPU workers on each side")
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--augment", default="basic", choices=["basic", "three_augment"])
    parser.add_argument("--epochs", type=int, default=3, help="warm epochs of each pipeline, after a cold one")
    args = parser.parse_args()

    import ray

    from study.data import load_task_data, parse_dataset_config
    from study.data.build import IMAGE_MAP_BATCH
    from study.data.images import ImageSpec

    root = tempfile.mkdtemp(prefix="lsbench")
    os.makedirs(f"{root}/train")
    os.makedirs(f"{root}/val")
    encoded, labels = make_shards(f"{root}/train", args.rows, shards=4)
    make_shards(f"{root}/val", 256, shards=1, seed=1)
    cfg = parse_dataset_config({"source": "parquet", "path": f"{root}/train", "val_path": f"{root}/val",
                                "augment": args.augment, "num_classes": 100, "in_chans": 3})

    # --- Ray Data: the study's own pipeline on a local Ray instance with `workers` CPUs -----------------------
    start = time.perf_counter()
    ray.init(num_cpus=args.workers, include_dashboard=False, log_to_driver=False,
             _temp_dir=tempfile.mkdtemp(prefix="lsr", dir="/tmp"))
    ray.data.DataContext.get_current().enable_progress_bars = False
    ray_init_s = time.perf_counter() - start
    data = load_task_data(cfg, seed=0)

    def ray_epoch(epoch):
        return data.train_batches(data.datasets["train"], batch_size=args.batch_size, epoch=epoch, seed=0,
                                  device="cpu")

    # --- torch DataLoader: same transform code, same batches of work, same worker count ------------------------
    spec = ImageSpec(image_size=32, in_chans=3, augment=args.augment)
    dataset = EncodedImages(encoded, labels, spec, seed=0)
    mixer = data.batch_steps

    # spawned (not forked: the parent holds Ray's and torch's threads), persistent workers, started in the cold epoch
    loader_args = {"batch_size": None, "num_workers": args.workers, "prefetch_factor": 4,
                   "persistent_workers": True, "multiprocessing_context": "spawn"}
    sampler = torch.utils.data.BatchSampler(
        torch.utils.data.RandomSampler(dataset, generator=torch.Generator().manual_seed(0)), IMAGE_MAP_BATCH,
        drop_last=False)
    memory_loader = torch.utils.data.DataLoader(dataset, sampler=sampler, **loader_args)

    def torch_epoch(epoch):
        pending = []
        for part in memory_loader:  # regroup the map-sized batches into training batches, as Ray Data does
            pending.append(part)
            if sum(len(p["label"]) for p in pending) >= args.batch_size:
                images = torch.cat([p["image"] for p in pending])
                labels_ = torch.cat([p["label"] for p in pending])
                pending = []
                yield mixer({"image": images, "label": labels_}, np.random.default_rng(epoch))

    files = sorted(os.path.join(f"{root}/train", f) for f in os.listdir(f"{root}/train"))

    stream_loader = torch.utils.data.DataLoader(ParquetStream(files, spec, seed=0, chunk=IMAGE_MAP_BATCH),
                                                **loader_args)

    def torch_stream_epoch(epoch):
        rng = np.random.default_rng([0, epoch])
        for batch in shuffled_batches(stream_loader, data.shuffle_buffer, args.batch_size, rng):
            yield mixer(batch, rng)

    ray_runs, torch_runs, memory_runs = [time_epoch(ray_epoch(0))], [time_epoch(torch_stream_epoch(0))], \
        [time_epoch(torch_epoch(0))]  # cold
    for epoch in range(1, args.epochs + 1):  # warm, alternating
        ray_runs.append(time_epoch(ray_epoch(epoch)))
        torch_runs.append(time_epoch(torch_stream_epoch(epoch)))
        memory_runs.append(time_epoch(torch_epoch(epoch)))
    ray.shutdown()
    median = lambda runs, i: statistics.median(r[i] for r in runs[1:])  # noqa: E731
    result = {
        "rows": args.rows, "workers": args.workers, "batch_size": args.batch_size, "augment": args.augment,
        "image": "32x32 PNG", "cpus_on_machine": os.cpu_count(),
        "ray_rows_per_s": round(median(ray_runs, 1), 1), "torch_rows_per_s": round(median(torch_runs, 1), 1),
        "ratio": round(median(ray_runs, 1) / median(torch_runs, 1), 3), "target_ratio": 0.8,
        "torch_in_memory_rows_per_s": round(median(memory_runs, 1), 1),
        "ratio_vs_in_memory": round(median(ray_runs, 1) / median(memory_runs, 1), 3),
        "ray_first_batch_s": round(ray_runs[0][0], 3), "torch_first_batch_s": round(torch_runs[0][0], 3),
        "ray_first_batch_warm_s": round(median(ray_runs, 0), 3),
        "torch_first_batch_warm_s": round(median(torch_runs, 0), 3),
        "ray_init_s": round(ray_init_s, 2),
        "ray_rows_per_s_each_epoch": [round(r[1], 1) for r in ray_runs],
        "torch_rows_per_s_each_epoch": [round(r[1], 1) for r in torch_runs],
        "torch_in_memory_rows_per_s_each_epoch": [round(r[1], 1) for r in memory_runs],
    }
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
