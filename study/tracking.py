"""MLflow tracking: one experiment per study, exactly one run per trial, and logging that never stops training.

Who logs what:
- the study driver creates (or finds) the experiment, with an explicit artifact location for local stores, and
  checks that the tracking server answers before any trial starts;
- the rank-0 Train worker of a trial finds its run by the tag `lapstudy.trial_id` (or creates it, named after the
  trial), then logs params, `config.yaml`, per-epoch metrics with step = epoch, geometry and plots. Finding the run
  by tag is what keeps one run per trial when a trial restarts (worker or node failure, Tune retry, `--resume`);
  epochs already in the run's history are not logged again, and epochs recorded in the checkpoint but missing from
  MLflow are logged on restart;
- a Tune callback on the study driver closes each run with its final status (completed, early_stopped, failed),
  because a trial stopped by ASHA is killed before its own code could do it.

If the tracking server goes away mid-study, logging calls fail fast (few retries, short time-outs), the pending
metrics are kept and sent with the next epoch, and training goes on: Ray's own records (the trial results in the
study folder) still hold every reported metric.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import re
import tempfile
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import unquote, urlparse

from mlflow.entities import DatasetInput, InputTag, Metric, Param, RunTag
from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor
from mlflow.tracking import MlflowClient
from mlflow.utils.mlflow_tags import MLFLOW_DATASET_CONTEXT, MLFLOW_PARENT_RUN_ID, MLFLOW_RUN_NOTE

from study.bookkeeping import EPOCH, RAY_ONLY
from study.data.hub import probe_url
from study.errors import UserError
from study.folder import local_store
from study.mlflow_settings import use_mlflow_client_settings
from study.runspec import RunSpec
from study.status import TrialStatus

log = logging.getLogger(__name__)

TAG_TRIAL = "lapstudy.trial_id"
TAG_STUDY = "lapstudy.study"
TAG_STATUS = "lapstudy.status"
TAG_ERROR = "lapstudy.error"
TAG_CHECKPOINT = "lapstudy.checkpoint"
TAG_CONFIG, TAG_REPLICATE = "lapstudy.config_id", "lapstudy.replicate"
TAG_STUDY_RUN = "lapstudy.study_run"  # "true" on the study's own run, the parent of its trial runs
# On the study's run: its best configuration's trial ids and their MLflow runs (comma-separated).
TAG_BEST_TRIALS, TAG_BEST_RUNS = "lapstudy.best_trial_ids", "lapstudy.best_run_ids"
# The MLflow UI opens an experiment in the layout its kind names: model training, not GenAI.
EXPERIMENT_KIND_TAG, MODEL_TRAINING = "mlflow.experimentKind", "custom_model_development"
# How MLflow clients authenticate (https://mlflow.org/docs/latest/auth): handed to the Train workers in memory.
MLFLOW_CREDENTIAL_VARIABLES = ("MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD", "MLFLOW_TRACKING_TOKEN",
                               "MLFLOW_TRACKING_INSECURE_TLS", "MLFLOW_TRACKING_SERVER_CERT_PATH")
_CREDENTIALS = re.compile(r"(\w+://)[^/\s@]+@")
SYSTEM_METRICS_EVERY_S = 5  # MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL overrides it
# MLflow caps a param value at 6000 characters and a batch at 100 params / 1000 metrics.
MAX_PARAM_CHARS, PARAMS_PER_BATCH, METRICS_PER_BATCH = 6000, 100, 1000
# Once a call to a tracking server has failed, each later one first checks that the server accepts a connection
# within this long: a server that is away then costs a refused connection, not a call's retries and back-off.
SERVER_PROBE_S = 2.0


def server_answers(tracking_uri: str) -> bool:
    """Whether an http(s) tracking server accepts a connection within SERVER_PROBE_S (any other store: True)."""
    url = urlparse(tracking_uri)
    if url.scheme not in ("http", "https") or not url.hostname:
        return True
    return probe_url(tracking_uri, timeout=SERVER_PROBE_S)[0]


def check_store(tracking_uri: str, name: str, *, must_be_new: bool) -> str | None:
    """Read only: the id of the study's experiment if the store has it, None if not yet. Raises UserError if the
    store cannot be used (unreachable, unknown scheme) or, for a new study, if an experiment of that name already
    holds runs (of another study)."""
    try:
        client = MlflowClient(tracking_uri)
        experiment = client.get_experiment_by_name(name)
        has_runs = bool(experiment is not None and client.search_runs([experiment.experiment_id], max_results=1))
    except Exception as exc:  # noqa: BLE001 - any failure here means the store is unusable
        raise UserError(f"--tracking-uri {redact(tracking_uri)}: cannot use the MLflow store "
                        f"({short_error(exc)})") from None
    if experiment is None:
        return None
    if experiment.lifecycle_stage == "deleted":
        raise UserError(f"--name {name}: an MLflow experiment of that name is deleted but still in the store; "
                        "pick another --name")
    if must_be_new and has_runs:
        raise UserError(
            f"--name {name}: the MLflow store {redact(tracking_uri)} already has an experiment {name!r} with runs; "
            "pick another --name (or --resume the study that owns it)"
        )
    return experiment.experiment_id


def ensure_experiment(tracking_uri: str, name: str, artifact_location: str | None, *, must_be_new: bool) -> str:
    """The experiment's id, created if needed and marked as model training (same errors as `check_store`)."""
    experiment_id = check_store(tracking_uri, name, must_be_new=must_be_new)
    try:
        client = MlflowClient(tracking_uri)
        if experiment_id is None:
            experiment_id = client.create_experiment(name, artifact_location=artifact_location)
        client.set_experiment_tag(experiment_id, EXPERIMENT_KIND_TAG, MODEL_TRAINING)
        return experiment_id
    except Exception as exc:  # noqa: BLE001
        raise UserError(f"--tracking-uri {redact(tracking_uri)}: cannot use the MLflow store "
                        f"({short_error(exc)})") from None


