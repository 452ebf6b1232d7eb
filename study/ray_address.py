"""The setup hook of every Ray worker the study starts: its own module, so that a worker imports only Ray for it
(`study.cluster` brings in MLflow and datasets, about 3.5 s of start-up per worker process on 2 CPUs)."""

from __future__ import annotations

import logging
import os
import warnings

import ray


def pin_ray_address() -> None:
    """Point Ray's own address look-ups in this process at the cluster it is connected to. Ray's State API, which
    Tune and Train's placement-group cleaner call without an address, otherwise looks for a local cluster and gives
    up when two run on the machine (another study, a notebook's): the placement groups of trials stopped early are
    then never freed and the next trials wait for CPUs forever. Runs in the driver, and in every worker process as
    the runtime environment's setup hook (SETUP_HOOK)."""
    os.environ.setdefault("RAY_ADDRESS", ray.get_runtime_context().gcs_address)


RAY_DATA_DATASET_LOGGER = "ray.data.dataset"


class WithoutIdleCpuWarning(logging.Filter):
    """Drops Ray Data's warning that no CPU is free at the instant a dataset starts (so it "will hang"): the study
    keeps a CPU of the cluster for Ray Data (study/resources.py), so a moment without a free one is a wait for the
    reserve, and the warning came with every trial of every laptop study. Its other warnings pass."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "does not have any available CPUs" not in str(record.msg)


def quiet_library_logs() -> None:
    """Workers' output reaches the driver's (log_to_driver) and so `ray job logs`: their warnings, errors and stderr
    (CUDA, NCCL) must, but Ray's routine INFO lines (Train's worker group starting, ...) would bury the progress
    lines. Ray Data's level comes from RAY_DATA_LOG_LEVEL in the runtime environment (study/cluster.py), which it
    reads when it is imported: importing it here would cost every worker process seconds."""
    logging.getLogger("ray").setLevel(logging.WARNING)
    # Ray Data's own batch conversion (torch_utils) hands torch read-only NumPy arrays it never writes to: a warning
    # on the first batch of every trial that nobody can act on.
    warnings.filterwarnings("ignore", message="The given NumPy array is not writable", category=UserWarning)
    dataset_logger = logging.getLogger(RAY_DATA_DATASET_LOGGER)
    if not any(isinstance(f, WithoutIdleCpuWarning) for f in dataset_logger.filters):
        dataset_logger.addFilter(WithoutIdleCpuWarning())


def setup_worker() -> None:
    pin_ray_address()
    quiet_library_logs()


# What a runtime environment's `worker_process_setup_hook` names to run in every worker.
SETUP_HOOK = f"{__name__}.{setup_worker.__name__}"
