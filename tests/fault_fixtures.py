"""Harness for the fault tests: tiny study spaces, the real `lapstudy` command as a subprocess with Ray kept in a
short temp folder, waits with deadlines, Ray's and MLflow's records read back, and clean-up of processes by the ids
recorded when they were started (never by name).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import yaml

REPO = Path(__file__).resolve().parents[1]
LAPSTUDY = Path(sys.executable).with_name("lapstudy")


def tiny_space(**changes) -> dict:
    """A study of a small ViT on digits (ships offline) that a 2-CPU machine trains in a few seconds per trial.
    Trials are fixed by `points_to_evaluate` and no early stopping, so the fault tests know what each one does."""
    space = {
        "name": "fault",
        "task": "classification",
        "dataset": {"source": "digits"},
        "metric": "val_acc",
        "mode": "max",
        "epochs": 4,
        "seed": 0,
        "num_samples": 2,
        "sampler": {"kind": "tpe", "n_startup_trials": 1},
        "early_stopping": "none",
        "geometry": {"max_batches": 1, "pca_points": 100},
        "fixed": {"preset": "vit_tiny_digits", "depth": 2, "batch_size": 64, "warmup_epochs": 0},
        "parameters": {
            "lr": {"type": "log_float", "low": 1.0e-4, "high": 1.0e4},
            "k": {"type": "int", "low": 0, "high": 4},
        },
        "points_to_evaluate": [{"lr": 1.0e-3, "k": 0}, {"lr": 2.0e-3, "k": 2}],
    }
    space.update(changes)
    return space


def write_space(path: Path, space: dict) -> Path:
    path.write_text(yaml.safe_dump(space, sort_keys=False))
    return path


def tree_digest(root: Path) -> str:
    """sha256 over every path (relative), file mode and file content under `root`: equal digests mean the folder is
    byte-for-byte unchanged."""
    digest = hashlib.sha256()
    root = Path(root)
    for path in sorted(root.rglob("*")):
        relative = path.relative_to(root).as_posix()
        stat = path.lstat()
        digest.update(f"{relative}\0{stat.st_mode:o}\0".encode())
        if path.is_file() and not path.is_symlink():
            digest.update(path.read_bytes())
        digest.update(b"\1")
    return digest.hexdigest()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_for(predicate, timeout: float, what: str, every: float = 0.25):
    """The predicate's first truthy value; AssertionError naming `what` after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(every)


# ---- the study driver as a subprocess -------------------------------------------------------------------------------


def study_env(ray_tmp: Path, **extra: str) -> dict:
    """Environment of a `lapstudy` subprocess: Ray's files under a short private folder (Unix socket paths are
    limited), offline hubs, no telemetry, unbuffered output so the log shows progress as it happens."""
    env = dict(os.environ)
    env.update({
        "RAY_TMPDIR": str(ray_tmp),
        "HF_HUB_OFFLINE": "1",
        "HF_HOME": str(ray_tmp / "hf"),
        "MLFLOW_DISABLE_TELEMETRY": "true",
        "RAY_USAGE_STATS_ENABLED": "0",
        "PYTHONUNBUFFERED": "1",
        "TQDM_DISABLE": "1",
    })
    env.update(extra)
    return env


class Lapstudy:
    """`lapstudy ARGS` started in the background; output goes to a log file the assertions quote."""

    def __init__(self, args: list[str], env: dict, log: Path, cwd: Path | None = None):
        self.args, self.log_path = [str(a) for a in args], log
        self._log = open(log, "ab")
        self._log.write(f"\n$ lapstudy {' '.join(self.args)}\n".encode())
        self._log.flush()
        self.process = subprocess.Popen([str(LAPSTUDY), *self.args], env=env, cwd=cwd, stdout=self._log,
                                        stderr=subprocess.STDOUT, start_new_session=True)
        self.pid = self.process.pid

    def log(self, tail: int = 6000) -> str:
        return self.log_path.read_text(errors="replace")[-tail:]

    def wait(self, timeout: float) -> int:
        try:
            return self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"lapstudy {' '.join(self.args)} still running after {timeout:.0f} s; log:\n"
                                 + self.log()) from None
        finally:
            self._log.flush()

    def finished(self) -> bool:
        return self.process.poll() is not None

    def close(self):
        if self.process.poll() is None:
            os.killpg(self.pid, signal.SIGKILL)
            self.process.wait(30)
        self._log.close()


