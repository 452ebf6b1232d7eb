"""How many trials run at once, decided up front so that trials never starve their own Train workers.

A trial is a driver that asks for no CPU (it only waits on its TorchTrainer) plus `workers` Train workers of
`cpus_per_worker` CPUs (and GPUs) each; a trial that trains in its own process (`trains_in_trial`) asks for its one
worker's CPUs and GPUs itself. Ray Data's read and transform tasks need CPU as well: one CPU of the cluster stays
free for them, or a data pipeline can hang without an error.
"""

from __future__ import annotations

import math

from study.errors import UserError
from study.runspec import Resources

DATA_CPU_RESERVE = 1.0
# The trial driver holds no CPU: with one CPU per driver, two concurrent trials on 2 CPUs leave none for their
# workers and wait forever. Ray refuses an all-zero request, hence the token of memory.
TRIAL_DRIVER_RESOURCES = {"CPU": 0, "memory": 1}
# A head-node resource (cluster.yaml) that pins trial drivers to the head, which is never preempted.
DRIVER_NODE_RESOURCE = "lapstudy_driver"
STANDARD_RESOURCES = frozenset({"CPU", "GPU", "memory", "object_store_memory"})


def trial_concurrency(resources: Resources, cluster: dict, nodes: list[dict], requested: int | None,
                      worker_resources: dict | None = None) -> int:
    """The number of trials that can run side by side; UserError (saying what fits) when the sizing cannot work.
    `worker_resources` are custom resources each Train worker asks for (--worker-resource)."""
    cpus, gpus = cluster.get("CPU", 0.0), cluster.get("GPU", 0.0)
    per_trial_cpu = resources.workers * resources.cpus_per_worker
    per_trial_gpu = resources.workers * resources.gpus_per_worker
    usable_cpu = cpus - DATA_CPU_RESERVE
    largest_node_cpu = max((n.get("CPU", 0.0) for n in nodes), default=0.0)
    largest_node_gpu = max((n.get("GPU", 0.0) for n in nodes), default=0.0)
    if resources.cpus_per_worker > largest_node_cpu:
        raise UserError(
            f"--cpus-per-worker {resources.cpus_per_worker:g}: no node of this cluster has that many CPUs "
            f"(largest: {largest_node_cpu:g})"
        )
    if resources.gpus_per_worker > largest_node_gpu:
        raise UserError(
            f"--gpus-per-worker {resources.gpus_per_worker:g}: no node of this cluster has that many GPUs "
            f"(largest: {largest_node_gpu:g}; use 0 on a CPU cluster)"
        )
    if per_trial_cpu > usable_cpu + 1e-9:
        hint = (f"at most {usable_cpu:g} CPUs per trial fit, e.g. --workers-per-trial 1 --cpus-per-worker {usable_cpu:g}"
                if usable_cpu > 0 else "nothing fits: give Ray at least 2 CPUs")
        raise UserError(
            f"--workers-per-trial {resources.workers} x --cpus-per-worker {resources.cpus_per_worker:g}: a trial needs "
            f"{per_trial_cpu:g} CPUs for its workers, but this cluster has {cpus:g} CPUs and keeps "
            f"{DATA_CPU_RESERVE:g} free for Ray Data; {hint}"
        )
    fits = math.floor(usable_cpu / per_trial_cpu + 1e-9)
    if per_trial_gpu > 0:
        if per_trial_gpu > gpus + 1e-9:
            raise UserError(
                f"--workers-per-trial {resources.workers} x --gpus-per-worker {resources.gpus_per_worker:g}: a trial "
                f"needs {per_trial_gpu:g} GPUs, this cluster has {gpus:g}"
            )
        fits = min(fits, math.floor(gpus / per_trial_gpu + 1e-9))
    for name, amount in (worker_resources or {}).items():
        if not any(node.get(name, 0.0) >= amount for node in nodes):
            offered = sorted({key for node in nodes for key in node
                              if key not in STANDARD_RESOURCES and not key.startswith("node:")})
            raise UserError(f"--worker-resource {name}={amount:g}: no node of this cluster has that much {name!r} "
                            f"(custom resources here: {', '.join(offered) or 'none'})")
        fits = min(fits, math.floor(cluster.get(name, 0.0) / (resources.workers * amount) + 1e-9))
    if requested is not None and requested > fits:
        raise UserError(
            f"--max-concurrent {requested}: only {fits} trial(s) of {resources.workers} worker(s) x "
            f"{resources.cpus_per_worker:g} CPU fit on this cluster ({cpus:g} CPUs, {gpus:g} GPUs, "
            f"{DATA_CPU_RESERVE:g} CPU kept for Ray Data)"
        )
    return requested or fits


def trains_in_trial(resources: Resources, cluster: dict, worker_resources: dict | None) -> bool:
    """Whether a trial trains in its own process (Ray Train's local mode, study/host.py) instead of a Train worker
    group: with one worker, no custom placement of it (--worker-resource) and no head node reserved for trial
    drivers (whose workers belong on the worker nodes). That saves starting a Train controller and a worker process
    per trial, and with actor reuse a process per trial altogether."""
    return resources.workers == 1 and not worker_resources and cluster.get(DRIVER_NODE_RESOURCE, 0) == 0


def trial_driver_resources(cluster: dict, resources: Resources, in_process: bool) -> dict:
    if in_process:
        return {"CPU": resources.cpus_per_worker, **({"GPU": resources.gpus_per_worker}
                                                      if resources.gpus_per_worker else {})}
    driver = dict(TRIAL_DRIVER_RESOURCES)
    if cluster.get(DRIVER_NODE_RESOURCE, 0) > 0:
        driver[DRIVER_NODE_RESOURCE] = 0.001
    return driver
