"""The sandbox that runs HumanEval's model-generated code (study/evals/sandbox.py), and the pass@k estimator.

Each check runs a real program in the child process and looks at the outcome from outside: the file that must not
exist, the scratch folder that must be gone, the parent that must survive. pass@k is compared with its definition by
enumerating every k-subset of the samples."""

from __future__ import annotations

import glob
import itertools
import os
import tempfile
from fractions import Fraction
from pathlib import Path

import pytest

from study.errors import UserError
from study.evals import sandbox
from study.evals.sandbox import Limits, mean_pass_at_k, pass_at_k, run_program, run_programs

FAST = Limits(cpu_s=1, wall_s=3.0, memory_mb=256, file_size_mb=1)


def run(program: str, limits: Limits = FAST):
    return run_program(program, allow_code_execution=True, limits=limits)


def test_a_correct_solution_passes_and_a_wrong_one_fails():
    tests = "\ndef check(f):\n    assert f(2, 3) == 5\n    assert f(0, 0) == 0\ncheck(add)\n"
    good = run("def add(a, b):\n    return a + b\n" + tests)
    bad = run("def add(a, b):\n    return a * b\n" + tests)
    assert good.status == "passed" and good.passed and good.reason == ""
    assert bad.status == "failed" and not bad.passed and bad.reason.startswith("AssertionError")


def test_an_early_exit_does_not_pass():
    for program in ("import os\nos._exit(0)\nassert False", "import sys\nsys.exit(0)\nassert False"):
        assert run(program).status == "failed"


def test_an_infinite_loop_is_stopped_at_the_cpu_limit():
    result = run("while True:\n    pass\n")
    assert result.status == "timed_out" and result.limit == "cpu"
    assert result.seconds < FAST.wall_s


def test_a_sleeping_program_is_killed_at_the_wall_clock_limit_with_its_children_group():
    result = run("import time\ntime.sleep(60)\n", Limits(cpu_s=5, wall_s=1.0))
    assert result.status == "timed_out" and result.limit == "wall"
    assert 1.0 <= result.seconds < 5


def test_a_memory_bomb_is_contained():
    result = run("x = []\nwhile True:\n    x.append(bytearray(10**7))\n")
    assert result.status == "failed" and result.limit == "memory", result
    # the parent is fine: it can still allocate and run another program
    assert len(bytearray(10**8)) == 10**8
    assert run("pass").passed


def test_a_write_outside_the_scratch_directory_is_refused_and_the_file_does_not_exist():
    target = Path(tempfile.gettempdir()) / f"lapstudy-escape-{os.getpid()}.txt"
    target.unlink(missing_ok=True)
    for program in (f"open({str(target)!r}, 'w').write('x')",
                    f"import os\nfd = os.open({str(target)!r}, os.O_WRONLY | os.O_CREAT)",
                    f"open('inside', 'w').close()\nimport os\nos.rename('inside', {str(target)!r})",
                    f"import os\nos.symlink({str(target)!r}, 'link')\nopen('link', 'w').write('x')",
                    f"import os\nd = os.open({str(target.parent)!r}, os.O_RDONLY)\n"
                    f"os.open({target.name!r}, os.O_WRONLY | os.O_CREAT, dir_fd=d)"):
        result = run(program)
        assert result.status == "failed" and result.limit == "sandbox", (program, result)
        assert not target.exists()
    # inside the scratch directory it may write, rename and remove what it likes
    inside = ("import os, shutil, tempfile\nopen('a', 'w').write('x')\nos.mkdir('d')\nos.rename('a', 'd/b')\n"
              "tempfile.NamedTemporaryFile().write(b'y')\nshutil.rmtree('d')\n")
    assert run(inside).passed


def test_processes_and_raised_limits_are_refused():
    for program in ("import subprocess\nsubprocess.run(['true'])", "import os\nos.system('true')",
                    "import os\nos.fork()", "import os\nos.kill(1, 0)",
                    "import resource\nresource.setrlimit(resource.RLIMIT_AS, (-1, -1))"):
        result = run(program)
        assert result.status == "failed" and result.limit == "sandbox", (program, result)


