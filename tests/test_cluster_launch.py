"""The launch path fails loudly. cluster.yaml: a valid Ray cluster-launcher config (the schema inside `ray`), every
node on the project's image at the pinned Ray and Python, no `|| true`; its shell steps run here with bash (with
`sudo`, `docker`, `mountpoint`, `nvidia-smi` replaced by recording fakes) refuse to go on when a setting is unset and
do their job when it is set. `lapstudy run` refuses a SQLite tracking store for a study that spans machines."""

from __future__ import annotations

import importlib
import json
import re
import subprocess
from pathlib import Path

import jsonschema
import pytest
import ray
import yaml

from import_probe import imported_with
from study import cli
from study.cluster import check_tracking_store, filesystem_type

REPO = Path(__file__).resolve().parents[1]
PYTHON_TAG = "py311"
SETTINGS = {"LAPSTUDY_IMAGE": "123456789012.dkr.ecr.us-west-2.amazonaws.com/lapstudy",
            "LAPSTUDY_IMAGE_TAG": "2.60.0-py311", "LAPSTUDY_EFS_ID": "fs-0123456789abcdef0",
            "LAPSTUDY_MLFLOW_BACKEND_STORE_URI": "postgresql://mlflow@db.internal:5432/mlflow",
            "LAPSTUDY_MLFLOW_ARTIFACTS": "s3://bucket/mlflow"}
HEAD_TOKEN = "tok0123456789abcdef"  # what the fake `ray get-auth-token --generate` makes


@pytest.fixture(scope="module")
def config() -> dict:
    return yaml.safe_load((REPO / "cluster.yaml").read_text())


def _all_commands(config) -> list[str]:
    keys = ("initialization_commands", "setup_commands", "head_setup_commands", "worker_setup_commands",
            "head_start_ray_commands", "worker_start_ray_commands")
    commands = [c for key in keys for c in config.get(key) or []]
    for node_type in config["available_node_types"].values():
        for key in ("initialization_commands", "worker_setup_commands"):
            commands += node_type.get(key) or []
    return commands


def _command(config, key: str, needle: str) -> str:
    found = [c for c in config[key] if needle in c]
    assert len(found) == 1, f"one {key} entry with {needle!r}"
    return found[0]


def test_validates_against_rays_autoscaler_schema(config):
    schema = json.loads((Path(ray.__file__).parent / "autoscaler" / "ray-schema.json").read_text())
    jsonschema.validate(config, schema)
    broken = {**config, "docker": {**config["docker"], "imag": "x"}}
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(broken, schema)


def test_nodes_run_the_pinned_image_on_a_current_ubuntu_host(config):
    ray_version = re.search(r"^ray==(\S+)", (REPO / "requirements.lock").read_text(), re.M).group(1)
    assert ray.__version__ == ray_version, "the tests run on the Ray the lock and the image pin"
    dockerfile = (REPO / "docker" / "Dockerfile").read_text()
    assert f"ARG RAY_VERSION={ray_version}\n" in dockerfile and f"ARG PYTHON_TAG={PYTHON_TAG}\n" in dockerfile
    images = {config["docker"]["head_image"], config["docker"]["worker_image"]}
    for name, node_type in config["available_node_types"].items():
        image = node_type.get("docker", {}).get("worker_image", config["docker"]["worker_image"])
        is_gpu = node_type["node_config"]["InstanceType"].startswith(("g", "p"))
        assert image == f"lapstudy-node:{'gpu' if is_gpu else 'cpu'}", name
        images.add(image)
        ami = node_type["node_config"]["ImageId"]
        assert ami != "latest_dlami" and (re.fullmatch(r"ami-[0-9a-f]{8,17}", ami) or
                                          re.search(r"ubuntu-(22|24)\.04", ami)), f"{name}: {ami}"
    assert images == {"lapstudy-node:cpu", "lapstudy-node:gpu"}
    # The initialization command is what makes those tags: from the pushed image of the matching flavour.
    pull = _command(config, "initialization_commands", "docker pull")
    assert '"lapstudy-node:$FLAVOUR"' in pull


