"""A study's trials as records read from Ray Tune's own state in the study folder: status tables, the best trials
and the Pareto set, and the exported configs. Ray's records are the source of truth (they hold every reported
metric even when the MLflow server was away); MLflow run ids come along in the reported metrics."""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

from study.errors import UserError
from study.yamlio import dump_yaml, load_yaml

STUDY_FILE, SPACE_FILE, TRIALS_DIR = "study.json", "space.yaml", "trials"
# Reported metrics worth carrying into an exported file's provenance (the ones a re-run is compared on).
EPOCH_KEYS = ("train_loss", "val_loss", "val_acc", "val_bpb", "samples_per_s", "tokens_per_s", "num_params")


@dataclass
class TrialRecord:
    trial_id: str
    name: str
    status: str  # completed | early_stopped | failed | running | pending
    params: dict
    epochs_run: int
    metrics: dict = field(default_factory=dict)  # the last reported result
    error: str | None = None

    @property
    def mlflow_run_id(self) -> str | None:
        return self.metrics.get("mlflow_run_id") or None


def record_from_trial(trial, epochs: int, *, finished: bool = False) -> TrialRecord:
    """A Tune `Trial` (live, in callbacks, or restored from the experiment state) as a TrialRecord. `finished`:
    the trial has just completed (Tune calls `on_trial_complete` before it marks the trial TERMINATED)."""
    result = dict(trial.last_result or {})
    epochs_run = int(result.get("epoch", 0) or 0)
    error = None
    if trial.status == "ERROR":
        status, error = "failed", error_summary(trial.get_error())
    elif trial.status == "TERMINATED" or finished:
        if result.get("diverged"):
            status, error = "failed", result.get("error")
        else:
            status = "completed" if epochs_run >= epochs else "early_stopped"
    elif trial.status in ("RUNNING", "PAUSED"):
        status = "running"
    else:
        status = "pending"
    return TrialRecord(trial.trial_id, str(trial), status, dict(trial.config or {}), epochs_run, result, error)


def load_records(study_dir: Path) -> list[TrialRecord]:
    from ray.tune import ExperimentAnalysis

    study_meta(study_dir)  # a clear error when the folder is not a study
    epochs = _space_epochs(study_dir)
    try:
        analysis = ExperimentAnalysis(str(study_dir))
    except Exception as exc:  # noqa: BLE001 - no (readable) experiment state
        raise UserError(f"{study_dir}: no Ray Tune experiment state to read ({type(exc).__name__}); "
                        "has the study started?") from None
    records = [record_from_trial(t, epochs) for t in analysis.trials]
    return sorted(records, key=lambda r: r.trial_id)


def trial_results(study_dir: Path) -> dict[str, list[dict]]:
    """Every result each trial reported, in order: the JSON lines Ray Tune keeps in each trial's folder."""
    trials: dict[str, list[dict]] = {}
    for path in sorted(Path(study_dir).glob("*/result.json")):
        rows = []
        for line in path.read_text().splitlines():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:  # a line cut short by a crash
                continue
        if rows:
            trials.setdefault(rows[0]["trial_id"], []).extend(rows)
    return trials


def study_meta(study_dir: Path) -> dict:
    path = Path(study_dir) / STUDY_FILE
    if not path.is_file():
        raise UserError(f"{study_dir}: not a study folder (no {STUDY_FILE}); give the folder `lapstudy run` created")
    return json.loads(path.read_text())


def _space_epochs(study_dir: Path) -> int:
    from study.space import parse_space

    return parse_space(load_yaml(Path(study_dir) / SPACE_FILE, "search space")).epochs


def error_summary(text: str | None) -> str:
    """The last `SomeError: message` line of a traceback text (what a person needs in a table)."""
    if not text:
        return "unknown error"
    lines = [line.strip() for line in str(text).splitlines() if line.strip()]
    pattern = re.compile(r"^[\w.]*(Error|Exception|Exit|Interrupt)\b.*")
    for line in reversed(lines):
        if pattern.match(line):
            return line[:500]
    return lines[-1][:500] if lines else "unknown error"


def _value(record: TrialRecord, metric: str) -> float:
    value = record.metrics.get(metric)
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else math.nan


