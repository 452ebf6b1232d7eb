"""Running model-generated code (HumanEval) with limits, and the unbiased pass@k estimator.

Execution is opt-in: `run_program` refuses unless `allow_code_execution` is True (the CLI's
`--allow-code-execution`). Each program runs in a fresh interpreter (`python -I -B`, a process group of its own)
that, before the program:

- sets resource limits: CPU seconds (RLIMIT_CPU), address space (RLIMIT_AS), the size of any file it writes
  (RLIMIT_FSIZE), open files, no core dumps; the parent kills the whole group at the wall-clock limit;
- installs an audit hook (PEP 578, which the program cannot remove) that refuses: opening for writing, creating,
  renaming, removing, linking or changing the mode of any path outside the scratch directory; starting processes
  (fork, exec, subprocess, os.system); signals to other processes; raising resource limits; sockets
  (connect, bind, send); ctypes (which would reach libc directly);
- starts in a scratch directory that is also its HOME and TMPDIR, and is removed afterwards.

Its environment is built from nothing (PATH, HOME, TMPDIR, LANG, OMP_NUM_THREADS), so no AWS_*, MLFLOW_*, tokens or
other secrets of the parent reach it. Like openai/human-eval's `reliability_guard`, this guards against accidents of
generated code, not against an adversary: a C extension already importable, or a bug in CPython, can get around an
audit hook. Run untrusted evaluations in a container or VM without credentials as well.

A program passes when it runs to the end (the tests, `check(entry_point)`, are part of it); it then writes a nonce
only the guard knows to a pipe, so a program that exits early with status 0 (`os._exit(0)`) does not pass.
"""

from __future__ import annotations

import json
import math
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Literal

from study.errors import UserError

ALLOW_FLAG = "--allow-code-execution"

Status = Literal["passed", "failed", "timed_out"]
# Which limit or rule ended a program that did not pass (None: its own error, e.g. a failed assert).
Limit = Literal["cpu", "wall", "memory", "file_size", "sandbox", None]


class CodeExecutionNotAllowed(UserError):
    def __init__(self, what: str = "HumanEval"):
        self.what = what
        super().__init__(f"{what} executes model-generated code; pass {ALLOW_FLAG} to allow it (each sample runs in "
                         "a limited subprocess, see docs/evals.md)", field=ALLOW_FLAG)

    def __reduce__(self):  # raised in a Ray worker, it travels pickled: rebuilt from `what`, not from its message
        return type(self), (self.what,)


@dataclass(frozen=True)
class Limits:
    cpu_s: int = 10  # CPU seconds (RLIMIT_CPU): SIGXCPU at the limit
    wall_s: float = 20.0  # wall-clock seconds, interpreter start included; then the process group is killed
    memory_mb: int = 1024  # address space (RLIMIT_AS)
    file_size_mb: int = 16  # largest file the program may write (RLIMIT_FSIZE), its captured output included
    open_files: int = 64
    output_chars: int = 4000  # how much of stdout/stderr a result keeps


@dataclass(frozen=True)
class ExecutionResult:
    status: Status
    reason: str  # "" when passed; else one line: the exception, or the limit or rule that stopped it
    limit: Limit = None
    stdout: str = ""
    stderr: str = ""
    seconds: float = 0.0

    @property
    def passed(self) -> bool:
        return self.status == "passed"


