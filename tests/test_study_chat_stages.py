"""search_spaces/gpt_d20_stages_laptop.yaml, made smaller, through the `lapstudy` command line on a local Ray cluster:
a tiny nanochat GPT pre-trained on the shipped text (with the chat tokens in its vocabulary), mid-trained on the
chat fixtures' mixture (every token a target) and fine-tuned on their SFT mixture (the assistant's tokens only), all
offline, each stage from the model the one before ended with, every stage's metrics in the trial's one MLflow run
under its name."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import yaml

from study_fixtures import lapstudy, metric_history, one_trial_study, ray_address, write_yaml  # noqa: F401

pytestmark = pytest.mark.slow(seconds=60)

SPACES = Path(__file__).resolve().parents[1] / "search_spaces"
SHIPPED = yaml.safe_load((SPACES / "gpt_d20_stages_laptop.yaml").read_text())
PRETRAIN, MIDTRAIN, SFT = 1, 1, 1


def _absolute(dataset: dict) -> dict:
    """The shipped space's fixture paths (relative to search_spaces/) made absolute for a space written elsewhere."""
    def part(p: dict) -> dict:
        return {k: str((SPACES / v).resolve()) if k in ("path", "local_dir") else v for k, v in p.items()}
    return {**dataset, "train": [part(p) for p in dataset["train"]], "val": [part(p) for p in dataset["val"]]}


midtrain, sft = SHIPPED["stages"]
SPACE = {**SHIPPED, "name": "chat", "epochs": PRETRAIN, "parameters": {"max_count": [2]},
         "geometry": {"max_batches": 1, "top_targets": 8, "pca_points": 50},
         "fixed": {**SHIPPED["fixed"], "steps_per_epoch": 4, "batch_size": 8},
         "stages": [{**midtrain, "epochs": MIDTRAIN, "dataset": _absolute(midtrain["dataset"]),
                     "hyperparameters": {"steps_per_epoch": 3}},
                    {**sft, "epochs": SFT, "dataset": _absolute(sft["dataset"]),
                     "hyperparameters": {**sft["hyperparameters"], "steps_per_epoch": 3}}]}


FIXTURES = Path(__file__).resolve().parent / "fixtures" / "evals"
BENCHMARK = {"tasks": ["arc_easy"], "limit": 8, "chat": True}
GSM8K = Path(__file__).resolve().parent / "fixtures" / "chat" / "openai" / "gsm8k"
SAMPLED = {"tasks": ["gsm8k_chat"], "include_path": [str(GSM8K)], "limit": 3, "num_samples": 2, "temperature": 1.0}
# HumanEval runs the model's code: only because the study's command line says --allow-code-execution.
CODE = {"tasks": ["humaneval"], "include_path": [str(FIXTURES)], "limit": 2, "chat": True}


@pytest.fixture(scope="module")
def chat_study(tmp_path_factory, ray_address):
    root = tmp_path_factory.mktemp("chat")
    # lm_eval's arc_easy over the shipped ARC rows; its data file absolute, as a trial runs in its own folder.
    tasks = root / "eval_tasks"
    tasks.mkdir()
    task = yaml.safe_load((FIXTURES / "arc_easy.yaml").read_text())
    task["dataset_kwargs"]["data_files"]["test"] = str(FIXTURES / "arc.jsonl")
    write_yaml(tasks / "arc_easy.yaml", task)
    stages = [*SPACE["stages"][:-1], {**SPACE["stages"][-1], "evaluate": [{**BENCHMARK, "include_path": ["eval_tasks"]},
                                                                         SAMPLED, CODE]}]
    study = one_trial_study(root, {**SPACE, "stages": stages}, ray_address, timeout=600,
                            flags=("--allow-code-execution",))
    return {**study, "root": root, "tasks": tasks}


def test_three_stages_log_their_metrics_under_their_names(chat_study):
    def history(key):
        return metric_history(chat_study["uri"], chat_study["run"].info.run_id, key)

    final = chat_study["rows"][-1]
    assert final["epoch"] == PRETRAIN + MIDTRAIN + SFT and final["stage"] == "sft"
    assert [step for step, _ in history("val_bpb")] == [PRETRAIN]
    assert [step for step, _ in history("midtrain/val_loss")] == [PRETRAIN + MIDTRAIN]
    assert [step for step, _ in history("sft/val_loss")] == [PRETRAIN + MIDTRAIN + SFT]
    assert all(math.isfinite(value) for key in ("sft/val_loss", "sft/val_bpb", "sft/train_loss", "midtrain/val_bpb")
               for _, value in history(key))
    # every stage's nanochat schedule ends at final_lr_frac 0 (the lr logged is the one after the epoch's last step)
    assert [value for key in ("lr", "midtrain/lr", "sft/lr") for _, value in history(key)] == [0.0, 0.0, 0.0]
    params = chat_study["run"].data.params
    # nanochat's tokenizer, trained on the shipped text: 512 tokens, the later stages reading with the same
    assert params["optimizer"] == "nanochat" and params["vocab_size"] == "512" \
        and params["data.tokenizer"] == "nanochat"
    assert chat_study["run"].data.tags["lapstudy.status"] == "completed"