def test_a_file_larger_than_the_limit_cannot_be_written():
    result = run("open('big', 'wb').write(b'x' * (2 << 20))")
    assert result.status == "failed" and result.limit == "file_size"


def test_the_environment_carries_no_secret_of_the_parent(monkeypatch):
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "fake-secret-for-the-test")
    monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", "fake-password")
    monkeypatch.setenv("HF_TOKEN", "fake-token")
    result = run("import os, json\nprint(json.dumps(dict(os.environ)))")
    assert result.passed
    assert "fake-secret-for-the-test" not in result.stdout and "AWS_SECRET_ACCESS_KEY" not in result.stdout
    assert "fake-password" not in result.stdout and "fake-token" not in result.stdout
    import json

    env = json.loads(result.stdout)
    assert Path(env["HOME"]).name.startswith("lapstudy-sandbox-")


def test_the_scratch_directory_is_removed_afterwards():
    before = set(glob.glob(os.path.join(tempfile.gettempdir(), "lapstudy-sandbox-*")))
    result = run("import os\nprint(os.getcwd())\nos.mkdir('sub')\nopen('sub/f', 'w').write('x')\nos.chmod('sub', 0o500)")
    assert result.passed
    scratch = result.stdout.strip()
    assert Path(scratch).name.startswith("lapstudy-sandbox-")
    assert not os.path.exists(scratch)
    assert set(glob.glob(os.path.join(tempfile.gettempdir(), "lapstudy-sandbox-*"))) <= before


def test_without_the_flag_nothing_is_executed(tmp_path, monkeypatch):
    marker = tmp_path / "ran"
    program = f"open({str(marker)!r}, 'w').write('x')"
    started = []
    monkeypatch.setattr(sandbox.subprocess, "Popen", lambda *a, **k: started.append(a))
    for allow in (False, None, "yes", 1):
        with pytest.raises(UserError, match="--allow-code-execution"):
            run_program(program, allow_code_execution=allow)
        with pytest.raises(UserError, match="--allow-code-execution"):
            run_programs([program], allow_code_execution=allow)
    assert started == [] and not marker.exists()


def test_programs_run_side_by_side_in_order():
    results = run_programs(["assert True", "assert False", "pass"], allow_code_execution=True, limits=FAST, workers=2)
    assert [r.status for r in results] == ["passed", "failed", "passed"]


# ---- pass@k -----------------------------------------------------------------------------------------------------------

def _pass_at_k_by_enumeration(n: int, c: int, k: int) -> Fraction:
    """The share of the k-subsets of n samples (c of them correct) that hold at least one correct sample."""
    samples = [True] * c + [False] * (n - c)
    subsets = list(itertools.combinations(range(n), k))
    return Fraction(sum(any(samples[i] for i in s) for s in subsets), len(subsets))


@pytest.mark.parametrize("n", [1, 2, 3, 5, 8, 10])
def test_pass_at_k_equals_the_share_of_k_subsets_with_a_correct_sample(n):
    for c in range(n + 1):
        for k in range(1, n + 1):
            assert pass_at_k(n, c, k) == pytest.approx(float(_pass_at_k_by_enumeration(n, c, k)), abs=1e-12)


def test_pass_at_k_known_values_and_stability():
    assert pass_at_k(10, 3, 1) == pytest.approx(0.3)
    assert pass_at_k(200, 0, 100) == 0.0 and pass_at_k(200, 101, 100) == 1.0
    # C(200, 100) is ~9e58: the product form stays exact where the binomials would be huge
    from math import comb

    assert pass_at_k(200, 5, 100) == pytest.approx(1 - comb(195, 100) / comb(200, 100), rel=1e-12)
    assert mean_pass_at_k([[True, False], [False, False]], 1) == pytest.approx(0.25)
    for bad in ((3, 4, 1), (3, 1, 4), (3, 1, 0)):
        with pytest.raises(ValueError):
            pass_at_k(*bad)
