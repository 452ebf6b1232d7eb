"""The process a run's loop runs in, and where its reports and checkpoints go.

- `TrainWorkerHost`: a worker of a Ray Train worker group. Train persists rank 0's checkpoints under the run's
  folder, hands the latest back to a restarted group, and forwards reports to Tune (`TuneReportCallback`).
- `InProcessHost`: Ray Train's local mode (`ScalingConfig(num_workers=0)`), where the training function runs in the
  calling process: a one-worker trial trains in its own Tune trial process, and `lapstudy train` in the command's,
  without starting a Train controller and a worker process per run. In Ray 2.60 local mode keeps only the last
  report in memory and refuses `ray.train.report` inside a Tune trial, so this host persists checkpoints itself, in
  Train's layout (`<storage>/<run name>/checkpoint_<time>/`, the newest `CHECKPOINTS_KEPT`), finds the newest
  again when the run restarts under the same name, and reports to Tune directly. The run's folder may be in object
  storage (study/storage.py), as Train's own would be.
"""

from __future__ import annotations

import posixpath
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import pyarrow.fs
import ray.train
import ray.train.torch
import torch
from ray import tune
from ray.tune.integration.ray_train import CHECKPOINT_PATH_KEY

from study.state import CHECKPOINT_FILE
from study.storage import filesystem, join
from study.worker import Worker

# Train keeps the newest checkpoints only: enough to resume, bounded on disk for large models.
CHECKPOINTS_KEPT = 2
CHECKPOINT_PREFIX = "checkpoint_"


def _checkpoints(run_folder: str) -> list[str]:
    """The names of a run's complete checkpoints, oldest first (both hosts name them by time). Complete: holding
    its state file, which object storage shows only once whole."""
    fs, path = filesystem(run_folder)
    infos = fs.get_file_info(pyarrow.fs.FileSelector(path, allow_not_found=True))
    names = sorted(info.base_name for info in infos
                   if info.type == pyarrow.fs.FileType.Directory and info.base_name.startswith(CHECKPOINT_PREFIX))
    states = fs.get_file_info([posixpath.join(path, name, CHECKPOINT_FILE) for name in names])
    return [name for name, state in zip(names, states) if state.type == pyarrow.fs.FileType.File]


def newest_checkpoint(run_folder: str) -> str | None:
    """Where the newest complete checkpoint of a run (a path or URI, as `run_folder`) is; None if it has none."""
    found = _checkpoints(run_folder)
    return join(run_folder, found[-1]) if found else None


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
    run_folder: str  # <storage>/<run name> (path or URI): the folder a Train worker group of that name would use
    to_tune: bool  # inside a Tune trial: every report goes to Tune (what ASHA and the sampler see)

    def worker(self) -> Worker:
        return Worker(0, 1, ray.train.torch.get_device())

    def prepare_model(self, model: torch.nn.Module) -> torch.nn.Module:
        return model.to(ray.train.torch.get_device())

    def latest_checkpoint(self) -> ray.train.Checkpoint | None:
        newest = newest_checkpoint(self.run_folder)
        return None if newest is None else ray.train.Checkpoint(newest)

    def report(self, metrics: dict, checkpoint: Path | None = None) -> None:
        if checkpoint is not None:
            # What TuneReportCallback adds for a Train worker group: where the trial's checkpoint is.
            metrics = {**metrics, CHECKPOINT_PATH_KEY: self._persist(checkpoint)}
        if self.to_tune:
            tune.report(metrics)

    def _persist(self, checkpoint: Path) -> str:
        """Copied whole or not at all, as a restart sees it: on a local disk under a temporary name, then renamed; in
        object storage, where an object appears once whole, the state file last."""
        fs, root = filesystem(self.run_folder)
        name = f"{CHECKPOINT_PREFIX}{datetime.now().strftime('%Y-%m-%d_%H-%M-%S.%f')}"
        local = isinstance(fs, pyarrow.fs.LocalFileSystem)
        copy_to = posixpath.join(root, f".incomplete_{name}" if local else name)
        fs.create_dir(copy_to, recursive=True)
        files = sorted(Path(checkpoint).rglob("*"), key=lambda file: file.name == CHECKPOINT_FILE)
        for file in (file for file in files if file.is_file()):
            target = posixpath.join(copy_to, file.relative_to(checkpoint).as_posix())
            fs.create_dir(posixpath.dirname(target), recursive=True)
            pyarrow.fs.copy_files(str(file), target, destination_filesystem=fs)
        if local:
            fs.move(copy_to, posixpath.join(root, name))
        for old in _checkpoints(self.run_folder)[:-CHECKPOINTS_KEPT]:
            fs.delete_dir(posixpath.join(root, old))
        return join(self.run_folder, name)
