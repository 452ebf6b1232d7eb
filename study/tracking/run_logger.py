"""The rank-0 Train worker's logger: what a trial's run records (params, config.yaml, its dataset, metrics with
step = epoch, system metrics) and how it keeps logging through a tracking server that goes away."""

from __future__ import annotations

import hashlib
import json
import logging
import math
import tempfile
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path

from mlflow.entities import DatasetInput, InputTag, Metric, Param, RunTag
from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor
from mlflow.tracking import MlflowClient
from mlflow.utils.mlflow_tags import MLFLOW_DATASET_CONTEXT, MLFLOW_PARENT_RUN_ID

from study.bookkeeping import EPOCH, RAY_ONLY
from study.mlflow_settings import use_mlflow_client_settings
from study.runspec import RunSpec
from study.status import TrialStatus
from study.tracking.runs import (
    MAX_PARAM_CHARS,
    METRICS_PER_BATCH,
    PARAMS_PER_BATCH,
    TAG_STATUS,
    TAG_STUDY,
    TAG_TRIAL,
    find_trial_run,
)
from study.tracking.store import credentials_to_environment, server_answers, short_error

log = logging.getLogger(__name__)

SYSTEM_METRICS_EVERY_S = 5  # MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL overrides it


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

