"""The one pre-flight of `lapstudy run` and `lapstudy train`: every check, in the order that fails fastest, then
the cluster and the data the run starts with.

Before Ray starts and before anything is written: the model and training keys that need no data, the tracking
server, the cluster address, and the dataset (a wrong or offline dataset fails in seconds). Then Ray starts (or is
joined), the data is opened, and the checks that need them run: the keys the data fixes, the batch size against the
split, and whether the workers fit on the cluster (on the nodes up now or on those its autoscaler can add).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import ray

from study.cluster import check_address, check_tracking_store, connect_ray
from study.data import DatasetConfig, TaskData, check_dataset, load_task_data
from study.node_types import declared_node_types
from study.resources import trial_concurrency, trials_that_fit
from study.runspec import Resources
from study.session import DriverRecord, end_session
from study.tracking.store import check_store


@dataclass(frozen=True)
class Request:
    """What a study or a single run was asked to start with."""

    task: str
    dataset: DatasetConfig
    seed: int
    resources: Resources
    storage: str  # where the run's folder goes (an absolute path or a URI)
    experiment: str  # the MLflow experiment it logs to
    new_experiment: bool  # an experiment of that name with runs in it belongs to another study
    tracking_uri: str | None = None  # a tracking server (None: the embedded store, made later)
    address: str | None = None
    max_concurrent: int | None = None
    worker_resources: dict = field(default_factory=dict)


@dataclass(frozen=True)
class Launch:
    task_data: TaskData
    concurrency: int  # trials that may run side by side (on nodes the autoscaler adds, too)
    session_dir: str | None  # the local Ray session started (None: joined a cluster)
    fit_now: int  # of those, how many the nodes up at the start hold


def preflight(request: Request, check_configs: Callable[[TaskData | None], None],
              previous: DriverRecord | None = None) -> Launch:
    """`check_configs(None)` checks what needs no data, `check_configs(task_data)` the rest (UserError naming the
    field). `previous`: the record of a study driver that died; what its Ray session left running is ended right
    before Ray starts again."""
    check_configs(None)
    check_tracking_store(request.tracking_uri, request.storage, request.address)  # before check_store makes a file
    if request.tracking_uri:
        check_store(request.tracking_uri, request.experiment, must_be_new=request.new_experiment)
    check_address(request.address)
    check_dataset(request.dataset)
    ended = end_session(previous)
    if ended:
        print(f"ended {len(ended)} process(es) the stopped study's Ray session left running: {', '.join(ended)}",
              flush=True)
    session_dir = connect_ray(request.address, request.storage)
    task_data = load_task_data(request.dataset, seed=request.seed)
    check_configs(task_data)
    alive = [node for node in ray.nodes() if node["Alive"]]
    check_tracking_store(request.tracking_uri, request.storage, request.address,
                         hosts={node["NodeManagerAddress"] for node in alive})
    nodes = [node["Resources"] for node in alive]
    concurrency = trial_concurrency(request.resources, ray.cluster_resources(), nodes, request.max_concurrent,
                                    worker_resources=request.worker_resources, node_types=declared_node_types())
    fit_now = trials_that_fit(request.resources, [(node, 1) for node in nodes], request.worker_resources)
    return Launch(task_data, concurrency, session_dir, min(concurrency, int(fit_now)))
