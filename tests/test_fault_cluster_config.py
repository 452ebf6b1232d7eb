"""`cluster.yaml` proven by reading it: it is a valid Ray cluster-launcher config (the schema shipped inside the `ray`
package), the head runs the MLflow server with a host-header guard that accepts the workers on the private network
and nothing public, the Ray dashboard and the MLflow UI are not exposed beyond the private network, no credentials
are in the file, workers are spot/preemptible while trial drivers stay on the head or on on-demand nodes."""

from __future__ import annotations

import ipaddress
import json
import re
import shlex
from pathlib import Path

import pytest
import ray
import yaml

from study.resources import DRIVER_NODE_RESOURCE

CLUSTER_YAML = Path(__file__).resolve().parents[1] / "cluster.yaml"
PRIVATE_NETWORKS = [ipaddress.ip_network(n) for n in ("10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16")]


@pytest.fixture(scope="module")
def config() -> dict:
    return yaml.safe_load(CLUSTER_YAML.read_text())


def _commands(config: dict, *keys: str) -> list[str]:
    commands = []
    for key in keys:
        commands += config.get(key) or []
    return commands


def _head_commands(config: dict) -> list[str]:
    return _commands(config, "initialization_commands", "setup_commands", "head_setup_commands",
                     "head_start_ray_commands")


def _mlflow_server_command(config: dict) -> list[str]:
    for command in _head_commands(config):
        if "mlflow server" in command or "mlflow.server" in command:
            return command
    raise AssertionError("no head command starts the MLflow server")


def _option(command: str, name: str) -> str | None:
    words = shlex.split(command.replace(";", " ; ").replace("&&", " && "))
    for i, word in enumerate(words):
        if word == name and i + 1 < len(words):
            return words[i + 1]
        if word.startswith(name + "="):
            return word.split("=", 1)[1]
    return None


def test_validates_against_the_schema_in_the_ray_package(config):
    import jsonschema

    schema = json.loads((Path(ray.__file__).parent / "autoscaler" / "ray-schema.json").read_text())
    jsonschema.validate(config, schema)
    assert config["provider"]["type"] == "aws"


def test_head_runs_the_mlflow_server_that_accepts_workers_on_the_private_network_only(config):
    from mlflow.server.security_utils import is_allowed_host_header

    command = _mlflow_server_command(config)
    assert "--backend-store-uri" in command, "the server needs a persistent store on the head"
    hosts_option = _option(command, "--allowed-hosts")
    env_hosts = re.search(r"MLFLOW_SERVER_ALLOWED_HOSTS=(\S+)", command)
    assert hosts_option or env_hosts, "configure the host-header guard explicitly (--allowed-hosts)"
    allowed = (hosts_option or env_hosts.group(1).strip("'\"")).split(",")
    assert "*" not in allowed, "'*' turns the guard off"
    # Workers reach the head at its private address (AWS VPCs: 10/8, 172.16/12; 192.168/16).
    for host in ("10.0.12.34:5000", "172.31.5.6:5000", "192.168.1.20:5000", "localhost:5000", "127.0.0.1:5000"):
        assert is_allowed_host_header(allowed, host), f"{host} would be refused"
    for host in ("203.0.113.7:5000", "mlflow.example.com", "evil.com:5000"):
        assert not is_allowed_host_header(allowed, host), f"{host} would be accepted"


def test_mlflow_and_dashboard_are_not_exposed_beyond_the_private_network(config):
    command = _mlflow_server_command(config)
    host = _option(command, "--host") or _option(command, "-h")
    assert host is not None, "bind the MLflow server explicitly"
    # Bound to the head's private address (or to localhost), never to every interface.
    assert host not in ("0.0.0.0", "::", "*"), f"MLflow bound to {host}"
    for command in _head_commands(config):
        if "ray start" in command:
            dashboard_host = _option(command, "--dashboard-host")
            assert dashboard_host in (None, "127.0.0.1", "localhost"), f"dashboard bound to {dashboard_host}"
    # Security group, if the config brings its own: the UI ports only from private ranges, never the internet.
    group = config["provider"].get("security_group") or {}
    for permission in group.get("IpPermissions", []):
        ports = range(permission.get("FromPort", 0), permission.get("ToPort", 65535) + 1)
        if 5000 in ports or 8265 in ports:
            for ip_range in permission.get("IpRanges", []):
                network = ipaddress.ip_network(ip_range["CidrIp"])
                assert any(network.subnet_of(private) for private in PRIVATE_NETWORKS), ip_range


def test_no_credentials_in_the_file():
    text = CLUSTER_YAML.read_text()
    patterns = {
        "AWS access key id": r"\bA(KIA|SIA)[0-9A-Z]{16}\b",
        "secret key setting": r"(?i)aws_secret_access_key|secret_access_key\s*[:=]",
        "private key": r"-----BEGIN [A-Z ]*PRIVATE KEY-----",
        "Hugging Face token": r"\bhf_[A-Za-z0-9]{20,}\b",
        "credentials in a URL": r"://[^/\s:@]+:[^/\s@]+@",
        "password or token value": r"(?i)(password|passwd|token|api[_-]?key)\s*[:=]\s*['\"]?[A-Za-z0-9/+_-]{8,}",
    }
    for what, pattern in patterns.items():
        assert not re.search(pattern, text), f"cluster.yaml holds a {what}"


def test_spot_workers_and_trial_drivers_on_the_head(config):
    types = config["available_node_types"]
    head = types[config["head_node_type"]]
    assert "InstanceMarketOptions" not in head["node_config"], "the head must be on-demand"
    assert head.get("resources", {}).get(DRIVER_NODE_RESOURCE, 0) >= 1, "trial drivers are pinned to the head"
    workers = {name: t for name, t in types.items() if name != config["head_node_type"]}
    spot = {name: t for name, t in workers.items()
            if t["node_config"].get("InstanceMarketOptions", {}).get("MarketType") == "spot"}
    assert spot, "the workers should be spot (preemptible) machines"
    for name, node_type in spot.items():
        assert DRIVER_NODE_RESOURCE not in node_type.get("resources", {}), f"{name}: no trial drivers on spot nodes"


def test_the_project_comes_from_the_image_not_from_a_pip_install_at_boot(config):
    """Every node runs the project's image (docker/Dockerfile installs it once); no node pip-installs at boot."""
    assert config["docker"]["head_image"] and config["docker"]["worker_image"]
    commands = " ".join(_commands(config, "initialization_commands", "setup_commands", "head_setup_commands",
                                  "worker_setup_commands", "head_start_ray_commands", "worker_start_ray_commands"))
    assert "pip install" not in commands and "pip3 install" not in commands


def test_docs_show_port_forwards_that_reach_the_services(config):
    """The dashboard and the UI are reached through SSH port-forwards (cluster.yaml, the README or the docs), and
    the forward for the UI points where the MLflow server listens."""
    root = CLUSTER_YAML.parent
    texts = [CLUSTER_YAML.read_text(), (root / "README.md").read_text(),
             *(p.read_text() for p in (root / "docs").glob("*.md"))]
    assert any("ray dashboard cluster.yaml" in text for text in texts)
    targets = {m.group(1) for text in texts for m in re.finditer(r"ssh\b[^\n]*-L\s*5000:(\S+):5000", text)}
    assert targets, "no `ssh -L 5000:...:5000` port-forward shown"
    bound = _option(_mlflow_server_command(config), "--host")
    if bound not in ("localhost", "127.0.0.1"):  # the server listens on the private address only
        assert not targets & {"localhost", "127.0.0.1"}, \
            f"a forward to localhost cannot reach a server bound to {bound}"
