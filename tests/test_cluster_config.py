"""cluster.yaml is a valid Ray cluster launcher config: checked against the JSON schema shipped inside `ray`."""

import json
from pathlib import Path

import jsonschema
import ray
import yaml

from study.resources import DRIVER_NODE_RESOURCE

REPO = Path(__file__).resolve().parents[1]


def test_cluster_yaml_validates_against_rays_schema():
    schema = json.loads((Path(ray.__file__).parent / "autoscaler" / "ray-schema.json").read_text())
    config = yaml.safe_load((REPO / "cluster.yaml").read_text())
    jsonschema.validate(config, schema)


def test_cluster_yaml_pins_trial_drivers_to_the_head_and_keeps_services_private():
    config = yaml.safe_load((REPO / "cluster.yaml").read_text())
    head = config["available_node_types"][config["head_node_type"]]
    assert head["resources"].get(DRIVER_NODE_RESOURCE, 0) > 0  # trial drivers ask for it: they stay on the head
    commands = " ".join(config["head_start_ray_commands"])
    assert "--dashboard-host=127.0.0.1" in commands
    assert "mlflow server" in commands and "--host 0.0.0.0" not in commands
    spot = [t for t in config["available_node_types"].values()
            if t["node_config"].get("InstanceMarketOptions", {}).get("MarketType") == "spot"]
    assert spot and all(t["resources"].get(DRIVER_NODE_RESOURCE, 0) == 0 for t in spot)