def run_lapstudy(args: list, env: dict, timeout: float, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([str(LAPSTUDY), *[str(a) for a in args]], env=env, cwd=cwd, capture_output=True,
                          text=True, timeout=timeout)


@dataclass(frozen=True)
class Proc:
    """A process recorded by pid and start time (from /proc), so a later kill cannot hit a reused pid."""

    pid: int
    start: int
    name: str

    @staticmethod
    def read(pid: int) -> "Proc | None":
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            return None
        name, rest = stat[stat.index("(") + 1:stat.rindex(")")], stat[stat.rindex(")") + 2:].split()
        return Proc(pid, int(rest[19]), name) if rest[0] != "Z" else None  # field 22: starttime; Z: zombie

    def alive(self) -> bool:
        now = Proc.read(self.pid)
        return now is not None and now.start == self.start


def _parents() -> dict[int, int]:
    parents = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
                parents[int(entry.name)] = int(stat[stat.rindex(")") + 2:].split()[1])
            except (OSError, ValueError, IndexError):
                continue
    return parents


def process_tree(pid: int) -> list[Proc]:
    """The process and all its live descendants, recorded (pid + start time)."""
    parents = _parents()
    tree, frontier = [pid], [pid]
    while frontier:
        children = [child for child, parent in parents.items() if parent in frontier]
        tree += children
        frontier = children
    return [p for p in map(Proc.read, tree) if p is not None]


def kill_recorded(processes: list[Proc], timeout: float = 20.0) -> list[str]:
    """SIGKILL every recorded process still alive (same pid and start time); returns what had to be killed."""
    killed = []
    for process in processes:
        if process.alive():
            try:
                os.kill(process.pid, signal.SIGKILL)
                killed.append(f"{process.name}[{process.pid}]")
            except ProcessLookupError:
                pass
    deadline = time.monotonic() + timeout
    while any(p.alive() for p in processes) and time.monotonic() < deadline:
        time.sleep(0.1)
    return killed


def settled(processes: list[Proc], quiet: float = 3.0, timeout: float = 60.0) -> list[Proc]:
    """The recorded processes still alive once none has exited for `quiet` seconds (at most `timeout`): after a
    driver's kill, what does not exit on its own."""
    deadline = time.monotonic() + timeout
    alive = [p for p in processes if p.alive()]
    last_change = time.monotonic()
    while time.monotonic() - last_change < quiet and time.monotonic() < deadline:
        time.sleep(0.2)
        now = [p for p in alive if p.alive()]
        if len(now) != len(alive):
            alive, last_change = now, time.monotonic()
    return alive



def kill_study_when(args: list, env: dict, cwd: Path, ready, what: str, timeout: float = 400) -> None:
    """`lapstudy ARGS` from `cwd`, its driver SIGKILLed once `ready()` holds while it still runs, then waited on until
    every process it had started has ended by itself: the state a `--resume` starts from."""
    study = Lapstudy(args, env, cwd / "first.log", cwd=cwd)
    try:
        def running_and_ready():
            assert not study.finished(), "the study ended before the kill:\n" + study.log()
            return ready()
        wait_for(running_and_ready, timeout, what)
        recorded = process_tree(study.pid)
        os.kill(study.pid, signal.SIGKILL)
        study.process.wait(30)
    finally:
        study.close()
    settled(recorded[1:])


def resume_study(args: list, env: dict, cwd: Path) -> str:
    """`lapstudy ARGS --resume` from `cwd` to its successful end; the tail of its log."""
    resumed = Lapstudy([*args, "--resume"], env, cwd / "resumed.log", cwd=cwd)
    try:
        assert resumed.wait(600) == 0, resumed.log()
        return resumed.log(20000)
    finally:
        resumed.close()

def processes_using(marker: str) -> list[Proc]:
    """Live processes whose command line mentions `marker` (a private temp folder): what a test left behind."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if marker in cmdline:
            process = Proc.read(int(entry.name))
            if process is not None and process.pid != os.getpid():
                found.append(process)
    return found


@contextmanager
def private_ray_tmp(prefix: str = "lsf"):
    """A short private RAY_TMPDIR; on exit, any process still using it is reported and killed (then the test that
    leaked it fails)."""
    folder = Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp"))
    try:
        yield folder
    finally:
        leaked = processes_using(str(folder))
        kill_recorded(leaked)
        if leaked:
            raise AssertionError(f"processes left running under {folder}: {[p.pid for p in leaked]}")


@contextmanager
def ray_without_dashboard():
    """An idle one-CPU Ray instance started without a dashboard, in a process of its own under a private RAY_TMPDIR
    (another user's cluster, a notebook's); yields its GCS address."""
    with private_ray_tmp("lso") as folder:
        script = ("import ray, time; ray.init(num_cpus=1, include_dashboard=False); "
                  "print(ray.get_runtime_context().gcs_address, flush=True); time.sleep(3600)")
        process = subprocess.Popen([sys.executable, "-c", script], env={**os.environ, "RAY_TMPDIR": str(folder)},
                                   stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                                   start_new_session=True)
        try:
            address = process.stdout.readline().strip()
            assert address, "the Ray instance did not start"
            yield address
        finally:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(30)
            kill_recorded(processes_using(str(folder)))  # Ray's daemons that left the process group
            shutil.rmtree(folder, ignore_errors=True)


@contextmanager
def simulated_cluster(prefix: str, *node_resources: dict):
    """A multi-node Ray cluster on this machine (`ray.cluster_utils.Cluster`), one CPU per node, under a private
    RAY_TMPDIR: the head (dashboard on, as Tune needs) holds the first custom resources, each further node the next.
    Yields the cluster, its nodes in that order, its address and the environment of a `lapstudy` joining it."""
    import pytest
    from ray.cluster_utils import Cluster

    with private_ray_tmp(prefix) as ray_tmp:
        patch = pytest.MonkeyPatch()
        patch.setenv("RAY_TMPDIR", str(ray_tmp))  # Cluster() writes its sessions under $RAY_TMPDIR/ray
        cluster = Cluster(shutdown_at_exit=False)
        try:
            head_resources, *others = node_resources
            # Free ports for the dashboard and every node's agent: Ray's fixed agent port (52365) is taken by any
            # other Ray instance on the machine, and the job API through that agent then fails.
            nodes = [cluster.add_node(num_cpus=1, resources=head_resources, include_dashboard=True,
                                      dashboard_port=free_port(), dashboard_agent_listen_port=free_port())]
            nodes += [cluster.add_node(num_cpus=1, resources=resources, dashboard_agent_listen_port=free_port())
                      for resources in others]
            cluster.wait_for_nodes()
            yield SimpleNamespace(cluster=cluster, nodes=nodes, address=cluster.address, env=study_env(ray_tmp),
                                  ray_tmp=ray_tmp)
        finally:
            cluster.shutdown()
            patch.undo()


def lose_node(cluster, node) -> list[Proc]:
    """A machine lost at once: every process of a simulated node (its raylet and everything the raylet started:
    Ray workers, trial drivers, Train workers, agents) SIGKILLed together, then the node removed as cluster_utils
    removes it. `remove_node` alone kills only the raylet and its helpers; the node's workers then go on for seconds
    until they notice, which no lost machine does. Returns the processes it killed."""
    roots = [info.process.pid for infos in node.all_processes.values() for info in infos]
    processes = [process for pid in roots for process in process_tree(pid)]
    kill_recorded(processes)
    cluster.remove_node(node, allow_graceful=False)
    return processes


# ---- Ray's records (the study folder) and MLflow's -----------------------------------------------------------------


def tune_results(study_dir: Path) -> dict[str, list[dict]]:
    """Every result Tune recorded, per trial id, in order: the trials' `result.json` in the study folder (what a
    resume starts from; Tune copies its records there from its staging folder every few seconds)."""
    return _read_results(Path(study_dir).glob("*/result.json"))


def live_results(ray_tmp: Path, study: str) -> dict[str, list[dict]]:
    """The same records as Tune writes them, in its staging folder inside the Ray session (up to date). Each file
    once: `session_latest` is a link to the newest session's folder."""
    files = Path(ray_tmp).glob(f"ray/session_*/artifacts/*/{study}/driver_artifacts/*/result.json")
    return _read_results({path.resolve() for path in files})


