"""What an install gives: exactly the tested set (requirements.lock, which `make setup`, `make test`, CI and the
cluster image install as pip's constraints), a laptop install (`make quickstart`: the project without extras) that
pulls none of what only tests, servers or GPUs run, and without the `lm` extra evaluations refused in one line."""

from __future__ import annotations

import importlib.metadata
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from packaging.requirements import Requirement
from packaging.version import Version

from study import cli

REPO = Path(__file__).resolve().parents[1]
LOCK = REPO / "requirements.lock"
# What `make quickstart` must not install: Triton (about 1 GB), the tests' S3 server and browser driver, the
# PostgreSQL driver of the cluster's tracking server, lm-evaluation-harness, the test runner.
NOT_ON_A_LAPTOP = {"triton", "moto", "selenium", "psycopg", "psycopg-binary", "lm-eval", "pytest"}


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()  # PEP 503


def locked_versions(text: str) -> dict[str, str]:
    """name -> version of every `name==version` line of a lock (uv's `# via` lines are comments)."""
    pins = (re.match(r"([A-Za-z0-9][A-Za-z0-9._-]*)==(\S+)", line) for line in text.splitlines())
    return {canonical(m[1]): m[2] for m in pins if m}


def installed_versions() -> dict[str, str]:
    """name -> version of every distribution this interpreter imports (the first on sys.path, as import finds it)."""
    versions: dict[str, str] = {}
    for dist in importlib.metadata.distributions():
        versions.setdefault(canonical(dist.metadata["Name"]), dist.version)
    return versions


def drift(locked: dict[str, str], installed: dict[str, str], cpu_build: bool) -> list[str]:
    """One line for every locked distribution not installed at its locked version. Without the lock's CPU build of
    torch (with a GPU, or off Linux, the Makefile and docker/Dockerfile install PyPI's build of the locked release),
    torch's release is compared, not the lock's +cpu tag, and the Triton that build requires is its own."""
    lines = []
    for name, version in sorted(locked.items()):
        have = installed.get(name)
        if not cpu_build and name == "triton":
            continue
        if not cpu_build and name == "torch" and have is not None and Version(have).public == Version(version).public:
            continue
        if have != version:
            lines.append(f"{name}: locked {version}, installed {have or 'nothing'}")
    return lines


def cpu_build_installed() -> bool:
    """What the Makefile asks: Linux, and no GPU that nvidia-smi lists."""
    gpu = shutil.which("nvidia-smi") is not None and subprocess.run(["nvidia-smi", "-L"], capture_output=True,
                                                                    text=True).stdout.strip() != ""
    return sys.platform == "linux" and not gpu


def test_every_locked_distribution_is_installed_at_its_locked_version():
    assert drift(locked_versions(LOCK.read_text()), installed_versions(), cpu_build_installed()) == []


def test_drift_names_each_distribution_that_left_the_lock():
    locked = {"optuna": "5.0.0", "torch": "2.13.0+cpu", "triton": "3.9.0", "moto": "5.2.5", "numpy": "2.4.6"}
    drifted = {"optuna": "5.1.0", "torch": "2.13.0", "triton": "3.7.0", "numpy": "2.4.6"}
    assert drift(locked, drifted, cpu_build=True) == [
        "moto: locked 5.2.5, installed nothing", "optuna: locked 5.0.0, installed 5.1.0",
        "torch: locked 2.13.0+cpu, installed 2.13.0", "triton: locked 3.9.0, installed 3.7.0"]
    # a GPU machine's CUDA build of the locked release, with its own Triton; another release is still drift
    assert drift(locked, drifted, cpu_build=False) == ["moto: locked 5.2.5, installed nothing",
                                                "optuna: locked 5.0.0, installed 5.1.0"]
    assert drift(locked, {**drifted, "torch": "2.12.0"}, cpu_build=False)[-1] == \
        "torch: locked 2.13.0+cpu, installed 2.12.0"
    assert locked_versions("# header\nray==2.60.0\n    # via lapstudy\nPyYAML==6.0.4\n") == {"ray": "2.60.0",
                                                                                          "pyyaml": "6.0.4"}


def project_requirements() -> list[Requirement]:
    """pyproject.toml's requirements, of the project and of every extra, but the extras' references to each other."""
    import tomllib

    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    texts = [*project["dependencies"], *(t for extra in project["optional-dependencies"].values() for t in extra)]
    return [r for r in map(Requirement, texts) if canonical(r.name) != "lapstudy"]