# Runs in the child before the program; reads {"nonce", "scratch", "limits", "program"} from stdin. Exit codes it
# chooses: 0 passed (nonce written), 3 memory, 4 sandbox refusal, 5 exited early, 1 any other exception.
_GUARD = r'''
import json, os, sys
_spec = json.loads(sys.stdin.read())
sys.stdin.close()
import resource, signal
_l = _spec["limits"]
for _res, _val in ((resource.RLIMIT_CPU, (_l["cpu_s"], _l["cpu_s"] + 1)),
                   (resource.RLIMIT_AS, (_l["memory_mb"] << 20,) * 2),
                   (resource.RLIMIT_FSIZE, (_l["file_size_mb"] << 20,) * 2),
                   (resource.RLIMIT_NOFILE, (_l["open_files"],) * 2),
                   (resource.RLIMIT_CORE, (0, 0))):
    resource.setrlimit(_res, _val)
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # an oversized write raises OSError(EFBIG) instead of killing
os.chdir(_spec["scratch"])
_status = os.fdopen(int(_spec["status_fd"]), "w")
_nonce = _spec["nonce"]
del _spec["nonce"]


def _make_hook(scratch):
    import posixpath
    realpath, fspath, readlink, isdir = posixpath.realpath, os.fspath, os.readlink, posixpath.isdir
    write_flags = os.O_WRONLY | os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_TRUNC
    # event: (indices of its paths, indices of the dir_fd each path is relative to); an int path is an fd
    path_events = {"os.mkdir": ((0,), (2,)), "os.remove": ((0,), (1,)), "os.rmdir": ((0,), (1,)),
                   "os.rename": ((0, 1), (2, 3)), "os.link": ((0, 1), (2, 3)), "os.symlink": ((1,), (2,)),
                   "os.chmod": ((0,), (2,)), "os.chown": ((0,), (3,)), "os.utime": ((0,), (3,)),
                   "os.truncate": ((0,), (None,)), "os.chflags": ((0,), (None,)), "os.setxattr": ((0,), (None,)),
                   "os.removexattr": ((0,), (None,)), "shutil.rmtree": ((0,), (1,)), "shutil.move": ((0, 1), (None, None)),
                   "shutil.copyfile": ((1,), (None,)), "shutil.copymode": ((1,), (None,)),
                   "shutil.copystat": ((1,), (None,)), "shutil.chown": ((0,), (None,))}
    denied = ("subprocess.Popen", "os.system", "os.exec", "os.posix_spawn", "os.spawn", "os.fork", "os.forkpty",
              "pty.spawn", "os.kill", "os.killpg", "signal.pthread_kill", "resource.setrlimit", "resource.prlimit",
              "socket.connect", "socket.bind", "socket.sendto", "socket.sendmsg", "sys.remote_exec",
              # ctypes may load libraries (numpy does on import) but not look up or call their functions
              "ctypes.dlsym", "ctypes.call_function", "ctypes.cdata", "ctypes.addressof", "ctypes.string_at",
              "ctypes.wstring_at", "ctypes.get_errno", "ctypes.set_errno", "ctypes.seh_exception",
              "os.startfile", "webbrowser.open", "winreg.")
    busy = [False]

    class SandboxError(PermissionError):
        pass

    def resolve(path, dir_fd=None):
        if isinstance(path, int):
            path = readlink(f"/proc/self/fd/{path}")
        path = fspath(path)
        if isinstance(path, bytes):
            path = path.decode("utf-8", "surrogateescape")
        if isinstance(dir_fd, int) and dir_fd >= 0 and not path.startswith("/"):
            path = readlink(f"/proc/self/fd/{dir_fd}") + "/" + path
        return realpath(path)

    def inside(path):
        return path == scratch or path.startswith(scratch + "/")

    def hook(event, args):
        if busy[0]:
            return
        busy[0] = True
        try:
            if event.startswith(denied):
                raise SandboxError(f"sandbox: {event} is not allowed")
            if event == "open":
                path, _mode, flags = args
                if isinstance(path, int):  # os.fdopen of an fd the program holds: it was checked when opened
                    return
                target = resolve(path)
                if not inside(target) and ((flags or 0) & write_flags or isdir(target)):
                    # a directory outside could serve as the dir_fd of a later os.open, which the event omits
                    raise SandboxError(f"sandbox: opening {path!r} outside the scratch directory for writing (or as a "
                                       "directory) is not allowed")
            elif event in path_events:
                where, dir_fds = path_events[event]
                for i, d in zip(where, dir_fds):
                    if i < len(args) and args[i] is not None:
                        target = resolve(args[i], args[d] if d is not None and d < len(args) else None)
                        if not inside(target):
                            raise SandboxError(f"sandbox: {event} outside the scratch directory is not allowed: "
                                               f"{args[i]!r}")
        finally:
            busy[0] = False

    return hook, SandboxError


_hook, _SandboxError = _make_hook(os.path.realpath(_spec["scratch"]))
sys.addaudithook(_hook)
del _make_hook, _hook
try:
    exec(compile(_spec.pop("program"), "<sample>", "exec"), {"__name__": "__main__"})
except MemoryError:
    _code = 3
    _why = "MemoryError"
except _SandboxError as _error:
    _code = 4
    _why = str(_error)
except SystemExit as _error:
    _code = 5
    _why = f"the program exited (SystemExit({_error.code!r})) before its tests finished"
except BaseException as _error:
    _code = 1
    _why = f"{type(_error).__name__}: {_error}"
else:
    _code = 0
    _why = ""
for _stream in (sys.stdout, sys.stderr):
    try:
        _stream.flush()
    except BaseException:
        pass
try:
    _status.write(json.dumps({"nonce": _nonce if _code == 0 else "", "why": _why[:2000]}))
    _status.close()
except BaseException:
    pass
os._exit(_code)
'''

_SIGNAL_LIMITS = {signal.SIGXCPU: "cpu", signal.SIGXFSZ: "file_size", signal.SIGKILL: "wall"}


