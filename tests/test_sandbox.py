"""The sandbox that runs HumanEval's model-generated code (study/evals/sandbox.py, isolation.py, sandbox_child.py),
and the pass@k estimator.

Each check runs a real sample through `run_sample`/`run_samples`, the functions HumanEval scoring calls, and looks
at the outcome from outside: the server that must see no connection, the file that must not exist, the process
that must still be alive, the process that must be gone. The hostile programs (tests/sandbox_corpus.py) first switch
off the audit hook from inside, as an adversary would, so what contains them is the operating system's layer.
pass@k is compared with its definition by enumerating every k-subset of the samples."""

from __future__ import annotations

import errno
import itertools
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
from fractions import Fraction
from pathlib import Path

import pytest

from study.errors import UserError
from study.evals import isolation, sandbox
from study.evals.humaneval import program
from study.evals.sandbox import Limits, Sample, mean_pass_at_k, pass_at_k, run_sample, run_samples
from study.evals.sandbox_child import decode, encode
from tests import sandbox_corpus as corpus

FAST = Limits(cpu_s=2, wall_s=8.0, memory_mb=256, file_size_mb=1)
ADD_TEST = "def check(candidate):\n    assert candidate(2, 3) == 5\n    assert candidate(-1, 1) == 0\n"
CORRECT = "def add(a, b):\n    return a + b\n"
WRONG = "def add(a, b):\n    return a * b\n"


def run(solution: str, test: str = ADD_TEST, entry_point: str = "add", limits: Limits = FAST):
    return run_sample(Sample(solution, test, entry_point), allow_code_execution=True, limits=limits)


def run_all(solutions: list[str], limits: Limits = FAST):
    return run_samples([Sample(s, ADD_TEST, "add") for s in solutions], allow_code_execution=True, limits=limits,
                       workers=2)


# ---- honest samples ----------------------------------------------------------------------------------------------

def test_a_correct_solution_passes_and_a_wrong_one_fails():
    good, bad = run_all([CORRECT, WRONG])
    assert good.status == "passed" and good.passed and good.reason == ""
    assert bad.status == "failed" and not bad.passed and bad.reason.startswith("AssertionError")


def test_a_humaneval_problem_with_prompt_helpers_runs_as_human_eval_builds_it():
    """HumanEval/32's shape: the tests call `poly`, a helper of the prompt; the completion calls it too."""
    problem = {"task_id": "t/0", "entry_point": "find_zero",
               "prompt": "import math\n\n\ndef poly(xs, x):\n"
                         "    return sum(c * math.pow(x, i) for i, c in enumerate(xs))"
                         "\n\n\ndef find_zero(xs):\n    \"\"\"A zero of the polynomial xs.\"\"\"\n",
               "test": "def check(candidate):\n    for xs in ([1, 2], [-6, 11, -6, 1], [2, -3, 1]):\n"
                       "        assert abs(poly(xs, candidate(list(xs)))) < 1e-6\n"}
    newton = ("    x = 0.5\n    for _ in range(200):\n"
              "        d = sum(i * c * x ** (i - 1) for i, c in enumerate(xs) if i)\n"
              "        x -= poly(xs, x) / d\n    return x\n")
    results = run_samples([program(problem, newton), program(problem, "    return 0.0\n")],
                          allow_code_execution=True, limits=FAST, workers=2)
    assert [r.status for r in results] == ["passed", "failed"], results


def test_values_cross_between_the_processes_with_their_types():
    test = ("def check(candidate):\n    assert candidate('tuple') == (1, 2) and type(candidate('tuple')) is tuple\n"
            "    assert candidate('dict') == {'a': [1.5, None], (1, 'b'): {2, 3}}\n"
            "    assert candidate('float') != candidate('float')\n"  # nan
            "    try:\n        candidate('raise')\n    except ValueError as e:\n        assert str(e) == 'no'\n"
            "    else:\n        assert False\n")
    solution = ("def f(kind):\n    if kind == 'raise':\n        raise ValueError('no')\n"
                "    return {'tuple': (1, 2), 'dict': {'a': [1.5, None], (1, 'b'): {2, 3}}, "
                "'float': float('nan')}[kind]\n")
    as_list = solution.replace("'tuple': (1, 2)", "'tuple': [1, 2]")
    results = run_samples([Sample(solution, test, "f"), Sample(as_list, test, "f")], allow_code_execution=True,
                          limits=FAST, workers=2)
    assert [r.status for r in results] == ["passed", "failed"], results