def test_sft_ends_with_its_benchmark_scored_as_lapstudy_eval_scores_its_checkpoint(chat_study):
    """The space's `evaluate:` of the SFT stage: lm_eval's arc_easy (over local rows), chat-formatted, on the model
    the stage ended with, logged at the stage's last epoch; `lapstudy eval` of that checkpoint gives the same."""
    last = PRETRAIN + MIDTRAIN + SFT
    [(step, accuracy)] = metric_history(chat_study["uri"], chat_study["run"].info.run_id, "sft/eval_arc_easy_acc")
    assert step == last and 0.0 <= accuracy <= 1.0
    final = chat_study["rows"][-1]
    assert final["sft/eval_arc_easy_acc"] == accuracy and final["sft/benchmark_s"] > 0
    assert not metric_history(chat_study["uri"], chat_study["run"].info.run_id, "midtrain/eval_arc_easy_acc")
    config = chat_study["root"] / "studies" / "chat" / "trials" / f"{final['trial_id']}.yaml"
    scored = lapstudy("eval", config, "--checkpoint", final["checkpoint_path"], "--tasks", "arc_easy",
                      "--include-path", chat_study["tasks"], "--limit", BENCHMARK["limit"], "--chat",
                      cwd=chat_study["root"])
    assert scored.returncode == 0, scored.stdout[-2000:] + scored.stderr[-2000:]
    printed = {line.split(":")[0]: float(line.split(":")[1]) for line in scored.stdout.splitlines()
               if line.startswith("eval_")}
    assert printed["eval_arc_easy_acc"] == pytest.approx(accuracy, abs=5e-7)  # printed to 6 decimals


def test_sft_ends_with_gsm8k_sampled_nanochats_way_as_lapstudy_eval_samples_it(chat_study):
    """The stage's second `evaluate:` entry, with its own samples and temperature: GSM8K pass@1 of 2 samples with the
    calculator, at the stage's last epoch; `lapstudy eval` of the checkpoint, with the run's seed, draws the same."""
    [(step, passed)] = metric_history(chat_study["uri"], chat_study["run"].info.run_id, "sft/eval_gsm8k_chat_pass_at_1")
    assert step == PRETRAIN + MIDTRAIN + SFT and 0.0 <= passed <= 1.0
    final = chat_study["rows"][-1]
    config = chat_study["root"] / "studies" / "chat" / "trials" / f"{final['trial_id']}.yaml"
    scored = lapstudy("eval", config, "--checkpoint", final["checkpoint_path"], "--tasks", "gsm8k_chat",
                      "--include-path", GSM8K, "--limit", SAMPLED["limit"], "--num-samples", SAMPLED["num_samples"],
                      "--temperature", SAMPLED["temperature"], cwd=chat_study["root"])
    assert scored.returncode == 0, scored.stdout[-2000:] + scored.stderr[-2000:]
    assert f"eval_gsm8k_chat_pass_at_1: {passed:.6f}" in scored.stdout


def test_the_command_lines_code_execution_flag_reaches_the_trials_humaneval(chat_study):
    """`lapstudy run --allow-code-execution` is what lets the trial's HumanEval run inside Ray (the space cannot ask
    for it); the trial's run config does not carry the decision, so `lapstudy train` of it needs the flag again."""
    [(step, passed)] = metric_history(chat_study["uri"], chat_study["run"].info.run_id, "sft/eval_humaneval_pass_at_1")
    assert step == PRETRAIN + MIDTRAIN + SFT and 0.0 <= passed <= 1.0
    final = chat_study["rows"][-1]
    config = chat_study["root"] / "studies" / "chat" / "trials" / f"{final['trial_id']}.yaml"
    assert "allow_code_execution" not in config.read_text()
    again = lapstudy("train", config, "--storage", "retrain", cwd=chat_study["root"], timeout=120)
    assert again.returncode == 2 and "--allow-code-execution" in again.stderr, again.stderr
    assert not (chat_study["root"] / "retrain").exists()