def wait_for_epoch(study: "Lapstudy", ray_tmp: Path, name: str, epoch: int, what: str, *,
                   other_than: str | None = None, timeout: float = 240) -> dict:
    """The newest live row of the first trial (other than `other_than`) that has reported `epoch`; fails, with the
    study's output, if the study ends first (the fault would come too late to test anything)."""
    def reached():
        assert not study.finished(), f"the study ended before {what}:\n" + study.log()
        for trial, rows in live_results(ray_tmp, name).items():
            if trial != other_than and rows and rows[-1]["epoch"] >= epoch:
                return rows[-1]
        return None

    return wait_for(reached, timeout, f"a trial to report epoch {epoch} ({what})")


def _read_results(paths) -> dict[str, list[dict]]:
    results: dict[str, list[dict]] = {}
    for path in sorted(paths):
        rows = []
        try:
            text = path.read_text()
        except FileNotFoundError:  # listed, then removed by Tune before it could be read (a live folder)
            continue
        for line in text.splitlines():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:  # a line being written right now
                break
        if rows:
            results.setdefault(rows[0]["trial_id"], []).extend(rows)
    return results


def reported_epochs(results: dict[str, list[dict]]) -> dict[str, int]:
    """The last epoch each trial reported."""
    return {trial: max(int(r.get("epoch", 0)) for r in rows) for trial, rows in results.items()}