def test_the_codec_round_trips_plain_data_and_refuses_anything_else():
    value = [None, True, 3, -2.5, float("inf"), "s", b"\x00\xff", 1 + 2j, (1, [2]), {3}, frozenset({4}), {"k": (5,)}]
    assert decode(encode(value)) == value and type(decode(encode((1,)))) is tuple
    assert type(decode(encode(True))) is bool and type(decode(encode(1))) is int
    for forged in ({"list": [1], "extra": 1}, {"object": "os.system"}, {"dict": [[1]]}, {"complex": ["1", 2.0]}):
        with pytest.raises(ValueError):
            decode(forged)
    with pytest.raises(TypeError):
        encode(object())


# ---- limits ------------------------------------------------------------------------------------------------------

def test_an_infinite_loop_is_stopped_at_the_cpu_limit():
    result = run("while True:\n    pass\n", limits=Limits(cpu_s=1, wall_s=20.0, memory_mb=256))
    assert result.status == "timed_out" and result.limit == "cpu", result
    assert result.seconds < 20.0


def test_a_sleeping_program_is_killed_at_the_wall_clock_limit():
    result = run("import time\ndef add(a, b):\n    time.sleep(60)\n", limits=Limits(cpu_s=5, wall_s=1.5))
    assert result.status == "timed_out" and result.limit == "wall"
    assert 1.5 <= result.seconds < 6


def test_a_memory_bomb_is_contained():
    result = run("x = []\nwhile True:\n    x.append(bytearray(10**7))\n")
    assert result.status == "failed" and result.limit == "memory", result
    assert len(bytearray(10**8)) == 10**8  # the parent is fine
    assert run(CORRECT).passed


def test_a_file_larger_than_the_limit_cannot_be_written():
    result = run("def add(a, b):\n    open('big', 'wb').write(b'x' * (2 << 20))\n")
    assert result.status == "failed" and result.limit == "file_size", result


def test_the_audit_hook_still_refuses_processes_and_outside_writes():
    target = Path("/var/tmp") / f"lapstudy-escape-{os.getpid()}.txt"  # /tmp is the scratch inside
    programs = ["import subprocess\nsubprocess.run(['true'])", "import os\nos.fork()", "import os\nos.kill(1, 0)",
                "import resource\nresource.setrlimit(resource.RLIMIT_AS, (-1, -1))", f"open({str(target)!r}, 'w')"]
    for prog, result in zip(programs, run_all(programs)):
        assert result.status == "failed" and result.limit == "sandbox", (prog, result)
    assert not target.exists()


def test_the_hostile_corpus_gets_past_the_audit_hook():
    """What the tests below contain is not the hook: the corpus switches it off and then starts processes."""
    result = run(corpus.UNHOOK + "import subprocess\nsubprocess.run(['true'], check=True)\n" + CORRECT)
    assert result.passed, result


# ---- secrets -----------------------------------------------------------------------------------------------------

def test_no_secret_of_the_parent_is_readable(monkeypatch, tmp_path):
    secret = "s3cr3t-" + secrets.token_hex(8)
    monkeypatch.setenv("LAPSTUDY_TEST_SECRET", secret)
    credentials = tmp_path / "home" / ".aws" / "credentials"
    credentials.parent.mkdir(parents=True)
    credentials.write_text(f"aws_secret_access_key = {secret}\n")
    project_file = Path(__file__).resolve().parents[1] / "pyproject.toml"
    # a process of the host started with the secret in its environment (what /proc/<pid>/environ shows)
    holder = subprocess.Popen(["sleep", "60"], env={"LAPSTUDY_TEST_SECRET": secret})
    try:
        result = run(corpus.hunt_secrets(secret_name="LAPSTUDY_TEST_SECRET", host_pids=[holder.pid, os.getpid()],
                                         paths=[str(credentials), str(project_file),
                                                os.path.expanduser("~/.bash_history")]) + CORRECT)
    finally:
        holder.kill()
        holder.wait()
    # the hunter hex-encodes what it found, so that the scrubbing of the reason cannot hide an escape
    found = result.stdout
    assert result.passed and "hunted" in found, result
    assert secret.encode().hex() not in found + result.reason and secret not in found
    assert "readable" not in found, found


