"""Search spaces, run configs, sizing, sampling, Pareto sets and MLflow bookkeeping, in-process (no Ray cluster)."""

from __future__ import annotations

import copy
import itertools
import math
import time
from pathlib import Path

import optuna
import pytest
import yaml

from study.cli import main
from study.errors import UserError
from study.optim import WarmupCosine
from study.resources import trains_in_trial, trial_concurrency, trial_driver_resources
from study.results import TrialRecord, best_records
from study.runspec import Resources, check_run_config, complete_hyperparameters
from study.search import DefineByRun, make_sampler, make_scheduler
from study.space import load_space, parse_space
from study.space_corners import check_configs, corner_configs
from study.status import TrialStatus
from study.yamlio import parse_yaml

REPO = Path(__file__).resolve().parents[1]
SPACES = sorted((REPO / "search_spaces").glob("*.yaml"))
DIGITS = {"num_classes": 10, "image_size": 8, "in_chans": 1}  # what the digits source fixes


def quickstart() -> dict:
    return yaml.safe_load((REPO / "search_spaces" / "quickstart.yaml").read_text())


@pytest.mark.parametrize("path", SPACES, ids=[p.name for p in SPACES])
def test_every_shipped_space_validates_and_builds_its_extreme_configs(path):
    space = load_space(path)
    assert check_configs(space) > 0


def test_quickstart_builds_with_the_data_it_runs_on():
    assert check_configs(load_space(REPO / "search_spaces" / "quickstart.yaml"), DIGITS) >= 2


def test_yaml_reads_exponent_floats_as_numbers():
    assert parse_yaml("lr: 1e-3\nwd: 5E-2\nn: 10\nname: 1e3x") == {"lr": 1e-3, "wd": 5e-2, "n": 10, "name": "1e3x"}


BAD_SPACES = [
    # (change to the quickstart, words the one-line error must contain)
    (lambda d: d["parameters"].update(foo=[1, 2]), ["parameters.foo", "not a hyperparameter", "lr"]),
    (lambda d: d["conditional"][0]["parameters"].update(k={"type": "int", "low": 0, "high": 5}),
     ["conditional[0].parameters.k = 5", "0..4"]),
    (lambda d: d["parameters"].update(lr={"type": "log_float", "low": 0.0, "high": 1.0}), ["parameters.lr", "low > 0"]),
    (lambda d: d["parameters"].update(laplacian_schedule=[]), ["parameters.laplacian_schedule", "at least 1"]),
    (lambda d: d.update(metric="val_bpb"), ["metric", "val_acc"]),
    (lambda d: d.update(mode="maximise"), ["mode", "'min'"]),
    (lambda d: d.update(sampler="bayes"), ["sampler.kind", "'tpe'", "'nsga2'"]),
    (lambda d: d.update(dataset={"source": "mnist"}), ["dataset", "digits", "pydoc_text"]),
    (lambda d: d.update(dataset={"source": "pydoc_text"}),
     ["dataset", "gives text, but task classification reads images", "tasks that read text: language_modeling"]),
    (lambda d: d.update(epochs=0), ["epochs", "greater than or equal to 1"]),
    (lambda d: d.update(task="segmentation"), ["task", "classification"]),
    (lambda d: d.update(early_stopping={"kind": "asha", "grace_period": 50}), ["grace_period", "epochs"]),
    (lambda d: d.update(metric=["val_acc", "samples_per_s"], mode=["max", "max"]), ["early_stopping", "none"]),
    (lambda d: d.update(metric=["val_acc", "samples_per_s"], mode=["max"], early_stopping="none"),
     ["mode", "one mode"]),
    (lambda d: d.update(sampler="grid"), ["grid", "conditional"]),
    (lambda d: d["points_to_evaluate"].append({"lr": 1e-3, "laplacian_schedule": "uniform", "k": 9}),
     ["points_to_evaluate[2].k", "0..4"]),
    (lambda d: d["points_to_evaluate"].append({"lr": 3e-3, "laplacian_schedule": "ramp", "k": 1}),
     ["points_to_evaluate[2].k", "not a parameter"]),
    (lambda d: d["conditional"][0]["when"].update(laplacian_schedule="zigzag"),
     ["conditional[0].when.laplacian_schedule", "ramp"]),
    (lambda d: d["conditional"][0]["when"].update(depth=4), ["conditional[0].when.depth", "not a parameter"]),
    (lambda d: d["fixed"].update(lr=1e-3), ["lr", "already defined"]),
    (lambda d: d["fixed"].update(weight_decay=-0.1), ["weight_decay", "greater than or equal to 0"]),
    (lambda d: d["fixed"].update(optimizer="adam"), ["optimizer", "'adamw'", "'lamb'", "'sgd'"]),
    (lambda d: d["fixed"].update(preset="gpt_tiny"), ["model", "vit"]),
    (lambda d: d["conditional"][1]["parameters"].update(start_layer={"type": "int", "low": 0, "high": 9}),
     ["start_layer = 9"]),
    (lambda d: d["fixed"].update(num_classes=7), ["fixed.num_classes", "dataset fixes it to 10"]),
    (lambda d: d["fixed"].update(preset="vit_b16"), ["patch_size", "image_size=8 (from the dataset)"]),
    (lambda d: d.update(extra_field=1), ["extra_field", "not a known field"]),
    (lambda d: d.update(evaluate={"tasks": ["arc_easy"]}), ["evaluate", "language models", "classification"]),
]