def test_nothing_fails_silently(config):
    for command in _all_commands(config):
        assert not re.search(r"\|\|\s*(true|:)\b", command), command
        assert ":-fs-" not in command and "fs-0000" not in command, "no placeholder default for the EFS id"
        assert "pip install" not in command, "the image has the project: no install at boot"


def _run(snippet: str, tmp_path: Path, env: dict, fail_mount: bool = False) -> subprocess.CompletedProcess:
    """Run a command of cluster.yaml as Ray runs it (bash, in a subshell), with the commands that touch the machine
    replaced by functions that record their arguments in `log` (`ray` with the auth mode and hub token it would
    start with; its `get-auth-token --generate` makes a token as Ray's does, once)."""
    log = tmp_path / "log"
    mount = "return 32" if fail_mount else f"touch {tmp_path / 'mounted'}"
    fakes = f"""
log={log}
sudo() {{ echo "sudo $*" >> $log; if [ "$1" = mount ]; then {mount}; fi; }}
mountpoint() {{ [ -e {tmp_path / 'mounted'} ]; }}
docker() {{ echo "docker $*" >> $log; }}
aws() {{ echo "aws $*" >> $log; echo password; }}
nvidia-smi() {{ return 1; }}
ray() {{ echo "ray $* [mode=${{RAY_AUTH_MODE:-}} hf=$(printenv HF_TOKEN)]" >> $log;
  if [ "$1" = get-auth-token ] && [ ! -s ~/.ray/auth_token ]; then
    mkdir -p ~/.ray; printf {HEAD_TOKEN} > ~/.ray/auth_token; fi; }}
"""
    return subprocess.run(["bash", "-c", f"{fakes}\n({snippet})"], capture_output=True, text=True, timeout=30,
                          env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), **env})


@pytest.mark.parametrize("variable", ["LAPSTUDY_EFS_ID"])
def test_mount_refuses_an_unset_efs_id_and_mounts_a_set_one(config, tmp_path, variable):
    snippet = _command(config, "initialization_commands", "mount -t nfs4")
    unset = _run(snippet, tmp_path, {k: v for k, v in SETTINGS.items() if k != variable})
    assert unset.returncode != 0
    assert variable in unset.stderr and "cluster.env" in unset.stderr
    assert not (tmp_path / "log").exists(), "nothing is mounted or created before the check"

    empty = _run(snippet, tmp_path, {**SETTINGS, variable: ""})
    assert empty.returncode != 0 and variable in empty.stderr

    failed = _run(snippet, tmp_path, SETTINGS, fail_mount=True)
    assert failed.returncode != 0 and "cannot mount EFS" in failed.stderr, "a failed mount stops the node"

    done = _run(snippet, tmp_path, SETTINGS)
    assert done.returncode == 0, done.stderr
    log = (tmp_path / "log").read_text()
    assert "sudo mount -t nfs4 -o nfsvers=4.1" in log
    assert f"{SETTINGS[variable]}.efs.us-west-2.amazonaws.com:/ /mnt/shared" in log


@pytest.mark.parametrize("variable", ["LAPSTUDY_IMAGE", "LAPSTUDY_IMAGE_TAG"])
def test_image_pull_refuses_an_unset_image_and_tags_the_pulled_one(config, tmp_path, variable):
    snippet = _command(config, "initialization_commands", "docker pull")
    unset = _run(snippet, tmp_path, {k: v for k, v in SETTINGS.items() if k != variable})
    assert unset.returncode != 0 and variable in unset.stderr and "cluster.env" in unset.stderr
    assert not (tmp_path / "log").exists()
    done = _run(snippet, tmp_path, SETTINGS)
    assert done.returncode == 0, done.stderr
    pulled = f"{SETTINGS['LAPSTUDY_IMAGE']}:{SETTINGS['LAPSTUDY_IMAGE_TAG']}-cpu"  # the fake host has no GPU
    assert f"docker pull {pulled}\ndocker tag {pulled} lapstudy-node:cpu" in (tmp_path / "log").read_text()