def test_the_sandbox_holds_the_standard_library_and_an_environment_built_from_nothing():
    project = Path(__file__).resolve().parents[1]
    probe = ("import json, os, sysconfig\nimports = []\nfor name in ('study', 'pytest', 'torch', 'pip'):\n"
             "    try:\n        __import__(name)\n        imports.append(name)\n    except ImportError:\n        pass\n"
             "site = sysconfig.get_paths()['purelib']\n"
             "print(json.dumps({'env': dict(os.environ), 'root': sorted(os.listdir('/')), 'imports': imports,"
             " 'site': sorted(os.listdir(site)) if os.path.isdir(site) else [], 'cwd': os.getcwd(),"
             f" 'project': os.path.exists({str(project)!r}), 'venv': os.path.exists({sys.prefix!r})}}))\n")
    result = run(probe + CORRECT)
    assert result.passed, result
    seen = json.loads(result.stdout)
    assert seen["env"].pop("PWD") == seen["cwd"] == isolation.SCRATCH  # bwrap's --chdir sets PWD
    assert seen["env"] == isolation.ENV
    assert seen["imports"] == [] and seen["site"] == [] and not seen["project"]
    assert sys.prefix == sys.base_prefix or not seen["venv"]
    assert set(seen["root"]) <= {"usr", "bin", "sbin", "lib", "lib32", "lib64", "libx32", "proc", "dev", "tmp",
                                 *Path(sys.base_prefix).parts[1:2]}, seen["root"]


def test_the_parents_secrets_never_reach_a_failure_reason(monkeypatch):
    secret = "tok-" + secrets.token_hex(12)
    monkeypatch.setenv("LAPSTUDY_TEST_TOKEN", secret)
    # the sample cannot know the secret: here the test writes it into the program, as if it had leaked
    result = run(f"def add(a, b):\n    raise RuntimeError('leak: {secret} ' + 'x' * 5000 + '\\nsecond line')\n")
    assert result.status == "failed" and secret not in result.reason and "[redacted]" in result.reason
    assert "\n" not in result.reason and len(result.reason) <= Limits().reason_chars
    long_reason = run("def add(a, b):\n    raise RuntimeError('y' * 100000)\n")
    assert len(long_reason.reason) <= Limits().reason_chars


# ---- network -----------------------------------------------------------------------------------------------------

def test_no_connection_reaches_a_server_of_the_host():
    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]
        result = run(corpus.connect(port) + CORRECT)
        server.settimeout(0.5)
        with pytest.raises(TimeoutError):
            server.accept()
    assert result.passed, result
    assert "attempts 3" in result.stdout \
        and sum(line.startswith("refused") for line in result.stdout.splitlines()) == 3, result.stdout


# ---- processes ---------------------------------------------------------------------------------------------------

def _processes_with(token: str) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    if token.encode() in f.read():
                        found.append(int(entry))
            except OSError:
                pass
    return found


@pytest.mark.parametrize("ending", ["returns", "sleeps_past_the_wall_clock", "storms"])
def test_nothing_started_by_a_sample_outlives_it(ending):
    token = f"61.{secrets.randbelow(10**9):09d}"
    solution = {"returns": corpus.daemon(token) + CORRECT,
                "sleeps_past_the_wall_clock": corpus.daemon(token) + "import time\ntime.sleep(60)\n",
                "storms": corpus.fork_storm(token, 200) + CORRECT}[ending]
    result = run(solution, limits=Limits(cpu_s=5, wall_s=3.0, memory_mb=256))
    survivors = _processes_with(token)
    for pid in survivors:  # a broken sandbox must not leave them running
        os.kill(pid, signal.SIGKILL)
    assert survivors == [], (result, survivors)
    assert result.status == ("timed_out" if ending == "sleeps_past_the_wall_clock" else "passed"), result
    if ending == "storms":
        started = int(result.stdout.split("forked ")[1].split()[0])
        assert started > 0
        if os.geteuid() != 0:  # the kernel exempts root's uid from RLIMIT_NPROC (docs/evals.md)
            assert started < FAST.processes


