"""Mistakes refused before anything starts, each through the installed `lapstudy` command: a URI in object storage
that names no bucket, a bucket that never answers, a YAML key given twice, a configuration no model can build, a
malformed HumanEval file, code execution asked for by a file instead of the command line. Each gets one line on
stderr naming the field or flag, exit code 2, and leaves no trace: the working folder byte-for-byte as it was, no
Ray session folder, nothing under the home folder (matplotlib writes its cache there on first import), no Hugging
Face cache. A study whose every trial failed exits 1 and says why (one small Ray study, marked slow)."""

from __future__ import annotations

import gzip
import json
import os
import shutil
import socket
import subprocess
import threading
import time
from pathlib import Path

import pytest
import yaml

from fault_fixtures import LAPSTUDY, REPO, private_ray_tmp, study_env, tiny_space, tree_digest, write_space
from import_probe import imported_by_command
from study.storage import REACH_TIMEOUT_S

HUMANEVAL = REPO / "tests" / "fixtures" / "evals" / "humaneval.jsonl"
RUN_CONFIG = {"task": "classification", "dataset": {"source": "digits"}, "epochs": 1, "seed": 0,
              "hyperparameters": {"preset": "vit_tiny_digits", "depth": 2, "batch_size": 64}}


def _language_model_space(**changes) -> dict:
    space = yaml.safe_load((REPO / "search_spaces" / "quickstart_lm.yaml").read_text())
    return {**space, "num_samples": 1, "epochs": 1, "early_stopping": "none", **changes}


def _language_model_config(**changes) -> dict:
    return {"task": "language_modeling", "dataset": {"source": "pydoc_text", "seq_len": 64}, "epochs": 1, "seed": 0,
            "hyperparameters": {"preset": "gpt_tiny", "batch_size": 8, "steps_per_epoch": 2}, **changes}


@pytest.fixture
def work(tmp_path) -> Path:
    """The working folder the command runs in; its inputs are written here before it runs."""
    (tmp_path / "work").mkdir()
    (tmp_path / "home").mkdir()
    return tmp_path / "work"


def refused(work: Path, *args, expect: list[str], timeout: float = 180, **env: str) -> tuple[str, float]:
    """`lapstudy ARGS` run in `work`: (its one error line, the seconds it took). It must exit 2 with that one line
    holding every text of `expect`, print nothing on stdout, and leave no trace."""
    root = work.parent
    environment = study_env(root / "ray", HOME=str(root / "home"), HF_HOME=str(root / "hf"), **env)
    for variable in ("MPLCONFIGDIR", "XDG_CACHE_HOME", "XDG_CONFIG_HOME"):  # matplotlib would write to ~ then
        environment.pop(variable, None)
    before = tree_digest(work)
    started = time.monotonic()
    done = subprocess.run([str(LAPSTUDY), *map(str, args)], cwd=work, env=environment, capture_output=True,
                          text=True, timeout=timeout)
    seconds = time.monotonic() - started
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert done.returncode == 2 and len(lines) == 1, f"exit code {done.returncode}; stderr:\n{done.stderr}"
    line = lines[0]
    assert line.startswith("lapstudy: error: ") and "Traceback" not in done.stderr, line
    for text in expect:
        assert text in line, f"{text!r} missing from the error line: {line}"
    assert done.stdout == "", f"nothing may be printed on stdout for a refused command:\n{done.stdout}"
    assert tree_digest(work) == before, "the working folder was changed"
    assert not (root / "ray").exists(), "a Ray session folder was made: Ray was started"
    assert list((root / "home").rglob("*")) == [], "files were written under the home folder"
    assert not (root / "hf").exists(), "a Hugging Face cache was made"
    return line, seconds


def _write(path: Path, data) -> Path:
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


# ---- object storage ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("command, location", [
    (["run", "space.yaml", "--storage"], "s3://"),
    (["run", "space.yaml", "--storage"], "gs://"),
    (["run", "space.yaml", "--storage"], "gs:/bucket/studies"),  # one slash: a URI typed wrong, not a folder gs:
    (["train", "config.yaml", "--storage"], "s3://"),
    (["train", "config.yaml", "--storage"], "gs://"),
    (["status"], "s3://"),
    (["report"], "gs://"),
    (["export"], "s3://"),
    (["sync"], "gs://"),
])
def test_a_uri_without_a_bucket_is_refused(work, command, location):
    """`s3://` lost its slashes to `s3:`, which no longer looked remote: train wrote ./gs:/ and run started Ray."""
    write_space(work / "space.yaml", tiny_space())
    _write(work / "config.yaml", RUN_CONFIG)
    argument = "--storage" if "--storage" in command else "STUDY_DIR"
    refused(work, *command, location, expect=[f"{argument} {location}", "names no bucket", "BUCKET/PREFIX"])