def _language_model_space(**changes) -> dict:
    return {**yaml.safe_load((REPO / "search_spaces" / "quickstart_lm.yaml").read_text()), **changes}


@pytest.mark.parametrize("evaluate, words", [
    # Running model-written code is the command line's decision (--allow-code-execution), never a file's.
    ({"tasks": ["humaneval"], "allow_code_execution": True}, ["evaluate.0", "allow_code_execution",
                                                             "--allow-code-execution"]),
    ({"tasks": []}, ["evaluate.0.tasks", "at least 1"]),
    ({"tasks": ["mmlu"], "limit": 0}, ["evaluate.0.limit"]),
    ({"tasks": ["gsm8k_chat"], "num_samples": 10}, ["evaluate", "temperature", "num_samples 10"]),
    ([{"tasks": ["mmlu", "gsm8k_chat"]}, {"tasks": ["gsm8k_chat"], "num_samples": 10, "temperature": 1.0}],
     ["evaluate", "gsm8k_chat in more than one entry"]),
])
def test_bad_benchmarks_fail_with_one_line_naming_the_field(evaluate, words):
    with pytest.raises(UserError) as info:
        parse_space(_language_model_space(evaluate=evaluate))
    message = str(info.value)
    assert "\n" not in message and all(word in message for word in words), message


def test_a_hub_benchmark_offline_fails_before_anything_starts_naming_include_path(monkeypatch):
    from study.evals.evaluate import check_evaluations

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    space = parse_space(_language_model_space(evaluate={"tasks": ["arc_challenge"]}))
    with pytest.raises(UserError, match="arc_challenge.*--include-path"):
        check_evaluations(space)


def test_benchmark_task_folders_are_read_from_the_space_files_folder(tmp_path):
    space = _language_model_space(evaluate={"tasks": ["arc_easy"], "include_path": ["tasks", "~/more"]},
                                  stages=[{"name": "again", "task": "language_modeling", "epochs": 1,
                                           "evaluate": {"tasks": ["mmlu"], "include_path": ["../shared"]}}])
    (tmp_path / "space.yaml").write_text(yaml.safe_dump(space))
    loaded = load_space(tmp_path / "space.yaml")
    assert loaded.evaluate[0].include_path == [str(tmp_path / "tasks"), str(Path("~/more").expanduser())]
    assert loaded.stages[0].evaluate[0].include_path == [str(tmp_path / "../shared")]
    spec = loaded.run_spec(loaded.resolve({"lr": 1e-3, "laplacian_schedule": "uniform", "k": 0}), Resources())
    assert [run.evaluate for _, _, run in spec.stage_runs()] == [loaded.evaluate, loaded.stages[0].evaluate]


