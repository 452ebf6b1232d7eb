"""The operating system's containment of one process: bubblewrap (`bwrap`) with namespaces of its own.

`command(argv, scratch_mb)` wraps an interpreter command line so that it runs:

- in new user, PID, network, mount, IPC, UTS and cgroup namespaces, nested user namespaces disabled: no network
  device but a loopback of its own, no process of the host visible (a fresh /proc of its PID namespace, /proc/sys
  read-only), no System V IPC or abstract socket of the host;
- as uid/gid 65534 inside, all capabilities dropped, no_new_privs (bwrap sets it), in a session of its own (no
  TIOCSTI into the caller's terminal), and killed with its whole PID namespace when bwrap dies (--die-with-parent:
  the program dies with its parent, the namespace's init, and when the init dies the kernel kills everything
  else in the namespace, setsid'd or not; `kill` ends a sandbox so, and waits until the namespace is empty);
- over a root that holds, read-only, /usr (shared libraries), the interpreter and its standard library, and
  nothing else: not the project, not a virtual environment, not a home, not /etc; the interpreter's own
  site-packages hidden under an empty read-only tmpfs; the root itself read-only;
- with a private tmpfs of `scratch_mb` MiB at /tmp as its working directory, HOME and TMPDIR (gone with the
  namespace), a minimal /dev (null, zero, full, random, urandom, tty; read-only but for /dev/shm, a small tmpfs), and an
  environment built from nothing.

On x86-64 a seccomp filter (classic BPF, assembled below: no library needed) also makes the kernel refuse, with
EPERM, the system calls a contained program has no use for and that are the usual ways into kernel bugs or out
of a namespace: ptrace and process_vm_*, bpf, perf_event_open, userfaultfd, io_uring, the keyring, mount and the
new mount API, unshare and setns, module and kexec loading, open_by_handle_at, iopl/ioperm, swapon, reboot, acct,
quotactl, syslog; and any x32-ABI or foreign-architecture system call. Elsewhere there is no filter (the
namespaces and the dropped capabilities still hold).

`require()` refuses, with one line naming what is missing, where bubblewrap or user namespaces are not available:
nothing falls back to a weaker sandbox.
"""

from __future__ import annotations

import functools
import json
import os
import select
import signal
import struct
import subprocess
import sys

from study.errors import UserError

SANDBOX_UID = 65534  # "nobody" inside the namespaces
SCRATCH = "/tmp"
ENV = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": SCRATCH, "TMPDIR": SCRATCH, "LANG": "C.UTF-8",
       "LC_ALL": "C.UTF-8", "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
# bwrap's own environment: its pid-1 reaper keeps it, and /proc/1/environ is readable inside
BWRAP_ENV = {"PATH": "/usr/bin:/bin"}
INSTALL_HINT = "install bubblewrap (Debian/Ubuntu: apt-get install bubblewrap; Fedora: dnf install bubblewrap)"
USERNS_HINT = ("unprivileged user namespaces must be allowed: sysctl kernel.unprivileged_userns_clone=1 and "
               "user.max_user_namespaces > 0 (on Ubuntu 24.04 also kernel.apparmor_restrict_unprivileged_userns=0); "
               "a container needs them allowed by its runtime (e.g. docker run --security-opt seccomp=unconfined)")


class SandboxUnavailable(UserError):
    """Model-generated code cannot be contained here; HumanEval refuses rather than run it less contained."""


def interpreter() -> str:
    """The real interpreter behind this one (a virtual environment's python is a link to it)."""
    return os.path.realpath(sys.executable)


def _root_binds() -> list[str]:
    args = ["--ro-bind", "/usr", "/usr"]
    for top in ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32"):
        if os.path.islink(top):  # a merged-/usr system: /lib -> usr/lib
            args += ["--symlink", os.readlink(top), top]
        elif os.path.isdir(top):
            args += ["--ro-bind", top, top]
    return args