def open_experiment(tracking_uri: str | None, folder: Path, name: str, *, must_be_new: bool) -> tuple[str, str]:
    """(tracking URI, experiment id): experiment `name` on the tracking server `tracking_uri`, or, for None, in the
    embedded default (a SQLite store and its artifacts in `folder`, which must exist); created if needed."""
    if tracking_uri:
        return tracking_uri, ensure_experiment(tracking_uri, name, None, must_be_new=must_be_new)
    uri, artifacts = local_store(folder)
    return uri, ensure_experiment(uri, name, artifacts, must_be_new=False)


def redact(text: str) -> str:
    """`text` with the password (and user) of any URL in it masked: what may be printed or stored."""
    return _CREDENTIALS.sub(r"\1***@", text)


def without_credentials(uri: str) -> str:
    """The tracking URI as study.json keeps it: no user or password (pass them again, or through the
    MLFLOW_TRACKING_USERNAME / MLFLOW_TRACKING_PASSWORD variables)."""
    return _CREDENTIALS.sub(r"\1", uri)


def credentials_to_environment(uri: str) -> str:
    """The URI without the basic-auth user and password written into it (http://user:password@host), which go to this
    process's MLFLOW_TRACKING_USERNAME / MLFLOW_TRACKING_PASSWORD instead (MLflow's client reads them at each call):
    MLflow's own warnings quote the URL they failed on, and a Train worker's output reaches the driver's and
    `ray job logs`."""
    parsed = urlparse(uri)
    if parsed.username is None:
        return uri
    os.environ["MLFLOW_TRACKING_USERNAME"] = unquote(parsed.username)
    os.environ["MLFLOW_TRACKING_PASSWORD"] = unquote(parsed.password or "")
    return without_credentials(uri)


def find_trial_run(client: MlflowClient, experiment_id: str, trial_id: str) -> str | None:
    runs = client.search_runs(
        [experiment_id], filter_string=f"tags.`{TAG_TRIAL}` = '{trial_id}'", max_results=2,
        order_by=["attributes.start_time ASC"]
    )
    return runs[0].info.run_id if runs else None


def find_study_run(client: MlflowClient, experiment_id: str) -> str | None:
    runs = client.search_runs([experiment_id], filter_string=f"tags.`{TAG_STUDY_RUN}` = 'true'", max_results=1)
    return runs[0].info.run_id if runs else None


def open_study_run(tracking_uri: str, experiment_id: str, study: str, params: dict[str, str],
                   tags: dict[str, str], files: list[Path]) -> str:
    """The study's own run, the parent of its trial runs: created with the study's settings as params, `tags`
    (provenance) and `files` as artifacts; found again by its tag when the study resumes, and running again."""
    try:
        client = MlflowClient(tracking_uri)
        run_id = find_study_run(client, experiment_id)
        if run_id is not None:
            if client.get_run(run_id).info.status != "RUNNING":
                client.update_run(run_id, status="RUNNING")
            return run_id
        run = client.create_run(experiment_id, run_name=f"study_{study}",
                                tags={TAG_STUDY: study, TAG_STUDY_RUN: "true", **tags})
        items = [Param(k, v[:MAX_PARAM_CHARS]) for k, v in params.items()]
        for start in range(0, len(items), PARAMS_PER_BATCH):
            client.log_batch(run.info.run_id, params=items[start:start + PARAMS_PER_BATCH])
        for path in files:
            client.log_artifact(run.info.run_id, str(path))
        return run.info.run_id
    except Exception as exc:  # noqa: BLE001
        raise UserError(f"--tracking-uri {redact(tracking_uri)}: cannot use the MLflow store "
                        f"({short_error(exc)})") from None