def test_the_last_stages_benchmarks_may_be_the_objective_without_asha():
    stages = [{"name": "sft", "task": "language_modeling", "epochs": 1,
               "evaluate": [{"tasks": ["gsm8k_chat"], "num_samples": 10, "temperature": 1.0}]}]
    space = parse_space(_language_model_space(stages=stages, metric="sft/eval_gsm8k_chat_pass_at_10", mode="max",
                                              early_stopping="none"))
    assert space.final_metric_prefixes() == ("sft/eval_gsm8k_chat_",) and not space.reported_every_epoch()
    with pytest.raises(UserError, match="reported at the trial's end only.*early_stopping: none"):
        parse_space(_language_model_space(stages=stages, metric="sft/eval_gsm8k_chat_pass_at_10", mode="max",
                                          early_stopping={"kind": "asha", "grace_period": 1}))
    with pytest.raises(UserError, match="or the last stage's benchmarks \\(sft/eval_gsm8k_chat_<metric>\\)"):
        parse_space(_language_model_space(stages=stages, metric="sft/eval_mmlu_acc", early_stopping="none"))
    assert parse_space(_language_model_space()).reported_every_epoch()


def test_benchmarks_with_their_own_settings_go_in_entries_of_their_own():
    space = parse_space(_language_model_space(evaluate=[
        {"tasks": ["arc_easy", "mmlu"]},
        {"tasks": ["gsm8k_chat"], "num_samples": 10, "temperature": 1.0}]))
    assert [(e.tasks, e.num_samples, e.temperature) for e in space.evaluate] == [
        (["arc_easy", "mmlu"], 1, 0.0), (["gsm8k_chat"], 10, 1.0)]
    assert parse_space(_language_model_space()).evaluate == []


@pytest.mark.parametrize("change, words", BAD_SPACES, ids=[str(i) for i in range(len(BAD_SPACES))])
def test_bad_spaces_fail_with_one_line_naming_the_field(change, words):
    data = quickstart()
    change(data)
    with pytest.raises(UserError) as info:
        check_configs(parse_space(data), DIGITS)
    message = str(info.value)
    assert "\n" not in message
    for word in words:
        assert word in message, message


def test_define_by_run_samples_conditional_parameters_only_when_their_condition_holds():
    space = parse_space(quickstart())
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=0), direction="maximize")
    seen = set()
    for _ in range(40):
        trial = study.ask()
        DefineByRun(space)(trial)
        params = trial.params
        seen.add(params["laplacian_schedule"])
        if params["laplacian_schedule"] == "uniform":
            assert set(params) == {"lr", "laplacian_schedule", "k"}
        else:
            assert set(params) == {"lr", "laplacian_schedule", "start_layer", "max_count"}
        resolved = space.resolve(params)
        if params["laplacian_schedule"] == "ramp":
            assert resolved["increment"] == 1  # the group's fixed value comes with it
        hyperparameters = complete_hyperparameters(resolved, DIGITS, space.task, epochs=space.epochs)
        assert hyperparameters["lr"] == params["lr"] and hyperparameters["num_classes"] == 10
        study.tell(trial, 0.5)
    assert seen == {"uniform", "ramp"}


def test_grid_sampler_covers_the_paper_grid_once():
    space = load_space(REPO / "search_spaces" / "vit_cifar100_k_grid.yaml")
    assert space.default_num_samples() == 6
    study = optuna.create_study(sampler=make_sampler(space, seed=0), direction="maximize")
    study.optimize(lambda trial: DefineByRun(space)(trial) or 0.0, n_trials=10)  # the grid stops it after 6
    assert sorted(t.params["k"] for t in study.trials) == [0, 3, 6, 9, 11, 12]


