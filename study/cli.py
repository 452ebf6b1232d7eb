"""The `lapstudy` command line: run, status, export, train, ui.

User mistakes (a bad space, config or flag, an unreachable cluster or tracking server) print one line on stderr
that names the field and what it allows, and exit with code 2 before anything is started or written.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from pathlib import Path

from study.errors import UserError

EXIT_USER_ERROR = 2


class _Parser(argparse.ArgumentParser):
    def __init__(self, *args, **kwargs):
        # No abbreviated flags: `--resum` must be an error, not a --resume.
        super().__init__(*args, **{**kwargs, "allow_abbrev": False})

    def error(self, message):  # argparse's usage block + message would be several lines
        raise UserError(f"{self.prog}: {message} (see {self.prog} --help)")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="lapstudy", description="Ray Tune + Optuna studies of Laplacian-head and STLT Transformers.")
    commands = parser.add_subparsers(dest="command", required=True, parser_class=_Parser, metavar="COMMAND")

    run = commands.add_parser("run", help="run (or --resume) a study of a search space",
                              description="Run a study: Ray Tune trials sampled by Optuna, each a Ray Train job, "
                                          "every trial an MLflow run.")
    run.add_argument("space", metavar="SPACE.yaml", help="the search space (see search_spaces/ and docs/study.md)")
    run.add_argument("--name", help="study name (default: the space's name); names the folder and the experiment")
    run.add_argument("--storage", metavar="DIR", help="parent folder of the study folder (default: ./studies); on a "
                     "cluster, a filesystem every node mounts")
    run.add_argument("--num-samples", type=int, metavar="N", help="trials to run (default: the space's num_samples)")
    run.add_argument("--max-concurrent", type=int, metavar="N", help="trials at a time (default: as many as fit)")
    run.add_argument("--workers-per-trial", type=int, default=1, metavar="N", help="Ray Train workers per trial")
    run.add_argument("--cpus-per-worker", type=float, default=1.0, metavar="F")
    run.add_argument("--gpus-per-worker", type=float, default=0.0, metavar="F")
    run.add_argument("--address", help="join a running Ray cluster (e.g. auto) instead of starting a local one")
    run.add_argument("--tracking-uri", metavar="URI", help="MLflow tracking server (default: SQLite in the study folder)")
    run.add_argument("--seed", type=int, help="study seed (default: the space's seed)")
    run.add_argument("--max-failures", type=int, default=2, metavar="N",
                     help="retries of a trial's workers (and of the trial) after a crash or a lost node")
    run.add_argument("--resume", action="store_true", help="continue the study in the study folder after a crash")
    run.add_argument("--worker-resource", action="append", default=[], metavar="NAME=AMOUNT",
                     help="a custom Ray resource each Train worker asks for, to place workers on a kind of node "
                          "(repeatable; e.g. spot=1 when cluster.yaml gives spot nodes that resource)")

    sync = commands.add_parser("sync", help="send MLflow what Ray recorded while the tracking server was away",
                               description="Bring a study's MLflow runs up to date with Ray's records (the source "
                                           "of truth): missing epochs, runs never created, final statuses.")
    sync.add_argument("study_dir", metavar="STUDY_DIR")
    sync.add_argument("--tracking-uri", metavar="URI", help="the study's tracking server, with credentials if it "
                      "needs them (default: the one in study.json)")

    status = commands.add_parser("status", help="the trials of a study as a table")
    status.add_argument("study_dir", metavar="STUDY_DIR")

    export = commands.add_parser("export", help="write the best trials (or the Pareto set) as run configs")
    export.add_argument("study_dir", metavar="STUDY_DIR")
    export.add_argument("--top", type=int, default=1, metavar="K", help="how many of the best trials (default 1)")
    export.add_argument("--out", metavar="DIR", help="output folder (default: STUDY_DIR/exported)")

    train = commands.add_parser("train", help="one run of a run config through the same Ray Train loop")
    train.add_argument("config", metavar="CONFIG.yaml")
    train.add_argument("--storage", metavar="DIR", help="folder for the run and its MLflow store (default: ./studies/train)")
    train.add_argument("--tracking-uri", metavar="URI", help="MLflow tracking server (default: SQLite in --storage)")
    train.add_argument("--address", help="join a running Ray cluster instead of starting a local one")
    train.add_argument("--workers", type=int, help="override the config's workers (exact reproduction needs the same)")
    train.add_argument("--cpus-per-worker", type=float)
    train.add_argument("--gpus-per-worker", type=float)

    ui = commands.add_parser("ui", help="the MLflow UI over a study's store")
    ui.add_argument("study_dir", metavar="STUDY_DIR")
    ui.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1: this machine only)")
    ui.add_argument("--port", type=int, default=5000)
    return parser


def main(argv: list[str] | None = None) -> int:
    from pydantic import ValidationError

    from models import ConfigError
    from study.errors import describe_validation_error

    try:
        return _dispatch(build_parser().parse_args(argv))
    except (UserError, ConfigError) as exc:
        print(f"lapstudy: error: {' '.join(str(exc).split())}", file=sys.stderr)
        return EXIT_USER_ERROR
    except ValidationError as exc:
        print(f"lapstudy: error: {describe_validation_error(exc)}", file=sys.stderr)
        return EXIT_USER_ERROR
    except KeyboardInterrupt:
        print("lapstudy: interrupted; `lapstudy run SPACE.yaml --resume` continues a study", file=sys.stderr)
        return 130


def _dispatch(args) -> int:
    if args.command == "run":
        from study.tuning import RunOptions, run_study

        return run_study(RunOptions(
            space=args.space, name=args.name, storage=args.storage, num_samples=args.num_samples,
            max_concurrent=_positive(args.max_concurrent, "--max-concurrent"),
            workers_per_trial=args.workers_per_trial, cpus_per_worker=args.cpus_per_worker,
            gpus_per_worker=args.gpus_per_worker, address=args.address, tracking_uri=args.tracking_uri,
            seed=args.seed, resume=args.resume, max_failures=_non_negative(args.max_failures, "--max-failures"),
            worker_resources=_worker_resources(args.worker_resource),
        ))
    if args.command == "sync":
        from study.tuning import sync_study

        return sync_study(Path(args.study_dir), args.tracking_uri)
    if args.command == "status":
        from study import results

        study_dir = Path(args.study_dir)
        meta = results.study_meta(study_dir)
        records = results.load_records(study_dir)
        print(f"study {meta['name']} ({study_dir}): {len(records)} of {meta['num_samples']} trials started")
        print(results.table(records, meta["metric"]))
        return 0
    if args.command == "export":
        from study import results

        for path in results.export(Path(args.study_dir), args.top, Path(args.out) if args.out else None):
            print(path)
        return 0
    if args.command == "train":
        from study.rerun import train_once

        return train_once(args.config, storage=args.storage, tracking_uri=args.tracking_uri, address=args.address,
                          workers=args.workers, cpus_per_worker=args.cpus_per_worker,
                          gpus_per_worker=args.gpus_per_worker)
    return _ui(Path(args.study_dir), args.host, args.port)


def _ui(study_dir: Path, host: str, port: int) -> int:
    from study import results
    from study.tracking import local_store

    meta = results.study_meta(study_dir)
    tracking_uri, _ = local_store(study_dir)
    if meta["tracking_uri"] != tracking_uri:
        raise UserError(f"{study_dir}: this study logs to {meta['tracking_uri']}; open that server's UI instead")
    if not 0 < port < 65536:
        raise UserError(f"--port: must be in 1..65535, got {port}")
    print(f"MLflow UI for study {meta['name']} at http://{host}:{port} (Ctrl-C to stop)", flush=True)
    os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
    command = [sys.executable, "-m", "mlflow", "ui", "--backend-store-uri", tracking_uri, "--host", host,
               "--port", str(port), "--workers", "1"]
    os.execv(sys.executable, command)
    return 0


def _worker_resources(items: list[str]) -> dict[str, float]:
    from study.resources import STANDARD_RESOURCES

    resources = {}
    for item in items:
        name, equals, amount = item.partition("=")
        try:
            value = float(amount) if equals else float("nan")
        except ValueError:
            value = float("nan")
        if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_.-]*", name) or not value > 0 or name in STANDARD_RESOURCES:
            raise UserError(f"--worker-resource {item!r}: expected NAME=AMOUNT with a custom resource name (not "
                            f"{', '.join(sorted(STANDARD_RESOURCES))}: use the --*-per-worker flags) and AMOUNT > 0")
        resources[name] = value
    return resources


def _positive(value, flag):
    if value is not None and value < 1:
        raise UserError(f"{flag}: must be >= 1, got {value}")
    return value


def _non_negative(value, flag):
    if value < 0:
        raise UserError(f"{flag}: must be >= 0, got {value}")
    return value


if __name__ == "__main__":
    sys.exit(main())