def close_run(tracking_uri: str, experiment_id: str, *, run_id: str | None, trial_id: str | None, status: TrialStatus,
              error: str | None = None, checkpoint: str | None = None, raise_errors: bool = False) -> None:
    """Set the final lapstudy status (and error) of a run and end it. Never raises unless asked: a lost tracking
    server must not take the study down."""
    try:
        client = MlflowClient(tracking_uri)
        if run_id is None and trial_id is not None:
            run_id = find_trial_run(client, experiment_id, trial_id)
        if run_id is None:
            return
        run = client.get_run(run_id)
        if run.info.status == status.mlflow_status and run.data.tags.get(TAG_STATUS) == status.value:
            return  # already closed so (a trial re-reported after a resume): leave the run as it is
        tags = [RunTag(TAG_STATUS, status.value)]
        if error:
            tags.append(RunTag(TAG_ERROR, error[:5000]))
        if checkpoint:
            tags.append(RunTag(TAG_CHECKPOINT, checkpoint))
        client.log_batch(run_id, tags=tags)
        client.set_terminated(run_id, status.mlflow_status)
    except Exception as exc:  # noqa: BLE001
        if raise_errors:
            raise
        log.warning("MLflow: could not close run %s (%s): %s", run_id, status, short_error(exc))


def record_study_best(tracking_uri: str, experiment_id: str, study_run_id: str, best: dict[str, float],
                      trial_runs: dict[str, str | None], description: str) -> None:
    """The study's run gets what the study found: `best/<metric>` metrics, the best trials' ids and runs as tags,
    and a note (the run's description in the MLflow UI) linking each best run. Best-effort, as close_run."""
    try:
        client = MlflowClient(tracking_uri)
        now = int(time.time() * 1000)
        links = ", ".join(f"[trial {trial}](#/experiments/{experiment_id}/runs/{run})" if run else f"trial {trial}"
                          for trial, run in trial_runs.items())
        client.log_batch(study_run_id, metrics=[Metric(f"best/{k}", float(v), now, 0) for k, v in best.items()
                                                if math.isfinite(v)],
                         tags=[RunTag(TAG_BEST_TRIALS, ",".join(trial_runs)),
                               RunTag(TAG_BEST_RUNS, ",".join(r for r in trial_runs.values() if r)),
                               RunTag(MLFLOW_RUN_NOTE, f"Best: {description}; {links}")])
    except Exception as exc:  # noqa: BLE001 - a lost tracking server must not take the study down
        log.warning("MLflow: could not record the study's best in run %s: %s", study_run_id, short_error(exc))


def epoch_metrics(epoch: int, values: dict) -> list[Metric]:
    """One epoch's MLflow metrics (step = epoch): its finite numbers, with the `epoch` marker last so that a run's
    epoch history lists only epochs whose metrics are all in."""
    now = int(time.time() * 1000)
    metrics = [Metric(key, float(value), now, epoch) for key, value in values.items()
               if key != EPOCH and key not in RAY_ONLY and isinstance(value, int | float)
               and not isinstance(value, bool) and math.isfinite(value)]
    return metrics + [Metric(EPOCH, float(epoch), now, epoch)]


@dataclass(frozen=True)
class TrackingTarget:
    """Where a run's rank-0 worker logs: the MLflow store, the study's experiment, and the trial's identity."""

    tracking_uri: str
    experiment_id: str
    run_name: str
    trial_id: str | None  # None for `lapstudy train`: always a new run
    study: str | None
    parent_run_id: str | None = None  # the study's own run, under which MLflow nests the trial runs
    tags: dict = field(default_factory=dict)  # more tags of a new run (its configuration id and replicate)


def run_params(spec: RunSpec, num_params: int, data: dict | None = None) -> dict[str, str]:
    """MLflow params: every resolved hyperparameter under its space name, plus task, seed, epochs and, from the trial
    itself, what the data resolved to (`data.*`: split sizes, tokenizer, ...). The dataset itself is the run's
    input (dataset_input)."""
    extra = {"task": spec.task, "seed": spec.seed, "epochs": spec.epochs, "num_params": num_params,
             "workers": spec.resources.workers}
    if data:
        extra["data"] = data
    return flat_params(spec.hyperparameters, extra)


