"""How long the `lapstudy` command line takes to answer: each command's wall time (the median of --repeats runs, the
commands taking turns so that load drift falls on all of them), against its target and beside two references
measured in the same rounds: a bare interpreter start, and `import torch`, which the space's model rules need (the
floor of a refusal that checks them).

- `help`, `version`, `bad_flag` (an unknown flag), `no_bucket` (`--storage s3://`): under 1 s, no torch;
- `bad_space` (a field the schema does not know) and `impossible_corner` (`mixer: stlt` with k searched over 0..4,
  refused by the model's rule at a corner): under 2 s, before Ray, MLflow, Optuna or matplotlib are imported;
- `status` and `export_json` of a finished one-trial study (run first, unless --study names one): status under 3 s;
- `ui`: from the command's start until the MLflow UI answers HTTP: under 20 s.

    python bench/cli.py [--repeats 5] [--study STUDY_DIR]

Prints one JSON object: seconds, targets, the ratio of each to its target, and the references.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import yaml

LAPSTUDY = Path(sys.executable).with_name("lapstudy")
TARGETS_S = {"help": 1.0, "version": 1.0, "bad_flag": 1.0, "no_bucket": 1.0, "bad_space": 2.0,
             "impossible_corner": 2.0, "status": 3.0, "ui": 20.0}
SPACE = {"name": "bench_cli", "task": "classification", "dataset": {"source": "digits"}, "metric": "val_acc",
         "mode": "max", "epochs": 1, "num_samples": 1, "early_stopping": "none", "geometry": {"max_batches": 1},
         "fixed": {"preset": "vit_tiny_digits", "depth": 2, "batch_size": 64},
         "parameters": {"lr": {"type": "log_float", "low": 1.0e-3, "high": 3.0e-3}}}


def timed(command: list[str], env: dict, cwd: Path, expect: int) -> float:
    started = time.perf_counter()
    done = subprocess.run(command, env=env, cwd=cwd, capture_output=True, text=True, timeout=600)
    seconds = time.perf_counter() - started
    if done.returncode != expect:
        raise SystemExit(f"{' '.join(command)}: exit code {done.returncode}, expected {expect}\n{done.stderr[-2000:]}")
    return seconds


def ui_answers(study: Path, env: dict, cwd: Path) -> float:
    """Seconds from `lapstudy ui` starting until its UI answers; the server is stopped after."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    started = time.perf_counter()
    server = subprocess.Popen([str(LAPSTUDY), "ui", str(study), "--port", str(port)], env=env, cwd=cwd,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=2).close()
                return time.perf_counter() - started
            except OSError:
                if server.poll() is not None:
                    raise SystemExit(f"lapstudy ui exited with {server.returncode} before answering") from None
                if time.perf_counter() - started > 300:
                    raise SystemExit("lapstudy ui did not answer within 300 s") from None
                time.sleep(0.1)
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(timeout=60)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--study", type=Path, help="a finished study folder for status, export and ui")
    args = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="lsbench"))
    try:
        measure(args, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def measure(args, work: Path) -> None:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "MLFLOW_DISABLE_TELEMETRY": "true", "RAY_USAGE_STATS_ENABLED": "0",
           "RAY_TMPDIR": str(work / "ray")}
    (work / "space.yaml").write_text(yaml.safe_dump(SPACE))
    (work / "unknown_field.yaml").write_text(yaml.safe_dump({**SPACE, "epoch": 3}))
    (work / "impossible.yaml").write_text(yaml.safe_dump({
        **SPACE, "fixed": {**SPACE["fixed"], "mixer": "stlt"}, "parameters": {"k": {"type": "int", "low": 0,
                                                                                      "high": 4}}}))
    study = args.study
    if study is None:
        timed([str(LAPSTUDY), "run", "space.yaml", "--storage", "studies"], env, work, 0)
        study = work / "studies" / SPACE["name"]
    study = study.resolve()

    commands = {
        "python": ([sys.executable, "-c", "pass"], 0),
        "import_torch": ([sys.executable, "-c", "import torch"], 0),
        "help": ([str(LAPSTUDY), "--help"], 0),
        "version": ([str(LAPSTUDY), "--version"], 0),
        "bad_flag": ([str(LAPSTUDY), "run", "space.yaml", "--epochs", "3"], 2),
        "no_bucket": ([str(LAPSTUDY), "run", "space.yaml", "--storage", "s3://"], 2),
        "bad_space": ([str(LAPSTUDY), "run", "unknown_field.yaml", "--storage", "refused"], 2),
        "impossible_corner": ([str(LAPSTUDY), "run", "impossible.yaml", "--storage", "refused"], 2),
        "status": ([str(LAPSTUDY), "status", str(study)], 0),
        "export_json": ([str(LAPSTUDY), "export", str(study), "--json", "--out", str(work / "exported")], 0),
    }
    seconds: dict[str, list[float]] = {name: [] for name in [*commands, "ui"]}
    for _ in range(args.repeats):
        for name, (command, expect) in commands.items():
            seconds[name].append(timed(command, env, work, expect))
        seconds["ui"].append(ui_answers(study, env, work))
    if (work / "refused").exists():
        raise SystemExit("a refused command wrote its study folder")

    median = {name: round(statistics.median(values), 3) for name, values in seconds.items()}
    print(json.dumps({
        "seconds": {name: median[name] for name in TARGETS_S | {"export_json": None}},
        "targets_s": TARGETS_S,
        "ratio_to_target": {name: round(median[name] / target, 3) for name, target in TARGETS_S.items()},
        "within_target": {name: median[name] < target for name, target in TARGETS_S.items()},
        "reference_s": {"python": median["python"], "import_torch": median["import_torch"]},
        "refusal_over_import_torch": {name: round(median[name] / median["import_torch"], 3)
                                      for name in ("bad_space", "impossible_corner", "status")},
        "spread_s": {name: round(max(values) - min(values), 3) for name, values in seconds.items()},
        "repeats": args.repeats,
        "load_average_1min": round(os.getloadavg()[0], 2),
    }, indent=2))


if __name__ == "__main__":
    main()
