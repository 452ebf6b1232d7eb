"""The in-process host (Ray Train's local mode) persists what Ray Train would: checkpoints under the run's folder in
Train's layout, the newest two kept, the newest found again by a restarted run, and every report sent to Tune with
the checkpoint's path, as TuneReportCallback sends a Train worker group's."""

from pathlib import Path

import pytest

import study.host
from study.host import CHECKPOINTS_KEPT, InProcessHost, newest_checkpoint


def _checkpoint_folder(tmp_path: Path, epoch: int) -> Path:
    folder = tmp_path / f"scratch_{epoch}"
    folder.mkdir()
    (folder / "state.pt").write_text(f"epoch {epoch}")
    return folder


@pytest.fixture
def to_tune(monkeypatch):
    sent = []
    monkeypatch.setattr(study.host.tune, "report", lambda metrics: sent.append(metrics))
    return sent


def test_checkpoints_persist_in_trains_layout_and_only_the_newest_are_kept(tmp_path, to_tune):
    host = InProcessHost(tmp_path / "storage" / "trial_a", to_tune=True)
    assert host.latest_checkpoint() is None  # a fresh run
    for epoch in range(1, 5):
        host.report({"epoch": epoch}, _checkpoint_folder(tmp_path, epoch))
    kept = sorted(p.name for p in host.run_folder.iterdir())
    assert len(kept) == CHECKPOINTS_KEPT and all(name.startswith("checkpoint_") for name in kept)
    assert [(host.run_folder / name / "state.pt").read_text() for name in kept] == ["epoch 3", "epoch 4"]
    # A restarted run under the same name resumes from the newest.
    again = InProcessHost(tmp_path / "storage" / "trial_a", to_tune=True)
    with again.latest_checkpoint().as_directory() as folder:
        assert (Path(folder) / "state.pt").read_text() == "epoch 4"
    assert [m["epoch"] for m in to_tune] == [1, 2, 3, 4]
    assert to_tune[-1]["checkpoint_path"] == str(host.run_folder / kept[-1])


def test_reports_without_a_checkpoint_reach_tune_unchanged_and_persist_nothing(tmp_path, to_tune):
    host = InProcessHost(tmp_path / "trial_b", to_tune=True)
    host.report({"epoch": 1, "val_acc": 0.5})
    assert to_tune == [{"epoch": 1, "val_acc": 0.5}]
    assert not host.run_folder.exists()


def test_outside_a_study_nothing_goes_to_tune(tmp_path, to_tune):
    host = InProcessHost(tmp_path / "run", to_tune=False)
    host.report({"epoch": 1}, _checkpoint_folder(tmp_path, 1))
    assert to_tune == [] and newest_checkpoint(host.run_folder) is not None


def test_a_copy_cut_short_is_never_taken_for_the_newest(tmp_path, to_tune):
    host = InProcessHost(tmp_path / "run", to_tune=False)
    host.report({"epoch": 1}, _checkpoint_folder(tmp_path, 1))
    # What a process killed mid-copy leaves: the staging folder, with a later-named checkpoint inside it.
    staging = host.run_folder / ".incomplete_x" / "checkpoint_9999-12-31_23-59-59.000000"
    staging.mkdir(parents=True)
    with host.latest_checkpoint().as_directory() as folder:
        assert (Path(folder) / "state.pt").read_text() == "epoch 1"
