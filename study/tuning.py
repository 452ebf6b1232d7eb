"""`lapstudy run`: the study driver. Ray Tune runs one function trainable per trial (the trial driver), which builds
and fits that trial's TorchTrainer; Optuna samples, ASHA stops early, MLflow records.

Study folder `<storage>/<name>/`: Ray Tune's experiment state (what `--resume` restores), `mlflow.db` and
`mlartifacts/` (the embedded MLflow store, unless `--tracking-uri`), `space.yaml` (the space as given),
`study.json` (how the study was started), `trials/<trial_id>.yaml` (each trial's complete run config) and `train/`
(Ray Train's runs, one per trial under a fixed name, holding the checkpoints a restarted trial resumes from).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import sys
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

import ray
from ray import tune
from ray.tune import Callback
from ray.tune.integration.ray_train import TuneReportCallback

from study import results
from study.results import SPACE_FILE, STUDY_FILE, TRIALS_DIR
from study.data import load_task_data, preflight
from study.errors import UserError
from study.loop import TrackingTarget, spec_document
from study.resources import trial_concurrency, trial_driver_resources
from study.runspec import Resources, complete_hyperparameters
from study.search import make_scheduler, make_searcher
from study.space import SearchSpace, load_space
from study.tracking import (
    MLFLOW_CREDENTIAL_VARIABLES,
    STATUS_COMPLETED,
    STATUS_EARLY_STOPPED,
    STATUS_FAILED,
    check_store,
    close_run,
    ensure_experiment,
    local_store,
    redact,
    sync_runs,
    without_credentials,
)
from study.trainer import build_trainer, plan_run
from study.yamlio import dump_yaml

TRAIN_DIR = "train"
EXPERIMENT_STATE_EVERY_S = 2
PROGRESS_EVERY_S = 30.0
# Tune re-runs a trial whose driver died (its node was lost); the trial resumes from its Train checkpoints.
# Worker crashes are retried inside the trial by Ray Train (--max-failures).
TRIAL_RETRIES = 1
TRAIN_POLL_VARIABLE, TRAIN_POLL_S = "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.5"


@dataclass(frozen=True)
class StudyContext:
    """What every trial driver needs to know about its study (pickled into the trainable)."""

    name: str
    study_dir: str
    space: SearchSpace
    seed: int
    resources: Resources
    tracking_uri: str
    experiment_id: str
    max_failures: int
    worker_resources: dict = field(default_factory=dict)  # custom Ray resources each Train worker asks for


@dataclass
class RunOptions:
    space: str
    name: str | None = None
    storage: str | None = None
    num_samples: int | None = None
    max_concurrent: int | None = None
    workers_per_trial: int = 1
    cpus_per_worker: float = 1.0
    gpus_per_worker: float = 0.0
    address: str | None = None
    tracking_uri: str | None = None
    seed: int | None = None
    resume: bool = False
    max_failures: int = 2
    worker_resources: dict = field(default_factory=dict)


# ---- the trial driver (one per trial, runs in a Tune trial actor) -------------------------------------------------


def trial_name(trial) -> str:
    return f"trial_{trial.trial_id}"


def trial_driver(config: dict, study: StudyContext) -> None:
    """One trial: resolve its hyperparameters, record its run config, fit its TorchTrainer."""
    context = tune.get_context()
    trial_id, trial_name = context.get_trial_id(), context.get_trial_name()
    space = study.space
    task_data = load_task_data(space.task, space.dataset, seed=study.seed)
    hyperparameters = complete_hyperparameters(space.resolve(config), task_data.model_overrides, space.task)
    spec = space.run_spec(
        hyperparameters, study.resources, seed=study.seed,
        provenance={"study": study.name, "trial_id": trial_id, "trial_name": trial_name},
    )
    record = Path(study.study_dir) / TRIALS_DIR / f"{trial_id}.yaml"
    record.parent.mkdir(parents=True, exist_ok=True)
    record.write_text(dump_yaml(spec_document(spec)))
    trainer = build_trainer(
        spec, task_data,
        name=f"trial_{trial_id}",  # fixed per trial: a restarted trial finds its checkpoints again
        storage_path=Path(study.study_dir) / TRAIN_DIR,
        tracking=TrackingTarget(study.tracking_uri, study.experiment_id, trial_name, trial_id, study.name),
        callbacks=[TuneReportCallback()],
        max_failures=study.max_failures,
        worker_resources=study.worker_resources,
    )
    trainer.fit()


# ---- callbacks on the study driver ----------------------------------------------------------------------------------


class CloseTrialRuns(Callback):
    """Ends each trial's MLflow run with its lapstudy status; the trial itself may have been killed by ASHA."""

    def __init__(self, tracking_uri: str, experiment_id: str, epochs: int):
        self.tracking_uri, self.experiment_id, self.epochs = tracking_uri, experiment_id, epochs

    def on_trial_complete(self, iteration, trials, trial, **info):
        result = trial.last_result or {}
        if result.get("diverged"):
            status, error = STATUS_FAILED, result.get("error")
        elif result.get("epoch", 0) < self.epochs:
            status, error = STATUS_EARLY_STOPPED, None
        else:
            status, error = STATUS_COMPLETED, None
        self._close(trial, status, error)

    def on_trial_error(self, iteration, trials, trial, **info):
        self._close(trial, STATUS_FAILED, results.error_summary(trial.get_error()))

    def _close(self, trial, status, error):
        result = trial.last_result or {}
        close_run(self.tracking_uri, self.experiment_id, run_id=result.get("mlflow_run_id") or None,
                  trial_id=trial.trial_id, status=status, error=error, checkpoint=result.get("checkpoint_path"))


