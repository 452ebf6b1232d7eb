"""How many trials run at once, decided up front so that trials never starve their own Train workers.

On a cluster whose autoscaler can add nodes, any concurrency its node types can reach is accepted (Tune queues the
trials that wait for nodes, and the autoscaler adds nodes for them); only what no node type could ever hold is
refused.

A trial is a driver that asks for no CPU (it only waits on its TorchTrainer) plus `workers` Train workers of
`cpus_per_worker` CPUs (and GPUs) each; a trial that trains in its own process (`trains_in_trial`) asks for its one
worker's CPUs and GPUs itself. Ray Data's read and transform tasks need CPU as well: one CPU of the cluster stays
free for them, or a data pipeline can hang without an error.
"""

from __future__ import annotations

import math

from study.errors import UserError
from study.node_types import NodeType
from study.runspec import Resources

DATA_CPU_RESERVE = 1.0
# The trial driver holds no CPU: with one CPU per driver, two concurrent trials on 2 CPUs leave none for their
# workers and wait forever. Ray refuses an all-zero request, hence the token of memory.
TRIAL_DRIVER_RESOURCES = {"CPU": 0, "memory": 1}
# A head-node resource (cluster.yaml) that pins trial drivers to the head, which is never preempted.
DRIVER_NODE_RESOURCE = "lapstudy_driver"
STANDARD_RESOURCES = frozenset({"CPU", "GPU", "memory", "object_store_memory"})


def trial_concurrency(resources: Resources, cluster: dict, nodes: list[dict], requested: int | None,
                      worker_resources: dict | None = None, node_types: list[NodeType] | None = None) -> int:
    """The number of trials that may run side by side; UserError (saying what fits) when the sizing cannot work.
    `cluster` and `nodes`: the resources of the nodes up now, together and each. `node_types`: those the
    autoscaler may add (study/node_types.py; None: none known), on which any concurrency they can reach is
    accepted: Tune queues the trials that wait for nodes. `worker_resources` are custom resources each Train
    worker asks for (--worker-resource)."""
    live = [(node, 1) for node in nodes]
    declared = [(t.resources, t.max_count) for t in node_types or []]
    pool = live + declared  # what one node can hold (the nodes up now are of the declared types, or none)
    # The cluster at its largest: the nodes up now, or as many of each type as the autoscaler may run.
    largest_cluster = max((live, declared), key=lambda nodes: trials_that_fit(resources, nodes, worker_resources))
    where = "this cluster (its nodes and the node types its autoscaler can add)" if node_types else "this cluster"
    if resources.cpus_per_worker > _largest(pool, "CPU"):
        raise UserError(f"--cpus-per-worker {resources.cpus_per_worker:g}: no node of {where} has that many CPUs "
                        f"({_largest_note(pool, node_types, 'CPU')})")
    if resources.gpus_per_worker > _largest(pool, "GPU"):
        raise UserError(f"--gpus-per-worker {resources.gpus_per_worker:g}: no node of {where} has that many GPUs "
                        f"({_largest_note(pool, node_types, 'GPU')}; use 0 on a CPU cluster)")
    for name, amount in (worker_resources or {}).items():
        if not any(node.get(name, 0.0) >= amount for node, _ in pool):
            offered = sorted({key for node, _ in pool for key in node
                              if key not in STANDARD_RESOURCES and not key.startswith("node:")})
            raise UserError(f"--worker-resource {name}={amount:g}: no node of {where} has that much {name!r} "
                            f"(custom resources there: {', '.join(offered) or 'none'})")
    if not any(_worker_slots(node, resources, worker_resources) >= 1 for node, _ in pool):
        raise UserError(f"--cpus-per-worker {resources.cpus_per_worker:g} with --gpus-per-worker "
                        f"{resources.gpus_per_worker:g}: no node of {where} holds one worker "
                        f"({_largest_note(pool, node_types, 'GPU')})")
    cpus = max(cluster.get("CPU", 0.0), _total(declared, "CPU"))
    usable_cpu = cpus - DATA_CPU_RESERVE
    per_trial_cpu = resources.workers * resources.cpus_per_worker
    if per_trial_cpu > usable_cpu + 1e-9:
        hint = (f"at most {usable_cpu:g} CPUs per trial fit, e.g. --workers-per-trial 1 "
                f"--cpus-per-worker {usable_cpu:g}"
                if usable_cpu > 0 else "nothing fits: give Ray at least 2 CPUs")
        raise UserError(
            f"--workers-per-trial {resources.workers} x --cpus-per-worker {resources.cpus_per_worker:g}: a trial needs "
            f"{per_trial_cpu:g} CPUs for its workers, but {where} {'reach' if node_types else 'has'} {cpus:g} CPUs "
            f"and {DATA_CPU_RESERVE:g} stays free for Ray Data; {hint}")
    reach = trials_that_fit(resources, largest_cluster, worker_resources)
    if reach < 1:
        gpus = _total(largest_cluster, "GPU")
        raise UserError(
            f"--workers-per-trial {resources.workers}: a trial needs {resources.workers} worker(s) of "
            f"{resources.cpus_per_worker:g} CPU + {resources.gpus_per_worker:g} GPU, but {where} hold(s) fewer "
            f"({cpus:g} CPUs, {gpus:g} GPUs)")
    if requested is not None and requested > reach:
        raise UserError(
            f"--max-concurrent {requested}: only {reach:g} trial(s) of {resources.workers} worker(s) x "
            f"{resources.cpus_per_worker:g} CPU" + (f" + {resources.gpus_per_worker:g} GPU" if resources.gpus_per_worker
                                                    else "")
            + f" fit on {where} ({_totals(largest_cluster)}, {DATA_CPU_RESERVE:g} CPU kept for Ray Data)")
    if requested is not None:
        return requested
    if math.isinf(reach):  # an autoscaler without limits: as many as fit now, the rest as nodes come
        return max(1, int(trials_that_fit(resources, live, worker_resources)))
    return int(reach)


