"""Reaching Ray: a clear error for a cluster address that cannot work, and the one way every command starts (or
joins) its Ray cluster."""

from __future__ import annotations

import json
import logging
import os
import re
import socket
import sys
from pathlib import Path

import ray
from ray.exceptions import AuthenticationError

from study.errors import UserError
from study.ray_address import SETUP_HOOK, pin_ray_address
from study.storage import STORAGE_VARIABLES, is_remote, staging_folder

ADDRESS_FORMS = "auto, HOST:PORT (the head's address, e.g. 10.0.0.5:6379) or ray://HOST:PORT"
ADDRESS_TIMEOUT_S = 5.0
# A trial's Train controller polls its workers this often, and only then hands their reports to Tune and sees that
# they have finished: Train's 2 s default costs 3-4 s per trial (bench/study_overhead.py).
TRAIN_POLL_VARIABLE, TRAIN_POLL_S = "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.5"


def check_address(address: str | None) -> None:
    """A clear error for an address that is not one, or where nothing answers: Ray itself would retry for minutes."""
    if address is None or address == "auto":
        return
    target = address.removeprefix("ray://")
    host, colon, port = target.rpartition(":")
    if not colon or not host or not port.isdigit() or not 0 < int(port) < 65536 or re.search(r"[\s/@]", target):
        raise UserError(f"--address {address!r}: expected {ADDRESS_FORMS}")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=ADDRESS_TIMEOUT_S):
            pass
    except OSError as exc:
        reason = exc.strerror or type(exc).__name__
        raise UserError(f"--address {address}: cannot connect (nothing answers at {host}:{port}: {reason}); "
                        "is the cluster up? (`ray status` on its head)") from None


# Filesystems shared between machines, by their type in the mount table (/proc/mounts).
NETWORK_FILESYSTEMS = frozenset({
    "nfs", "nfs4", "efs", "cifs", "smb3", "smbfs", "9p", "afs", "lustre", "gpfs", "beegfs", "glusterfs", "ceph",
    "fuse.ceph", "fuse.glusterfs", "fuse.gcsfuse", "fuse.s3fs", "fuse.mountpoint-s3", "fuse.sshfs", "fuse.juicefs",
})
MOUNTS_FILE = "/proc/mounts"
TRACKING_FIX = ("pass --tracking-uri http://HEAD:5000, the MLflow server on the cluster's head (cluster.yaml and "
                "k8s/rayjob.yaml set LAPSTUDY_TRACKING_URI to it; docs/cluster.md)")


def filesystem_type(path: Path, mounts_file: str | None = None) -> str | None:
    """The type of the filesystem holding `path` (or its nearest existing parent), from the mount table: the entry
    with the longest mount point above it. None where the table cannot be read (not Linux)."""
    path = Path(path).resolve()
    while not path.exists() and path != path.parent:
        path = path.parent
    try:
        lines = Path(mounts_file or MOUNTS_FILE).read_text().splitlines()
    except OSError:
        return None
    best, kind = "", None
    for line in lines:
        fields = line.split()
        if len(fields) < 3:
            continue
        mount_point = fields[1].replace("\\040", " ")
        if (str(path) == mount_point or str(path).startswith(mount_point.rstrip("/") + "/")) \
                and len(mount_point) >= len(best):
            best, kind = mount_point, fields[2]
    return kind


def check_tracking_store(tracking_uri: str | None, storage: str, address: str | None,
                         hosts: set[str] | None = None) -> None:
    """Refuse a SQLite tracking store for a study that spans machines or is kept in object storage. `tracking_uri`
    None is the default SQLite store in the study folder under `storage`. Before Ray starts (`hosts` None): a joined
    cluster (`address`) with the store on a network filesystem, whose nodes (and the autoscaler's later ones) would
    all write that file (SQLite's locking is not safe over NFS: a corrupt or locked store). After it (`hosts`: the
    machines of the cluster's nodes): nodes on several machines, each of which would open its own SQLite file."""
    if tracking_uri is None and is_remote(storage):
        raise UserError(f"--storage {storage}: the study's default MLflow store is a SQLite file in its folder, which "
                        f"object storage cannot hold; pass --tracking-uri: an MLflow server (e.g. http://HEAD:5000, "
                        f"its runs in PostgreSQL and artifacts in object storage; docs/cluster.md)")
    if tracking_uri is None:
        where, named = Path(storage), f"no --tracking-uri, so the study would log to SQLite in {Path(storage)}"
    elif tracking_uri.startswith("sqlite:"):
        where, named = Path(tracking_uri.split(":///", 1)[-1] or "."), f"--tracking-uri {tracking_uri}"
    else:
        return
    if hosts is not None:
        if len(hosts) > 1:
            raise UserError(f"{named}: the cluster's nodes are on {len(hosts)} machines and each would write its own "
                            f"SQLite file; {TRACKING_FIX}")
        return
    kind = filesystem_type(where)
    if address and kind in NETWORK_FILESYSTEMS:
        raise UserError(f"{named}, on a shared filesystem ({kind}) written from several nodes: SQLite's locking is "
                        f"not safe there; {TRACKING_FIX}")


def check_state_api(where: str) -> None:
    """A clear error unless Ray's State API (served by the dashboard) answers for the connected cluster, by knowing
    this process's node. Tune and Train ask it whether a trial's actors live before freeing the trial's
    placement group: with no dashboard, trials stopped early keep their CPUs and the next ones wait forever; and the
    cluster's GCS then still names 127.0.0.1:8265, where another cluster's dashboard answers no, and a running
    trial's group is removed under it."""
    from ray.util.state import get_node
    from ray.util.state.exception import RayStateApiException

    try:
        node = get_node(ray.get_runtime_context().get_node_id(), timeout=10)
    except (RayStateApiException, ValueError):  # ValueError: the GCS names no API server at all
        node = None
    if node is None:
        raise UserError(f"{where}: Ray's State API does not answer for this cluster (no dashboard on its head); "
                        "start the head with `ray start --head --include-dashboard=true`")


