"""`lapstudy export`: the best trials (or the Pareto set) as run configs that `lapstudy train` re-runs exactly."""

from __future__ import annotations

from datetime import datetime, timezone
from pathlib import Path

from study.errors import UserError
from study.folder import EXPORT_DIR, StudyFolder
from study.results import best_configurations, configurations, load_records, metric_value
from study.tasks import task_class
from study.yamlio import dump_yaml, load_yaml


def export(folder: StudyFolder, top: int, out_dir: Path | None) -> list[tuple[Path, dict]]:
    """Write the `top` best configurations (or the Pareto set), ranked by their mean over the replicates, as run
    configs: each is its first replicate's, with every replicate's value in the provenance. Returns (path,
    provenance) of each file, best first."""
    record = folder.record()
    space = folder.space()
    best = best_configurations(configurations(load_records(folder)), space.metrics, space.modes)
    if not space.multi_objective:
        best = best[:top]
    if not best:
        raise UserError(f"{folder.location}: no configuration completed every epoch of every replicate yet; "
                        "nothing to export")
    out_dir = out_dir or folder.path / EXPORT_DIR
    out_dir.mkdir(parents=True, exist_ok=True)
    # The metrics every epoch reports go into the provenance: a re-run is compared with them.
    epoch_metrics = task_class(space.task).epoch_metrics(space.dataset)
    written = []
    for rank, configuration in enumerate(best, start=1):
        trial = configuration.trials[0]
        config_path = folder.trial_config(trial.trial_id)
        if not config_path.is_file():
            raise UserError(f"{config_path}: the trial's run config is missing from the study folder")
        document = load_yaml(config_path, "trial config")
        document["provenance"] = {
            "study": record.name,
            "trial_id": trial.trial_id,
            "trial_name": trial.name,
            "mlflow_experiment": record.name,
            "mlflow_run_id": trial.mlflow_run_id,
            "metric": dict(zip(space.metrics, space.modes)),
            "value": {m: metric_value(trial, m) for m in space.metrics},
            "rank": rank,
            "pareto": space.multi_objective,
            "epochs_run": trial.epochs_run,
            "final_metrics": {k: trial.metrics[k] for k in epoch_metrics if k in trial.metrics},
            "exported_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        }
        if len(configuration.trials) > 1:
            summaries = {m: configuration.summary(m) for m in space.metrics}
            document["provenance"]["configuration"] = {
                "config_id": configuration.config_id,
                "mean": {m: summary.mean for m, summary in summaries.items()},
                "std": {m: summary.std for m, summary in summaries.items()},
                "n": min(summary.n for summary in summaries.values()),
                "replicates": [{"trial_id": t.trial_id, "seed": t.seed,
                                "value": {m: metric_value(t, m) for m in space.metrics}}
                               for t in configuration.trials],
            }
        kind = "pareto" if space.multi_objective else "top"
        path = out_dir / f"{kind}{rank:02d}_{trial.trial_id}.yaml"
        path.write_text(f"# lapstudy run config: re-run with `lapstudy train {path.name}`\n" + dump_yaml(document))
        written.append((path, document["provenance"]))
    return written
