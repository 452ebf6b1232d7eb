"""Every sampler kind a space may name gives a searcher that Ray's cloudpickle round-trips, under the locked Optuna
(in this process) and under Optuna 5.1, whose NSGA-II sampler holds a threading lock (in a fresh interpreter with
Optuna 5.1.0 first on its path, from PyPI)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from search_pickle_probe import KINDS, check_round_trip

PROBE = Path(__file__).resolve().parent / "search_pickle_probe.py"
REPO = PROBE.parents[1]
OPTUNA_5_1 = "5.1.0"


@pytest.mark.parametrize("kind", KINDS)
def test_the_searcher_pickles_and_its_copy_goes_on(kind, tmp_path):
    check_round_trip(kind, tmp_path)


@pytest.fixture(scope="module")
def optuna_5_1(tmp_path_factory) -> Path:
    """A folder holding Optuna 5.1.0 alone: its requirements are the locked Optuna's, already installed."""
    folder = tmp_path_factory.mktemp(f"optuna-{OPTUNA_5_1}")
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--target", str(folder),
                    f"optuna=={OPTUNA_5_1}"], check=True)
    return folder


def test_every_searcher_pickles_under_optuna_5_1(optuna_5_1):
    path = os.pathsep.join([str(optuna_5_1), str(REPO), os.environ.get("PYTHONPATH", "")])
    done = subprocess.run([sys.executable, str(PROBE), *KINDS], cwd=REPO, capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": path}, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1] == f"optuna {OPTUNA_5_1}: {' '.join(KINDS)}"
