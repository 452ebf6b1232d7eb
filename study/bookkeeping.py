"""What a trial carries besides its hyperparameters and its metrics: the one definition every reader filters by.

A trial's config holds its sampled values plus its identity (TRIAL_IDENTITY); a result it reports to Ray holds its
metrics plus the loop's bookkeeping (BOOKKEEPING) and what Tune adds to every result (TUNE_ADDED). Nothing else in
`study/` spells these keys out."""

from __future__ import annotations

from ray.tune.result import AUTO_RESULT_KEYS

# Keys every trial's config carries besides its sampled values (none is a hyperparameter name): its configuration,
# which replicate of it the trial is, and that replicate's seed (study/search.py's ReplicatedSearch sets them).
CONFIG_ID, REPLICATE, SEED = "config_id", "replicate", "seed"
TRIAL_IDENTITY = frozenset({CONFIG_ID, REPLICATE, SEED})

# What the training loop reports to Ray besides the epoch's metrics (Ray's records only, never MLflow metrics).
RAY_ONLY = frozenset({"mlflow_run_id", "resumed_from_epoch", "worker_node_id", "worker_pid", "checkpoint_path"})
# The run's epoch counter: an MLflow step, not a metric.
EPOCH = "epoch"
# What a report carries besides a stage's own metrics, kept under its own name in every stage.
BOOKKEEPING = RAY_ONLY | {EPOCH, "step", "stage", "diverged", "error"}
# What Tune adds to every reported result.
TUNE_ADDED = frozenset(AUTO_RESULT_KEYS) | {"done", "trial_id", "experiment_tag"}
