"""`TrainState`: what a run carries from one optimiser step to the next and from a checkpoint to its restart.

A checkpoint is one `torch.save` file in a folder that the run's host (study/host.py) persists to the run's storage
and hands back, as a Ray Train `Checkpoint`, when the run restarts.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import ray.train
import torch

CHECKPOINT_FILE = "state.pt"


@dataclass
class TrainState:
    model: torch.nn.Module  # the bare model: what is saved and evaluated
    trained: torch.nn.Module  # what training forwards through: the model, or its DDP wrapper with several workers
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    epoch: int = 0  # the last finished epoch
    step: int = 0  # optimiser steps taken
    history: list[dict] = field(default_factory=list)  # every finished epoch's metrics, in order
    mlflow_run_id: str = ""

    def restore(self, checkpoint: ray.train.Checkpoint | None, device: torch.device) -> None:
        """Continue from `checkpoint` (None: a fresh run)."""
        if checkpoint is None:
            return
        with checkpoint.as_directory() as folder:
            saved = torch.load(Path(folder) / CHECKPOINT_FILE, map_location=device, weights_only=False)
        self.model.load_state_dict(saved["model"])
        self.optimizer.load_state_dict(saved["optimizer"])
        self.scheduler.load_state_dict(saved["scheduler"])
        self.epoch, self.step, self.history = saved["epoch"], saved["step"], saved["history"]
        self.mlflow_run_id = saved.get("mlflow_run_id", "")

    def save(self, folder: Path, carry: dict | None = None) -> None:
        """Write the checkpoint into `folder`. `carry`: what the run's next stage starts from (saved with the last
        epoch)."""
        torch.save({"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(),
                    "scheduler": self.scheduler.state_dict(), "epoch": self.epoch, "step": self.step,
                    "history": self.history, "mlflow_run_id": self.mlflow_run_id, "carry": carry},
                   Path(folder) / CHECKPOINT_FILE)
