"""Running model-generated code (HumanEval) contained by the operating system, and the unbiased pass@k estimator.

Execution is opt-in: `run_sample` refuses unless `allow_code_execution` is True (the CLI's `--allow-code-execution`),
and refuses as well where the sandbox cannot be built (`isolation.require`: no bubblewrap, no user namespaces), never
running the code less contained.

A sample is a completion's source (`solution`: the prompt + the completion, which defines `entry_point`) and its
tests (`test`: the prompt + the problem's `check`). They run in two processes, each under bubblewrap in namespaces
of its own (study/evals/isolation.py: no network, no host process, no file of the host writable, nothing of the
project or the parent's environment readable), with resource limits (CPU seconds, address space, file size,
processes, open files) set in the child before anything else, and both are killed, with everything they started,
at the wall-clock limit:

- the *sample* process runs the solution, then answers calls of its entry point;
- the *check* process runs the tests, with the entry point bound to a stub that asks the sample process over a
  pipe and decodes its answer into plain data (study/evals/sandbox_child.py).

The verdict: a sample passes only when the check process exits 0 after `check(candidate)` returned and said so
on a pipe only it holds. The sample's process can see neither the check's process (another PID namespace) nor its
memory or pipes; what it can influence is the values it answers, which is what a black-box test of a function
measures. So exiting early, printing markers, patching the standard library, the interpreter or this module's
code in its own process, returning an object whose `__eq__` says True, or reading the test's expected values
cannot produce a pass. What stays trusted: the parent (this module), bubblewrap and the kernel, and the problem's
prompt and tests (the dataset), which run in the check process — itself contained the same way.

How this differs from openai/human-eval's in-process `check`: the test sees the completion's results as plain data
(a result that is not None/bool/int/float/complex/str/bytes/list/tuple/set/frozenset/dict fails), an argument
the completion mutates is not seen mutated by the test, and an exception the completion raises reaches the test as
the same built-in exception type (others as CandidateError). HumanEval's tests compare return values only.

The failure reason a record keeps is one line, at most `Limits.reason_chars` long, with every value of the parent's
environment that is 8 characters or longer replaced by [redacted] (the sandbox holds none of them anyway).
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from study.errors import UserError
from study.evals import isolation

ALLOW_FLAG = "--allow-code-execution"
CHILD_SOURCE = (Path(__file__).parent / "sandbox_child.py").read_text()

Status = Literal["passed", "failed", "timed_out"]
# Which limit or rule ended a sample that did not pass (None: its own error, e.g. a failed assert).
Limit = Literal["cpu", "wall", "memory", "file_size", "sandbox", None]


class CodeExecutionNotAllowed(UserError):
    def __init__(self, what: str = "HumanEval"):
        self.what = what
        super().__init__(f"{what} executes model-generated code; pass {ALLOW_FLAG} to allow it (each sample runs in "
                         "a bubblewrap sandbox, see docs/evals.md)", field=ALLOW_FLAG)

    def __reduce__(self):  # raised in a Ray worker, it travels pickled: rebuilt from `what`, not from its message
        return type(self), (self.what,)


def require_code_execution(allow_code_execution: bool, what: str = "HumanEval") -> None:
    """The rule for running model-written code (`what` names what asks for it): only where the command line allowed
    it, and only where this machine can contain it (CodeExecutionNotAllowed, SandboxUnavailable)."""
    if allow_code_execution is not True:
        raise CodeExecutionNotAllowed(what)
    isolation.require(what)


@dataclass(frozen=True)
class Limits:
    cpu_s: int = 10  # CPU seconds (RLIMIT_CPU) of each process: SIGXCPU at the limit
    wall_s: float = 20.0  # wall-clock seconds, start-up included; then both sandboxes are killed, and all inside
    memory_mb: int = 1024  # address space (RLIMIT_AS) of each process
    file_size_mb: int = 16  # largest file a process may write (RLIMIT_FSIZE), its captured output included
    scratch_mb: int = 64  # the private tmpfs that is each sandbox's working directory
    processes: int = 32  # RLIMIT_NPROC inside (the kernel exempts a caller running as root: see docs/evals.md)
    open_files: int = 64
    answer_bytes: int = 1 << 20  # the longest answer (one encoded return value) the test reads
    output_chars: int = 4000  # how much of the sample's stdout/stderr a result keeps
    reason_chars: int = 500  # how much of a failure reason a result keeps


@dataclass(frozen=True)
class Sample:
    solution: str  # untrusted: the prompt + the completion
    test: str  # trusted: the prompt + the problem's tests, defining check(candidate)
    entry_point: str


@dataclass(frozen=True)
class ExecutionResult:
    status: Status
    reason: str  # "" when passed; else one line: the exception, or the limit or rule that stopped it
    limit: Limit = None
    stdout: str = ""  # the sample process's, scrubbed
    stderr: str = ""
    seconds: float = 0.0

    @property
    def passed(self) -> bool:
        return self.status == "passed"


def run_sample(sample: Sample, *, allow_code_execution: bool, limits: Limits = Limits()) -> ExecutionResult:
    """Run `sample` contained (see the module's docstring); whether it passed, and if not, why.

    Raises CodeExecutionNotAllowed unless `allow_code_execution`, SandboxUnavailable where it cannot be contained,
    both before anything runs."""
    require_code_execution(allow_code_execution)
    return _run(sample, limits)


def run_samples(samples: list[Sample], *, allow_code_execution: bool, limits: Limits = Limits(),
                workers: int | None = None) -> list[ExecutionResult]:
    """`run_sample` over many samples, `workers` at a time (default: the CPUs), results in their order."""
    require_code_execution(allow_code_execution)
    workers = workers or max(1, min(len(os.sched_getaffinity(0)), 8))
    with ThreadPoolExecutor(max_workers=workers) as pool:
        return list(pool.map(lambda s: _run(s, limits), samples))


def _run(sample: Sample, limits: Limits) -> ExecutionResult:
    child_limits = {k: getattr(limits, k) for k in ("cpu_s", "memory_mb", "file_size_mb", "open_files", "processes")}
    calls_read, calls_write = os.pipe()  # check -> sample
    answers_read, answers_write = os.pipe()  # sample -> check
    sample_status_read, sample_status_write = os.pipe()
    check_status_read, check_status_write = os.pipe()
    sample_spec = {"solution": sample.solution, "entry_point": sample.entry_point, "limits": child_limits,
                   "calls_fd": calls_read, "answers_fd": answers_write, "status_fd": sample_status_write}
    check_spec = {"test": sample.test, "entry_point": sample.entry_point, "limits": child_limits,
                  "calls_fd": calls_write, "answers_fd": answers_read, "status_fd": check_status_write,
                  "answer_bytes": limits.answer_bytes}
    child_fds = [calls_read, answers_write, sample_status_write, calls_write, answers_read, check_status_write]
    start = time.monotonic()
    sandboxes: list[isolation.Contained] = []
    with tempfile.TemporaryDirectory(prefix="lapstudy-sandbox-out-") as captured:  # the parent's; never bound
        try:
            with open(os.path.join(captured, "stdout"), "wb") as out, \
                    open(os.path.join(captured, "stderr"), "wb") as err, \
                    open(os.devnull, "wb") as discard:
                sandboxes.append(_start("sample", sample_spec, tuple(child_fds[:3]), out, err, limits))
                sandboxes.append(_start("check", check_spec, tuple(child_fds[3:]), discard, discard, limits))
                _close(child_fds)  # the children hold them now: a pipe ends when its process does
                sample_proc, check_proc = (s.proc for s in sandboxes)
                timed_out = False
                try:
                    check_proc.wait(timeout=max(0.0, limits.wall_s - (time.monotonic() - start)))
                    # the verdict is in; the sample process ends on its own once its calls pipe closes
                    sample_proc.wait(timeout=max(0.0, min(1.0, limits.wall_s - (time.monotonic() - start))))
                except subprocess.TimeoutExpired:
                    timed_out = check_proc.poll() is None
                for contained in sandboxes:
                    contained.kill()
            seconds = time.monotonic() - start
            check_status = _read_status(check_status_read)
            sample_status = _read_status(sample_status_read)
            stdout, stderr = (_read_tail(os.path.join(captured, name), limits.output_chars)
                              for name in ("stdout", "stderr"))
        finally:
            for contained in sandboxes:
                contained.kill()
            _close(child_fds + [check_status_read, sample_status_read])
    status, reason, limit = _outcome(check_proc.returncode, check_status, sample_proc.returncode, sample_status,
                                     timed_out, limits)
    return ExecutionResult(status, " ".join(scrub(reason).split())[:limits.reason_chars], limit,
                           scrub(stdout)[-limits.output_chars:], scrub(stderr)[-limits.output_chars:], seconds)


def _start(role: str, spec: dict, fds: tuple[int, ...], stdout, stderr, limits: Limits) -> isolation.Contained:
    argv = [isolation.interpreter(), "-I", "-S", "-B", "-c", CHILD_SOURCE, role]
    sandbox = isolation.start(argv, limits.scratch_mb, stdin=subprocess.PIPE, stdout=stdout, stderr=stderr,
                              pass_fds=fds)
    try:
        sandbox.proc.stdin.write(json.dumps(spec).encode())
        sandbox.proc.stdin.close()
    except BrokenPipeError:
        pass
    return sandbox


def _close(fds: list[int]) -> None:
    while fds:
        try:
            os.close(fds.pop())
        except OSError:
            pass


def _read_status(fd: int, limit: int = 8192) -> dict:
    try:
        text = os.read(fd, limit)  # one write of a short JSON object, or nothing
        status = json.loads(text) if text else {}
    except (OSError, ValueError):
        return {}
    return status if isinstance(status, dict) else {}




def _outcome(check_code: int, check_status: dict, sample_code: int, sample_status: dict, timed_out: bool,
             limits: Limits) -> tuple[Status, str, Limit]:
    """The verdict from the check process alone; for a failure, a label from what the sample process reported
    (which it may have forged: a label, never a pass)."""
    if timed_out:
        return "timed_out", f"wall-clock limit of {limits.wall_s:g} s exceeded; both sandboxes killed", "wall"
    if check_code == 0 and check_status.get("passed") is True:
        return "passed", "", None
    check_why = str(check_status.get("why") or f"the test's process ended with status {check_code}")
    sample_why = str(sample_status.get("why") or "")
    # bwrap exits 128 + N when its program dies of signal N
    if sample_code in (128 + signal.SIGXCPU, -signal.SIGXCPU):
        return "timed_out", f"CPU-time limit of {limits.cpu_s} s exceeded (SIGXCPU)", "cpu"
    if check_code in (128 + signal.SIGXCPU, -signal.SIGXCPU):
        return "timed_out", f"CPU-time limit of {limits.cpu_s} s exceeded by the test (SIGXCPU)", "cpu"
    if sample_code == 3 or check_why.startswith("MemoryError"):
        return "failed", f"memory limit of {limits.memory_mb} MiB exceeded ({sample_why or check_why})", "memory"
    if sample_code == 4:
        return "failed", sample_why, "sandbox"
    if sample_code in (1, 5, 6) and sample_why:
        return "failed", sample_why, None
    if "EFBIG" in check_why or "File too large" in check_why:
        return "failed", f"file-size limit of {limits.file_size_mb} MiB exceeded ({check_why})", "file_size"
    return "failed", check_why, None


def scrub(text: str) -> str:
    """`text` with every value of this process's environment that is 8 characters or longer replaced."""
    for value in sorted({v for v in os.environ.values() if len(v) >= 8}, key=len, reverse=True):
        text = text.replace(value, "[redacted]")
    return text


def _read_tail(path: str, chars: int) -> str:
    with open(path, "rb") as f:
        f.seek(0, os.SEEK_END)
        f.seek(max(0, f.tell() - 4 * chars))
        return f.read().decode("utf-8", errors="replace")[-chars:]


# ---- pass@k ----------------------------------------------------------------------------------------------------------

def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased estimator of pass@k from n samples of which c passed (Chen et al. 2021, eq. 1):
    1 - C(n-c, k) / C(n, k), as the product 1 - prod_{i=n-c+1}^{n} (1 - k/i), which never forms the binomials."""
    if not (0 <= c <= n and 1 <= k <= n):
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))


def mean_pass_at_k(passed: list[list[bool]], k: int) -> float:
    """pass@k averaged over problems; `passed[p]` holds the outcome of each sample of problem p (n >= k each)."""
    if not passed:
        raise ValueError("pass@k needs at least one problem")
    return sum(pass_at_k(len(p), sum(map(bool, p)), k) for p in passed) / len(passed)
