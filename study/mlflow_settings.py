"""How the MLflow client of every lapstudy process behaves, where the user has not set otherwise (MLflow reads these
variables at each call). Applied where a command or a trial's run starts, never on import: `lapstudy`'s entry point
and the worker's run logger (study/tracking/run_logger.py `RunLogger`). Its own module so that the entry point sets them
without importing MLflow."""

from __future__ import annotations

import os

MLFLOW_CLIENT_SETTINGS = {
    # Fail fast instead of MLflow's default of 7 retries with exponential back-off (minutes per call on a dead server).
    "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2",
    "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
    "MLFLOW_HTTP_REQUEST_TIMEOUT": "15",
    "MLFLOW_DISABLE_TELEMETRY": "true",
    # MLflow prints "View run ... at: <tracking URI>" when a run ends: noise, and a leak of credentials in the URI.
    "MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT": "true",
}


def use_mlflow_client_settings() -> None:
    """Give this process MLFLOW_CLIENT_SETTINGS; the variables the user set are kept."""
    for key, value in MLFLOW_CLIENT_SETTINGS.items():
        os.environ.setdefault(key, value)
