"""`lapstudy eval CONFIG_OR_RUN --tasks ...`: check the command line, load the run's model, evaluate, print and log.

Every check that needs no model comes first (the flags, the HumanEval flag, whether each task can be found or its
data reached), so a mistake costs no model loading and runs nothing. The flags that an `evaluate:` entry also has are
checked as one (study/evals/spec.py), named as flags."""

from __future__ import annotations

import re
import time

from study.errors import UserError, validate_flags
from study.evals.evaluate import check_tasks, evaluate_model, require_harness
from study.evals.load import load_model
from study.evals.spec import HARNESS_EXAMPLES, OWN_TASKS, EvaluationSpec, check_humaneval_allowed

EXPERIMENT = "lapstudy-eval"


def parse_tasks(text: str) -> list[str]:
    tasks = [t.strip() for t in text.split(",") if t.strip()]
    bad = [t for t in tasks if not re.fullmatch(r"[A-Za-z0-9_.\-]+", t)]
    if not tasks or bad:
        raise UserError(f"--tasks {text!r}: expected comma-separated task names, e.g. "
                        f"{','.join(HARNESS_EXAMPLES + OWN_TASKS)}")
    return list(dict.fromkeys(tasks))


def evaluation_of(args, tasks: list[str]) -> EvaluationSpec:
    """The flags an `evaluate:` entry also has, checked by its rules; a refusal names the flags (--num-samples for
    num_samples)."""
    flags = {name: f"--{name.replace('_', '-')}" for name in EvaluationSpec.model_fields}
    entry = {name: getattr(args, name) for name in flags if name != "tasks"}
    entry["include_path"] = [str(folder) for folder in entry["include_path"]]
    return validate_flags(EvaluationSpec, {"tasks": tasks, **entry}, flags)


def check_flags(args) -> list[str]:
    tasks = parse_tasks(args.tasks)
    evaluation_of(args, tasks)
    if args.batch_size < 1:
        raise UserError(f"--batch-size: must be >= 1, got {args.batch_size}")
    check_humaneval_allowed(tasks, args.allow_code_execution, "--")  # before the model is loaded
    if args.run_id and not args.tracking_uri:
        raise UserError("--run-id: needs --tracking-uri (the server that holds the run)")
    for folder in args.include_path:
        if not folder.is_dir():
            raise UserError(f"--include-path: {folder} is not a folder")
    if not re.fullmatch(r"cpu|cuda(:\d+)?|mps", args.device):
        raise UserError(f"--device: expected cpu, cuda, cuda:N or mps, got {args.device!r}")
    return tasks


def run_eval(args) -> int:
    require_harness("lapstudy eval")
    tasks = check_flags(args)
    check_tasks(tasks, args.include_path)  # fails fast (offline, unknown) before the model is loaded
    model, tokenizer, spec = load_model(args.run, args.checkpoint, device=args.device)
    print(f"evaluating {args.run} ({tokenizer.name} tokens, context {model.config.context_length}) on "
          f"{', '.join(tasks)}", flush=True)
    start = time.time()
    metrics = evaluate_model(model, tokenizer, tasks, include_path=args.include_path, limit=args.limit,
                             allow_code_execution=args.allow_code_execution, num_samples=args.num_samples,
                             temperature=args.temperature, num_fewshot=args.num_fewshot, batch_size=args.batch_size,
                             apply_chat_template=args.chat, seed=spec.seed)
    for name, value in metrics.items():
        print(f"{name}: {value:.6f}")
    print(f"({time.time() - start:.1f} s)", flush=True)
    if args.tracking_uri:
        run_id = log_metrics(metrics, args.tracking_uri, args.run_id, params={
            "eval_tasks": ",".join(tasks), "eval_limit": args.limit, "eval_num_samples": args.num_samples,
            "eval_temperature": args.temperature, "eval_run": str(args.run)})
        print(f"logged to MLflow run {run_id}", flush=True)
    return 0


def log_metrics(metrics: dict[str, float], tracking_uri: str, run_id: str | None, params: dict | None = None) -> str:
    """Log `metrics` into MLflow run `run_id` (None: a new run of experiment lapstudy-eval, with `params`)."""
    from mlflow import MlflowClient
    from mlflow.entities import Metric, Param

    client = MlflowClient(tracking_uri)
    if run_id is None:
        experiment = client.get_experiment_by_name(EXPERIMENT)
        experiment_id = experiment.experiment_id if experiment else client.create_experiment(EXPERIMENT)
        run_id = client.create_run(experiment_id).info.run_id
        client.log_batch(run_id, params=[Param(k, str(v)) for k, v in (params or {}).items()])
        finish = True
    else:
        try:
            client.get_run(run_id)
        except Exception as error:
            raise UserError(f"--run-id: no run {run_id} at {tracking_uri} ({type(error).__name__})") from None
        finish = False
    now = int(time.time() * 1000)
    client.log_batch(run_id, metrics=[Metric(k, float(v), now, 0) for k, v in metrics.items()])
    if finish:
        client.set_terminated(run_id)
    return run_id