def mlflow_runs(tracking_uri: str, experiment: str) -> dict[str, list[dict]]:
    """Every MLflow run of the experiment, grouped by its `lapstudy.trial_id` tag: run id, status, tags, params and
    the full history (step, value) of every metric."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri)
    found = client.get_experiment_by_name(experiment)
    if found is None:
        return {}
    runs: dict[str, list[dict]] = {}
    for run in client.search_runs([found.experiment_id], max_results=1000):
        if run.data.tags.get("lapstudy.study_run") == "true":
            continue  # the study's own run: study_run() reads it
        history = {key: sorted((m.step, m.value) for m in client.get_metric_history(run.info.run_id, key))
                   for key in run.data.metrics}
        runs.setdefault(run.data.tags.get("lapstudy.trial_id"), []).append({
            "run_id": run.info.run_id, "status": run.info.status, "tags": dict(run.data.tags),
            "params": dict(run.data.params), "history": history,
        })
    return runs


def study_run(tracking_uri: str, experiment: str) -> dict:
    """The study's own MLflow run (the parent of its trial runs): id, status, tags, params, metrics."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri)
    found = client.get_experiment_by_name(experiment)
    [run] = client.search_runs([found.experiment_id], filter_string="tags.`lapstudy.study_run` = 'true'")
    return {"run_id": run.info.run_id, "status": run.info.status, "tags": dict(run.data.tags),
            "params": dict(run.data.params), "metrics": dict(run.data.metrics)}


def study_records(study_dir: Path, experiment: str, tracking_uri: str | None = None) -> tuple[dict, dict]:
    """Ray's records and MLflow's runs of a study (MLflow: the SQLite store in the study folder unless given)."""
    return tune_results(study_dir), mlflow_runs(tracking_uri or f"sqlite:///{Path(study_dir) / 'mlflow.db'}",
                                                experiment)


def explain(rows: list[dict], log: str) -> str:
    """What a fault test's failure needs to be understood without the run: a trial's rows in Ray's records (epoch,
    checkpoint it resumed from, trial driver and rank-0 processes) and the study's output."""
    brief = [{key: row.get(key) for key in ("epoch", "resumed_from_epoch", "pid", "worker_pid")} for row in rows]
    return f"\nRay's rows of the trial: {brief}\nthe study's output:\n{log}"


def epoch_steps(run: dict, key: str = "epoch") -> list[int]:
    return [step for step, _ in run["history"].get(key, [])]


@contextmanager
def mlflow_server(store: Path, port: int, log: Path, *, backend: str | None = None, artifacts: str | None = None,
                  env: dict | None = None):
    """A real `mlflow server` on 127.0.0.1 over a SQLite store in `store` (or the `backend` store's URI, artifacts
    to `artifacts`); yields a handle with stop()/start() so a test can take it away and bring it back on the same
    port and store."""
    server = _MlflowServer(store, port, log, backend, artifacts, env or {})
    server.start()
    try:
        yield server
    finally:
        server.stop()


class _MlflowServer:
    def __init__(self, store: Path, port: int, log: Path, backend: str | None, artifacts: str | None, env: dict):
        self.store, self.port, self.log = Path(store), port, log
        self.backend = backend or f"sqlite:///{self.store / 'mlflow.db'}"
        self.artifacts, self.env = artifacts or str(self.store / "artifacts"), env
        self.process = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 90.0):
        self.store.mkdir(parents=True, exist_ok=True)
        command = [sys.executable, "-m", "mlflow", "server", "--backend-store-uri", self.backend,
                   "--artifacts-destination", self.artifacts,
                   "--host", "127.0.0.1", "--port", str(self.port), "--workers", "1"]
        with open(self.log, "ab") as out:
            # Started as cluster.yaml starts the head's server: without MLflow's job runner (GenAI judges and
            # scorers, a huey consumer pool of its own), which has nothing to do for a study's runs.
            self.process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                            env={**os.environ, "MLFLOW_DISABLE_TELEMETRY": "true",
                                                 "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false", **self.env})
        wait_for(self.healthy, timeout, f"mlflow server on port {self.port}", every=0.5)

    def healthy(self) -> bool:
        if self.process is not None and self.process.poll() is not None:
            raise AssertionError(f"mlflow server exited ({self.process.returncode}): {self.log.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(f"{self.url}/health", timeout=2) as response:
                return response.status == 200
        except OSError:
            return False

    def stop(self):
        """SIGKILL the server's process group (the id recorded when it was started): an abrupt loss, as in a crash."""
        if self.process is not None and self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(30)
        self.process = None
