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

The package, one module per part:
- `study.tracking.store`: whether the store answers, the study's experiment, credentials in tracking URIs;
- `study.tracking.runs`: the runs' tags, finding a trial's run again, the study's run, closing runs;
- `study.tracking.run_logger`: the rank-0 worker's `RunLogger` and what a trial's run records.
"""
