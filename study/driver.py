"""`lapstudy run`: the study driver. Ray Tune runs one trial driver per trial (study/trial.py), Optuna samples, ASHA
stops early, MLflow records; the study folder (study/folder.py) keeps everything a resume needs."""

from __future__ import annotations

import json
import os
import sys
from collections import Counter
from datetime import datetime, timezone

import ray
from ray import tune

from study.callbacks import CloseTrialRuns, PushJournal, StudyProgress
from study.data import TaskData, check_dataset
from study.errors import UserError
from study.evals.evaluate import check_evaluations
from study.folder import SPACE_FILE, StudyFolder, StudyRecord, local_store
from study.precheck import RunOptions
from study.preflight import Request, preflight
from study.provenance import provenance
from study.report import REPORT_DIR, write_report
from study.resources import trains_in_trial, trial_driver_resources
from study.results import format_params, load_records, study_best, summary
from study.runspec import Resources, complete_hyperparameters
from study.search import JOURNAL_FILE, make_scheduler, make_searcher
from study.session import DRIVER_FILE, previous_driver, record_driver
from study.space import SearchSpace
from study.space_corners import check_configs
from study.status import TrialStatus
from study.storage import join
from study.sync import sync_runs
from study.tracking.runs import close_run, open_study_run, record_study_best
from study.tracking.store import open_experiment, redact, without_credentials
from study.trial import StudyContext, plan_run, trial_driver, trial_name

# Tune saves its experiment state (what --resume restores) at most this often: a killed driver loses at most these
# seconds of Tune's bookkeeping (its default waits 10 s or more between saves).
EXPERIMENT_STATE_EVERY_S = 2
# Tune re-runs a trial whose driver died (its node was lost); the trial resumes from its Train checkpoints.
# Worker crashes are retried inside the trial by Ray Train (--max-failures), or by Tune for a trial that trains in
# its own process.
TRIAL_RETRIES = 1


def run_study(options: RunOptions, space: SearchSpace, name: str) -> int:
    """`space` and `name`: what study/precheck.py's check_study found. Every other check that can be made is made
    before Ray starts and before the study folder is created or touched (study/preflight.py); then the trials run,
    and MLflow is brought up to date with Ray's records at the end. Exits 1 when every trial failed."""
    folder = StudyFolder.at(join(options.storage, name))
    stored, previous = None, None
    if options.resume:
        previous = previous_driver(folder.pull(DRIVER_FILE).path)  # before a full pull replaces a live copy
        stored = folder.pull().check_resume(options.space,
                                            has_tune_state=tune.Tuner.can_restore(folder.location),
                                            num_samples=options.num_samples, seed=options.seed)
    else:
        folder.check_new()
        folder.pull()  # a study in object storage: no stale local copy of an earlier one
    seed = stored.seed if stored else (options.seed if options.seed is not None else space.seed)
    resources = stored.resources if stored else options.resources
    worker_resources = stored.worker_resources if stored else dict(options.worker_resources)
    num_samples = stored.num_samples if stored else (options.num_samples or space.default_num_samples())
    seeds = stored.seeds if stored else space.replicate_seeds(seed)
    tracking_uri = _tracking_uri(options, stored, folder)
    request = Request(task=space.task, dataset=space.dataset, seed=seed, resources=resources, storage=options.storage,
                      experiment=name, new_experiment=not stored, tracking_uri=tracking_uri, address=options.address,
                      max_concurrent=stored.max_concurrent if stored else options.max_concurrent,
                      worker_resources=worker_resources)
    launch = preflight(request, lambda task_data: _check_space(space, resources, task_data), previous)
    in_process = stored.trains_in_trial if stored else trains_in_trial(resources, ray.cluster_resources(),
                                                                        worker_resources)

    folder.path.mkdir(parents=True, exist_ok=True)
    tracking_uri, experiment_id = open_experiment(tracking_uri, folder.path, name, must_be_new=not stored)
    if not stored:
        folder.start(options.space, StudyRecord(
            name=name, space=str(options.space), created=datetime.now(timezone.utc).isoformat(), seed=seed,
            num_samples=num_samples, seeds=seeds, max_concurrent=options.max_concurrent, resources=resources,
            worker_resources=worker_resources, trains_in_trial=in_process,
            tracking_uri=without_credentials(tracking_uri),
            experiment_id=experiment_id, metric=space.metrics, mode=space.modes))
    record_driver(folder.path, launch.session_dir)
    folder.push(DRIVER_FILE)
    study_run_id = open_study_run(tracking_uri, experiment_id, name, _study_params(space, folder.record()),
                                  provenance(), [folder.path / SPACE_FILE])

    context = StudyContext(folder, space, resources, tracking_uri, experiment_id, study_run_id,
                           options.max_failures, in_process, worker_resources, options.allow_code_execution)
    trainable = tune.with_resources(tune.with_parameters(trial_driver, study=context),
                                    trial_driver_resources(ray.cluster_resources(), resources, in_process))
    trials = num_samples * len(seeds)
    callbacks = [CloseTrialRuns(tracking_uri, experiment_id, space.total_epochs), StudyProgress(space, trials)]
    if folder.remote:
        callbacks.append(PushJournal(folder, EXPERIMENT_STATE_EVERY_S))
    replicated = f" ({num_samples} configurations x {len(seeds)} seeds)" if len(seeds) > 1 else ""
    print(f"study {name} in {folder.location}: {trials} trials{replicated} of {space.epochs} epochs, up to "
          f"{launch.concurrency} at a time, {resources.workers} worker(s) x {resources.cpus_per_worker:g} CPU"
          + (f" + {resources.gpus_per_worker:g} GPU" if resources.gpus_per_worker else "") + " per trial"
          + (", trained in the trial's own process" if in_process else "")
          + (f"; {launch.fit_now} fit on the nodes up now, the others wait for the nodes the autoscaler adds"
             if launch.fit_now < launch.concurrency else ""), flush=True)
    os.environ.setdefault("TUNE_GLOBAL_CHECKPOINT_S", str(EXPERIMENT_STATE_EVERY_S))
    if not space.reported_every_epoch():
        # The metric of a later stage is in that stage's reports only, a benchmark's in the last: Tune would refuse
        # the earlier ones.
        os.environ.setdefault("TUNE_DISABLE_STRICT_METRIC_CHECKING", "1")
    if stored:
        tuner = tune.Tuner.restore(folder.location, trainable=trainable, resume_unfinished=True, resume_errored=True)
    else:
        tuner = tune.Tuner(
            trainable,
            tune_config=tune.TuneConfig(search_alg=make_searcher(space, seed, folder.path),
                                        scheduler=make_scheduler(space), num_samples=trials,
                                        max_concurrent_trials=launch.concurrency, trial_name_creator=trial_name,
                                        trial_dirname_creator=trial_name,
                                        # The next trial takes over a finished trial's process (torch and the
                                        # project already imported) when it trains in it.
                                        reuse_actors=in_process),
            run_config=tune.RunConfig(name=name, storage_path=options.storage, callbacks=callbacks, verbose=0,
                                      failure_config=tune.FailureConfig(max_failures=max(
                                          TRIAL_RETRIES, options.max_failures if in_process else 0))),
        )
    tuner.fit()
    folder.push(JOURNAL_FILE)
    records = load_records(folder.pull())  # a study in object storage: Tune's records are there
    unsynced = sync_runs(folder, tracking_uri, experiment_id, records)
    print(summary(records, space, folder), flush=True)
    print(f"report: {write_report(folder)}", flush=True)
    folder.push(REPORT_DIR)
    best = study_best(records, space.metrics, space.modes)
    if best is not None:
        over = f" (mean of {best.replicates} seeds)" if best.replicates > 1 else ""
        described = ", ".join(f"{m} {v:.4f}" for m, v in best.metrics.items())
        record_study_best(tracking_uri, experiment_id, study_run_id, best.metrics,
                          {t.trial_id: t.mlflow_run_id for t in best.trials},
                          f"{format_params(best.sampled)}: {described}{over}")
    failed = every_trial_failed(records)
    close_run(tracking_uri, experiment_id, run_id=study_run_id, trial_id=None,
              status=TrialStatus.FAILED if failed else TrialStatus.COMPLETED, error=failed)
    if unsynced:
        print(f"MLflow at {redact(tracking_uri)} did not answer: {unsynced} trial run(s) lack epochs Ray recorded; "
              f"`lapstudy sync {folder.location}` sends them when it is back", flush=True)
    if failed:
        print(f"lapstudy: {failed}", file=sys.stderr, flush=True)
        return 1
    return 0