def test_asha_counts_epochs_not_training_iterations():
    scheduler = make_scheduler(parse_space(quickstart()))
    assert scheduler._time_attr == "epoch" and scheduler._max_t == 20


@pytest.mark.parametrize(
    "cluster, resources, requested, expected",
    [
        ({"CPU": 2}, Resources(workers=1, cpus_per_worker=1), None, 1),
        ({"CPU": 2}, Resources(workers=2, cpus_per_worker=0.5), None, 1),
        ({"CPU": 2}, Resources(workers=1, cpus_per_worker=0.5), 2, 2),
        ({"CPU": 32, "GPU": 4}, Resources(workers=2, cpus_per_worker=4, gpus_per_worker=1), None, 2),
        ({"CPU": 9}, Resources(workers=1, cpus_per_worker=2), None, 4),
    ],
)
def test_concurrency_keeps_workers_fed_and_a_cpu_for_ray_data(cluster, resources, requested, expected):
    assert trial_concurrency(resources, cluster, [cluster], requested) == expected


@pytest.mark.parametrize(
    "resources, cluster, worker_resources, in_process",
    [
        (Resources(workers=1, cpus_per_worker=1), {"CPU": 2}, {}, True),  # the laptop: the trial trains itself
        (Resources(workers=1, cpus_per_worker=4, gpus_per_worker=1), {"CPU": 8, "GPU": 1}, {}, True),
        (Resources(workers=2, cpus_per_worker=0.5), {"CPU": 2}, {}, False),  # DDP needs a worker group
        (Resources(workers=1, cpus_per_worker=1), {"CPU": 2, "spot": 1}, {"spot": 1}, False),  # placed workers
        (Resources(workers=1, cpus_per_worker=1), {"CPU": 8, "lapstudy_driver": 1}, {}, False),  # drivers on the head
    ],
)
def test_a_trial_trains_in_its_own_process_only_when_one_unplaced_worker_is_all_it_needs(
        resources, cluster, worker_resources, in_process):
    assert trains_in_trial(resources, cluster, worker_resources) is in_process
    asked = trial_driver_resources(cluster, resources, in_process)
    if in_process:  # the trial's process holds what its one worker would have held
        assert asked == {"CPU": resources.cpus_per_worker,
                         **({"GPU": resources.gpus_per_worker} if resources.gpus_per_worker else {})}
    else:  # a driver that only waits on its TorchTrainer
        assert asked.get("CPU") == 0 and "GPU" not in asked
        assert ("lapstudy_driver" in asked) == ("lapstudy_driver" in cluster)


@pytest.mark.parametrize(
    "cluster, resources, requested, words",
    [
        ({"CPU": 2}, Resources(workers=2, cpus_per_worker=1), None, ["--workers-per-trial 2", "Ray Data", "at most 1"]),
        ({"CPU": 2}, Resources(workers=1, cpus_per_worker=1), 2, ["--max-concurrent 2", "only 1"]),
        ({"CPU": 2}, Resources(workers=1, cpus_per_worker=4), None, ["--cpus-per-worker 4", "largest: 2"]),
        ({"CPU": 8}, Resources(workers=1, cpus_per_worker=1, gpus_per_worker=1), None, ["--gpus-per-worker 1"]),
    ],
)
def test_impossible_sizing_is_refused_saying_what_fits(cluster, resources, requested, words):
    with pytest.raises(UserError) as info:
        trial_concurrency(resources, cluster, [cluster], requested)
    for word in words:
        assert word in str(info.value), str(info.value)


