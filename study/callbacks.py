"""Ray Tune callbacks of the study driver: MLflow runs closed with their trial's status, live progress, and the
sampler's journal kept in object storage."""

from __future__ import annotations

import time

from ray.tune import Callback

from study.folder import StudyFolder
from study.results import best_records, count_statuses, format_metrics, format_params, record_from_trial
from study.search import JOURNAL_FILE
from study.space import SearchSpace
from study.status import TrialStatus, trial_status
from study.tracking.runs import close_run

PROGRESS_EVERY_S = 30.0
# A trial Tune has made but not started for this long waits for nodes (the autoscaler's), not for its own start.
WAITING_AFTER_S = 10.0


class CloseTrialRuns(Callback):
    """Ends each trial's MLflow run with its lapstudy status: a trial stopped by ASHA is killed before its own code
    could do it."""

    def __init__(self, tracking_uri: str, experiment_id: str, epochs: int):
        self.tracking_uri, self.experiment_id, self.epochs = tracking_uri, experiment_id, epochs

    def on_trial_complete(self, iteration, trials, trial, **info):
        self._close(trial, *trial_status("TERMINATED", trial.last_result, self.epochs))

    def on_trial_error(self, iteration, trials, trial, **info):
        self._close(trial, *trial_status("ERROR", trial.last_result, self.epochs, error=trial.get_error()))

    def _close(self, trial, status: TrialStatus, error: str | None):
        result = trial.last_result or {}
        close_run(self.tracking_uri, self.experiment_id, run_id=result.get("mlflow_run_id") or None,
                  trial_id=trial.trial_id, status=status, error=error, checkpoint=result.get("checkpoint_path"))


class StudyProgress(Callback):
    """Live progress on the console: a line per started and finished trial, and the state of the study (done,
    stopped early, failed, running, waiting for nodes, best so far) whenever a trial ends and at least every 30 s."""

    def __init__(self, space: SearchSpace, num_samples: int):
        self.metrics, self.modes, self.num_samples = space.metrics, space.modes, num_samples
        self.epochs = space.total_epochs
        self._reset()

    def _reset(self):
        self.started = time.monotonic()
        self.last_line = 0.0
        self.last_status = None
        self.pending_since: dict[str, float] = {}

    def setup(self, **info):
        self._reset()

    def on_trial_start(self, iteration, trials, trial, **info):
        record = record_from_trial(trial, self.epochs)
        self._print(f"trial {trial.trial_id} started: {format_params(record.sampled)} (seed {record.seed})")

    def on_trial_complete(self, iteration, trials, trial, **info):
        record = record_from_trial(trial, self.epochs, finished=True)
        what = {TrialStatus.COMPLETED: "finished", TrialStatus.EARLY_STOPPED: f"stopped early at epoch "
                f"{record.epochs_run}"}.get(record.status, str(record.status))
        self._print(f"trial {trial.trial_id} {what}: {format_metrics(record, self.metrics)}"
                    + (f" ({record.error})" if record.error else ""))
        self._status(trials, force=True, finished=trial)

    def on_trial_error(self, iteration, trials, trial, **info):
        _, error = trial_status("ERROR", trial.last_result, self.epochs, error=trial.get_error())
        self._print(f"trial {trial.trial_id} failed: {error}")
        self._status(trials, force=True)

    def on_step_end(self, iteration, trials, **info):
        self._note_pending(trials)
        self._status(trials)

    def _status(self, trials, force=False, finished=None):
        now = time.monotonic()
        if not force and now - self.last_line < PROGRESS_EVERY_S:
            return
        records = [record_from_trial(t, self.epochs, finished=t is finished) for t in trials]
        counts = count_statuses(records)
        done = sum(counts[s] for s in TrialStatus if s.finished)
        line = (f"{done}/{self.num_samples} done ({counts[TrialStatus.EARLY_STOPPED]} stopped early, "
                f"{counts[TrialStatus.FAILED]} failed), {counts[TrialStatus.RUNNING]} running")
        waiting = sum(now - since >= WAITING_AFTER_S for since in self.pending_since.values())
        if waiting:
            line += f", {waiting} waiting for nodes"
        best = best_records(records, self.metrics, self.modes, include_running=True)
        if best and len(self.metrics) == 1:
            r = best[0]
            line += (f" | best {self.metrics[0]} {r.metrics[self.metrics[0]]:.4f} (trial {r.trial_id}: "
                     f"{format_params(r.sampled)})")
        elif best:
            line += f" | {len(best)} trial(s) on the Pareto front"
        if force or line != self.last_status:
            self._print(line)
            self.last_status = line

    def _note_pending(self, trials):
        """Since when each trial Tune has made has not started: after WAITING_AFTER_S no node has room for it yet
        (on an autoscaling cluster, until the nodes the autoscaler adds for it join)."""
        now = time.monotonic()
        pending = {t.trial_id for t in trials if t.status == "PENDING"}
        self.pending_since = {trial: self.pending_since.get(trial, now) for trial in pending}

    def _print(self, text):
        elapsed = int(time.monotonic() - self.started)
        print(f"[{elapsed // 3600:02d}:{elapsed // 60 % 60:02d}:{elapsed % 60:02d}] {text}", flush=True)
        self.last_line = time.monotonic()


class PushJournal(Callback):
    """Keeps the Optuna journal of a study in object storage current there (the sampler writes it in the driver's
    local copy, when it proposes a trial and when one ends): pushed at most every few seconds, like Tune's own state,
    and when a trial ends."""

    def __init__(self, folder: StudyFolder, every_s: float):
        self.folder, self.every_s, self.pushed = folder, every_s, float("-inf")

    def on_step_end(self, iteration, trials, **info):
        if time.monotonic() - self.pushed >= self.every_s:
            self._push()

    def on_trial_complete(self, iteration, trials, trial, **info):
        self._push()

    def _push(self):
        self.folder.push(JOURNAL_FILE)
        self.pushed = time.monotonic()