def test_a_sample_cannot_signal_a_process_of_the_host():
    victim = subprocess.Popen(["sleep", "60"])
    try:  # the caller too: were it reachable, this test would die, which fails it as well
        result = run(corpus.kill([victim.pid, os.getpid()]) + CORRECT)
        assert victim.poll() is None, "the sample killed a process of the host"
    finally:
        victim.kill()
        victim.wait()
    assert result.passed, result


# ---- files -------------------------------------------------------------------------------------------------------

def test_nothing_is_created_or_changed_outside_the_scratch_directory(tmp_path):
    outside = tmp_path / "outside"
    lib = Path(sysconfig.get_paths()["stdlib"])
    targets = [str(outside / "written"), str(outside / "node"), str(lib / "lapstudy_planted.py"),
               str(Path(sysconfig.get_paths()["purelib"]) / "lapstudy_planted.pth"), "/usr/lapstudy_planted",
               "/lapstudy_planted", "/dev/lapstudy_planted"]
    outside.mkdir()
    result = run(corpus.write_outside(targets) + CORRECT)
    for target in targets[2:5]:  # a broken sandbox must not leave them behind
        Path(target).unlink(missing_ok=True)
    assert result.passed, result
    assert "made" not in result.stdout, result.stdout  # not even in the sandbox's own read-only root and /dev
    assert list(outside.iterdir()) == [] and not (lib / "lapstudy_planted.py").exists()
    assert not Path(targets[3]).exists() and not Path("/usr/lapstudy_planted").exists()
    assert "mknod refused" in result.stdout and "sysctl refused" in result.stdout, result.stdout


@pytest.mark.skipif(isolation.seccomp_filter() is None, reason="the seccomp filter is x86-64's")
def test_the_kernel_refuses_system_calls_a_sample_has_no_use_for():
    refused = {"ptrace (PTRACE_TRACEME)": (101, (0, 0, 0, 0)), "io_uring_setup": (425, (1, 0)),
               "keyctl (get keyring id)": (250, (0, -3, 0)), "unshare (new user namespace)": (272, (0x10000000,)),
               "bpf": (321, (0, 0, 0)), "perf_event_open": (298, (0, 0, -1, -1, 0)), "userfaultfd": (323, (0,)),
               "getpid through the x32 ABI": (0x40000000 + 39, ())}
    result = run(corpus.syscalls({**refused, "getpid": (39, ())}) + CORRECT)
    assert result.passed, result
    made = json.loads(result.stdout)
    assert made.pop("getpid")[0] > 0  # an ordinary call goes through
    assert made == {name: [-1, errno.EPERM] for name in refused}, made


def test_nothing_persists_into_a_later_sample():
    first = run(corpus.persist() + CORRECT)
    later = run("import os, sys\ndef add(a, b):\n"
                "    planted = os.environ.get('PERSISTED') or 'persisted' in sys.modules"
                " or os.path.exists(os.path.expanduser('~/.lapstudy_mark'))\n    return 0 if planted else a + b\n")
    planted = [p for site in {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["stdlib"],
                              sysconfig.get_paths(vars={"base": sys.base_prefix})["purelib"]}
               for p in Path(site).glob("lapstudy_persist*")]
    for path in planted:  # a broken sandbox must not leave them to later interpreters
        path.unlink()
    assert planted == [] and "planted in" not in first.stdout, first.stdout
    assert first.passed and later.passed, (first, later)