def test_warmup_cosine_schedule():
    schedule = WarmupCosine(warmup=4, total=20, min_ratio=0.1)
    assert [schedule(s) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert schedule(4) == 1.0
    assert math.isclose(schedule(12), 0.1 + 0.9 * 0.5, rel_tol=1e-12)  # half-way through the decay
    assert math.isclose(schedule(20), 0.1) and math.isclose(schedule(25), 0.1)


def test_inverse_sqrt_schedule_is_the_transformers_divided_by_its_peak():
    """Vaswani et al. 2017, 5.3: lrate = d^-0.5 min(n^-0.5, n warmup^-1.5) at step n; with `lr` its peak."""
    import torch

    from study.optim import build_schedule
    from study.runspec import train_config

    d, warmup, peak = 512, 40, 7e-4
    train = train_config({"lr": peak, "warmup_epochs": 4, "lr_decay": "inverse_sqrt"})
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=peak)
    schedule = build_schedule(optimizer, train, steps_per_epoch=10, epochs=50)
    paper_peak = d ** -0.5 * warmup ** -0.5
    for n in range(1, 500):  # the lr that step n (1-based) runs at
        paper = d ** -0.5 * min(n ** -0.5, n * warmup ** -1.5)
        assert math.isclose(optimizer.param_groups[0]["lr"], peak * paper / paper_peak, rel_tol=1e-12), n
        optimizer.step()
        schedule.step()
    assert math.isclose(max(peak * d ** -0.5 * min(n ** -0.5, n * warmup ** -1.5) / paper_peak for n in range(1, 500)),
                        peak)
    with pytest.raises(UserError, match="lr_decay: inverse_sqrt.*warmup_epochs > 0"):
        check_run_config({"lr_decay": "inverse_sqrt"}, "classification", where="hyperparameters")


def test_pareto_set_is_exactly_the_non_dominated_trials():
    values = [(0.9, 100.0), (0.8, 300.0), (0.85, 90.0), (0.7, 310.0), (0.9, 100.0), (0.95, 50.0), (0.6, 20.0)]
    records = [TrialRecord(f"t{i}", f"t{i}", TrialStatus.COMPLETED, {}, 3, {"val_acc": a, "samples_per_s": s})
               for i, (a, s) in enumerate(values)]
    records.append(TrialRecord("stopped", "stopped", TrialStatus.EARLY_STOPPED, {}, 1,
                               {"val_acc": 0.99, "samples_per_s": 999}))
    front = {r.trial_id for r in best_records(records, ["val_acc", "samples_per_s"], ["max", "max"])}

    def dominates(p, q):
        return all(x >= y for x, y in zip(p, q)) and p != q

    expected = {f"t{i}" for i, v in enumerate(values) if not any(dominates(w, v) for w in values)}
    assert front == expected == {"t0", "t1", "t3", "t4", "t5"}
    ranked = best_records(records, ["val_loss"], ["min"]) + best_records(records, ["val_acc"], ["max"])
    assert [r.trial_id for r in ranked][:2] == ["t5", "t0"]  # no val_loss anywhere; completed trials only


def test_cli_reports_user_errors_in_one_line_and_leaves_an_existing_study_alone(tmp_path, capsys):
    good = tmp_path / "good.yaml"
    good.write_text(yaml.safe_dump(quickstart()))
    space = tmp_path / "space.yaml"
    data = quickstart()
    data["fixed"]["batch_size"] = -1
    space.write_text(yaml.safe_dump(data))
    existing = tmp_path / "studies" / "quickstart"
    existing.mkdir(parents=True)
    (existing / "study.json").write_text("{}")
    cases = [
        (["run", str(tmp_path / "missing.yaml")], "no such file"),
        (["run", str(good), "--storage", str(tmp_path / "studies")], "already exists"),
        (["run", str(good), "--storage", str(tmp_path / "studies"), "--resume"], "no study to resume"),
        (["run", str(space), "--storage", str(tmp_path / "other")], "fixed.batch_size"),
        (["run", str(good), "--storage", str(tmp_path / "other"), "--workers-per-trial", "0"], "--workers-per-trial"),
        (["run", str(space), "--max-concurrent", "0"], "--max-concurrent"),
        (["export", str(tmp_path)], "not a study folder"),
        (["status", str(tmp_path / "nowhere")], "not a study folder"),
        (["train", str(space)], "run config"),
        (["run"], "required"),
    ]
    for argv, words in cases:
        assert main(argv) == 2, argv
        err = capsys.readouterr().err.strip()
        assert err.count("\n") == 0 and words in err, (argv, err)
    assert (existing / "study.json").read_text() == "{}" and len(list(existing.iterdir())) == 1
    assert not (tmp_path / "other").exists()