def test_every_requirement_has_an_upper_bound_and_the_lock_satisfies_it():
    """A new major release waits for a lock that was tested with it; and pyproject.toml and the lock agree (an edit
    of the first without `make lock` is found here)."""
    locked = locked_versions(LOCK.read_text())
    for requirement in project_requirements():
        bounded = [s for s in requirement.specifier if s.operator in ("<", "<=", "==", "~=")]
        assert bounded, f"{requirement}: no upper bound"
        assert requirement.specifier.contains(locked[canonical(requirement.name)], prereleases=True), \
            f"{requirement}: the lock has {locked[canonical(requirement.name)]}"


def requirement_closure(name: str, extras: tuple[str, ...] = ()) -> set[str]:
    """The distributions `pip install name[extras]` installs, from the installed distributions' metadata: each
    requirement whose marker holds here (with the extras asked of its distribution), transitively."""
    asked: dict[str, set[str]] = {}
    todo = [(canonical(name), set(extras))]
    while todo:
        dist, wanted = todo.pop()
        if dist in asked and wanted <= asked[dist]:
            continue
        asked[dist] = asked.get(dist, set()) | wanted
        for text in importlib.metadata.requires(dist) or []:
            requirement = Requirement(text)
            marker = requirement.marker
            if marker is None or any(marker.evaluate({"extra": e}) for e in ("", *asked[dist])):
                todo.append((canonical(requirement.name), set(requirement.extras)))
    return set(asked)


def test_the_laptop_install_pulls_nothing_that_only_tests_servers_or_gpus_run():
    laptop, everything = requirement_closure("lapstudy"), requirement_closure("lapstudy", ("dev",))
    # torch's CUDA build requires Triton itself (a GPU machine gets it with torch)
    cuda_torch = Version(importlib.metadata.version("torch")).local != "cpu"
    assert laptop & NOT_ON_A_LAPTOP == ({"triton"} if cuda_torch and "triton" in laptop else set())
    assert NOT_ON_A_LAPTOP <= everything  # what `make test` installs
    assert {"ray", "optuna", "mlflow", "torch", "scikit-learn"} <= laptop


def test_study_modules_import_without_the_harness():
    """A laptop install has no lm_eval: the CLI, the study driver, a trial's loop and the evaluation modules that
    need no harness still import (lm_eval is made unimportable in a fresh interpreter)."""
    probe = ("import sys; sys.modules['lm_eval'] = None; "
             "import study.cli, study.driver, study.loop, study.train, study.evals.cli, study.evals.gsm8k; "
             "print('lm_eval' in sys.modules and sys.modules['lm_eval'] is not None)")
    done = subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "False"


NEEDS_LM = "language-model evaluations need lm-evaluation-harness, which is not installed: pip install 'lapstudy[lm]'"


@pytest.fixture
def without_harness(monkeypatch):
    monkeypatch.setitem(sys.modules, "lm_eval", None)  # `import lm_eval` raises ImportError, as where it is absent


def test_the_lm_extra_installs_the_harness():
    assert "lm-eval" in requirement_closure("lapstudy", ("lm",)) - requirement_closure("lapstudy")


def test_a_space_with_evaluations_is_refused_in_one_line_without_the_harness(without_harness, tmp_path, capfd):
    space = yaml.safe_load((REPO / "search_spaces" / "quickstart_lm.yaml").read_text())
    space["evaluate"] = {"tasks": ["arc_easy"], "include_path": [str(REPO / "tests" / "fixtures" / "evals")]}
    (tmp_path / "space.yaml").write_text(yaml.safe_dump(space))
    code = cli.main(["run", str(tmp_path / "space.yaml"), "--storage", str(tmp_path / "studies")])
    err = capfd.readouterr().err.strip()
    assert (code, err.splitlines()) == (2, [f"lapstudy: error: evaluate: {NEEDS_LM}"])
    assert not (tmp_path / "studies").exists()


def test_lapstudy_eval_is_refused_in_one_line_without_the_harness(without_harness, tmp_path, capfd):
    code = cli.main(["eval", str(tmp_path / "run.yaml"), "--tasks", "arc_easy"])
    assert (code, capfd.readouterr().err.strip().splitlines()) == (2, [f"lapstudy: error: lapstudy eval: {NEEDS_LM}"])