@pytest.mark.parametrize("variable", ["LAPSTUDY_MLFLOW_BACKEND_STORE_URI", "LAPSTUDY_MLFLOW_ARTIFACTS"])
def test_mlflow_server_refuses_an_unset_or_local_store(config, tmp_path, variable):
    snippet = _command(config, "head_start_ray_commands", "mlflow server")
    assert "--serve-artifacts" in snippet and '--artifacts-destination "$LAPSTUDY_MLFLOW_ARTIFACTS"' in snippet
    assert '--backend-store-uri "$LAPSTUDY_MLFLOW_BACKEND_STORE_URI"' in snippet
    unset = _run(snippet, tmp_path, {k: v for k, v in SETTINGS.items() if k != variable})
    assert unset.returncode != 0 and variable in unset.stderr
    local = {"LAPSTUDY_MLFLOW_BACKEND_STORE_URI": f"sqlite:///{tmp_path}/mlflow.db",
             "LAPSTUDY_MLFLOW_ARTIFACTS": str(tmp_path / "artifacts")}[variable]
    refused = _run(snippet, tmp_path, {**SETTINGS, variable: local})
    assert refused.returncode != 0 and variable in refused.stderr
    assert not (tmp_path / "mlflow").exists(), "the server is not started on a store that ray down deletes"


def test_the_head_gives_jobs_the_tracking_server(config):
    start = _command(config, "head_start_ray_commands", "ray start --head")
    assert f"; {cli.TRACKING_URI_VARIABLE}=http://$(hostname -I | cut -d' ' -f1):5000 ray start --head" in start
    mlflow = _command(config, "head_start_ray_commands", "mlflow server")
    assert '--host "$HEAD_IP" --port 5000' in mlflow


# --- lapstudy run refuses SQLite for a study across machines -------------------------------------------------------

def _mounts(tmp_path: Path, shared: Path, kind: str = "nfs4") -> str:
    table = tmp_path / "mounts"
    table.write_text(f"/dev/root / ext4 rw 0 0\nfs-1.efs.us-west-2.amazonaws.com:/ {shared} {kind} rw 0 0\n")
    return str(table)


def test_filesystem_type_reads_the_longest_mount_point(tmp_path, monkeypatch):
    shared = tmp_path / "shared"
    (shared / "studies").mkdir(parents=True)
    monkeypatch.setattr("study.cluster.MOUNTS_FILE", _mounts(tmp_path, shared))
    assert filesystem_type(shared / "studies" / "not-yet" / "mlflow.db") == "nfs4"
    assert filesystem_type(tmp_path) == "ext4"
    assert filesystem_type(Path(str(shared) + "-other")) == "ext4"


def test_refusal_rules(tmp_path, monkeypatch):
    shared = tmp_path / "shared"
    shared.mkdir()
    monkeypatch.setattr("study.cluster.MOUNTS_FILE", _mounts(tmp_path, shared))
    from study.errors import UserError

    # (tracking URI, storage) with the SQLite file on the shared filesystem, then on a local disk
    on_shared = [(None, shared), (f"sqlite:///{shared}/mlflow.db", tmp_path)]
    on_local = [(None, tmp_path), (f"sqlite:///{tmp_path}/mlflow.db", shared)]
    for uri, storage in on_shared:
        with pytest.raises(UserError, match="shared filesystem .nfs4.*--tracking-uri http://HEAD:5000"):
            check_tracking_store(uri, storage, "auto")  # joined cluster, store on NFS
        check_tracking_store(uri, storage, None)  # a local study on a network home folder: one machine
    for uri, storage in on_shared + on_local:
        with pytest.raises(UserError, match="2 machines"):
            check_tracking_store(uri, storage, "auto", hosts={"10.0.0.1", "10.0.0.2"})
    for uri, storage in on_local:
        check_tracking_store(uri, storage, "auto")  # a local disk, before Ray: the nodes' machines decide
        check_tracking_store(uri, storage, "auto", hosts={"127.0.0.1"})  # a simulated cluster on one machine
    check_tracking_store("http://10.0.0.1:5000", shared, "auto", hosts={"10.0.0.1", "10.0.0.2"})