def test_run_logger_keeps_one_run_per_trial_and_logs_each_epoch_once(tmp_path):
    from mlflow.tracking import MlflowClient

    from study.folder import local_store
    from study.tracking.run_logger import RunLogger, TrackingTarget
    from study.tracking.runs import TAG_TRIAL, close_run
    from study.tracking.store import ensure_experiment

    uri, artifacts = local_store(tmp_path)
    experiment = ensure_experiment(uri, "s", artifacts, must_be_new=True)

    def logger():
        return RunLogger(TrackingTarget(uri, experiment, "trial_abc_00001", "abc_00001", "s"),
                         {"lr": "0.001", "k": "2"}, "task: classification\n")

    first = logger()
    first.log_epoch(1, {"val_acc": 0.5, "train_loss": 1.0})
    first.log_epoch(2, {"val_acc": 0.6, "train_loss": 0.9})
    close_run(uri, experiment, run_id=None, trial_id="abc_00001", status=TrialStatus.FAILED, error="node lost")
    restarted = logger()  # the trial restarts: same run, live again, epochs 1-2 not logged twice
    assert restarted.run_id == first.run_id
    for epoch, acc in ((2, 0.6), (3, 0.7)):
        restarted.log_epoch(epoch, {"val_acc": acc, "train_loss": 1.0 - acc})
    close_run(uri, experiment, run_id=restarted.run_id, trial_id=None, status=TrialStatus.COMPLETED)
    client = MlflowClient(uri)
    runs = client.search_runs([experiment], filter_string=f"tags.`{TAG_TRIAL}` = 'abc_00001'")
    assert len(runs) == 1
    run = runs[0]
    assert run.info.status == "FINISHED" and run.data.tags["lapstudy.status"] == "completed"
    assert [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, "val_acc")] == [
        (1, 0.5), (2, 0.6), (3, 0.7)]
    assert run.data.params == {"lr": "0.001", "k": "2"}
    assert [a.path for a in client.list_artifacts(run.info.run_id)] == ["config.yaml"]


def test_run_logger_records_system_metrics_of_a_run_shorter_than_one_sampling_interval(tmp_path):
    """MLflow's monitor drops its first sample when stopped within its interval: a short trial still gets one."""
    from mlflow.tracking import MlflowClient

    from study.folder import local_store
    from study.tracking.run_logger import SYSTEM_METRICS_EVERY_S, RunLogger, TrackingTarget
    from study.tracking.store import ensure_experiment

    uri, artifacts = local_store(tmp_path)
    experiment = ensure_experiment(uri, "s", artifacts, must_be_new=True)
    logger = RunLogger(TrackingTarget(uri, experiment, "trial_short", "short", "s"), {}, "", system_metrics=True)
    started = time.monotonic()
    logger.log_epoch(1, {"val_acc": 0.5})
    logger.close()
    assert time.monotonic() - started < SYSTEM_METRICS_EVERY_S
    run = MlflowClient(uri).get_run(logger.run_id)
    assert any(key.startswith("system/cpu") for key in run.data.metrics), sorted(run.data.metrics)


