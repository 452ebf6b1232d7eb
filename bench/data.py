"""Ray Data image pipeline against a plain torch DataLoader doing the same work on the same data.

32x32 PNG images in local parquet shards (generated, CIFAR-sized), the training transform of `study.data`
(decode, random resized crop, flip; `--augment three_augment` adds 3-Augment) and the worker-side normalisation,
with the same number of CPU workers on both sides. Measured side by side in one run; prints one JSON object:

- ``ray_rows_per_s`` / ``torch_rows_per_s``: training rows per second of a warm epoch (the second one) through
  `TaskData.train_batches` (Ray Data: read_parquet -> map_batches decode + augment -> local shuffle ->
  iter_torch_batches) and through a DataLoader whose workers run the same `transform_batch` on the same batches of
  encoded images (held in memory: the DataLoader is spared the parquet reads).
- ``ratio``: ray / torch. Target >= 0.8.
- ``*_first_batch_s``: time from asking for the first epoch to the first batch (Ray Data's executor start, the
  DataLoader's worker start), cold.
"""

from __future__ import annotations

import argparse
import io
import json
import os
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


def time_epochs(make_iter, epochs: int) -> tuple[float, list[float]]:
    first_batch, rates = None, []
    for epoch in range(epochs):
        start = time.perf_counter()
        rows = 0
        for batch in make_iter(epoch):
            if first_batch is None:
                first_batch = time.perf_counter() - start
            rows += len(batch["label"])
        rates.append(rows / (time.perf_counter() - start))
    return first_batch, rates


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
    parser.add_argument("--rows", type=int, default=20_000)
    parser.add_argument("--workers", type=int, default=2, help="CPU workers on each side")
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--augment", default="basic", choices=["basic", "three_augment"])
    parser.add_argument("--epochs", type=int, default=2)
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
    data = load_task_data("classification", cfg, seed=0)
    ray_first, ray_rates = time_epochs(
        lambda e: data.train_batches(data.datasets["train"], batch_size=args.batch_size, epoch=e, seed=0,
                                     device="cpu"), args.epochs)
    ray.shutdown()

    # --- torch DataLoader: same transform code, same batches of work, same worker count ------------------------
    spec = ImageSpec(image_size=32, in_chans=3, augment=args.augment)
    dataset = EncodedImages(encoded, labels, spec, seed=0)
    mixer = data.mixer

    def torch_epoch(epoch):
        generator = torch.Generator().manual_seed(epoch)
        sampler = torch.utils.data.BatchSampler(torch.utils.data.RandomSampler(dataset, generator=generator),
                                                IMAGE_MAP_BATCH, drop_last=False)
        loader = torch.utils.data.DataLoader(dataset, sampler=sampler, batch_size=None, num_workers=args.workers,
                                             persistent_workers=False, prefetch_factor=4)
        pending = []
        for part in loader:  # regroup the map-sized batches into training batches, as Ray Data does
            pending.append(part)
            if sum(len(p["label"]) for p in pending) >= args.batch_size:
                images = torch.cat([p["image"] for p in pending])
                labels_ = torch.cat([p["label"] for p in pending])
                pending = []
                yield mixer({"image": images, "label": labels_}, np.random.default_rng(epoch))

    torch_first, torch_rates = time_epochs(torch_epoch, args.epochs)
    result = {
        "rows": args.rows, "workers": args.workers, "batch_size": args.batch_size, "augment": args.augment,
        "image": "32x32 PNG", "cpus_on_machine": os.cpu_count(),
        "ray_rows_per_s": round(ray_rates[-1], 1), "torch_rows_per_s": round(torch_rates[-1], 1),
        "ratio": round(ray_rates[-1] / torch_rates[-1], 3), "target_ratio": 0.8,
        "ray_first_batch_s": round(ray_first, 3), "torch_first_batch_s": round(torch_first, 3),
        "ray_init_s": round(ray_init_s, 2),
        "ray_rows_per_s_each_epoch": [round(r, 1) for r in ray_rates],
        "torch_rows_per_s_each_epoch": [round(r, 1) for r in torch_rates],
    }
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
