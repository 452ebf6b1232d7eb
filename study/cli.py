"""The `lapstudy` command line: run, status, report, export, train, eval, sync, ui.

Paths are resolved once, here: relative to the working folder, `~` expanded, trailing slashes ignored (a URI in
object storage must name its bucket). User mistakes (a bad space, config or flag, an unreachable cluster, bucket or
tracking server) print one line on stderr that names the field and what it allows, and exit with code 2 before
anything is started or written.

Each command imports what it needs when it runs: `--help`, `--version` and a mistaken command line answer at once,
without loading torch, Ray and MLflow; `run` and `train` check the space or run config (study/precheck.py: torch
for the model's rules, nothing heavier) before they load Ray, MLflow, Optuna and matplotlib.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from pathlib import Path

from study.errors import UserError, validate_flags

EXIT_USER_ERROR = 2
# The cluster's tracking server, set on the head by cluster.yaml and k8s/rayjob.yaml: the default of --tracking-uri.
TRACKING_URI_VARIABLE = "LAPSTUDY_TRACKING_URI"


class _Parser(argparse.ArgumentParser):
    def __init__(self, *args, **kwargs):
        # No abbreviated flags: `--resum` must be an error, not a --resume.
        super().__init__(*args, **{**kwargs, "allow_abbrev": False})

    def error(self, message):  # argparse's usage block + message would be several lines
        raise UserError(f"{self.prog}: {message} (see {self.prog} --help)")


def user_path(text: str) -> Path:
    """A path as a user types it (relative, `~`, a trailing slash), absolute from here on."""
    return Path(os.path.expanduser(text)).resolve()


def user_location(argument: str):
    """The argparse type of a location given as `argument`: a local folder (as `user_path`) or a URI in object
    storage (s3://BUCKET/PREFIX, gs://...), kept as given; one that names no bucket is a UserError."""
    from study.storage import check_location, is_remote

    def location(text: str) -> str:
        text = check_location(text, argument)
        return text if is_remote(text) else str(user_path(text))

    return location


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("lapstudy")
    except PackageNotFoundError:  # run from a checkout that was never installed
        return "unknown (not installed)"


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="lapstudy", description="Ray Tune + Optuna studies of Laplacian-head and STLT Transformers.")
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    commands = parser.add_subparsers(dest="command", required=True, parser_class=_Parser, metavar="COMMAND")

    run = commands.add_parser("run", help="run (or --resume) a study of a search space",
                              description="Run a study: Ray Tune trials sampled by Optuna, each a Ray Train job, "
                                          "every trial an MLflow run.")
    run.add_argument("space", type=user_path, metavar="SPACE.yaml",
                     help="the search space (see search_spaces/ and docs/study.md)")
    run.add_argument("--name", help="study name (default: the space's name); names the folder and the experiment")
    run.add_argument("--storage", type=user_location("--storage"), default="studies", metavar="DIR_OR_URI",
                     help="parent folder of the study folder (default: ./studies); on a cluster, object storage "
                          "(s3://BUCKET/PREFIX, gs://BUCKET/PREFIX; needs --tracking-uri) or a filesystem every node "
                          "mounts")
    run.add_argument("--num-samples", type=int, metavar="N", help="trials to run (default: the space's num_samples)")
    run.add_argument("--max-concurrent", type=int, metavar="N", help="trials at a time (default: as many as fit)")
    run.add_argument("--workers-per-trial", type=int, default=1, metavar="N", help="Ray Train workers per trial")
    run.add_argument("--cpus-per-worker", type=float, default=1.0, metavar="F")
    run.add_argument("--gpus-per-worker", type=float, default=0.0, metavar="F")
    run.add_argument("--address", help="join a running Ray cluster (e.g. auto) instead of starting a local one")
    run.add_argument("--tracking-uri", metavar="URI", default=os.environ.get(TRACKING_URI_VARIABLE) or None,
                     help=f"MLflow tracking server (default: ${TRACKING_URI_VARIABLE} where set, as on the cluster's "
                          "head, else SQLite in the study folder)")
    run.add_argument("--seed", type=int, help="study seed (default: the space's seed)")
    run.add_argument("--max-failures", type=int, default=2, metavar="N",
                     help="retries of a trial's workers (and of the trial) after a crash or a lost node")
    run.add_argument("--resume", action="store_true", help="continue the study in the study folder after a crash")
    run.add_argument("--dry-run", action="store_true",
                     help="check the space and print what each trial would train (stages, models with their "
                          "parameter counts, steps, resources), then stop: no Ray, no data read")
    run.add_argument("--worker-resource", action="append", default=[], metavar="NAME=AMOUNT",
                     help="a custom Ray resource each Train worker asks for, to place workers on a kind of node "
                          "(repeatable; e.g. spot=1 when cluster.yaml gives spot nodes that resource)")
    run.add_argument("--allow-code-execution", action="store_true",
                     help="let the space's HumanEval benchmark run model-generated code (each sample in a limited "
                          "subprocess, docs/evals.md); a space that asks for HumanEval is refused without it")

    sync = commands.add_parser("sync", help="send MLflow what Ray recorded while the tracking server was away",
                               description="Bring a study's MLflow runs up to date with Ray's records (the source "
                                           "of truth): missing epochs, runs never created, final statuses.")
    sync.add_argument("study_dir", type=user_location("STUDY_DIR"), metavar="STUDY_DIR")
    sync.add_argument("--tracking-uri", metavar="URI", help="the study's tracking server, with credentials if it "
                      "needs them (default: the one in study.json)")

    status = commands.add_parser("status", help="the trials of a study as a table")
    status.add_argument("study_dir", type=user_location("STUDY_DIR"), metavar="STUDY_DIR",
                        help="the study folder, or its URI in object storage")
    status.add_argument("--json", action="store_true", help="print the study and its trials as one JSON document")

    report = commands.add_parser("report", help="write the study's report (HTML with its figures) and log it to MLflow",
                                 description="The study's report: the best configurations with their replicates' "
                                             "mean and spread, differences to the baseline, the metric against the "
                                             "geometry, figures. Written to STUDY_DIR/report/report.html.")
    report.add_argument("study_dir", type=user_location("STUDY_DIR"), metavar="STUDY_DIR")

    export = commands.add_parser("export", help="write the best trials (or the Pareto set) as run configs")
    export.add_argument("study_dir", type=user_location("STUDY_DIR"), metavar="STUDY_DIR")
    export.add_argument("--top", type=int, default=1, metavar="K", help="how many of the best trials (default 1)")
    export.add_argument("--out", type=user_path, metavar="DIR", help="output folder (default: STUDY_DIR/exported; "
                        "./exported/NAME for a study in object storage)")
    export.add_argument("--json", action="store_true", help="print what was written as one JSON document (each "
                        "file with its rank, trial and values) instead of one path a line")
    export.add_argument("--register", action="store_true", help="also log the best trial's trained model to its "
                        "MLflow run (with a signature) and register it in MLflow's model registry under the study's "
                        "name")

    train = commands.add_parser("train", help="one run of a run config through the same Ray Train loop")
    train.add_argument("config", type=user_path, metavar="CONFIG.yaml")
    train.add_argument("--storage", type=user_location("--storage"), default="studies/train", metavar="DIR_OR_URI",
                       help="folder for the run and its MLflow store (default: ./studies/train), or object storage "
                            "(s3://BUCKET/PREFIX, gs://...; needs --tracking-uri)")
    train.add_argument("--tracking-uri", metavar="URI", default=os.environ.get(TRACKING_URI_VARIABLE) or None,
                       help=f"MLflow tracking server (default: ${TRACKING_URI_VARIABLE} where set, else SQLite in "
                            "--storage)")
    train.add_argument("--address", help="join a running Ray cluster instead of starting a local one")
    train.add_argument("--workers", type=int, help="override the config's workers (exact reproduction needs the same)")
    train.add_argument("--cpus-per-worker", type=float)
    train.add_argument("--gpus-per-worker", type=float)
    train.add_argument("--allow-code-execution", action="store_true",
                       help="let the config's HumanEval benchmark run model-generated code (each sample in a limited "
                            "subprocess); a config that asks for HumanEval is refused without it")

    evaluate = commands.add_parser(
        "eval", help="benchmark a trained language model (lm-evaluation-harness tasks, HumanEval)",
        description="Evaluate a run's language model on ARC, MMLU, GSM8K (lm-evaluation-harness) and HumanEval (its "
                    "generated code run in a sandbox, only with --allow-code-execution); prints eval_<task>_<metric> "
                    "and logs them to MLflow with --tracking-uri. See docs/evals.md.")
    evaluate.add_argument("run", type=user_path, metavar="CONFIG_OR_RUN",
                          help="a run config (exported or from lapstudy train) or a run folder")
    evaluate.add_argument("--checkpoint", type=user_path, metavar="PATH",
                          help="state.pt, a checkpoint_* folder or a run folder (default: found beside the config)")
    evaluate.add_argument("--tasks", required=True, metavar="T1,T2",
                          help="comma-separated: arc_easy, arc_challenge, mmlu, gsm8k, humaneval, gsm8k_chat "
                               "(nanochat's GSM8K: sampled with the calculator tool, pass@k) or any lm_eval task")
    evaluate.add_argument("--include-path", type=user_path, action="append", default=[], metavar="DIR",
                          help="a folder of lm_eval task configs (and humaneval.jsonl, or GSM8K's main/test-*.parquet) "
                               "over local data; its tasks "
                               "take precedence over the harness's (repeatable; the way to evaluate offline)")
    evaluate.add_argument("--limit", type=int, metavar="N", help="the first N examples of each task")
    evaluate.add_argument("--num-fewshot", type=int, metavar="N", help="few-shot examples (default: each task's)")
    evaluate.add_argument("--allow-code-execution", action="store_true",
                          help="let HumanEval run model-generated code (each sample in a limited subprocess)")
    evaluate.add_argument("--num-samples", type=int, default=1, metavar="K",
                          help="samples per problem of humaneval and gsm8k_chat: pass@1, and pass@10 with 10 or more "
                               "(default 1)")
    evaluate.add_argument("--temperature", type=float, default=0.0, metavar="T",
                          help="their sampling temperature (default 0: greedy; > 0 needed with --num-samples > 1)")
    evaluate.add_argument("--chat", action="store_true", help="format prompts as a chat (apply_chat_template)")
    evaluate.add_argument("--batch-size", type=int, default=16, metavar="N")
    evaluate.add_argument("--device", default="cpu", help="torch device (default cpu; e.g. cuda)")
    evaluate.add_argument("--tracking-uri", metavar="URI", help="log the metrics to this MLflow server")
    evaluate.add_argument("--run-id", metavar="ID", help="the MLflow run to log into (default: a new run in "
                          "experiment lapstudy-eval); needs --tracking-uri")

    ui = commands.add_parser("ui", help="the MLflow UI over a study's store")
    ui.add_argument("study_dir", type=user_path, metavar="STUDY_DIR")
    ui.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1: this machine only)")
    ui.add_argument("--port", type=int, default=5000)
    return parser


