"""Shared fixtures of the data tests: one local Ray instance for all of them (imported by tests/test_data_*.py)."""

import os
import tempfile

import pytest

from fault_fixtures import free_port
from study.ray_address import SETUP_HOOK


@pytest.fixture
def ray_local():
    """A 2-CPU local Ray instance shared by the data tests: reused when one is running (whoever started it), started
    again when another test shut it down; Ray shuts it down at exit."""
    import ray

    if not ray.is_initialized():
        temp_dir = tempfile.mkdtemp(prefix="lsd", dir="/tmp")  # short: Ray's socket paths have a length limit
        # As `lapstudy` starts its cluster, so that Train's placement-group cleaner asks this cluster, not another
        # on the machine, whether a trial's controller is alive: the setup hook points Ray's State API at this GCS,
        # and the dashboard serves that API. Without one, this GCS still names 127.0.0.1:8265, where another
        # cluster's dashboard answers that the controller does not exist, and the cleaner removes a live trial's
        # placement group (seen when another test worker's study ran beside the data tests).
        ray.init(num_cpus=2, include_dashboard=True, dashboard_port=free_port(), _temp_dir=temp_dir,
                 log_to_driver=False, runtime_env={"worker_process_setup_hook": SETUP_HOOK})
        ray.data.DataContext.get_current().enable_progress_bars = False
    return ray


def write_cifar100_mirror(root, train_rows, test_rows):
    """A local copy of the uoft-cs/cifar100 hub repository layout (card with configs, parquet written by
    `datasets` with its Image and ClassLabel features) under root/uoft-cs/cifar100, from (PIL image, label) rows."""
    import datasets

    repo = root / "uoft-cs" / "cifar100"
    os.makedirs(repo / "cifar100", exist_ok=True)
    features = datasets.Features({
        "img": datasets.Image(),
        "fine_label": datasets.ClassLabel(num_classes=100),
        "coarse_label": datasets.ClassLabel(num_classes=20),
    })
    for split, rows in (("train", train_rows), ("test", test_rows)):
        ds = datasets.Dataset.from_dict(
            {"img": [img for img, _ in rows], "fine_label": [y for _, y in rows], "coarse_label": [0] * len(rows)},
            features=features,
        )
        ds.to_parquet(str(repo / "cifar100" / f"{split}-00000-of-00001.parquet"))
    (repo / "README.md").write_text(
        "---\nconfigs:\n- config_name: cifar100\n  data_files:\n  - split: train\n    path: cifar100/train-*\n"
        "  - split: test\n    path: cifar100/test-*\n---\n"
    )
    return repo
