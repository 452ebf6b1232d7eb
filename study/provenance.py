"""Where a study's code came from: the git commit of the checkout lapstudy runs from (when it is one) and the
versions of the libraries whose behaviour the numbers depend on. Recorded on the study's MLflow run."""

from __future__ import annotations

import platform
import subprocess
from importlib import metadata
from pathlib import Path

PACKAGES = ("lapstudy", "torch", "ray", "optuna", "mlflow", "triton", "numpy")


def provenance() -> dict[str, str]:
    """`lapstudy.git_commit` (with `-dirty` when the checkout has uncommitted changes) where the code is a git
    checkout, and `lapstudy.version.<package>` for each installed package of PACKAGES, and Python's version."""
    found = {"lapstudy.version.python": platform.python_version()}
    for package in PACKAGES:
        try:
            found[f"lapstudy.version.{package}"] = metadata.version(package)
        except metadata.PackageNotFoundError:
            continue
    commit = _git_commit(Path(__file__).resolve().parent)
    if commit:
        found["lapstudy.git_commit"] = commit
    return found


def _git_commit(folder: Path) -> str | None:
    try:
        head = subprocess.run(["git", "-C", str(folder), "rev-parse", "HEAD"], capture_output=True, text=True,
                              timeout=10)
        if head.returncode != 0:
            return None
        dirty = subprocess.run(["git", "-C", str(folder), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10)
        return head.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")
    except (OSError, subprocess.TimeoutExpired):  # no git on this machine
        return None