def main(argv: list[str] | None = None) -> int:
    from models.errors import ConfigError  # costs no torch (models/__init__.py imports on first use)
    from study.mlflow_settings import use_mlflow_client_settings

    use_mlflow_client_settings()
    try:
        return _dispatch(build_parser().parse_args(argv))
    except (UserError, ConfigError) as exc:
        print(f"lapstudy: error: {' '.join(str(exc).split())}", file=sys.stderr)
        return EXIT_USER_ERROR
    except KeyboardInterrupt:
        print("lapstudy: interrupted; `lapstudy run SPACE.yaml --resume` continues a study", file=sys.stderr)
        return 130


def _dispatch(args) -> int:
    if args.command == "run":
        from study.precheck import RunOptions, check_study
        from study.runspec import Resources

        options = RunOptions(
            space=args.space, storage=args.storage, name=args.name,
            num_samples=_at_least(1, args.num_samples, "--num-samples"),
            max_concurrent=_at_least(1, args.max_concurrent, "--max-concurrent"),
            resources=Resources(**_worker_flags(args, "--workers-per-trial", args.workers_per_trial)),
            address=args.address, tracking_uri=args.tracking_uri, seed=args.seed, resume=args.resume,
            max_failures=_at_least(0, args.max_failures, "--max-failures"),
            worker_resources=_worker_resources(args.worker_resource),
            allow_code_execution=args.allow_code_execution,
        )
        space, name = check_study(options)  # before Ray, MLflow, Optuna and matplotlib are imported
        if args.dry_run:
            from study.dry_run import describe_study

            print(describe_study(space, name, options))
            return 0

        from study.driver import run_study

        return run_study(options, space, name)
    if args.command == "train":
        from study.precheck import check_run

        spec = check_run(args.config, args.storage, _worker_flags(args, "--workers", args.workers),
                         allow_code_execution=args.allow_code_execution)

        from study.train import train_once

        return train_once(args.config, spec, storage=args.storage, tracking_uri=args.tracking_uri,
                          address=args.address, allow_code_execution=args.allow_code_execution)
    if args.command == "sync":
        from study.sync import sync_study

        return sync_study(_read_study(args.study_dir), args.tracking_uri)
    if args.command == "status":
        from study.results import status, status_document

        folder = _read_study(args.study_dir)
        print(json.dumps(status_document(folder), indent=2) if args.json else status(folder))
        return 0
    if args.command == "report":
        from study.report import REPORT_DIR, write_report

        folder = _read_study(args.study_dir)
        print(write_report(folder))
        folder.push(REPORT_DIR)
        return 0
    if args.command == "export":
        from study.export import export

        top = _at_least(1, args.top, "--top")
        folder = _read_study(args.study_dir)
        out = args.out or (Path.cwd() / "exported" / folder.name if folder.remote else None)
        written = export(folder, top, out)
        registered = None
        if args.register:
            from study.register import register_best

            best = written[0][1]
            registered = register_best(folder, best["trial_id"], best["mlflow_run_id"],
                                       folder.record().tracking_uri, folder.name)
        if args.json:
            from study.results import json_number

            print(json.dumps({"study": folder.location, "exported": [
                {"path": str(path), "rank": provenance["rank"], "trial_id": provenance["trial_id"],
                 "value": {m: json_number(v) for m, v in provenance["value"].items()}}
                for path, provenance in written], **({"registered": {
                    "name": registered.name, "version": int(registered.version), "run_id": registered.run_id,
                    "uri": f"models:/{registered.name}/{registered.version}"}} if registered else {})}, indent=2))
        else:
            for path, _ in written:
                print(path)
            if registered:
                print(f"registered {registered.name} version {registered.version} "
                      f"(models:/{registered.name}/{registered.version}) from trial {written[0][1]['trial_id']}")
        return 0
    if args.command == "eval":
        from study.evals.cli import run_eval

        return run_eval(args)
    return _ui(args.study_dir, args.host, args.port)


