"""Run lifecycle: the tags that identify a study's runs, finding a trial's run again by its tag, the study's own run
(the parent of its trial runs), and closing each run with its final status. Every write but the study run's opening
is best-effort: a lost tracking server must not take the study down."""

from __future__ import annotations

import logging
import math
import time
from pathlib import Path

from mlflow.entities import Metric, Param, RunTag
from mlflow.tracking import MlflowClient
from mlflow.utils.mlflow_tags import MLFLOW_RUN_NOTE

from study.errors import UserError
from study.status import TrialStatus
from study.tracking.store import redact, short_error

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
# MLflow caps a param value at 6000 characters and a batch at 100 params / 1000 metrics.
MAX_PARAM_CHARS, PARAMS_PER_BATCH, METRICS_PER_BATCH = 6000, 100, 1000


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

