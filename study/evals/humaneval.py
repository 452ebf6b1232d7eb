"""HumanEval (Chen et al. 2021): complete a function from its signature and docstring; a completion passes when the
problem's tests run without error. Generation goes through the harness adapter, execution through the sandbox.

Problems are read from a HumanEval-format file (JSON lines with task_id, prompt, test, entry_point; openai/human-eval's
`HumanEval.jsonl.gz` as it is) named `humaneval.jsonl`, `humaneval.jsonl.gz` or `HumanEval.jsonl.gz` in an
`--include-path` folder, else from the hub's `openai/openai_humaneval`. The program run for a completion is
openai/human-eval's: prompt + completion + "\\n" + test + "\\n" + f"check({entry_point})". Completions stop at
lm_eval's humaneval stop sequences (a new top-level class, def, comment, if or print).

What runs is openai/human-eval's program split in two (study/evals/sandbox.py): the completion's process runs
prompt + completion; the test's process runs prompt + test and `check(entry_point)`, asking the completion's process
for each call of the entry point. Each runs in a bubblewrap sandbox of its own, so a completion can neither reach
the machine nor forge its verdict.
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path

from study.data.hub import hub_reachable
from study.errors import UserError
from study.evals.sandbox import Limits, Sample, mean_pass_at_k, require_code_execution, run_samples
from study.evals.spec import HUMANEVAL

TASK = HUMANEVAL
FILE_NAMES = ("humaneval.jsonl", "humaneval.jsonl.gz", "HumanEval.jsonl.gz")
STOP_SEQUENCES = ["\nclass", "\ndef", "\n#", "\nif", "\nprint"]  # lm_eval's tasks/humaneval/humaneval.yaml
HUB_DATASET = "openai/openai_humaneval"
FIELDS = ("task_id", "prompt", "test", "entry_point")


def find_problem_file(include_paths: list[Path]) -> Path | None:
    for folder in include_paths:
        for name in FILE_NAMES:
            if (folder / name).is_file():
                return folder / name
    return None


def load_problems(path: Path | None) -> list[dict]:
    """The problems of a HumanEval-format file (None: the hub's copy, which needs the internet)."""
    if path is None:
        reachable, why = hub_reachable()
        if not reachable:
            raise UserError(f"--tasks humaneval: the problems come from the hub ({HUB_DATASET}), which cannot be "
                            f"reached ({why}); put a HumanEval-format {FILE_NAMES[0]} in a folder given as "
                            "--include-path (see docs/evals.md)")
        import datasets

        return [dict(row) for row in datasets.load_dataset(HUB_DATASET, split="test")]
    return [_problem(line, path, number) for number, line in enumerate(_lines(path), start=1) if line.strip()]


def _lines(path: Path) -> list[str]:
    """The file's lines, a .gz one decompressed; a UserError naming the file when it cannot be read as text."""
    opener = gzip.open if path.suffix == ".gz" else open
    try:
        with opener(path, "rt", encoding="utf-8") as f:
            return f.readlines()
    except (OSError, EOFError, UnicodeDecodeError) as exc:  # gzip.BadGzipFile is an OSError
        what = "gzip-compressed UTF-8 text" if path.suffix == ".gz" else "UTF-8 text"
        raise UserError(f"{path}: cannot be read as {what} ({' '.join(str(exc).split())}); a HumanEval problem file "
                        "is JSON lines (openai/human-eval's HumanEval.jsonl.gz)") from None


def _problem(line: str, path: Path, number: int) -> dict:
    """One JSON line: a problem with HumanEval's fields."""
    try:
        problem = json.loads(line)
    except json.JSONDecodeError as exc:
        raise UserError(f"{path}: line {number} is not JSON ({exc.msg} at column {exc.colno}); a HumanEval problem "
                        "file holds one JSON object per line") from None
    if not isinstance(problem, dict):
        kind = {"int": "a number", "float": "a number", "str": "a string", "list": "a list"}.get(
            type(problem).__name__, json.dumps(problem))
        raise UserError(f"{path}: line {number} is {kind}, not a problem (a JSON object with {', '.join(FIELDS)})")
    missing = [k for k in FIELDS if k not in problem]
    if missing:
        raise UserError(f"{path}: the problem on line {number} lacks {', '.join(missing)} (HumanEval's fields: "
                        f"{', '.join(FIELDS)})")
    return problem


def program(problem: dict, completion: str) -> Sample:
    """The sample of `completion`: the prompt and completion in one process, the prompt (its helpers, e.g.
    HumanEval/32's `poly`, which tests call) and the tests in the other."""
    prompt = problem["prompt"]
    try:
        compile(prompt, "<prompt>", "exec")
    except SyntaxError:  # a prompt that is not a module on its own: the tests run without its helpers
        prompt = ""
    return Sample(solution=f"{problem['prompt']}{completion}\n", test=f"{prompt}\n{problem['test']}\n",
                  entry_point=problem["entry_point"])


def evaluate_humaneval(lm, problems: list[dict], *, allow_code_execution: bool, num_samples: int = 1,
                       temperature: float = 0.0, max_gen_toks: int = 512, ks: tuple[int, ...] = (1, 10),
                       limits: Limits = Limits(), log=print) -> tuple[dict[str, float], list[dict]]:
    """({"pass_at_<k>": value} for every k <= num_samples, one record per sample). `lm`: a LapstudyLM. Checks the
    flag before generating anything."""
    require_code_execution(allow_code_execution)
    records, programs = [], []
    for problem in problems:
        for sample in range(num_samples):
            completion = lm.generate(problem["prompt"], until=STOP_SEQUENCES, max_gen_toks=max_gen_toks,
                                     do_sample=temperature > 0, temperature=temperature)
            records.append({"task_id": problem["task_id"], "sample": sample, "completion": completion})
            programs.append(program(problem, completion))
    results = run_samples(programs, allow_code_execution=True, limits=limits)
    by_problem: dict[str, list[bool]] = {}
    for record, result in zip(records, results):
        record.update(status=result.status, reason=result.reason)
        by_problem.setdefault(record["task_id"], []).append(result.passed)
    outcomes = list(by_problem.values())
    metrics = {f"pass_at_{k}": mean_pass_at_k(outcomes, k) for k in ks if k <= num_samples}
    log(f"humaneval: {sum(map(sum, outcomes))} of {len(records)} samples passed over {len(outcomes)} problems; "
        + ", ".join(f"{name} {value:.4f}" for name, value in metrics.items()))
    return metrics, records
