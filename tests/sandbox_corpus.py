"""Hostile completions for tests/test_sandbox.py: each tries one kind of escape and then, where the test wants it
to pass, the test appends a correct `add`. They first switch the audit hook off from inside (as an adversary in the
same interpreter can), so what stops them is the operating system's layer. Each reports what it managed on stdout
in words the test looks for; the tests check the effects from outside wherever there is one to see."""

from __future__ import annotations

# The hook's closure holds its re-entrancy flag; set, the hook returns at once for every event.
UNHOOK = """
import gc as _gc
for _f in _gc.get_objects():
    if getattr(_f, "__name__", None) == "hook" and getattr(_f, "__closure__", None):
        for _cell in _f.__closure__:
            if _cell.cell_contents == [False]:
                _cell.cell_contents[0] = True
"""


def hunt_secrets(secret_name: str, host_pids: list[int], paths: list[str]) -> str:
    """Looks for `secret_name` in every environment it can read (its own, /proc/*/environ, the host pids') and
    reads `paths`; prints the hex of what it found (hex: the parent's scrubbing must not be what hides it)."""
    return UNHOOK + f"""
import os
found, readable = [], []
sources = [f"/proc/{{p}}/environ" for p in os.listdir("/proc") if p.isdigit()] + ["/proc/self/environ"]
sources += [f"/proc/{{p}}/environ" for p in {host_pids!r}]
for source in sources:
    try:
        data = open(source, "rb").read()
    except OSError:
        continue
    for item in data.split(b"\\0"):
        if item.startswith(b"{secret_name}="):
            found.append(item.hex())
if os.environ.get("{secret_name}"):
    found.append(os.environ["{secret_name}"].encode().hex())
for path in {paths!r}:
    try:
        found.append(open(path, "rb").read().hex())
        readable.append(path)
    except OSError:
        pass
print("hunted", len(sources), "found", found, "readable" if readable else "", readable)
"""


def connect(port: int) -> str:
    """Three ways to 127.0.0.1:`port`: a socket of its own, a subprocess, multiprocessing's fork-exec."""
    probe = (f"import socket\ntry:\n    socket.create_connection(('127.0.0.1', {port}), timeout=2)\n"
             f"    print('connected')\nexcept OSError as e:\n    print('refused', e)\n")
    return UNHOOK + f"""
import os, socket, subprocess, sys, multiprocessing.util
attempts = 0
try:
    socket.create_connection(("127.0.0.1", {port}), timeout=2)
    print("connected")
except OSError as e:
    print("refused", e)
attempts += 1
done = subprocess.run([sys.executable, "-I", "-S", "-c", {probe!r}], capture_output=True, text=True)
print(done.stdout, done.stderr[-300:])
attempts += 1
pid = multiprocessing.util.spawnv_passfds(os.fsencode(sys.executable),
                                          [sys.executable, "-I", "-S", "-c", {probe!r}], [1])
os.waitpid(pid, 0)
attempts += 1
print("attempts", attempts)
"""


def daemon(token: str) -> str:
    """A grandchild in a session of its own (double fork + setsid), running `sleep <token>`."""
    return UNHOOK + f"""
import os
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        os.execv("/usr/bin/sleep", ["sleep", "{token}"])
    os._exit(0)
os.wait()
"""


def fork_storm(token: str, count: int) -> str:
    """Up to `count` children, each its own session running `sleep <token>`; prints how many it started."""
    return UNHOOK + f"""
import os
started = 0
for _ in range({count}):
    try:
        pid = os.fork()
    except OSError:
        break
    if pid == 0:
        os.setsid()
        os.execv("/usr/bin/sleep", ["sleep", "{token}"])
    started += 1
print("forked", started)
"""


def kill(victims: list[int]) -> str:
    """Signals the host's `victims` and its own parent every way it can: os.kill, a pidfd, kill(1), pid 1."""
    return UNHOOK + f"""
import os, signal, subprocess
for victim in {victims!r}:
    for attempt in (lambda: os.kill(victim, signal.SIGKILL), lambda: os.kill(os.getppid(), signal.SIGKILL),
                    lambda: signal.pidfd_send_signal(os.pidfd_open(victim), signal.SIGKILL),
                    lambda: subprocess.run(["kill", "-9", str(victim)]), lambda: os.kill(1, signal.SIGKILL)):
        try:
            attempt()
        except OSError as e:
            print("refused", e)
"""


