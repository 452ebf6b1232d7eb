"""`lapstudy eval`: a run config and its checkpoint through the harness to printed and MLflow-logged metrics; bad
input refused in one line (exit 2) before any model is loaded; HumanEval's generation, execution and pass@k."""

from __future__ import annotations

import pytest
import torch
import yaml

from study import cli
from study.evals.humaneval import evaluate_humaneval, load_problems
from study.evals.sandbox import Limits, pass_at_k
from test_harness import FIXTURES, REPO, _mc_accuracy_by_hand, tiny_gpt


@pytest.fixture(autouse=True)
def _repo_cwd(monkeypatch):
    monkeypatch.chdir(REPO)


@pytest.fixture
def run_config(tmp_path):
    """A `lapstudy train`-style run: <storage>/<name>.yaml beside <storage>/<name>/checkpoint_000000/state.pt."""
    model = tiny_gpt(5, depth=1)
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump({
        "task": "language_modeling", "dataset": {"source": "pydoc_text", "seq_len": 192}, "epochs": 1, "seed": 0,
        "hyperparameters": {"preset": "gpt_tiny", "depth": 1, "context_length": 192, "vocab_size": 257}}))
    (tmp_path / "run" / "checkpoint_000000").mkdir(parents=True)
    torch.save({"model": model.state_dict(), "epoch": 1}, tmp_path / "run" / "checkpoint_000000" / "state.pt")
    return config, model


def _main(argv, capfd):
    code = cli.main([str(a) for a in argv])
    out, err = capfd.readouterr()
    return code, out, err


def test_eval_prints_and_logs_what_the_model_scores(run_config, tmp_path, capfd):
    config, model = run_config
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    code, out, err = _main(["eval", config, "--tasks", "mmlu", "--include-path", FIXTURES, "--tracking-uri", uri],
                           capfd)
    assert code == 0, err
    printed = {line.split(":")[0]: float(line.split(":")[1]) for line in out.splitlines()
               if line.startswith("eval_")}
    assert printed["eval_mmlu_acc"] == pytest.approx(_mc_accuracy_by_hand(model))
    from mlflow import MlflowClient

    client = MlflowClient(uri)
    (run,) = client.search_runs([client.get_experiment_by_name("lapstudy-eval").experiment_id])
    assert run.data.metrics["eval_mmlu_acc"] == pytest.approx(printed["eval_mmlu_acc"])
    assert run.data.params["eval_tasks"] == "mmlu"


BAD = [
    (["--tasks", "humaneval"], ["--allow-code-execution"]),
    (["--tasks", "arc_challenge"], ["arc_challenge", "--include-path"]),  # offline: a hub task
    (["--tasks", "gsm8k_chat"], ["gsm8k_chat", "openai/gsm8k", "--include-path"]),  # offline, no local copy
    (["--tasks", ""], ["--tasks", "arc_easy"]),
    (["--tasks", "mmlu", "--limit", "0"], ["--limit", "greater than or equal to 1"]),
    (["--tasks", "humaneval", "--allow-code-execution", "--num-samples", "10"], ["--temperature", "> 0"]),
    (["--tasks", "mmlu", "--run-id", "abc"], ["--run-id", "--tracking-uri"]),
    (["--tasks", "mmlu", "--device", "gpu"], ["--device", "cuda"]),
    (["--tasks", "mmlu", "--bogus"], ["--bogus"]),
]


@pytest.mark.parametrize("extra,expect", BAD, ids=[" ".join(b[0])[:40] for b in BAD])
def test_bad_input_is_one_line_and_loads_no_model(run_config, extra, expect, capfd, monkeypatch):
    config, _ = run_config
    import study.evals.cli

    monkeypatch.setattr(study.evals.cli, "load_model", lambda *a, **k: pytest.fail("the model was loaded"))
    code, out, err = _main(["eval", config, "--include-path", FIXTURES, *extra], capfd)
    assert code == 2
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
    for text in expect:
        assert text in err


def test_a_missing_checkpoint_names_the_flag(tmp_path, run_config, capfd):
    config, _ = run_config
    lonely = tmp_path / "elsewhere.yaml"
    lonely.write_text(config.read_text())
    code, _, err = _main(["eval", lonely, "--tasks", "mmlu", "--include-path", FIXTURES], capfd)
    assert code == 2 and "--checkpoint" in err


class _ScriptedLM:
    """Completions given by a script: problem index -> list of completions, one per sample."""

    def __init__(self, script):
        self.script, self.calls = script, {}

    def generate(self, prompt, **kwargs):
        index = next(i for i, p in enumerate(self.problems) if p["prompt"] == prompt)
        self.calls[index] = self.calls.get(index, 0) + 1
        return self.script[index][self.calls[index] - 1]


def test_humaneval_executes_the_samples_and_scores_pass_at_k():
    problems = load_problems(FIXTURES / "humaneval.jsonl")
    right = [p["canonical_solution"] for p in problems]
    wrong = ["    return None\n", "    while True:\n        pass\n"]  # a wrong value, then a loop the limit stops
    lm = _ScriptedLM({0: [right[0]] * 3 + [wrong[0]] * 7, 1: [wrong[1]] + [right[1]] + [wrong[0]] * 8})
    lm.problems = problems
    metrics, records = evaluate_humaneval(lm, problems, allow_code_execution=True, num_samples=10, temperature=0.8,
                                          limits=Limits(cpu_s=1, wall_s=3), log=lambda _: None)
    assert metrics["pass_at_1"] == pytest.approx((pass_at_k(10, 3, 1) + pass_at_k(10, 1, 1)) / 2)
    assert metrics["pass_at_10"] == 1.0
    statuses = [r["status"] for r in records if r["task_id"] == problems[1]["task_id"]]
    assert statuses[:2] == ["timed_out", "passed"]


def test_humaneval_end_to_end_refuses_without_the_flag_and_runs_with_it(run_config, capfd):
    config, _ = run_config
    code, out, err = _main(["eval", config, "--tasks", "humaneval", "--include-path", FIXTURES,
                            "--allow-code-execution"], capfd)
    assert code == 0, err
    assert "eval_humaneval_pass_at_1: 0.000000" in out  # a random model writes no working function
    assert "eval_humaneval_pass_at_10" not in out  # one sample per problem
