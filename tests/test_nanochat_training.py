"""`optimizer: nanochat` in the study's training loop: nanochat's Muon + AdamW split with its learning rates, its
schedule set by `NanochatSchedule` alone (no LambdaLR on top), checkpoints that resume the same next step, and a
tiny GPT that learns with it. The truths are written out from nanochat's scripts/base_train.py, mid_train.py and
chat_sft.py at commit e1770a3, not read back from study/."""

from __future__ import annotations

import tempfile
from contextlib import nullcontext
from pathlib import Path

import pytest
import torch

from models import build_model
from study.errors import UserError
from study.optim import NanochatOptimizer, build_optimizer, build_schedule, peak_lr
from study.runspec import TrainConfig, check_run_config, resolve
from study.state import CHECKPOINT_FILE, TrainState
from study.tasks import GeometrySpec, StepSettings, task_class
from study.worker import Worker

WORKER = Worker(0, 1, torch.device("cpu"))
TINY = {"preset": "gpt_tiny", "block_style": "nanochat", "vocab_size": 37, "context_length": 16, "dim": 32,
        "depth": 2, "num_heads": 4}
NANOCHAT = TrainConfig(optimizer="nanochat", weight_decay=0.0)


def _state(train: TrainConfig = NANOCHAT, steps_per_epoch: int = 10, epochs: int = 2, seed: int = 0):
    torch.manual_seed(seed)
    model = build_model(TINY)
    optimizer = build_optimizer(model, train, 1.0)
    return TrainState(model, model, optimizer, build_schedule(optimizer, train, steps_per_epoch, epochs))


def _batch(seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 37, (4, 17), generator=g)
    return {"input_ids": tokens[:, :-1], "targets": tokens[:, 1:], "target_bytes": torch.ones(4, 16, dtype=torch.long)}


def _step(state: TrainState, batch: dict, steps_per_epoch: int = 10, epochs: int = 2) -> torch.Tensor:
    task = task_class("language_modeling")(state.model, WORKER, seed=0, geometry=GeometrySpec(),
                                           resolved=resolve({}, "language_modeling", {}, epochs=epochs))
    return task.train_step(state, batch, StepSettings(nullcontext(), 1.0, steps_per_epoch, epochs))


def test_muon_for_block_matrices_adamw_for_embedding_and_head_at_nanochats_lrs():
    state = _state()
    model, optimizer = state.model, state.optimizer
    assert isinstance(optimizer, NanochatOptimizer)
    assert isinstance(optimizer.muon, torch.optim.Muon) and isinstance(optimizer.adamw, torch.optim.AdamW)
    muon = {id(p) for g in optimizer.muon.param_groups for p in g["params"]}
    matrices = {id(p) for p in model.blocks.parameters() if p.ndim == 2}
    assert muon == matrices and matrices
    groups = {g["name"]: g for g in optimizer.adamw.param_groups}
    assert [p is model.wte.weight for p in groups["embedding"]["params"]] == [True]
    assert [p is model.lm_head.weight for p in groups["lm_head"]["params"]] == [True]
    scale = (32 / 768) ** -0.5  # gpt.py setup_optimizers: dmodel_lr_scale
    assert groups["embedding"]["lr"] == pytest.approx(0.2 * scale)
    assert groups["lm_head"]["lr"] == pytest.approx(0.004 * scale)
    assert optimizer.muon.param_groups[0]["lr"] == pytest.approx(0.02)
    assert optimizer.adamw.defaults["betas"] == (0.8, 0.95) and optimizer.adamw.defaults["eps"] == 1e-10
    assert optimizer.muon.param_groups[0]["nesterov"] and optimizer.muon.param_groups[0]["ns_steps"] == 5
    assert not any("lr_scale" in g for g in optimizer.param_groups)
    assert not isinstance(state.scheduler, torch.optim.lr_scheduler.LRScheduler)