def test_run_logger_records_system_metrics_of_a_run_stopped_while_the_monitor_checks_it(tmp_path, monkeypatch):
    """MLflow's monitor, after its interval, asks for the run's status and drops its sample if it was stopped
    meanwhile (seen in CI with a trial resumed for its last epoch): the run still gets one."""
    from mlflow.tracking import MlflowClient

    from study.folder import local_store
    from study.tracking import run_logger
    from study.tracking.run_logger import RunLogger, TrackingTarget
    from study.tracking.store import ensure_experiment

    monkeypatch.setattr(run_logger, "SYSTEM_METRICS_EVERY_S", 0.5)
    get_run = MlflowClient.get_run

    def slow_get_run(self, run_id):  # the monitor's status check, slow as on a loaded machine
        time.sleep(1.0)
        return get_run(self, run_id)

    uri, artifacts = local_store(tmp_path)
    experiment = ensure_experiment(uri, "s", artifacts, must_be_new=True)
    logger = RunLogger(TrackingTarget(uri, experiment, "trial_cut", "cut", "s"), {}, "", system_metrics=True)
    logger.log_epoch(1, {"val_acc": 0.5})
    after_epoch = _system_samples(uri, logger.run_id)
    monkeypatch.setattr(MlflowClient, "get_run", slow_get_run)
    time.sleep(0.9)  # past the interval: the monitor is in its status check when the run stops
    logger.close()
    monkeypatch.setattr(MlflowClient, "get_run", get_run)
    assert _system_samples(uri, logger.run_id) == after_epoch + [after_epoch[-1] + 1]


def test_run_logger_records_system_metrics_with_an_epoch_before_its_process_dies(tmp_path):
    """A worker killed after its last report never reaches close() (a driver lost at that moment; its resumed trial
    only hands the result back): the epoch it logged brought the machine's metrics with it."""
    from study.folder import local_store
    from study.tracking.run_logger import SYSTEM_METRICS_EVERY_S, RunLogger, TrackingTarget
    from study.tracking.store import ensure_experiment

    uri, artifacts = local_store(tmp_path)
    experiment = ensure_experiment(uri, "s", artifacts, must_be_new=True)
    logger = RunLogger(TrackingTarget(uri, experiment, "trial_killed", "killed", "s"), {}, "", system_metrics=True)
    started = time.monotonic()
    logger.log_epoch(1, {"val_acc": 0.5})
    logger.log_epoch(2, {"val_acc": 0.6})
    samples = _system_samples(uri, logger.run_id)
    assert time.monotonic() - started < SYSTEM_METRICS_EVERY_S  # before MLflow's monitor would have published
    logger.close()  # only to stop its thread: what the run held before is what a killed process leaves
    assert samples == [0, 1]


def _system_samples(uri: str, run_id: str) -> list[int]:
    from mlflow.tracking import MlflowClient

    return [m.step for m in MlflowClient(uri).get_metric_history(run_id, "system/cpu_utilization_percentage")]


def test_run_logger_survives_an_unreachable_tracking_server(monkeypatch):
    from study.tracking.run_logger import RunLogger, TrackingTarget

    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "2")
    logger = RunLogger(TrackingTarget("http://127.0.0.1:9", "0", "t", "t", "s"), {}, "")
    logger.log_epoch(1, {"val_acc": 0.5})  # must neither raise nor lose the metrics
    assert logger.run_id is None and len(logger._pending) == 2


def test_corner_enumeration_covers_every_combination_of_bounds():
    space = parse_space(quickstart())
    combos = [c for c, _ in corner_configs(space) if _ == "parameters"]
    uniform = [c for c in combos if c["laplacian_schedule"] == "uniform"]
    ramp = [c for c in combos if c["laplacian_schedule"] == "ramp"]
    assert len(uniform) == 2 * 2 and len(ramp) == 2 * 2 * 2
    assert {(c["lr"], c["k"]) for c in uniform} == set(itertools.product([1e-3, 6e-3], [0, 4]))


def test_space_copy_is_not_mutated_by_validation():
    data = quickstart()
    before = copy.deepcopy(data)
    check_configs(parse_space(data), DIGITS)
    assert data == before