def dataset_input(config) -> DatasetInput:
    """The run's data as MLflow records datasets (mlflow.log_input): a name, its source (a hub repository, a local or
    remote path, or the project's own generator for the built-in sources) and a digest of the dataset as configured,
    so that runs on the same data share it (what it resolved to, split sizes and tokenizer, is in the `data.*`
    params)."""
    from mlflow.data.code_dataset_source import CodeDatasetSource
    from mlflow.data.dataset_source_registry import resolve_dataset_source
    from mlflow.data.huggingface_dataset_source import HuggingFaceDatasetSource
    from mlflow.data.meta_dataset import MetaDataset

    dataset = config.model_dump(mode="json")
    hub = getattr(config, "hub_id", None)  # the source's own answer (a hub image preset names its repository)
    path = dataset.get("local_dir") or dataset.get("path")
    if path:
        with warnings.catch_warnings():  # a local path matches the local-artifact source twice: the same one
            warnings.simplefilter("ignore", UserWarning)
            source = resolve_dataset_source(str(path))
    elif hub:
        source = HuggingFaceDatasetSource(hub, config_name=dataset.get("config_name") or dataset.get("sample"),
                                          revision=dataset.get("revision"))
    else:
        source = CodeDatasetSource({"lapstudy.source": dataset["source"]})
    described = json.dumps(dataset, sort_keys=True, default=str)
    name = dataset["source"] + (f":{hub}" if hub else f":{Path(str(path)).name}" if path else "")
    meta = MetaDataset(source, name=name, digest=hashlib.sha256(described.encode()).hexdigest()[:12])
    return DatasetInput(meta._to_mlflow_entity(), tags=[InputTag(MLFLOW_DATASET_CONTEXT, "training")])


def flat_params(hyperparameters: dict, extra: dict) -> dict[str, str]:
    params = {}
    for key, value in {**hyperparameters, **extra}.items():
        if isinstance(value, dict):
            for sub, sub_value in value.items():
                params[f"{key}.{sub}"] = str(sub_value)
        else:
            params[key] = str(value)
    return {k: v[:MAX_PARAM_CHARS] for k, v in params.items()}