def every_trial_failed(records: list) -> str | None:
    """Why the study has nothing to show when every one of its trials failed (its commonest errors), else None."""
    if not records or any(r.status is not TrialStatus.FAILED for r in records):
        return None
    errors = Counter(r.error or "unknown error" for r in records).most_common()
    if len(errors) == 1:
        return f"every trial failed ({len(records)} of {len(records)}): {errors[0][0]}"
    shown = "; ".join(f"{error} ({count})" for error, count in errors[:3])
    more = f"; {len(errors) - 3} other error(s) in `lapstudy status`" if len(errors) > 3 else ""
    return f"every trial failed ({len(records)} of {len(records)}): {shown}{more}"


def _study_params(space: SearchSpace, record: StudyRecord) -> dict[str, str]:
    """The study's run's params: how it was started and the space's settings (nested ones as JSON)."""
    started = record.model_dump(mode="json", exclude={"name", "space", "created", "tracking_uri", "experiment_id"})
    settings = space.model_dump(mode="json", exclude={"name", "description"})

    def text(value) -> str:
        return json.dumps(value) if isinstance(value, dict | list) else str(value)

    return {**{key: text(value) for key, value in started.items()},
            **{f"space.{key}": text(value) for key, value in settings.items()}}


def _check_space(space: SearchSpace, resources: Resources, task_data: TaskData | None) -> None:
    """Every extreme configuration of the space builds (study/precheck.py checked the keys the data does not shape):
    before the data (None) the later stages' datasets and the benchmarks, then every configuration with the keys
    the data fixes, and each one's batch against the training split."""
    if task_data is None:
        for stage in space.stages:
            check_dataset(stage.dataset or space.dataset)
        check_evaluations(space)
        return

    def fits_the_data(hyperparameters):
        complete = complete_hyperparameters(hyperparameters, task_data.model_overrides, space.task,
                                            epochs=space.epochs)
        plan_run(space.run_spec(complete, resources), task_data)

    check_configs(space, task_data.model_overrides, check=fits_the_data)


def _tracking_uri(options: RunOptions, stored: StudyRecord | None, folder: StudyFolder) -> str | None:
    """The tracking server's URI, None for the study's own SQLite store. A resumed study keeps its store; the URI
    saved in study.json carries no credentials, so a resume may pass it again with them."""
    if not stored:
        return options.tracking_uri
    saved = without_credentials(stored.tracking_uri)
    if saved == local_store(folder.path)[0]:
        if options.tracking_uri:
            raise UserError(f"--tracking-uri: this study logs to its own store ({saved}); resume it without the flag")
        return None
    if options.tracking_uri and without_credentials(options.tracking_uri) != saved:
        raise UserError(f"--tracking-uri: this study logs to {saved}; resume it with that store")
    return options.tracking_uri or stored.tracking_uri