def trials_that_fit(resources: Resources, pool: list[tuple[dict, int | None]],
                    worker_resources: dict | None = None) -> float:
    """How many trials the nodes of `pool` ((resources of a node, how many such nodes; None: no limit)) hold at
    once, each node taking whole workers, with one CPU of them all left to Ray Data. `math.inf` without a limit."""
    slots, cpus = 0.0, 0.0
    for node, count in pool:
        per_node = _worker_slots(node, resources, worker_resources)
        if per_node >= 1 and count is None:
            return math.inf
        slots += per_node * (count or 0)
        cpus += node.get("CPU", 0.0) * (count or 0)
    by_slots = slots // resources.workers
    per_trial_cpu = resources.workers * resources.cpus_per_worker
    by_cpu = math.floor((cpus - DATA_CPU_RESERVE) / per_trial_cpu + 1e-9) if per_trial_cpu > 0 else math.inf
    return max(0, min(by_slots, by_cpu))


def _worker_slots(node: dict, resources: Resources, worker_resources: dict | None) -> int:
    """Whole Train workers one node holds."""
    asks = {"CPU": resources.cpus_per_worker, "GPU": resources.gpus_per_worker, **(worker_resources or {})}
    counts = [math.floor(node.get(name, 0.0) / amount + 1e-9) for name, amount in asks.items() if amount > 0]
    return min(counts) if counts else 1


def _total(pool: list[tuple[dict, int | None]], name: str) -> float:
    return sum(node.get(name, 0.0) * (math.inf if count is None else count) for node, count in pool
               if node.get(name, 0.0) > 0)


def _totals(pool: list[tuple[dict, int | None]]) -> str:
    return f"{_total(pool, 'CPU'):g} CPUs, {_total(pool, 'GPU'):g} GPUs"


def _largest(pool: list[tuple[dict, int | None]], name: str) -> float:
    return max((node.get(name, 0.0) for node, _ in pool), default=0.0)


def _largest_note(pool: list[tuple[dict, int | None]], node_types: list[NodeType] | None, name: str) -> str:
    """The most of `name` one node has, and what the node type with the most holds, where types are known."""
    note = f"largest: {_largest(pool, name):g}"
    if not node_types:
        return note
    biggest = max(node_types, key=lambda t: (t.resources.get(name, 0.0), t.resources.get("GPU", 0.0),
                                             t.resources.get("CPU", 0.0)))
    return (f"{note}; the largest node type, {biggest.name}, holds {biggest.resources.get('CPU', 0.0):g} CPUs and "
            f"{biggest.resources.get('GPU', 0.0):g} GPUs")


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
