"""search_spaces/stlt_longctx_laptop.yaml, made smaller, through the `lapstudy` command line on a local Ray cluster,
offline: attention and adaptive STLT trained at 64 tokens, each epoch's perplexity per token and per word at 64, 256
and 1024 tokens and every STLT layer's S_eff (at each length) and T in each trial's MLflow run and in what Tune
judged the trials on."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import yaml

from study_fixtures import lapstudy, metric_history, mlflow_runs, ray_address, tune_trials, write_yaml  # noqa: F401

pytestmark = pytest.mark.slow(seconds=75)

SHIPPED = yaml.safe_load((Path(__file__).resolve().parents[1] / "search_spaces" / "stlt_longctx_laptop.yaml")
                         .read_text())
EPOCHS = 2
CONTEXTS = SHIPPED["dataset"]["eval_contexts"]
SPACE = {**SHIPPED, "name": "longctx", "epochs": EPOCHS, "num_samples": 2,
         "fixed": {**SHIPPED["fixed"], "steps_per_epoch": 10},
         "points_to_evaluate": [SHIPPED["points_to_evaluate"][0], SHIPPED["points_to_evaluate"][2]]}


@pytest.fixture(scope="module")
def study(tmp_path_factory, ray_address):
    root = tmp_path_factory.mktemp("longctx")
    write_yaml(root / "longctx.yaml", SPACE)
    run = lapstudy("run", "longctx.yaml", "--storage", "studies", "--address", ray_address, cwd=root)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    study_dir = root / "studies" / "longctx"
    uri = f"sqlite:///{study_dir / 'mlflow.db'}"
    return {"uri": uri, "rows": tune_trials(study_dir), "runs": mlflow_runs(uri, "longctx")}


def test_every_epoch_logs_perplexity_at_every_context(study):
    assert len(study["runs"]) == 2 and len(study["rows"]) == 2
    for run in study["runs"]:
        for length in CONTEXTS:
            history = metric_history(study["uri"], run.info.run_id, f"val_ppl_token_ctx{length}")
            assert [step for step, _ in history] == list(range(1, EPOCHS + 1)), (length, history)
            # A byte-level model that learnt something: better than uniform over 257 tokens, and a perplexity.
            assert all(1.0 < value < 257 for _, value in history), (length, history)
            # The same loss over the words, fewer than the bytes: a larger number.
            words = dict(metric_history(study["uri"], run.info.run_id, f"val_ppl_word_ctx{length}"))
            assert all(words[step] > value for step, value in history), (length, words, history)
        ppl = dict(metric_history(study["uri"], run.info.run_id, "val_ppl"))
        loss = dict(metric_history(study["uri"], run.info.run_id, "val_loss"))
        assert ppl[EPOCHS] == pytest.approx(math.exp(loss[EPOCHS]))
    # What the sampler judged: the space's metric, per word at 1024 tokens, in every row Tune kept.
    for rows in study["rows"].values():
        assert all(math.isfinite(row["val_ppl_word_ctx1024"]) for row in rows)


def test_stlt_layers_log_their_nodes_in_use_and_window_every_epoch(study):
    [stlt] = [r for r in study["runs"] if r.data.params["mixer"] == "stlt"]
    [attention] = [r for r in study["runs"] if r.data.params["mixer"] == "attention"]
    depth = 4  # gpt_tiny
    for layer in range(depth):
        for key in (f"stlt_T_l{layer}", f"stlt_s_eff_l{layer}", *(f"stlt_s_eff_l{layer}_ctx{n}" for n in CONTEXTS)):
            history = metric_history(study["uri"], stlt.info.run_id, key)
            assert [step for step, _ in history] == list(range(1, EPOCHS + 1)), key
            assert all(value > 0 for _, value in history), key
        assert not metric_history(study["uri"], attention.info.run_id, f"stlt_T_l{layer}")
    nodes = SPACE["conditional"][0]["fixed"]["stlt_nodes"]
    assert all(value <= nodes for layer in range(depth)
               for _, value in metric_history(study["uri"], stlt.info.run_id, f"stlt_s_eff_l{layer}"))