def run_program(program: str, *, allow_code_execution: bool, limits: Limits = Limits()) -> ExecutionResult:
    """Run `program` (Python source) in a limited child process; whether it ran to the end, and if not, why.

    Raises CodeExecutionNotAllowed, before anything runs, unless `allow_code_execution`."""
    if allow_code_execution is not True:
        raise CodeExecutionNotAllowed()
    scratch = tempfile.mkdtemp(prefix="lapstudy-sandbox-")
    captured = tempfile.mkdtemp(prefix="lapstudy-sandbox-out-")  # the parent's: the program cannot open it
    nonce = secrets.token_hex(16)
    status_read, status_write = os.pipe()
    start = time.monotonic()
    try:
        with open(os.path.join(captured, "stdout"), "wb") as out, open(os.path.join(captured, "stderr"), "wb") as err:
            spec = {"nonce": nonce, "scratch": scratch, "status_fd": status_write, "program": program,
                    "limits": {k: getattr(limits, k) for k in ("cpu_s", "memory_mb", "file_size_mb", "open_files")}}
            proc = subprocess.Popen(
                [sys.executable, "-I", "-B", "-c", _GUARD], stdin=subprocess.PIPE, stdout=out, stderr=err,
                cwd=scratch, env=sandbox_env(scratch), start_new_session=True, pass_fds=(status_write,),
                close_fds=True)
            os.close(status_write)
            status_write = -1
            timed_out = False
            try:
                proc.stdin.write(json.dumps(spec).encode())
                proc.stdin.close()
            except BrokenPipeError:
                pass
            try:
                proc.wait(timeout=limits.wall_s)
            except subprocess.TimeoutExpired:
                timed_out = True
            _kill_group(proc.pid)  # whatever it left running, on timeout or not
            proc.wait()
        with os.fdopen(status_read, "r") as status_file:
            status_read = -1
            status_text = status_file.read()
        seconds = time.monotonic() - start
        stdout, stderr = (_read_tail(os.path.join(captured, name), limits.output_chars) for name in ("stdout", "stderr"))
        status, reason, limit = _outcome(proc.returncode, timed_out, status_text, nonce, limits, stderr)
        return ExecutionResult(status, reason, limit, stdout, stderr, seconds)
    finally:
        for fd in (status_read, status_write):
            if fd >= 0:
                os.close(fd)
        _remove(scratch)
        _remove(captured)


def run_programs(programs: list[str], *, allow_code_execution: bool, limits: Limits = Limits(),
                 workers: int | None = None) -> list[ExecutionResult]:
    """`run_program` over many programs, `workers` at a time (default: the CPUs), results in their order."""
    if allow_code_execution is not True:
        raise CodeExecutionNotAllowed()
    workers = workers or max(1, min(len(os.sched_getaffinity(0)), 8))
    with ThreadPoolExecutor(max_workers=workers) as pool:
        return list(pool.map(lambda p: run_program(p, allow_code_execution=True, limits=limits), programs))


def sandbox_env(scratch: str) -> dict[str, str]:
    """The child's whole environment: nothing inherited from the parent."""
    return {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": scratch, "TMPDIR": scratch, "LANG": "C.UTF-8",
            "LC_ALL": "C.UTF-8", "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


def _outcome(returncode: int, timed_out: bool, status_text: str, nonce: str, limits: Limits,
             stderr: str) -> tuple[Status, str, Limit]:
    if timed_out:
        return "timed_out", f"wall-clock limit of {limits.wall_s:g} s exceeded; process group killed", "wall"
    try:
        status = json.loads(status_text) if status_text else {}
    except ValueError:
        status = {}
    if returncode == 0 and status.get("nonce") == nonce:
        return "passed", "", None
    if returncode < 0:
        sig = -returncode
        if sig == signal.SIGXCPU:
            return "timed_out", f"CPU-time limit of {limits.cpu_s} s exceeded (SIGXCPU)", "cpu"
        name = signal.Signals(sig).name if sig in signal.Signals._value2member_map_ else str(sig)
        return "failed", f"killed by {name}", _SIGNAL_LIMITS.get(sig)
    why = status.get("why") or (stderr.strip().splitlines() or [""])[-1]
    if returncode == 3:
        return "failed", f"memory limit of {limits.memory_mb} MiB exceeded ({why})", "memory"
    if returncode == 4:
        return "failed", why, "sandbox"
    if returncode == 0:
        return "failed", "the program exited before its tests finished", None
    if "EFBIG" in why or "File too large" in why:
        return "failed", f"file-size limit of {limits.file_size_mb} MiB exceeded ({why})", "file_size"
    return "failed", why or f"exit status {returncode}", None


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _read_tail(path: str, chars: int) -> str:
    with open(path, "rb") as f:
        f.seek(0, os.SEEK_END)
        f.seek(max(0, f.tell() - 4 * chars))
        return f.read().decode("utf-8", errors="replace")[-chars:]


def _remove(path: str) -> None:
    def make_writable(func, target, _exc):  # a program may leave a folder without write permission
        os.chmod(os.path.dirname(target), 0o700)
        os.chmod(target, 0o700)
        func(target)

    shutil.rmtree(path, onexc=make_writable) if sys.version_info >= (3, 12) else \
        shutil.rmtree(path, onerror=make_writable)


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