class StudyProgress(Callback):
    """Live progress on the console: a line per finished trial and a status line at least every 30 s."""

    def __init__(self, space: SearchSpace, num_samples: int):
        self.metrics, self.modes, self.epochs, self.num_samples = space.metrics, space.modes, space.epochs, num_samples
        self._reset()

    def _reset(self):
        self.started = time.monotonic()
        self.last_line = 0.0
        self.last_status = None

    def setup(self, **info):
        self._reset()

    def on_trial_start(self, iteration, trials, trial, **info):
        self._print(f"trial {trial.trial_id} started: {results.format_params(trial.config)}")

    def on_trial_complete(self, iteration, trials, trial, **info):
        record = results.record_from_trial(trial, self.epochs, finished=True)
        what = {"completed": "finished", "early_stopped": f"stopped early at epoch {record.epochs_run}",
                "failed": "failed"}.get(record.status, record.status)
        self._print(f"trial {trial.trial_id} {what}: {results.format_metrics(record, self.metrics)}"
                    + (f" ({record.error})" if record.error else ""))
        self._status(trials, force=True, finished=trial)

    def on_trial_error(self, iteration, trials, trial, **info):
        self._print(f"trial {trial.trial_id} failed: {results.error_summary(trial.get_error())}")
        self._status(trials, force=True)

    def on_step_end(self, iteration, trials, **info):
        self._status(trials)

    def _status(self, trials, force=False, finished=None):
        now = time.monotonic()
        if not force and now - self.last_line < PROGRESS_EVERY_S:
            return
        records = [results.record_from_trial(t, self.epochs, finished=t is finished) for t in trials]
        counts = {s: sum(r.status == s for r in records) for s in ("completed", "early_stopped", "failed", "running")}
        done = counts["completed"] + counts["early_stopped"] + counts["failed"]
        line = (f"{done}/{self.num_samples} done ({counts['early_stopped']} stopped early, {counts['failed']} failed), "
                f"{counts['running']} running")
        best = results.best_records(records, self.metrics, self.modes, include_running=True)
        if best and not (len(self.metrics) > 1):
            r = best[0]
            line += f" | best {self.metrics[0]} {r.metrics[self.metrics[0]]:.4f} (trial {r.trial_id}: {results.format_params(r.params)})"
        elif best:
            line += f" | {len(best)} trial(s) on the Pareto front"
        if force or line != self.last_status:
            self._print(line)
            self.last_status = line

    def _print(self, text):
        elapsed = int(time.monotonic() - self.started)
        print(f"[{elapsed // 3600:02d}:{elapsed // 60 % 60:02d}:{elapsed % 60:02d}] {text}", flush=True)
        self.last_line = time.monotonic()


