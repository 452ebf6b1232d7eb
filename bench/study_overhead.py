"""What the study system costs: the same trials through `lapstudy run` and through a plain in-process Optuna loop.

Same model, data (scikit-learn digits, the same 1437/360 split sizes and batch), epochs, seeds, optimiser and
schedule, one thread each; the plain loop also computes the last epoch's token geometry, as the trials do. Prints
JSON with

- `epoch_time_ratio`: steady-state seconds per epoch, lapstudy / plain (median over epochs 3..E; target <= 1.10),
- `study_wall_ratio`: whole-study wall time, lapstudy (from the command's start, Ray's start included) / plain
  (target <= 1.25),
- `trial_startup_s`: per-trial start-up latency in lapstudy (from the trial's start to its first epoch's record,
  minus a steady epoch), and the gap between one trial's last report and the next one's start.

    python bench/study_overhead.py [--epochs 30] [--trials 3] [--dim 128] [--depth 6]

Each trial should train for at least a minute (the defaults do on one CPU thread); the whole run takes about
2 x trials x (epochs x epoch time) plus Ray's start-up.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import optuna
import torch
import torch.nn.functional as F
import yaml
from mlflow.tracking import MlflowClient
from sklearn.datasets import load_digits

import models
from models.geometry import GeometryAccumulator
from study.optim import WarmupCosine

LAPSTUDY = Path(sys.executable).with_name("lapstudy")
BATCH, TRAIN_ROWS = 64, 1437
LRS = [2e-3, 3e-3, 4e-3, 5e-3, 6e-3, 8e-3]


def space(args) -> dict:
    points = [{"lr": lr, "k": k % 5} for k, lr in enumerate(LRS[: args.trials])]
    return {
        "name": "overhead",
        "task": "classification",
        "dataset": {"source": "digits"},
        "metric": "val_acc",
        "mode": "max",
        "epochs": args.epochs,
        "seed": 0,
        "num_samples": args.trials,
        "sampler": "random",
        "scheduler": "none",
        "fixed": {"preset": "vit_tiny_digits", "dim": args.dim, "depth": args.depth, "batch_size": BATCH,
                  "warmup_epochs": 1},
        "parameters": {"lr": {"type": "log_float", "low": 1e-3, "high": 1e-2}, "k": {"type": "int", "low": 0, "high": 4}},
        "points_to_evaluate": points,
    }


def run_lapstudy(args, folder: Path) -> dict:
    path = folder / "space.yaml"
    path.write_text(yaml.safe_dump(space(args)))
    started = time.perf_counter()
    done = subprocess.run([str(LAPSTUDY), "run", str(path), "--storage", str(folder / "studies"),
                           "--max-concurrent", "1"], capture_output=True, text=True)
    wall = time.perf_counter() - started
    if done.returncode:
        sys.exit(f"lapstudy failed:\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}")
    study_dir = folder / "studies" / "overhead"
    trials = []
    for result in sorted(study_dir.glob("trial_*/result.json")):
        trials.append([json.loads(line) for line in result.read_text().splitlines() if line.strip()])
    trials.sort(key=lambda rows: rows[0]["timestamp"] - rows[0]["time_total_s"])
    # Tune's time_this_iter_s is rounded to its ~2 s collection interval: time epochs by the MLflow timestamps the
    # rank-0 worker writes just before each report (one full cycle: train, evaluate, checkpoint, report, log).
    client = MlflowClient(f"sqlite:///{study_dir / 'mlflow.db'}")
    experiment = client.get_experiment_by_name("overhead").experiment_id
    cycles, startup = [], []
    for rows in trials:
        [run] = client.search_runs([experiment], filter_string=f"tags.`lapstudy.trial_id` = '{rows[0]['trial_id']}'")
        stamps = [m.timestamp / 1000 for m in client.get_metric_history(run.info.run_id, "epoch")]
        cycles += [b - a for a, b in zip(stamps[1:-2], stamps[2:-1])]  # epochs 3..E-1 (E computes geometry)
        startup.append(stamps[0] - (rows[0]["timestamp"] - rows[0]["time_total_s"]))
    epoch = statistics.median(cycles)
    spans = [(rows[0]["timestamp"] - rows[0]["time_total_s"], rows[-1]["timestamp"]) for rows in trials]
    gaps = [spans[i + 1][0] - spans[i][1] for i in range(len(spans) - 1)]
    return {"wall_s": wall, "epoch_s": epoch, "startup_s": [s - epoch for s in startup], "gaps_s": gaps,
            "val_acc": [rows[-1]["val_acc"] for rows in trials], "load": os.getloadavg()[0]}


def run_plain(args) -> dict:
    torch.set_num_threads(1)
    digits = load_digits()
    x = torch.tensor(digits.images, dtype=torch.float32)[:, None] / 16.0
    x = (x - x.mean()) / x.std()
    y = torch.tensor(digits.target)
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(0))
    train, val = order[:TRAIN_ROWS], order[TRAIN_ROWS:]
    steps = TRAIN_ROWS // BATCH
    epoch_times, accuracies = [], []
    points = space(args)["points_to_evaluate"]

    def objective(trial):
        lr = trial.suggest_float("lr", 1e-3, 1e-2, log=True)
        k = trial.suggest_int("k", 0, 4)
        torch.manual_seed(0)
        model = models.build_model({"preset": "vit_tiny_digits", "dim": args.dim, "depth": args.depth, "k": k})
        optimizer = torch.optim.AdamW(model.param_groups(0.05), lr=lr)
        schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, WarmupCosine(steps, steps * args.epochs, 0.0))
        for epoch in range(1, args.epochs + 1):
            started = time.perf_counter()
            model.train()
            shuffled = train[torch.randperm(len(train), generator=torch.Generator().manual_seed(epoch))]
            for step in range(steps):
                batch = shuffled[step * BATCH:(step + 1) * BATCH]
                loss = F.cross_entropy(model(x[batch]), y[batch])
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                optimizer.step()
                schedule.step()
            model.eval()
            with torch.no_grad():
                out = model(x[val], return_features=epoch == args.epochs)
                if epoch == args.epochs:
                    geometry = GeometryAccumulator(out.tokens.shape[-1], num_classes=10)
                    geometry.update(out.tokens, labels=y[val], features=out.feature)
                    geometry.finalize_means(model.classifier_weight, model.classifier_bias)
                    geometry.update_nc4(out.feature)
                    geometry.compute(model.classifier_weight)
                    out = out.logits
                accuracy = (out.argmax(1) == y[val]).float().mean().item()
            epoch_times.append((epoch, time.perf_counter() - started))
        accuracies.append(accuracy)
        return accuracy

    started = time.perf_counter()
    study = optuna.create_study(direction="maximize", sampler=optuna.samplers.RandomSampler(seed=0))
    for point in points:
        study.enqueue_trial(point)
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study.optimize(objective, n_trials=args.trials)
    wall = time.perf_counter() - started
    steady = [t for epoch, t in epoch_times if 3 <= epoch < args.epochs]
    return {"wall_s": wall, "epoch_s": statistics.median(steady), "val_acc": accuracies, "load": os.getloadavg()[0]}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--epochs", type=int, default=30)
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--depth", type=int, default=6)
    args = parser.parse_args()
    plain = run_plain(args)
    with tempfile.TemporaryDirectory(prefix="lso", dir="/tmp") as folder:
        study = run_lapstudy(args, Path(folder))
    print(json.dumps({
        "trials": args.trials,
        "epochs": args.epochs,
        "plain_epoch_s": round(plain["epoch_s"], 4),
        "lapstudy_epoch_s": round(study["epoch_s"], 4),
        "epoch_time_ratio": round(study["epoch_s"] / plain["epoch_s"], 3),
        "plain_study_wall_s": round(plain["wall_s"], 1),
        "lapstudy_study_wall_s": round(study["wall_s"], 1),
        "study_wall_ratio": round(study["wall_s"] / plain["wall_s"], 3),
        "trial_startup_s": [round(s, 1) for s in study["startup_s"]],
        "gap_between_trials_s": [round(g, 1) for g in study["gaps_s"]],
        "plain_seconds_per_trial": round(plain["wall_s"] / args.trials, 1),
        "val_acc": {"plain": [round(a, 4) for a in plain["val_acc"]],
                    "lapstudy": [round(a, 4) for a in study["val_acc"]]},
        "targets": {"epoch_time_ratio": 1.10, "study_wall_ratio": 1.25},
        # The machine is shared: the 1-minute load average when each half finished, to judge the ratios by.
        "load_average": {"plain": round(plain["load"], 2), "lapstudy": round(study["load"], 2)},
    }, indent=2))


if __name__ == "__main__":
    main()
