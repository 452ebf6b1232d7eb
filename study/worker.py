"""What a Ray Train worker knows about itself and shares with the others: its rank, the world size, its device,
sums over all workers, and the seeding that makes a run repeat exactly."""

from __future__ import annotations

import random
from contextlib import nullcontext
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist


@dataclass(frozen=True)
class Worker:
    rank: int
    world: int
    device: torch.device

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """The sum of `tensor` over every worker (the tensor itself with one worker), on the CPU."""
        if self.world > 1 and dist.is_initialized():
            moved = tensor.to("cuda" if dist.get_backend() == "nccl" else "cpu")
            dist.all_reduce(moved)
            return moved.cpu()
        return tensor

    def autocast(self, precision: str):
        """bf16 autocast when asked for, or on a GPU by default (`precision: auto`); fp32 otherwise."""
        if precision == "bf16" or (precision == "auto" and self.device.type == "cuda"):
            return torch.autocast(device_type=self.device.type, dtype=torch.bfloat16)
        return nullcontext()


def seed_everything(seed: int, *more: int) -> None:
    """Seed Python, numpy and torch from (seed, *more): the same initial weights on every worker from (seed,), and
    a stream per (seed, epoch, rank) that a restarted run draws again exactly."""
    value = int(np.random.SeedSequence([seed, *more]).generate_state(1, np.uint32)[0])
    random.seed(value)
    np.random.seed(value)
    torch.manual_seed(value)
