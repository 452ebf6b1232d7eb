"""Concurrency that follows the autoscaler: on the shipped cluster.yaml (a head that trains nothing, one on-demand
GPU worker, up to 8 spot GPU workers), `lapstudy run --max-concurrent 8 --gpus-per-worker 1` is accepted before the
first GPU worker has joined and after, and a request no node type can hold is refused in one line.

The node types are what `ray up` hands the head's autoscaler (`~/ray_bootstrap_config.yaml`): cluster.yaml with
each type's resources filled in by Ray's own AWS launcher code from EC2's instance catalogue (moto's copy of it).
The nodes up now are what a real Ray cluster reports (`ray.nodes()`): a head with cluster.yaml's head resources,
then a GPU worker node of the gpu_spot type's resources joining it, as the autoscaler's would (one CPU machine
advertises them; Ray does not look). The same node types reported through the GCS, where an autoscaler that
reports its cluster config puts them, are read the same way.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import ray
import yaml

from study.errors import UserError
from study.node_types import NodeType, declared_node_types, from_autoscaling_config, from_cluster_config
from study.resources import DRIVER_NODE_RESOURCE, trial_concurrency, trials_that_fit
from study.runspec import Resources

REPO = Path(__file__).resolve().parents[1]
GPU_TRIAL = Resources(workers=1, cpus_per_worker=4, gpus_per_worker=1)  # the documented submission


@pytest.fixture(scope="module")
def launcher_config(tmp_path_factory) -> dict:
    """cluster.yaml as `ray up` writes it to the head: each node type's resources filled in from its instance type."""
    from moto import mock_aws
    from ray.autoscaler._private.aws.node_provider import AWSNodeProvider

    config = yaml.safe_load((REPO / "cluster.yaml").read_text())
    patch = pytest.MonkeyPatch()
    for key in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        patch.setenv(key, "testing")
    try:
        with mock_aws():
            return AWSNodeProvider.fillout_available_node_types_resources(config)
    finally:
        patch.undo()


@pytest.fixture(scope="module")
def node_types(launcher_config) -> list[NodeType]:
    return from_autoscaling_config(launcher_config)


def test_the_head_trains_nothing_and_the_gpu_types_are_what_ec2_says(launcher_config, node_types):
    head = launcher_config["available_node_types"][launcher_config["head_node_type"]]["resources"]
    assert head.get("CPU") == 0 and not head.get("GPU") and head[DRIVER_NODE_RESOURCE] > 0
    types = {t.name: t for t in node_types}
    assert types["head"].max_count == 1
    for name, count in (("gpu_spot", 8), ("gpu_on_demand", 1)):  # g5.2xlarge: 8 vCPUs, one A10G
        assert types[name].max_count == count
        assert types[name].resources["GPU"] == 1 and types[name].resources["CPU"] == 8


def test_decisions_on_the_launchers_node_types(node_types):
    head_only = [{"CPU": 0.0, DRIVER_NODE_RESOURCE: 1000.0, "memory": 1e10}]
    gpu_node = {"CPU": 8.0, "GPU": 1.0, "memory": 2.4e10}
    for nodes in (head_only, head_only + [gpu_node]):  # before the first GPU worker joins, and after
        cluster = {key: sum(n.get(key, 0.0) for n in nodes) for n in nodes for key in n}
        assert trial_concurrency(GPU_TRIAL, cluster, nodes, 8, node_types=node_types) == 8
        # Without --max-concurrent: as many as the GPU node types hold (8 spot + 1 on-demand), not the one up now.
        assert trial_concurrency(GPU_TRIAL, cluster, nodes, None, node_types=node_types) == 9
    assert trials_that_fit(GPU_TRIAL, [(n, 1) for n in head_only]) == 0
    assert trials_that_fit(GPU_TRIAL, [(n, 1) for n in head_only + [gpu_node]]) == 1
    # Without the node types (what lapstudy knew before), the same request is refused: no node up has a GPU.
    with pytest.raises(UserError, match=r"^--[cg]pus-per-worker [41]: no node of this cluster has that many"):
        trial_concurrency(GPU_TRIAL, head_only[0], head_only, 8)


