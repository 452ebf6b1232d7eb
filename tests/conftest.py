import os

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
