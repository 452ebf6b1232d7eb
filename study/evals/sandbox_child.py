"""What runs inside the sandbox (study/evals/sandbox.py starts it under bubblewrap): standard library only, since
the sandbox holds the interpreter's standard library and nothing else. The source is handed to `python -I -S -B -c`
with the role as its argument:

- `sample`: the completion's process. Runs the untrusted solution (prompt + completion), then answers calls of its
  entry point, one JSON line per call on `calls_fd`, one JSON line per answer on `answers_fd`. It may tamper with
  anything in its own process, this file's code included: all it can change is what it answers.
- `check`: the test's process, in a sandbox of its own that the sample cannot see. Runs the problem's prompt and
  test, with the entry point bound to `candidate`, a stub that sends each call to the sample and decodes the answer
  into plain data (None, bool, int, float, complex, str, bytes, list, tuple, set, frozenset, dict): no object of the
  sample's, hence no `__eq__` of its own, ever reaches the test. Its exit status 0 with {"passed": true} on
  `status_fd` is the only pass there is.

Both read their spec (JSON) from stdin and set their resource limits before running anything else.
"""

import builtins
import json
import os
import resource
import signal
import sys

CONTAINERS = {"list": list, "tuple": tuple, "set": set, "frozenset": frozenset}


class CandidateError(Exception):
    """The completion raised something the test cannot be given as it is, or stopped answering."""


def encode(value):
    """`value` as JSON-able data that says its type: scalars as themselves, containers as {kind: items}."""
    kind = type(value)
    if value is None or kind in (bool, int, float, str):
        return value
    for name, container in CONTAINERS.items():
        if kind is container:
            return {name: [encode(v) for v in value]}
    if kind is dict:
        return {"dict": [[encode(k), encode(v)] for k, v in value.items()]}
    if kind is bytes:
        return {"bytes": value.hex()}
    if kind is complex:
        return {"complex": [value.real, value.imag]}
    for base in (bool, int, float, str):  # a subclass (an IntEnum, a str subclass) is sent as its base value
        if isinstance(value, base):
            return base(value)
    raise TypeError(f"a {kind.__name__} cannot be passed between the completion's and the test's processes")


def decode(data):
    """The inverse of `encode`, accepting only what `encode` writes; anything else is a ValueError."""
    kind = type(data)
    if data is None or kind in (bool, int, float, str):
        return data
    if kind is dict and len(data) == 1:
        (name, items), = data.items()
        if name in CONTAINERS and type(items) is list:
            return CONTAINERS[name](decode(v) for v in items)
        if name == "dict" and type(items) is list and all(type(p) is list and len(p) == 2 for p in items):
            return {decode(k): decode(v) for k, v in items}
        if name == "bytes" and type(items) is str:
            return bytes.fromhex(items)
        if name == "complex" and type(items) is list and len(items) == 2 and all(type(x) is float for x in items):
            return complex(*items)
    raise ValueError("the completion's process answered with something that is not an encoded value")


def set_limits(limits):
    for res, value in ((resource.RLIMIT_CPU, (limits["cpu_s"], limits["cpu_s"] + 1)),
                       (resource.RLIMIT_AS, (limits["memory_mb"] << 20,) * 2),
                       (resource.RLIMIT_FSIZE, (limits["file_size_mb"] << 20,) * 2),
                       (resource.RLIMIT_NOFILE, (limits["open_files"],) * 2),
                       (resource.RLIMIT_NPROC, (limits["processes"],) * 2),
                       (resource.RLIMIT_CORE, (0, 0))):
        resource.setrlimit(res, value)
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # an oversized write raises OSError(EFBIG) instead of killing


def make_audit_hook(scratch):
    """A second layer behind the operating system's: refuses, in this interpreter, writes outside the scratch
    directory, starting processes, signals, raised limits, sockets and ctypes calls (PEP 578). Code in the same
    interpreter can get around it; the namespaces are what contain the sample."""
    import posixpath
    realpath, fspath, readlink, isdir = posixpath.realpath, os.fspath, os.readlink, posixpath.isdir
    write_flags = os.O_WRONLY | os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_TRUNC
    # event: (indices of its paths, indices of the dir_fd each path is relative to); an int path is an fd
    path_events = {"os.mkdir": ((0,), (2,)), "os.remove": ((0,), (1,)), "os.rmdir": ((0,), (1,)),
                   "os.rename": ((0, 1), (2, 3)), "os.link": ((0, 1), (2, 3)), "os.symlink": ((1,), (2,)),
                   "os.chmod": ((0,), (2,)), "os.chown": ((0,), (3,)), "os.utime": ((0,), (3,)),
                   "os.truncate": ((0,), (None,)), "os.chflags": ((0,), (None,)), "os.setxattr": ((0,), (None,)),
                   "os.removexattr": ((0,), (None,)), "shutil.rmtree": ((0,), (1,)),
                   "shutil.move": ((0, 1), (None, None)), "shutil.copyfile": ((1,), (None,)),
                   "shutil.copymode": ((1,), (None,)), "shutil.copystat": ((1,), (None,)),
                   "shutil.chown": ((0,), (None,))}
    denied = ("subprocess.Popen", "os.system", "os.exec", "os.posix_spawn", "os.spawn", "os.fork", "os.forkpty",
              "pty.spawn", "os.kill", "os.killpg", "signal.pthread_kill", "resource.setrlimit", "resource.prlimit",
              "socket.connect", "socket.bind", "socket.sendto", "socket.sendmsg", "sys.remote_exec",
              "ctypes.dlsym", "ctypes.call_function", "ctypes.cdata", "ctypes.addressof", "ctypes.string_at",
              "ctypes.wstring_at", "ctypes.get_errno", "ctypes.set_errno", "os.startfile", "webbrowser.open")
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


