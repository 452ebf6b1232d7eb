"""The study driver's record in its study folder (driver.json): which process drives the study, on which machine,
and which local Ray session it started.

`lapstudy run --resume` reads it before starting anything: a driver still alive on this machine means the study is
still running (the resume is refused); a driver that died (killed, or its machine rebooted with the storage intact)
may have left processes of its Ray session behind, some of which never exit on their own (Ray's agents, workers of
a raylet that lives on, the dashboard's helpers). The resume ends those before it starts a session of its own.
"""

from __future__ import annotations

import json
import os
import socket
from dataclasses import asdict, dataclass
from pathlib import Path

import psutil

from study.errors import UserError

DRIVER_FILE = "driver.json"
TERMINATE_WAIT_S = 5.0


@dataclass(frozen=True)
class DriverRecord:
    host: str
    pid: int
    started: float  # the process's start time: with the pid, it tells the process apart from a later one
    session_dir: str | None  # the local Ray session it started (None: it joined a cluster)

    def alive(self) -> bool:
        """Whether the driver still runs (on this machine; a driver elsewhere cannot be seen and counts as not)."""
        if self.host != socket.gethostname():
            return False
        try:
            return psutil.Process(self.pid).create_time() == self.started
        except psutil.Error:
            return False


def record_driver(folder: Path, session_dir: str | None) -> None:
    me = psutil.Process()
    record = DriverRecord(socket.gethostname(), me.pid, me.create_time(), session_dir)
    (folder / DRIVER_FILE).write_text(json.dumps(asdict(record), indent=2) + "\n")


def previous_driver(folder: Path) -> DriverRecord | None:
    """The record of the driver that ran the study before; UserError if that driver still runs."""
    path = folder / DRIVER_FILE
    if not path.is_file():
        return None
    record = DriverRecord(**json.loads(path.read_text()))
    if record.alive():
        raise UserError(f"--resume: the study in {folder} is still running (lapstudy process {record.pid} on this "
                        "machine); wait for it, or stop it first")
    return record


def end_session(record: DriverRecord | None) -> list[str]:
    """End every process left of `record`'s local Ray session on this machine: the processes that name the session
    folder in their command line or hold a file open under it, and all their descendants. Returns what it ended."""
    if record is None or record.session_dir is None or record.host != socket.gethostname():
        return []
    session = os.path.realpath(record.session_dir)
    protected = {p.pid for p in [psutil.Process(), *psutil.Process().parents()]}
    found: dict[int, psutil.Process] = {}
    for process in psutil.process_iter():
        if process.pid in protected or process.pid in found:
            continue
        if _uses(process, session):
            for member in [process, *_descendants(process)]:
                if member.pid not in protected:
                    found[member.pid] = member
    names = [f"{_name(p)}[{p.pid}]" for p in found.values()]
    for process in found.values():
        try:
            process.terminate()
        except psutil.Error:
            pass
    _, alive = psutil.wait_procs(list(found.values()), timeout=TERMINATE_WAIT_S)
    for process in alive:
        try:
            process.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(alive, timeout=TERMINATE_WAIT_S)
    return names


def _uses(process: psutil.Process, session: str) -> bool:
    try:
        if any(session in part for part in process.cmdline()):
            return True
        return any(os.path.realpath(f.path).startswith(session + os.sep) for f in process.open_files())
    except psutil.Error:  # gone, or not ours to inspect
        return False


def _descendants(process: psutil.Process) -> list[psutil.Process]:
    try:
        return process.children(recursive=True)
    except psutil.Error:
        return []


def _name(process: psutil.Process) -> str:
    try:
        return process.name()
    except psutil.Error:
        return "?"
