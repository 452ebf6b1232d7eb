"""Bringing MLflow up to date with Ray's records, the study's source of truth: at the end of every study, and as
`lapstudy sync` once a tracking server that went away mid-study answers again."""

from __future__ import annotations

import logging

from mlflow.entities import RunTag
from mlflow.tracking import MlflowClient

from study.bookkeeping import CONFIG_ID, REPLICATE, TUNE_ADDED
from study.errors import UserError, validate
from study.folder import StudyFolder, local_store
from study.results import TrialRecord, load_records, trial_rows
from study.runspec import RunSpec
from study.status import TrialStatus
from study.tracking.run_logger import RunLogger, TrackingTarget, dataset_input, epoch_metrics, run_params
from study.tracking.runs import (
    METRICS_PER_BATCH,
    TAG_CONFIG,
    TAG_ERROR,
    TAG_REPLICATE,
    TAG_STATUS,
    TAG_STUDY_RUN,
    TAG_TRIAL,
    close_run,
    find_study_run,
    find_trial_run,
)
from study.tracking.store import open_experiment, redact, short_error, without_credentials
from study.yamlio import dump_yaml, load_yaml

log = logging.getLogger(__name__)


def sync_runs(folder: StudyFolder, tracking_uri: str, experiment_id: str,
              records: list[TrialRecord] | None = None) -> int:
    """Make MLflow agree with Ray's records.

    For every finished trial: the epochs Ray recorded that its run lacks (the tracking server was away when the
    worker logged them) are logged, a run the trial never managed to create is created (params and config.yaml
    from the trial's run config; pictures of the missing epochs cannot be recovered), and the run gets the trial's
    final status. A run left running by a trial Ray has no record of (its driver was killed right after starting
    it; the study ran the configuration again as another trial) is closed as failed. A run already in order is not
    touched. `records`: the study's trial records when the caller has just read them. Returns how many trials could
    not be brought up to date (the server is still away)."""
    by_id = {r.trial_id: r for r in (records if records is not None else load_records(folder))}
    rows = trial_rows(folder)
    failures = 0
    for trial_id, record in by_id.items():
        if not record.status.finished:
            continue
        reported = {int(row["epoch"]): {k: v for k, v in row.items() if k not in TUNE_ADDED}
                    for row in rows.get(trial_id, []) if "epoch" in row}
        try:
            _sync_trial(folder, tracking_uri, experiment_id, record, reported)
        except Exception as exc:  # noqa: BLE001 - best effort; Ray's records stay complete either way
            failures += 1
            log.warning("MLflow: could not bring trial %s's run up to date: %s", trial_id, short_error(exc))
    try:
        client = MlflowClient(tracking_uri)
        running = client.search_runs([experiment_id], filter_string=f"tags.`{TAG_STATUS}` = '{TrialStatus.RUNNING}'")
        for run in running:
            if run.data.tags.get(TAG_STUDY_RUN) != "true" and run.data.tags.get(TAG_TRIAL) not in by_id:
                client.log_batch(run.info.run_id, tags=[RunTag(TAG_STATUS, TrialStatus.FAILED.value), RunTag(
                    TAG_ERROR, "trial lost with its study driver before Ray recorded it; the study ran its "
                               "configuration again as another trial")])
                client.set_terminated(run.info.run_id, TrialStatus.FAILED.mlflow_status)
    except Exception as exc:  # noqa: BLE001
        failures += 1
        log.warning("MLflow: could not check for runs of lost trials: %s", short_error(exc))
    return failures


def _sync_trial(folder: StudyFolder, tracking_uri: str, experiment_id: str, record: TrialRecord,
                reported: dict) -> None:
    client = MlflowClient(tracking_uri)
    run_id = find_trial_run(client, experiment_id, record.trial_id)
    if run_id is None:
        if not reported:
            return  # the trial failed before its first epoch: Ray's record holds its error
        path = folder.trial_config(record.trial_id)
        spec = validate(RunSpec, load_yaml(path, "trial config"), prefix=f"{path}: ")
        num_params = int(next(iter(reported.values())).get("num_params", 0))
        replicate = {TAG_CONFIG: str(spec.provenance[CONFIG_ID]), TAG_REPLICATE: str(spec.provenance[REPLICATE])}
        target = TrackingTarget(tracking_uri, experiment_id, record.name, record.trial_id, folder.name,
                                parent_run_id=find_study_run(client, experiment_id), tags=replicate)
        logger = RunLogger(target, run_params(spec, num_params), dump_yaml(spec.document()),
                           datasets=[dataset_input(spec.dataset)])
        if logger.run_id is None:
            raise ConnectionError("the run could not be created")
        run_id = logger.run_id
    logged = {int(m.step) for m in client.get_metric_history(run_id, "epoch")}
    missing = [metric for epoch in sorted(set(reported) - logged) for metric in epoch_metrics(epoch, reported[epoch])]
    for start in range(0, len(missing), METRICS_PER_BATCH):
        client.log_batch(run_id, metrics=missing[start:start + METRICS_PER_BATCH])
    last = reported[max(reported)] if reported else {}
    close_run(tracking_uri, experiment_id, run_id=run_id, trial_id=record.trial_id, status=record.status,
              error=record.error, checkpoint=last.get("checkpoint_path"), raise_errors=True)


def sync_study(folder: StudyFolder, tracking_uri: str | None) -> int:
    """`lapstudy sync`: bring the study's MLflow runs up to date with Ray's records."""
    record = folder.record()
    saved = without_credentials(record.tracking_uri)
    if tracking_uri and without_credentials(tracking_uri) != saved:
        raise UserError(f"--tracking-uri: this study logs to {saved}")
    uri = tracking_uri or record.tracking_uri
    # The experiment is created again if the store lost it: the runs are rebuilt from Ray's records.
    server = None if uri == local_store(folder.path)[0] else uri
    uri, experiment_id = open_experiment(server, folder.path, record.name, must_be_new=False)
    left = sync_runs(folder, uri, experiment_id)
    if left:
        raise UserError(f"--tracking-uri {redact(uri)}: {left} trial run(s) could not be brought up to date")
    print(f"MLflow runs of study {record.name} match Ray's records ({redact(uri)})", flush=True)
    return 0