def read_line(stream, limit):
    line = stream.readline(limit + 1)
    if len(line) > limit:
        raise CandidateError(f"an answer longer than {limit} bytes")
    return line


def run_sample(spec):
    """Exit status: 0 answered every call; 3 memory; 4 refused by the audit hook; 5 exited while defining;
    6 defined no such function; 1 any other exception while defining. Only labels for a failure: never a verdict."""
    status = os.fdopen(spec["status_fd"], "w")
    calls = os.fdopen(spec["calls_fd"], "rb")
    answers = os.fdopen(spec["answers_fd"], "wb")
    hook, sandbox_error = make_audit_hook(os.path.realpath(os.getcwd()))
    sys.addaudithook(hook)
    namespace = {"__name__": "__main__"}
    code, why = 0, ""
    try:
        exec(compile(spec["solution"], "<completion>", "exec"), namespace)
    except MemoryError:
        code, why = 3, "MemoryError"
    except sandbox_error as error:
        code, why = 4, str(error)
    except SystemExit as error:
        code, why = 5, f"the completion exited (SystemExit({error.code!r})) before its tests ran"
    except BaseException as error:
        code, why = 1, f"{type(error).__name__}: {error}"
    function = namespace.get(spec["entry_point"])
    if code == 0 and not callable(function):
        code, why = 6, f"the completion defines no function {spec['entry_point']}"
    if code == 0:
        for line in iter(lambda: calls.readline(), b""):
            call = json.loads(line)
            try:
                answer = {"value": encode(function(*decode(call["args"]), **decode(call["kwargs"])))}
            except BaseException as error:  # the test decides what an exception means, as it would in-process
                answer = {"raised": [type(error).__name__, str(error)[:1000]]}
                code, why = (3, "MemoryError") if isinstance(error, MemoryError) else (code, why)
            answers.write(json.dumps(answer).encode() + b"\n")
            answers.flush()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except BaseException:
            pass
    try:
        status.write(json.dumps({"why": why[:2000]}))
        status.close()
    except BaseException:
        pass
    os._exit(code)


def run_check(spec):
    """Exit status 0 (and {"passed": true} on the status fd) only when `check(candidate)` returned."""
    status = os.fdopen(spec["status_fd"], "w")
    calls = os.fdopen(spec["calls_fd"], "wb")
    answers = os.fdopen(spec["answers_fd"], "rb")
    answer_limit = spec["answer_bytes"]

    def candidate(*args, **kwargs):
        try:
            calls.write(json.dumps({"args": encode(args), "kwargs": encode(kwargs)}).encode() + b"\n")
            calls.flush()
        except BrokenPipeError:
            raise CandidateError("the completion's process ended before answering") from None
        line = read_line(answers, answer_limit)
        if not line:
            raise CandidateError("the completion's process ended before answering")
        answer = json.loads(line)
        if type(answer) is dict and set(answer) == {"value"}:
            return decode(answer["value"])
        if type(answer) is dict and set(answer) == {"raised"} and type(answer["raised"]) is list:
            name, message = (str(x) for x in answer["raised"][:2])
            kind = getattr(builtins, name, None)  # a built-in exception is re-raised as itself, for tests that catch
            if isinstance(kind, type) and issubclass(kind, Exception) and kind.__module__ == "builtins":
                raise kind(message)
            raise CandidateError(f"{name}: {message}")
        raise CandidateError("the completion's process answered with something that is not an answer")

    namespace = {"__name__": "__main__"}
    try:
        exec(compile(spec["test"], "<test>", "exec"), namespace)
        namespace[spec["entry_point"]] = candidate
        namespace["check"](candidate)
    except BaseException as error:
        why = f"{type(error).__name__}: {error}" if str(error) else type(error).__name__
        status.write(json.dumps({"passed": False, "why": why[:2000]}))
        status.close()
        os._exit(1)
    status.write(json.dumps({"passed": True}))
    status.close()
    os._exit(0)


if __name__ == "__main__":
    _spec = json.loads(sys.stdin.read())
    sys.stdin.close()
    set_limits(_spec["limits"])
    {"sample": run_sample, "check": run_check}[sys.argv[1]](_spec)