def test_a_copy_of_the_project_cannot_be_removed(tmp_path):
    project = tmp_path / "project"
    shutil.copytree(Path(__file__).resolve().parents[1] / "study" / "evals", project / "study" / "evals")
    before = sorted(p.relative_to(project) for p in project.rglob("*"))
    result = run(corpus.remove(str(project)) + CORRECT)
    assert result.passed, result
    assert sorted(p.relative_to(project) for p in project.rglob("*")) == before


# ---- forged verdicts ---------------------------------------------------------------------------------------------

def test_no_wrong_sample_can_forge_a_pass():
    forgeries = corpus.forgeries(WRONG)
    results = run_all(list(forgeries.values()))
    passed = [name for name, result in zip(forgeries, results) if result.passed]
    assert passed == [], passed


# ---- fail closed -------------------------------------------------------------------------------------------------

@pytest.fixture()
def fresh_probe():
    isolation._probe.cache_clear()
    yield
    isolation._probe.cache_clear()


def test_without_bubblewrap_nothing_runs_and_one_line_says_what_to_install(monkeypatch, tmp_path, fresh_probe):
    marker = tmp_path / "ran"
    monkeypatch.setattr(isolation, "BWRAP_ENV", {"PATH": str(tmp_path)})  # no bwrap on this PATH
    with pytest.raises(isolation.SandboxUnavailable, match="bubblewrap .*not installed.*apt-get install bubblewrap"):
        run_sample(Sample(f"open({str(marker)!r}, 'w')", ADD_TEST, "add"), allow_code_execution=True)
    assert not marker.exists()


def test_without_user_namespaces_nothing_runs_and_one_line_names_the_setting(monkeypatch, tmp_path, fresh_probe):
    # a bwrap that fails as bwrap does where the kernel refuses unprivileged user namespaces
    fake = tmp_path / "bwrap"
    fake.write_text("#!/bin/sh\necho 'bwrap: No permissions to creating new namespace, likely because the kernel "
                    "does not allow non-privileged user namespaces.' >&2\nexit 1\n")
    fake.chmod(0o755)
    monkeypatch.setattr(isolation, "BWRAP_ENV", {"PATH": str(tmp_path)})
    with pytest.raises(UserError) as refused:
        run_samples([Sample(CORRECT, ADD_TEST, "add")], allow_code_execution=True)
    message = str(refused.value)
    assert "\n" not in message and "No permissions to creating new namespace" in message
    assert "kernel.unprivileged_userns_clone" in message


def test_lapstudy_eval_refuses_humaneval_without_bubblewrap_before_loading_a_model(monkeypatch, tmp_path, capfd,
                                                                                  fresh_probe):
    from study import cli

    monkeypatch.setattr(isolation, "BWRAP_ENV", {"PATH": str(tmp_path)})
    code = cli.main(["eval", str(tmp_path / "no-such-run.yaml"), "--tasks", "humaneval", "--allow-code-execution"])
    err = capfd.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1, err
    assert "--tasks humaneval" in err and "apt-get install bubblewrap" in err and "no-such-run" not in err


def test_without_the_flag_nothing_is_executed(tmp_path, monkeypatch):
    marker = tmp_path / "ran"
    sample = Sample(f"open({str(marker)!r}, 'w').write('x')", ADD_TEST, "add")
    started = []
    monkeypatch.setattr(sandbox.subprocess, "Popen", lambda *a, **k: started.append(a))
    monkeypatch.setattr(isolation.subprocess, "run", lambda *a, **k: started.append(a))
    for allow in (False, None, "yes", 1):
        with pytest.raises(UserError, match="--allow-code-execution"):
            run_sample(sample, allow_code_execution=allow)
        with pytest.raises(UserError, match="--allow-code-execution"):
            run_samples([sample], allow_code_execution=allow)
    assert started == [] and not marker.exists()


def test_samples_run_side_by_side_in_order():
    results = run_all([CORRECT, WRONG, "raise SystemExit(0)", CORRECT])
    assert [r.status for r in results] == ["passed", "failed", "failed", "passed"]


# ---- pass@k ----------------------------------------------------------------------------------------------------------

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
