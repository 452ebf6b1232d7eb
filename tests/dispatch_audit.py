"""Record the shape of every tensor an op creates, to prove what a code path never materialises."""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


class ShapeAudit(TorchDispatchMode):
    """Inside ``with ShapeAudit() as audit:`` every op output's shape lands in ``audit.shapes``, forward and backward
    (autograd runs backward ops through the dispatcher too)."""

    def __init__(self):
        super().__init__()
        self.shapes: list[tuple[str, tuple[int, ...]]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self.shapes.append((str(func), tuple(t.shape)))
        return out

    def largest(self) -> int:
        return max((torch.Size(shape).numel() for _, shape in self.shapes), default=0)
