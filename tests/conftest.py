import os

import pytest
import torch

# Without a GPU, Triton kernels run on the CPU through Triton's interpreter (that is how CI tests them). The
# variable must be set before any module imports triton, and conftest is imported before every test module.
# Importing torch does not import triton.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# Ray waits 30 s for a new head's GCS to publish its port; on a 2-core machine running two test workers' studies it
# took longer (the autoscaling test's head timed out so, twice in CI). Every Ray head the tests start, in this
# process or in a `lapstudy` subprocess, inherits the longer wait.
os.environ.setdefault("RAY_gcs_server_port_wait_time_s", "120")


# The order in which pytest-xdist hands out test modules (`make test`: --dist=loadfile --no-loadscope-reorder): the
# costliest first, so that on two workers the long Ray modules do not start last and leave one worker idle at the
# end (xdist's own order, by number of tests, gave them out last). A module's cost is the sum of the `seconds` its
# `slow` marks give (a module-level mark counts once: its studies are set up once), half a second for any other test.
FAST_TEST_S = 0.5


def _module_cost(items) -> float:
    module_marks = items[0].getparent(pytest.Module).own_markers
    cost = sum(mark.kwargs.get("seconds", 0) for mark in module_marks if mark.name == "slow")
    for item in items:
        own = [mark for mark in item.own_markers if mark.name == "slow"]
        cost += sum(mark.kwargs.get("seconds", 0) for mark in own) if own else FAST_TEST_S
    return cost


def pytest_collection_modifyitems(session, config, items):
    modules: dict[str, list] = {}
    for item in items:
        modules.setdefault(item.nodeid.split("::")[0], []).append(item)
    ordered = sorted(modules.values(), key=_module_cost, reverse=True)  # stable: ties keep pytest's order
    items[:] = [item for module in ordered for item in module]