# What the study's Ray workers get from the driver through the runtime environment: settings, never credentials.
# Ray shows a job's runtime environment to anyone who reaches the dashboard or the State API, so MLflow's, the hub's
# and the object store's credentials reach the workers through their nodes' own environment instead: inherited from
# this process on a local cluster, set on each node of a real one (cluster.yaml's cluster.env, k8s Secrets).
WORKER_SETTINGS = ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", *STORAGE_VARIABLES)


def job_runtime_env() -> dict:
    """The runtime environment of the Ray job this process runs as (`ray job submit --runtime-env-json`), {}
    outside a job. Ray merges it with the one `ray.init` is given and refuses a key that both set."""
    from ray._private.runtime_env.constants import RAY_JOB_CONFIG_JSON_ENV_VAR  # what ray.init itself reads

    injected = os.environ.get(RAY_JOB_CONFIG_JSON_ENV_VAR)
    return dict(json.loads(injected).get("runtime_env") or {}) if injected else {}


def hf_home(storage: str) -> str:
    """Hugging Face's cache: $HF_HOME, else a folder beside the study's (never the home folder)."""
    local = staging_folder(storage) if is_remote(storage) else Path(storage)
    return os.environ.get("HF_HOME") or str(local / ".hf_home")


def worker_runtime_env(storage: str, job_env: dict) -> dict:
    """The runtime environment `connect_ray` gives `ray.init`: what the workers need (no credential), less the
    variables the job's own runtime environment (`job_env`) already sets: the job's values reach the workers
    anyway, and Ray refuses to merge two environments that set the same variable."""
    env = {"MLFLOW_DISABLE_TELEMETRY": "true", "HF_HOME": hf_home(storage),
           TRAIN_POLL_VARIABLE: os.environ.get(TRAIN_POLL_VARIABLE, TRAIN_POLL_S),
           # Workers' output reaches the driver's (log_to_driver): no progress bars or INFO lines of Ray Data, none
           # of MLflow's.
           "RAY_TQDM": "0", "RAY_DATA_LOG_LEVEL": "WARNING", "MLFLOW_LOGGING_LEVEL": "WARNING"}
    env.update({key: os.environ[key] for key in WORKER_SETTINGS if key in os.environ})
    taken = set(job_env.get("env_vars") or {})
    return {"env_vars": {key: value for key, value in env.items() if key not in taken},
            "worker_process_setup_hook": SETUP_HOOK}


TUNE_CONTROLLER_LOGGER = "ray.tune.execution.tune_controller"


class WithoutTrialTracebacks(logging.Filter):
    """Drops the full traceback Tune logs for every failed trial: the progress line already names the error, and
    `lapstudy status` keeps it. Every other record of Tune's passes."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("Trial task failed for trial")


def connect_ray(address: str | None, storage: str) -> str | None:
    """Start a local cluster (dashboard on: Tune needs it to clean up the placement groups of stopped trials) or
    join the one at `address`. Returns the local cluster's session folder (None when joining one)."""
    job_env = job_runtime_env()
    runtime_env = worker_runtime_env(storage, job_env)
    os.environ.setdefault("HF_HOME", hf_home(storage))
    os.environ.setdefault("RAY_AIR_NEW_OUTPUT", "0")
    # Workers' output (their warnings, CUDA and NCCL errors) reaches the driver's, and so `ray job logs`.
    kwargs = dict(runtime_env=runtime_env, log_to_driver=True, logging_level="ERROR")
    where = f"--address {address}" if address else "local Ray cluster"
    try:
        if address:
            ray.init(address=address, **kwargs)
            session_dir = None
        else:
            session_dir = ray.init(include_dashboard=True, **kwargs).address_info["session_dir"]
    except AuthenticationError:
        raise UserError(f"--address {address}: the cluster uses token authentication and no token was found "
                        "here (~/.ray/auth_token, RAY_AUTH_TOKEN_PATH or RAY_AUTH_TOKEN); copy the cluster's "
                        "token") from None
    except (ConnectionError, ValueError, RuntimeError, OSError) as exc:  # OSError: e.g. RAY_TMPDIR too long
        # Ray's whole reason, less the values of the job's variables it quotes (a merge refusal quotes them all).
        reason = " ".join(str(exc).split())
        for value in (job_env.get("env_vars") or {}).values():
            if len(str(value)) >= 4:
                reason = reason.replace(str(value), "***")
        raise UserError(f"{where}: cannot connect ({reason})") from None
    pin_ray_address()
    if not (address or "").startswith("ray://"):  # through Ray Client, Tune's driver runs on the cluster, not here
        check_state_api(where)
    # Ray's, Ray Data's and MLflow's own log lines would bury the progress lines; errors still come through, and
    # Tune's warnings (among them that trials have waited long for resources no node offers).
    logging.getLogger("mlflow").setLevel(logging.WARNING)
    for logger in ("ray", "ray.train", "ray.data"):
        logging.getLogger(logger).setLevel(logging.ERROR)
    logging.getLogger("ray.tune").setLevel(logging.WARNING)
    tune_controller = logging.getLogger(TUNE_CONTROLLER_LOGGER)
    if not any(isinstance(f, WithoutTrialTracebacks) for f in tune_controller.filters):
        tune_controller.addFilter(WithoutTrialTracebacks())
    sys.stdout.flush()
    return session_dir