@pytest.fixture
def silent_endpoint():
    """An S3 endpoint that accepts connections and never answers (pyarrow's S3 client waits on it for good)."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(64)
    accepted = []

    def accept():
        while True:
            try:
                accepted.append(server.accept()[0])
            except OSError:  # closed
                return

    threading.Thread(target=accept, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.getsockname()[1]}"
    finally:
        server.close()
        for connection in accepted:
            connection.close()


S3_CREDENTIALS = {"AWS_ACCESS_KEY_ID": "test", "AWS_SECRET_ACCESS_KEY": "test", "AWS_DEFAULT_REGION": "us-east-1"}


@pytest.mark.parametrize("command", [["run", "space.yaml", "--storage", "s3://silent/studies", "--tracking-uri",
                                      "http://127.0.0.1:9"],
                                     ["status", "s3://silent/studies/fault"]], ids=["run", "status"])
def test_a_bucket_that_never_answers_is_refused_in_bounded_time_saying_what_it_waited_for(work, silent_endpoint,
                                                                                          command):
    write_space(work / "space.yaml", tiny_space())
    line, seconds = refused(work, *command, expect=[f"did not answer within {REACH_TIMEOUT_S:g} s",
                                                    f"waited for {silent_endpoint}"],
                            AWS_ENDPOINT_URL=silent_endpoint, **S3_CREDENTIALS)
    assert REACH_TIMEOUT_S <= seconds < REACH_TIMEOUT_S + 30, f"refused after {seconds:.0f} s: {line}"


# ---- YAML ------------------------------------------------------------------------------------------------------------


def test_a_key_given_twice_in_a_space_is_refused_naming_both_lines(work):
    text = yaml.safe_dump(tiny_space(), sort_keys=False)
    lines = text.splitlines()
    first = next(i for i, line in enumerate(lines) if line.startswith("epochs:")) + 1
    (work / "space.yaml").write_text(text + "epochs: 40\n")
    refused(work, "run", "space.yaml", expect=["key 'epochs' is given twice", f"line {first} and line "
                                                                              f"{len(lines) + 1}"])


def test_a_key_given_twice_in_a_run_config_is_refused_naming_both_lines(work):
    (work / "config.yaml").write_text("task: classification\ndataset: {source: digits}\nepochs: 1\n"
                                      "hyperparameters:\n  preset: vit_tiny_digits\n  lr: 1.0e-3\n  lr: 3.0e-3\n")
    refused(work, "train", "config.yaml", expect=["run config", "key 'lr' is given twice", "line 6 and line 7"])


# ---- configurations no model can build --------------------------------------------------------------------------


def test_a_searched_value_no_model_can_build_is_refused_before_ray_starts(work):
    """STLT layers have no heads: `mixer: stlt` with k searched over 0..4 passed the corner checks, every trial with
    k > 0 failed inside Ray, and the study exited 0."""
    write_space(work / "space.yaml", tiny_space(
        fixed={"preset": "vit_tiny_digits", "depth": 2, "batch_size": 64, "mixer": "stlt"},
        parameters={"k": {"type": "int", "low": 0, "high": 4}}, points_to_evaluate=[]))
    refused(work, "run", "space.yaml", expect=["fixed.mixer", "'stlt' (no heads)", "schedule gives it 4", "k=4"])


def test_a_searched_head_count_the_gpt_cannot_rotate_is_refused(work):
    """RoPE turns channels in pairs: 48 / 16 = 3 channels per head was refused only when the model was built."""
    space = _language_model_space()
    _write(work / "space.yaml", {**space, "fixed": {**space["fixed"], "dim": 48}, "conditional": [],
                                 "parameters": {"num_heads": [4, 16]}, "points_to_evaluate": []})
    refused(work, "run", "space.yaml", expect=["parameters.num_heads = 16", "RoPE needs an even head dimension",
                                               "got 3"])


def test_a_run_config_no_model_can_build_is_refused(work):
    _write(work / "config.yaml", {**RUN_CONFIG, "hyperparameters": {**RUN_CONFIG["hyperparameters"],
                                                                    "mixer": "stlt", "k": 2}})
    refused(work, "train", "config.yaml", expect=["hyperparameters.mixer", "'stlt' (no heads)", "gives it 2"])


# ---- HumanEval files and code execution --------------------------------------------------------------------------

MALFORMED = [("humaneval.jsonl", b"{\"task_id\": \"x\",\n", "line 1 is not JSON"),
             ("humaneval.jsonl", b"42\n", "line 1 is a number, not a problem"),
             ("humaneval.jsonl.gz", b"{\"task_id\": \"not compressed\"}\n", "cannot be read as gzip-compressed")]


@pytest.mark.parametrize("name, content, words", MALFORMED, ids=["not-json", "a-number", "not-gzip"])
def test_a_malformed_humaneval_file_is_refused_by_lapstudy_eval(work, name, content, words):
    (work / "tasks").mkdir()
    (work / "tasks" / name).write_bytes(content)
    _write(work / "config.yaml", _language_model_config())
    refused(work, "eval", "config.yaml", "--tasks", "humaneval", "--allow-code-execution", "--include-path", "tasks",
            expect=[str(work / "tasks" / name), words])


@pytest.mark.parametrize("name, content, words", MALFORMED, ids=["not-json", "a-number", "not-gzip"])
def test_a_malformed_humaneval_file_is_refused_by_a_spaces_evaluate(work, name, content, words):
    (work / "tasks").mkdir()
    (work / "tasks" / name).write_bytes(content)
    _write(work / "space.yaml", _language_model_space(evaluate={"tasks": ["humaneval"], "include_path": ["tasks"]}))
    refused(work, "run", "space.yaml", "--allow-code-execution", expect=[str(work / "tasks" / name), words])


def test_a_space_asking_for_humaneval_is_refused_without_the_flag(work):
    """Model-written code runs only where the command line says so: a shipped paper space no longer decides it."""
    _write(work / "space.yaml", _language_model_space(
        evaluate={"tasks": ["humaneval"], "include_path": [str(HUMANEVAL.parent)]}))
    refused(work, "run", "space.yaml", expect=["search space", "evaluate[0].tasks humaneval",
                                               "--allow-code-execution"])


def test_a_later_stage_asking_for_humaneval_is_refused_without_the_flag(work):
    stage = {"name": "again", "task": "language_modeling", "epochs": 1,
             "evaluate": [{"tasks": ["humaneval"], "include_path": [str(HUMANEVAL.parent)]}]}
    _write(work / "space.yaml", _language_model_space(stages=[stage]))
    refused(work, "run", "space.yaml", expect=["stages[0].evaluate[0].tasks humaneval", "--allow-code-execution"])


def test_a_run_config_asking_for_humaneval_is_refused_without_the_flag(work):
    """An exported config re-run with `lapstudy train` needs the flag again: the file never carries it."""
    _write(work / "config.yaml", _language_model_config(
        evaluate=[{"tasks": ["humaneval"], "include_path": [str(HUMANEVAL.parent)]}]))
    refused(work, "train", "config.yaml", expect=["run config", "evaluate[0].tasks humaneval",
                                                  "--allow-code-execution"])


@pytest.mark.parametrize("command, file", [(["run", "space.yaml", "--allow-code-execution"], "space"),
                                           (["train", "config.yaml", "--allow-code-execution"], "config")])
def test_the_old_yaml_field_is_refused_naming_the_flag(work, command, file):
    entry = {"tasks": ["humaneval"], "include_path": [str(HUMANEVAL.parent)], "allow_code_execution": True}
    _write(work / "space.yaml", _language_model_space(evaluate=entry))
    _write(work / "config.yaml", _language_model_config(evaluate=[entry]))
    refused(work, *command, expect=["evaluate.0", "allow_code_execution", "--allow-code-execution"])


# ---- what a refusal costs -----------------------------------------------------------------------------------------


def test_a_bad_space_is_refused_before_ray_mlflow_optuna_or_matplotlib_are_imported(tmp_path):
    """The space and every corner of it are checked with the model's own rules (torch), then the machinery loads."""
    write_space(tmp_path / "space.yaml", tiny_space(parameters={"k": {"type": "int", "low": 0, "high": 9}},
                                                    points_to_evaluate=[]))
    code, loaded = imported_by_command(["run", str(tmp_path / "space.yaml"), "--storage", str(tmp_path / "studies")],
                                       ("ray", "mlflow", "optuna", "matplotlib", "datasets", "lm_eval", "torch"))
    assert code == 2 and loaded == ["torch"], loaded
    assert not (tmp_path / "studies").exists()


