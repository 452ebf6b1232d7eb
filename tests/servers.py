"""Real servers the cluster path runs against, started by the tests: an S3-compatible object store (moto's server
mode) and PostgreSQL (Debian's package), each on a free local port and stopped with the test session."""

from __future__ import annotations

import glob
import os
import pwd
import shutil
import subprocess
import sys
import tempfile
import urllib.request
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest

from fault_fixtures import free_port, wait_for


@dataclass(frozen=True)
class ObjectStore:
    endpoint: str

    @property
    def env(self) -> dict[str, str]:
        """What points pyarrow (Ray's storage), boto3 and MLflow's artifact store at this server."""
        return {"AWS_ENDPOINT_URL": self.endpoint, "MLFLOW_S3_ENDPOINT_URL": self.endpoint,
                "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}

    def bucket(self, name: str) -> str:
        import boto3

        boto3.client("s3", endpoint_url=self.endpoint, region_name="us-east-1", aws_access_key_id="testing",
                     aws_secret_access_key="testing").create_bucket(Bucket=name)
        return f"s3://{name}"


@pytest.fixture(scope="session")
def object_store(tmp_path_factory):
    """An S3-compatible server (moto) for the session, this process's pyarrow and boto3 pointed at it."""
    with s3_server(tmp_path_factory.mktemp("moto") / "moto.log") as store:
        saved = {key: os.environ.get(key) for key in store.env}
        os.environ.update(store.env)
        try:
            yield store
        finally:
            for key, value in saved.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value


@contextmanager
def s3_server(log: Path):
    port = free_port()
    with open(log, "ab") as out:
        process = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                                   stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    store = ObjectStore(f"http://127.0.0.1:{port}")

    def up() -> bool:
        assert process.poll() is None, f"moto server exited: {log.read_text()[-3000:]}"
        try:
            with urllib.request.urlopen(f"{store.endpoint}/moto-api/", timeout=2):
                return True
        except OSError:
            return False

    try:
        wait_for(up, 60, "the S3-compatible server (moto)", every=0.3)
        yield store
    finally:
        process.kill()
        process.wait(30)


def _postgres_bin(tool: str) -> str:
    # Debian keeps the server's tools per version (/usr/bin has wrappers that want a configured cluster)
    found = next(iter(sorted(glob.glob(f"/usr/lib/postgresql/*/bin/{tool}"), reverse=True)), None) or shutil.which(tool)
    assert found, f"PostgreSQL's {tool} not found: install Debian's postgresql package (.ci/run does)"
    return found


@contextmanager
def postgres_server(database: str = "mlflow"):
    """A PostgreSQL cluster in a fresh folder, trusting local connections as user `lapstudy`; yields the URI of
    `database` in it. PostgreSQL refuses to run as root: as root, the server runs as Debian's `postgres` user."""
    folder = Path(tempfile.mkdtemp(prefix="lapstudy-pg-"))
    as_user: list[str] = []
    if os.geteuid() == 0:
        owner = pwd.getpwnam("postgres")
        os.chown(folder, owner.pw_uid, owner.pw_gid)
        as_user = ["runuser", "-u", "postgres", "--"]
    data, port = folder / "data", free_port()

    def run(*command: str) -> None:
        subprocess.run([*as_user, *command], check=True, capture_output=True, timeout=120)

    run(_postgres_bin("initdb"), "-D", str(data), "-U", "lapstudy", "-A", "trust", "--no-sync")
    run(_postgres_bin("pg_ctl"), "-D", str(data), "-l", str(folder / "server.log"), "-w", "-t", "60", "-o",
        f"-p {port} -c listen_addresses=127.0.0.1 -k {folder} -c fsync=off", "start")
    try:
        run(_postgres_bin("createdb"), "-h", "127.0.0.1", "-p", str(port), "-U", "lapstudy", database)
        yield f"postgresql://lapstudy@127.0.0.1:{port}/{database}"
    finally:
        subprocess.run([*as_user, _postgres_bin("pg_ctl"), "-D", str(data), "-m", "immediate", "stop"],
                       capture_output=True, timeout=60)
        shutil.rmtree(folder, ignore_errors=True)
