"""How much cheaper than the paper's grid a search finds its answer: learning curves recorded once, searches replayed.

The question is the paper's (how many Laplacian heads, where: a uniform k per layer, or a ramp's start layer and
cap; and the learning rate) on the shipped digits task, in the space `SPACE` below (16 configurations, a tiny ViT,
`EPOCHS` epochs). Two steps:

1. Record (once, cached in `--cache`, default bench/cache/search_efficiency_digits.json): every configuration at the
   seeds `SEEDS`, trained by the project's own loop (study/trial.py's `run_stages`: the Ray Train loop in Ray
   Train's local mode, in this process, on a one-CPU local Ray, as `lapstudy train` runs it; no Tune, no MLflow),
   with the token geometry measured at every epoch. The cache holds every epoch's objective, geometry and seconds.
2. Replay searches against the cached curves, each with the project's own objects: the samplers of
   study/search.py's `make_sampler` inside its `StudySearch` (Tune's OptunaSearch) and the schedulers of
   `make_scheduler` (Tune's ASHA; study/geometry_stopper.py), driven by a loop that calls them as Tune's controller
   does (searcher.suggest, scheduler.on_trial_add, on_trial_result per epoch from both, on_trial_complete when a
   trial ends or is stopped). Compared at equal seeds:
   (a) the paper's way: the full grid, every configuration to the end at every seed;
   (b) random search + ASHA; (c) TPE + ASHA (the project's default); (d) TPE + the geometry stopper.

A search trial is one run of a configuration at one seed (a search with ASHA cannot replicate: study/space.py); the
search of seed s sees the recorded run at seed SEEDS[s % len(SEEDS)]. The search's answer at any moment is its best
configuration by the value of its trials that ran to the end; it is judged by that configuration's mean final value
over all recorded seeds, so that "best" is not seed luck. Figures of merit, over `--search-seeds` search seeds
(median and range): epochs (and replayed wall time) until the answer is within `TOLERANCE` (0.5 points of val_acc)
of the grid's best 3-seed mean; the regret at 25/50/100% of the grid's budget (its epochs over all seeds).

Where the replay differs from a live study:
- A replayed trial's curve is the recorded run's: a live trial at the same seed repeats it as far as the seeded,
  deterministic CPU loop does (study/loop.py), and a configuration a search proposes twice repeats that run, as a
  live study at one seed would; a live study's geometry epochs are its rungs and last epoch, the recording's every
  epoch (the values at the rungs are the same measurement).
- Wall time is the recorded seconds of each epoch (train + evaluation), run on `--concurrency` replayed workers; a live
  study adds Ray's per-trial start and tear-down (about 17 s per trial on 2 CPUs), less geometry time (measured
  here at every epoch), and the load of the machine.
- TPE starts modelling after 4 random trials (the space's `n_startup_trials`; the project's default is 10, which is
  most of a 16-point space).
- Trials report in the order of a simulated clock, not the order Ray would deliver them; with several workers the
  order of simultaneous reports is fixed (earliest start first).

    python bench/search_efficiency.py [--record-only | --replay-only] [--cache PATH] [--search-seeds 9]
                                      [--concurrency 2] [--grace-period 2]

Recording took 25 minutes on a shared 2-CPU machine (run it under `nice`; the cache is committed); a replay of all
four searches at 9 search seeds takes about a minute.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

EPOCHS = 10
SEEDS = (0, 1, 2)
TOLERANCE = 0.005  # 0.5 points of validation accuracy
BUDGET_FRACTIONS = (0.25, 0.5, 1.0)
DEFAULT_CACHE = REPO / "bench" / "cache" / "search_efficiency_digits.json"
# What the cache keeps of each epoch's report: the objective, the last layer's geometry, and the time it took.
KEPT = ("epoch", "val_acc", "val_loss", "train_loss", "train_s", "eval_s")

SPACE = {
    "name": "search_efficiency_digits",
    "description": "The paper's question (Laplacian heads per layer: uniform k or a ramp; lr) on digits.",
    "task": "classification",
    "dataset": {"source": "digits"},
    "metric": "val_acc",
    "mode": "max",
    "epochs": EPOCHS,
    "seed": 0,
    "sampler": {"kind": "tpe", "n_startup_trials": 4},
    "early_stopping": {"kind": "asha", "grace_period": 2, "reduction_factor": 2},
    "geometry": {"every": 1, "pca_points": 500},
    "fixed": {"preset": "vit_tiny_digits", "batch_size": 64, "weight_decay": 0.05, "warmup_epochs": 1},
    "parameters": {"lr": [1.0e-3, 3.0e-3], "laplacian_schedule": ["uniform", "ramp"]},
    "conditional": [
        {"when": {"laplacian_schedule": "uniform"}, "parameters": {"k": [0, 1, 2, 4]}},
        {"when": {"laplacian_schedule": "ramp"}, "parameters": {"start_layer": [0, 2], "max_count": [2, 4]},
         "fixed": {"increment": 1}},
    ],
}


def load_bench_space(early_stopping: dict | None = None, sampler: dict | None = None):
    from study.space import parse_space

    return parse_space({**SPACE, **({"early_stopping": early_stopping} if early_stopping else {}),
                        **({"sampler": sampler} if sampler else {})}, "bench space")


def grid_configs() -> list[dict]:
    """Every configuration of SPACE: its sampled values."""
    configs = []
    for lr in SPACE["parameters"]["lr"]:
        configs += [{"lr": lr, "laplacian_schedule": "uniform", "k": k}
                    for k in SPACE["conditional"][0]["parameters"]["k"]]
        ramp = SPACE["conditional"][1]["parameters"]
        configs += [{"lr": lr, "laplacian_schedule": "ramp", "start_layer": s, "max_count": m}
                    for s in ramp["start_layer"] for m in ramp["max_count"]]
    return configs


def config_key(config: dict) -> str:
    return json.dumps(config, sort_keys=True)


# ---- 1. recording ------------------------------------------------------------------------------------------------

def record(cache: Path) -> dict:
    """Train every configuration at every seed that the cache lacks; the cache after it (written after each run)."""
    import ray
    import torch

    from study.data import load_task_data
    from study.runspec import Resources, complete_hyperparameters
    from study.state import CHECKPOINT_FILE
    from study.trial import RunSetup, run_stages

    space = load_bench_space()
    recorded = json.loads(cache.read_text()) if cache.exists() else {"space": SPACE, "runs": {}}
    if recorded["space"] != SPACE:
        raise SystemExit(f"{cache}: recorded for another space; remove it or give another --cache")
    todo = [(c, s) for c in grid_configs() for s in SEEDS if f"{config_key(c)}@{s}" not in recorded["runs"]]
    if not todo:
        return recorded
    torch.set_num_threads(1)
    ray.init(num_cpus=1, include_dashboard=False, logging_level="ERROR", log_to_driver=False)
    try:
        with tempfile.TemporaryDirectory() as storage:
            for i, (config, seed) in enumerate(todo):
                started = time.perf_counter()
                task_data = load_task_data(space.dataset, seed=seed)
                hyperparameters = complete_hyperparameters(space.resolve(config), task_data.model_overrides,
                                                           space.task)
                spec = space.run_spec(hyperparameters, Resources(), seed=seed)
                final = run_stages(spec, f"run{i}", RunSetup(storage_path=storage, tracking=None, in_process=True),
                                   task_data, None)
                saved = torch.load(Path(final["checkpoint_path"]) / CHECKPOINT_FILE, weights_only=False)
                curve = [{k: v for k, v in row.items()
                          if k in KEPT or (k.startswith("geom_") and not k.startswith("geom_l"))}
                         for row in saved["history"]]
                recorded["runs"][f"{config_key(config)}@{seed}"] = curve
                cache.parent.mkdir(parents=True, exist_ok=True)
                cache.write_text(json.dumps(recorded))
                print(f"recorded {i + 1}/{len(todo)} {config} seed {seed}: val_acc {curve[-1]['val_acc']:.4f} "
                      f"({time.perf_counter() - started:.0f} s)", flush=True)
    finally:
        ray.shutdown()
    return recorded


# ---- 2. replay ---------------------------------------------------------------------------------------------------

def curves_by_config(recorded: dict) -> dict[str, list[list[dict]]]:
    """config key -> its curve at each of SEEDS (every configuration of the grid must be recorded at every seed)."""
    missing = [f"{c} seed {s}" for c in grid_configs() for s in SEEDS if f"{config_key(c)}@{s}" not in recorded["runs"]]
    if missing:
        raise SystemExit(f"the cache lacks {len(missing)} runs (first: {missing[0]}); run without --replay-only")
    return {config_key(c): [recorded["runs"][f"{config_key(c)}@{s}"] for s in SEEDS] for c in grid_configs()}


def epoch_seconds(row: dict) -> float:
    return row["train_s"] + row.get("eval_s", 0.0)


class Answers:
    """The trajectory of a search's answer: after each epoch it spent, its best configuration (by its trials that
    ran to the end) and that configuration's regret: the grid's best mean final value minus its own."""

    def __init__(self, final_means: dict[str, float]):
        self.final_means, self.best_mean = final_means, max(final_means.values())
        self.points: list[tuple[int, float, float]] = []  # (epochs spent, replayed seconds, regret; inf: no answer)
        self.answer: tuple[float, str] | None = None
        self.tried: set[str] = set()  # the configurations it started

    def finished(self, key: str, value: float) -> None:
        if self.answer is None or value > self.answer[0]:
            self.answer = (value, key)

    def record(self, epochs: int, seconds: float) -> None:
        regret = math.inf if self.answer is None else self.best_mean - self.final_means[self.answer[1]]
        self.points.append((epochs, seconds, regret))

    def first_within(self, tolerance: float) -> tuple[int, float] | None:
        return next(((e, t) for e, t, r in self.points if r <= tolerance + 1e-12), None)

    def regret_at(self, epochs: float) -> float:
        spent = [r for e, _, r in self.points if e <= epochs]
        return spent[-1] if spent else math.inf


def replay_search(curves, final_means, *, sampler: str, early_stopping: str, search_seed: int, concurrency: int,
                  budget: int, grace_period: int) -> Answers:
    """One search through the project's searcher and scheduler objects, as Tune's controller calls them, on
    `concurrency` replayed workers, until it has spent `budget` epochs. A trial sees the curve at seed
    SEEDS[search_seed % len(SEEDS)]."""
    import heapq

    from ray.tune.experiment import Trial
    from ray.tune.schedulers import TrialScheduler

    from study.search import DefineByRun, StudySearch, make_sampler, make_scheduler

    space = load_bench_space(early_stopping={"kind": early_stopping, "grace_period": grace_period,
                                             "reduction_factor": SPACE["early_stopping"]["reduction_factor"]},
                             sampler={**SPACE["sampler"], "kind": sampler})
    searcher = StudySearch(space=DefineByRun(space), metric=space.metrics[0], mode=space.modes[0],
                           sampler=make_sampler(space, search_seed))
    stopper = make_scheduler(space)
    seen_seed = search_seed % len(SEEDS)
    answers, spent, order = Answers(final_means), 0, 0
    pending: list = []  # (time its next epoch ends, start order, trial, key, curve, epoch index)

    def start(now: float) -> None:
        nonlocal order
        trial = Trial("__fake", stub=True)
        sampled = searcher.suggest(trial.trial_id)
        key = config_key(sampled)
        answers.tried.add(key)
        curve = curves[key][seen_seed]
        stopper.on_trial_add(None, trial)
        heapq.heappush(pending, (now + epoch_seconds(curve[0]), order, trial, key, curve, 0))
        order += 1

    for _ in range(concurrency):
        start(0.0)
    while spent < budget:
        now, started, trial, key, curve, index = heapq.heappop(pending)
        row = curve[index]
        result = {**row, "training_iteration": index + 1}
        spent += 1
        searcher.on_trial_result(trial.trial_id, result)
        decision = stopper.on_trial_result(None, trial, result)
        ended = index + 1 == len(curve)
        if decision == TrialScheduler.STOP or ended:
            stopper.on_trial_complete(None, trial, result)
            searcher.on_trial_complete(trial.trial_id, result)
            if ended:
                answers.finished(key, row["val_acc"])
            answers.record(spent, now)
            start(now)
        else:
            answers.record(spent, now)
            heapq.heappush(pending, (now + epoch_seconds(curve[index + 1]), started, trial, key, curve, index + 1))
    return answers


def replay_grid(curves, final_means, *, search_seed: int, concurrency: int) -> Answers:
    """The paper's grid in a random order (seeded by `search_seed`): every configuration at every seed to the end,
    on `concurrency` workers; its answer is the best mean over the configurations all of whose seeds finished."""
    import random

    runs = [(key, s) for key in curves for s in range(len(SEEDS))]
    random.Random(search_seed).shuffle(runs)
    free_at = [0.0] * concurrency
    answers, spent, done = Answers(final_means), 0, {}
    for key, s in runs:
        worker = min(range(concurrency), key=free_at.__getitem__)
        free_at[worker] += sum(epoch_seconds(row) for row in curves[key][s])
        spent += len(curves[key][s])
        done[key] = done.get(key, 0) + 1
        if done[key] == len(SEEDS):
            answers.finished(key, final_means[key])
        answers.tried.add(key)
        answers.record(spent, free_at[worker])
    return answers


def spread(values: list[float]) -> dict:
    """Median and range; a value that is inf (never reached) counts in the median as the worst."""
    finite = [v for v in values if math.isfinite(v)]
    median = statistics.median(values)
    as_json = lambda v: round(v, 4) if math.isfinite(v) else None  # noqa: E731 - JSON has no inf
    return {"median": as_json(median), "min": as_json(min(values)), "max": as_json(max(values)),
            "finite": f"{len(finite)}/{len(values)}", "values": [as_json(v) for v in values]}


def rung_prediction_quality(curves, rungs) -> dict:
    """How well each ranking the stoppers use at a rung orders the runs by their final value, over every recorded run:
    Spearman's rho of the final val_acc with val_acc at the rung (ASHA's ranking) and with the geometry stopper's
    ridge prediction from the rung's val_acc and geometry, fitted with the configuration's own runs left out."""
    import numpy as np
    from scipy.stats import spearmanr
    from sklearn.linear_model import Ridge
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import StandardScaler

    from study.geometry_stopper import GEOMETRY_FEATURES, RIDGE_ALPHA

    runs = [(key, curve) for key, by_seed in curves.items() for curve in by_seed]
    final = np.array([curve[-1]["val_acc"] for _, curve in runs])
    quality = {}
    for rung in rungs:
        rows = [curve[rung - 1] for _, curve in runs]
        features = np.array([[row["val_acc"], *(row[f] for f in GEOMETRY_FEATURES if f in rows[0])] for row in rows])
        predicted = np.empty(len(runs))
        for key in curves:
            held = np.array([k == key for k, _ in runs])
            model = make_pipeline(StandardScaler(), Ridge(alpha=RIDGE_ALPHA)).fit(features[~held], final[~held])
            predicted[held] = model.predict(features[held])
        quality[f"epoch_{rung}"] = {"rho_val_acc": round(float(spearmanr(features[:, 0], final)[0]), 3),
                                    "rho_geometry_prediction": round(float(spearmanr(predicted, final)[0]), 3)}
    return quality


def measure(recorded: dict, *, search_seeds: int, concurrency: int, grace_period: int) -> dict:
    curves = curves_by_config(recorded)
    final_means = {key: statistics.mean(curve[-1]["val_acc"] for curve in runs) for key, runs in curves.items()}
    best_key = max(final_means, key=final_means.get)
    budget = sum(len(curve) for runs in curves.values() for curve in runs)  # the grid's epochs, every seed
    grid_seconds = sum(epoch_seconds(row) for runs in curves.values() for curve in runs for row in curve)
    grid_wall = replay_grid(curves, final_means, search_seed=0, concurrency=concurrency).points[-1][1]
    methods = {"random_asha": ("random", "asha"), "tpe_asha": ("tpe", "asha"), "tpe_geometry": ("tpe", "geometry"),
               "grid_random_order": None}
    report = {"grid": {"configurations": len(curves), "seeds": len(SEEDS), "epochs": budget,
                       "replayed_wall_s": round(grid_wall, 1), "cpu_s": round(grid_seconds, 1),
                       "best": {"config": json.loads(best_key), "mean_val_acc": round(final_means[best_key], 4),
                                "per_seed": [c[-1]["val_acc"] for c in curves[best_key]]},
                       "final_means": {k: round(v, 4) for k, v in sorted(final_means.items(), key=lambda kv: -kv[1])}},
              "rung_ranking_vs_final": rung_prediction_quality(curves, load_bench_space(
                  early_stopping={**SPACE["early_stopping"], "grace_period": grace_period}).judged_epochs()),
              "grace_period": grace_period,
              "tolerance_points": TOLERANCE * 100, "search_seeds": search_seeds, "concurrency": concurrency}
    per_method = {}
    for name, kinds in methods.items():
        runs = []
        for seed in range(search_seeds):
            if kinds is None:
                answers = replay_grid(curves, final_means, search_seed=seed, concurrency=concurrency)
            else:
                answers = replay_search(curves, final_means, sampler=kinds[0], early_stopping=kinds[1],
                                        search_seed=seed, concurrency=concurrency, budget=budget,
                                        grace_period=grace_period)
            runs.append(answers)
        reached = [a.first_within(TOLERANCE) for a in runs]
        per_method[name] = {
            "epochs_to_within": [r[0] if r else math.inf for r in reached],
            "wall_s_to_within": [r[1] if r else math.inf for r in reached],
            "regret_at": {str(f): [100 * a.regret_at(f * budget) for a in runs] for f in BUDGET_FRACTIONS},
            "configurations_tried": [len(a.tried) for a in runs]}
    report["methods"] = {
        name: {"epochs_ratio": spread([e / budget for e in m["epochs_to_within"]]),
               "wall_ratio": spread([t / grid_wall for t in m["wall_s_to_within"]]),
               "epochs_to_within": spread(m["epochs_to_within"]),
               "regret_points_at_budget_fraction": {f: spread(v) for f, v in m["regret_at"].items()},
               "configurations_tried": spread(m["configurations_tried"])}
        for name, m in per_method.items()}
    # Paired by search seed: the same sampler seed and visible seed with either stopper.
    geometry, asha = per_method["tpe_geometry"]["epochs_to_within"], per_method["tpe_asha"]["epochs_to_within"]
    report["tpe_geometry_over_tpe_asha_epochs"] = spread([g / a for g, a in zip(geometry, asha)
                                                          if math.isfinite(g) and math.isfinite(a)] or [math.inf])
    tpe = report["methods"]["tpe_asha"]["epochs_ratio"]["median"]
    report["target"] = {"tpe_asha_epochs_ratio_at_most": 0.4, "tpe_asha_epochs_ratio_median": tpe,
                        "met": tpe is not None and tpe <= 0.4,
                        "tpe_asha_searches_within_at_budget_end": sum(
                            r <= 100 * TOLERANCE + 1e-9 for r in per_method["tpe_asha"]["regret_at"]["1.0"])}
    return report


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cache", type=Path, default=DEFAULT_CACHE)
    parser.add_argument("--record-only", action="store_true")
    parser.add_argument("--replay-only", action="store_true", help="use the cache as it is; record nothing")
    parser.add_argument("--search-seeds", type=int, default=9)
    parser.add_argument("--concurrency", type=int, default=2)
    parser.add_argument("--grace-period", type=int, default=SPACE["early_stopping"]["grace_period"],
                        help="ASHA's and the geometry stopper's first rung (epochs)")
    args = parser.parse_args(argv)
    recorded = json.loads(args.cache.read_text()) if args.replay_only else record(args.cache)
    if args.record_only:
        return 0
    print(json.dumps(measure(recorded, search_seeds=args.search_seeds, concurrency=args.concurrency,
                                grace_period=args.grace_period), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
