"""The "a tiny model must learn" check shared by the model tests: 8x8 scikit-learn digits (ship offline), a fixed
split, a plain training loop that drives the model's training hooks, stopping once validation accuracy is reached."""

import pytest
import torch
import torch.nn.functional as F

TRAIN_SIZE = 1437  # of 1797: 80% to train on


def train_on_digits(model, optimizer, *, epochs: int, target: float, batch_size: int = 64) -> tuple[float, int]:
    """Best validation accuracy, and the epochs it took (all of them when `target` was not reached). Batches are
    shuffled by torch's global generator: seed it before building the model."""
    # scikit-learn ships the digits. bench/gpu_check.sh runs the model tests on a machine whose python holds torch,
    # Triton, numpy and pytest only; this check trains on the CPU anyway, so the CPU suite loses nothing there.
    datasets = pytest.importorskip("sklearn.datasets", reason="the digits ship with scikit-learn")
    digits = datasets.load_digits()
    x = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 8.0 - 1.0
    y = torch.tensor(digits.target)
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(0))
    train, val = order[:TRAIN_SIZE], order[TRAIN_SIZE:]
    steps_per_epoch = -(-len(train) // batch_size)
    best = 0.0
    for epoch in range(epochs):
        model.train()
        for i, batch in enumerate(train[torch.randperm(len(train))].split(batch_size)):
            model.set_training_step(epoch * steps_per_epoch + i, epochs * steps_per_epoch)
            loss = F.cross_entropy(model(x[batch]), y[batch]) + model.regularization_loss()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        model.eval()
        with torch.no_grad():
            best = max(best, (model(x[val]).argmax(-1) == y[val]).float().mean().item())
        if best >= target:
            return best, epoch + 1
    return best, epochs
