"""Evaluate a language model on benchmark tasks in-process: `evaluate_model` returns {"eval_<task>_<metric>": value}.

Every task but `humaneval` runs through lm-evaluation-harness (`lm_eval.simple_evaluate` over the `LapstudyLM`
adapter), with its task definitions: the harness's own, or YAML configs in `include_path` folders, which take
precedence over a harness task of the same name (so `--include-path` gives `arc_easy` over a local copy of the data).
A harness task reads its data from the Hugging Face hub; when the hub cannot be reached such a task fails before
anything runs, naming `--include-path`. `humaneval` runs through study/evals/humaneval.py (generation by the adapter,
execution by the sandbox), and only where the command line says `--allow-code-execution`; `gsm8k_chat`, GSM8K as
nanochat scores a chat model (sampled completions with the calculator tool, pass@k), through study/evals/gsm8k.py.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from pathlib import Path

from study.data.hub import hub_reachable
from study.errors import UserError
from study.evals import gsm8k
from study.evals.humaneval import evaluate_humaneval, find_problem_file, load_problems
from study.evals.load import tokenizer_for
from study.evals.sandbox import Limits
from study.evals.spec import (
    HARNESS_EXAMPLES,
    HUMANEVAL,
    OWN_TASKS,
    EvaluationSpec,
    check_humaneval_allowed,
    evaluations,
)


def require_harness(asker: str) -> None:
    """A UserError naming pyproject.toml's `lm` extra when lm-evaluation-harness is not installed: every evaluation
    runs through its model interface (study/evals/harness.py), and the laptop install (make quickstart) leaves it
    out."""
    try:
        import lm_eval  # noqa: F401
    except ImportError:
        raise UserError(f"{asker}: language-model evaluations need lm-evaluation-harness, which is not installed: "
                        "pip install 'lapstudy[lm]'") from None


def metric_name(task: str, metric: str, filter_name: str = "none") -> str:
    """eval_<task>_<metric>[_<filter>] in MLflow's alphabet (letters, digits, _): "acc,none" of arc_easy is
    eval_arc_easy_acc; "exact_match,strict-match" of gsm8k is eval_gsm8k_exact_match_strict_match."""
    parts = [task, metric] + ([filter_name] if filter_name not in ("none", "") else [])
    return "eval_" + "_".join(re.sub(r"[^A-Za-z0-9]+", "_", p).strip("_") for p in parts)


def harness_task_manager(names: Iterable[str], include_path: Iterable[Path] = (), include_defaults: bool = True):
    """lm_eval's TaskManager for `names`: over `include_path` alone when every name is defined there (no index of the
    harness's thousands of tasks, no hub), else with the harness's tasks, which read the hub: a UserError when it
    cannot be reached or a name is no task."""
    from lm_eval.tasks import TaskManager

    paths = [str(p) for p in include_path]
    local = TaskManager(include_path=paths, include_defaults=False) if paths else None
    rest = [n for n in names if local is None or n not in local.all_tasks]
    if not rest:
        return local
    hint = ("give --include-path DIR with a task config of that name over local data (lm_eval's YAML format; "
            "tests/fixtures/evals/ has examples; docs/evals.md)")
    if not include_defaults:
        raise UserError(f"--tasks {','.join(rest)}: not defined in --include-path ({', '.join(paths) or 'none'}); "
                        f"{hint}")
    reachable, why = hub_reachable()
    if not reachable:
        raise UserError(f"--tasks {','.join(rest)}: lm_eval's task{'s read' if len(rest) > 1 else ' reads'} its data "
                        f"from the Hugging Face hub, which cannot be reached ({why}); {hint}")
    manager = TaskManager(include_path=paths or None)
    unknown = [n for n in rest if n not in manager.all_tasks]
    if unknown:
        raise UserError(f"--tasks {','.join(unknown)}: no such lm_eval task (e.g. "
                        f"{', '.join(HARNESS_EXAMPLES + OWN_TASKS)}); see `lm_eval ls tasks` or --include-path")
    return manager


def evaluate_model(model, tokenizer, tasks: list[str], *, include_path: Iterable[Path] = (), limit: int | None = None,
                   allow_code_execution: bool = False, num_samples: int = 1, temperature: float = 0.0,
                   num_fewshot: int | None = None, batch_size: int = 16, apply_chat_template: bool = False,
                   include_defaults: bool = True, seed: int = 0, limits: Limits = Limits(), max_gen_toks: int = 512,
                   log: Callable[[str], None] = print) -> dict[str, float]:
    """Evaluate `model` (a GPT) with `tokenizer` (study/data/text.py's) on `tasks`; {"eval_<task>_<metric>": value}.

    `limit`: the first N examples of each task. `num_samples`, `temperature`: the samples per problem of HumanEval and
    gsm8k_chat (pass@k for k in 1, 10 up to num_samples). `include_defaults=False` keeps to the tasks of
    `include_path`."""
    require_harness("evaluate")
    from study.evals.harness import LapstudyLM

    tasks = list(dict.fromkeys(tasks))
    check_humaneval_allowed(tasks, allow_code_execution, "--")  # before the harness's tasks take their time
    include_path = [Path(p) for p in include_path]
    harness_tasks = [t for t in tasks if t not in OWN_TASKS]
    manager = harness_task_manager(harness_tasks, include_path, include_defaults) if harness_tasks else None
    problems = None
    if HUMANEVAL in tasks:
        problems = load_problems(find_problem_file(include_path))[:limit]
    gsm8k_problems = None
    if gsm8k.TASK in tasks:
        if not getattr(tokenizer, "chat", False):
            raise UserError(f"--tasks {gsm8k.TASK}: the model's vocabulary has no chat tokens (train it with "
                            "chat_tokens: true or on chat data, as nanochat's stages do)")
        gsm8k_problems = gsm8k.load_problems(include_path)[:limit]
    lm = LapstudyLM(model, tokenizer, batch_size=batch_size, seed=seed)
    metrics: dict[str, float] = {}
    if harness_tasks:
        import lm_eval

        output = lm_eval.simple_evaluate(
            model=lm, tasks=harness_tasks, task_manager=manager, limit=limit, num_fewshot=num_fewshot,
            apply_chat_template=apply_chat_template, log_samples=False, bootstrap_iters=1000, random_seed=seed,
            numpy_random_seed=seed, torch_random_seed=seed, fewshot_random_seed=seed, confirm_run_unsafe_code=False,
            verbosity="WARNING")
        results = output["results"]
        reported = [t for t in results if t in harness_tasks] or list(results)
        for task in reported:
            for key, value in results[task].items():
                if "," not in key or not isinstance(value, (int, float)) or isinstance(value, bool):
                    continue
                metric, filter_name = key.split(",", 1)
                metrics[metric_name(task, metric, filter_name)] = float(value)
    if problems is not None:
        values, _ = evaluate_humaneval(lm, problems, allow_code_execution=True, num_samples=num_samples,
                                       temperature=temperature, max_gen_toks=max_gen_toks, limits=limits, log=log)
        metrics.update({metric_name(HUMANEVAL, k): v for k, v in values.items()})
    if gsm8k_problems is not None:
        with lm._autocast():
            values, _ = gsm8k.evaluate_gsm8k(model, tokenizer, gsm8k_problems, num_samples=num_samples,
                                             temperature=temperature, seed=seed, log=log)
        metrics.update({metric_name(gsm8k.TASK, k): v for k, v in values.items()})
    return dict(sorted(metrics.items()))


def check_tasks(tasks: list[str], include_path: Iterable[Path]) -> None:
    """What can fail before a model is trained or loaded: an unknown task, a hub task offline, a missing HumanEval
    file."""
    include_path = [Path(p) for p in include_path]
    harness_tasks = [t for t in tasks if t not in OWN_TASKS]
    if harness_tasks:
        harness_task_manager(harness_tasks, include_path)
    if HUMANEVAL in tasks:
        load_problems(find_problem_file(include_path))
    if gsm8k.TASK in tasks and not gsm8k.find_local_split(include_path):
        gsm8k.load_problems(include_path)  # the hub: fails at once offline, naming --include-path


def check_evaluations(run) -> None:
    """check_tasks for every `evaluate:` entry of a run config or a space, its first stage's and each later one's."""
    entries = [evaluation for _, evaluation in evaluations(run)]
    if entries:
        require_harness("evaluate")
    for evaluation in entries:
        check_tasks(evaluation.tasks, evaluation.include_path)


def evaluate_stage(model, evaluation: EvaluationSpec, dataset, *, seed: int, allow_code_execution: bool,
                   tokenizer=None, log: Callable[[str], None] = print) -> dict[str, float]:
    """A stage's benchmarks (its `evaluate:`) on the model it trained, read with its data's tokenizer (`tokenizer`,
    the one the stage's data was made with, else the one its dataset config names); `allow_code_execution`: what
    the command line that started the run allowed."""
    if tokenizer is None:
        tokenizer = tokenizer_for(dataset, model.config.vocab_size, "evaluate")
    return evaluate_model(model, tokenizer, evaluation.tasks, include_path=evaluation.include_path,
                          limit=evaluation.limit, allow_code_execution=allow_code_execution,
                          num_samples=evaluation.num_samples, temperature=evaluation.temperature,
                          num_fewshot=evaluation.num_fewshot, apply_chat_template=evaluation.chat, seed=seed, log=log)


__all__ = ["check_evaluations", "check_tasks", "evaluate_model", "evaluate_stage", "harness_task_manager",
           "metric_name", "require_harness"]
