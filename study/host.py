"""The process a run's loop runs in, and where its reports and checkpoints go.

- `TrainWorkerHost`: a worker of a Ray Train worker group. Train persists rank 0's checkpoints under the run's
  folder, hands the latest back to a restarted group, and forwards reports to Tune (`TuneReportCallback`).
- `InProcessHost`: Ray Train's local mode (`ScalingConfig(num_workers=0)`), where the training function runs in the
  calling process: a one-worker trial trains in its own Tune trial process, and `lapstudy train` in the command's,
  without starting a Train controller and a worker process per run. In Ray 2.60 local mode keeps only the last
  report in memory and refuses `ray.train.report` inside a Tune trial, so this host persists checkpoints itself, in
  Train's layout (`<storage>/<run name>/checkpoint_<time>/`, the newest `CHECKPOINTS_KEPT`), finds the newest
  again when the run restarts under the same name, and reports to Tune directly.
"""

from __future__ import annotations

import shutil
import tempfile
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import ray.train
import ray.train.torch
import torch
from ray import tune
from ray.tune.integration.ray_train import CHECKPOINT_PATH_KEY

from study.worker import Worker

# Train keeps the newest checkpoints only: enough to resume, bounded on disk for large models.
CHECKPOINTS_KEPT = 2
CHECKPOINT_PREFIX = "checkpoint_"


def newest_checkpoint(run_folder: Path) -> Path | None:
    """The newest complete checkpoint of a run (both hosts name them by time, so the names sort by age)."""
    found = [path for path in Path(run_folder).glob(f"{CHECKPOINT_PREFIX}*") if path.is_dir()]
    return max(found) if found else None


class TrainWorkerHost:
    def worker(self) -> Worker:
        context = ray.train.get_context()
        return Worker(context.get_world_rank(), context.get_world_size(), ray.train.torch.get_device())

    def prepare_model(self, model: torch.nn.Module) -> torch.nn.Module:
        return ray.train.torch.prepare_model(model)  # on the worker's device, DDP-wrapped with several workers

    def latest_checkpoint(self) -> ray.train.Checkpoint | None:
        return ray.train.get_checkpoint()

    def report(self, metrics: dict, checkpoint: Path | None = None) -> None:
        """A barrier: every worker reports; rank 0 with the checkpoint folder (Train copies it to storage)."""
        ray.train.report(metrics, checkpoint=None if checkpoint is None else ray.train.Checkpoint.from_directory(
            checkpoint))


@dataclass(frozen=True)
class InProcessHost:
    run_folder: Path  # <storage>/<run name>: the same folder a Train worker group of that name would use
    to_tune: bool  # inside a Tune trial: every report goes to Tune (what ASHA and the sampler see)

    def worker(self) -> Worker:
        return Worker(0, 1, ray.train.torch.get_device())

    def prepare_model(self, model: torch.nn.Module) -> torch.nn.Module:
        return model.to(ray.train.torch.get_device())

    def latest_checkpoint(self) -> ray.train.Checkpoint | None:
        newest = newest_checkpoint(self.run_folder)
        return None if newest is None else ray.train.Checkpoint.from_directory(str(newest))

    def report(self, metrics: dict, checkpoint: Path | None = None) -> None:
        if checkpoint is not None:
            # What TuneReportCallback adds for a Train worker group: where the trial's checkpoint is.
            metrics = {**metrics, CHECKPOINT_PATH_KEY: str(self._persist(checkpoint))}
        if self.to_tune:
            tune.report(metrics)

    def _persist(self, checkpoint: Path) -> Path:
        """Copy under a temporary name, then rename: a process killed mid-copy leaves no half checkpoint that a
        restart would take for the newest."""
        self.run_folder.mkdir(parents=True, exist_ok=True)
        persisted = self.run_folder / f"{CHECKPOINT_PREFIX}{datetime.now().strftime('%Y-%m-%d_%H-%M-%S.%f')}"
        with tempfile.TemporaryDirectory(dir=self.run_folder, prefix=".incomplete_") as staging:
            shutil.copytree(checkpoint, Path(staging) / persisted.name)
            (Path(staging) / persisted.name).rename(persisted)
        for old in sorted(p for p in self.run_folder.glob(f"{CHECKPOINT_PREFIX}*") if p.is_dir())[:-CHECKPOINTS_KEPT]:
            shutil.rmtree(old, ignore_errors=True)
        return persisted