@pytest.mark.parametrize("resources, requested, words", [
    (Resources(workers=1, cpus_per_worker=4, gpus_per_worker=2), 8,
     ["--gpus-per-worker 2", "largest: 1", "gpu_", "8 CPUs and 1 GPUs"]),
    (Resources(workers=1, cpus_per_worker=16, gpus_per_worker=1), 8, ["--cpus-per-worker 16", "largest: 8"]),
    (GPU_TRIAL, 10, ["--max-concurrent 10", "only 9"]),
    (Resources(workers=1, cpus_per_worker=4, gpus_per_worker=1), 8, None),  # the control: accepted
])
def test_what_no_node_type_holds_is_refused_in_one_line(node_types, resources, requested, words):
    head_only = [{"CPU": 0.0, DRIVER_NODE_RESOURCE: 1000.0}]
    if words is None:
        assert trial_concurrency(resources, head_only[0], head_only, requested, node_types=node_types) == requested
        return
    with pytest.raises(UserError) as info:
        trial_concurrency(resources, head_only[0], head_only, requested, node_types=node_types)
    message = str(info.value)
    assert "\n" not in message and all(word in message for word in words), message


def test_unlimited_node_types_accept_any_concurrency():
    unlimited = [NodeType("gpu", {"CPU": 8.0, "GPU": 1.0}, None)]
    nodes = [{"CPU": 2.0}]
    assert trial_concurrency(GPU_TRIAL, nodes[0], nodes, 64, node_types=unlimited) == 64
    assert trial_concurrency(GPU_TRIAL, nodes[0], nodes, None, node_types=unlimited) == 1  # as many as up, or one


# ---- the real check: a Ray cluster reporting its nodes as the GPU worker joins ------------------------------------

@pytest.fixture(scope="module")
def cluster(tmp_path_factory, launcher_config):
    """A head with cluster.yaml's head resources, this process connected to it as the study driver is; the launcher's
    config where `ray up` puts it on the head (in a HOME of the test's)."""
    from ray.cluster_utils import Cluster

    from fault_fixtures import free_port, private_ray_tmp

    home = tmp_path_factory.mktemp("home")
    bootstrap = home / "ray_bootstrap_config.yaml"
    bootstrap.write_text(json.dumps(launcher_config))  # `ray up` writes it as JSON
    head = launcher_config["available_node_types"]["head"]["resources"]
    ray.shutdown()  # an in-process Ray instance another module left (the data tests share one) would be joined
    with private_ray_tmp("lsa") as ray_tmp:
        patch = pytest.MonkeyPatch()
        patch.setenv("RAY_TMPDIR", str(ray_tmp))
        cluster = Cluster(shutdown_at_exit=False)
        try:
            cluster.add_node(num_cpus=head["CPU"], resources={DRIVER_NODE_RESOURCE: head[DRIVER_NODE_RESOURCE]},
                             include_dashboard=False, dashboard_port=free_port())
            ray.init(address=cluster.address, log_to_driver=False, logging_level="ERROR")
            # Read from the test's home by path: Ray's nodes keep the real home, where its token lives (a node
            # started under another home in a process that had run Ray never came up).
            cluster.bootstrap_config = str(bootstrap)
            yield cluster
        finally:
            ray.shutdown()
            cluster.shutdown()
            patch.undo()


def _reported() -> tuple[dict, list[dict]]:
    return ray.cluster_resources(), [n["Resources"] for n in ray.nodes() if n["Alive"]]


@pytest.mark.slow(seconds=6)
def test_accepted_before_the_first_gpu_worker_joins_and_after_and_refused_beyond_every_node_type(
        cluster, launcher_config):
    types = declared_node_types(cluster.bootstrap_config)  # no cluster config in the GCS: the launcher's file
    assert types == from_autoscaling_config(launcher_config)
    totals, nodes = _reported()
    assert totals.get("GPU", 0) == 0 and totals.get("CPU", 0) == 0, "only the head, which trains nothing, is up"
    assert trial_concurrency(GPU_TRIAL, totals, nodes, 8, node_types=types) == 8
    with pytest.raises(UserError, match=r"^--gpus-per-worker 2: .*largest: 1"):
        trial_concurrency(Resources(workers=1, cpus_per_worker=4, gpus_per_worker=2), totals, nodes, 8,
                          node_types=types)

    gpu = launcher_config["available_node_types"]["gpu_spot"]["resources"]
    cluster.add_node(num_cpus=gpu["CPU"], num_gpus=gpu["GPU"])  # the node the autoscaler adds
    deadline = time.monotonic() + 60
    while _reported()[0].get("GPU", 0) < 1:
        assert time.monotonic() < deadline, "the GPU node never joined"
        time.sleep(0.2)
    totals, nodes = _reported()
    assert trial_concurrency(GPU_TRIAL, totals, nodes, 8, node_types=declared_node_types(cluster.bootstrap_config)) == 8
    assert trials_that_fit(GPU_TRIAL, [(node, 1) for node in nodes]) == 1  # what runs at once until more join
    with pytest.raises(UserError, match=r"^--max-concurrent 10: only 9 trial"):
        trial_concurrency(GPU_TRIAL, totals, nodes, 10, node_types=declared_node_types(cluster.bootstrap_config))