def test_lapstudy_run_refuses_sqlite_on_a_shared_filesystem_for_a_cluster(tmp_path, monkeypatch, capfd):
    from fault_fixtures import tiny_space, write_space

    shared = tmp_path / "shared"
    shared.mkdir()
    monkeypatch.setattr("study.cluster.MOUNTS_FILE", _mounts(tmp_path, shared))
    monkeypatch.delenv(cli.TRACKING_URI_VARIABLE, raising=False)

    def refuse(*args, **kwargs):
        raise AssertionError("ray.init called: the refusal must come before Ray starts")

    monkeypatch.setattr(ray, "init", refuse)
    space = write_space(tmp_path / "space.yaml", tiny_space())
    code = cli.main(["run", str(space), "--address", "auto", "--storage", str(shared / "studies")])
    out, err = capfd.readouterr()
    assert code == 2 and out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "SQLite" in lines[0] and "--tracking-uri http://HEAD:5000" in lines[0], err
    assert not any(shared.iterdir()), "nothing written"


def test_every_workers_setup_hook_imports_nothing_heavier_than_ray(tmp_path, monkeypatch):
    """Each Ray worker process the study starts runs the hook `connect_ray` names: its module is imported there
    first, so it must not bring in MLflow, datasets or torch (seconds of start-up for every worker on 2 CPUs)."""
    from types import SimpleNamespace

    from study.cluster import connect_ray

    seen = {}

    def init(**kwargs):
        seen.update(kwargs)
        return SimpleNamespace(address_info={"session_dir": str(tmp_path / "session")})

    monkeypatch.setattr(ray, "init", init)
    monkeypatch.setattr(ray, "get_runtime_context", lambda: SimpleNamespace(gcs_address="127.0.0.1:6379"))
    monkeypatch.setattr("study.cluster.check_state_api", lambda where: None)  # no cluster to ask here
    monkeypatch.setenv("RAY_ADDRESS", "127.0.0.1:6379")  # restored after the test: the hook also runs here
    connect_ray(None, tmp_path)
    module, name = seen["runtime_env"]["worker_process_setup_hook"].rsplit(".", 1)
    assert callable(getattr(importlib.import_module(module), name))
    assert imported_with(module, ("mlflow", "datasets", "torch", "optuna")) == []


# --- what the driver hands its Ray workers -------------------------------------------------------------------------

CREDENTIALS = {"HF_TOKEN": "hf_jobToken0123456789", "MLFLOW_TRACKING_USERNAME": "user",
               "MLFLOW_TRACKING_PASSWORD": "pw", "MLFLOW_TRACKING_TOKEN": "tok", "AWS_SECRET_ACCESS_KEY": "aws",
               "AWS_ACCESS_KEY_ID": "AKIA", "AWS_SESSION_TOKEN": "session"}


def test_no_credential_travels_in_the_workers_runtime_environment(tmp_path, monkeypatch):
    """Ray shows a job's runtime environment to whoever reaches the dashboard: credentials stay out of it, the
    settings the workers need go in."""
    from study.cluster import worker_runtime_env

    for key, value in {**CREDENTIALS, "HF_HUB_OFFLINE": "1", "AWS_ENDPOINT_URL": "http://10.0.0.9:9000"}.items():
        monkeypatch.setenv(key, value)
    env_vars = worker_runtime_env(str(tmp_path), {})["env_vars"]
    assert not set(CREDENTIALS) & set(env_vars)
    assert not set(CREDENTIALS.values()) & set(env_vars.values())
    assert env_vars["HF_HUB_OFFLINE"] == "1" and env_vars["AWS_ENDPOINT_URL"] == "http://10.0.0.9:9000"


