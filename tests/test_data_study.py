"""Done-means of the data issue: the CIFAR-100 space runs unchanged (its dataset field untouched) against a local
parquet copy of the hub repository, through `lapstudy run`, offline."""

import os
import subprocess
import sys

import numpy as np
import pytest
import yaml
from data_fixtures import write_cifar100_mirror
from PIL import Image

from study.data.hub import MIRROR_ENV

SPACE = os.path.join(os.path.dirname(__file__), os.pardir, "search_spaces", "vit_cifar100_parquet.yaml")


@pytest.mark.slow
def test_cifar100_space_runs_against_a_local_parquet_copy_offline(tmp_path):
    rng = np.random.default_rng(0)
    rows = lambda n: [(Image.fromarray(rng.integers(0, 256, (32, 32, 3), dtype=np.uint8)), int(y))  # noqa: E731
                      for y in rng.integers(0, 100, n)]
    write_cifar100_mirror(tmp_path / "mirror", rows(64), rows(24))
    space = yaml.safe_load(open(SPACE))
    # only the budget shrinks; the dataset field is the shipped one
    space.update(epochs=1, num_samples=1, scheduler={"kind": "none"})
    space["fixed"].update(batch_size=16, warmup_epochs=0)
    path = tmp_path / "space.yaml"
    path.write_text(yaml.safe_dump(space))
    env = {**os.environ, "HF_HUB_OFFLINE": "1", MIRROR_ENV: str(tmp_path / "mirror")}
    cli = [sys.executable, "-c", "import sys; from study.cli import main; sys.exit(main())"]
    result = subprocess.run(cli + ["run", str(path), "--storage", str(tmp_path / "studies")], env=env,
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    status = subprocess.run(cli + ["status", str(tmp_path / "studies" / "vit_cifar100_parquet")], env=env,
                            capture_output=True, text=True, timeout=120)
    assert status.returncode == 0 and "val_acc" in status.stdout, status.stdout + status.stderr[-2000:]
