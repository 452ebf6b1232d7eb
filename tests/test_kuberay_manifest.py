"""k8s/rayjob.yaml is a RayJob KubeRay accepts: validated against KubeRay's RayJob CRD (its OpenAPI v3 schema,
vendored in tests/fixtures/kuberay/ with its source), unknown fields refused as `kubectl apply --validate=strict`
refuses them. Its images are the project's image at the Ray and Python the project pins (the same ones
docker/Dockerfile builds from), the study storage is shared, the tracking URI comes from a secret, and no
placeholder is left to fill in."""

from __future__ import annotations

import copy
import re
from pathlib import Path

import jsonschema
import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
CRD = REPO / "tests" / "fixtures" / "kuberay" / "ray.io_rayjobs.yaml"
MANIFEST = REPO / "k8s" / "rayjob.yaml"
PYTHON_TAG = "py311"  # the Python of requirements.lock and of the images (rayproject/ray:<ray>-py311)


def locked_version(name: str) -> str:
    match = re.search(rf"^{name}==([^\s+]+)", (REPO / "requirements.lock").read_text(), re.M)
    assert match, f"{name} is not in requirements.lock"
    return match.group(1)


def _strict(schema):
    """Refuse unknown fields, as the API server does with strict field validation (a CRD's structural schema only
    lists the known ones)."""
    if isinstance(schema, dict):
        if (schema.get("type") == "object" and "properties" in schema and "additionalProperties" not in schema
                and not schema.get("x-kubernetes-preserve-unknown-fields")):
            schema["additionalProperties"] = False
        for value in schema.values():
            _strict(value)
    elif isinstance(schema, list):
        for value in schema:
            _strict(value)
    return schema


@pytest.fixture(scope="module")
def validator():
    crd = yaml.load(CRD.read_text(), Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
    assert crd["spec"]["names"]["kind"] == "RayJob"
    version = next(v for v in crd["spec"]["versions"] if v["name"] == "v1")
    return jsonschema.Draft7Validator(_strict(copy.deepcopy(version["schema"]["openAPIV3Schema"])))


@pytest.fixture(scope="module")
def documents():
    return list(yaml.safe_load_all(MANIFEST.read_text()))


@pytest.fixture(scope="module")
def job(documents):
    jobs = [d for d in documents if d["kind"] == "RayJob"]
    assert len(jobs) == 1 and jobs[0]["apiVersion"] == "ray.io/v1"
    return jobs[0]


def _containers(job):
    cluster = job["spec"]["rayClusterSpec"]
    groups = {"head": cluster["headGroupSpec"], **{g["groupName"]: g for g in cluster["workerGroupSpecs"]}}
    return {name: group["template"]["spec"]["containers"][0] for name, group in groups.items()}


def test_validates_against_kuberays_rayjob_crd(validator, job):
    errors = sorted(validator.iter_errors(job), key=lambda e: list(e.absolute_path))
    assert not errors, "\n".join(f"{'.'.join(map(str, e.absolute_path))}: {e.message[:200]}" for e in errors)


@pytest.mark.parametrize("breakage", ["unknown field", "wrong type", "missing head"])
def test_the_schema_check_refuses_a_broken_manifest(validator, job, breakage):
    broken = copy.deepcopy(job)
    cluster = broken["spec"]["rayClusterSpec"]
    if breakage == "unknown field":
        cluster["headGroupSpec"]["templat"] = cluster["headGroupSpec"].pop("template")
    elif breakage == "wrong type":
        cluster["workerGroupSpecs"][0]["replicas"] = "two"
    else:
        del cluster["headGroupSpec"]
    assert list(validator.iter_errors(broken))


def test_head_cpu_and_gpu_groups_run_the_projects_image_at_the_pinned_ray_and_python(job):
    ray_version = locked_version("ray")
    cluster = job["spec"]["rayClusterSpec"]
    assert cluster["rayVersion"] == ray_version
    containers = _containers(job)
    assert {"head", "cpu", "gpu"} <= set(containers)
    gpu = [name for name, c in containers.items() if "nvidia.com/gpu" in c.get("resources", {}).get("limits", {})]
    assert gpu == ["gpu"]
    for name, container in containers.items():
        flavour = "gpu" if name in gpu else "cpu"
        assert container["image"] == f"lapstudy:{ray_version}-{PYTHON_TAG}-{flavour}", name
    dockerfile = (REPO / "docker" / "Dockerfile").read_text()
    assert f"ARG RAY_VERSION={ray_version}\n" in dockerfile and f"ARG PYTHON_TAG={PYTHON_TAG}\n" in dockerfile
    assert "FROM rayproject/ray:${RAY_VERSION}-${PYTHON_TAG} AS base-cpu" in dockerfile
    assert "FROM rayproject/ray:${RAY_VERSION}-${PYTHON_TAG}-gpu AS base-gpu" in dockerfile


def test_pyproject_pins_the_ray_minor_of_the_lock_and_image():
    import tomllib

    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    ray = next(d for d in project["dependencies"] if re.match(r"ray\[", d))
    major_minor = ".".join(locked_version("ray").split(".")[:2])
    assert re.fullmatch(rf"ray\[[a-z,]+\]==({re.escape(major_minor)}\.\*|{re.escape(locked_version('ray'))})", ray), ray


def test_entrypoint_shared_storage_and_tracking_secret(job):
    spec = job["spec"]
    words = spec["entrypoint"].split()
    assert words[:2] == ["lapstudy", "run"] and "--address" in words
    storage = words[words.index("--storage") + 1]
    cluster = spec["rayClusterSpec"]
    pods = [cluster["headGroupSpec"]["template"]["spec"]] + [g["template"]["spec"] for g in cluster["workerGroupSpecs"]]
    for pod in pods:  # every pod mounts the shared volume where the study folder goes
        claims = {v["name"]: v["persistentVolumeClaim"]["claimName"]
                  for v in pod["volumes"] if "persistentVolumeClaim" in v}
        mounts = [m for m in pod["containers"][0]["volumeMounts"] if m["name"] in claims]
        assert any(storage.startswith(m["mountPath"].rstrip("/") + "/") for m in mounts), pod["containers"][0]["name"]
    head_env = {e["name"]: e for e in _containers(job)["head"]["env"]}
    uri = head_env["LAPSTUDY_TRACKING_URI"]
    assert "value" not in uri and uri["valueFrom"]["secretKeyRef"]["name"], "the tracking URI comes from a secret"
    from study.cli import TRACKING_URI_VARIABLE

    assert TRACKING_URI_VARIABLE == "LAPSTUDY_TRACKING_URI"  # what `lapstudy run` reads as its --tracking-uri


def test_the_shared_volume_is_read_write_many(documents, job):
    claims = {d["metadata"]["name"]: d for d in documents if d["kind"] == "PersistentVolumeClaim"}
    head = job["spec"]["rayClusterSpec"]["headGroupSpec"]["template"]["spec"]
    for volume in head["volumes"]:
        claim = claims[volume["persistentVolumeClaim"]["claimName"]]
        assert claim["spec"]["accessModes"] == ["ReadWriteMany"]


PLACEHOLDERS = re.compile(r"<[A-Za-z][^>\n]*>|\bREPLACE|\bCHANGE_?ME\b|\bTODO\b|\bFIXME\b|\bxxx+\b|example\.com|"
                          r"\b(?:fs|ami|sg|subnet)-0{6,}\b|\$\{[A-Z_]+\}", re.I)


@pytest.mark.parametrize("path", ["k8s/rayjob.yaml", "k8s/kustomization.yaml", "cluster.yaml"])
def test_no_placeholder_values_remain(path):
    """Comments may show a command with <registry>; no value may be one to fill in."""
    data = yaml.safe_load_all((REPO / path).read_text())
    values = []

    def walk(node):
        if isinstance(node, dict):
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)
        elif isinstance(node, str):
            values.append(node)

    for document in data:
        walk(document)
    found = [v for v in values if PLACEHOLDERS.search(v)]
    assert not found, f"{path}: placeholder values {found}"


