"""Reaching Ray: a clear error for a cluster address that cannot work, and the one way every command starts (or
joins) its Ray cluster."""

from __future__ import annotations

import logging
import os
import re
import socket
import sys
from pathlib import Path

import ray
from ray.exceptions import AuthenticationError

from study.errors import UserError
from study.tracking import MLFLOW_CREDENTIAL_VARIABLES

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


def pin_ray_address() -> None:
    """Point Ray's own address look-ups in this process at the cluster it is connected to. Ray's State API, which
    Tune and Train's placement-group cleaner call without an address, otherwise looks for a local cluster and gives
    up when two run on the machine (another study, a notebook's): the placement groups of trials stopped early are
    then never freed and the next trials wait for CPUs forever. Runs in the driver, and in every worker process as
    the runtime environment's setup hook."""
    os.environ.setdefault("RAY_ADDRESS", ray.get_runtime_context().gcs_address)


def connect_ray(address: str | None, storage: Path) -> str | None:
    """Start a local cluster (dashboard on: Tune needs it to clean up the placement groups of stopped trials) or
    join the one at `address`. Returns the local cluster's session folder (None when joining one)."""
    env = {"MLFLOW_DISABLE_TELEMETRY": "true"}
    env["HF_HOME"] = os.environ.get("HF_HOME") or str(storage / ".hf_home")
    # Passed to the workers in memory (Ray's runtime environment), never written to the study folder.
    for key in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "HF_TOKEN", *MLFLOW_CREDENTIAL_VARIABLES):
        if key in os.environ:
            env[key] = os.environ[key]
    env[TRAIN_POLL_VARIABLE] = os.environ.get(TRAIN_POLL_VARIABLE, TRAIN_POLL_S)
    os.environ.setdefault("HF_HOME", env["HF_HOME"])
    os.environ.setdefault("RAY_AIR_NEW_OUTPUT", "0")
    runtime_env = {"env_vars": env, "worker_process_setup_hook": f"{__name__}.{pin_ray_address.__name__}"}
    kwargs = dict(runtime_env=runtime_env, log_to_driver=False, logging_level="ERROR")
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
        where = f"--address {address}" if address else "local Ray cluster"
        raise UserError(f"{where}: cannot connect ({' '.join(str(exc).split())[:200]})") from None
    pin_ray_address()
    # Ray's, Optuna's and MLflow's own log lines would bury the progress lines; errors still come through.
    logging.getLogger("mlflow").setLevel(logging.WARNING)
    for logger in ("ray", "ray.train", "ray.data"):
        logging.getLogger(logger).setLevel(logging.ERROR)
    # Tune logs every trial error with its full traceback; the progress lines already name the error.
    logging.getLogger("ray.tune").setLevel(logging.CRITICAL)
    sys.stdout.flush()
    return session_dir
