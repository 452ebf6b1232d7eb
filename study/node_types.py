"""The nodes a cluster can have, besides those up now: the node types its autoscaler may add, where Ray exposes them.

Two places hold them. The GCS keeps the cluster config an autoscaler reports (node groups: resources, min and max
count), which Ray Data reads to size its own requests (`ray._private.state.state.get_cluster_config()`). The
cluster launcher (`ray up`) gives the head's autoscaler its config as `~/ray_bootstrap_config.yaml`, its node types'
resources filled in from the instance types; the study driver, a Ray job, runs on that head. Where neither is
there (a cluster of `ray start` nodes, KubeRay's autoscaler), there are no node types to read: `None`.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import yaml

# Where `ray up` puts the autoscaler's config on the head (the head's `ray start --autoscaling-config=`).
BOOTSTRAP_CONFIG = "~/ray_bootstrap_config.yaml"


@dataclass(frozen=True)
class NodeType:
    name: str
    resources: dict  # what one node of the type offers: CPU, GPU, memory, custom resources
    max_count: int | None  # how many nodes of it the cluster may have; None: no limit


def declared_node_types(bootstrap_config: str = BOOTSTRAP_CONFIG) -> list[NodeType] | None:
    """The autoscaler's node types (GCS first, then the launcher's config on this machine), None where neither."""
    import ray._private.state

    reported = ray._private.state.state.get_cluster_config()
    if reported is not None and reported.node_group_configs:
        return from_cluster_config(reported)
    path = Path(os.path.expanduser(bootstrap_config))
    if path.is_file():
        return from_autoscaling_config(yaml.safe_load(path.read_text()))  # JSON is YAML: `ray up` writes JSON
    return None


def from_cluster_config(config) -> list[NodeType]:
    """From the GCS's `autoscaler_pb2.ClusterConfig`: a max count of -1 is no limit."""
    return [NodeType(group.name, {key: float(value) for key, value in group.resources.items()},
                     None if group.max_count < 0 else group.max_count)
            for group in config.node_group_configs]


def from_autoscaling_config(config: dict) -> list[NodeType]:
    """From a cluster launcher config (`available_node_types`): the head type counts once; a worker type as many
    times as its `max_workers` and the cluster's allow."""
    cluster_max = config.get("max_workers")
    head = config.get("head_node_type")
    types = []
    for name, node_type in (config.get("available_node_types") or {}).items():
        resources = node_type.get("resources") or {}
        if isinstance(resources, str):
            resources = json.loads(resources)
        if name == head:
            count = 1
        else:
            counts = [c for c in (node_type.get("max_workers"), cluster_max) if c is not None]
            count = min(counts) if counts else None
        types.append(NodeType(name, {key: float(value) for key, value in resources.items()}, count))
    return types