def write_outside(targets: list[str]) -> str:
    """Creates files and device nodes at `targets`, a device node in its scratch, and opens a kernel sysctl."""
    return UNHOOK + f"""
import os, stat
for target in {targets!r}:
    for make in (lambda: open(target, "w").write("x"),
                 lambda: os.mknod(target, stat.S_IFCHR | 0o666, os.makedev(1, 3))):
        try:
            make()
            print("made", target)
        except OSError:
            pass
try:
    os.mknod("node", stat.S_IFCHR | 0o666, os.makedev(1, 3))
    print("mknod made")
except OSError:
    print("mknod refused")
try:
    os.close(os.open("/proc/sys/kernel/core_pattern", os.O_WRONLY))  # opened, not written
    print("sysctl writable")
except OSError:
    print("sysctl refused")
"""


def syscalls(calls: dict[str, tuple[int, tuple[int, ...]]]) -> str:
    """Makes each raw system call {name: (number, args)} through libc's syscall(); prints {name: [result, errno]}."""
    return UNHOOK + f"""
import ctypes, json
libc = ctypes.CDLL(None, use_errno=True)
made = {{}}
for name, (number, args) in {calls!r}.items():
    ctypes.set_errno(0)
    made[name] = [libc.syscall(number, *args), ctypes.get_errno()]
print(json.dumps(made))
"""


def persist() -> str:
    """Start-up files that would run code in later interpreters: a .pth file in every site and library folder, a
    history file, a marker in its HOME. (Not sitecustomize.py: were the sandbox broken, it would run in every
    interpreter of the machine.)"""
    return UNHOOK + """
import os, site, sys, sysconfig
payload = "import os; os.environ['PERSISTED'] = '1'\\n"
folders = set(site.getsitepackages() + [site.getusersitepackages(), sysconfig.get_paths()["stdlib"],
              sysconfig.get_paths()["purelib"], os.path.dirname(os.__file__)])
for folder in folders:
    try:
        os.makedirs(folder, exist_ok=True)
        open(os.path.join(folder, "lapstudy_persist.pth"), "w").write(payload)
        if not folder.startswith(os.path.expanduser("~")):  # its HOME is its scratch, gone afterwards
            print("planted in", folder)
    except OSError:
        pass
for name in ("~/.python_history", "~/.lapstudy_mark"):
    try:
        open(os.path.expanduser(name), "w").write(payload)
    except OSError:
        pass
"""


def remove(project: str) -> str:
    return UNHOOK + f"""
import os, shutil
shutil.rmtree({project!r}, ignore_errors=True)
for root, _dirs, files in os.walk({project!r}):
    for name in files:
        try:
            os.remove(os.path.join(root, name))
        except OSError:
            pass
"""


def forgeries(wrong: str) -> dict[str, str]:
    """Wrong solutions (or none at all) that each try to be scored as passed."""
    fake = '{"passed": true}'
    return {
        "os._exit(0) before the tests": "import os\nos._exit(0)\n",
        "sys.exit(0) before the tests": "import sys\nsys.exit(0)\n",
        "os._exit(0) inside the call": "import os\ndef add(a, b):\n    os._exit(0)\n",
        "markers printed": f"print('passed')\nprint({fake!r})\nimport sys\nprint({fake!r}, file=sys.stderr)\n" + wrong,
        "a fake verdict on every fd": UNHOOK + f"import os\nfor fd in range(3, 64):\n    try:\n        os.write(fd, "
                                       f"{fake!r}.encode())\n    except OSError:\n        pass\n" + wrong,
        "__eq__ that always agrees": "class Yes:\n    def __eq__(self, other):\n        return True\n"
                                     "def add(a, b):\n    return Yes()\n",
        "int subclass that always agrees": "class Yes(int):\n    def __eq__(self, other):\n        return True\n"
                                           "    __hash__ = int.__hash__\ndef add(a, b):\n    return Yes(0)\n",
        "AssertionError patched away": "import builtins\nbuiltins.AssertionError = type('Nothing', (Exception,), {})\n"
                                       + wrong,
        "tracing that skips the test": "import sys\ndef tracer(frame, event, arg):\n    if frame.f_code.co_name == "
                                       "'check':\n        raise SystemExit(0)\n    return tracer\n"
                                       "sys.settrace(tracer)\n"
                                       + wrong,
        "patched json and exit codes": UNHOOK + "import json, os\njson.dumps = lambda *a, **k: " + repr(fake) +
                                       "\nos._exit = lambda code: os.abort()\n" + wrong,
        "answers forged through the pipe": UNHOOK + "import os, json\nfor fd in range(3, 64):\n    try:\n        "
                                           "os.write(fd, (json.dumps({'value': 5}) + '\\n').encode() * 8)\n"
                                           "    except OSError:\n        pass\n" + wrong,
        "the guard's own functions replaced": UNHOOK + "import sys\nm = sys.modules['__main__']\n"
                                              "m.encode = lambda v: 5\n" + wrong,
    }
