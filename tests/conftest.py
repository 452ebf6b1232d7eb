import os

# Triton kernels run on the CPU through Triton's interpreter in CI; the variable must be set before any module
# imports triton, and conftest is imported before every test module.
os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
