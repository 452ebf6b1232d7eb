"""What the study system costs: the same trials through `lapstudy run` and through a plain in-process Optuna loop.

Two comparisons, each repeated with the two sides alternating (lapstudy first, then plain first, ...) so that load
drift on this shared machine falls on both sides; the ratios of each repeat are printed with their median and spread.

- The overhead space (fixed trials, no early stopping, `--epochs`/`--trials`/`--dim`/`--depth`):
  `epoch_time_ratio`, steady-state seconds per epoch, lapstudy / plain (median over epochs 3..E-1; target <= 1.10);
  `study_wall_ratio`, whole-study wall time, lapstudy (from the command's start, Ray's start included) / plain
  (target <= 1.25); `trial_startup_s`, each trial's start to its first epoch's record minus a steady epoch; the gap
  between one trial's last report and the next one's start.
- `--quickstart`: `search_spaces/quickstart.yaml` as `make quickstart` runs it (TPE, ASHA) against the plain loop on
  the same trials, each for the epochs ASHA let it run: `quickstart_wall_ratio` (target <= 2).

The plain loop trains exactly the configs lapstudy's trials recorded (`trials/<id>.yaml`): the same model, digits
split and normalisation, batch, optimiser, schedule, seed and geometry epochs, on one thread, with no Ray, no MLflow
and no pictures; lapstudy's first run supplies them, so the first repeat always starts with lapstudy.

    python bench/study_overhead.py [--repeats 3] [--epochs 30] [--trials 3] [--dim 128] [--depth 6] [--quickstart]

The defaults take about 30 minutes on 2 CPUs (with --quickstart about 15 more).
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

import numpy as np
import optuna
import torch
import torch.nn.functional as F
import yaml
from mlflow.tracking import MlflowClient
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split

import models
from models.geometry import GeometryAccumulator
from study.data.config import DigitsConfig
from study.optim import build_optimizer, build_schedule
from study.runspec import RunSpec, load_run_spec, slow_lr_scale
from study.worker import seed_everything

REPO = Path(__file__).resolve().parents[1]
LAPSTUDY = Path(sys.executable).with_name("lapstudy")
LRS = [2e-3, 3e-3, 4e-3, 5e-3, 6e-3, 8e-3]
TARGETS = {"epoch_time_ratio": 1.10, "study_wall_ratio": 1.25, "quickstart_wall_ratio": 2.0}


def overhead_space(args) -> dict:
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
        "early_stopping": "none",
        "fixed": {"preset": "vit_tiny_digits", "dim": args.dim, "depth": args.depth, "batch_size": 64,
                  "warmup_epochs": 1},
        "parameters": {"lr": {"type": "log_float", "low": 1e-3, "high": 1e-2},
                       "k": {"type": "int", "low": 0, "high": 4}},
        "points_to_evaluate": points,
    }


def run_lapstudy(space_path: Path, name: str, folder: Path, extra: list[str]) -> dict:
    """One `lapstudy run` from its command's start to its end; its trials' configs, epochs and timings."""
    started = time.perf_counter()
    done = subprocess.run([str(LAPSTUDY), "run", str(space_path), "--storage", str(folder / "studies"), *extra],
                          capture_output=True, text=True)
    wall = time.perf_counter() - started
    if done.returncode:
        sys.exit(f"lapstudy failed:\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}")
    study_dir = folder / "studies" / name
    trials = []
    for result in sorted(study_dir.glob("trial_*/result.json")):
        trials.append([json.loads(line) for line in result.read_text().splitlines() if line.strip()])
    trials.sort(key=lambda rows: rows[0]["timestamp"] - rows[0]["time_total_s"])
    # Tune's time_this_iter_s is rounded to its collection interval: time epochs by the MLflow timestamps the loop
    # writes just before each report (one full cycle: train, evaluate, checkpoint, report, log).
    client = MlflowClient(f"sqlite:///{study_dir / 'mlflow.db'}")
    experiment = client.get_experiment_by_name(name).experiment_id
    cycles, startup = [], []
    for rows in trials:
        [run] = client.search_runs([experiment], filter_string=f"tags.`lapstudy.trial_id` = '{rows[0]['trial_id']}'")
        stamps = [m.timestamp / 1000 for m in client.get_metric_history(run.info.run_id, "epoch")]
        cycles += [b - a for a, b in zip(stamps[1:-2], stamps[2:-1])]  # epochs 3..E-1 (E computes geometry)
        startup.append(stamps[0] - (rows[0]["timestamp"] - rows[0]["time_total_s"]))
    epoch = statistics.median(cycles) if cycles else float("nan")
    spans = [(rows[0]["timestamp"] - rows[0]["time_total_s"], rows[-1]["timestamp"]) for rows in trials]
    return {"wall_s": wall, "epoch_s": epoch, "startup_s": [s - epoch for s in startup],
            "gaps_s": [spans[i + 1][0] - spans[i][1] for i in range(len(spans) - 1)],
            "trials": [(load_run_spec(study_dir / "trials" / f"{rows[0]['trial_id']}.yaml"), rows[0]["config"],
                        max(r["epoch"] for r in rows)) for rows in trials],
            "val_acc": [rows[-1]["val_acc"] for rows in trials], "load": os.getloadavg()[0]}


def digits_tensors() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """study/data/offline.py's digits: the same stratified split and the training split's normalisation."""
    cfg = DigitsConfig(source="digits")
    digits = load_digits()
    images = np.round(digits.images * (255.0 / 16.0)).astype(np.uint8)
    train_idx, val_idx = train_test_split(np.arange(len(images)), test_size=cfg.val_fraction,
                                          random_state=cfg.split_seed, stratify=digits.target)
    pixels = torch.tensor(images, dtype=torch.float32)[:, None] / 255.0
    train, val = pixels[np.sort(train_idx)], pixels[np.sort(val_idx)]
    mean, std = train.mean(), train.std()
    labels = torch.tensor(digits.target)
    return (train - mean) / std, labels[np.sort(train_idx)], (val - mean) / std, labels[np.sort(val_idx)]


def run_plain(trials: list[tuple[RunSpec, dict, int]]) -> dict:
    """The trials (run config, sampled values, epochs to run) in one process, Optuna enqueuing their values."""
    torch.set_num_threads(1)
    x, y, x_val, y_val = digits_tensors()
    epoch_times, accuracies = [], []

    def objective(trial):
        spec, _, epochs_run = trials[trial.number]
        batch = spec.train.batch_size
        steps = len(x) // batch
        seed_everything(spec.seed)  # the trial's initial weights
        model = models.build_model(spec.resolved.config)
        optimizer = build_optimizer(model, spec.train, slow_lr_scale(spec.resolved))
        schedule = build_schedule(optimizer, spec.train, steps, spec.epochs)
        for epoch in range(1, epochs_run + 1):
            started = time.perf_counter()
            model.train()
            shuffled = torch.randperm(len(x), generator=torch.Generator().manual_seed(epoch))
            for step in range(steps):
                rows = shuffled[step * batch:(step + 1) * batch]
                loss = F.cross_entropy(model(x[rows]), y[rows])
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                if spec.train.grad_clip:
                    torch.nn.utils.clip_grad_norm_(model.parameters(), spec.train.grad_clip)
                optimizer.step()
                schedule.step()
            model.eval()
            with torch.no_grad():
                geometry = spec.geometry.due(epoch, spec.epochs)
                out = model(x_val, return_features=geometry)
                if geometry:
                    accumulator = GeometryAccumulator(out.tokens.shape[-1], num_classes=10)
                    accumulator.update(out.tokens, labels=y_val, features=out.feature)
                    accumulator.finalize_means(model.classifier_weight, model.classifier_bias)
                    accumulator.update_nc4(out.feature)
                    accumulator.compute(model.classifier_weight)
                    out = out.logits
                accuracy = (out.argmax(1) == y_val).float().mean().item()
            epoch_times.append((epoch, epochs_run, time.perf_counter() - started))
        accuracies.append(accuracy)
        return accuracy

    started = time.perf_counter()
    study = optuna.create_study(direction="maximize", sampler=optuna.samplers.RandomSampler(seed=0))
    for _, values, _ in trials:
        study.enqueue_trial(values)
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study.optimize(objective, n_trials=len(trials))
    wall = time.perf_counter() - started
    steady = [t for epoch, last, t in epoch_times if 3 <= epoch < last]
    return {"wall_s": wall, "epoch_s": statistics.median(steady) if steady else float("nan"), "val_acc": accuracies,
            "load": os.getloadavg()[0]}


def spread(values: list[float]) -> dict:
    return {"median": round(statistics.median(values), 3), "min": round(min(values), 3), "max": round(max(values), 3),
            "runs": [round(v, 3) for v in values]}


def alternate(repeats: int, lapstudy, plain) -> list[tuple[dict, dict]]:
    """`repeats` pairs, lapstudy first in even repeats and plain first in odd ones (its trials: the first run's)."""
    pairs, first = [], None
    for repeat in range(repeats):
        if repeat % 2 == 0:
            study = lapstudy(repeat)
            first = first or study
            pairs.append((study, plain(first["trials"])))
        else:
            done = plain(first["trials"])
            pairs.append((lapstudy(repeat), done))
        print(f"repeat {repeat + 1}/{repeats}: lapstudy {pairs[-1][0]['wall_s']:.1f} s, plain "
              f"{pairs[-1][1]['wall_s']:.1f} s", file=sys.stderr, flush=True)
    return pairs


def overhead(args, folder: Path) -> dict:
    path = folder / "overhead.yaml"
    path.write_text(yaml.safe_dump(overhead_space(args)))
    pairs = alternate(args.repeats, lambda r: run_lapstudy(path, "overhead", folder / f"o{r}",
                                                           ["--max-concurrent", "1"]), run_plain)
    return {
        "trials": args.trials,
        "epochs": args.epochs,
        "epoch_time_ratio": spread([s["epoch_s"] / p["epoch_s"] for s, p in pairs]),
        "study_wall_ratio": spread([s["wall_s"] / p["wall_s"] for s, p in pairs]),
        "plain_epoch_s": [round(p["epoch_s"], 4) for _, p in pairs],
        "lapstudy_epoch_s": [round(s["epoch_s"], 4) for s, _ in pairs],
        "plain_study_wall_s": [round(p["wall_s"], 1) for _, p in pairs],
        "lapstudy_study_wall_s": [round(s["wall_s"], 1) for s, _ in pairs],
        "trial_startup_s": [[round(x, 1) for x in s["startup_s"]] for s, _ in pairs],
        "gap_between_trials_s": [[round(g, 1) for g in s["gaps_s"]] for s, _ in pairs],
        "val_acc": {"plain": [round(a, 4) for a in pairs[0][1]["val_acc"]],
                    "lapstudy": [round(a, 4) for a in pairs[0][0]["val_acc"]]},
        # The machine is shared: the 1-minute load average when each side finished, to judge the ratios by.
        "load_average": [{"plain": round(p["load"], 2), "lapstudy": round(s["load"], 2)} for s, p in pairs],
    }


def quickstart(args, folder: Path) -> dict:
    path = REPO / "search_spaces" / "quickstart.yaml"
    pairs = alternate(args.repeats, lambda r: run_lapstudy(path, "quickstart", folder / f"q{r}", []), run_plain)
    epochs = [[epochs for _, _, epochs in s["trials"]] for s, _ in pairs]
    return {
        "quickstart_wall_ratio": spread([s["wall_s"] / p["wall_s"] for s, p in pairs]),
        "lapstudy_wall_s": [round(s["wall_s"], 1) for s, _ in pairs],
        "plain_wall_s": [round(p["wall_s"], 1) for _, p in pairs],
        # The plain loop trains the first run's trials; a later run that sampled others is visible here.
        "epochs_per_trial": epochs,
        "load_average": [{"plain": round(p["load"], 2), "lapstudy": round(s["load"], 2)} for s, p in pairs],
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--epochs", type=int, default=30)
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--depth", type=int, default=6)
    parser.add_argument("--quickstart", action="store_true", help="also compare the quickstart study")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="lso", dir="/tmp") as folder:
        report = {"repeats": args.repeats, "overhead_space": overhead(args, Path(folder))}
        if args.quickstart:
            report["quickstart"] = quickstart(args, Path(folder))
    report["targets"] = TARGETS
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
