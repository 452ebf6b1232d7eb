import os

import torch

# Without a GPU, Triton kernels run on the CPU through Triton's interpreter (that is how CI tests them). The
# variable must be set before any module imports triton, and conftest is imported before every test module.
# Importing torch does not import triton.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