def _interpreter_binds() -> list[str]:
    """The interpreter, its standard library and shared libraries (prefix/lib), unless /usr holds them already;
    its site-packages hidden."""
    exe = interpreter()
    args = [] if exe.startswith("/usr/") else ["--ro-bind", exe, exe]
    version = f"python{sys.version_info.major}.{sys.version_info.minor}"
    for prefix in dict.fromkeys((sys.base_prefix, sys.base_exec_prefix)):
        lib = os.path.join(prefix, "lib")
        if not lib.startswith("/usr/") and os.path.isdir(lib):
            args += ["--ro-bind", lib, lib]
        for site in (os.path.join(lib, version, "site-packages"), os.path.join(lib, version, "dist-packages")):
            if os.path.isdir(site):
                args += ["--tmpfs", site, "--remount-ro", site]
    return args


def command(argv: list[str], scratch_mb: int, info_fd: int | None = None, seccomp_fd: int | None = None) -> list[str]:
    """bwrap's command line running `argv` (an interpreter command) contained as the module docstring says;
    `info_fd`: where bwrap writes {"child-pid": the host pid of the namespace's init, ...} once it is set up;
    `seccomp_fd`: where it reads the seccomp filter from."""
    env = [arg for name, value in ENV.items() for arg in ("--setenv", name, value)]
    proc_extra = ["--ro-bind", "/proc/pressure", "/proc/pressure"] if os.path.isdir("/proc/pressure") else []
    return ["bwrap",
            "--unshare-user", "--unshare-pid", "--unshare-net", "--unshare-ipc", "--unshare-uts", "--unshare-cgroup",
            "--disable-userns", "--uid", str(SANDBOX_UID), "--gid", str(SANDBOX_UID), "--hostname", "sandbox",
            "--die-with-parent", "--new-session", "--cap-drop", "ALL",
            *(["--info-fd", str(info_fd)] if info_fd is not None else []),
            *(["--seccomp", str(seccomp_fd)] if seccomp_fd is not None else []),
            *_root_binds(), *_interpreter_binds(),
            # the kernel's sysctls are global: a root-mapped uid could write them through a writable /proc/sys
            "--proc", "/proc", "--ro-bind", "/proc/sys", "/proc/sys", *proc_extra,
            "--dev", "/dev", "--remount-ro", "/dev", "--size", str(16 << 20), "--tmpfs", "/dev/shm",
            "--size", str(scratch_mb << 20), "--tmpfs", SCRATCH, "--chdir", SCRATCH,
            "--remount-ro", "/",
            "--clearenv", *env,
            "--", *argv]


# x86-64 numbers of the refused system calls (asm/unistd_64.h)
_REFUSED_X86_64 = {"ptrace": 101, "syslog": 103, "pivot_root": 155, "acct": 163, "mount": 165, "umount2": 166,
                   "swapon": 167, "swapoff": 168, "reboot": 169, "iopl": 172, "ioperm": 173, "init_module": 175,
                   "delete_module": 176, "quotactl": 179, "kexec_load": 246, "add_key": 248, "request_key": 249,
                   "keyctl": 250, "unshare": 272, "perf_event_open": 298, "name_to_handle_at": 303,
                   "open_by_handle_at": 304, "setns": 308, "process_vm_readv": 310, "process_vm_writev": 311,
                   "finit_module": 313, "kexec_file_load": 320, "bpf": 321, "userfaultfd": 323, "io_uring_setup": 425,
                   "io_uring_enter": 426, "io_uring_register": 427, "open_tree": 428, "move_mount": 429, "fsopen": 430,
                   "fsconfig": 431, "fsmount": 432, "fspick": 433, "mount_setattr": 442}


def seccomp_filter() -> bytes | None:
    """The filter as bwrap's --seccomp reads it (an array of struct sock_filter); None off x86-64."""
    if os.uname().machine != "x86_64":
        return None
    ld_abs, jeq, jge, ret = 0x20, 0x15, 0x35, 0x06  # BPF_LD|BPF_W|BPF_ABS, BPF_JMP|BPF_JEQ|BPF_K, ...JGE, BPF_RET
    allow, eperm, kill = 0x7FFF0000, 0x00050000 | 1, 0x80000000  # SECCOMP_RET_ALLOW, _ERRNO|EPERM, _KILL_PROCESS
    numbers = sorted(_REFUSED_X86_64.values())
    n = len(numbers)
    # seccomp_data: nr at offset 0, arch at 4. Layout: arch check, nr load, x32 check, one jeq per call, then
    # [allow, eperm]; a jump offset counts the instructions it skips.
    program = [(ld_abs, 0, 0, 4), (jeq, 1, 0, 0xC000003E), (ret, 0, 0, kill), (ld_abs, 0, 0, 0),
               (jge, n + 1, 0, 0x40000000)]
    program += [(jeq, n - i, 0, nr) for i, nr in enumerate(numbers)]
    program += [(ret, 0, 0, allow), (ret, 0, 0, eperm)]
    return b"".join(struct.pack("HBBI", *op) for op in program)