def test_a_job_that_sets_hf_token_in_its_runtime_environment_is_not_refused(tmp_path, monkeypatch):
    """`ray job submit --runtime-env-json '{"env_vars": {"HF_TOKEN": ...}}'`: the job's variables reach this
    process, and Ray merges the job's runtime environment with ray.init's, refusing any variable both set
    (ray.init's own merge, run here on what Ray's job supervisor hands the driver)."""
    import json

    from ray._private.runtime_env.constants import RAY_JOB_CONFIG_JSON_ENV_VAR
    from ray.runtime_env.runtime_env import _merge_runtime_env

    from study.cluster import job_runtime_env, worker_runtime_env

    job = {"env_vars": {"HF_TOKEN": CREDENTIALS["HF_TOKEN"], "HF_HOME": "/mnt/shared/hf", "HF_HUB_OFFLINE": "0"},
           "working_dir": "gcs://_ray_pkg_0123.zip"}
    monkeypatch.setenv(RAY_JOB_CONFIG_JSON_ENV_VAR, json.dumps({"runtime_env": job, "metadata": {}}))
    for key, value in job["env_vars"].items():  # the job supervisor starts the driver with them set
        monkeypatch.setenv(key, value)
    assert job_runtime_env() == job
    ours = worker_runtime_env(str(tmp_path), job_runtime_env())
    merged = _merge_runtime_env(job, ours)
    assert merged is not None, "Ray would refuse the merge"
    assert merged["env_vars"]["HF_HOME"] == "/mnt/shared/hf" and merged["working_dir"] == job["working_dir"]
    assert merged["worker_process_setup_hook"] == ours["worker_process_setup_hook"]
    monkeypatch.delenv(RAY_JOB_CONFIG_JSON_ENV_VAR)
    assert job_runtime_env() == {}  # outside a job, nothing to leave out
    assert _merge_runtime_env(job, worker_runtime_env(str(tmp_path), {})) is None  # the refusal this avoids


def test_a_refused_connection_shows_rays_whole_reason_without_the_jobs_values(tmp_path, monkeypatch):
    import json

    from ray._private.runtime_env.constants import RAY_JOB_CONFIG_JSON_ENV_VAR

    from study.cluster import connect_ray
    from study.errors import UserError

    token = CREDENTIALS["HF_TOKEN"]
    job = {"env_vars": {"HF_TOKEN": token}, "worker_process_setup_hook": "mine.setup"}
    monkeypatch.setenv(RAY_JOB_CONFIG_JSON_ENV_VAR, json.dumps({"runtime_env": job}))
    quoted = f"Failed to merge the Job's runtime env {job} with a ray.init's runtime env " + "x" * 400

    def init(**kwargs):
        raise ValueError(quoted + "\n because of a conflict.")

    monkeypatch.setattr(ray, "init", init)
    with pytest.raises(UserError) as info:
        connect_ray("auto", str(tmp_path))
    message = str(info.value)
    assert quoted.replace(token, "***") in message and message.endswith("because of a conflict.)")
    assert token not in message and "\n" not in message


def test_tune_warnings_reach_the_driver_output_without_trial_tracebacks(tmp_path, monkeypatch):
    """After connect_ray, Tune's warnings (that trials wait for resources) are emitted and workers' output is
    forwarded (log_to_driver); only the traceback Tune logs for each failed trial is dropped."""
    import logging
    from types import SimpleNamespace

    from study.cluster import connect_ray

    seen = {}
    monkeypatch.setattr(ray, "init", lambda **kwargs: seen.update(kwargs) or SimpleNamespace(
        address_info={"session_dir": str(tmp_path)}))
    monkeypatch.setattr("study.cluster.pin_ray_address", lambda: None)
    monkeypatch.setattr("study.cluster.check_state_api", lambda where: None)
    connect_ray(None, str(tmp_path))
    assert seen["log_to_driver"] is True
    warned = logging.getLogger("ray.tune.execution.insufficient_resources_manager")
    assert warned.isEnabledFor(logging.WARNING)
    controller = logging.getLogger("ray.tune.execution.tune_controller")
    record = controller.makeRecord(controller.name, logging.ERROR, __file__, 1, "Trial task failed for trial %s",
                                   ("t1",), None)
    assert controller.isEnabledFor(logging.ERROR) and not controller.filter(record)
    other = controller.makeRecord(controller.name, logging.WARNING, __file__, 1, "checkpointing failed", (), None)
    assert controller.filter(other)


# --- Ray's token authentication on the `ray up` path ---------------------------------------------------------------

