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


@pytest.fixture(scope="session")
def object_store(tmp_path_factory):
    """An S3-compatible server (moto) for the session, this process's pyarrow and boto3 pointed at it."""
    from servers import s3_server

    with s3_server(tmp_path_factory.mktemp("moto") / "moto.log") as store:
        saved = {key: os.environ.get(key) for key in store.env}
        os.environ.update(store.env)
        try:
            yield store
        finally:
            for key, value in saved.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value
