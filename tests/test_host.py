"""The in-process host (Ray Train's local mode) persists what Ray Train would: checkpoints under the run's folder in
Train's layout, the newest two kept, the newest found again by a restarted run, and every report sent to Tune with
the checkpoint's path, as TuneReportCallback sends a Train worker group's. The run's folder is a local one or in
object storage (an S3-compatible server), as Train's own would be."""

import uuid
from pathlib import Path

import pyarrow.fs
import pytest

import study.host
from servers import object_store  # noqa: F401 - the S3-compatible server, for the fixture below
from study.host import CHECKPOINTS_KEPT, InProcessHost, newest_checkpoint
from study.storage import filesystem, join, write_text


def _checkpoint_folder(tmp_path: Path, epoch: int) -> Path:
    folder = tmp_path / f"scratch_{epoch}"
    folder.mkdir()
    (folder / "state.pt").write_text(f"epoch {epoch}")
    (folder / "extra").mkdir()
    (folder / "extra" / "note.txt").write_text("beside the state")
    return folder


def _read(location: str) -> str:
    fs, path = filesystem(location)
    with fs.open_input_stream(path) as stream:
        return stream.read().decode()


def _entries(location: str) -> list[str]:
    fs, path = filesystem(location)
    return sorted(info.base_name for info in fs.get_file_info(pyarrow.fs.FileSelector(path, allow_not_found=True)))


@pytest.fixture(params=["local", "s3"])
def storage(request, tmp_path) -> str:
    if request.param == "local":
        return str(tmp_path / "storage")
    store = request.getfixturevalue("object_store")
    return join(store.bucket(f"host-{uuid.uuid4().hex[:12]}"), "studies")


@pytest.fixture
def to_tune(monkeypatch):
    sent = []
    monkeypatch.setattr(study.host.tune, "report", lambda metrics: sent.append(metrics))
    return sent


def test_checkpoints_persist_in_trains_layout_and_only_the_newest_are_kept(tmp_path, storage, to_tune):
    host = InProcessHost(join(storage, "trial_a"), to_tune=True)
    assert host.latest_checkpoint() is None  # a fresh run
    for epoch in range(1, 5):
        host.report({"epoch": epoch}, _checkpoint_folder(tmp_path, epoch))
    kept = _entries(host.run_folder)
    assert len(kept) == CHECKPOINTS_KEPT and all(name.startswith("checkpoint_") for name in kept)
    assert [_read(join(host.run_folder, name, "state.pt")) for name in kept] == ["epoch 3", "epoch 4"]
    assert _read(join(host.run_folder, kept[-1], "extra", "note.txt")) == "beside the state"
    # A restarted run under the same name resumes from the newest.
    again = InProcessHost(join(storage, "trial_a"), to_tune=True)
    with again.latest_checkpoint().as_directory() as folder:
        assert (Path(folder) / "state.pt").read_text() == "epoch 4"
    assert [m["epoch"] for m in to_tune] == [1, 2, 3, 4]
    assert to_tune[-1]["checkpoint_path"] == join(host.run_folder, kept[-1]) == newest_checkpoint(host.run_folder)


def test_reports_without_a_checkpoint_reach_tune_unchanged_and_persist_nothing(storage, to_tune):
    host = InProcessHost(join(storage, "trial_b"), to_tune=True)
    host.report({"epoch": 1, "val_acc": 0.5})
    assert to_tune == [{"epoch": 1, "val_acc": 0.5}]
    assert _entries(host.run_folder) == []


def test_outside_a_study_nothing_goes_to_tune(tmp_path, storage, to_tune):
    host = InProcessHost(join(storage, "run"), to_tune=False)
    host.report({"epoch": 1}, _checkpoint_folder(tmp_path, 1))
    assert to_tune == [] and newest_checkpoint(host.run_folder) is not None


def test_a_copy_cut_short_is_never_taken_for_the_newest(tmp_path, storage, to_tune):
    host = InProcessHost(join(storage, "run"), to_tune=False)
    host.report({"epoch": 1}, _checkpoint_folder(tmp_path, 1))
    # What a process killed mid-copy leaves: locally the staging folder with a later-named checkpoint inside it; in
    # object storage a later-named checkpoint whose state file never arrived.
    later = "checkpoint_9999-12-31_23-59-59.000000"
    write_text(join(host.run_folder, f".incomplete_{later}", "state.pt"), "cut short")
    write_text(join(host.run_folder, later, "extra", "note.txt"), "the state never came")
    with host.latest_checkpoint().as_directory() as folder:
        assert (Path(folder) / "state.pt").read_text() == "epoch 1"