def _read_study(location: str):
    """The study at `location`; one in object storage pulled into a local copy of its own first."""
    from study.folder import StudyFolder
    from study.storage import check_reachable

    check_reachable(location, "STUDY_DIR")
    return StudyFolder.at(location, reading=True).pull()


def _ui(study_dir: Path, host: str, port: int) -> int:
    from study.folder import StudyFolder, local_store

    record = StudyFolder(study_dir).record()
    tracking_uri, _ = local_store(study_dir)
    if record.tracking_uri != tracking_uri:
        raise UserError(f"{study_dir}: this study logs to {record.tracking_uri}; open that server's UI instead")
    if not 0 < port < 65536:
        raise UserError(f"--port: must be in 1..65535, got {port}")
    print(f"MLflow UI for study {record.name} at http://{host}:{port} (Ctrl-C to stop)", flush=True)
    # MLflow's job runner (GenAI judges and scorers, a process of its own) has nothing to do for a study's runs and
    # delayed the UI's first answer by half.
    os.environ.setdefault("MLFLOW_SERVER_ENABLE_JOB_EXECUTION", "false")
    command = [sys.executable, "-m", "mlflow", "ui", "--backend-store-uri", tracking_uri, "--host", host,
               "--port", str(port), "--workers", "1"]
    os.execv(sys.executable, command)
    return 0


def _worker_flags(args, workers_flag: str, workers: int | None) -> dict:
    """The worker flags given (None: not given; `workers_flag` sets `workers`), checked by the rules of the run
    config's `resources:` (runspec.Resources), a refusal naming the flag as the user typed it."""
    from study.runspec import Resources

    flags = {"workers": workers_flag, "cpus_per_worker": "--cpus-per-worker", "gpus_per_worker": "--gpus-per-worker"}
    given = {"workers": workers, "cpus_per_worker": args.cpus_per_worker, "gpus_per_worker": args.gpus_per_worker}
    given = {name: value for name, value in given.items() if value is not None}
    validate_flags(Resources, given, flags)
    return given


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


def _at_least(low, value, flag):
    if value is not None and value < low:
        raise UserError(f"{flag}: must be >= {low:g}, got {value:g}")
    return value


if __name__ == "__main__":
    sys.exit(main())