# ---- the study driver -----------------------------------------------------------------------------------------------


def run_study(options: RunOptions) -> int:
    """Everything that can be checked is checked before Ray starts and before the study folder is created or
    touched: the space and every config it can produce (the keys the data shapes wait for the data), the flags,
    the study folder, the tracking server and the cluster address. Then the checks that need the cluster and the
    data (sizing, batch size against the split) run before the first trial."""
    space_path = Path(options.space)
    space = load_space(space_path)
    space.check_configs(before_data=True)
    name = options.name or space.name
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]*", name):
        raise UserError(f"--name {name!r}: use letters, digits, '_', '.' and '-' (it names a folder)")
    storage = Path(options.storage or "studies").expanduser().resolve()
    study_dir = storage / name
    stored = _check_study_folder(study_dir, space_path, options)
    seed = stored["seed"] if stored else (options.seed if options.seed is not None else space.seed)
    resources = Resources(**stored["resources"]) if stored else _resources(options)
    worker_resources = stored.get("worker_resources", {}) if stored else dict(options.worker_resources)
    num_samples = stored["num_samples"] if stored else (options.num_samples or space.default_num_samples())
    if options.num_samples is not None and options.num_samples < 1:
        raise UserError(f"--num-samples: must be >= 1, got {options.num_samples}")
    tracking_uri = _tracking_uri(options, stored, study_dir)
    experiment_id = None
    if tracking_uri:  # a tracking server: it must answer before anything starts
        experiment_id = check_store(tracking_uri, name, must_be_new=not stored)
    check_address(options.address)
    searcher, scheduler = make_searcher(space, seed), make_scheduler(space)
    preflight(space.task, space.dataset)  # a wrong or offline dataset fails in seconds, before Ray starts

    connect_ray(options.address, storage)
    task_data = load_task_data(space.task, space.dataset, seed=seed)
    space.check_configs(task_data.model_overrides, check=lambda hp: plan_run(
        space.run_spec(complete_hyperparameters(hp, task_data.model_overrides, space.task), resources),
        task_data.num_train))
    cluster = ray.cluster_resources()
    concurrency = trial_concurrency(resources, cluster, [n["Resources"] for n in ray.nodes() if n["Alive"]],
                                    options.max_concurrent if not stored else stored["max_concurrent"],
                                    worker_resources=worker_resources)

    study_dir.mkdir(parents=True, exist_ok=True)
    if tracking_uri:
        experiment_id = experiment_id or ensure_experiment(tracking_uri, name, None, must_be_new=not stored)
    else:
        tracking_uri, artifacts = local_store(study_dir)
        experiment_id = ensure_experiment(tracking_uri, name, artifacts, must_be_new=False)
    if not stored:
        shutil.copyfile(space_path, study_dir / SPACE_FILE)
        meta = {"name": name, "space": str(space_path.resolve()), "created": datetime.now(timezone.utc).isoformat(),
                "seed": seed, "num_samples": num_samples, "max_concurrent": options.max_concurrent,
                "resources": resources.model_dump(), "worker_resources": worker_resources,
                "tracking_uri": without_credentials(tracking_uri), "experiment_id": experiment_id,
                "metric": space.metrics, "mode": space.modes}
        (study_dir / STUDY_FILE).write_text(json.dumps(meta, indent=2) + "\n")

    context = StudyContext(name, str(study_dir), space, seed, resources, tracking_uri, experiment_id,
                           options.max_failures, worker_resources)
    trainable = tune.with_resources(tune.with_parameters(trial_driver, study=context),
                                    trial_driver_resources(cluster))
    callbacks = [CloseTrialRuns(tracking_uri, experiment_id, space.epochs), StudyProgress(space, num_samples)]
    print(f"study {name} in {study_dir}: {num_samples} trials of {space.epochs} epochs, up to {concurrency} at a "
          f"time, {resources.workers} worker(s) x {resources.cpus_per_worker:g} CPU"
          + (f" + {resources.gpus_per_worker:g} GPU" if resources.gpus_per_worker else "") + " per trial", flush=True)
    if stored:
        tuner = tune.Tuner.restore(str(study_dir), trainable=trainable, resume_unfinished=True, resume_errored=True)
    else:
        tuner = tune.Tuner(
            trainable,
            tune_config=tune.TuneConfig(search_alg=searcher, scheduler=scheduler, num_samples=num_samples,
                                        max_concurrent_trials=concurrency, trial_name_creator=trial_name,
                                        trial_dirname_creator=trial_name),
            run_config=tune.RunConfig(
                name=name, storage_path=str(storage), callbacks=callbacks, verbose=0,
                failure_config=tune.FailureConfig(max_failures=TRIAL_RETRIES),
            ),
        )
    # Tune saves its experiment state (what --resume restores) at most this often: a killed driver loses at most
    # these seconds of Tune's bookkeeping (its default waits 10 s or more between saves).
    os.environ.setdefault("TUNE_GLOBAL_CHECKPOINT_S", str(EXPERIMENT_STATE_EVERY_S))
    tuner.fit()
    records = results.load_records(study_dir)
    unsynced = sync_runs(study_dir, tracking_uri, experiment_id, name, records)
    print(results.summary(records, space, study_dir), flush=True)
    if unsynced:
        print(f"MLflow at {redact(tracking_uri)} did not answer: {unsynced} trial run(s) lack epochs Ray recorded; "
              f"`lapstudy sync {study_dir}` sends them when it is back", flush=True)
    return 0


