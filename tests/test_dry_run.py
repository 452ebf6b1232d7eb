"""`lapstudy run SPACE --dry-run`: the space checked and what each trial would train printed, stage by stage, with
the model each stage builds counted on the meta device, and nothing started: no Ray, no MLflow, no data read."""

from __future__ import annotations

from pathlib import Path

import yaml

from import_probe import imported_by_command
from study.cli import EXIT_USER_ERROR, main

SPACES = Path(__file__).resolve().parents[1] / "search_spaces"
D20_PARAMETERS = "560,988,160 parameters"  # nanochat's d20 at e1770a3 (tests/test_nanochat_d20.py writes it out)


def _dry_run(capsys, space: Path, *flags: str, storage: Path) -> tuple[int, str, str]:
    code = main(["run", str(space), "--dry-run", "--storage", str(storage), *flags])
    out, err = capsys.readouterr()
    return code, out, err


def test_the_paper_space_prints_each_trials_stages_and_d20s_parameters(capsys, tmp_path):
    code, out, err = _dry_run(capsys, SPACES / "gpt_d20_paper.yaml", "--allow-code-execution",
                              "--workers-per-trial", "8", "--gpus-per-worker", "1", storage=tmp_path)
    assert code == 0 and err == ""
    assert "3 configuration(s)" in out and "3 grid points:" in out
    assert "each trial: 8 worker(s), 1 CPU and 1 GPU each" in out
    assert out.count(D20_PARAMETERS) == 9 and out.count("vocabulary 65,536") == 9  # 3 trials x 3 stages
    assert out.count("20 epoch(s) x 1,070 steps, batch 256, grad_clip 1.0") == 3  # base_train: 21,400 steps
    assert out.count("1 epoch(s) x 495 steps, batch 256, no gradient clipping") == 3  # mid_train
    assert out.count("1 epoch(s) x 701 steps, batch 32, no gradient clipping") == 3  # chat_sft
    ramp_5 = [0, 0, 0, 0, 1, 2, 3, 4] + [5] * 12  # from layer 4, one more a layer, at most 5
    assert f"Laplacian heads per layer {ramp_5}" in out and f"Laplacian heads per layer {[0] * 20}" in out
    assert not (tmp_path / "gpt_d20_paper").exists()  # no study folder


def test_later_stages_read_the_pretrainings_bpe_and_keep_its_vocabulary(capsys, tmp_path):
    code, out, _ = _dry_run(capsys, SPACES / "gpt_d20_stages_laptop.yaml", storage=tmp_path)
    assert code == 0
    models = [line.strip() for line in out.splitlines() if "parameters, model gpt" in line]
    assert len(models) == 6 and all("vocabulary 512" in line for line in models)  # bpe.vocab_size, every stage
    assert len({line.split(" parameters")[0] for line in models}) == 1


def test_a_dry_run_starts_nothing(tmp_path):
    code, loaded = imported_by_command(["run", str(SPACES / "gpt_d20_stages_laptop.yaml"), "--dry-run",
                                        "--storage", str(tmp_path)], ("ray", "mlflow", "optuna"))
    assert (code, loaded) == (0, [])


def test_a_dry_run_still_refuses_a_wrong_space(capsys, tmp_path):
    wrong = tmp_path / "wrong.yaml"  # base_train's 21,400 steps do not split into 3 epochs
    wrong.write_text(yaml.safe_dump({**yaml.safe_load((SPACES / "gpt_d20_stages.yaml").read_text()), "epochs": 3}))
    code, out, err = _dry_run(capsys, wrong, "--allow-code-execution", storage=tmp_path)
    assert code == EXIT_USER_ERROR and out == ""
    assert err.startswith("lapstudy: error: ") and "param_data_ratio" in err and "3 epochs do not split" in err
    assert len(err.strip().splitlines()) == 1