def best_records(records, metrics: list[str], modes: list[str], *, include_running=False) -> list[TrialRecord]:
    """Single objective: trials that ran every epoch, best first. Several: their Pareto set (non-dominated)."""
    allowed = {"completed", "running", "early_stopped"} if include_running else {"completed"}
    pool = [r for r in records if r.status in allowed and all(math.isfinite(_value(r, m)) for m in metrics)]
    signs = [1.0 if mode == "max" else -1.0 for mode in modes]
    if len(metrics) == 1:
        return sorted(pool, key=lambda r: -signs[0] * _value(r, metrics[0]))
    scores = {r.trial_id: [s * _value(r, m) for s, m in zip(signs, metrics)] for r in pool}

    def dominated(a):
        return any(all(x >= y for x, y in zip(scores[b.trial_id], scores[a.trial_id]))
                   and any(x > y for x, y in zip(scores[b.trial_id], scores[a.trial_id])) for b in pool)

    return sorted([r for r in pool if not dominated(r)], key=lambda r: -scores[r.trial_id][0])


def format_params(params: dict) -> str:
    return ", ".join(f"{k}={_short(v)}" for k, v in params.items())


def format_metrics(record: TrialRecord, metrics: list[str]) -> str:
    parts = [f"{m} {_value(record, m):.4f}" for m in metrics if m in record.metrics]
    return ", ".join(parts + [f"{record.epochs_run} epochs"])


def _short(value) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def table(records: list[TrialRecord], metrics: list[str]) -> str:
    """Trials as a fixed-width table: id, status, epochs, metrics, error or params."""
    names = sorted({k for r in records for k in r.params})
    header = ["trial", "status", "epochs", *metrics, *names]
    rows = [header]
    for r in records:
        values = [r.trial_id, r.status, str(r.epochs_run)]
        values += [f"{_value(r, m):.4f}" if m in r.metrics else "-" for m in metrics]
        values += [_short(r.params[n]) if n in r.params else "-" for n in names]
        rows.append(values)
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines = ["  ".join(v.ljust(w) for v, w in zip(row, widths)).rstrip() for row in rows]
    errors = [f"  {r.trial_id}: {r.error}" for r in records if r.error]
    return "\n".join(lines + (["errors:"] + errors if errors else []))


def summary(records: list[TrialRecord], space, study_dir: Path, top: int = 5) -> str:
    counts = {s: sum(r.status == s for r in records) for s in ("completed", "early_stopped", "failed")}
    best = best_records(records, space.metrics, space.modes)
    title = "Pareto set" if space.multi_objective else f"best {min(top, len(best))} by {space.metrics[0]}"
    lines = [f"\nstudy {study_dir.name}: {len(records)} trials, {counts['completed']} completed, "
             f"{counts['early_stopped']} stopped early, {counts['failed']} failed"]
    if best:
        lines += [f"{title}:", table(best if space.multi_objective else best[:top], space.metrics)]
    else:
        lines.append("no trial completed every epoch")
    folder = str(study_dir)
    lines += ["next:", f"  lapstudy status {folder}", f"  lapstudy export {folder} --top 3",
              f"  lapstudy ui {folder}      (MLflow UI: compare trials on {', '.join(space.metrics)} and geometry)"]
    return "\n".join(lines)


def export(study_dir: Path, top: int, out_dir: Path | None) -> list[Path]:
    """Write the `top` best trials (or the Pareto set) as run configs that `lapstudy train` re-runs."""
    from study.space import parse_space

    study_dir = Path(study_dir).resolve()
    meta = study_meta(study_dir)
    space = parse_space(load_yaml(study_dir / SPACE_FILE, "search space"))
    if top < 1:
        raise UserError(f"--top: must be >= 1, got {top}")
    records = load_records(study_dir)
    best = best_records(records, space.metrics, space.modes)
    if not space.multi_objective:
        best = best[:top]
    if not best:
        raise UserError(f"{study_dir}: no trial completed every epoch yet; nothing to export")
    out_dir = Path(out_dir) if out_dir else study_dir / "exported"
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for rank, record in enumerate(best, start=1):
        config_path = study_dir / TRIALS_DIR / f"{record.trial_id}.yaml"
        if not config_path.is_file():
            raise UserError(f"{config_path}: the trial's run config is missing from the study folder")
        document = load_yaml(config_path, "trial config")
        document["provenance"] = {
            "study": meta["name"],
            "trial_id": record.trial_id,
            "trial_name": record.name,
            "mlflow_experiment": meta["name"],
            "mlflow_run_id": record.mlflow_run_id,
            "metric": dict(zip(space.metrics, space.modes)),
            "value": {m: _value(record, m) for m in space.metrics},
            "rank": rank,
            "pareto": space.multi_objective,
            "epochs_run": record.epochs_run,
            "final_metrics": {k: record.metrics[k] for k in EPOCH_KEYS if k in record.metrics},
            "exported_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        }
        kind = "pareto" if space.multi_objective else "top"
        path = out_dir / f"{kind}{rank:02d}_{record.trial_id}.yaml"
        path.write_text(f"# lapstudy run config: re-run with `lapstudy train {path.name}`\n" + dump_yaml(document))
        written.append(path)
    return written