def sync_study(study_dir: Path, tracking_uri: str | None) -> int:
    """`lapstudy sync`: bring the study's MLflow runs up to date with Ray's records."""
    meta = results.study_meta(study_dir)
    saved = without_credentials(meta["tracking_uri"])
    if tracking_uri and without_credentials(tracking_uri) != saved:
        raise UserError(f"--tracking-uri: this study logs to {saved}")
    uri = tracking_uri or meta["tracking_uri"]
    own_store, artifacts = local_store(study_dir)
    # Created again if the store lost it: the runs are rebuilt from Ray's records.
    experiment_id = ensure_experiment(uri, meta["name"], artifacts if uri == own_store else None, must_be_new=False)
    left = sync_runs(Path(study_dir), uri, experiment_id, meta["name"])
    if left:
        raise UserError(f"--tracking-uri {redact(uri)}: {left} trial run(s) could not be brought up to date")
    print(f"MLflow runs of study {meta['name']} match Ray's records ({redact(uri)})", flush=True)
    return 0


def _tracking_uri(options: RunOptions, stored: dict | None, study_dir: Path) -> str | None:
    """The tracking server's URI, None for the study's own SQLite store. A resumed study keeps its store; the URI
    saved in study.json carries no credentials, so a resume may pass it again with them."""
    if not stored:
        return options.tracking_uri
    saved = without_credentials(stored["tracking_uri"])
    if saved == local_store(study_dir)[0]:
        if options.tracking_uri:
            raise UserError(f"--tracking-uri: this study logs to its own store ({saved}); resume it without the flag")
        return None
    if options.tracking_uri and without_credentials(options.tracking_uri) != saved:
        raise UserError(f"--tracking-uri: this study logs to {saved}; resume it with that store")
    return options.tracking_uri or stored["tracking_uri"]


def _resources(options: RunOptions) -> Resources:
    for flag, value, low in (("--workers-per-trial", options.workers_per_trial, 1),):
        if value < low:
            raise UserError(f"{flag}: must be >= {low}, got {value}")
    if options.cpus_per_worker <= 0:
        raise UserError(f"--cpus-per-worker: must be > 0, got {options.cpus_per_worker:g}")
    if options.gpus_per_worker < 0:
        raise UserError(f"--gpus-per-worker: must be >= 0, got {options.gpus_per_worker:g}")
    return Resources(workers=options.workers_per_trial, cpus_per_worker=options.cpus_per_worker,
                     gpus_per_worker=options.gpus_per_worker)


