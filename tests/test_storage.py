"""Studies in object storage, against a real S3-compatible server (moto): the study folder's local copy pulled and
pushed as the driver and the reading commands need, a trial's record written straight to storage, and the mistakes
a user can make with `--storage s3://...` refused in one line before anything is started or written."""

from __future__ import annotations

import uuid

import pyarrow.fs
import pytest
import ray
import yaml

from fault_fixtures import tiny_space, write_space
from servers import object_store  # noqa: F401 - the S3-compatible server
from study import cli
from study.errors import UserError
from study.folder import SPACE_FILE, STUDY_FILE, TRAIN_DIR, StudyFolder
from study.storage import STAGING_VARIABLE, check_reachable, filesystem, is_remote, join, write_text


@pytest.fixture
def bucket(object_store, tmp_path, monkeypatch) -> str:
    monkeypatch.setenv(STAGING_VARIABLE, str(tmp_path / "staging"))
    return object_store.bucket(f"st-{uuid.uuid4().hex[:12]}")


def _files(location: str) -> dict[str, str]:
    fs, path = filesystem(location)
    infos = fs.get_file_info(pyarrow.fs.FileSelector(path, recursive=True, allow_not_found=True))
    found = {}
    for info in infos:
        if info.type == pyarrow.fs.FileType.File:
            with fs.open_input_stream(info.path) as stream:
                found[info.path[len(path) + 1:]] = stream.read().decode()
    return found


def test_locations():
    assert is_remote("s3://bucket/studies") and is_remote("gs://bucket") and not is_remote("/data/studies")
    assert not is_remote("file:///data") and not is_remote("studies")
    assert join("s3://bucket/studies", "name", "train") == "s3://bucket/studies/name/train"
    assert join("/data/studies", "name") == "/data/studies/name"


def test_a_missing_bucket_is_named(object_store):
    with pytest.raises(UserError, match="bucket 'no-such-bucket' not found"):
        check_reachable("s3://no-such-bucket/studies")


def test_the_local_copy_follows_storage(bucket, tmp_path):
    location = join(bucket, "studies", "s")
    folder = StudyFolder.at(location)
    assert folder.remote == location and folder.path == tmp_path / "staging" / "work" / "s3" / bucket[5:] / "studies/s"
    folder.check_new()  # nothing there yet
    write_text(join(location, STUDY_FILE), "{}")
    write_text(join(location, "trial_1", "result.json"), "{\"epoch\": 1}\n")
    write_text(join(location, TRAIN_DIR, "trial_1", "checkpoint_1", "state.pt"), "weights")
    with pytest.raises(UserError, match="already exists"):
        folder.check_new()
    folder.path.mkdir(parents=True)
    (folder.path / "stale.txt").write_text("from an earlier study")
    folder.pull()
    local = sorted(str(p.relative_to(folder.path)) for p in folder.path.rglob("*") if p.is_file())
    assert local == [STUDY_FILE, "trial_1/result.json"]  # replaced, checkpoints left in storage
    # A trial's record goes straight to storage (trials run on any node); a push sends the driver's files.
    folder.write_trial_config("t1", "lr: 0.1\n")
    (folder.path / SPACE_FILE).write_text("name: s\n")
    folder.push(SPACE_FILE, "not-there.txt")
    stored = _files(location)
    assert stored["trials/t1.yaml"] == "lr: 0.1\n" and stored[SPACE_FILE] == "name: s\n"
    assert not (folder.path / "trials").exists()
    # The reading commands' copy is their own: pulling it leaves the driver's as it was.
    (folder.path / "optuna.journal").write_text("newer than storage's")
    reader = StudyFolder.at(location, reading=True).pull()
    assert reader.path != folder.path and (reader.path / "trials" / "t1.yaml").read_text() == "lr: 0.1\n"
    assert (folder.path / "optuna.journal").read_text() == "newer than storage's"
    folder.pull(STUDY_FILE)  # only that file, nothing removed
    assert (folder.path / "optuna.journal").exists()


@pytest.fixture(autouse=True)
def _no_ray(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("ray.init called for a refused command line")

    monkeypatch.setattr(ray, "init", refuse)


def _refused(argv: list[str], capsys) -> str:
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("lapstudy: error:"), err
    return err


def test_object_storage_without_a_tracking_server_is_refused(bucket, tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("LAPSTUDY_TRACKING_URI", raising=False)
    space = write_space(tmp_path / "s.yaml", tiny_space(name="s"))
    err = _refused(["run", str(space), "--storage", join(bucket, "studies")], capsys)
    assert "--storage s3://" in err and "--tracking-uri" in err
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump({"task": "classification", "dataset": {"source": "digits"}, "epochs": 1,
                                      "seed": 0, "hyperparameters": {"preset": "vit_tiny_digits"}}))
    err = _refused(["train", str(config), "--storage", join(bucket, "retrain")], capsys)
    assert "--storage s3://" in err and "--tracking-uri" in err
    assert _files(bucket) == {}  # nothing written


def test_a_missing_bucket_is_refused_by_every_command(object_store, tmp_path, capsys):
    space = write_space(tmp_path / "s.yaml", tiny_space(name="s"))
    err = _refused(["run", str(space), "--storage", "s3://absent-bucket/studies", "--tracking-uri",
                    "http://127.0.0.1:9"], capsys)
    assert "--storage s3://absent-bucket/studies" in err and "not found" in err
    for command in ("status", "export", "report", "sync"):
        err = _refused([command, "s3://absent-bucket/studies/s"], capsys)
        assert "STUDY_DIR s3://absent-bucket/studies/s" in err and "not found" in err and "--storage" not in err


def test_a_location_that_holds_no_study_is_named(bucket, capsys):
    err = _refused(["status", join(bucket, "studies", "nothing")], capsys)
    assert "not a study folder" in err
