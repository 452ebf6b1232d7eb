"""Shared fixtures of the data tests: one local Ray instance for all of them (imported by tests/test_data_*.py)."""

import os
import tempfile

import pytest


@pytest.fixture(scope="session")
def ray_local():
    """A 2-CPU local Ray instance shared by every data test; reused when another fixture already started one."""
    import ray

    if ray.is_initialized():
        yield ray
        return
    temp_dir = tempfile.mkdtemp(prefix="lsd", dir="/tmp")  # short: Ray's socket paths have a length limit
    os.environ.setdefault("RAY_DATA_DISABLE_PROGRESS_BARS", "1")
    ray.init(num_cpus=2, include_dashboard=False, _temp_dir=temp_dir, log_to_driver=False)
    ray.data.DataContext.get_current().enable_progress_bars = False
    yield ray
    ray.shutdown()