@pytest.mark.slow(seconds=6)
def test_node_types_an_autoscaler_reports_to_the_gcs_come_first(cluster):
    from ray.core.generated import autoscaler_pb2

    config = autoscaler_pb2.ClusterConfig()
    for name, resources, count in (("head", {"CPU": 0, DRIVER_NODE_RESOURCE: 1000}, 1),
                                   ("gpu", {"CPU": 8, "GPU": 4}, -1)):
        group = config.node_group_configs.add(name=name, max_count=count)
        group.resources.update(resources)
    ray._private.worker.global_worker.gcs_client.report_cluster_config(config.SerializeToString())
    try:
        types = declared_node_types(cluster.bootstrap_config)
        assert types == from_cluster_config(config)
        assert {t.name: t.max_count for t in types} == {"head": 1, "gpu": None}
        totals, nodes = _reported()
        assert trial_concurrency(Resources(workers=4, cpus_per_worker=2, gpus_per_worker=1), totals, nodes, 32,
                                 node_types=types) == 32
    finally:
        ray._private.worker.global_worker.gcs_client.report_cluster_config(
            autoscaler_pb2.ClusterConfig().SerializeToString())
    assert declared_node_types(cluster.bootstrap_config) == from_autoscaling_config(json.loads(
        Path(cluster.bootstrap_config).read_text()))


# ---- the progress line --------------------------------------------------------------------------------------------

class _Trial:
    def __init__(self, trial_id: str, status: str):
        self.trial_id, self.status, self.config, self.last_result = trial_id, status, {"lr": 0.001}, {}

    def get_error(self):
        return None

    def __str__(self):
        return self.trial_id


def test_the_progress_line_says_how_many_trials_wait_for_nodes(monkeypatch, capsys):
    """Trials Tune has made but not started for WAITING_AFTER_S wait for nodes; a trial just made does not yet."""
    from study import callbacks
    from study.space import load_space

    clock = [1000.0]
    monkeypatch.setattr(callbacks.time, "monotonic", lambda: clock[0])
    progress = callbacks.StudyProgress(load_space(REPO / "search_spaces" / "quickstart.yaml"), 8)
    trials = [_Trial("a", "RUNNING"), *(_Trial(t, "PENDING") for t in "bcdefgh")]
    progress.on_step_end(0, trials)
    assert "waiting" not in capsys.readouterr().out, "made this instant: not waiting yet"
    clock[0] += callbacks.WAITING_AFTER_S + callbacks.PROGRESS_EVERY_S
    trials[1].status = "RUNNING"  # the autoscaler's first node joined and took one
    progress.on_step_end(1, trials)
    (line,) = capsys.readouterr().out.splitlines()
    assert "2 running, 6 waiting for nodes" in line, line
    for trial in trials:
        trial.status = "RUNNING"
    clock[0] += callbacks.PROGRESS_EVERY_S
    progress.on_step_end(2, trials)
    (line,) = capsys.readouterr().out.splitlines()
    assert "8 running" in line and "waiting" not in line, line


def test_a_worker_no_single_node_type_holds_is_refused():
    """8 CPUs on one type and a GPU on another: a worker asking for 4 CPUs and a GPU fits neither."""
    types = [NodeType("cpu", {"CPU": 8.0}, 4), NodeType("small_gpu", {"CPU": 2.0, "GPU": 1.0}, 4)]
    head = [{"CPU": 0.0}]
    with pytest.raises(UserError, match=r"^--cpus-per-worker 4 with --gpus-per-worker 1: no node of this cluster "
                                        r"\(its nodes and the node types its autoscaler can add\) holds one worker"):
        trial_concurrency(GPU_TRIAL, head[0], head, 1, node_types=types)
    small = Resources(workers=1, cpus_per_worker=2, gpus_per_worker=1)
    assert trial_concurrency(small, head[0], head, None, node_types=types) == 4