def _check_study_folder(study_dir: Path, space_path: Path, options: RunOptions) -> dict | None:
    """None for a new study; the stored study.json for --resume. Never modifies the folder."""
    meta_path = study_dir / STUDY_FILE
    if not options.resume:
        if study_dir.exists() and any(study_dir.iterdir()):
            raise UserError(f"study folder {study_dir} already exists: pass --resume to continue that study, "
                            "or --name/--storage for a new one")
        return None
    if not meta_path.is_file() or not tune.Tuner.can_restore(str(study_dir)):
        raise UserError(f"--resume: {study_dir} holds no study to resume (no {STUDY_FILE} or Ray experiment state)")
    if (study_dir / SPACE_FILE).read_bytes() != space_path.read_bytes():
        raise UserError(f"--resume: {space_path} differs from the space this study started with "
                        f"({study_dir / SPACE_FILE}); resume with that file, or start a new study with --name")
    stored = json.loads(meta_path.read_text())
    for flag, value, key in (("--num-samples", options.num_samples, "num_samples"), ("--seed", options.seed, "seed")):
        if value is not None and value != stored[key]:
            raise UserError(f"{flag}: this study was started with {stored[key]}; --resume keeps it")
    return stored


ADDRESS_FORMS = "auto, HOST:PORT (the head's address, e.g. 10.0.0.5:6379) or ray://HOST:PORT"
ADDRESS_TIMEOUT_S = 5.0


def check_address(address: str | None) -> None:
    """A clear error for an address that is not one, or where nothing answers: Ray itself would retry for minutes."""
    if address is None or address == "auto":
        return
    target = address.removeprefix("ray://")
    host, colon, port = target.rpartition(":")
    if not colon or not host or not port.isdigit() or not 0 < int(port) < 65536 or re.search(r"[\s/@]", target):
        raise UserError(f"--address {address!r}: expected {ADDRESS_FORMS}")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=ADDRESS_TIMEOUT_S):
            pass
    except OSError as exc:
        reason = exc.strerror or type(exc).__name__
        raise UserError(f"--address {address}: cannot connect (nothing answers at {host}:{port}: {reason}); "
                        "is the cluster up? (`ray status` on its head)") from None


def connect_ray(address: str | None, storage: Path) -> None:
    """Start a local cluster (dashboard on: Tune needs it to clean up the placement groups of stopped trials) or
    join the one at `address`."""
    env = {"MLFLOW_DISABLE_TELEMETRY": "true"}
    env["HF_HOME"] = os.environ.get("HF_HOME") or str(storage / ".hf_home")
    # Passed to the workers in memory (Ray's runtime environment), never written to the study folder.
    for key in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "HF_TOKEN", *MLFLOW_CREDENTIAL_VARIABLES):
        if key in os.environ:
            env[key] = os.environ[key]
    # A trial's Train controller polls its workers this often, and only then hands their reports to Tune and sees
    # that they have finished: Train's 2 s default costs 3-4 s per trial (bench/study_overhead.py).
    env[TRAIN_POLL_VARIABLE] = os.environ.get(TRAIN_POLL_VARIABLE, TRAIN_POLL_S)
    os.environ.setdefault("HF_HOME", env["HF_HOME"])
    os.environ.setdefault("RAY_AIR_NEW_OUTPUT", "0")
    kwargs = dict(runtime_env={"env_vars": env}, log_to_driver=False, logging_level="ERROR")
    try:
        if address:
            ray.init(address=address, **kwargs)
        else:
            ray.init(include_dashboard=True, **kwargs)
    except (ConnectionError, ValueError, RuntimeError, OSError) as exc:  # OSError: e.g. RAY_TMPDIR too long
        where = f"--address {address}" if address else "local Ray cluster"
        raise UserError(f"{where}: cannot connect ({' '.join(str(exc).split())[:200]})") from None
    # Ray's, Optuna's and MLflow's own log lines would bury the progress lines; errors still come through.
    import logging

    logging.getLogger("mlflow").setLevel(logging.WARNING)
    for logger in ("ray", "ray.train", "ray.data"):
        logging.getLogger(logger).setLevel(logging.ERROR)
    # Tune logs every trial error with its full traceback; the progress lines already name the error.
    logging.getLogger("ray.tune").setLevel(logging.CRITICAL)
    sys.stdout.flush()