def test_the_head_makes_rays_token_and_every_worker_joins_with_it(config, tmp_path):
    """The head makes the token once, starts with RAY_AUTH_MODE=token and writes the token into its copy of
    cluster.env (which the workers receive: the launcher syncs the head's copies of the file mounts); a worker saves
    it where Ray reads it and joins with token auth on; HF_TOKEN from cluster.env is in both nodes' environment."""
    head_home, worker_home = tmp_path / "head", tmp_path / "worker"
    head_home.mkdir(), worker_home.mkdir()
    settings = "".join(f"{key}={value}\n" for key, value in SETTINGS.items()) + "HF_TOKEN=hf_nodeToken0123\n"
    (head_home / "cluster.env").write_text(settings)
    head = _command(config, "head_start_ray_commands", "ray start --head")
    for _ in range(2):  # a restart (`ray up` again) keeps the token and writes it once
        done = _run(head, head_home, {})
        assert done.returncode == 0, done.stderr
    handed = (head_home / "cluster.env").read_text()
    assert handed == settings + f"RAY_AUTH_TOKEN={HEAD_TOKEN}\n"
    log = (head_home / "log").read_text().splitlines()
    assert log[0].startswith("ray get-auth-token --generate")
    starts = [line for line in log if line.startswith("ray start --head")]
    assert len(starts) == 2 and all("--num-cpus=0 " in line and line.endswith("[mode=token hf=hf_nodeToken0123]")
                                    for line in starts), starts

    worker = _command(config, "worker_start_ray_commands", "ray start --address")
    refused = _run(worker, worker_home, {"RAY_HEAD_IP": "10.0.0.5"})  # no cluster.env handed over
    assert refused.returncode != 0 and "RAY_AUTH_TOKEN" in refused.stderr
    assert not (worker_home / "log").exists(), "no ray start without the token"
    (worker_home / "cluster.env").write_text(handed)
    done = _run(worker, worker_home, {"RAY_HEAD_IP": "10.0.0.5"})
    assert done.returncode == 0, done.stderr
    token_file = worker_home / ".ray" / "auth_token"
    assert token_file.read_text() == HEAD_TOKEN and token_file.stat().st_mode & 0o077 == 0
    assert (worker_home / "log").read_text() == \
        "ray start --address=10.0.0.5:6379 --object-manager-port=8076 [mode=token hf=hf_nodeToken0123]\n"


def test_every_worker_node_type_launches_with_the_worker_instance_profile(config):
    """Ray's launcher gives its default role to the head only: a worker without an instance profile could not pull
    the image from ECR nor reach the study's bucket. The head checks, before anything starts, that it exists."""
    head_type = config["head_node_type"]
    for name, node_type in config["available_node_types"].items():
        profile = node_type["node_config"].get("IamInstanceProfile")
        assert profile == ({"Name": "lapstudy-head"} if name == head_type else {"Name": "lapstudy-worker"}), name
    (check,) = config["available_node_types"][head_type]["initialization_commands"]
    assert "aws iam get-instance-profile --instance-profile-name lapstudy-worker" in check
    docs = (REPO / "docs" / "cluster.md").read_text()
    for needed in ("lapstudy-worker", "lapstudy-head", "AmazonEC2ContainerRegistryReadOnly", "iam:PassRole",
                   "iam:GetInstanceProfile"):
        assert needed in docs, f"docs/cluster.md's one-time set-up does not say {needed}"


def test_the_workers_setup_hook_keeps_warnings_but_drops_ray_datas_idle_cpu_one():
    import logging

    from study.ray_address import quiet_library_logs

    quiet_library_logs()
    assert logging.getLogger("ray").getEffectiveLevel() == logging.WARNING
    dataset = logging.getLogger("ray.data.dataset")
    idle = dataset.makeRecord(dataset.name, logging.WARNING, __file__, 1, "Warning: The Ray cluster currently does not "
                              "have any available CPUs. The Dataset job will hang unless more CPUs are freed up.",
                              (), None)
    other = dataset.makeRecord(dataset.name, logging.WARNING, __file__, 1, "Ray Data's other warning", (), None)
    assert not dataset.filter(idle) and dataset.filter(other)
