"""The study folder `<storage>/<name>/`: what lives where, and the record of how the study was started.

- Ray Tune's experiment state: what `--resume` restores, and what `status`, `export` and `sync` read;
- `mlflow.db` and `mlartifacts/`: the embedded MLflow store (unless the study logs to `--tracking-uri`);
- `space.yaml`: the space as given; `study.json`: how the study was started (`StudyRecord`);
- `trials/<trial_id>.yaml`: each trial's complete run config;
- `train/trial_<trial_id>/`: Ray Train's run of each trial, under a fixed name, with the checkpoints a restarted
  trial resumes from;
- `exported/`: what `lapstudy export` writes unless told otherwise.

A study in object storage (study/storage.py) is read and written through a local copy of that folder, Train's
checkpoints excepted: pulled before it is read, its own files pushed back when they change.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict

from study.errors import UserError, validate
from study.runspec import Resources
from study.space import SearchSpace, load_space
from study.storage import download, has_entries, is_remote, join, staging_folder, upload, write_text

STUDY_FILE, SPACE_FILE, TRIALS_DIR, TRAIN_DIR, EXPORT_DIR = "study.json", "space.yaml", "trials", "train", "exported"


class StudyRecord(BaseModel):
    """study.json: what a resumed study keeps, whatever the flags of the resume say."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    name: str
    space: str  # where the space file was when the study started
    created: str
    seed: int
    num_samples: int  # configurations; each runs once per seed of `seeds`
    seeds: list[int]  # the replicates' seeds
    max_concurrent: int | None
    resources: Resources
    worker_resources: dict[str, float] = {}
    # Trials train in their own process (study/resources.py: trains_in_trial); fixed at the start, so a resume
    # finds its checkpoints the way they were written (studies from before: in a Train worker group)
    trains_in_trial: bool = False
    tracking_uri: str  # without credentials
    experiment_id: str
    metric: list[str]
    mode: list[str]


def local_store(study_dir: Path) -> tuple[str, str]:
    """(tracking URI, artifact location) of the embedded default MLflow store: `mlflow.db` and `mlartifacts/` in the
    study folder (or in `lapstudy train`'s --storage)."""
    study_dir = Path(study_dir).resolve()
    return f"sqlite:///{study_dir / 'mlflow.db'}", (study_dir / "mlartifacts").as_uri()


@dataclass(frozen=True)
class StudyFolder:
    path: Path  # absolute; for a study in object storage, its local copy
    remote: str | None = None  # the study's URI in object storage

    @classmethod
    def at(cls, location: str, reading: bool = False) -> StudyFolder:
        """The study at `location`: an absolute local path or a URI (its local copy the driver's, or with `reading`
        one of its own for the commands that read a study, which may run beside the driver)."""
        if is_remote(location):
            return cls(staging_folder(location, "read" if reading else "work"), location.rstrip("/"))
        return cls(Path(location))

    @property
    def location(self) -> str:
        """Where the study is kept (what Ray Tune restores from)."""
        return self.remote or str(self.path)

    @property
    def name(self) -> str:
        return self.path.name

    @property
    def trials_dir(self) -> Path:
        return self.path / TRIALS_DIR

    @property
    def train_location(self) -> str:
        return join(self.location, TRAIN_DIR)

    def trial_config(self, trial_id: str) -> Path:
        return self.trials_dir / f"{trial_id}.yaml"

    def write_trial_config(self, trial_id: str, text: str) -> None:
        """From the trial's process, on any node: straight to storage."""
        write_text(join(self.location, TRIALS_DIR, f"{trial_id}.yaml"), text)

    def pull(self, *names: str) -> StudyFolder:
        """Replace the local copy with what storage holds, or only these files of it (a local study is its own
        copy). Never while a driver works on this copy: its Optuna journal is newer there."""
        if self.remote:
            if not names:
                shutil.rmtree(self.path, ignore_errors=True)
            download(self.remote, self.path, skip=frozenset({TRAIN_DIR}), only=frozenset(names))
        return self

    def push(self, *names: str) -> None:
        """Send these files or folders of the local copy to storage."""
        for name in names if self.remote else ():
            if (self.path / name).exists():
                upload(self.path / name, join(self.remote, name))

    def record(self) -> StudyRecord:
        path = self.path / STUDY_FILE
        if not path.is_file():
            raise UserError(f"{self.location}: not a study folder (no {STUDY_FILE}); give the folder `lapstudy run` "
                            "created")
        return validate(StudyRecord, json.loads(path.read_text()), prefix=f"{path}: ")

    def space(self) -> SearchSpace:
        """The space the study runs (its copy here, its dataset paths as read from where the original was)."""
        return load_space(self.path / SPACE_FILE, base=Path(self.record().space).parent)

    def check_new(self) -> None:
        if has_entries(self.location):
            raise UserError(f"study folder {self.location} already exists: pass --resume to continue that study, "
                            "or --name/--storage for a new one")

    def check_resume(self, space_path: Path, *, has_tune_state: bool, **flags: Any) -> StudyRecord:
        """The record of the study to resume; UserError if there is none, if the space is not the one it started
        with, or if one of `flags` (as `--num-samples=value`, None for not given) contradicts the record."""
        if not (self.path / STUDY_FILE).is_file() or not has_tune_state:
            raise UserError(f"--resume: {self.location} holds no study to resume (no {STUDY_FILE} or Ray experiment "
                            "state)")
        if (self.path / SPACE_FILE).read_bytes() != space_path.read_bytes():
            raise UserError(f"--resume: {space_path} differs from the space this study started with "
                            f"({self.path / SPACE_FILE}); resume with that file, or start a new study with --name")
        record = self.record()
        for flag, value in flags.items():
            stored = getattr(record, flag)
            if value is not None and value != stored:
                raise UserError(f"--{flag.replace('_', '-')}: this study was started with {stored}; --resume keeps it")
        return record

    def start(self, space_path: Path, record: StudyRecord) -> None:
        """Write the space and study.json of a new study (the folder exists)."""
        shutil.copyfile(space_path, self.path / SPACE_FILE)
        (self.path / STUDY_FILE).write_text(json.dumps(record.model_dump(mode="json"), indent=2) + "\n")
        self.push(SPACE_FILE, STUDY_FILE)