def test_lr_and_momentum_follow_nanochats_schedule_step_by_step():
    """20 steps, warmdown_ratio 0.2: base_train's get_lr_multiplier is 1 through step 16, then (20 - s) / 4;
    get_muon_momentum is 0.85 + 0.1 * s / 300. Taken from the groups after real optimiser steps, so a second
    schedule on top (a LambdaLR multiplying again) would show."""
    state = _state()
    groups = state.optimizer.param_groups
    initial = [g["lr"] for g in groups]
    expected = {0: 1.0, 5: 1.0, 16: 1.0, 17: 0.75, 18: 0.5, 19: 0.25}
    for step in range(20):
        if step in expected:
            assert [g["lr"] for g in groups] == pytest.approx([lr * expected[step] for lr in initial]), step
            assert peak_lr(state.optimizer) == pytest.approx(0.02 * expected[step])
            assert state.optimizer.muon.param_groups[0]["momentum"] == pytest.approx(0.85 + 0.1 * step / 300)
        _step(state, _batch(step))
    assert state.step == 20 and [g["lr"] for g in groups] == pytest.approx([0.0] * len(groups))


def test_sft_schedule_decays_from_the_first_step_with_a_flat_momentum():
    """chat_sft.py: lrm = 1 - it / num_iterations and Muon's momentum left at 0.95 (warmdown_ratio 1,
    muon_momentum_warmup 0); min_lr_ratio is nanochat's final_lr_frac."""
    state = _state(TrainConfig(optimizer="nanochat", weight_decay=0.0, warmdown_ratio=1.0, muon_momentum_warmup=0,
                               matrix_lr=0.02 * 0.02), steps_per_epoch=4, epochs=2)
    for step in range(8):
        assert peak_lr(state.optimizer) == pytest.approx(0.0004 * (1 - step / 8))
        assert state.optimizer.muon.param_groups[0]["momentum"] == 0.95
        state.scheduler.step()


def test_checkpoint_round_trip_resumes_the_same_next_step():
    """Three steps, a checkpoint as TrainState.report writes it, then step four: in the same process and in a fresh
    one restored from the checkpoint (Adam moments, Muon's momentum buffers and the schedule's position)."""
    import ray.train

    state = _state()
    for step in range(3):
        _step(state, _batch(step))
    with tempfile.TemporaryDirectory() as folder:
        torch.save({"model": state.model.state_dict(), "optimizer": state.optimizer.state_dict(),
                    "scheduler": state.scheduler.state_dict(), "epoch": 0, "step": state.step, "history": [],
                    "mlflow_run_id": ""}, Path(folder) / CHECKPOINT_FILE)
        resumed = _state(seed=1)
        resumed.restore(ray.train.Checkpoint.from_directory(folder), torch.device("cpu"))
    assert resumed.step == 3
    assert [g["lr"] for g in resumed.optimizer.param_groups] == [g["lr"] for g in state.optimizer.param_groups]
    for this in (state, resumed):
        _step(this, _batch(3))
    for a, b in zip(state.model.parameters(), resumed.model.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_a_tiny_gpt_learns_a_fixed_batch_with_it():
    """The loss on one fixed batch falls by half in 30 steps, and Muon moved every matrix of the blocks (nanochat
    zero-initialises the output projections: only an update makes them non-zero)."""
    state = _state(steps_per_epoch=30, epochs=1)
    before = {name: p.detach().clone() for name, p in state.model.blocks.named_parameters() if p.ndim == 2}
    batch = _batch()
    losses = [_step(state, batch, 30, 1).item() for _ in range(30)]
    assert losses[-1] < 0.5 * losses[0], losses
    after = dict(state.model.blocks.named_parameters())
    assert all(not torch.equal(before[name], after[name]) for name in before)


def test_nanochat_optimizer_is_for_gpts_only():
    with pytest.raises(UserError, match=r"hyperparameters\.optimizer: nanochat .* use adamw, lamb or sgd"):
        check_run_config({"preset": "vit_tiny_digits", "optimizer": "nanochat"}, "classification")