class Contained:
    """A running sandbox: bwrap's process, and a pidfd of its namespace's init (None if it never started)."""

    def __init__(self, proc: subprocess.Popen, info_read: int):
        self.proc, self.init = proc, None
        text = b""
        try:  # bwrap writes one JSON object and closes the pipe (unwritten when it fails)
            while chunk := os.read(info_read, 4096):
                text += chunk
        finally:
            os.close(info_read)
        try:
            info = json.loads(text or b"{}")
        except ValueError:
            info = {}
        try:
            init = os.pidfd_open(info["child-pid"])
        except (KeyError, ProcessLookupError):
            return
        try:  # the pidfd pins the process; the namespace proves that the pid was not reused meanwhile
            same = os.stat(f"/proc/{info['child-pid']}/ns/pid").st_ino == info.get("pid-namespace")
        except OSError:
            same = False
        if same:
            self.init = init
        else:
            os.close(init)

    def kill(self) -> None:
        """SIGKILL the init (the kernel then kills all else in the namespace) and bwrap; return once the
        namespace is empty (an init's exit completes only after every other process in it has gone)."""
        if self.init is not None:
            try:
                signal.pidfd_send_signal(self.init, signal.SIGKILL)
            except ProcessLookupError:
                pass
            select.select([self.init], [], [], 10.0)
            os.close(self.init)
            self.init = None
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        self.proc.wait()


def start(argv: list[str], scratch_mb: int, *, stdin, stdout, stderr, pass_fds: tuple[int, ...]) -> Contained:
    """`argv` started contained (bwrap's own environment minimal too: its init's /proc/1/environ is readable)."""
    info_read, info_write = os.pipe()
    rules, seccomp_fd = seccomp_filter(), None
    if rules is not None:  # far smaller than a pipe's buffer: written whole before bwrap reads it
        seccomp_fd, rules_write = os.pipe()
        os.write(rules_write, rules)
        os.close(rules_write)
    extra = (info_write,) if seccomp_fd is None else (info_write, seccomp_fd)
    try:
        proc = subprocess.Popen(command(argv, scratch_mb, info_write, seccomp_fd), stdin=stdin, stdout=stdout,
                                stderr=stderr, cwd="/", env=BWRAP_ENV, start_new_session=True,
                                pass_fds=(*pass_fds, *extra), close_fds=True)
    except BaseException:
        os.close(info_read)
        raise
    finally:
        for fd in extra:
            os.close(fd)
    return Contained(proc, info_read)


@functools.lru_cache(maxsize=1)
def _probe() -> str:
    """"" when a contained interpreter starts here, else why not (cached: it is asked before every evaluation)."""
    try:
        done = subprocess.run(command([interpreter(), "-I", "-S", "-c", "pass"], 1), env=BWRAP_ENV, cwd="/",
                              capture_output=True, text=True, timeout=60)
    except FileNotFoundError:
        return f"bubblewrap (bwrap) is not installed: {INSTALL_HINT}"
    except subprocess.TimeoutExpired:
        return "bubblewrap did not start a contained interpreter within 60 s"
    if done.returncode != 0:
        said = " ".join((done.stderr.strip().splitlines() or [f"exit status {done.returncode}"])[-1].split())[:300]
        return f"bubblewrap cannot contain a process here ({said}); {USERNS_HINT}"
    return ""


def require(what: str = "HumanEval") -> None:
    """SandboxUnavailable, in one line, unless processes can be contained here."""
    why = _probe()
    if why:
        _probe.cache_clear()  # a fix (installing bwrap) is seen by the next attempt
        raise SandboxUnavailable(f"{what} runs model-generated code only inside a bubblewrap sandbox: {why}")