def test_the_shared_volume_names_a_class_and_the_job_a_start_deadline(documents, job, validator):
    (claim,) = [d for d in documents if d["kind"] == "PersistentVolumeClaim"]
    assert claim["spec"].get("storageClassName"), "the cluster's default class is usually ReadWriteOnce"
    deadline = job["spec"].get("preRunningDeadlineSeconds")
    assert isinstance(deadline, int) and 0 < deadline <= 3600, "a study that cannot start fails within the hour"
    assert "activeDeadlineSeconds" not in job["spec"], "a running study has no time limit"
    broken = copy.deepcopy(job)
    broken["spec"]["preRunningDeadlineSeconds"] = 0
    assert list(validator.iter_errors(broken)), "the CRD's own bound (minimum 1) is what validates it"


def test_the_head_trains_nothing_and_credentials_come_from_secrets(job):
    cluster = job["spec"]["rayClusterSpec"]
    assert cluster["headGroupSpec"]["rayStartParams"]["num-cpus"] == "0"
    assert all(g["rayStartParams"].get("num-cpus") != "0" for g in cluster["workerGroupSpecs"])
    assert "--runtime-env" not in job["spec"]["entrypoint"] and "runtimeEnvYAML" not in job["spec"]
    secret_only = {"MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD", "HF_TOKEN"}
    for name, container in _containers(job).items():
        env = {e["name"]: e for e in container.get("env", [])}
        for key in secret_only & set(env):
            assert "value" not in env[key] and env[key]["valueFrom"]["secretKeyRef"], (name, key)
        # Rank 0 of a trial, on a worker, logs to MLflow: the workers get the server's credentials too.
        assert {"MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD"} <= set(env), name