@pytest.mark.parametrize("argv", [["--help"], ["--version"], ["run", "--help"], ["run", "space.yaml", "--bogus"],
                                  ["status", "s3://"]], ids=["help", "version", "run-help", "bad-flag", "no-bucket"])
def test_the_command_line_answers_without_torch(argv):
    code, loaded = imported_by_command(argv, ("torch", "ray", "mlflow", "pyarrow"))
    assert code in (0, 2) and loaded == [], loaded


def test_version_names_the_installed_package():
    from importlib.metadata import version

    done = subprocess.run([str(LAPSTUDY), "--version"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout.strip() == f"lapstudy {version('lapstudy')}"


# ---- a study whose every trial failed -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def doomed_study(tmp_path_factory):
    """Two trials that both fail at run time, where no check before could see it: one diverges (lr 1e6), one asks
    for the Triton STLT backend on a CPU without Triton's interpreter (an error inside the trial, retried once)."""
    root = tmp_path_factory.mktemp("doomed")
    space = tiny_space(name="doomed", epochs=1, sampler={"kind": "random"},
                       parameters={"mixer": ["attention", "stlt"],
                                   "lr": {"type": "log_float", "low": 1.0e-3, "high": 1.0e6}},
                       conditional=[{"when": {"mixer": "stlt"}, "fixed": {"stlt_backend": "triton"}}],
                       points_to_evaluate=[{"mixer": "attention", "lr": 1.0e6}, {"mixer": "stlt", "lr": 1.0e-3}])
    write_space(root / "doomed.yaml", space)
    with private_ray_tmp("lsd") as ray_tmp:
        env = study_env(ray_tmp)
        env.pop("TRITON_INTERPRET", None)
        run = subprocess.run([str(LAPSTUDY), "run", "doomed.yaml", "--storage", "studies", "--max-failures", "0"],
                             cwd=root, env=env, capture_output=True, text=True, timeout=600)
        shutil.rmtree(ray_tmp, ignore_errors=True)
    return {"run": run, "dir": root / "studies" / "doomed"}


@pytest.mark.slow(seconds=30)
def test_a_study_whose_every_trial_failed_exits_1_saying_why(doomed_study):
    run = doomed_study["run"]
    assert run.returncode == 1, run.stdout[-3000:] + run.stderr[-3000:]
    [line] = [line for line in run.stderr.splitlines() if line.startswith("lapstudy: ")]
    assert "every trial failed (2 of 2)" in line
    assert "training diverged: train_loss is nan at epoch 1 (1)" in line
    assert "backend: 'triton' needs CUDA tensors" in line


@pytest.mark.slow(seconds=30)
def test_the_records_read_without_ray_are_those_ray_tunes_analysis_reads(doomed_study):
    """`lapstudy status` reads Tune's experiment state as JSON; ExperimentAnalysis (Ray's own reader, which unpickles
    every trial) must find the same trials, statuses, params, last results and errors."""
    from ray.tune import ExperimentAnalysis

    from study.folder import StudyFolder
    from study.results import load_records, record_from_trial

    folder = StudyFolder(doomed_study["dir"])
    analysis = ExperimentAnalysis(str(folder.path))
    expected = sorted((record_from_trial(t, folder.space().total_epochs) for t in analysis.trials),
                      key=lambda r: r.trial_id)
    assert load_records(folder) == expected
    assert {r.error.split(":")[0] for r in expected} == {"training diverged", "ValueError"}


@pytest.mark.slow(seconds=30)
def test_status_json_holds_each_trials_status_and_error(doomed_study):
    done = subprocess.run([str(LAPSTUDY), "status", str(doomed_study["dir"]), "--json"], capture_output=True,
                          text=True, timeout=120, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert done.returncode == 0, done.stderr
    document = json.loads(done.stdout)
    rows = {json.loads(line)["trial_id"]: json.loads(line)
            for path in doomed_study["dir"].glob("trial_*/result.json") for line in path.read_text().splitlines()}
    trials = {t["trial_id"]: t for t in document["trials"]}
    assert document["study"] == "doomed" and document["trials_planned"] == 2 and len(trials) == 2
    assert all(t["status"] == "failed" for t in trials.values())
    diverged = next(t for t in trials.values() if t["params"]["mixer"] == "attention")
    assert diverged["trial_id"] in rows and diverged["metrics"] == {"val_acc": None}  # NaN in Ray's record
    assert diverged["error"] == rows[diverged["trial_id"]]["error"]
    assert next(t for t in trials.values() if t["params"]["mixer"] == "stlt")["epochs"] == 0


@pytest.mark.slow(seconds=30)
def test_export_of_a_study_with_nothing_completed_is_refused(doomed_study, tmp_path):
    done = subprocess.run([str(LAPSTUDY), "export", str(doomed_study["dir"]), "--json", "--out", str(tmp_path / "x")],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "nothing to export" in done.stderr and not (tmp_path / "x").exists()


def test_gzip_fixture_is_real_gzip(tmp_path):
    """The not-gzip case above fails for the right reason: the same text compressed is read."""
    from study.evals.humaneval import load_problems

    (tmp_path / "humaneval.jsonl.gz").write_bytes(gzip.compress(HUMANEVAL.read_bytes()))
    assert load_problems(tmp_path / "humaneval.jsonl.gz") == load_problems(HUMANEVAL)