class RunLogger:
    """The rank-0 worker's handle on its MLflow run. Every call is best-effort: failures are logged once, metrics
    are kept and retried with the next epoch, training never waits on the tracking server for long.
    `system_metrics`: MLflow's monitor logs the machine's CPU, memory, disk, network (and GPU, where NVML answers)
    to the run as `system/*` until `close()`."""

    def __init__(self, target: TrackingTarget, params: dict[str, str], config_yaml: str, *,
                 datasets: list[DatasetInput] = (), system_metrics: bool = False):
        use_mlflow_client_settings()
        self.target, self.params, self.config_yaml, self.datasets = target, params, config_yaml, list(datasets)
        self.experiment_id, self.trial_id = target.experiment_id, target.trial_id
        self.run_id: str | None = None
        self._logged_steps: set[int] = set()
        self._pending: list[Metric] = []
        self._warned = False
        self._ready = False
        self._failed = False  # the last call failed: the next one checks that the server answers first
        self.tracking_uri = credentials_to_environment(target.tracking_uri) if target.tracking_uri else None
        self._client = MlflowClient(self.tracking_uri) if self.tracking_uri else None
        self._system_metrics = system_metrics
        self._monitor = None
        self._connect()

    @property
    def enabled(self) -> bool:
        return self._client is not None

    def _connect(self) -> bool:
        """Find the trial's run (by tag) or create it; on a new run log params, tags and config.yaml. False while the
        server is away (what was to be logged is kept, or dropped for artifacts and tags)."""
        if not self.enabled:
            return False
        if self._failed:
            if not server_answers(self.tracking_uri):
                return False
            self._failed = False
        if self._ready:
            return True
        try:
            client = self._client
            if self.run_id is None and self.trial_id is not None:
                self.run_id = find_trial_run(client, self.experiment_id, self.trial_id)
            created = self.run_id is None
            if created:
                tags = {TAG_STATUS: TrialStatus.RUNNING.value, **self.target.tags}
                if self.trial_id is not None:
                    tags[TAG_TRIAL] = self.trial_id
                if self.target.study is not None:
                    tags[TAG_STUDY] = self.target.study
                if self.target.parent_run_id:
                    tags[MLFLOW_PARENT_RUN_ID] = self.target.parent_run_id  # the study's run: MLflow nests it
                run = client.create_run(self.experiment_id, run_name=self.target.run_name, tags=tags)
                self.run_id = run.info.run_id
                items = list(self.params.items())
                for start in range(0, len(items), PARAMS_PER_BATCH):
                    client.log_batch(self.run_id,
                                     params=[Param(k, v) for k, v in items[start:start + PARAMS_PER_BATCH]])
                if self.datasets:
                    client.log_inputs(self.run_id, datasets=self.datasets)
                with tempfile.TemporaryDirectory() as tmp:
                    path = Path(tmp) / "config.yaml"
                    path.write_text(self.config_yaml)
                    client.log_artifact(self.run_id, str(path))
            else:
                run = client.get_run(self.run_id)
                if run.info.status != "RUNNING":  # a restarted trial: its run is live again
                    client.update_run(self.run_id, status="RUNNING")
                    client.set_tag(self.run_id, TAG_STATUS, TrialStatus.RUNNING.value)
                self._logged_steps = {m.step for m in client.get_metric_history(self.run_id, "epoch")}
            self._ready = True
            if self._system_metrics:
                self._start_monitor(resume=not created)
            return True
        except Exception as exc:  # noqa: BLE001
            self._warn("connect", exc)
            return False

    def log_epoch(self, epoch: int, metrics: dict[str, float]) -> None:
        """Metrics of one epoch with step = epoch; an epoch already in the run is skipped (restarted trials)."""
        if not self.enabled or epoch in self._logged_steps:
            return
        self._pending += epoch_metrics(epoch, metrics)
        self._logged_steps.add(epoch)
        if self.flush() and self._monitor is not None and not self._monitor_published():
            # An epoch shorter than the monitor's interval: publish its samples now, so that a run whose process is
            # killed before close() (a driver lost just after the last report) still has the machine's metrics.
            try:
                self._stop_monitor()
                self._start_monitor(resume=True)
            except Exception as exc:  # noqa: BLE001
                self._warn("log system metrics", exc)

    def flush(self) -> bool:
        if not self._pending or not self._connect():
            return not self._pending
        try:
            # The "epoch" marker goes last in each batch so that a run's epoch history lists only complete epochs.
            ordered = sorted(self._pending, key=lambda m: (m.step, m.key == "epoch"))
            for start in range(0, len(ordered), METRICS_PER_BATCH):
                self._client.log_batch(self.run_id, metrics=ordered[start:start + METRICS_PER_BATCH])
            self._pending.clear()
            return True
        except Exception as exc:  # noqa: BLE001
            self._warn("log metrics", exc)
            return False

    def log_artifacts(self, local_dir: str, artifact_path: str | None = None) -> None:
        if not self.enabled or not self._connect():
            return
        try:
            self._client.log_artifacts(self.run_id, local_dir, artifact_path)
        except Exception as exc:  # noqa: BLE001
            self._warn("log artifacts", exc)

    def set_tags(self, tags: dict[str, str]) -> None:
        if not self.enabled or not self._connect():
            return
        try:
            self._client.log_batch(self.run_id, tags=[RunTag(k, str(v)) for k, v in tags.items()])
        except Exception as exc:  # noqa: BLE001
            self._warn("set tags", exc)

    def close(self) -> None:
        """Stop the system-metrics monitor (the run itself is ended by whoever knows its final status)."""
        if self._monitor is not None:
            try:
                self._stop_monitor()
            except Exception as exc:  # noqa: BLE001
                self._warn("log system metrics", exc)

    def _start_monitor(self, *, resume: bool) -> None:
        self._monitor = SystemMetricsMonitor(self.run_id, sampling_interval=SYSTEM_METRICS_EVERY_S,
                                             resume_logging=resume, tracking_uri=self.tracking_uri)
        self._monitor.start()
        self._first_step = self._monitor._logging_step

    def _monitor_published(self) -> bool:
        return self._monitor._logging_step != self._first_step

    def _stop_monitor(self) -> None:
        """MLflow's monitor publishes only after a whole interval, and only if it is not stopped while it checks the
        run's status then: stopped before its first publication, it logs the samples it took, or one taken now."""
        monitor = self._monitor
        monitor.finish()  # joins its thread: nothing samples while this publishes
        published = self._monitor_published()
        self._monitor = None
        if not published:
            if not monitor.aggregate_metrics():
                monitor.collect_metrics()
            monitor.publish_metrics(monitor.aggregate_metrics())
            monitor.mlflow_logger.flush()

    def _warn(self, what: str, exc: Exception) -> None:
        self._failed = True
        if not self._warned:
            log.warning("MLflow %s failed (training goes on; Ray keeps the results): %s", what, short_error(exc))
            self._warned = True


def short_error(exc: Exception) -> str:
    text = redact(" ".join(str(exc).split()))
    return f"{type(exc).__name__}: {text[:300]}"
