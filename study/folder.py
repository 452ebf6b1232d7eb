"""The study folder `<storage>/<name>/`: what lives where, and the record of how the study was started.

- Ray Tune's experiment state: what `--resume` restores, and what `status`, `export` and `sync` read;
- `mlflow.db` and `mlartifacts/`: the embedded MLflow store (unless the study logs to `--tracking-uri`);
- `space.yaml`: the space as given; `study.json`: how the study was started (`StudyRecord`);
- `trials/<trial_id>.yaml`: each trial's complete run config;
- `train/trial_<trial_id>/`: Ray Train's run of each trial, under a fixed name, with the checkpoints a restarted
  trial resumes from;
- `exported/`: what `lapstudy export` writes unless told otherwise.
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

STUDY_FILE, SPACE_FILE, TRIALS_DIR, TRAIN_DIR, EXPORT_DIR = "study.json", "space.yaml", "trials", "train", "exported"


class StudyRecord(BaseModel):
    """study.json: what a resumed study keeps, whatever the flags of the resume say."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    name: str
    space: str  # where the space file was when the study started
    created: str
    seed: int
    num_samples: int  # configurations; each runs once per seed of `seeds`
    seeds: list[int] | None = None  # the replicates' seeds (None in studies started before replicates: [seed])
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


@dataclass(frozen=True)
class StudyFolder:
    path: Path  # absolute

    @property
    def name(self) -> str:
        return self.path.name

    @property
    def trials_dir(self) -> Path:
        return self.path / TRIALS_DIR

    @property
    def train_dir(self) -> Path:
        return self.path / TRAIN_DIR

    def trial_config(self, trial_id: str) -> Path:
        return self.trials_dir / f"{trial_id}.yaml"

    def record(self) -> StudyRecord:
        path = self.path / STUDY_FILE
        if not path.is_file():
            raise UserError(f"{self.path}: not a study folder (no {STUDY_FILE}); give the folder `lapstudy run` "
                            "created")
        return validate(StudyRecord, json.loads(path.read_text()), prefix=f"{path}: ")

    def space(self) -> SearchSpace:
        """The space the study runs (its copy here, its dataset paths as read from where the original was)."""
        return load_space(self.path / SPACE_FILE, base=Path(self.record().space).parent)

    def check_new(self) -> None:
        if self.path.exists() and any(self.path.iterdir()):
            raise UserError(f"study folder {self.path} already exists: pass --resume to continue that study, "
                            "or --name/--storage for a new one")

    def check_resume(self, space_path: Path, *, has_tune_state: bool, **flags: Any) -> StudyRecord:
        """The record of the study to resume; UserError if there is none, if the space is not the one it started
        with, or if one of `flags` (as `--num-samples=value`, None for not given) contradicts the record."""
        if not (self.path / STUDY_FILE).is_file() or not has_tune_state:
            raise UserError(f"--resume: {self.path} holds no study to resume (no {STUDY_FILE} or Ray experiment state)")
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
